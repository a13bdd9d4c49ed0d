"""`MuonMonitor`: what Muon does, in the logger.

Every ``log_every_n_steps`` updates it logs, in `LearningRateMonitor`'s key scheme:

- ``lr-<OptimizerClass>/<group name>`` for every param group of every
  optimizer (``lr-Muon/hidden``, ``lr-AdamW/embeddings``; ``pgN`` for unnamed
  groups, no suffix for a lone unnamed group, ``-1``, ``-2`` when a class repeats),
  unless a ``LearningRateMonitor`` is among the callbacks: it logs these keys
  itself, so the monitor leaves them out (and says so once, at INFO);
- ``muon/effective_lr_min`` and ``muon/effective_lr_max``: the learning rates
  Muon's matrices really get after the shape adjustment;
- ``muon/orthogonality_error`` (mean over the diagnosed matrices) and
  ``muon/orthogonality_error_max``: for the update ``O`` of one matrix,
  ``||O O^T - I_r||_F / sqrt(r)`` with ``r = min(m, n)``;
- ``muon/update_rms``: RMS of the applied update (``effective_lr * O``);
- with NorMuon (``normuon_beta2``), from the optimizer's state after the step:
  ``muon/normuon_second_moment`` (the mean over every neuron of its running mean
  squared update ``v``) and ``muon/normuon_row_scale_ratio`` (per matrix, the
  largest over the smallest ``1 / (sqrt(v) + 1e-8)``, averaged over matrices:
  how unequally NorMuon scales the rows; 1 would mean it changes nothing);
- ``momentum-Muon/<group>`` and ``weight_decay-<OptimizerClass>/<group>`` (the ``lr-*`` key with ``momentum``
  or ``weight_decay`` in place of ``lr``) for every group a `MomentumSchedule` or `WeightDecaySchedule` among the
  callbacks moves: the value the update used, on every row the monitor writes (a setting no schedule moves stays
  as configured and is not logged);
- ``muon/skipped_steps`` once `MuonMixin` has skipped an update: the mixin's count
  (``muon_skipped_updates``), which the mixin logs itself at the trainer's
  ``log_every_n_steps``; the monitor writes it into its own rows too, so every
  row it writes is complete at the monitor's own interval.

The orthogonality numbers come from `lightning_muon.Muon` itself (also the one
inside a `lightning_muon.MuonWithAdamW`, under automatic optimization), which
records them during the logging step only (one ``r x r`` Gram matrix per
matrix, nothing on other steps). For an optimizer that cannot report
(``torch.optim.Muon``) the monitor recomputes the update from the gradient and
momentum buffer before the step: one extra Newton-Schulz per diagnosed matrix
on logging steps. The values are reduced across ranks with torchmetrics.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_muon.callbacks._checks import check_optional_count, require_logger
from lightning_muon.callbacks.metrics import OrthogonalityError, UpdateRMS
from lightning_muon.callbacks.schedules import _GroupSchedule
from lightning_muon.combined import MuonWithAdamW
from lightning_muon.lightning import SKIPPED_STEPS_KEY, _compat
from lightning_muon.lightning.mixin import MuonMixin
from lightning_muon.optim import ParamDiagnostics, preview_update
from lightning_muon.optim.groups import (
    NAME,
    NORMUON_EPS,
    SECOND_MOMENT,
    group_effective_lr,
    group_effective_lrs,
    lr_value,
)
from lightning_muon.optim.muon import Muon
from lightning_muon.optim.newton_schulz import orthogonality_error

__all__ = ["MuonMonitor"]


def lr_keys(optimizers: list[Optimizer]) -> list[list[str]]:
    """Logger keys for every param group, exactly as ``LearningRateMonitor`` names them."""
    seen: defaultdict[type, int] = defaultdict(int)
    keys = []
    for optimizer in optimizers:
        seen[type(optimizer)] += 1
        name = f"lr-{type(optimizer).__name__}"
        if seen[type(optimizer)] > 1:
            name += f"-{seen[type(optimizer)] - 1}"
        groups = optimizer.param_groups
        names = [g.get(NAME) for g in groups]
        duplicates = {n for n in names if n is not None and names.count(n) > 1}
        if duplicates:
            raise MisconfigurationException(
                f"{name} has several param groups named {sorted(duplicates)}; give each group its own name."
            )
        if len(groups) > 1:
            keys.append([f"{name}/{n or f'pg{i + 1}'}" for i, n in enumerate(names)])
        else:
            keys.append([f"{name}/{names[0]}" if names[0] else name])
    return keys


def _is_muon(optimizer: Optimizer) -> bool:
    return isinstance(optimizer, (Muon, torch.optim.Muon))


def _muon_of(optimizer: Optimizer) -> Optimizer:
    """The Muon that steps ``optimizer``'s Muon groups: the one inside a `MuonWithAdamW` (when it has Muon
    groups), else the optimizer itself."""
    if isinstance(optimizer, MuonWithAdamW) and optimizer.muon is not None:
        return optimizer.muon
    return optimizer


def _normuon_metrics(optimizers: list[Optimizer]) -> dict[str, float]:
    """The NorMuon keys from the second moments the optimizers hold (none without a NorMuon group). Every rank
    holds every row's statistic (a plain tensor, whole on every rank, under every strategy), so no reduction."""
    moments = [
        optimizer.state[p][SECOND_MOMENT]
        for optimizer in optimizers
        for group in optimizer.param_groups
        if group.get("normuon_beta2") is not None
        for p in group["params"]
        if SECOND_MOMENT in optimizer.state[p]
    ]
    if not moments:
        return {}
    scales = [1 / (v.float().sqrt() + NORMUON_EPS) for v in moments]
    ratios = torch.stack([scale.max() / scale.min() for scale in scales])
    return {
        "muon/normuon_second_moment": torch.cat([v.float().flatten() for v in moments]).mean().item(),
        "muon/normuon_row_scale_ratio": ratios.mean().item(),
    }


@dataclass
class _Pending:
    """What a logging update gathers before its batch ends and the row is written."""

    #: The update's logger step.
    step: int
    #: The learning rates it uses, by logger key (schedulers step after it).
    lrs: dict[str, float]
    #: The `Muon` optimizers asked to record their diagnostics during its step.
    reporting: list[Muon] = field(default_factory=list)
    #: The diagnostics recomputed before its step, for optimizers that cannot report (``torch.optim.Muon``).
    recomputed: list[ParamDiagnostics] = field(default_factory=list)


class MuonMonitor(Callback):
    """Log per-group learning rates, Muon's effective learning rates and how orthogonal its updates are.

    Args:
        log_every_n_steps: log after every this many updates (default: the
            trainer's ``log_every_n_steps``). Steps count updates, as
            ``trainer.global_step`` does under `MuonMixin`.
        orthogonality: diagnose the orthogonality error and update RMS.
        per_parameter: also log ``muon/orthogonality_error/<parameter name>``
            for every diagnosed matrix.
        sample: diagnose at most this many matrices per logging step (a window
            that moves on each time, so all are covered over time); ``None``
            diagnoses every Muon matrix.

    Examples:
        ```python
        trainer = L.Trainer(callbacks=[MuonMonitor(log_every_n_steps=10)])
        ```
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        orthogonality: bool = True,
        per_parameter: bool = False,
        sample: int | None = None,
    ) -> None:
        check_optional_count("log_every_n_steps", log_every_n_steps)
        check_optional_count("sample", sample)
        self.log_every_n_steps = log_every_n_steps
        self.orthogonality = orthogonality
        self.per_parameter = per_parameter
        self.sample = sample
        self._pending: _Pending | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        require_logger(trainer, "MuonMonitor")
        self._every = self.log_every_n_steps or _compat.log_every_n_steps(trainer)
        self._optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]
        lr_keys(self._optimizers)  # duplicate group names fail here, before training
        # Beside a LearningRateMonitor, which logs the same lr-* keys, only the monitor's own keys.
        lr_monitors = _compat.lightning_classes(LearningRateMonitor)
        self._log_lrs = not any(isinstance(c, lr_monitors) for c in _compat.trainer_callbacks(trainer))
        if not self._log_lrs:
            rank_zero_info(
                "MuonMonitor: LearningRateMonitor logs the lr-* keys, so MuonMonitor leaves them out of its rows."
            )
        self._muon = [_muon_of(o) for o in self._optimizers if _is_muon(_muon_of(o))]
        baseline = isinstance(pl_module, MuonMixin) and not pl_module.muon_enabled
        if not self._muon and not baseline:
            # (no warning for MuonMixin's muon=None baseline, where no Muon is the point)
            rank_zero_warn(
                "MuonMonitor found no Muon optimizer (lightning_muon.Muon, torch.optim.Muon or a MuonWithAdamW "
                "with Muon groups), so it logs "
                "learning rates only. Train with MuonMixin (muon=...) to see Muon's diagnostics."
            )
        self._names = {id(p): n for n, p in pl_module.named_parameters()}
        self._schedules = [c for c in _compat.trainer_callbacks(trainer) if isinstance(c, _GroupSchedule)]
        self._error = OrthogonalityError().to(pl_module.device)
        self._rms = UpdateRMS().to(pl_module.device)
        self._round = 0

    # ------------------------------------------------------------- collecting

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        optimizer = _muon_of(getattr(optimizer, "optimizer", optimizer))
        step = _compat.logger_step(trainer)  # index of this update, as loggers count
        if (step + 1) % self._every:
            return
        if self._pending is None or self._pending.step != step:
            self._pending = _Pending(step, self._learning_rates())
        if not (self.orthogonality and _is_muon(optimizer)):
            return
        chosen = self._choose(optimizer)
        if isinstance(optimizer, Muon):
            optimizer.clear_diagnostics()
            optimizer.record_diagnostics(chosen)
            self._pending.reporting.append(optimizer)
        else:
            self._pending.recomputed += self._recompute(optimizer, chosen)

    def _learning_rates(self) -> dict[str, float]:
        metrics = {}
        # Keys read afresh: the first training batch may move parameters between groups (MuonMixin's routing).
        for optimizer, keys in zip(self._optimizers, lr_keys(self._optimizers), strict=True):
            for group, key in zip(optimizer.param_groups, keys, strict=True):
                if self._log_lrs:
                    metrics[key] = lr_value(group["lr"])
        effective = [lr for optimizer in self._muon for g in optimizer.param_groups for lr in group_effective_lrs(g)]
        if effective:
            metrics["muon/effective_lr_min"] = min(effective)
            metrics["muon/effective_lr_max"] = max(effective)
        return metrics

    def _scheduled(self) -> dict[str, float]:
        """The settings the schedule callbacks move, per group (what the update used: they change before steps)."""
        metrics = {}
        for schedule in self._schedules:
            for optimizer, keys in zip(self._optimizers, lr_keys(self._optimizers), strict=True):
                for group, key in zip(optimizer.param_groups, keys, strict=True):
                    if schedule.moves(optimizer, group):
                        name = schedule.hyperparameter + key.removeprefix("lr")
                        metrics[name] = float(group[schedule.hyperparameter])
        return metrics

    def _choose(self, optimizer: Optimizer) -> list[Tensor]:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.sample is None or self.sample >= len(params):
            return params
        start = (self._round * self.sample) % len(params)
        return [params[(start + i) % len(params)] for i in range(self.sample)]

    def _recompute(self, optimizer: Optimizer, chosen: list[Tensor]) -> list[ParamDiagnostics]:
        """The update ``torch.optim.Muon`` is about to make, from its gradient and momentum buffer."""
        chosen_ids = {id(p) for p in chosen}
        results = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in chosen_ids or p.grad is None:
                    continue
                update = preview_update(group, p.grad, optimizer.state[p].get("momentum_buffer"))
                effective_lr = group_effective_lr(group, p.shape)
                rms = update.square().mean().sqrt() * effective_lr
                name = self._names.get(id(p), "?")
                results.append(ParamDiagnostics(name, tuple(p.shape), effective_lr, orthogonality_error(update), rms))
        return results

    # ---------------------------------------------------------------- logging

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        metrics = dict(pending.lrs)
        diagnosed = list(pending.recomputed)
        for optimizer in pending.reporting:
            diagnosed += optimizer.diagnostics
            optimizer.clear_diagnostics()  # a skipped update leaves its request unanswered: drop it
        if self.orthogonality and self._muon:
            self._round += 1
            device = self._error.device
            empty = torch.zeros(0, device=device)
            errors = torch.stack([d.orthogonality_error for d in diagnosed]).to(device) if diagnosed else empty
            rms = torch.stack([d.update_rms for d in diagnosed]).to(device) if diagnosed else empty
            numel = torch.tensor([math.prod(d.shape) for d in diagnosed], dtype=torch.long, device=device)
            self._error.reset()
            self._rms.reset()
            self._error.update(errors)
            self._rms.update(rms, numel)
            mean, largest = self._error.compute()  # collective: every rank gets here
            if bool(torch.isfinite(mean)):  # NaN when no rank diagnosed anything
                metrics["muon/orthogonality_error"] = mean.item()
                metrics["muon/orthogonality_error_max"] = largest.item()
                metrics["muon/update_rms"] = self._rms.compute().item()
            if self.per_parameter:
                for d in diagnosed:
                    metrics[f"muon/orthogonality_error/{d.name}"] = d.orthogonality_error.item()
        metrics.update(_normuon_metrics(self._muon))
        metrics.update(self._scheduled())
        if isinstance(pl_module, MuonMixin) and pl_module.muon_skipped_updates:
            metrics[SKIPPED_STEPS_KEY] = float(pl_module.muon_skipped_updates)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=pending.step)
