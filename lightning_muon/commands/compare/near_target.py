"""`NearTargetValidation`: the callback ``compare --target`` adds to every fit, so that the fit validates densely
near the target loss and the steps it takes to reach it are resolved (see
`lightning_muon.commands.compare.target`)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_muon.commands.compare.target import RESOLUTION, TargetSchedule, check_resolution
from lightning_muon.lightning import _compat


class NearTargetValidation(Callback):
    """Validate on the Trainer's grid of ``val_check_interval`` steps and, near ``target``, closing in on it (the
    last validations ``resolution`` times the steps done apart), as
    `lightning_muon.commands.compare.target.TargetSchedule` says.

    Steps are optimizer updates (``trainer.global_step``): with gradient accumulation the grid counts updates, not
    batches, and a validation never falls between the micro-batches of an update. The decision is the same on
    every rank (rank zero's validation loss is broadcast).

    Args:
        target: the loss to reach.
        resolution: the gap between validations near the target, as a fraction of the steps done.
        monitor: the logged validation loss.

    Examples:
        ```yaml
        trainer:
          val_check_interval: 25
          check_val_every_n_epoch: null
          callbacks:
            - class_path: lightning_muon.commands.compare.near_target.NearTargetValidation
              init_args: {target: 1.75, resolution: 0.02}
        ```
    """

    def __init__(self, target: float, resolution: float = RESOLUTION, monitor: str = "val_loss") -> None:
        check_resolution(resolution)
        self.target, self.resolution, self.monitor = float(target), resolution, monitor
        self.schedule: TargetSchedule | None = None
        self._step = 0
        self._warned = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        every = trainer.val_check_interval
        if not isinstance(every, int) or every < 1 or not _compat.validates_by_batches(trainer):
            raise MisconfigurationException(
                "NearTargetValidation counts validations in steps: give Trainer(val_check_interval=N) a number of "
                f"steps (N >= 1) and check_val_every_n_epoch=None, got val_check_interval={every!r}"
            )
        self.schedule = TargetSchedule(self.target, every, self.resolution)
        self._step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object,
                           batch: object, batch_idx: int) -> None:
        if self.schedule is None:
            return
        step = trainer.global_step
        due = step != self._step and self.schedule.due(step)  # a new update, and a validation is due after it
        self._step = step
        _compat.validate_after_this_batch(trainer, due)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.schedule is None or trainer.state.fn != TrainerFn.FITTING:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if not self._warned:
                rank_zero_warn(f"NearTargetValidation: the validation logged no {self.monitor!r}, so the fit "
                               "validates on its grid only")
                self._warned = True
            return
        loss = trainer.strategy.broadcast(float(value), src=0)
        self.schedule.record(trainer.global_step, loss)
