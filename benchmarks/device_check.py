"""One device check: is lightning_muon correct on this device, and how fast is its step there?

Correctness, each a measured value against a tolerance stated here (set before any GPU ran it):

- ``Muon`` against ``torch.optim.Muon`` in bf16 on the device: the exact path (``ns_batch_bytes=0``) bit for bit,
  the default batched path within `BATCHED_ATOL`;
- ``MuonWithAdamW`` on a small GPT on the device against the same on the CPU (float32 Newton-Schulz on both);
- a ``MuonMixin`` fit (bf16-mixed on CUDA, 32-true on CPU) against the same fit in 32-true on the CPU, with the
  Newton-Schulz dtype left to the hardware; its epoch-end checkpoint saved on the device and resumed on the CPU,
  against the device's uninterrupted run;
- QK-Clip through SDPA: the max logit measured from the captured q and k on the device against the CPU's, and
  below ``tau`` after the clip.

Speed, through ``optimizer_step.py``'s helpers (same parameters and gradients for every optimizer, turns
interleaved, medians): the optimizer step (the default, AOL Newton-Schulz at 4 steps, the qkv one block a head) on
GPT-2-small's hidden matrices (and 24 layers of 2048 on an
accelerator at full size) against ``torch.optim.Muon`` and fused AdamW, against the matmul peak measured in the same
run (the NS-limit ratio), eager and with the Newton-Schulz kernels under ``torch.compile`` (graphs and graph breaks
counted), and the memory one step adds (CUDA's allocator; the CPU has no such count).

    python benchmarks/device_check.py --device cpu                  # full size on the CPU (~6 min on 2 cores)
    python benchmarks/device_check.py --device cuda --write          # a GPU: writes results/device_check_cuda.md
    python benchmarks/device_check.py --device cpu --size short     # seconds: what tests/test_device_check.py runs

Exits 1 when a check fails. With ``--write`` also writes ``benchmarks/results/device_check_<device>.md`` and its
``benchmarks/RESULTS.md`` section.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import optimizer_step
import qk_clip as qk_clip_benchmark
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rich.progress import Progress
from rich.table import Table
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import Muon, MuonWithAdamW
from lightning_muon.attention import QKClipper
from lightning_muon.examples.char_gpt import GPT, CharGPT
from lightning_muon.optim import _precision, _update

import _common
import _report


@dataclass(frozen=True)
class Size:
    """How much each part does."""

    #: Optimizer steps of the numerics checks, and updates per epoch of the fits (two epochs: resumed after one).
    steps: int
    #: The GPT of the numerics checks and fits: layers, width.
    layers: int
    width: int
    #: Matrix sets timed (`optimizer_step.MODELS`), on the CPU and on an accelerator.
    models: tuple[str, ...]
    accelerator_models: tuple[str, ...]
    #: Timed steps per optimizer (median reported).
    repeats: int
    #: Side of the matmuls that measure the peak (CPU; accelerators 8192).
    peak_n: int
    #: ``torch.compile``'s backend for the Newton-Schulz kernels (``"eager"``: traced, no code generated).
    backend: str


SIZES = {
    "short": Size(steps=2, layers=1, width=32, models=("width-128",), accelerator_models=("width-128",), repeats=2,
                  peak_n=256, backend="eager"),
    "full": Size(steps=10, layers=2, width=128, models=("gpt2-small",), accelerator_models=("gpt2-small", "24x2048"),
                 repeats=5, peak_n=2048, backend="inductor"),
}
#: The batched bf16 path may round an entry of the update differently from torch's one-matrix kernels
#: (tests/optim/test_muon.py: BATCHED_PARAM_ATOL over 20 steps at lr 0.02).
BATCHED_ATOL = 1e-3
#: Device against CPU, as a fraction of how far the run moved the parameters (``max |a - b| / max |b - start|``):
#: same precision (float32 Newton-Schulz, 32-true), and bf16-mixed against 32-true.
SAME_PRECISION_TOL = 1e-3
MIXED_PRECISION_TOL = 0.25
#: Relative difference of the final training loss, bf16-mixed against 32-true.
MIXED_LOSS_TOL = 0.05
#: The max logit, device against CPU (relative); after the clip, at most ``tau * (1 + CLIP_TOL)``.
LOGIT_TOL = 1e-3
CLIP_TOL = 1e-3
COMPILED = "ours (bf16, NS compiled)"
optimizer_step.OURS.setdefault(COMPILED, optimizer_step.OURS["ours (bf16)"])
#: Rows beside the default: AOL Newton-Schulz at 4 steps and the fused qkv one block a head (issue 48's options).
OPTIONS = ["ours (bf16, AOL, 4 steps)", "ours (bf16, qkv per head)"]
for _label in OPTIONS:
    optimizer_step.OURS.setdefault(_label, optimizer_step.AOL_BLOCKS[_label])


@dataclass
class Check:
    name: str
    value: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.value <= self.tolerance


def moved_apart(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """``max |a - b|`` over ``max |b - start|``: how far two runs ended apart, as a fraction of how far one moved."""
    apart = max(float((a[n].cpu().float() - b[n].cpu().float()).abs().max()) for n in b)
    moved = max(float((b[n].cpu().float() - start[n].cpu().float()).abs().max()) for n in b)
    return apart / moved


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def tokens(size: Size, batches: int, seed: int = 0) -> TensorDataset:
    """``batches`` batches of 4 windows of 32 random bytes, targets shifted by one."""
    data = torch.randint(0, 256, (batches * 4, 33), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(data[:, :-1], data[:, 1:])


def gpt(size: Size, cls: type[GPT] = GPT, **kwargs: object) -> GPT:
    torch.manual_seed(0)
    return cls(n_layer=size.layers, n_head=2, n_embd=size.width, block_size=32, **kwargs)


# ------------------------------------------------------------------------------------------------ correctness


def against_torch(device: torch.device, size: Size) -> list[Check]:
    """Muon against torch.optim.Muon (bf16) on ``device``: the exact path, then the batched one."""
    shapes = [(24, 16), (16, 24), (20, 20), (24, 16), (24, 16)]
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(size.steps)]
    ends = {}
    for label in ("torch", "exact", "batched"):
        params = [torch.nn.Parameter(x.to(device)) for x in start]
        if label == "torch":
            optimizer: torch.optim.Optimizer = torch.optim.Muon(params, lr=0.02)
        else:
            optimizer = Muon(params, lr=0.02, ns_dtype=torch.bfloat16, ns_batch_bytes=0 if label == "exact" else None)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.to(device)
            optimizer.step()
        ends[label] = [p.detach().cpu() for p in params]
    apart = {label: max(float((a - b).abs().max()) for a, b in zip(ends[label], ends["torch"], strict=True))
             for label in ("exact", "batched")}
    return [Check("Muon vs torch.optim.Muon, exact path (max |diff|)", apart["exact"], 0.0),
            Check("Muon vs torch.optim.Muon, batched path (max |diff|)", apart["batched"], BATCHED_ATOL)]


def combined_on(device: torch.device, size: Size) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A GPT trained ``size.steps`` steps by MuonWithAdamW (float32 Newton-Schulz) on ``device``: start, end."""
    model = gpt(size).to(device)
    start = state(model)
    optimizer = MuonWithAdamW(model, ns_dtype=torch.float32)
    for inputs, targets in DataLoader(tokens(size, size.steps), batch_size=4):
        model.loss((inputs.to(device), targets.to(device))).backward()
        optimizer.step()
        optimizer.zero_grad()
    return start, state(model)


def fit_on(device: torch.device, size: Size, directory: Path, resume: Path | None = None) -> tuple[dict, float]:
    """A CharGPT (MuonMixin, the NS dtype by hardware) fit of 2 epochs of ``size.steps`` updates on ``device``
    (bf16-mixed on CUDA), an epoch-end checkpoint in ``directory``; from ``resume`` on the CPU when given. Returns
    its final parameters and training loss."""
    model = gpt(size, CharGPT)
    precision = "bf16-mixed" if device.type == "cuda" and resume is None else "32-true"
    trainer = L.Trainer(
        accelerator=device.type, devices=1, precision=precision, max_epochs=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=directory,
        callbacks=[ModelCheckpoint(dirpath=directory, filename="epoch{epoch}", auto_insert_metric_name=False,
                                   save_top_k=-1, every_n_epochs=1)],
    )
    trainer.fit(model, DataLoader(tokens(size, size.steps), batch_size=4), ckpt_path=resume)
    return state(model), float(trainer.callback_metrics["train_loss"])


def fits(device: torch.device, size: Size) -> list[Check]:
    """The mixin fit on ``device`` against the CPU's, and its checkpoint resumed on the CPU."""
    mixed = device.type == "cuda"
    start = state(gpt(size, CharGPT))
    with tempfile.TemporaryDirectory() as root:
        on_device, device_loss = fit_on(device, size, Path(root) / "device")
        on_cpu, cpu_loss = fit_on(torch.device("cpu"), size, Path(root) / "cpu")
        resumed, _ = fit_on(torch.device("cpu"), size, Path(root) / "resumed", Path(root) / "device" / "epoch0.ckpt")
    what = "bf16-mixed" if mixed else "32-true"
    return [
        Check(f"MuonMixin fit, {what} vs CPU 32-true (apart / moved)", moved_apart(on_device, on_cpu, start),
              MIXED_PRECISION_TOL if mixed else SAME_PRECISION_TOL),
        Check(f"MuonMixin fit, {what} vs CPU 32-true (final loss, relative)", abs(device_loss - cpu_loss) / cpu_loss,
              MIXED_LOSS_TOL if mixed else SAME_PRECISION_TOL),
        Check("checkpoint saved on the device, resumed on the CPU, vs the device's run (apart / moved)",
              moved_apart(resumed, on_device, start), MIXED_PRECISION_TOL if mixed else SAME_PRECISION_TOL),
    ]


def max_logit(model: torch.nn.Module, inputs: torch.Tensor, tau: float | None = None) -> tuple[float, int]:
    """The max attention logit of a training forward on ``inputs`` (q and k captured around SDPA), and how many
    heads a clip at ``tau`` scaled (0 when only measuring)."""
    with QKClipper(model, tau=tau) as clipper:
        with clipper.recording():
            model(inputs)
        stats = clipper.clip()
    return stats.max_logit, int(stats.clipped_heads.sum())


def qk_clip(device: torch.device, size: Size) -> list[Check]:
    """QK-Clip on a transformers Llama (GQA, SDPA; `qk_clip.llama`) on the device: the max logit against the CPU's,
    then at most tau = half of it after the clip."""
    inputs = tokens(size, 1).tensors[0]
    torch.manual_seed(0)
    model = qk_clip_benchmark.llama(size.width, size.layers, 4, 2, 256).train()
    on_cpu, _ = max_logit(model, inputs)
    model.to(device)
    measured, _ = max_logit(model, inputs.to(device))
    tau = measured / 2
    _, clipped = max_logit(model, inputs.to(device), tau)
    after, _ = max_logit(model, inputs.to(device))
    return [Check("QK-Clip: max logit through SDPA vs CPU (relative)", abs(measured - on_cpu) / on_cpu, LOGIT_TOL),
            Check(f"QK-Clip: max logit after the clip at tau = {tau:.3g} ({clipped} heads clipped), / tau - 1",
                  max(after / tau - 1, 0.0) if clipped else float("inf"), CLIP_TOL)]


def correctness(device: torch.device, size: Size) -> list[Check]:
    """Every check; Lightning's INFO lines (the routing tables of the fits) kept quiet."""
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)
    try:  # (run in-process by the tests: the level is given back)
        start, cpu_end = combined_on(torch.device("cpu"), size)
        _, device_end = combined_on(device, size)
        combined = Check("MuonWithAdamW, float32 NS, vs CPU (apart / moved)",
                         moved_apart(device_end, cpu_end, start), SAME_PRECISION_TOL)
        return [*against_torch(device, size), combined, *fits(device, size), *qk_clip(device, size)]
    finally:
        lightning_log.setLevel(level)


# ------------------------------------------------------------------------------------------------------ speed


@contextlib.contextmanager
def compiled_newton_schulz(backend: str) -> Iterator[dict[str, int]]:
    """Within the block the optimizer's Newton-Schulz kernels run under ``torch.compile``; yields the counts
    (graphs compiled, graph breaks), filled in when the block ends."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    originals = {name: getattr(_update, name) for name in ("zeropower_via_newtonschulz", "gram_newton_schulz")}
    counts: dict[str, int] = {}
    try:
        for name, fn in originals.items():
            setattr(_update, name, torch.compile(fn, backend=backend))
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(_update, name, fn)
        counts["graphs"] = counters["stats"]["unique_graphs"]
        counts["graph breaks"] = sum(counters["graph_break"].values())


def step_memory(name: str, labels: list[str]) -> Table:
    """The memory one step adds at its peak (above what was allocated before it), per optimizer: CUDA's allocator
    statistics (the CPU keeps none)."""
    table = Table(title=f"memory one step adds at its peak ({name})")
    table.add_column("optimizer", justify="left")
    table.add_column("MiB", justify="right")
    for label in labels:
        if optimizer_step.DEVICE.type != "cuda":
            table.add_row(label, "n/a (no allocator statistics on the CPU)")
            continue
        shapes = optimizer_step.MODELS[name]()
        params = [torch.nn.Parameter(torch.randn(s, device=optimizer_step.DEVICE)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = optimizer_step.build(label, params)
        optimizer.step()  # the state exists
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        torch.cuda.synchronize()
        table.add_row(label, f"{(torch.cuda.max_memory_allocated() - before) / 2**20:.0f}")
        del optimizer, params
    return table


def speed(device: torch.device, size: Size) -> tuple[list[Table], dict[str, torch.dtype | float | int]]:
    optimizer_step.DEVICE = device
    accelerator = device.type != "cpu"
    n = 8192 if accelerator else size.peak_n
    dtypes = (torch.bfloat16,) if accelerator else (torch.bfloat16, torch.float32)
    peaks = {dtype: optimizer_step.matmul_peak(dtype, n) for dtype in dtypes}
    labels = ["ours (bf16)", *([] if accelerator else ["ours (fp32)"]), *OPTIONS, optimizer_step.TORCH_MUON,
              optimizer_step.ADAMW]
    models = size.accelerator_models if accelerator else size.models
    rows: list[dict] = []
    with Progress(console=_common.console(170), transient=True) as progress:
        for name in models:
            rows += optimizer_step.bench_model(name, size.repeats, progress, labels)
            with compiled_newton_schulz(size.backend) as counts:
                rows += optimizer_step.bench_model(name, size.repeats, progress, [COMPILED])
    peaks = {dtype: max(peaks[dtype], optimizer_step.matmul_peak(dtype, n)) for dtype in dtypes}
    tables = [optimizer_step.render(rows, peaks), step_memory(models[0], labels)]
    return tables, {"peak_n": n, **{f"peak {dtype}": peaks[dtype] for dtype in dtypes}, **counts}


# ------------------------------------------------------------------------------------------------------- main


def checks_table(checks: list[Check]) -> Table:
    table = Table(title="correctness")
    for column in ("check", "value", "tolerance", "ok"):
        table.add_column(column, justify="left" if column == "check" else "right")
    for check in checks:
        table.add_row(check.name, f"{check.value:.3g}", f"{check.tolerance:.3g}", "yes" if check.ok else "NO")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Correctness and step speed of lightning_muon on one device.")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--size", choices=list(SIZES), default="full", help="short: seconds, for the tests")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/device_check_<device>.md")
    args = parser.parse_args(argv)
    device, size = torch.device(args.device), SIZES[args.size]
    start, load = time.perf_counter(), os.getloadavg()[0]
    checks = correctness(device, size)
    tables, facts = speed(device, size)
    wall = time.perf_counter() - start
    console = _common.console(170)
    for table in [checks_table(checks), *tables]:
        console.print(table)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({_precision.native_bf16(device)[1]})"
    peaks = ", ".join(f"{k.removeprefix('peak torch.')} {v / 1e9:.0f} GFLOP/s" for k, v in facts.items()
                      if k.startswith("peak "))
    details = (
        f"{_common.machine()}, device {name}, size {args.size}; {_precision.decide(device).line()} Matmul peak "
        f"{peaks} ({facts['peak_n']}^3); Newton-Schulz under torch.compile(backend={size.backend!r}): "
        f"{facts['graphs']} graphs, {facts['graph breaks']} graph breaks; {wall:.0f} s wall, load average "
        f"{load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (other processes share the machine)"
    )
    console.print(details)
    if args.write:
        notes = (
            "Tolerances were set before any GPU ran this. `apart / moved`: the largest parameter difference between "
            "the two runs over the largest distance one run moved a parameter. The NS limit is the Newton-Schulz "
            "FLOPs of one step over the matmul peak measured in this run. The compiled row runs after the eager "
            "rows (its own interleaving), its compile time excluded (the warm-up step).\n"
        )
        path = _report.write(f"device_check_{device.type}", f"Device check ({name})",
                             _report.command("device_check.py", argv), details, [checks_table(checks), *tables], notes)
        console.print(f"wrote {path}")
    return 0 if all(check.ok for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
