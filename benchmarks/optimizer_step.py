"""Optimizer step time: `lightning_muon.Muon` against `torch.optim.Muon` and fused AdamW, same run.

Two sets of hidden matrices (``nn.Linear`` weight shapes, ``out x in``):

- ``gpt2-small``: 12 layers of 2304x768 (qkv), 768x768 (attn proj), 3072x768
  (MLP in), 768x3072 (MLP out): 85M parameters;
- ``width-128``: 4 layers of the same blocks at width 128.

Each optimizer steps on the same random gradients; the table reports the
median step time, the ratio ours/torch, and the Newton-Schulz FLOP rate as a
share of the machine's matmul peak measured in the same run (a 2048^3 matmul in
the NS dtype). bf16 and fp32 Newton-Schulz are both measured: bf16 is the
default (fast where the CPU has bf16 matmuls, e.g. AVX512-BF16/AMX), fp32 is
the choice on CPUs without them.

    python benchmarks/optimizer_step.py            # both model sizes
    python benchmarks/optimizer_step.py --quick    # width-128 only, a few seconds

Writes ``benchmarks/results/optimizer_step.md`` (and prints the same table).
"""

from __future__ import annotations

import argparse
import datetime
import io
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import lightning_muon
from lightning_muon.newton_schulz import ns_flops

RESULTS = Path(__file__).parent / "results" / "optimizer_step.md"

MODELS = {
    "gpt2-small": (12, 768),
    "width-128": (4, 128),
}


def hidden_shapes(layers: int, width: int) -> list[tuple[int, int]]:
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 7) -> float:
    """FLOP/s of the fastest of several ``n^3`` matmuls in ``dtype``: the practical peak of this machine."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = min(timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


_MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
FACTORIES: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "lightning_muon.Muon (bf16 NS)": lambda params: lightning_muon.Muon(params, **_MUON),
    "torch.optim.Muon (bf16 NS)": lambda params: torch.optim.Muon(params, **_MUON),
    "lightning_muon.Muon (fp32 NS)": lambda params: lightning_muon.Muon(params, ns_dtype=torch.float32, **_MUON),
    "torch.optim.AdamW (fused)": lambda params: torch.optim.AdamW(params, lr=3e-4, fused=True),
}


def bench_model(name: str, repeats: int, progress: Progress) -> list[dict]:
    """Median step time of every optimizer, each on its own copy of the same parameters and gradients.

    The optimizers take turns step by step, so a slow spell of the machine hits all of them alike.
    """
    layers, width = MODELS[name]
    shapes = hidden_shapes(layers, width)
    torch.manual_seed(0)
    initial = [torch.randn(s) * 0.02 for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    flops = sum(ns_flops(*s) for s in shapes)
    steps = {}
    for label in FACTORIES:
        params = [torch.nn.Parameter(x.clone()) for x in initial]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer = FACTORIES[label](params)
        optimizer.step()  # warm-up: allocates the state
        steps[label] = optimizer.step
    times: dict[str, list[float]] = {label: [] for label in steps}
    task = progress.add_task(name, total=repeats)
    for _ in range(repeats):
        for label, step in steps.items():
            times[label].append(timed(step))
        progress.advance(task)
    return [
        {"model": name, "optimizer": label, "seconds": statistics.median(t), "ns_flops": flops}
        for label, t in times.items()
    ]


def render(rows: list[dict], peaks: dict[torch.dtype, float]) -> Table:
    table = Table(title="optimizer step (median)")
    for column in ("model", "optimizer", "step ms", "ours / torch.optim.Muon", "NS % of matmul peak"):
        table.add_column(column, justify="left" if column in ("model", "optimizer") else "right")
    for row in rows:
        torch_row = next(r for r in rows if r["model"] == row["model"] and r["optimizer"].startswith("torch.optim.Muon"))
        ratio = f"{row['seconds'] / torch_row['seconds']:.2f}" if row["optimizer"].startswith("lightning_muon") else ""
        if "Muon" in row["optimizer"]:
            peak = peaks[torch.float32 if "fp32" in row["optimizer"] else torch.bfloat16]
            share = f"{100 * row['ns_flops'] / row['seconds'] / peak:.0f}%"
        else:
            share = ""
        table.add_row(row["model"], row["optimizer"], f"{1e3 * row['seconds']:.2f}", ratio, share)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Optimizer step time, ours against torch.optim.Muon and AdamW.")
    parser.add_argument("--quick", action="store_true", help="width-128 only")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per optimizer (median reported)")
    parser.add_argument("--no-write", action="store_true", help="print only, do not write the results file")
    args = parser.parse_args(argv)

    models = ["width-128"] if args.quick else list(MODELS)
    console = Console()
    peaks = {dtype: matmul_peak(dtype) for dtype in (torch.bfloat16, torch.float32)}
    rows: list[dict] = []
    with Progress(console=console, transient=True) as progress:
        for name in models:
            repeats = args.repeats or (11 if name == "gpt2-small" else 50)
            rows += bench_model(name, repeats, progress)
    table = render(rows, peaks)
    console.print(table)
    machine = (
        f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}; matmul peak "
        f"bf16 {peaks[torch.bfloat16] / 1e9:.0f} GFLOP/s, fp32 {peaks[torch.float32] / 1e9:.0f} GFLOP/s"
    )
    console.print(machine)
    if not args.no_write:
        buffer = io.StringIO()
        Console(file=buffer, width=120, no_color=True, force_terminal=False).print(table)
        command = "python benchmarks/optimizer_step.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            f"# Optimizer step\n\n`{command}` on {datetime.date.today()}: {machine}.\n\n"
            f"```\n{buffer.getvalue()}```\n"
        )
        console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
