"""`MomentumSchedule` and `WeightDecaySchedule`: schedules of more than the lr, as callbacks.

Both set a param group's setting right before each update (``on_before_optimizer_step``: under `MuonMixin`
once per update for each of the pair, after the last micro-batch of an accumulated update; under automatic
optimization before each optimizer step), from the index of the update (``trainer.global_step``, the updates
already taken) and the group's own value as configured (its *base*, read before the fit's first update).

The bases are in the callback's ``state_dict``: a fit resumed from a checkpoint (whose optimizer groups hold the
last update's scheduled values, not the configured ones) sets the resumed update's values from them, so it ends
bit for bit where the uninterrupted fit ends. `MuonMonitor` logs the values they move, per group.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_muon.optim.groups import lr_value
from lightning_muon.optim.muon import Muon

__all__ = ["MomentumSchedule", "WeightDecaySchedule", "momentum_at"]


def group_kind(optimizer: Optimizer, group: dict[str, Any]) -> str:
    """What steps ``group``: its ``algorithm`` (a `MuonWithAdamW` group), else ``"muon"`` for a Muon optimizer,
    else the optimizer's class name in lower case (``"adamw"``)."""
    if "algorithm" in group:
        return str(group["algorithm"])
    if isinstance(optimizer, (Muon, torch.optim.Muon)):
        return "muon"
    return type(optimizer).__name__.lower()


def momentum_at(
    step: int, momentum: float, start: float, warmup_steps: int, end: float | None, cooldown_steps: int,
    total_steps: int,
) -> float:
    """The momentum of update ``step`` (0-based): ``start`` at update 0, rising linearly to ``momentum`` at update
    ``warmup_steps``; over the last ``cooldown_steps`` updates of ``total_steps`` falling linearly to ``end``, which
    the last update uses."""
    cooldown_start = total_steps - cooldown_steps
    if cooldown_steps and end is not None and step >= cooldown_start:
        fraction = min(1.0, (step - cooldown_start + 1) / cooldown_steps)
        return momentum + (end - momentum) * fraction
    if step < warmup_steps:
        return start + (momentum - start) * step / warmup_steps
    return momentum


class _GroupSchedule(Callback):
    """Sets ``hyperparameter`` of the groups `moves` picks, before each update, from their bases."""

    #: The param group key it sets.
    hyperparameter = ""

    def __init__(self) -> None:
        #: Per optimizer (in ``trainer.optimizers``' order), per group: the values it schedules from.
        self.bases: list[list[dict[str, float]]] = []

    def moves(self, optimizer: Optimizer, group: dict[str, Any]) -> bool:
        """Whether this schedule sets ``group``."""
        raise NotImplementedError

    def value(self, step: int, group: dict[str, Any], base: dict[str, float]) -> float:
        """The group's value for update ``step``."""
        raise NotImplementedError

    def _base(self, optimizer: Optimizer, group: dict[str, Any]) -> dict[str, float]:
        return {self.hyperparameter: float(group[self.hyperparameter])}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.bases = []  # a new fit reads its own; a resumed one gets the checkpoint's (restored after setup)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"bases": [[dict(b) for b in groups] for groups in self.bases]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.bases = [[dict(b) for b in groups] for groups in state_dict["bases"]]

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]
        raw = getattr(optimizer, "optimizer", optimizer)
        index = next(i for i, o in enumerate(optimizers) if o is raw)
        while len(self.bases) < len(optimizers):
            self.bases.append([])
        bases = self.bases[index]
        # (groups added since, by a finetuning callback, are read when first seen)
        bases += [self._base(raw, g) if self.moves(raw, g) else {} for g in raw.param_groups[len(bases):]]
        for group, base in zip(raw.param_groups, bases, strict=False):
            if base and self.moves(raw, group):
                group[self.hyperparameter] = self.value(trainer.global_step, group, base)


class MomentumSchedule(_GroupSchedule):
    """Warm Muon's momentum up from ``start`` to each group's configured ``momentum``, and cool it down at the end.

    Update ``k`` (0-based) uses ``start + (momentum - start) * k / warmup_steps`` while ``k < warmup_steps``, then
    the configured momentum; with ``cooldown_steps``, the last ``cooldown_steps`` updates fall linearly to ``end``
    (the fit's last update uses ``end``). Groups whose momenta differ keep their ratio: ``start`` and ``end`` are
    the values of the group with the largest configured momentum, the others scaled by theirs over it.

    Moves Muon groups only: those of a `lightning_muon.Muon` or ``torch.optim.Muon`` (`MuonMixin`'s first
    optimizer) and those of a `MuonWithAdamW` with ``algorithm: muon``; AdamW's betas stay as configured.

    ``warmup_steps`` and ``cooldown_steps`` take a number of updates (an int) or a fraction of the fit's (a float
    in (0, 1], as ``Trainer(val_check_interval=0.25)`` takes a fraction of an epoch): ``warmup_steps=0.1`` warms up
    over the first 10% of ``total_steps``, rounded to whole updates, so the schedule follows a fit's length.

    Args:
        start: the momentum of the first update (the modded-nanogpt speedrun: 0.85).
        warmup_steps: updates (or the fraction of the fit's) to reach the configured momentum (the speedrun:
            300); 0 for none.
        end: the momentum of the last update, with ``cooldown_steps``.
        cooldown_steps: updates (or the fraction of the fit's) at the end of the fit over which it falls to
            ``end``; 0 for none.
        total_steps: the fit's length in updates for the cooldown and the fractions; ``None``:
            ``trainer.estimated_stepping_batches``. A fit longer than it is warned about (the cooldown would end
            before the fit does).

    Examples:
        ```python
        trainer = L.Trainer(callbacks=[MomentumSchedule(start=0.85, warmup_steps=300)])
        # the speedrun's shape at any length: up over the first 10% of the updates, down over the last 10%
        recipe = MomentumSchedule(start=0.85, warmup_steps=0.1, end=0.85, cooldown_steps=0.1)
        ```
    """

    hyperparameter = "momentum"

    def __init__(
        self, start: float = 0.85, warmup_steps: int | float = 300, end: float | None = None,
        cooldown_steps: int | float = 0, total_steps: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("start", start), ("end", end)):
            if value is not None and not 0.0 <= value < 1.0:
                raise MisconfigurationException(f"MomentumSchedule: {name} must be in [0, 1), got {value!r}")
        for name, count in (("warmup_steps", warmup_steps), ("cooldown_steps", cooldown_steps)):
            whole = isinstance(count, int) and not isinstance(count, bool) and count >= 0
            if not whole and not (isinstance(count, float) and 0.0 < count <= 1.0):
                raise MisconfigurationException(
                    f"MomentumSchedule: {name} must be an int >= 0 (updates) or a float in (0, 1] (a fraction of the "
                    f"fit's updates), got {count!r}"
                )
        if cooldown_steps and end is None:
            raise MisconfigurationException(
                f"MomentumSchedule: cooldown_steps={cooldown_steps} needs the momentum to end at: give end=..."
            )
        if total_steps is not None and (isinstance(total_steps, bool) or total_steps < 1):
            raise MisconfigurationException(f"MomentumSchedule: total_steps must be >= 1 or None, got {total_steps!r}")
        self.start, self.warmup_steps, self.end = start, warmup_steps, end
        self.cooldown_steps, self.total_steps = cooldown_steps, total_steps
        self._total = total_steps or 0
        #: ``warmup_steps`` and ``cooldown_steps`` in updates of ``_total`` (set again at the fit's start).
        self._warmup, self._cooldown = self._updates()

    def _updates(self) -> tuple[int, int]:
        """``warmup_steps`` and ``cooldown_steps`` in updates: a fraction of ``_total``, rounded, or the count."""
        warmup, cooldown = (round(c * self._total) if isinstance(c, float) else c
                            for c in (self.warmup_steps, self.cooldown_steps))
        return warmup, cooldown

    @override
    def moves(self, optimizer: Optimizer, group: dict[str, Any]) -> bool:
        return "momentum" in group and group_kind(optimizer, group) == "muon"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        updates = trainer.estimated_stepping_batches
        fractions = [c for c in (self.warmup_steps, self.cooldown_steps) if isinstance(c, float)]
        if self.total_steps is None and not math.isfinite(updates) and (fractions or self.cooldown_steps):
            raise MisconfigurationException(
                "MomentumSchedule: a cooldown or a fraction of the fit needs the fit's length, and this fit has no "
                "end (no max_steps or max_epochs): give the Trainer max_steps, or MomentumSchedule total_steps."
            )
        self._total = self.total_steps or (int(updates) if math.isfinite(updates) else 0)
        self._warmup, self._cooldown = self._updates()
        if self._cooldown and self._warmup + self._cooldown > self._total:
            raise MisconfigurationException(
                f"MomentumSchedule: warmup_steps={self.warmup_steps} and cooldown_steps={self.cooldown_steps} "
                f"overlap in a fit of {self._total} updates: shorten them, or give a longer total_steps."
            )
        if self._cooldown and self.total_steps is not None and math.isfinite(updates) and updates > self._total:
            rank_zero_warn(
                f"MomentumSchedule: total_steps={self._total} is shorter than this fit's {int(updates)} updates: the "
                f"cooldown ends at update {self._total} and the momentum stays at end={self.end} after it. Give "
                f"total_steps={int(updates)}, or leave it None to end with the fit."
            )

    @override
    def value(self, step: int, group: dict[str, Any], base: dict[str, float]) -> float:
        reference = max(b["momentum"] for groups in self.bases for b in groups if b)
        scheduled = momentum_at(
            step, reference, self.start, self._warmup, self.end, self._cooldown, self._total
        )
        if base["momentum"] == reference:
            return scheduled
        return scheduled * base["momentum"] / reference


class WeightDecaySchedule(_GroupSchedule):
    """Weight decay that follows the lr schedule: each group's ``weight_decay`` is its configured weight decay
    times the group's current lr over its initial lr (``initial_lr``, which torch's lr schedulers write into the
    group, else the lr before the first update). With `WarmupCosine`, weight decay warms up and decays with it.

    A group whose initial lr is 0 keeps its weight decay.

    Args:
        optimizers: which groups: by `MuonWithAdamW`'s ``algorithm`` of a group, else by the optimizer
            (``"muon"`` for `lightning_muon.Muon` and ``torch.optim.Muon``, else its class name in lower case:
            ``"adamw"``). Default: both of `MuonMixin`'s pair.

    Examples:
        ```python
        trainer = L.Trainer(callbacks=[WeightDecaySchedule(optimizers=["muon"])])
        ```
    """

    hyperparameter = "weight_decay"

    def __init__(self, optimizers: list[str] | tuple[str, ...] = ("muon", "adamw")) -> None:
        super().__init__()
        if isinstance(optimizers, str) or not optimizers or not all(isinstance(o, str) for o in optimizers):
            raise MisconfigurationException(
                f"WeightDecaySchedule: optimizers must be a list of names such as ['muon', 'adamw'], got "
                f"{optimizers!r}"
            )
        self.optimizers = [o.lower() for o in optimizers]

    @override
    def moves(self, optimizer: Optimizer, group: dict[str, Any]) -> bool:
        return "weight_decay" in group and group_kind(optimizer, group) in self.optimizers

    @override
    def _base(self, optimizer: Optimizer, group: dict[str, Any]) -> dict[str, float]:
        initial = group.get("initial_lr", group["lr"])
        return {"weight_decay": float(group["weight_decay"]), "lr": lr_value(initial)}

    @override
    def value(self, step: int, group: dict[str, Any], base: dict[str, float]) -> float:
        if base["lr"] == 0:
            return base["weight_decay"]
        return base["weight_decay"] * lr_value(group["lr"]) / base["lr"]
