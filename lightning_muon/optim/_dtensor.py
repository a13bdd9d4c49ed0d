"""What the maths, the plan and the exchanges need to know of sharding: whether a tensor is a DTensor, and which
part of its matrix each rank's shard holds (`matrix_split`)."""

from __future__ import annotations

import math

from torch import Tensor

#: How the shards of one matrix (``shape[0] x prod(shape[1:])``) cut it (`matrix_split`): ``(dim, unit)``, along
#: its rows (``dim`` 0) or columns (1), each rank's rows or columns a multiple of ``unit``. Row shards, ``(0, 1)``,
#: for FSDP2's ``Shard(0)`` and for a tensor that is not sharded at all.
ROWS = (0, 1)


def is_dtensor(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded parameter under FSDP2 or tensor parallelism)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)


def matrix_split(tensor: Tensor) -> tuple[int, int]:
    """How the shards of ``tensor`` on its mesh's last dim cut its matrix ``shape[0] x prod(shape[1:])``:
    `ROWS` for ``Shard(0)`` (FSDP2, tensor parallelism's colwise weights) and for any tensor that is not
    sharded on dim 1; ``(1, prod(shape[2:]))`` for ``Shard(1)`` (tensor parallelism's rowwise weights): a
    column-sharded matrix is a row-sharded one transposed, each rank's columns whole slices of dim 1."""
    if not is_dtensor(tensor):
        return ROWS
    placement = tensor.placements[-1]  # type: ignore[attr-defined]
    if placement.is_shard(1):
        return 1, math.prod(tensor.shape[2:])
    return ROWS
