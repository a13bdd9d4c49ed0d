"""The per-head maximum attention logit, exact and in chunks: the full ``T x S`` logit matrix is never held at once.

``max_attention_logits(q, k, scale=..., causal=True)`` is ``max_{b,i,j} scale * q[b,h,i] . k[b,g(h),j]`` for every
query head ``h`` over the pairs the attention lets through (the causal mask, an explicit mask), with ``g(h)`` the
key head that query head reads under grouped-query attention (contiguous groups: query heads ``g*r .. g*r+r-1``
share key head ``g``, as transformers' ``repeat_kv`` and litgpt's ``repeat_interleave`` lay them out). The logits
are formed in float32 from the q and k given (bf16 inputs are cast exactly), one block of query rows at a time;
under a causal mask each block is multiplied only against the keys it can see, so the work is about half of
``q @ k^T``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "max_attention_logits"]

#: The largest logit block formed at once (elements, float32): 16 MiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 22


def _check(query: Tensor, key: Tensor, scale: float) -> tuple[int, int, int, int, int]:
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(
            f"query and key must be (batch, heads, time, head_dim); got shapes {tuple(query.shape)} and "
            f"{tuple(key.shape)}"
        )
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[0] != batch or key.shape[3] != dim or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"key of shape {tuple(key.shape)} does not fit query of shape {tuple(query.shape)}: the batch and "
            "head_dim must agree and the key heads must divide the query heads"
        )
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    return batch, heads, kv_heads, rows, key.shape[2]


def _grouped_keep(keep: Tensor, heads: int, kv_heads: int, rows: int, cols: int) -> Tensor:
    """``keep`` (broadcastable to ``(B, heads, T, S)``) as ``(B or 1, kv_heads or 1, r or 1, T, S)``."""
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    if keep.dim() != 4 or keep.shape[1] not in (1, heads):
        raise ValueError(
            f"the mask of shape {tuple(keep.shape)} must broadcast to (batch, {heads}, {rows}, {cols})"
        )
    keep = keep.expand(keep.shape[0], keep.shape[1], rows, cols)
    if keep.shape[1] == heads:
        return keep.unflatten(1, (kv_heads, heads // kv_heads))
    return keep.unsqueeze(2)


def max_attention_logits(
    query: Tensor,
    key: Tensor,
    *,
    scale: float,
    causal: bool = False,
    keep: Tensor | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor:
    """The maximum attention logit of every query head, ``(heads,)`` float32.

    Args:
        query: ``(batch, heads, T, head_dim)``, as the attention uses it (after RoPE, QK-norm).
        key: ``(batch, kv_heads, S, head_dim)``; ``kv_heads`` divides ``heads`` (GQA, MQA) or equals it.
        scale: the attention's own logit scale (``head_dim ** -0.5`` for most), > 0.
        causal: query ``i`` (at position ``S - T + i``, so a KV cache is respected) sees keys ``j <= S - T + i``.
        keep: a boolean mask broadcastable to ``(batch, heads, T, S)``, True where a query attends a key
            (SDPA's convention); combined with ``causal``.
        chunk_elements: the largest logit block formed at once.

    A head that attends nothing (every pair masked) gets ``-inf``.
    """
    batch, heads, kv_heads, rows, cols = _check(query, key, scale)
    group = heads // kv_heads
    result = torch.full((kv_heads, group), float("-inf"), device=query.device, dtype=torch.float32)
    if rows == 0 or cols == 0:
        return result.flatten()
    grouped_keep = None if keep is None else _grouped_keep(keep, heads, kv_heads, rows, cols)
    q = query.unflatten(1, (kv_heads, group))  # (B, G, r, T, D): query head g*r + i reads key head g
    k = key.float().transpose(-1, -2)  # (B, G, D, S), shared by the group's r query heads without a copy
    offset = cols - rows
    block = max(1, chunk_elements // max(1, batch * heads * cols))
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        seen = min(cols, offset + stop) if causal else cols  # the keys any row of this block may see
        if seen <= 0:
            continue
        rows_here = stop - start
        q_block = q[:, :, :, start:stop].float().reshape(batch, kv_heads, group * rows_here, q.shape[-1])
        logits = (q_block @ k[..., :seen]).view(batch, kv_heads, group, rows_here, seen)
        if causal:
            row_pos = torch.arange(start + offset, stop + offset, device=query.device).unsqueeze(1)
            hidden = torch.arange(seen, device=query.device).unsqueeze(0) > row_pos
            logits.masked_fill_(hidden, float("-inf"))
        if grouped_keep is not None:
            logits.masked_fill_(~grouped_keep[..., start:stop, :seen], float("-inf"))
        result = torch.maximum(result, logits.amax(dim=(0, 3, 4)))
    return result.flatten() * scale
