"""What each parameter of a `Muon` was given as, and the step-time check that it still is.

``Muon.add_param_group`` checks every parameter (a matrix, or a stack of them, in its layout) and records its shape
here. Something may still swap or reshape the tensors of ``group["params"]`` afterwards: DeepSpeed's ZeRO optimizer
(stages 1, 2 and 3) flattens each param group's matrices into one 1-D buffer and writes it into
``group["params"]`` (a ``(1536,)`` tensor for a ``32 x 16`` and a ``32 x 32``; a shard of it per rank), and FSDP1
makes each parameter's data a 1-D view of its shard. Orthogonalising such a buffer as a ``1536 x 1`` matrix is a
silent wrong update, so every step first checks each parameter against its record: the same tensor of the same
shape passes at the cost of a dict lookup; a tensor never recorded (a group rebuilt over the model's own tensors, a
copy of the optimizer) is checked as ``add_param_group`` checks one, and recorded; any other is refused, before
anything moves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_muon.optim import groups

#: Why a flattened or replaced parameter is refused, and the way out (after what was found).
REPLACED = (
    "something reshaped or replaced the optimizer's parameters after it was built. DeepSpeed's ZeRO optimizer "
    "(stages 1, 2 and 3) does this: it flattens each param group's matrices into one 1-D buffer and writes it into "
    "group['params']; FSDP1 (FullyShardedDataParallel) makes each parameter a 1-D view of its shard. Muon "
    "orthogonalises each matrix whole, so a flattened one would get a silent wrong update: nothing was stepped. "
    "Shard with FSDP2 instead (torch.distributed.fsdp.fully_shard; in Lightning, strategy=ModelParallelStrategy()), "
    "or under DeepSpeed use DeepSpeed's own Muon (\"optimizer\": {\"type\": \"Muon\"} in its config) instead of "
    "lightning_muon's."
)


class GivenShapes:
    """The shape each parameter had when it was given (by identity, through weak references: a record never keeps
    a tensor alive, and a recycled ``id`` is told from its tensor)."""

    def __init__(self) -> None:
        self._shapes: dict[int, tuple[weakref.ref[Tensor], torch.Size]] = {}

    def record(self, params: list[Tensor]) -> None:
        """``params`` were checked and given: remember each one's shape."""
        for p in params:
            self._shapes[id(p)] = (weakref.ref(p), p.shape)

    def check(self, param_groups: list[dict[str, Any]], refusal: Callable[[Tensor, str, Any], str | None]) -> None:
        """Raise a ``RuntimeError`` for the first parameter of ``param_groups`` that is no longer what it was given
        as; ``refusal(p, layout, blocks)`` checks one not recorded yet, as ``add_param_group`` would."""
        shapes, index = self._shapes, 0
        for k, group in enumerate(param_groups):
            params = group["params"]
            for i, p in enumerate(params):
                given = shapes.get(id(p))
                if given is None or not _refers_to(given[0], p):
                    self._take_new(group, k, i, index + i, refusal)
                elif given[1] != p.shape:
                    raise RuntimeError(
                        f"Muon: {_describe(group, i, index + i)} was given as a tensor of shape {tuple(given[1])} "
                        f"and is one of shape {tuple(p.shape)} at this step: {REPLACED}"
                    )
            index += len(params)

    def _take_new(self, group: dict[str, Any], k: int, i: int, index: int,
                  refusal: Callable[[Tensor, str, Any], str | None]) -> None:
        """A tensor of group ``k`` (position ``i``) this optimizer was not given: check it, record it."""
        p, count = group["params"][i], len(group["params"])
        layouts, blocks = group.get(groups.MATRIX_LAYOUTS), group.get(groups.MATRIX_BLOCKS)
        described = all(entries is None or len(entries) == count for entries in (layouts, blocks))
        if not described or refusal(p, groups.layouts_of(group)[i], groups.blocks_of(group)[i]) is not None:
            raise RuntimeError(
                f"Muon: param group {k} holds a tensor of shape {tuple(p.shape)} (index {index}) that it was not "
                f"given and cannot take as a matrix: {REPLACED}"
            )
        self.record([p])


def _refers_to(ref: weakref.ref[Tensor], tensor: Tensor) -> bool:
    """Whether ``ref`` is a reference to ``tensor`` (not to a dead tensor whose ``id`` it now has)."""
    return ref() is tensor


def _describe(group: dict[str, Any], i: int, index: int) -> str:
    """`groups.describe_param`, its name left out where the group's names no longer match its tensors."""
    names = group.get(groups.PARAM_NAMES)
    if names is not None and len(names) != len(group["params"]):
        return f"parameter {index}"
    return groups.describe_param(group, i, index)
