"""`FitState`: what one fit of a `MuonMixin` module holds beyond each batch.

``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)``, ``Trainer(accumulate_grad_batches=...)`` and a
``GradientAccumulationScheduler`` mean what they mean under automatic optimization, and the mixin's own
``gradient_clip_val`` and ``accumulate_grad_batches`` do the same: the fit takes the Trainer's flags off it (so
that Lightning's manual-optimization check lets them through), resolves them against the mixin's arguments, and
gives them back at its end. Given in both places with different values, the fit is refused before it trains,
naming both.

The mixin creates a `FitState` in ``configure_callbacks`` (the first hook of a fit) and drops it in
``teardown``; its methods are named after the hooks that call them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.lightning import _checkpoint, _checks, _compat
from lightning_muon.lightning._config import MuonConfig
from lightning_muon.lightning._first_batch import restore_roles_before_loading
from lightning_muon.lightning._update_loop import UpdateSettings

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch import LightningModule


class FitState:
    """One fit's settings and what it borrowed from the Trainer.

    Args:
        settings: what each update uses (clipping, the skip limit).
        accumulate_grad_batches: micro-batches per update (before a ``GradientAccumulationScheduler`` changes it
            at an epoch start).
        accumulation_scheduler: the ``GradientAccumulationScheduler`` taken off the Trainer, if one was given.
        trainer_flags: what the Trainer was given, put back at the end of the fit.
    """

    def __init__(
        self,
        settings: UpdateSettings,
        accumulate_grad_batches: int,
        accumulation_scheduler: GradientAccumulationScheduler | None,
        trainer_flags: _compat.TrainerFlags,
    ) -> None:
        self.settings = settings
        self.accumulate_grad_batches = accumulate_grad_batches
        self.accumulation_scheduler = accumulation_scheduler
        self.trainer_flags = trainer_flags
        #: The monitor-driven schedulers: id -> (metric, strict), which manual optimization would drop.
        self.monitors: dict[int, tuple[str, bool]] = {}

    @classmethod
    def configure_callbacks(cls, module: LightningModule, config: MuonConfig) -> FitState:
        """Before Lightning checks the fit: refuse what cannot work, take the Trainer's clipping and accumulation
        flags (and ``GradientAccumulationScheduler``) for the mixin, and resolve them against ``config``."""
        trainer = module.trainer
        _checks.check_callbacks(module, config.muon_enabled)
        _checkpoint.name_unreadable_checkpoints(trainer.strategy, restore_roles_before_loading)
        flags = _compat.take_trainer_flags(trainer)
        try:
            return resolve(config, flags)
        except Exception:
            _compat.restore_trainer_flags(trainer, flags)
            raise

    def accumulation_at(self, epoch: int) -> int:
        """Micro-batches per update during ``epoch``."""
        if self.accumulation_scheduler is None:
            return self.accumulate_grad_batches
        return self.accumulation_scheduler.get_accumulate_grad_batches(epoch)

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's loop already knows how to count accumulated batches (logger steps, validation zero_grad,
        ``estimated_stepping_batches``): give it the fit's number."""
        _compat.set_accumulate_grad_batches(trainer, self.accumulation_at(trainer.current_epoch))

    def configure_optimizers(self, schedulers: list[dict[str, Any]]) -> None:
        """Keep the monitor of each monitor-driven scheduler config (manual optimization drops it) for
        `on_fit_start`, taking it out of the config Lightning validates."""
        self.monitors = {
            id(c["scheduler"]): (c.pop("monitor"), c.pop("strict", True)) for c in schedulers if "monitor" in c
        }

    def on_fit_start(self, module: LightningModule, own_classes: Sequence[type], lrs_given: bool) -> None:
        """Give the monitor-driven schedulers back their metric; say what the parent's ``configure_optimizers``
        (the first of ``own_classes`` that defines it) would have built (``lrs_given``: the user chose the lrs)."""
        for config in module.trainer.lr_scheduler_configs:
            monitor = self.monitors.get(id(config.scheduler))
            if monitor is not None:
                config.reduce_on_plateau, (config.monitor, config.strict) = True, monitor
        _checks.tell_replaced(module, own_classes, lrs_given)

    def on_train_epoch_start(self, trainer: pl.Trainer) -> None:
        """A ``GradientAccumulationScheduler``'s number for this epoch (what the callback itself would set)."""
        if self.accumulation_scheduler is not None:
            _compat.set_accumulate_grad_batches(trainer, self.accumulation_at(trainer.current_epoch))

    def teardown(self, trainer: pl.Trainer) -> float | None:
        """Give the Trainer its flags back; return ``lr_find``'s suggestion, if this fit ran one that writes
        its suggestion back (``None`` otherwise)."""
        _compat.restore_trainer_flags(trainer, self.trainer_flags)
        finders = _compat.lightning_classes(LearningRateFinder)
        finder = next((c for c in _compat.trainer_callbacks(trainer) if isinstance(c, finders)), None)
        if finder is None or finder.optimal_lr is None or not _compat.lr_finder_updates_attr(finder):
            return None
        return finder.optimal_lr.suggestion()


def resolve(config: MuonConfig, flags: _compat.TrainerFlags) -> FitState:
    """The fit's state from the mixin's arguments and the Trainer's flags taken off it; a
    `MisconfigurationException` naming both values where the Trainer and the mixin disagree."""
    schedulers = [c for _, c in flags.accumulation_schedulers]
    if len(schedulers) > 1:
        raise MisconfigurationException(
            f"{len(schedulers)} GradientAccumulationScheduler callbacks were given; keep one."
        )
    scheduler = schedulers[0] if schedulers else None
    own_n, trainer_n = config.accumulate_grad_batches, flags.accumulate_grad_batches
    if scheduler is not None and own_n != 1:
        raise MisconfigurationException(
            f"GradientAccumulationScheduler(scheduling={scheduler.scheduling}) and MuonMixin(accumulate_grad_batches="
            f"{own_n}) both set the accumulation: keep one of them."
        )
    if own_n != 1 and trainer_n != 1 and own_n != trainer_n:
        raise MisconfigurationException(
            f"Trainer(accumulate_grad_batches={trainer_n}) and MuonMixin(accumulate_grad_batches={own_n}) disagree: "
            "give the number of micro-batches per update in one place (either works)."
        )
    clip, algorithm = _resolve_clipping(config.gradient_clip_val, flags)
    settings = UpdateSettings(clip, algorithm, config.max_consecutive_skips)
    return FitState(settings, own_n if own_n != 1 else trainer_n, scheduler, flags)


def _resolve_clipping(own_clip: float | None, flags: _compat.TrainerFlags) -> tuple[float | None, str]:
    """The clip value and algorithm, from the mixin's ``gradient_clip_val`` and the Trainer's two flags."""
    trainer_clip = flags.gradient_clip_val
    algorithm = flags.gradient_clip_algorithm or "norm"
    if trainer_clip is not None and not trainer_clip > 0:
        trainer_clip = None  # Lightning reads gradient_clip_val=0 as "no clipping"
    if own_clip is not None and trainer_clip is not None and (own_clip != trainer_clip or algorithm != "norm"):
        raise MisconfigurationException(
            f"Trainer(gradient_clip_val={trainer_clip}, gradient_clip_algorithm={algorithm!r}) and MuonMixin("
            f"gradient_clip_val={own_clip}) (a global norm) disagree: give the clipping in one place."
        )
    if trainer_clip is None and flags.gradient_clip_algorithm is not None and own_clip is not None:
        algorithm = flags.gradient_clip_algorithm  # Trainer(gradient_clip_algorithm=...) with the mixin's value
        if algorithm != "norm":
            raise MisconfigurationException(
                f"Trainer(gradient_clip_algorithm={algorithm!r}) with MuonMixin(gradient_clip_val={own_clip}): the "
                f"mixin's value is a norm. Use Trainer(gradient_clip_val={own_clip}, gradient_clip_algorithm="
                f"{algorithm!r}) instead."
            )
    return own_clip if own_clip is not None else trainer_clip, algorithm
