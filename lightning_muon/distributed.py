"""Splitting Muon's Newton-Schulz work across data-parallel ranks, and DTensor (FSDP2) support.

Under DDP every rank holds the same averaged gradients, so orthogonalising
every matrix on every rank repeats the work ``world`` times. Instead each rank
orthogonalises a share of the matrices (balanced by FLOPs, assigned the same
way on every rank), the orthogonalised updates are all-gathered as flat byte
buffers, and every rank applies every update: every rank keeps every momentum
buffer (Lightning checkpoints rank 0) and parameters stay identical.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["World", "replicated_world", "any_rank", "assign_owners", "exchange", "is_dtensor"]

#: Each matrix's bytes start on this boundary in the exchange buffer, so any dtype can view them.
_ALIGN = 8


class World(NamedTuple):
    rank: int
    size: int


def is_dtensor(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded parameter under FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)


def replicated_world(params: Sequence[Tensor]) -> World | None:
    """This rank and the world size when work can be split: an initialised process group of more than
    one rank, and replicated (plain-tensor) parameters. ``None`` otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if any(is_dtensor(p) for p in params):
        return None
    return World(dist.get_rank(), dist.get_world_size())


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Element-wise OR of ``flags`` over all ranks (one small all-reduce)."""
    tensor = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(x) for x in tensor.tolist()]


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """The rank that computes each job: largest jobs first, each to the least-loaded rank (ties: lowest rank).

    Deterministic, so every rank computes the same assignment without communicating.
    """
    loads = [(0.0, rank) for rank in range(world_size)]
    owners = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        load, rank = heapq.heappop(loads)
        owners[job] = rank
        heapq.heappush(loads, (load + costs[job], rank))
    return owners


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def exchange(
    local: dict[int, list[Tensor]],
    owners: Sequence[int],
    layouts: Sequence[tuple[int, tuple[int, int], torch.dtype]],
    world: World,
    device: torch.device,
    buffers: dict | None = None,
) -> list[list[Tensor]]:
    """All-gather every job's orthogonalised matrices from the rank that computed them.

    Args:
        local: job index -> the matrices this rank computed for it.
        owners: the rank of every job (from `assign_owners`).
        layouts: per job ``(count, (m, n), dtype)`` of its matrices, known on every rank.
        world: this rank and the world size.
        device: where the exchange buffers live (the parameters' device).
        buffers: a dict kept by the caller between steps, to reuse the exchange buffers
            (allocating and faulting in a copy of all updates every step measured ~20% of a split step).

    Returns the matrices of every job, in job order (views into the receive buffers, valid until
    the next exchange with the same ``buffers``). Bytes travel as ``uint8``
    (any dtype, any backend); each rank sends only its own share, padded to
    the largest share.
    """
    sizes = [0] * world.size
    for job, (count, (m, n), dtype) in enumerate(layouts):
        sizes[owners[job]] += count * _padded(m * n * dtype.itemsize)
    width = max(sizes)
    key = (width, str(device))
    if buffers is not None and key in buffers:
        send, received = buffers[key]
    else:
        send = torch.zeros(width, dtype=torch.uint8, device=device)
        received = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(world.size)]
        if buffers is not None:
            buffers.clear()
            buffers[key] = (send, received)
    offset = 0
    for job in sorted(local):
        for matrix in local[job]:
            nbytes = matrix.numel() * matrix.element_size()
            send[offset : offset + nbytes] = matrix.contiguous().view(-1).view(torch.uint8)
            offset += _padded(nbytes)
    dist.all_gather(received, send)
    result: list[list[Tensor]] = [[] for _ in layouts]
    offsets = [0] * world.size
    for job, (count, (m, n), dtype) in enumerate(layouts):
        rank, nbytes = owners[job], m * n * dtype.itemsize
        for _ in range(count):
            start = offsets[rank]
            result[job].append(received[rank][start : start + nbytes].view(dtype).view(m, n))
            offsets[rank] += _padded(nbytes)
    return result
