"""What Newton-Schulz does to the singular values of a real Muon update, drawn for the "How Muon works" page.

1. The update Muon orthogonalises: the shipped byte-level GPT (2 layers, width 128) trained 50 updates on the
   standard library's sources by `MuonWithAdamW` (seed 0, float32 Newton-Schulz), then the Nesterov input of its
   last update for one MLP matrix (``blocks.1.mlp.fc.weight``, 512 x 128), ``grad.lerp(momentum_buffer, 0.95)``
   as `lightning_muon.Muon` forms it. Its singular values scaled as the iteration scales them (by the Frobenius
   norm), and after `zeropower_via_newtonschulz`'s 5 steps: Keller Jordan's quintic in float32 and in bfloat16,
   and Polar Express in bfloat16; each with `orthogonality_error`, the number `MuonMonitor` logs as
   ``muon/orthogonality_error``.
2. The same for a Gaussian random 512 x 128 matrix (what the monitoring guide's "random matrices" are).
3. The quintic as a map of one singular value, after 1 to 5 steps (its coefficients from `coefficient_schedule`):
   the band every singular value above about 0.01 lands in.

    python benchmarks/newton_schulz_spectrum.py           # prints the tables
    python benchmarks/newton_schulz_spectrum.py --write   # and writes docs/img/newton_schulz.png and
                                                          # benchmarks/results/newton_schulz_spectrum.md
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
from rich.table import Table

from lightning_muon import MuonWithAdamW, orthogonality_error, zeropower_via_newtonschulz
from lightning_muon.examples.char_gpt import GPT, StdlibTextDataModule
from lightning_muon.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, coefficient_schedule

import _common
import _report

MATRIX = "blocks.1.mlp.fc.weight"
UPDATES = 50
#: Singular values at or above this (of the Frobenius-scaled input) land in the band after 5 quintic steps.
BAND_FROM = 0.01
#: (label, ns_coefficients, dtype) of each orthogonalisation drawn.
VARIANTS = [
    ("quintic, float32", DEFAULT_NS_COEFFICIENTS, torch.float32),
    ("quintic, bfloat16 (the default where native)", DEFAULT_NS_COEFFICIENTS, torch.bfloat16),
    ("Polar Express, bfloat16", "polar_express", torch.bfloat16),
]


def muon_update(seed: int = 0) -> torch.Tensor:
    """The matrix Muon orthogonalised at its last update of `MATRIX`, after `UPDATES` updates of a small GPT."""
    torch.manual_seed(seed)
    model = GPT(n_layer=2, n_embd=128)
    optimizer = MuonWithAdamW(model, ns_dtype=torch.float32, adamw_lr=3e-3)
    with tempfile.TemporaryDirectory() as cache:
        data = StdlibTextDataModule(batch_size=16, max_bytes=1_000_000, seed=seed, cache_dir=cache)
        data.setup("fit")
        batches = iter(data.train_dataloader())
        for _ in range(UPDATES):
            optimizer.zero_grad()
            model.loss(next(batches)).backward()
            optimizer.step()
    parameter = dict(model.named_parameters())[MATRIX]
    momentum = optimizer.muon.defaults["momentum"]
    return parameter.grad.lerp(optimizer.muon.state[parameter]["momentum_buffer"], momentum).detach()


def scalar_map(x: torch.Tensor, steps: int) -> torch.Tensor:
    """One singular value through ``steps`` quintic steps (float64): ``s <- a s + b s^3 + c s^5``."""
    for a, b, c in coefficient_schedule(DEFAULT_NS_COEFFICIENTS, steps)[0]:
        x = a * x + b * x**3 + c * x**5
    return x


def band() -> tuple[float, float]:
    """The lowest and highest a singular value in [`BAND_FROM`, 1] ends at after the default 5 steps."""
    out = scalar_map(torch.linspace(BAND_FROM, 1.0, 200_001, dtype=torch.float64), DEFAULT_NS_STEPS)
    return out.min().item(), out.max().item()


def spectra(update: torch.Tensor) -> dict[str, tuple[torch.Tensor, float]]:
    """Singular values (descending) of the scaled input and of each variant's output, with each one's
    orthogonality error."""
    scaled = update.double() / update.double().norm()
    found = {"input, scaled by its Frobenius norm": (torch.linalg.svdvals(scaled), orthogonality_error(scaled).item())}
    for label, coefficients, dtype in VARIANTS:
        out = zeropower_via_newtonschulz(update, ns_coefficients=coefficients, dtype=dtype)
        found[label] = (torch.linalg.svdvals(out.double()), orthogonality_error(out).item())
    return found


def table(title: str, found: dict[str, tuple[torch.Tensor, float]], low: float, high: float) -> Table:
    result = Table(title=title)
    for column in ("matrix", "smallest s", "largest s", f"s in {low:.2f}..{high:.2f}", "orthogonality error"):
        result.add_column(column, justify="left" if column == "matrix" else "right")
    for label, (s, error) in found.items():
        inside = ((s >= low - 5e-3) & (s <= high + 5e-3)).sum().item()
        result.add_row(label, f"{s.min():.4f}", f"{s.max():.4f}", f"{inside} of {s.numel()}", f"{error:.3f}")
    return result


def draw(path, found: dict[str, tuple[torch.Tensor, float]], low: float, high: float, shape: tuple[int, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for (label, (s, error)), style in zip(found.items(), ["k-", "C0-", "C1--", "C2-"], strict=True):
        left.plot(range(1, s.numel() + 1), s.numpy(), style, lw=1.6, label=f"{label} (error {error:.2f})")
    for axis in (left, right):
        axis.axhspan(low, high, color="C0", alpha=0.12, lw=0, label=f"the band {low:.2f}..{high:.2f}")
        axis.axhline(1.0, color="grey", lw=0.6)
        axis.set_yscale("log")
    left.set_xlabel(f"singular value index ({MATRIX}, {'x'.join(map(str, shape))})")
    left.set_ylabel("singular value")
    left.set_title(f"A Muon update of the shipped GPT, after {UPDATES} updates")
    left.legend(fontsize=8, loc="lower left")
    x = torch.logspace(-4, 0, 400, dtype=torch.float64)
    for steps in range(1, DEFAULT_NS_STEPS + 1):
        right.plot(x.numpy(), scalar_map(x, steps).numpy(), lw=1.4 if steps == DEFAULT_NS_STEPS else 0.9,
                   label=f"{steps} step{'s' if steps > 1 else ''}")
    right.plot(x.numpy(), x.numpy(), "k:", lw=0.8, label="input")
    right.set_xscale("log")
    right.set_xlabel("singular value in (after the Frobenius scaling)")
    right.set_ylabel("singular value out")
    right.set_title(f"The quintic on one singular value: the band {low:.2f}..{high:.2f}")
    right.legend(fontsize=8, loc="lower right")
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the plot and the results file")
    args = parser.parse_args(argv)
    logging.getLogger("lightning_muon").setLevel(logging.WARNING)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    low, high = band()
    update = muon_update()
    found = spectra(update)
    torch.manual_seed(0)
    random = spectra(torch.randn(*update.shape))
    bf16 = zeropower_via_newtonschulz(update, dtype=torch.bfloat16).double()
    fp32 = zeropower_via_newtonschulz(update, dtype=torch.float32).double()
    apart = ((bf16 - fp32).norm() / fp32.norm()).item()
    tables = [table(f"{MATRIX} of the shipped GPT after {UPDATES} updates: Muon's input and its 5-step outputs",
                    found, low, high),
              table("a Gaussian random matrix of the same shape", random, low, high)]
    scaled = found["input, scaled by its Frobenius norm"][0]
    above = (scaled >= BAND_FROM).sum().item()
    notes = (f"The band: every singular value in [{BAND_FROM}, 1] of the scaled input ends in {low:.4f}..{high:.4f} "
             f"after the quintic's {DEFAULT_NS_STEPS} steps (float64, the map s <- a s + b s^3 + c s^5 with "
             f"(a, b, c) = {DEFAULT_NS_COEFFICIENTS}); {above} of the GPT update's {scaled.numel()} scaled singular "
             f"values are at or above {BAND_FROM}. bfloat16 against float32 on the GPT's update: "
             f"||O_bf16 - O_fp32||_F / ||O_fp32||_F = {apart:.4f}.\n")
    console = _common.console()
    for result in tables:
        console.print(result)
    console.print(notes)
    if args.write:
        path = _common.ROOT / "docs" / "img" / "newton_schulz.png"
        draw(path, found, low, high, tuple(update.shape))
        details = (f"{_common.machine()}; GPT(n_layer=2, n_embd=128) on StdlibTextDataModule(batch_size=16, "
                   f"max_bytes=1_000_000, seed=0), MuonWithAdamW(ns_dtype=torch.float32, adamw_lr=3e-3), seed 0; "
                   f"the plot is docs/img/newton_schulz.png")
        print(_report.write("newton_schulz_spectrum", "Newton-Schulz on the singular values of a Muon update",
                            _report.command("newton_schulz_spectrum.py", argv), details, tables, notes))


if __name__ == "__main__":
    main()
