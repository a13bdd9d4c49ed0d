"""Degenerate hidden matrices (one side 1 to 4) on Muon or on AdamW: which trains better?

Muon's update of a matrix with one side r <= 4 has at most r singular directions: for a 1 x n row it is the
gradient direction normalised to unit length (every singular value set to one), a normalised step, not an
orthogonalisation in any useful sense. This measures whether such matrices train better on Muon or on AdamW.

The model is an MLP on scikit-learn's digits (64 pixels -> 128 -> 128 -> k -> 128 -> 10) with a bottleneck
of width k in {1, 2, 4}: its matrices of shape k x 128 and 128 x k are the degenerate ones. Its input layer
and head are on AdamW and its 128 x 128 matrix on Muon in both settings: only the degenerate matrices move.
Tanh activations (a ReLU bottleneck of width 1 or 2 dies in some seeds, whatever the optimizer).
The optimizers are `MuonMixin`'s defaults (Muon lr 0.02, momentum 0.95, weight decay 0.01, Newton-Schulz in float32
here, as bf16 matmuls are slow on CPUs; AdamW lr 3e-4, betas (0.9, 0.95)), stepped by plain PyTorch for
`--steps` updates of batch 128; the figure is the test cross-entropy at the end (lower is better), per seed.

    python benchmarks/degenerate.py             # prints a markdown table
    python benchmarks/degenerate.py --write     # also writes results/degenerate.md and its RESULTS.md section
"""

from __future__ import annotations

import argparse
import statistics

import torch
from sklearn.datasets import load_digits
from torch import nn

from lightning_muon import Muon
from lightning_muon.routing import route_parameters

import _common
import _report


def data() -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=generator)
    test, train = order[:400], order[400:]
    return x[train], y[train], x[test], y[test]


def model(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, width),
                         nn.Tanh(), nn.Linear(width, 128), nn.Tanh(), nn.Linear(128, 10))


def train(width: int, degenerate_on: str, seed: int, steps: int) -> float:
    x, y, x_test, y_test = data()
    torch.manual_seed(seed)
    net = model(width)
    adamw_params = ["0.weight", "8.weight"] + ([] if degenerate_on == "Muon" else ["4.weight", "6.weight"])
    routing = route_parameters(net, adamw_params=adamw_params)
    optimizers = [torch.optim.AdamW(routing.adamw_groups, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)]
    optimizers.append(Muon(routing.muon_groups, lr=0.02, momentum=0.95, weight_decay=0.01, ns_dtype=torch.float32))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(0, len(x), (128,), generator=generator)
        loss = nn.functional.cross_entropy(net(x[index]), y[index])
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        return float(nn.functional.cross_entropy(net(x_test), y_test))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for width in (1, 2, 4):
        results = {}
        for where in ("Muon", "AdamW"):
            results[where] = [train(width, where, seed, args.steps) for seed in range(args.seeds)]
        means = {k: statistics.mean(v) for k, v in results.items()}
        better = min(means, key=means.__getitem__)
        cells = [", ".join(f"{v:.3f}" for v in results[k]) + f" (mean {means[k]:.3f})" for k in ("Muon", "AdamW")]
        rows.append(f"| {width} | {width}x128, 128x{width} | {cells[0]} | {cells[1]} | {better} |")
        print(rows[-1], flush=True)
    report = "\n".join([
        "# Degenerate hidden matrices: Muon or AdamW", "",
        f"`python benchmarks/degenerate.py --steps {args.steps} --seeds {args.seeds}`; {_common.machine()}", "",
        "Test cross-entropy on digits after the updates, per seed (lower is better):", "",
        "| bottleneck k | degenerate matrices | on Muon | on AdamW | lower |", "|---|---|---|---|---|", *rows, "",
    ])
    print("\n" + report)
    if args.write:
        _report.write_markdown("degenerate", report)


if __name__ == "__main__":
    main()
