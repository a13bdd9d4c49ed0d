"""`WallClock`: wall-clock time and data seen, in the logger, so runs can be compared by time as well as by step.

It logs, at the logger's step:

- ``time/elapsed_s``: seconds since training started (after the sanity check),
  validation included;
- ``time/train_s``: the same, minus the time spent in validation: the time
  the training steps themselves took, which does not depend on how often one
  validates;
- ``time/samples``: training samples seen so far, over all ranks;
- ``time/tokens``: training tokens seen so far, over all ranks, when batches
  carry token ids (their first tensor is an integer tensor of two or more
  dimensions, like ``(inputs, targets)`` of shape ``(batch, time)``).

Rows are written every ``log_every_n_steps`` updates, just before every
validation during fitting (so each ``val_loss`` point has a time at its own
step) and once when training ends. ``time/tokens / time/train_s`` is the
training throughput. The counts assume every rank gets batches of the same
size (Lightning's distributed sampler, ``drop_last``); only rank zero logs.
They start from zero when a run resumes from a checkpoint.

Lightning's ``ThroughputMonitor`` reports windowed rates and needs a
``batch_size_fn``; it has no training time with validation left out, which a
comparison by time needs.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override

from lightning_muon.callbacks._checks import check_optional_count, require_logger
from lightning_muon.lightning import _compat

__all__ = ["WallClock"]


def _first_tensor(batch: Any) -> Tensor | None:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def count_tokens(batch: Any) -> int | None:
    """Tokens in ``batch``: the size of its first tensor when that holds integer ids of shape ``(batch, time, ...)``.

    ``None`` when the batch has no such tensor (images, float features).
    """
    first = _first_tensor(batch)
    if first is None or first.dim() < 2 or first.is_floating_point() or first.is_complex() or first.dtype == torch.bool:
        return None
    return first.numel()


class WallClock(Callback):
    """Log wall-clock time and samples (and tokens) seen, for comparisons against time and throughput.

    Args:
        log_every_n_steps: log after every this many updates (default: the
            trainer's ``log_every_n_steps``); rows are also written before
            each validation and at the end of training.

    Examples:
        ```python
        trainer = L.Trainer(callbacks=[WallClock()], logger=CSVLogger("logs"))
        # metrics.csv gains time/elapsed_s, time/train_s, time/samples (and time/tokens)
        ```

        or, from the command line:

        ```bash
        lightning-muon fit --config C --trainer.callbacks+=lightning_muon.WallClock
        ```
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        check_optional_count("log_every_n_steps", log_every_n_steps)
        self.log_every_n_steps = log_every_n_steps
        self._reset()

    def _reset(self) -> None:
        self._start: float | None = None
        self._validation_s = 0.0
        self._validation_start: float | None = None
        self._samples = 0
        self._tokens: int | None = None
        self._last_logged: int | None = None

    def _now(self, pl_module: pl.LightningModule) -> float:
        """The time, once the device has finished the work queued so far (asynchronous accelerators)."""
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, again: bool = False) -> None:
        """One row at ``step``; a step already logged is skipped (accumulated micro-batches) unless ``again``."""
        if not trainer.is_global_zero or self._start is None or (step == self._last_logged and not again):
            return
        elapsed = self._now(pl_module) - self._start
        metrics = {
            "time/elapsed_s": elapsed,
            "time/train_s": elapsed - self._validation_s,
            "time/samples": float(self._samples),
        }
        if self._tokens is not None:
            metrics["time/tokens"] = float(self._tokens)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        self._last_logged = step

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        require_logger(trainer, "WallClock")
        self._reset()
        self._every = self.log_every_n_steps or _compat.log_every_n_steps(trainer)
        self._start = self._now(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        world = trainer.world_size
        self._samples += extract_batch_size(batch) * world
        tokens = count_tokens(batch)
        if tokens is not None:
            self._tokens = (self._tokens or 0) + tokens * world
        step = _compat.logger_step(trainer)  # the step loggers give this batch's metrics
        if (step + 1) % self._every == 0:
            self._log(trainer, pl_module, step)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self._start is None:  # not timing a fit (sanity check, trainer.validate)
            return
        self._log(trainer, pl_module, _compat.logger_step(trainer))
        self._validation_start = self._now(pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None:
            self._validation_s += self._now(pl_module) - self._validation_start
            self._validation_start = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last step again if it was logged already: elapsed_s now includes the final validation.
        self._log(trainer, pl_module, max(_compat.logger_step(trainer) - 1, 0), again=True)
        self._start = None
