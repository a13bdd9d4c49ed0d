"""Learning-rate schedules for the pair of optimizers (one scheduler per optimizer)."""

from __future__ import annotations

import math
import warnings

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["WarmupCosine"]


class WarmupCosine(LambdaLR):
    """Linear warmup (``lr * k / warmup_steps`` on update ``k``), then a cosine decay to ``min_lr_ratio`` x lr.

    torch's ``SequentialLR(LinearLR, CosineAnnealingLR)`` is the same curve, but needs the total length when
    it is built; this one takes ``total_steps=None`` and lets `MuonMixin` fill in the fit's length later (any
    scheduler with a ``total_steps`` attribute that is ``None`` after construction gets the same).

    Args:
        optimizer: the optimizer.
        warmup_steps: updates of linear warmup.
        total_steps: length of the whole schedule in updates. ``None`` lets
            `MuonMixin` fill in ``trainer.estimated_stepping_batches`` (the
            number of updates of the fit) before the first step; a fit resumed
            from a checkpoint with another length then keeps its own length
            (with a warning), so an extended run does not train at the final lr.
        min_lr_ratio: the final lr as a fraction of the base lr.
        last_epoch: the index of the last update taken (``-1``: a new schedule), as torch's schedulers take it.

    Examples:
        `MuonMixin`'s ``lr_scheduler``, among the model's ``init_args`` in a config (applied to both optimizers;
        ``muon_lr_scheduler`` or ``adamw_lr_scheduler`` for one of them):

        ```yaml
        lr_scheduler:
          class_path: lightning_muon.WarmupCosine
          init_args: {warmup_steps: 100}
        ```
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps must be >= 1 or None, got {total_steps}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        #: Whether the length comes from the fit (``total_steps=None`` here), not from the user.
        self.total_from_fit = total_steps is None
        self.min_lr_ratio = min_lr_ratio
        self._warned_past_end = False
        super().__init__(optimizer, self.factor, last_epoch)

    def factor(self, step: int) -> float:
        """The multiplier of the base lr after ``step`` updates."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        if step > self.total_steps and self.min_lr_ratio == 0.0 and not self._warned_past_end:
            self._warned_past_end = True
            warnings.warn(
                f"WarmupCosine is past its total_steps={self.total_steps} (update {step}): the lr stays at "
                "min_lr_ratio * lr = 0 from here and nothing trains. Give total_steps=None (the fit's length) or a "
                "longer total_steps, or a min_lr_ratio > 0.",
                stacklevel=2,
            )
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def state_dict(self) -> dict:
        # LambdaLR would try to save the bound method; everything it needs is in plain attributes.
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}

    def load_state_dict(self, state_dict: dict) -> None:
        fit_total = self.total_steps if self.total_from_fit else None
        self.__dict__.update(state_dict)
        saved = state_dict.get("total_steps")
        if fit_total is not None and self.total_from_fit and saved != fit_total:
            # A resumed fit of another length (max_steps raised to extend a run): the schedule follows this fit.
            warnings.warn(
                f"WarmupCosine: the checkpoint's schedule was {saved} updates long, this fit is {fit_total}: the "
                f"cosine now runs to update {fit_total}, from the restored update {self.last_epoch}. Give "
                "total_steps explicitly to keep a fixed schedule.",
                stacklevel=2,
            )
            self.total_steps = fit_total
            # The optimizer's restored lrs are the old schedule's (0 at its end): set this update's.
            lrs = [base * self.factor(self.last_epoch) for base in self.base_lrs]
            # (the groups it was built with come first; any added later, by a finetuning callback, keep theirs)
            for group, lr in zip(self.optimizer.param_groups[: len(lrs)], lrs, strict=True):
                group["lr"] = lr
            self._last_lr = lrs
