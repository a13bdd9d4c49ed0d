"""Every use of Lightning's private API in lightning_muon, each wrapped once.

Manual optimization leaves the update to the module, but a correct update
still has to speak to the loop: whether this micro-batch ends an update, the
hooks ``optimizer.step()`` would run, the ``global_step`` count, the step the
loggers use. Lightning has no public API for these, so this module is the only
place that touches its internals; ``tests/test_compat.py`` checks each one
against the installed Lightning and fails naming the wrapper to update.
No other module of the package may use a private Lightning name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer import call

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from torch.optim import Optimizer

#: The Lightning releases these wrappers were checked against (``tests/test_compat.py``).
CHECKED_LIGHTNING = ("2.5", "2.6")


def ends_update(trainer: pl.Trainer) -> bool:
    """Whether the current training batch is the last micro-batch of an update (Lightning's own decision:
    ``accumulate_grad_batches``, the end of the epoch, and the last batches of a fit)."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


@contextlib.contextmanager
def one_optimizer_step(lightning_optimizer: LightningOptimizer) -> Iterator[None]:
    """Count what runs inside as one optimizer step: ``trainer.global_step`` advances by one, however many
    optimizers step (the manual loop counts through these hooks of a ``LightningOptimizer``)."""
    lightning_optimizer._on_before_step()
    try:
        yield
    finally:
        lightning_optimizer._on_after_step()


def call_on_before_optimizer_step(trainer: pl.Trainer, optimizer: Optimizer) -> None:
    """Run ``on_before_optimizer_step`` of every callback, then of the module, as ``optimizer.step()`` would."""
    call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
    call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)


def cli_class_path(hparams: Any) -> str | None:
    """The class path LightningCLI stores in a model's hparams when it built the model (else ``None``)."""
    return hparams.get("_class_path")


def logger_step(trainer: pl.Trainer) -> int:
    """The step loggers give the metrics of the current batch (what ``LearningRateMonitor`` logs at)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def log_every_n_steps(trainer: pl.Trainer) -> int:
    """``Trainer(log_every_n_steps=...)`` (set by the logger connector, not declared on the Trainer)."""
    return trainer.log_every_n_steps  # type: ignore[attr-defined]


def set_accumulate_grad_batches(trainer: pl.Trainer, value: int) -> None:
    """Let the loop count ``value`` micro-batches per update (logger steps, ``estimated_stepping_batches``,
    the accumulation decision). Manual optimization refuses the Trainer flag only when it validates the
    loop's settings, which happens before ``LightningModule.setup``: written from ``setup``, it stands."""
    trainer.accumulate_grad_batches = value
