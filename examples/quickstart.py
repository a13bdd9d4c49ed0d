"""Quickstart: route a model's parameters, train it with Muon + AdamW, compare with AdamW alone.

A plain PyTorch loop on scikit-learn's bundled 8x8 digits (offline, seconds on
a laptop CPU). It shows the three core pieces: `route_parameters` (who goes
where and why), `lightning_muon.Muon` on the hidden matrices, and the
orthogonality diagnostics of the update it made.

    python -m lightning_muon.examples.quickstart     (needs scikit-learn)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F

from lightning_muon import Muon
from lightning_muon.examples._extras import sklearn_digits
from lightning_muon.routing import ADAMW, MUON, route_parameters


def digits(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """scikit-learn's 1,797 digits, scaled to [0, 1], split 80/20 deterministically."""
    data = sklearn_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(x))
    return x[order[:split]], y[order[:split]], x[order[split:]], y[order[split:]]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
        nn.Linear(256, 10),
    )


def train(use_muon: bool, steps: int, seed: int = 0) -> tuple[float, float, Muon | None]:
    """Train for ``steps`` minibatches; returns (test loss, test accuracy, the Muon optimizer)."""
    torch.manual_seed(seed)
    x, y, x_test, y_test = digits(seed)
    model = make_model()
    if use_muon:
        routing = route_parameters(model)
        muon = Muon(routing.groups(MUON), lr=0.02, momentum=0.95, weight_decay=0.01)
        optimizers = [muon, torch.optim.AdamW(routing.groups(ADAMW), lr=3e-3, betas=(0.9, 0.95))]
    else:
        muon = None
        optimizers = [torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))]
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = torch.randint(len(x), (64,), generator=generator)
        loss = F.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        if muon is not None and step == steps - 1:
            muon.record_diagnostics()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        logits = model(x_test)
        return F.cross_entropy(logits, y_test).item(), (logits.argmax(-1) == y_test).float().mean().item(), muon


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)

    print(route_parameters(make_model()).render(width=110))
    muon_loss, muon_acc, muon = train(use_muon=True, steps=args.steps)
    assert muon is not None
    adamw_loss, adamw_acc, _ = train(use_muon=False, steps=args.steps)
    print(f"after {args.steps} steps on sklearn digits (test split):")
    print(f"  Muon + AdamW : loss {muon_loss:.4f}  accuracy {muon_acc:.3f}")
    print(f"  AdamW alone  : loss {adamw_loss:.4f}  accuracy {adamw_acc:.3f}")
    print("orthogonality error of the last Muon update (0 = orthogonal; about 0.3 by design on well-conditioned "
          "momentum, higher when it is nearly low-rank):")
    for d in muon.diagnostics:
        print(f"  {d.name:10s} {d.shape!s:12s} error {d.orthogonality_error.item():.3f}  "
              f"update RMS {d.update_rms.item():.2e}  effective lr {d.effective_lr:.3g}")


if __name__ == "__main__":
    main()
