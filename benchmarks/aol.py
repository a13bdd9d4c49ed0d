"""How orthogonal Newton-Schulz's output is with Turbo-Muon's AOL preconditioning, against today's default.

Each orthogonalisation is scored by the singular values ``s`` of its output: the mean and the worst ``|s - 1|``
(0 for the exact polar factor ``U V^T``). The variants, each at 4 and 5 steps, by `zeropower_via_newtonschulz`:

- ``default``: today's iteration (Frobenius normalisation, Keller Jordan's coefficients);
- ``AOL``: ``ns_precondition="aol"`` with the default coefficients;
- ``turbo``: ``ns_coefficients="turbo_muon"`` (the paper's coefficients) after the Frobenius normalisation,
  to tell the coefficients' share from AOL's;
- ``AOL+turbo``: ``ns_precondition="aol", ns_coefficients="turbo_muon"``, the pairing of the paper's code.

The matrices are gradient-like: ``L R / sqrt(16) + noise * N`` with ``L``, ``R`` Gaussian factors of rank 16 and
``N`` Gaussian noise, at three noise levels (the smaller the noise, the wider the spread of singular values), 3
seeds each; and the real Muon input of ``benchmarks/newton_schulz_spectrum.py`` (the shipped GPT's
``blocks.1.mlp.fc.weight``, 512 x 128, after 50 updates). Mean: over the seeds' singular values; worst: over all.

    python benchmarks/aol.py           # prints the tables
    python benchmarks/aol.py --write   # and writes benchmarks/results/aol.md
"""

from __future__ import annotations

import argparse
import logging

import newton_schulz_spectrum
import torch
from rich.table import Table

from lightning_muon import zeropower_via_newtonschulz
from lightning_muon.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS

import _common
import _report

RANK = 16
NOISES = (0.3, 0.1, 0.03)
SEEDS = (0, 1, 2)
#: (label, shape): square, tall 3:1 (the Gram path's aspect in Muon), wide 1:4, and a stack of 4.
SHAPES = [("256x256", (256, 256)), ("768x256", (768, 256)), ("256x1024", (256, 1024)), ("4x128x512", (4, 128, 512))]
#: (label, ns_coefficients, ns_precondition).
VARIANTS = [
    ("default", DEFAULT_NS_COEFFICIENTS, None),
    ("AOL", DEFAULT_NS_COEFFICIENTS, "aol"),
    ("turbo", "turbo_muon", None),
    ("AOL+turbo", "turbo_muon", "aol"),
]
STEPS = (4, 5)
DTYPES = (torch.float32, torch.bfloat16)


def gradient_like(shape: tuple[int, ...], noise: float, seed: int) -> torch.Tensor:
    """A low-rank product of Gaussian factors plus Gaussian noise."""
    generator = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    low = torch.randn(*batch, m, RANK, generator=generator) @ torch.randn(*batch, RANK, n, generator=generator)
    return low / RANK**0.5 + noise * torch.randn(*batch, m, n, generator=generator)


def deviations(G: torch.Tensor, coefficients, precondition: str | None, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """``|s - 1|`` of every singular value of the output, all matrices of the stack together."""
    out = zeropower_via_newtonschulz(G, ns_coefficients=coefficients, ns_steps=steps, dtype=dtype,
                                     ns_precondition=precondition)
    return (torch.linalg.svdvals(out.double()) - 1).abs().flatten()


def score(matrices: list[torch.Tensor], dtype: torch.dtype) -> list[str]:
    """One ``mean / worst`` cell per variant and step count."""
    cells = []
    for _, coefficients, precondition in VARIANTS:
        for steps in STEPS:
            found = torch.cat([deviations(G, coefficients, precondition, steps, dtype) for G in matrices])
            cells.append(f"{found.mean():.3f}/{found.max():.3f}")
    return cells


def table(dtype: torch.dtype, rows: list[tuple[str, list[torch.Tensor]]]) -> Table:
    name = str(dtype).removeprefix("torch.")
    result = Table(title=f"mean / worst |singular value - 1| after Newton-Schulz in {name}")
    result.add_column("matrices")
    for label, _, _ in VARIANTS:
        for steps in STEPS:
            result.add_column(f"{label} {steps}", justify="right")
    for label, matrices in rows:
        result.add_row(label, *score(matrices, dtype))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/aol.md")
    args = parser.parse_args(argv)
    logging.getLogger("lightning_muon").setLevel(logging.WARNING)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = [(f"{label}, {noise}", [gradient_like(shape, noise, seed) for seed in SEEDS])
            for noise in NOISES for label, shape in SHAPES]
    rows.append(("GPT 512x128", [newton_schulz_spectrum.muon_update()]))
    tables = [table(dtype, rows) for dtype in DTYPES]
    notes = ("Rows: shape, noise (3 seeds each); GPT 512x128: the Muon update of newton_schulz_spectrum.py. "
             "Cells: mean/worst |s - 1|. Columns: variant and Newton-Schulz steps. default: Frobenius "
             "normalisation and Keller Jordan's "
             f"coefficients {DEFAULT_NS_COEFFICIENTS} (today's Muon at 5 steps); AOL: ns_precondition=\"aol\" with "
             "the same coefficients; turbo: ns_coefficients=\"turbo_muon\" after the Frobenius normalisation; "
             "AOL+turbo: ns_precondition=\"aol\", ns_coefficients=\"turbo_muon\" (the "
             "last 4 or 5 of the five coefficient triples of Turbo-Muon's code). Gradient-like matrices: "
             f"L R / sqrt({RANK}) + noise * N (Gaussian L: m x {RANK}, R: {RANK} x n, N: m x n), seeds {SEEDS}; the "
             "GPT update is newton_schulz_spectrum.py's (seed 0).\n")
    console = _common.console()
    for result in tables:
        console.print(result)
    console.print(notes)
    if args.write:
        details = f"{_common.machine()}; singular values by torch.linalg.svdvals in float64"
        print(_report.write("aol", "AOL-preconditioned Newton-Schulz: orthogonality against the default",
                            _report.command("aol.py", argv), details, tables, notes))


if __name__ == "__main__":
    main()
