"""QK-Clip (Kimi K2's MuonClip rule) on one attention's weights, in whatever layout they are stored.

After an update, every query head ``h`` whose maximum logit ``S_h`` (measured in that step's forward) is above
``tau`` has ``gamma_h = tau / S_h``; heads at or under ``tau`` have ``gamma_h = 1``.

- Without GQA (one key head per query head) the head's query rows and key rows (biases too) are each multiplied
  by ``sqrt(gamma_h)``, so its next logits are ``gamma_h`` times these: capped at ``tau``.
- A key head shared by a group of query heads (GQA, MQA) is multiplied by ``sqrt(min gamma)`` over its group
  (the factor of the group's largest logit) and each query head by its own ``sqrt(gamma_h)``. Every factor is at
  most 1 (no weight ever grows), every head ends at or under ``tau`` (the group's largest exactly at it), and the
  query rows of an unclipped head are untouched; its logits still shrink with the shared key (by
  ``sqrt(min gamma)``), the price of not enlarging any weight.

Heads with ``gamma = 1`` are multiplied by exactly 1.0, which leaves every bit as it was, so the whole clip is a
few elementwise products on device with no host sync. A non-finite ``S_h`` (an overflowed forward) clips nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_muon.attention.layout import QKLayout, QKProjection
from lightning_muon.optim._dtensor import is_dtensor, local_slices

__all__ = ["clip_factors", "qk_clip_"]


def clip_factors(layout: QKLayout, max_logits: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    """The factors for the query heads ``(num_heads,)`` and key heads ``(num_kv_heads,)``, float32, all <= 1."""
    s = max_logits.float()
    if s.shape != (layout.num_heads,):
        raise ValueError(f"max_logits must have shape ({layout.num_heads},), got {tuple(s.shape)}")
    over = torch.isfinite(s) & (s > tau)
    gamma = torch.where(over, tau / torch.where(over, s, torch.ones_like(s)), torch.ones_like(s))
    query = gamma.sqrt()
    key = gamma.view(layout.num_kv_heads, layout.group_size).amin(dim=1).sqrt()
    return query, key


def _scale_heads_(proj: QKProjection, factors: Tensor, head_dim: int) -> None:
    rows = factors.repeat_interleave(head_dim)
    shape = (-1, 1) if proj.out_dim == 0 else (1, -1)
    _scale_(proj.weight, proj.out_dim, proj.offset, rows, shape)
    if proj.bias is not None:
        _scale_(proj.bias, 0, proj.bias_start, rows, (-1,))


def _scale_(tensor: Tensor, dim: int, start: int, rows: Tensor, shape: tuple[int, ...]) -> None:
    """Multiply ``tensor``'s entries ``start .. start + len(rows)`` along ``dim`` by ``rows``; a DTensor (FSDP2,
    tensor parallelism) on this rank's shard, by the factors of the entries it holds."""
    if not is_dtensor(tensor):
        tensor.narrow(dim, start, rows.numel()).mul_(rows.to(tensor.dtype).view(shape))
        return
    full = torch.ones(tensor.shape[dim], dtype=rows.dtype, device=rows.device)
    full[start : start + rows.numel()] = rows
    local = tensor.to_local()  # type: ignore[attr-defined]
    local.mul_(full[local_slices(tensor)[dim]].to(local.dtype).view(shape))


@torch.no_grad()
def qk_clip_(layout: QKLayout, max_logits: Tensor, tau: float) -> Tensor:
    """Apply QK-Clip in place to the weights ``layout`` names; returns how many query heads were over ``tau``
    (a 0-dim tensor, on the weights' device, not synced).

    Args:
        layout: the attention's q/k heads.
        max_logits: ``(num_heads,)``, the largest logit of each query head in the last forward(s).
        tau: the threshold (> 0).
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau!r}")
    device = layout.query.weight.device
    query, key = clip_factors(layout, max_logits.to(device), tau)
    _scale_heads_(layout.query, query, layout.head_dim)
    _scale_heads_(layout.key, key, layout.head_dim)
    return (query < 1).sum()
