"""Where an attention's query and key heads live in its weights, and the adapter for a module of one's own.

`QKLayout` says which output features of which weights are each query and key head: a head is ``head_dim``
consecutive output features starting at ``offset + head * head_dim`` of its `QKProjection` (rows of an
``nn.Linear`` weight, columns of a weight stored ``in x out`` like transformers' ``Conv1D``), its bias entries
too. Query head ``h`` reads key head ``h // (num_heads // num_kv_heads)`` (grouped-query attention with contiguous
groups, as transformers and litgpt lay them out).

The adapter, for an attention the package does not know: give the module a ``qk_layout()`` method returning its
`QKLayout`, and call `record_qk` in its ``forward`` with the q and k its attention actually uses (`QKLayout`'s
example).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["QKLayout", "QKProjection", "record_qk"]


@dataclass(frozen=True)
class QKProjection:
    """One projection's heads: output features ``offset .. offset + heads * head_dim`` of ``weight`` (and ``bias``).

    Args:
        weight: the parameter holding the projection (a fused qkv weight too, with ``offset``).
        bias: its bias (indexed like the output features), or None.
        offset: the first output feature of this projection's heads in ``weight``.
        bias_offset: the same in ``bias`` where it differs (``nn.MultiheadAttention``'s separate q/k/v weights
            share one ``in_proj_bias``); ``None``: ``offset``.
        transposed: ``weight`` is stored ``in x out`` (output features along dim 1, transformers' ``Conv1D``).
    """

    weight: Tensor
    bias: Tensor | None = None
    offset: int = 0
    bias_offset: int | None = None
    transposed: bool = False

    @property
    def out_dim(self) -> int:
        """The dimension of ``weight`` that indexes output features."""
        return 1 if self.transposed else 0

    @property
    def bias_start(self) -> int:
        """The first bias entry of this projection's heads."""
        return self.offset if self.bias_offset is None else self.bias_offset


@dataclass(frozen=True)
class QKLayout:
    """The query and key heads of one attention module.

    Args:
        query: where the query heads are.
        key: where the key heads are.
        num_heads: query heads.
        num_kv_heads: key heads (divides ``num_heads``; equal to it without GQA).
        head_dim: features per head.
        qk_norm: q and k are normalised after the projection (QK-norm): the logits can be measured, but scaling
            the projection cannot lower them, so `qk_clip_` refuses to clip such a layout.
        value: where the value heads are (``num_kv_heads`` of them), or ``None`` where unknown; QK-Clip does not
            read it, ``route_parameters(split_heads=True)`` splits v by it.

    Examples:
        The adapter, for an attention the package does not know: a ``qk_layout()`` method returning its
        `QKLayout`, and `record_qk` in its ``forward`` with the q and k its attention actually uses.

        ```python
        class MyAttention(nn.Module):
            def qk_layout(self) -> QKLayout:
                return QKLayout(
                    query=QKProjection(self.wq.weight),
                    key=QKProjection(self.wk.weight),
                    num_heads=self.heads,
                    num_kv_heads=self.kv_heads,
                    head_dim=self.head_dim,
                )

            def forward(self, x):
                q, k, v = ...  # (batch, heads, T, head_dim), RoPE applied
                # a no-op unless the clipper measures this module:
                record_qk(self, q, k, scale=self.head_dim ** -0.5, causal=True)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.out(y.transpose(1, 2).flatten(2))
        ```
    """

    query: QKProjection
    key: QKProjection
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool = False
    value: QKProjection | None = None

    def check(self, name: str) -> None:
        """Refuse a layout that does not fit its weights, naming the module ``name``."""
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.head_dim < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{name}: num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim} "
                "must be >= 1 with num_kv_heads dividing num_heads"
            )
        for what, proj, heads in self.projections():
            if proj.weight.dim() != 2:
                raise ValueError(f"{name}: the {what} weight must be a matrix, got shape {tuple(proj.weight.shape)}")
            stop = proj.offset + heads * self.head_dim
            if proj.offset < 0 or stop > proj.weight.shape[proj.out_dim]:
                raise ValueError(
                    f"{name}: {heads} {what} heads of {self.head_dim} from output feature {proj.offset} need "
                    f"{stop} output features; the weight of shape {tuple(proj.weight.shape)} has "
                    f"{proj.weight.shape[proj.out_dim]} along dim {proj.out_dim}"
                )
            bias_stop = proj.bias_start + heads * self.head_dim
            bad_bias = proj.bias is not None and (proj.bias.dim() != 1 or proj.bias.shape[0] < bias_stop)
            if proj.bias is not None and (bad_bias or proj.bias_start < 0):
                raise ValueError(
                    f"{name}: the {what} bias of shape {tuple(proj.bias.shape)} has fewer than {bias_stop} entries"
                )

    def projections(self) -> list[tuple[str, QKProjection, int]]:
        """``(what, projection, heads)`` for the query, the key and (where known) the value."""
        found = [("query", self.query, self.num_heads), ("key", self.key, self.num_kv_heads)]
        return found + ([("value", self.value, self.num_kv_heads)] if self.value is not None else [])

    @property
    def group_size(self) -> int:
        """Query heads per key head."""
        return self.num_heads // self.num_kv_heads


#: Module -> the function its q and k go to while it is measured (filled by the meters, read by every capture).
Recorder = Callable[[Tensor, Tensor, float, bool, "Tensor | None"], None]
RECORDERS: weakref.WeakKeyDictionary[nn.Module, Recorder] = weakref.WeakKeyDictionary()


def record_qk(
    module: nn.Module, query: Tensor, key: Tensor, *, scale: float, causal: bool, keep: Tensor | None = None
) -> None:
    """Hand the q and k an attention uses to whatever measures ``module`` (nothing, cheaply, when nothing does).

    Args:
        module: the attention module (the one with ``qk_layout()``).
        query: ``(batch, num_heads, T, head_dim)``, after RoPE / QK-norm.
        key: ``(batch, num_kv_heads or num_heads, S, head_dim)``.
        scale: the logit scale the attention applies.
        causal: whether query ``i`` sees only keys ``j <= S - T + i``.
        keep: a boolean mask broadcastable to ``(batch, num_heads, T, S)``, True where a query attends a key.
    """
    recorder = RECORDERS.get(module)
    if recorder is not None:
        recorder(query, key, scale, causal, keep)
