"""Muon under DDP: per-rank step time with the Newton-Schulz work split across ranks vs repeated on each.

Two CPU processes (gloo, one thread each, so the two ranks do not fight over
the 2 cores) hold the same GPT-2-small hidden matrices (12 layers of 2304x768,
768x768, 3072x768, 768x3072) and the same gradients, as DDP leaves them after
its all-reduce. Each steps ``lightning_muon.Muon`` with ``split_ns=True`` (each
rank orthogonalises half the matrices, then an all-gather of the updates) and
``split_ns=False`` (every rank orthogonalises every matrix, like
``torch.optim.Muon``), alternating, and reports the median per-rank step time
and the bytes each rank sent, against the bytes of the Muon parameters.

    python benchmarks/distributed.py            # GPT-2-small, 3 timed steps per mode
    python benchmarks/distributed.py --quick    # width-128 matrices, seconds

Writes ``benchmarks/results/distributed.md``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from lightning_muon import Muon

RESULTS = Path(__file__).parent / "results" / "distributed.md"
WORLD = 2


def shapes(layers: int, width: int) -> list[tuple[int, int]]:
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers


def worker(rank: int, layers: int, width: int, repeats: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # the same matrices and gradients on every rank, as after DDP's all-reduce
    initial = [torch.randn(s) * 0.02 for s in shapes(layers, width)]
    grads = [torch.randn(s) for s in shapes(layers, width)]
    steps, sent = {}, {}
    optimizers = {}
    for split in (True, False):
        params = [torch.nn.Parameter(x.clone()) for x in initial]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizers[split] = Muon(params, lr=0.02, momentum=0.95, weight_decay=0.01, split_ns=split)
        optimizers[split].step()  # warm-up
        steps[split] = []
    for _ in range(repeats):
        for split, optimizer in optimizers.items():
            dist.barrier()
            start = time.perf_counter()
            optimizer.step()
            steps[split].append(time.perf_counter() - start)
            sent[split] = optimizer.last_exchange_bytes
    torch.save({"steps": steps, "sent": sent, "param_bytes": sum(x.numel() * 4 for x in initial)}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="width-128 matrices instead of GPT-2-small")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    layers, width, name = (4, 128, "width-128") if args.quick else (12, 768, "gpt2-small")
    repeats = args.repeats or (20 if args.quick else 3)

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(worker, args=(layers, width, repeats, init_file, tmp), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]

    table = Table(title=f"Muon step per rank, {WORLD} CPU processes (gloo, 1 thread each), {name}")
    for column in ("mode", "rank 0 ms", "rank 1 ms", "ratio to not split", "bytes sent (all ranks)", "of Muon param bytes"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    medians = {split: [statistics.median(r["steps"][split]) for r in ranks] for split in (True, False)}
    param_bytes = ranks[0]["param_bytes"]
    for split, label in ((False, "split_ns=False (every rank does all)"), (True, "split_ns=True (each rank half)")):
        sent = sum(r["sent"][split] for r in ranks)
        ratio = max(medians[split]) / max(medians[False])
        table.add_row(
            label, *(f"{1e3 * m:.0f}" for m in medians[split]), f"{ratio:.2f}", f"{sent:,}", f"{sent / param_bytes:.2f}"
        )
    console = Console()
    console.print(table)
    machine = f"torch {torch.__version__}, {os.cpu_count()} CPUs, {repeats} timed steps per mode (median)"
    console.print(machine)
    if not args.no_write:
        buffer = io.StringIO()
        Console(file=buffer, width=140, no_color=True, force_terminal=False).print(table)
        command = " ".join(["python benchmarks/distributed.py"] + (argv if argv is not None else sys.argv[1:]))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            f"# Distributed Newton-Schulz\n\n`{command}` on {datetime.date.today()}: {machine}.\n"
            "The ratio compares the slower rank of each mode (a step waits for it). Bytes are what the "
            "all-gather carries: each rank's share of the updates in bf16.\n\n"
            f"```\n{buffer.getvalue()}```\n"
        )
        console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
