"""Checks that keep a run from training wrongly without a word: weights that an update made non-finite, and
a 16-mixed run whose every update the GradScaler skips.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_muon.optim.norms import is_finite, total_norm

#: A GradScaler scale below this means the loss is scaled DOWN: the gradients are not overflowing now and
#: then, every update is being skipped (from the default 2**16 it takes 17 overflows in a row).
SCALE_FLOOR = 1.0
#: Skipped updates in a row after which a warning says where this is heading (early fp16 overflows are normal).
WARN_AFTER = 5


def _shown(names: list[str]) -> str:
    return ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")


def check_weights_finite(optimizers: list[Optimizer], module: nn.Module) -> None:
    """After an update: refuse to go on when a parameter became non-finite, naming it, its optimizer and lr.

    One fused norm over all parameters (and one device sync); per-parameter checks only when it is bad.
    """
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    if not params or bool(torch.isfinite(total_norm(params))):
        return
    names = {id(p): n for n, p in module.named_parameters()}
    bad = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not is_finite(p):
                    bad.append(f"{names.get(id(p), '?')} ({type(optimizer).__name__}, lr {float(group['lr']):g})")
    if not bad:  # every element finite, the norm overflowed its dtype
        return
    raise RuntimeError(
        f"The update just made turned weights non-finite, from finite gradients: {_shown(bad)}. The learning rate "
        "is far too large for these weights (or the optimizer's settings diverge); lower it."
    )


class ScalerWatch:
    """Consecutive updates the GradScaler skipped (16-mixed), and the stop when the scale has collapsed."""

    def __init__(self) -> None:
        self.consecutive = 0

    def after_update(self, skipped: bool, scale: float, losses: list[Tensor]) -> None:
        """Count a skipped (or not) update; stop once the scale is below `SCALE_FLOOR`, naming the cause."""
        self.consecutive = self.consecutive + 1 if skipped else 0
        if self.consecutive == WARN_AFTER:
            warnings.warn(
                f"16-mixed: the GradScaler skipped {WARN_AFTER} updates in a row (scale now {scale:g}); if it goes "
                f"on, the fit stops once the scale is below {SCALE_FLOOR:g}.",
                stacklevel=2,
            )
        if not skipped or scale >= SCALE_FLOOR:
            return
        nan_loss = any(not bool(torch.isfinite(loss).all()) for loss in losses)
        cause = (
            "the loss itself is NaN or inf (the data, the model's forward or the loss function)"
            if nan_loss
            else "the gradients overflow fp16 at every scale (values too large for fp16: try bf16-mixed)"
        )
        raise RuntimeError(
            f"16-mixed: the GradScaler skipped the last {self.consecutive} updates and its scale fell to {scale:g}, "
            f"so no weight has changed for {self.consecutive} updates: {cause}."
        )
