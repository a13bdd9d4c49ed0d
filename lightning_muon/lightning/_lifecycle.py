"""What `MuonMixin` does around one fit, beyond each batch: take the Trainer's flags (and give them back),
follow a ``GradientAccumulationScheduler``, step the schedulers Lightning would step between batches, and keep
``lr_find``'s suggestion for the next fit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.lightning import _checks, _compat
from lightning_muon.lightning._fit_settings import resolve
from lightning_muon.lightning._schedulers import step_schedulers

if TYPE_CHECKING:
    from lightning_muon.lightning.mixin import MuonMixin


def begin_fit(module: MuonMixin) -> None:
    """Before Lightning checks the fit: refuse what cannot work, take the Trainer's clipping and accumulation
    flags (and ``GradientAccumulationScheduler``) for the mixin, and resolve them against its own arguments."""
    trainer = module.trainer
    _checks.check_callbacks(module, module.muon_enabled)
    _compat.name_unreadable_checkpoints(trainer.strategy)
    flags = _compat.take_trainer_flags(trainer)
    try:
        module._muon_loop.settings = resolve(module._muon_config, flags)
    except Exception:
        _compat.restore_trainer_flags(trainer, flags)
        raise
    module._muon_loop.trainer_flags = flags


def setup_fit(module: MuonMixin) -> None:
    """Lightning's loop already knows how to count accumulated batches (logger steps, validation zero_grad,
    ``estimated_stepping_batches``): give it the fit's number."""
    loop = module._muon_loop
    _compat.set_accumulate_grad_batches(module.trainer, loop.settings.accumulation_at(module.trainer.current_epoch))


def build_optimizers(module: MuonMixin) -> Any:
    """``[muon, adamw]`` over the routed param groups (only AdamW when ``muon=None``), with their schedulers."""
    routing, config = module.muon_routing(), module._muon_config
    if not routing.routes:
        raise MisconfigurationException(
            f"{type(module).__name__} has no trainable parameter: every parameter has requires_grad=False (or the "
            "layers are built after the optimizers). Unfreeze what should train (`layer.requires_grad_(True)`), "
            "or build the layers in __init__ or configure_model."
        )
    rank_zero_info("\n" + routing.render())
    if module.muon_enabled and not routing.muon_groups:
        rank_zero_warn("MuonMixin: no parameter was routed to Muon; only AdamW will train this model.")
    optimizers = [config.build_adamw(routing.adamw_groups)]
    if routing.muon_groups:
        optimizers.insert(0, config.build("muon", routing.muon_groups))
    if config.lr_scheduler_factory is None:
        return optimizers
    schedulers = config.build_schedulers(optimizers, lambda: module.trainer.estimated_stepping_batches)
    # Manual optimization drops a scheduler's monitor: kept here for `start_fit`.
    module._muon_loop.monitors = {
        id(c["scheduler"]): (c.pop("monitor"), c.pop("strict", True)) for c in schedulers if "monitor" in c
    }
    return optimizers, schedulers


def start_fit(module: MuonMixin, mixin: type[MuonMixin]) -> None:
    """At fit start: the monitor-driven schedulers get back the metric manual optimization dropped; say once
    what the parent's ``configure_optimizers`` would have built."""
    for config in module.trainer.lr_scheduler_configs:
        monitor = module._muon_loop.monitors.get(id(config.scheduler))
        if monitor is not None:
            config.reduce_on_plateau, (config.monitor, config.strict) = True, monitor
    if not module._muon_loop.told_replaced:
        module._muon_loop.told_replaced = True
        _checks.tell_replaced(module, mixin)


def start_epoch(module: MuonMixin) -> None:
    """A ``GradientAccumulationScheduler``'s number for this epoch (what the callback itself would set)."""
    settings = module._muon_loop.settings
    if settings.accumulation_scheduler is not None:
        _compat.set_accumulate_grad_batches(module.trainer, settings.accumulation_at(module.trainer.current_epoch))


def end_epoch(module: MuonMixin) -> None:
    """After ``on_train_epoch_end``: the last update's and the epoch's monitor-driven schedulers."""
    module._muon_loop.step_pending_plateau(module)
    trainer = module.trainer
    if _compat.ends_epoch(trainer):
        step_schedulers(module, interval="epoch", plateau=True, index=trainer.current_epoch + 1)


def end_fit(module: MuonMixin) -> None:
    """Give the Trainer its flags back; keep ``lr_find``'s suggestion as AdamW's lr (``muon=None``)."""
    trainer, loop = module.trainer, module._muon_loop
    finder = next((c for c in _compat.trainer_callbacks(trainer) if isinstance(c, LearningRateFinder)), None)
    if finder is not None and finder.optimal_lr is not None and _compat.lr_finder_updates_attr(finder):
        lr = finder.optimal_lr.suggestion()
        if lr is not None and not module.muon_enabled:
            module._muon_config = loop.config = module._muon_config.with_adamw_lr(lr)
            module.hparams["adamw"] = module._muon_config.adamw
            rank_zero_info(f"MuonMixin: lr_find's suggestion, lr={lr:g}, is AdamW's lr from the next fit on.")
    if loop.trainer_flags is not None:
        _compat.restore_trainer_flags(trainer, loop.trainer_flags)
        loop.trainer_flags = None
    else:
        _compat.set_accumulate_grad_batches(trainer, 1)
