"""Attention projections' row blocks, one per head (``route_parameters(split_heads=True)``).

The heads are read where QK-Clip reads them (`lightning_muon.attention.find_attention`: transformers' configs,
litgpt's, ``nn.MultiheadAttention``, a module's own ``qk_layout()``), never guessed: q is split into its
``num_heads`` heads, k and v into their ``num_kv_heads`` (grouped-query attention), a fused qkv weight first by
projection, then by head. The output projection stays whole: its heads are its input columns, not its rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_muon.attention import AttentionSite, UnsupportedAttentionError, find_attention

__all__ = ["HeadBlocks", "fused_attention", "head_blocks"]

#: One projection's heads in a weight: ``(offset, heads, what, head_dim, transposed)`` (`QKProjection`'s terms).
Span = tuple[int, int, str, int, bool]

#: ``route_parameters(split_heads=True)`` on a model with an attention whose heads cannot be read.
HEADS_UNREADABLE = (
    "split_heads cannot read every attention's heads: {error}. For split_heads, give such a module's weights their "
    "head blocks by hand with matrix_blocks ({{'<module>.q_proj.weight': [<head_dim>] * <heads>}}, None to keep "
    "one whole), which decides over split_heads for the parameters it matches"
)


@dataclass(frozen=True)
class HeadBlocks:
    """One weight's blocks along its output features: each a head (or a stretch no head covers), in words too."""

    #: The block sizes, in order along the output features (rows of an ``nn.Linear``, columns of a ``Conv1D``).
    sizes: tuple[int, ...]
    #: ``"split per head: 4 query heads of 32 rows"``, for the routing table.
    words: str


def head_blocks(model: nn.Module, params: dict[str, Tensor], exclude: Sequence[str] = ()) -> dict[str, HeadBlocks]:
    """The per-head blocks of every attention projection of ``model`` among ``params`` (name -> parameter).

    Args:
        model: the model.
        params: the parameters to split, by name (weights not among them are left alone: frozen ones).
        exclude: module names (``fnmatch`` patterns) whose heads are not read (their weights' blocks are given).

    Raises:
        ValueError: a module looks like attention but its heads cannot be read (`HEADS_UNREADABLE`), or the heads
            found overlap in a weight.
    """
    try:
        sites = find_attention(model, exclude)
    except UnsupportedAttentionError as error:
        raise ValueError(HEADS_UNREADABLE.format(error=error)) from error
    spans = _spans(sites, params)
    return {name: _blocks(name, params[name], found) for name, found in spans.items()}


def fused_attention(model: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The attention weights of ``model`` that hold several of q, k and v one after the other, by parameter name:
    which (``"q, k, v"``) and their sizes along the output features, read where the heads are
    (`lightning_muon.attention.find_attention`: a module's own ``qk_layout()`` too, like the shipped GPT's ``qkv``).
    Only blocks that cover the weight end to end count. Nothing where an attention's heads cannot be read: the
    routing then names the fused projections it finds by module type alone."""
    try:
        sites = find_attention(model)
    except UnsupportedAttentionError:
        return {}
    params = dict(model.named_parameters())
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, held in _spans(sites, params).items():
        sizes = [heads * head_dim for _, heads, _, head_dim, _ in held]
        ends = [offset + size for (offset, *_), size in zip(held, sizes, strict=True)]
        contiguous = held[0][0] == 0 and [offset for offset, *_ in held[1:]] == ends[:-1]
        covered = ends[-1] == params[name].shape[1 if held[0][4] else 0]
        if len(held) > 1 and contiguous and covered:
            found[name] = (", ".join(what[0] for _, _, what, _, _ in held), tuple(sizes))
    return found


def _spans(sites: Sequence[AttentionSite], params: Mapping[str, Tensor]) -> dict[str, list[Span]]:
    """Where the attention ``sites``' projections lie in ``params`` (name -> parameter; others left out): each
    weight's spans ``(offset, heads, what, head_dim, transposed)``, sorted by offset."""
    names = {id(p): name for name, p in params.items()}
    spans: dict[str, list[Span]] = {}
    for site in sites:
        for what, projection, heads in site.layout.projections():
            name = names.get(id(projection.weight))
            if name is not None:
                span = (projection.offset, heads, what, site.layout.head_dim, projection.transposed)
                spans.setdefault(name, []).append(span)
    return {name: sorted(found) for name, found in spans.items()}


def _blocks(name: str, weight: Tensor, spans: list[Span]) -> HeadBlocks:
    """``weight``'s blocks from its heads' spans ``(offset, heads, what, head_dim, transposed)``, sorted by offset;
    a stretch no head covers (an adapter's layout without v, say) is one block of its own."""
    transposed = spans[0][4]
    features = weight.shape[1 if transposed else 0]
    sizes: list[int] = []
    parts: list[str] = []
    at = 0
    for offset, heads, what, head_dim, _ in spans:
        if offset < at:
            raise ValueError(f"the attention heads found in `{name}` overlap at output feature {offset}")
        if offset > at:
            sizes.append(offset - at)
            parts.append(f"{offset - at} {_along(transposed)} in no head")
        sizes.extend([head_dim] * heads)
        parts.append(f"{heads} {what} heads of {head_dim} {_along(transposed)}")
        at = offset + heads * head_dim
    if at < features:
        sizes.append(features - at)
        parts.append(f"{features - at} {_along(transposed)} in no head")
    split = "split by projection, then per head" if len(spans) > 1 else "split per head"
    return HeadBlocks(tuple(sizes), f"{split}: {' + '.join(parts)}")


def _along(transposed: bool) -> str:
    """What a weight's output features are: rows, or columns of one stored ``in x out`` (``Conv1D``)."""
    return "columns" if transposed else "rows"
