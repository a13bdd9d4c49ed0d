"""What MuonMonitor's diagnostics cost: logging steps against the other steps of the same run.

Trains the ``char_gpt`` example (default size: 4 layers, width 128) through a
real Trainer with ``MuonMonitor(log_every_n_steps=N)`` and times every training
batch; the median of the logging steps (orthogonality diagnosed, metrics
reduced and logged) is compared with the median of the other steps, which
must cost nothing extra (the optimizer's diagnostic path is not entered).

    python benchmarks/monitor_overhead.py            # prints the result
    python benchmarks/monitor_overhead.py --write    # and writes benchmarks/results/monitor_overhead.md
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_muon import MuonMonitor
from lightning_muon.examples.char_gpt import CharGPT, StdlibTextDataModule

import _common
import _report


class BatchTimer(Callback):
    def __init__(self) -> None:
        self.times: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append((trainer.fit_loop.epoch_loop._batches_that_stepped, time.perf_counter() - self._start))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=5, help="MuonMonitor(log_every_n_steps=...)")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/monitor_overhead.md and its RESULTS.md section (else: print)")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    timer = BatchTimer()
    with tempfile.TemporaryDirectory() as tmp:
        L.seed_everything(0)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=args.steps,
            limit_val_batches=0,
            logger=CSVLogger(tmp),
            log_every_n_steps=args.every,
            callbacks=[MuonMonitor(log_every_n_steps=args.every), timer],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(CharGPT(), datamodule=StdlibTextDataModule())
    warm = timer.times[5:]
    logging_steps = [t for step, t in warm if (step + 1) % args.every == 0]
    other_steps = [t for step, t in warm if (step + 1) % args.every]
    log_ms, other_ms = 1e3 * statistics.median(logging_steps), 1e3 * statistics.median(other_steps)
    line = (
        f"logging step {log_ms:.1f} ms (median of {len(logging_steps)}), other steps {other_ms:.1f} ms "
        f"(median of {len(other_steps)}): ratio {log_ms / other_ms:.3f}"
    )
    print(line)
    if args.write:
        details = (
            f"{_common.machine()}; char_gpt default size, MuonMonitor(log_every_n_steps={args.every}), "
            "orthogonality on"
        )
        path = _report.write("monitor_overhead", "MuonMonitor overhead", _report.command("monitor_overhead.py", argv),
                             details, [], line + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
