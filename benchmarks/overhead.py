"""Training throughput of `char_gpt` through a real Trainer: the mixin's manual loop against Lightning's
automatic optimization, and the optimizer's share of the step against the FLOP model.

Three runs of the same model (`examples.char_gpt`, default size: 4 layers, width
128) and data (`StdlibTextDataModule`, 32 x 128 bytes a batch), in one process:

- ``automatic AdamW``: `examples.char_gpt.GPT` (a plain LightningModule) whose
  ``configure_optimizers`` returns fused AdamW with the baseline's settings
  (Lightning's automatic optimization);
- ``MuonMixin, muon=None``: `CharGPT` with ``configs/gpt_adamw.yaml``'s
  optimizer (the same fused AdamW) through the mixin's manual loop, so only the
  loop differs;
- ``MuonMixin, Muon + AdamW``: `CharGPT` with ``configs/gpt_muon.yaml``'s pair.

Each run takes ``--steps`` updates; the median wall time of a training batch
(``on_train_batch_start`` to ``on_train_batch_end``) after ``--warmup`` steps
gives the step time and tokens/s; the runs take turns ``--rounds`` times. In
the Muon run the two optimizers' ``step`` calls are timed too, and set against
the FLOP model: Newton-Schulz FLOPs of one step over ``6 x params x tokens`` of
forward and backward.

    python benchmarks/overhead.py            # prints the tables
    python benchmarks/overhead.py --write    # and writes benchmarks/results/overhead.md
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from rich.table import Table

from lightning_muon import Muon
from lightning_muon.examples.char_gpt import GPT, CharGPT, StdlibTextDataModule
from lightning_muon.optim.newton_schulz import ns_flops

import _common
import _report

#: configs/gpt_adamw.yaml's AdamW (the baseline), configs/gpt_muon.yaml's pair.
BASELINE_ADAMW = {"lr": 0.00075, "betas": (0.9, 0.95), "weight_decay": 0.0}
MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
PAIR_ADAMW = {"lr": 0.003, "betas": (0.9, 0.95), "weight_decay": 0.0}
BATCH, BLOCK = 32, 128


class AutomaticGPT(GPT):
    """The plain LightningModule: automatic optimization, fused AdamW on every parameter."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), fused=True, **BASELINE_ADAMW)


RUNS = {
    "automatic AdamW (plain LightningModule)": AutomaticGPT,
    "MuonMixin, muon=None (gpt_adamw.yaml: same AdamW, manual loop)": lambda: CharGPT(
        muon=None, adamw=functools.partial(torch.optim.AdamW, **BASELINE_ADAMW)
    ),
    "MuonMixin, Muon + AdamW (gpt_muon.yaml)": lambda: CharGPT(
        muon=functools.partial(Muon, **MUON), adamw=functools.partial(torch.optim.AdamW, **PAIR_ADAMW)
    ),
}
BASELINE = "automatic AdamW (plain LightningModule)"


class StepTimer(Callback):
    """Wall time of every training batch and, under manual optimization, of every optimizer's ``step``."""

    def __init__(self) -> None:
        self.batches: list[float] = []
        self.optimizer_steps: dict[str, list[float]] = {}
        self.muon: Muon | None = None
        self.params = 0

    def on_train_start(self, trainer, pl_module):
        self.params = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        if pl_module.automatic_optimization:
            return  # Lightning's step(closure) runs forward and backward inside: not the optimizer alone
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, Muon):
                self.muon = optimizer
            times = self.optimizer_steps.setdefault(type(optimizer).__name__, [])
            inner = optimizer.step

            def step(*args, _inner=inner, _times=times, **kwargs):
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    _times.append(time.perf_counter() - start)

            optimizer.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(time.perf_counter() - self._start)


def run(make, steps: int, warmup: int) -> tuple[list[float], dict[str, list[float]], StepTimer]:
    torch.manual_seed(0)
    model = make()
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )
    trainer.fit(model, datamodule=StdlibTextDataModule(block_size=BLOCK, batch_size=BATCH, seed=0))
    return timer.batches[warmup:], {k: v[warmup:] for k, v in timer.optimizer_steps.items()}, timer


def flop_model(muon: Muon, params: int) -> tuple[float, float]:
    """(Newton-Schulz FLOPs of one step, 6 x params x tokens of one step's forward and backward)."""
    ns = sum(ns_flops(p.shape[0], p[0].numel(), g["ns_steps"]) for g in muon.param_groups for p in g["params"])
    return float(ns), 6.0 * params * BATCH * BLOCK


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/overhead.md and its RESULTS.md section (else: print)")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    times: dict[str, list[float]] = {name: [] for name in RUNS}
    optimizer_times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, make in RUNS.items():
            batches, steps, timer = run(make, args.steps, args.warmup)
            times[name] += batches
            if steps:
                for optimizer, t in steps.items():
                    optimizer_times.setdefault(optimizer, []).extend(t)
                muon, params = timer.muon, timer.params

    baseline = statistics.median(times[BASELINE])
    table = Table(title="char_gpt training step through Trainer (median)")
    for column in ("run", "step ms", "tokens/s", "step time ratio to automatic AdamW"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, t in times.items():
        median = statistics.median(t)
        table.add_row(name, f"{1e3 * median:.1f}", f"{BATCH * BLOCK / median:,.0f}", f"{median / baseline:.3f}")

    muon_step = statistics.median(times["MuonMixin, Muon + AdamW (gpt_muon.yaml)"])
    ns, model_flops = flop_model(muon, params)
    shares = Table(title="Muon + AdamW run: the optimizers' share of the step against the FLOP model")
    for column in ("", "ms per step", "share of the step", "FLOP model share"):
        shares.add_column(column, justify="left" if not column else "right")
    for optimizer, t in optimizer_times.items():
        median = statistics.median(t)
        model_share = f"{ns / (model_flops + ns):.3f}" if optimizer == "Muon" else ""
        shares.add_row(f"{optimizer}.step", f"{1e3 * median:.2f}", f"{median / muon_step:.3f}", model_share)

    console = _common.console(140)
    console.print(table)
    console.print(shares)
    flops_line = (
        f"FLOP model: Newton-Schulz {ns / 1e9:.2f} GFLOP a step against "
        f"6 x {model_flops / 6 / BATCH / BLOCK / 1e6:.2f}M params x {BATCH * BLOCK} tokens = "
        f"{model_flops / 1e9:.1f} GFLOP of forward and backward (attention's "
        f"own FLOPs left out), so Newton-Schulz would be {ns / (model_flops + ns):.1%} of a step that ran both at "
        "the same speed"
    )
    console.print(flops_line)
    details = f"{_common.machine()}; {args.rounds} rounds x {args.steps - args.warmup} timed steps per run"
    console.print(details)
    if args.write:
        notes = (
            f"{flops_line}. A measured Muon share below the FLOP model's means Newton-Schulz runs its FLOPs "
            "faster than forward and backward run theirs (bf16 Newton-Schulz against fp32 training here); above "
            "it, slower (small matrices, elementwise work, Python).\n"
        )
        path = _report.write("overhead", "Manual-loop overhead and the optimizer's share (char_gpt)",
                             _report.command("overhead.py", argv), details, [table, shares], notes)
        console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
