"""torchmetrics `Metric`s for Muon's diagnostics, reduced across ranks.

Under DDP each rank may diagnose a different share of the matrices; these
metrics sum (or max) their states over all ranks, so a logged value covers
every matrix. Every rank must call ``compute()`` (it is a collective).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


class OrthogonalityError(Metric):
    """Mean and max of per-matrix orthogonality errors ``||O O^T - I_r||_F / sqrt(r)``."""

    full_state_update = False
    total: Tensor
    count: Tensor
    largest: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("largest", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, errors: Tensor) -> None:
        """Add the errors of some matrices (a 1D tensor; empty is fine)."""
        errors = errors.detach().reshape(-1).to(self.total.device, torch.float64)
        self.total += errors.sum()
        self.count += errors.numel()
        if errors.numel():
            self.largest = torch.maximum(self.largest, errors.max())

    def compute(self) -> tuple[Tensor, Tensor]:
        """``(mean, max)`` over every matrix seen on every rank (NaN when none was)."""
        mean = self.total / self.count if self.count > 0 else torch.tensor(float("nan"), device=self.total.device)
        return mean, self.largest


class UpdateRMS(Metric):
    """RMS over all elements of the applied updates (``effective_lr * O`` of each matrix)."""

    full_state_update = False
    sum_squares: Tensor
    numel: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("sum_squares", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("numel", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, rms: Tensor, numel: Tensor) -> None:
        """Add matrices by their update RMS and element counts (1D tensors of the same length)."""
        rms = rms.detach().reshape(-1).to(self.sum_squares.device, torch.float64)
        numel = numel.reshape(-1).to(self.sum_squares.device)
        self.sum_squares += (rms.square() * numel).sum()
        self.numel += numel.sum()

    def compute(self) -> Tensor:
        if self.numel == 0:
            return torch.tensor(float("nan"), device=self.sum_squares.device)
        return (self.sum_squares / self.numel).sqrt()
