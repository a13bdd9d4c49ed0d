"""The collectives of Muon's distributed strategies: which world, where ranks agree, and the byte exchanges.

Under DDP every rank holds the same averaged gradients, so orthogonalising
every matrix on every rank repeats the work ``world`` times. Instead each rank
orthogonalises a share of the matrices (balanced by FLOPs, assigned the same
way on every rank), the orthogonalised updates are all-gathered as flat byte
buffers, and every rank applies every update: every rank keeps every momentum
buffer (Lightning checkpoints rank 0) and parameters stay identical.

Under FSDP2 every rank holds a row shard of each matrix (a DTensor sharded on
dim 0), and Newton-Schulz needs the whole matrix. Each matrix gets an owner
rank (the same FLOP-balanced assignment); one all-to-all sends every shard to
its matrix's owner, the owner orthogonalises the whole matrix, and a second
all-to-all sends every rank back its rows of the result. Momentum stays sharded.
Under HSDP (a 2-D mesh: replicate, then shard) each replica does the same within
its shard group. Under tensor parallelism (a 1-D mesh) rowwise weights are
sharded on dim 1: a column-sharded matrix is a row-sharded one transposed, so
the same exchange moves every rank's columns instead of its rows
(`ExchangeLayout.cuts`), and the owner assembles and orthogonalises the whole
matrix as stored, batched with the same-shape matrices of its job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.optim._dtensor import Part, matrix_parts, shards_matrix, tiles

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


#: Each matrix's bytes start on this boundary in the exchange buffer, so any dtype can view them.
_ALIGN = 8


class World(NamedTuple):
    """The ranks that share a distributed step's Newton-Schulz work, seen from this one."""

    #: This rank within `group`.
    rank: int
    #: How many ranks `group` has.
    size: int
    #: The process group the ranks belong to (``None``: the default group).
    group: dist.ProcessGroup | None = None
    #: How many copies of this world repeat the same work (HSDP: the replicate dim of the mesh; else 1).
    replicas: int = 1
    #: How many mesh dims the world spans (2: FSDP2 over tensor parallelism, every rank of a 2-D mesh).
    mesh_dims: int = 1


def replicated_world(group: dist.ProcessGroup | None = None) -> World | None:
    """This rank and the size of ``group`` (``None``: the default group) when replicated parameters' work can
    be split over it: an initialised process group of more than one rank. ``None`` otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return None
    return World(dist.get_rank(group), dist.get_world_size(group), group)


def sharded_world(params: Sequence[Tensor], mesh: DeviceMesh | None = None) -> World | str:
    """The world of the owner exchange, or why these parameters have none (a sentence).

    Every parameter must be a DTensor over the same device mesh (``mesh``: the first parameter's unless given),
    sharded on dim 0 or dim 1 on each dim of the mesh that shards:

    - a 1-D mesh (FSDP2's ``(Shard(0),)``; tensor parallelism's colwise ``(Shard(0),)`` and rowwise
      ``(Shard(1),)``, mixed): the world is the mesh's ranks;
    - a 2-D mesh that replicates on its first dim and shards dim 0 on its second (HSDP, ``(Replicate(),
      Shard(0))``): the world is the shard dim's ranks, and each replica (`World.replicas`) repeats the same
      exchange and work on its own identical shards;
    - a 2-D mesh that shards on both dims (FSDP2 over tensor parallelism: ``(_StridedShard(0), Shard(0))``,
      ``(Shard(0), Shard(1))``), spanning the job's ranks in order: the world is every rank of the mesh, each
      holding a block of each matrix (`lightning_muon.optim._dtensor.matrix_parts`).
    """
    from torch.distributed.tensor import DTensor, Replicate

    dtensors = [p for p in params if isinstance(p, DTensor)]
    if len(dtensors) != len(params):
        return "some Muon parameters are DTensors and some are not"
    mesh = dtensors[0].device_mesh if mesh is None else mesh
    if any(p.device_mesh != mesh for p in dtensors):
        return "the Muon parameters live on different device meshes"
    placements = {tuple(p.placements) for p in dtensors}
    if mesh.ndim > 2 or not all(_known(ps, mesh.ndim) for ps in placements):
        shown = ", ".join(sorted("(" + ", ".join(map(repr, ps)) + ")" for ps in placements))
        return (
            f"placements {shown} on a {mesh.ndim}-D mesh are none of FSDP2's or tensor parallelism's (Shard(dim=0), "
            "Shard(dim=1)), HSDP's (Replicate(), Shard(dim=0)) or FSDP2 over tensor parallelism's (a shard of dim "
            "0 or 1 on each mesh dim)"
        )
    if any(not tiles(p, parts) for p in dtensors if (parts := matrix_parts(p)) is not None):
        return "the ranks' shards of a matrix do not cover it exactly once"
    hsdp = mesh.ndim == 2 and all(isinstance(ps[0], Replicate) for ps in placements)
    if mesh.ndim == 2 and not hsdp:
        if mesh.mesh.flatten().tolist() != list(range(dist.get_world_size())):
            return "the 2-D mesh does not span the job's ranks in order"
        return World(dist.get_rank(), mesh.size(), None, 1, 2)
    dim = mesh.ndim - 1
    if mesh.size(dim) < 2:
        return f"the mesh shards over {mesh.size(dim)} rank"
    group = mesh.get_group(dim)
    if dist.get_rank(group) != mesh.get_local_rank(dim):  # shards follow mesh order, collectives group order
        return "the mesh orders its ranks unlike its process group"
    return World(mesh.get_local_rank(dim), mesh.size(dim), group, mesh.size(0) if hsdp else 1)


def _known(placements: tuple, ndim: int) -> bool:
    """Whether ``placements`` on a mesh of ``ndim`` dims are a layout the owner exchange knows (`sharded_world`)."""
    from torch.distributed.tensor import Replicate, Shard

    if ndim == 1:
        return shards_matrix(placements[0])
    if isinstance(placements[0], Replicate):
        return type(placements[1]) is Shard and placements[1].dim == 0
    return all(shards_matrix(p) for p in placements)


class Agreement(NamedTuple):
    """Where the ranks of a world agree on host-side facts (which parameters have a gradient, `any_rank`)."""

    #: The process group of the all-reduce.
    group: dist.ProcessGroup | None
    #: The device of the all-reduced tensor: the CPU (no device sync), or ``None``: the parameters' device.
    device: torch.device | None


#: Backends that all-reduce CPU tensors themselves (a ``cpu:<backend>`` part of a multi-device backend too).
_HOST_BACKENDS = ("gloo", "mpi")


def agreement_path(backend: str, spans_world: bool) -> str:
    """How ranks of a group with this ``backend`` agree on flags, the device left alone where possible:

    - ``"cpu"``: a CPU tensor on the group itself (gloo, or a backend with a CPU part such as
      ``cpu:gloo,cuda:nccl``);
    - ``"gloo"``: a CPU tensor on a gloo group over the same ranks, created once: only for a group that
      spans the whole default group (``spans_world``), since creating a group is collective over every rank;
    - ``"device"``: a tensor on the parameters' device (a subgroup under a device-only backend such as NCCL:
      one device sync per step, the path of every world before this choice existed).
    """
    parts = [part.strip() for part in backend.lower().split(",")]
    if any(part in _HOST_BACKENDS or part.startswith("cpu:") for part in parts):
        return "cpu"
    return "gloo" if spans_world else "device"


def make_agreement(group: dist.ProcessGroup | None) -> Agreement:
    """The `Agreement` of a world's process group (see `agreement_path`). Creates a process group on the
    ``"gloo"`` path, so every rank of the default group must call it, at the same point (Muon does at its
    first step, when it chooses its strategy)."""
    path = agreement_path(str(dist.get_backend(group)), dist.get_world_size(group) == dist.get_world_size())
    if path == "cpu":
        return Agreement(group, torch.device("cpu"))
    if path == "gloo":
        return Agreement(dist.new_group(backend="gloo"), torch.device("cpu"))
    return Agreement(group, None)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class ExchangeLayout(NamedTuple):
    """What an exchange needs to know of one job's matrices, the same on every rank."""

    #: How many 2D blocks (one per parameter: its matrices one under the other).
    blocks: int
    #: The ``(rows, cols)`` of each whole block.
    shape: tuple[int, int]
    #: The dtype the blocks travel (and are orthogonalised) in.
    dtype: torch.dtype
    #: How the ranks' shards cut each block: per block, each rank's part (`lightning_muon.optim._dtensor.
    #: matrix_parts`), or ``None`` for row shards (`row_parts`); empty: every block in row shards (FSDP2's
    #: layout; and replicated blocks, which are not cut).
    cuts: tuple[tuple[Part, ...] | None, ...] = ()

    def parts(self, block: int, world_size: int) -> list[tuple[slice, slice]]:
        """The part of a whole block each rank holds, by rank: its cut's, or `row_parts`."""
        cut = self.cuts[block] if self.cuts else None
        if cut is None:
            return row_parts(self.shape, world_size)
        return [(slice(r, r + m), slice(c, c + n)) for r, m, c, n in cut]

    def part_shape(self, part: tuple[slice, slice]) -> tuple[int, int]:
        """The ``(rows, cols)`` of one part of a block (`parts`)."""
        rows, cols = (len(range(*s.indices(size))) for s, size in zip(part, self.shape, strict=True))
        return rows, cols

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, unpadded."""
        m, n = self.shape
        return m * n * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes the job takes in an exchange buffer (each block starts 8-byte aligned)."""
        return self.blocks * _padded(self.block_bytes)


class ExchangeBuffers:
    """The byte buffers of the exchanges, kept between steps (and FSDP2's rounds): one per role (``"send"``,
    ``"receive"``, ``"stacks"``), grown to the largest request, so exchanges of the same sizes allocate nothing
    (allocating and faulting in a copy of all updates every step measured ~20% of a split DDP step).

    A request is valid until the next request of the same role. `largest` is the largest request since the
    caller last reset it (what a step's exchanges needed of any one buffer); `kept_bytes` what is held.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], Tensor] = {}
        self.largest = 0

    def get(self, role: str, nbytes: int, device: torch.device) -> Tensor:
        """``nbytes`` of ``uint8`` on ``device`` for ``role`` (the front of the kept buffer)."""
        self.largest = max(self.largest, nbytes)
        key = (role, str(device))
        kept = self._kept.get(key)
        if kept is None or kept.numel() < nbytes:
            kept = self._kept[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return kept[:nbytes]

    @property
    def kept_bytes(self) -> int:
        """Bytes held between steps, all roles together."""
        return sum(t.numel() for t in self._kept.values())


def _buffer(buffers: ExchangeBuffers | None, role: str, nbytes: int, device: torch.device) -> Tensor:
    if buffers is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffers.get(role, nbytes, device)


# ----------------------------------------------------------------- DDP (replicated parameters)


def all_gather_results(
    local: dict[int, list[Tensor]],
    owners: Sequence[int],
    layouts: Sequence[ExchangeLayout],
    world: World,
    device: torch.device,
    buffers: ExchangeBuffers | None = None,
) -> list[list[Tensor]]:
    """All-gather every job's orthogonalised matrices from the rank that computed them.

    Args:
        local: job index -> the matrices this rank computed for it.
        owners: the rank of every job (from `lightning_muon.optim._plan.assign_owners`).
        layouts: per job, its matrices (known on every rank).
        world: this rank, the world size and the process group.
        device: where the exchange buffers live (the parameters' device).
        buffers: kept exchange buffers to use (fresh ones without).

    Returns the matrices of every job, in job order (views into the receive buffer, valid until
    its next use). Bytes travel as ``uint8`` (any dtype, any backend); each rank sends only its
    own share, padded to the largest share.
    """
    sizes = [0] * world.size
    for job, layout in enumerate(layouts):
        sizes[owners[job]] += layout.nbytes
    width = max(sizes)
    send = _buffer(buffers, "send", width, device)
    received = list(_buffer(buffers, "receive", world.size * width, device).view(world.size, width).unbind(0))
    offset = 0
    for job in sorted(local):
        for matrix in local[job]:
            nbytes = matrix.numel() * matrix.element_size()
            send[offset : offset + nbytes] = matrix.contiguous().view(-1).view(torch.uint8)
            offset += _padded(nbytes)
    dist.all_gather(received, send, group=world.group)
    result: list[list[Tensor]] = [[] for _ in layouts]
    offsets = [0] * world.size
    for job, layout in enumerate(layouts):
        rank, nbytes = owners[job], layout.block_bytes
        for _ in range(layout.blocks):
            start = offsets[rank]
            result[job].append(received[rank][start : start + nbytes].view(layout.dtype).view(layout.shape))
            offsets[rank] += _padded(nbytes)
    return result


# ----------------------------------------------------------------- FSDP2 (row shards)


def shard_rows(rows: int, world_size: int) -> list[int]:
    """How many rows each rank holds of a tensor sharded on dim 0 (``torch.chunk``'s split, as DTensor's
    ``Shard(0)``: ``ceil(rows / world)`` each, the last ones shorter or empty)."""
    chunk = -(-rows // world_size)
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(world_size)]


def row_parts(shape: tuple[int, int], world_size: int) -> list[tuple[slice, slice]]:
    """The rows of a whole ``shape`` matrix each rank holds, by rank: `shard_rows`' split (DTensor's
    ``Shard(0)``)."""
    extents = shard_rows(shape[0], world_size)
    starts = [sum(extents[:rank]) for rank in range(world_size)]
    return [(slice(start, start + extent), slice(None)) for start, extent in zip(starts, extents, strict=True)]


def _all_to_all(
    pieces: list[list[tuple[Tensor, torch.dtype]]],
    receive: list[list[tuple[tuple[int, int], torch.dtype]]],
    world: World,
    device: torch.device,
    buffers: ExchangeBuffers | None = None,
) -> list[list[Tensor]]:
    """Send ``pieces[d]`` (matrices, each with the dtype it travels in: cast while packing) to each rank
    ``d``; receive matrices of the given shapes and dtypes from each rank, in the order that rank sent
    them. One ``all_to_all_single`` of bytes, through ``buffers``' send and receive buffers where given
    (the results are views into the receive buffer)."""
    send_sizes = [sum(_padded(p.numel() * dtype.itemsize) for p, dtype in row) for row in pieces]
    receive_sizes = [sum(_padded(m * n * dtype.itemsize) for (m, n), dtype in row) for row in receive]
    send = _buffer(buffers, "send", sum(send_sizes), device)
    offset = 0
    for row in pieces:
        for piece, dtype in row:
            nbytes = piece.numel() * dtype.itemsize
            send[offset : offset + nbytes].view(dtype).view(piece.shape).copy_(piece)
            offset += _padded(nbytes)
    received = _buffer(buffers, "receive", sum(receive_sizes), device)
    dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=world.group)
    result: list[list[Tensor]] = []
    offset = 0
    for expected in receive:
        result.append([])
        for (m, n), dtype in expected:
            nbytes = m * n * dtype.itemsize
            result[-1].append(received[offset : offset + nbytes].view(dtype).view(m, n))
            offset += _padded(nbytes)
    return result


def gather_to_owners(
    shards: Sequence[Sequence[Tensor]],
    owners: Sequence[int],
    layouts: Sequence[ExchangeLayout],
    world: World,
    buffers: ExchangeBuffers | None = None,
) -> dict[int, Tensor]:
    """Send every rank's shards of each job's matrices to the job's owner, whole matrices come back.

    Args:
        shards: per job, this rank's part of each of its matrices: its rows, or its columns (the layout's
            `ExchangeLayout.cuts`), any float dtype, any shape of that many elements.
        owners: the rank of every job (from `lightning_muon.optim._plan.assign_owners`), the same on every rank.
        layouts: per job, how many matrices, their whole shape, how they are cut, and the dtype they travel
            (and are orthogonalised) in.
        buffers: kept exchange buffers to use (fresh ones without).

    Returns, for each job this rank owns, its matrices stacked whole: ``(blocks, m, n)`` in ``dtype``
    (views into ``buffers``' stacks buffer where given, valid until its next use).
    """
    device = shards[0][0].device
    pieces: list[list] = [[] for _ in range(world.size)]
    receive: list[list] = [[] for _ in range(world.size)]
    for job, layout in enumerate(layouts):
        for block, shard in enumerate(shards[job]):
            parts = layout.parts(block, world.size)
            pieces[owners[job]].append((shard.reshape(layout.part_shape(parts[world.rank])), layout.dtype))
            if owners[job] == world.rank:
                for source, part in enumerate(parts):
                    receive[source].append((layout.part_shape(part), layout.dtype))
    received = _all_to_all(pieces, receive, world, device, buffers)
    mine = [job for job in range(len(layouts)) if owners[job] == world.rank]
    stacks = _buffer(buffers, "stacks", sum(layouts[job].nbytes for job in mine), device)
    whole: dict[int, Tensor] = {}
    taken, offset = [0] * world.size, 0
    for job in mine:
        layout = layouts[job]
        blocks, (m, n) = layout.blocks, layout.shape
        nbytes = blocks * layout.block_bytes  # contiguous; the next stack starts 8-byte aligned
        stack = stacks[offset : offset + nbytes].view(layout.dtype).view(blocks, m, n)
        offset += layout.nbytes
        for i in range(blocks):
            for source, part in enumerate(layout.parts(i, world.size)):
                stack[i][part] = received[source][taken[source] + i]
        for source in range(world.size):
            taken[source] += blocks
        whole[job] = stack
    return whole


def scatter_from_owners(
    whole: dict[int, Tensor],
    owners: Sequence[int],
    layouts: Sequence[ExchangeLayout],
    world: World,
    device: torch.device,
    buffers: ExchangeBuffers | None = None,
) -> list[list[Tensor]]:
    """The inverse of `gather_to_owners`: each owner sends every rank its part (rows or columns) of each whole
    result.

    Args:
        whole: for each job this rank owns, its results ``(blocks, m, n)`` in the layout's dtype.
        device: where the receive buffer lives (the parameters' device).
        buffers: kept exchange buffers to use (fresh ones without).

    Returns, per job, this rank's part of each result (``(rows, cols)`` views into one receive buffer).
    """
    pieces: list[list] = [[] for _ in range(world.size)]
    receive: list[list] = [[] for _ in range(world.size)]
    for job, layout in enumerate(layouts):
        for i in range(layout.blocks):
            parts = layout.parts(i, world.size)
            receive[owners[job]].append((layout.part_shape(parts[world.rank]), layout.dtype))
            if owners[job] == world.rank:
                for dest, part in enumerate(parts):
                    pieces[dest].append((whole[job][i][part], layout.dtype))
    received = _all_to_all(pieces, receive, world, device, buffers)
    result, taken = [], [0] * world.size
    for job, layout in enumerate(layouts):
        owner = owners[job]
        result.append(received[owner][taken[owner] : taken[owner] + layout.blocks])
        taken[owner] += layout.blocks
    return result
