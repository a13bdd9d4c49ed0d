"""Muon + AdamW without the Trainer: `route_parameters` and `lightning_muon.Muon` in a Lightning Fabric loop.

Fabric takes both optimizers as they are (``fabric.setup(model, muon, adamw)``); route before ``setup``, so
the names in the table are the model's own. Nothing is downloaded: a small embedding + MLP model learns a
synthetic task in a few seconds on a CPU.

    python -m lightning_muon.examples.fabric_loop
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.nn import functional as F

from lightning_muon import Muon, route_parameters


def make_model() -> nn.Module:
    """Token embedding (AdamW), two hidden matrices (Muon), an output head (AdamW)."""
    return nn.Sequential(
        nn.Embedding(16, 32), nn.Flatten(), nn.Linear(8 * 32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
        nn.Linear(128, 16),
    )


def train(steps: int = 100, seed: int = 0, fabric: Fabric | None = None) -> list[float]:
    """Train for ``steps`` updates; the training loss of every step."""
    fabric = fabric or Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(seed)
    model = make_model()
    routing = route_parameters(model)  # before setup: who goes where, and why (print(routing))
    fabric.print(routing)
    muon = Muon(routing.muon_groups, lr=0.02, momentum=0.95, weight_decay=0.01)
    adamw = torch.optim.AdamW(routing.adamw_groups, lr=3e-3, betas=(0.9, 0.95))
    model, muon, adamw = fabric.setup(model, muon, adamw)

    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(16, (512, 8), generator=generator)
    y = (x[:, 0] + x[:, 1]) % 16  # the sum of the first two tokens, mod 16
    losses = []
    for _ in range(steps):
        batch = torch.randint(len(x), (64,), generator=generator)
        inputs, targets = fabric.to_device((x[batch], y[batch]))
        loss = F.cross_entropy(model(inputs), targets)
        fabric.backward(loss)
        for optimizer in (muon, adamw):
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    losses = train(args.steps)
    print(f"Fabric, Muon + AdamW: training loss {losses[0]:.3f} at step 1, {losses[-1]:.3f} after {len(losses)} steps")


if __name__ == "__main__":
    main()
