"""Optimizer step time: `lightning_muon.Muon` against `torch.optim.Muon` and fused AdamW, same run.

Two sets of hidden matrices (``nn.Linear`` weight shapes, ``out x in``):

- ``gpt2-small``: 12 layers of 2304x768 (qkv), 768x768 (attn proj), 3072x768
  (MLP in), 768x3072 (MLP out): 85M parameters;
- ``width-128``: 4 layers of the same blocks at width 128 (the ``char_gpt``
  example's default shapes);
- ``resnet18-conv``: ResNet-18's conv kernels after the stem (``out x in x k x k``,
  orthogonalised as ``out x in*k*k``: 1:9 for the 3x3 ones); ``torch.optim.Muon``
  takes 2D parameters only, so it gets the same kernels flattened;
- ``24x2048`` (accelerators): 24 layers at width 2048, 1.2B parameters.

Each optimizer steps on the same random gradients; the table reports the
median step time, the ratio ours/torch, the step against its physical limit
(the Newton-Schulz FLOPs of the path it takes over the machine's matmul peak
measured in the same run: a 2048^3 matmul in the NS dtype on CPU, 8192^3 on an
accelerator), and how far from orthogonal the first update is (the mean
orthogonality error over the matrices, the quintic's band is ~0.3-0.45 on
random gradients). Our rows: the default (Gram Newton-Schulz on matrices at
least `DEFAULT_GRAM_ASPECT` times longer than wide), Gram off
(``ns_gram_aspect=None``), Polar Express coefficients, and fp32 Newton-Schulz
(the choice on CPUs without bf16 matmuls). ``--update-rules`` times NorMuon and cautious weight decay
and the fused qkv split into q, k and v (``matrix_blocks``) against plain Muon in bf16 and fp32 instead;
``--aol-blocks`` AOL Newton-Schulz at 4 steps (`lightning_muon.Muon`'s ``ns_precondition="aol"``) and the qkv split
per projection and per head (64-row heads), bf16.

    python benchmarks/optimizer_step.py            # gpt2-small and width-128
    python benchmarks/optimizer_step.py --quick    # width-128 only, a few seconds
    python benchmarks/optimizer_step.py --device cuda --models gpt2-small 24x2048   # a GPU, bf16 NS
    python benchmarks/optimizer_step.py --update-rules --models width-128 gpt2-small  # NorMuon, cautious wd, split
    python benchmarks/optimizer_step.py --aol-blocks --models gpt2-small --cpu-time   # AOL, qkv per projection/head

Prints the table; with ``--write`` also writes ``benchmarks/results/optimizer_step.md``
(``optimizer_step_cuda.md`` on a GPU) and its ``benchmarks/RESULTS.md`` section.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from rich.progress import Progress
from rich.table import Table

import lightning_muon
from lightning_muon.optim import preview_update
from lightning_muon.optim.groups import matrix_shape, ns_dtype, uses_gram
from lightning_muon.optim.muon import DEFAULT_GRAM_ASPECT
from lightning_muon.optim.newton_schulz import (
    gram_newton_schulz,
    ns_flops,
    orthogonality_error,
    zeropower_via_newtonschulz,
)

import _common
import _report


def resnet18_kernels() -> list[tuple[int, ...]]:
    """ResNet-18's conv kernel shapes after the stem (which routing leaves on AdamW), downsample 1x1s included."""
    shapes: list[tuple[int, ...]] = [(64, 64, 3, 3)] * 4
    for width in (128, 256, 512):
        shapes += [(width, width // 2, 3, 3)] + [(width, width, 3, 3)] * 3 + [(width, width // 2, 1, 1)]
    return shapes


MODELS = {
    "gpt2-small": lambda: _common.hidden_shapes(12, 768),
    "width-128": lambda: _common.hidden_shapes(4, 128),
    "resnet18-conv": resnet18_kernels,
    "24x2048": lambda: _common.hidden_shapes(24, 2048),
}
#: Where the step runs (``--device``); timings synchronise it.
DEVICE = torch.device("cpu")


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 7) -> float:
    """FLOP/s of the fastest of several ``n^3`` matmuls in ``dtype``: the practical peak of this machine."""
    a, b = torch.randn(n, n, dtype=dtype, device=DEVICE), torch.randn(n, n, dtype=dtype, device=DEVICE)
    a @ b
    best = min(timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


#: The clock `timed` reads: wall time, or with ``--cpu-time`` the CPU time of this process (all its threads), which
#: a machine shared with other work leaves about as it is where wall time grows with the load.
CLOCK: Callable[[], float] = time.perf_counter


def timed(fn: Callable[[], object]) -> float:
    if DEVICE.type != "cpu":
        torch.accelerator.synchronize()
    start = CLOCK()
    fn()
    if DEVICE.type != "cpu":
        torch.accelerator.synchronize()
    return CLOCK() - start


_MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
#: Our variants: label -> extra Muon arguments.
OURS = {
    "ours (bf16)": {"ns_dtype": torch.bfloat16},
    "ours (bf16, Gram off)": {"ns_dtype": torch.bfloat16, "ns_gram_aspect": None},
    "ours (bf16, Polar Express)": {"ns_dtype": torch.bfloat16, "ns_coefficients": "polar_express"},
    "ours (fp32)": {"ns_dtype": torch.float32},
}
#: An update rule's setting that is no Muon argument: every fused ``3d x d`` qkv matrix split into blocks (a param
#: group's ``matrix_blocks``): ``"projections"``, its three ``d x d`` blocks (as ``split_fused=True`` sets it for
#: GPT-2's ``c_attn``); ``"heads"``, one block of `HEAD_DIM` rows a head (q's heads, then k's, then v's).
SPLIT_QKV = "split qkv"
#: A head's rows where the qkv is split per head: GPT-2's (12 heads of 64 at width 768).
HEAD_DIM = 64
#: The update rules beside plain Muon (``--update-rules``): each against plain Muon in the same dtype.
UPDATE_RULES = {
    "ours (bf16)": {},
    "ours (bf16, NorMuon)": {"normuon_beta2": 0.95},
    "ours (bf16, cautious wd)": {"cautious_weight_decay": True},
    "ours (fp32)": {"ns_dtype": torch.float32},
    "ours (fp32, NorMuon)": {"ns_dtype": torch.float32, "normuon_beta2": 0.95},
    "ours (fp32, cautious wd)": {"ns_dtype": torch.float32, "cautious_weight_decay": True},
    "ours (bf16, qkv split)": {SPLIT_QKV: "projections"},
    "ours (fp32, qkv split)": {"ns_dtype": torch.float32, SPLIT_QKV: "projections"},
}
#: AOL Newton-Schulz at 4 steps and the qkv split per projection and per head, against plain Muon (``--aol-blocks``):
#: bf16, the Newton-Schulz dtype of a CPU with AVX512-BF16 or AMX and of accelerators.
AOL_BLOCKS = {
    "ours (bf16)": {},
    "ours (bf16, AOL, 4 steps)": {"ns_steps": 4, "ns_precondition": "aol"},
    "ours (bf16, AOL, 4 steps, Turbo-Muon coefficients)": {"ns_steps": 4, "ns_precondition": "aol",
                                                           "ns_coefficients": "turbo_muon"},
    "ours (bf16, qkv split)": {SPLIT_QKV: "projections"},
    "ours (bf16, qkv per head)": {SPLIT_QKV: "heads"},
}
TORCH_MUON = "torch.optim.Muon (bf16)"
ADAMW = "torch.optim.AdamW (fused)"


def build(label: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if label == TORCH_MUON:
        return torch.optim.Muon(params, **_MUON)
    if label == ADAMW:
        return torch.optim.AdamW(params, lr=3e-4, fused=True)
    settings = dict(OURS[label])
    split = settings.pop(SPLIT_QKV, None)
    if split is not None:
        blocks = [(([p.shape[1]] * 3) if split == "projections" else [HEAD_DIM] * (3 * p.shape[1] // HEAD_DIM))
                  if p.ndim == 2 and p.shape[0] == 3 * p.shape[1] else None for p in params]
        return lightning_muon.Muon([{"params": params, "matrix_blocks": blocks}], **_MUON, **settings)
    return lightning_muon.Muon(params, **_MUON, **settings)


def ns_cost(optimizer: torch.optim.Optimizer, shapes: list[tuple[int, ...]]) -> int:
    """Newton-Schulz FLOPs of one step on the path each matrix (or each block of a split one) takes (Gram or not)."""
    group = optimizer.param_groups[0]
    total = 0
    for shape, blocks in zip(shapes, group.get("matrix_blocks") or [None] * len(shapes), strict=True):
        m, n = matrix_shape(shape)
        for rows in blocks or [m]:
            total += ns_flops(rows, n, group["ns_steps"], gram=uses_gram(group, (rows, n)), dtype=ns_dtype(group))
    return total


def first_update_error(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> float:
    """Mean orthogonality error of the first step's updates (ours report it; torch's is recomputed the same way
    by `preview_update`, the monitor's reading of torch's groups). Runs the warm-up step."""
    if isinstance(optimizer, lightning_muon.Muon):
        optimizer.record_diagnostics()
        optimizer.step()
        return statistics.mean(float(d.orthogonality_error) for d in optimizer.diagnostics)
    group = optimizer.param_groups[0]
    errors = [float(orthogonality_error(preview_update(group, p.grad, None))) for p in params]
    optimizer.step()
    return statistics.mean(errors)


def bench_model(name: str, repeats: int, progress: Progress, labels: Sequence[str] | None = None) -> list[dict]:
    """Median step time of every optimizer (or of ``labels``), each on its own copy of the same parameters and
    gradients.

    The optimizers take turns step by step, so a slow spell of the machine hits all of them alike.
    """
    shapes = MODELS[name]()
    torch.manual_seed(0)
    initial = [torch.randn(s, device=DEVICE) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=DEVICE) for s in shapes]
    steps, flops, errors = {}, {}, {}
    for label in labels or [*OURS, TORCH_MUON, ADAMW]:
        if DEVICE.type != "cpu" and "fp32" in label:
            continue  # bf16 Newton-Schulz is the choice on accelerators
        flat = label == TORCH_MUON  # torch.optim.Muon takes 2D parameters only: conv kernels flattened
        params = [torch.nn.Parameter((x.flatten(1) if flat else x).clone()) for x in initial]
        for p, g in zip(params, grads):
            p.grad = (g.flatten(1) if flat else g).clone()
        optimizer = build(label, params)
        if label != ADAMW:
            flops[label] = ns_cost(optimizer, shapes)
            errors[label] = first_update_error(optimizer, params)  # also the warm-up step
        else:
            optimizer.step()  # warm-up: allocates the state
        steps[label] = optimizer.step
    times: dict[str, list[float]] = {label: [] for label in steps}
    task = progress.add_task(name, total=repeats)
    for _ in range(repeats):
        for label, step in steps.items():
            times[label].append(timed(step))
        progress.advance(task)
    return [
        {"model": name, "optimizer": label, "seconds": statistics.median(t), "ns_flops": flops.get(label),
         "error": errors.get(label)}
        for label, t in times.items()
    ]


#: The Gram threshold sweep: short sides and aspect ratios (long side / short side).
SWEEP_SIDES = (64, 128, 256, 768)
SWEEP_ASPECTS = (1.5, 2, 3, 4, 6, 9)


def gram_sweep(progress: Progress, seconds: float = 1.5) -> Table:
    """Time of `gram_newton_schulz` over the standard iteration, bf16, on stacks of ``r x alpha*r`` matrices
    (up to 8 matrices or 4 MiB a stack): the evidence for `DEFAULT_GRAM_ASPECT`. The two take turns call by
    call; the cell is the median of the per-turn ratios (below 1: Gram is faster)."""
    table = Table(title="Gram Newton-Schulz time / standard, bf16 (median of paired calls)")
    table.add_column("short side r", justify="left")
    for aspect in SWEEP_ASPECTS:
        table.add_column(f"k = {aspect} r", justify="right")
    task = progress.add_task("Gram sweep", total=len(SWEEP_SIDES) * len(SWEEP_ASPECTS))
    for r in SWEEP_SIDES:
        cells = []
        for aspect in SWEEP_ASPECTS:
            k = int(r * aspect)
            X = torch.randn(max(1, min(8, (4 << 20) // (2 * r * k))), r, k, device=DEVICE).bfloat16()
            zeropower_via_newtonschulz(X), gram_newton_schulz(X)
            ratios: list[float] = []
            start = time.perf_counter()
            while time.perf_counter() - start < seconds or len(ratios) < 5:
                standard = timed(lambda X=X: zeropower_via_newtonschulz(X))
                ratios.append(timed(lambda X=X: gram_newton_schulz(X)) / standard)
            cells.append(f"{statistics.median(ratios):.2f}")
            progress.advance(task)
        table.add_row(f"r = {r}", *cells)
    return table


def _plain(label: str) -> str:
    """The plain-Muon row an update rule's row is measured against: ours in the same Newton-Schulz dtype."""
    return "ours (fp32)" if "fp32" in label else "ours (bf16)"


def render(rows: list[dict], peaks: dict[torch.dtype, float], against_plain: bool = False) -> Table:
    clock = "CPU time" if CLOCK is time.process_time else "wall time"
    table = Table(title=f"optimizer step on {DEVICE.type} (median {clock})")
    columns = ("model", "optimizer", "step ms", "ours / torch.optim.Muon", "NS GFLOP", "NS % of matmul peak",
               "x the NS limit", "orthogonality error", *(["/ plain Muon, same dtype"] if against_plain else []))
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "optimizer") else "right")
    for row in rows:
        torch_row = next(
            r for r in rows if r["model"] == row["model"] and r["optimizer"].startswith("torch.optim.Muon")
        )
        ratio = f"{row['seconds'] / torch_row['seconds']:.2f}" if row["optimizer"].startswith("ours") else ""
        if row["ns_flops"] is not None:
            peak = peaks[torch.float32 if "fp32" in row["optimizer"] else torch.bfloat16]
            limit = row["ns_flops"] / peak  # seconds of Newton-Schulz alone at the peak: the shortest step
            share, multiple = f"{100 * limit / row['seconds']:.0f}%", f"{row['seconds'] / limit:.2f}"
            gflop, error = f"{row['ns_flops'] / 1e9:.2f}", f"{row['error']:.3f}"
        else:
            share = multiple = gflop = error = ""
        plain = [f"{row['seconds'] / r['seconds']:.2f}" for r in rows if row["optimizer"].startswith("ours")
                 and r["model"] == row["model"] and r["optimizer"] == _plain(row["optimizer"])]
        table.add_row(row["model"], row["optimizer"], f"{1e3 * row['seconds']:.2f}", ratio, gflop, share, multiple,
                      error, *([plain[0] if plain else ""] if against_plain else []))
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Optimizer step time, ours against torch.optim.Muon and AdamW.")
    parser.add_argument("--quick", action="store_true", help="width-128 only")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=None,
                        help="matrix sets to run (default: gpt2-small width-128 resnet18-conv)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or an accelerator such as cuda")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per optimizer (median reported)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the Gram threshold sweep")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time steps by this process's CPU time, not wall time (CPU; a machine other work shares)")
    parser.add_argument("--update-rules", action="store_true",
                        help="our rows: plain Muon, NorMuon, cautious weight decay and the qkv split in bf16 and fp32 "
                             "(no sweep; writes optimizer_step_update_rules.md)")
    parser.add_argument("--aol-blocks", action="store_true",
                        help="our rows: plain Muon, AOL Newton-Schulz at 4 steps, the qkv split per projection and per "
                             "head, bf16 (no sweep; writes optimizer_step_aol_blocks.md)")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/optimizer_step.md and its RESULTS.md section (else: print)")
    args = parser.parse_args(argv)

    global DEVICE, OURS, CLOCK
    DEVICE = torch.device(args.device)
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    if args.update_rules or args.aol_blocks:
        OURS, args.no_sweep = UPDATE_RULES if args.update_rules else AOL_BLOCKS, True
    models = args.models or (["width-128"] if args.quick else ["gpt2-small", "width-128", "resnet18-conv"])
    console = _common.console(170)
    n = 2048 if DEVICE.type == "cpu" else 8192
    dtypes = (torch.bfloat16, torch.float32)
    # The peak is measured before and after the workloads, and the higher kept: a slow spell of a shared machine
    # during one measurement would otherwise put steps above "100% of the peak".
    peaks = {dtype: matmul_peak(dtype, n) for dtype in dtypes}
    rows: list[dict] = []
    with Progress(console=console, transient=True) as progress:
        for name in models:
            repeats = args.repeats or (11 if name == "gpt2-small" else 50 if name == "width-128" else 21)
            rows += bench_model(name, repeats, progress)
        sweep = None if args.no_sweep or args.quick else gram_sweep(progress)
    peaks = {dtype: max(peaks[dtype], matmul_peak(dtype, n)) for dtype in dtypes}
    table = render(rows, peaks, against_plain=args.update_rules or args.aol_blocks)
    console.print(table)
    if sweep is not None:
        console.print(sweep)
    device = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else DEVICE.type
    details = (
        f"{_common.machine()}, device {device}; matmul peak bf16 {peaks[torch.bfloat16] / 1e9:.0f} GFLOP/s, "
        f"fp32 {peaks[torch.float32] / 1e9:.0f} GFLOP/s ({n}^3)"
    )
    console.print(details)
    if args.write:
        notes = (
            "The NS limit is the Newton-Schulz FLOPs of one step (on the path each row takes: Gram or not) over "
            "the measured matmul peak in the NS dtype: the step if Newton-Schulz ran at the peak and everything "
            "else took no time. The orthogonality error is the mean over matrices of ||O O^T - I||_F / sqrt(r) "
            "of the first update, on random gradients. torch.optim.Muon gets conv kernels flattened to 2D.\n"
        )
        name = "optimizer_step" if DEVICE.type == "cpu" else f"optimizer_step_{DEVICE.type}"
        name += "_update_rules" if args.update_rules else "_aol_blocks" if args.aol_blocks else ""
        title = "Optimizer step" + ("" if DEVICE.type == "cpu" else f" ({device})")
        if sweep is not None:
            notes += (
                f"The sweep times Gram Newton-Schulz against the standard iteration on stacks of r x k matrices; the "
                f"default `ns_gram_aspect` ({DEFAULT_GRAM_ASPECT:g}) is where Gram is faster across the sizes.\n"
            )
        tables = [table] if sweep is None else [table, sweep]
        path = _report.write(name, title, _report.command("optimizer_step.py", argv), details, tables, notes)
        console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
