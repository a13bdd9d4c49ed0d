"""The lr schedulers of a `MuonMixin` fit: which factory schedules each optimizer (the shared ``lr_scheduler``, or
that optimizer's own ``muon_lr_scheduler`` / ``adamw_lr_scheduler``, which wins for its optimizer), the scheduler
configs built from them, and the check that a resume keeps the checkpoint's layout.

Lightning restores the saved scheduler states by position into the fit's schedulers: a resume whose schedulers
come from other arguments (a shared schedule saved, one per optimizer resumed, or the other way round) would load
one schedule's state into another schedule without an error, so it is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer

from lightning_muon.routing import ADAMW, MUON

#: The shared argument, and each optimizer's own (which replaces the shared one for that optimizer).
SHARED = "lr_scheduler"
OWN = {MUON: "muon_lr_scheduler", ADAMW: "adamw_lr_scheduler"}


def scheduler_source(settings: Mapping[str, Any], algorithm: str) -> str | None:
    """The argument whose factory schedules the ``algorithm`` optimizer under ``settings`` (a config's, or a
    checkpoint record's: `MuonConfig.to_hparams`; a record from before the per-optimizer arguments has none of
    them): its own, else the shared one, else ``None`` (a constant lr)."""
    for name in (OWN[algorithm], SHARED):
        if settings.get(name) is not None:
            return name
    return None


def layout(settings: Mapping[str, Any]) -> dict[str, str | None]:
    """Which argument schedules each optimizer (`scheduler_source`), Muon's (none for ``muon=None``) and AdamW's."""
    muon = scheduler_source(settings, MUON) if settings.get("muon", True) is not None else None
    return {MUON: muon, ADAMW: scheduler_source(settings, ADAMW)}


def _words(sources: Mapping[str, str | None]) -> str:
    return ", ".join(f"{algorithm} by {source or 'none (a constant lr)'}" for algorithm, source in sources.items())


def build_schedulers(factories: Mapping[str, Callable[..., Any] | None], optimizers: Mapping[str, Optimizer],
                     fit_length: Callable[[], float]) -> list[dict[str, Any]]:
    """One scheduler config (Lightning's dict) for each of ``optimizers`` (by algorithm, in their order) whose
    factory in ``factories`` (by algorithm: `MuonConfig.scheduler_factories`) is not ``None``.

    A factory may return a scheduler (stepped per update) or a Lightning scheduler dict
    (``{"scheduler": ..., "interval": "epoch", "frequency": 2, "monitor": "val_loss"}``; ``interval``
    defaults to ``"step"``). A ``ReduceLROnPlateau`` is stepped per epoch on its ``monitor`` (the dict's, or
    the scheduler's own attribute as ``lightning.pytorch.cli.ReduceLROnPlateau`` has it).
    A scheduler whose ``total_steps`` is ``None`` after construction (`lightning_muon.WarmupCosine`'s
    protocol) gets the fit's number of updates, ``fit_length()``.
    """
    schedulers = []
    for algorithm, optimizer in optimizers.items():
        factory = factories.get(algorithm)
        if factory is not None:
            schedulers.append(_scheduler_config(factory(optimizer), fit_length))
    return schedulers


def _scheduler_config(built: Any, fit_length: Callable[[], float]) -> dict[str, Any]:
    """What a factory returned, as Lightning's scheduler dict (see `build_schedulers`)."""
    config = dict(built) if isinstance(built, dict) else {"scheduler": built}
    scheduler = config["scheduler"]
    if getattr(scheduler, "total_steps", 0) is None:
        total = fit_length()
        if not math.isfinite(total):
            raise MisconfigurationException(
                f"{type(scheduler).__name__} needs the length of the fit, which is unbounded here: set "
                "Trainer(max_steps=...) or max_epochs, or give the scheduler total_steps=..."
            )
        scheduler.total_steps = int(total)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        config.setdefault("monitor", getattr(scheduler, "monitor", None))
        config.setdefault("interval", "epoch")
        if config["monitor"] is None:
            raise MisconfigurationException(
                "lr_scheduler builds a ReduceLROnPlateau but names no metric to monitor: use "
                "lightning.pytorch.cli.ReduceLROnPlateau(optimizer, monitor='val_loss', ...) or return "
                "{'scheduler': ReduceLROnPlateau(optimizer), 'monitor': 'val_loss'} from the factory."
            )
    config.setdefault("interval", "step")
    if config["interval"] not in ("step", "epoch"):
        raise MisconfigurationException(
            f"lr_scheduler's interval must be 'step' or 'epoch', got {config['interval']!r}"
        )
    return config


def check_layout(checkpoint: Mapping[str, Any], saved: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """Refuse a resume from ``checkpoint`` (its record: ``saved``) that holds scheduler states and whose fit takes
    each optimizer's schedule from other arguments than the checkpoint's (``settings``: the fit's,
    `MuonConfig.to_hparams`). A checkpoint without scheduler states (or a record without settings) passes: the
    fit's schedulers start afresh, as Lightning starts them."""
    then_settings = saved.get("settings")
    if not isinstance(then_settings, Mapping) or not checkpoint.get("lr_schedulers"):
        return
    then, now = layout(then_settings), layout(settings)
    if then == now:
        return
    raise MisconfigurationException(
        f"This checkpoint's lr schedules came from other arguments than this fit's: it was trained with "
        f"{_words(then)}; this fit gives {_words(now)}. Lightning restores the saved scheduler states by position, so "
        "one schedule's state would drive another. Resume with the checkpoint's arguments (the shared lr_scheduler, "
        "or muon_lr_scheduler / adamw_lr_scheduler, as it was trained), or start a new fit from these weights "
        "(model.load_state_dict(torch.load(path)['state_dict'])) without ckpt_path."
    )
