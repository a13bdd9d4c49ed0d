"""What the maths, the plan, the exchanges, the attention clip and the first-batch trace need to know of sharding:
whether a tensor is a DTensor, which part of its matrix each rank's shard holds (`matrix_parts`), whether a
placement shards a matrix's rows or columns (`shards_matrix`), a DTensor's local shard as the forward holds it
(`local_tensor`); and what FSDP1 flattened (`fsdp1_flattened`, `fsdp1_wrapped`), which Muon cannot train.

The one module that reads torch's private DTensor API (``_compute_local_shape_and_global_offset``,
``_StridedShard``, ``DTensor._local_tensor``) and FSDP1's mark on the tensors it flattened (``_fsdp_flattened``):
every subpackage may import it, and ``tests/test_layout.py`` keeps those names here, as ``lightning/_compat.py``
keeps Lightning's private API.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from typing import Any

from torch import Tensor, nn

#: The attribute FSDP1 sets on every tensor it flattened: its ``FlatParameter``s, and with ``use_orig_params=True``
#: the original parameters, whose data it made views of this rank's shard (1-D, ``(0,)`` where the rank holds none).
FSDP1_FLATTENED = "_fsdp_flattened"

#: One rank's part of a sharded matrix (``shape[0] x prod(shape[1:])``): ``(first row, rows, first column,
#: columns)``.
Part = tuple[int, int, int, int]


def is_dtensor(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded parameter under FSDP2 or tensor parallelism)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)


def shards_matrix(placement: object) -> bool:
    """Whether ``placement`` shards a matrix's rows or columns (``Shard(0)``, ``Shard(1)``, and the strided shards
    FSDP2 makes over tensor parallelism)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, (Shard, _StridedShard)) and placement.dim in (0, 1)


def local_tensor(tensor: object) -> Tensor | None:
    """A DTensor's local shard, read as an attribute (no torch call, so no dispatch a trace would see); ``None``
    for anything else."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, Tensor) else None


def world_placements(tensor: Tensor) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """The mesh shape and placements of the ranks that share a DTensor's Newton-Schulz work: its whole mesh,
    except HSDP's replicate dim (each replica does the same work on its own copy)."""
    from torch.distributed.tensor import Replicate

    shape, placements = tuple(tensor.device_mesh.shape), tuple(tensor.placements)  # type: ignore[attr-defined]
    if len(placements) == 2 and isinstance(placements[0], Replicate):
        return shape[1:], placements[1:]
    return shape, placements


def matrix_parts(tensor: Tensor) -> tuple[Part, ...] | None:
    """Each rank's part of ``tensor``'s matrix ``shape[0] x prod(shape[1:])``, by rank of the world that shares
    its work (the mesh flattened in row-major order, without HSDP's replicate dim: `world_placements`), or
    ``None`` where the shards are plain row shards (FSDP2's and HSDP's ``Shard(0)`` on one mesh dim, tensor
    parallelism's colwise weights) or ``tensor`` is no DTensor.

    Shards of dim 1 (tensor parallelism's rowwise weights) cut the matrix's columns, each rank's a whole slice
    of dim 1 (a column-sharded matrix is a row-sharded one transposed); 2-D placements (FSDP2 over tensor
    parallelism: ``(_StridedShard(0), Shard(0))``, ``(Shard(0), Shard(1))``) cut both, as DTensor itself
    computes each rank's shard.
    """
    from torch.distributed.tensor import Shard

    if not is_dtensor(tensor):
        return None
    mesh_shape, placements = world_placements(tensor)
    if len(placements) == 1 and type(placements[0]) is Shard and placements[0].dim == 0:
        return None
    return _parts(tuple(tensor.shape), mesh_shape, placements)


@functools.lru_cache(maxsize=256)
def _parts(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...]) -> tuple[Part, ...]:
    # DTensor's own arithmetic of a shard's size and offset at any mesh coordinate (uneven shards, and
    # _StridedShard's right-to-left order included); private, so checked by `tiles` where it is used.
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    unit = math.prod(shape[2:])
    parts = []
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
        if len(shape) == 1:
            parts.append((offset[0], local[0], 0, 1))
        else:
            parts.append((offset[0], local[0], offset[1] * unit, local[1] * unit))
    return tuple(parts)


def tiles(tensor: Tensor, parts: tuple[Part, ...]) -> bool:
    """Whether ``parts`` cover ``tensor``'s matrix exactly once: every element on exactly one rank."""
    rows = tensor.shape[0]
    cols = math.prod(tensor.shape[1:])
    if sum(m * n for _, m, _, n in parts) != rows * cols:
        return False
    for (r0, m0, c0, n0), (r1, m1, c1, n1) in itertools.combinations(parts, 2):
        if m0 and n0 and m1 and n1 and r0 < r1 + m1 and r1 < r0 + m0 and c0 < c1 + n1 and c1 < c0 + n0:
            return False
    return all(0 <= r and r + m <= rows and 0 <= c and c + n <= cols for r, m, c, n in parts)


def local_slices(tensor: Tensor) -> tuple[slice, ...]:
    """Where this rank's shard of a DTensor lies in the whole tensor, one slice per dim (the whole dim where it is
    not sharded); for a plain tensor, all of every dim."""
    if not is_dtensor(tensor):
        return tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = tensor.device_mesh, tensor.placements  # type: ignore[attr-defined]
    local, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    return tuple(slice(start, start + n) for start, n in zip(offset, local, strict=True))


def fsdp1_flattened(tensor: Tensor) -> bool:
    """Whether FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) flattened ``tensor``: one of its flat
    parameters, or an original parameter whose data it replaced by a view of a flat shard (``use_orig_params``)."""
    return bool(getattr(tensor, FSDP1_FLATTENED, False))


def fsdp1_wrapped(model: nn.Module) -> tuple[list[str], list[str]]:
    """The names of ``model``'s FSDP1 wrappers (``""`` for the model itself) and of its trainable parameters FSDP1
    flattened (also where the model was wrapped from outside); both empty for a model FSDP1 has not touched (FSDP2's
    ``fully_shard`` keeps parameters whole, as DTensors). Nothing can be wrapped before ``torch.distributed.fsdp``
    is imported, so it is never imported here."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    wrapper = getattr(fsdp, "FullyShardedDataParallel", None)
    modules = [name for name, m in model.named_modules() if wrapper is not None and isinstance(m, wrapper)]
    params = [name for name, p in model.named_parameters() if p.requires_grad and fsdp1_flattened(p)]
    return modules, params
