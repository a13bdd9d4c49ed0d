"""Where Muon's Newton-Schulz work runs: on every rank, split over DDP ranks, or on FSDP2 owner ranks.

`choose_strategy` picks one of three, from the parameters and the process group:

- `LocalStep`: one process, or every rank doing all the work (``split_ns=False``,
  and DTensor layouts other than FSDP2's and HSDP's, whose matrices are gathered
  whole: a fallback, said in a rank-zero warning);
- `ReplicatedStep` (DDP): each rank orthogonalises a FLOP-balanced share of the
  matrices, the results are all-gathered, every rank applies every update;
- `ShardedStep` (FSDP2, DTensors ``Shard(0)`` on a 1-D mesh; HSDP, ``(Replicate(),
  Shard(0))`` on a 2-D mesh, within each replica's shard group): each matrix's row
  shards go to an owner rank, which orthogonalises the whole matrices and sends
  every rank back its rows.

Owners are assigned per parameter, each bucket cut into one job per owner
(`lightning_muon.optim._plan`), so the split does not depend on ``ns_batch_bytes``.
A distributed run says which path it takes in one rank-zero line at its first step (the ``lightning_muon``
logger at INFO; a fallback is a warning); a single process says it only at DEBUG.

Each strategy owns its owners, exchange buffers, byte count and diagnostics;
all of them use the maths of `lightning_muon.optim._update`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from lightning_muon.optim import _update
from lightning_muon.optim._collectives import (
    Agreement,
    ExchangeBuffers,
    World,
    all_gather_results,
    any_rank,
    gather_to_owners,
    is_dtensor,
    make_agreement,
    replicated_world,
    scatter_from_owners,
    sharded_world,
)
from lightning_muon.optim._plan import Job, exchange_rounds, in_bucket_order, plan_jobs, sub_bucket
from lightning_muon.optim._update import Bucket, Chooser, ParamDiagnostics

T = TypeVar("T")


class LocalStep:
    """Every bucket orthogonalised here, bucket by bucket (DTensors gathered whole on every rank)."""

    #: Ranks that must agree on which parameters have gradients (``None``: no other rank takes part).
    world: World | None = None
    #: Where they agree (`agree`): on a CPU tensor wherever the backend allows, so no device sync.
    agreement: Agreement | None = None
    #: Sharded matrices are orthogonalised one at a time, each gathered whole.
    whole_dtensors = True
    #: Bytes this rank sent in the last step's exchanges.
    exchanged_bytes = 0
    #: Every parameter needs a momentum buffer from the first step on (DTensor parameters: a distributed
    #: checkpoint of FSDP2 resumes only when it has a state for every parameter).
    complete_state = False
    #: ``(key, plan)`` of the last step (`_planned`).
    _last_plan: tuple[Any, Any] | None = None

    def __init__(self, description: str = "Newton-Schulz runs on this process alone", fallback: bool = False) -> None:
        #: Which path the run takes, a clause for the rank-zero line of `choose_strategy`.
        self.description = description
        #: Whether that path is a fallback that repeats the Newton-Schulz work on every rank.
        self.fallback = fallback

    def agree(self, flags: list[bool], device: torch.device) -> list[bool]:
        """``flags`` (one per parameter: has it a gradient?) ORed over the world's ranks, so that every rank
        builds the same buckets; ``flags`` itself without a world. ``device``: the parameters' device, used only
        where the backend cannot all-reduce a CPU tensor (see `lightning_muon.optim._collectives.agreement_path`)."""
        if self.agreement is None:
            return flags
        return any_rank(flags, self.agreement.device or device, self.agreement.group)

    def _planned(self, buckets: Sequence[Bucket], plan: Callable[[], T], limit: int = 0) -> T:
        """``plan()``, computed again only when what a plan reads changes (the buckets' parameter counts, FLOPs
        and exchange layouts, and the exchange ``limit``), else the last step's: a plan of a large model is
        milliseconds of Python (1,000 matrices, 64 ranks: ~5 ms) that most steps would repeat."""
        key = (tuple((len(b.params), b.flops, b.exchange_layout) for b in buckets), limit)
        if self._last_plan is None or self._last_plan[0] != key:
            self._last_plan = (key, plan())
        return cast(T, self._last_plan[1])

    def run(self, buckets: Sequence[Bucket], diagnose: Chooser | None) -> list[ParamDiagnostics]:
        """Momentum, Newton-Schulz and apply for every bucket; the diagnostics of the chosen matrices."""
        diagnostics: list[ParamDiagnostics] = []
        # Call by call (a bucket, or one with its transposed twin: `ns_batches`), so a matrix's buffer and
        # gradient are still in cache for its whole update (on CPU, sweeping every buffer first and
        # orthogonalising afterwards measured slower).
        for batch in _update.ns_batches(buckets):
            chosen = [buckets[j] for j in batch]
            results = _update.orthogonalise_together(chosen, [_update.momentum(b) for b in chosen])
            for bucket, orthogonal in zip(chosen, results, strict=True):
                _update.apply(bucket, orthogonal)
                if diagnose is not None:
                    diagnostics += _update.record(bucket, orthogonal, diagnose)
        return diagnostics


class ReplicatedStep(LocalStep):
    """DDP: each rank orthogonalises its share of the matrices; the results are all-gathered; all apply all.

    Every rank keeps every momentum buffer (Lightning checkpoints rank 0), so parameters stay identical.
    """

    def __init__(self, world: World) -> None:
        super().__init__(
            f"Newton-Schulz split over {world.size} DDP ranks (each orthogonalises a FLOP-balanced share of the "
            "matrices, the updates are all-gathered)"
        )
        self.world = world
        self.agreement = make_agreement(world.group)
        # Reused between steps: allocating and faulting in a copy of all updates every step measured
        # ~20% of a split step.
        self._buffers: dict = {}

    def run(self, buckets: Sequence[Bucket], diagnose: Chooser | None) -> list[ParamDiagnostics]:
        assert self.world is not None
        if not buckets:  # the same on every rank: which parameters have gradients was agreed
            return []
        size = self.world.size
        jobs = self._planned(buckets, lambda: plan_jobs(buckets, size))
        parts = [sub_bucket(buckets[job.bucket], job.indices) for job in jobs]
        local = {}
        for j, (job, part) in enumerate(zip(jobs, parts, strict=True)):
            if job.owner == self.world.rank:
                local[j] = _update.orthogonalise(part, _update.momentum(part))
        # Every rank keeps every momentum buffer; only the owner needs the update itself.
        mine = {job.bucket: set(job.indices) for job in jobs if job.owner == self.world.rank}
        for b, bucket in enumerate(buckets):
            others = [i for i in range(len(bucket.params)) if i not in mine.get(b, ())]
            if others:
                _update.momentum(sub_bucket(bucket, others), update=False)
        device = buckets[0].params[0].device
        layouts = [part.exchange_layout for part in parts]
        owners = [job.owner for job in jobs]
        gathered = all_gather_results(local, owners, layouts, self.world, device, self._buffers)
        self.exchanged_bytes = int(sum(t.numel() * t.element_size() for ts in local.values() for t in ts))
        diagnostics: list[ParamDiagnostics] = []
        for bucket, orthogonal in zip(buckets, in_bucket_order(buckets, jobs, gathered), strict=True):
            _update.apply(bucket, orthogonal)
            if diagnose is not None:
                diagnostics += _update.record(bucket, orthogonal, diagnose)
        return diagnostics


#: The most bytes one FSDP2 exchange buffer holds per rank (a round of exchanges stays within it, see
#: `lightning_muon.optim._plan.exchange_rounds`): large enough for all-to-alls at full bandwidth and for batched
#: Newton-Schulz calls that gain nothing from growing further, small next to an accelerator's memory.
EXCHANGE_ROUND_BYTES = 64 << 20


class ShardedStep(LocalStep):
    """FSDP2: each job's row shards go to its owner rank, which orthogonalises the whole matrices and
    sends every rank back its rows of the result; every rank applies its own rows. Momentum stays sharded.

    The exchanges run in rounds (`lightning_muon.optim._plan.exchange_rounds`, every owner busy in each):
    every exchange buffer holds at most ``max(round_bytes, P)`` bytes per rank, ``P`` about one parameter's
    matrices in ``ns_dtype`` (for a parameter larger than the limit), through three buffers kept between
    steps (send, receive, stacks), so the exchange memory is bounded by the round, not the model. At the
    peak of a round a rank holds those three, the owner's Newton-Schulz results (as large as its stacks)
    and the round's momentum updates of its rows (in the gradients' dtype): about ``4 * round_bytes`` plus
    those updates, where one exchange of the whole model allocated its share (``~12 bytes per Muon
    parameter / world``) afresh every step.
    """

    whole_dtensors = False

    def __init__(self, world: World) -> None:
        #: Most bytes one exchange buffer holds in a round (`EXCHANGE_ROUND_BYTES` unless changed).
        self.round_bytes = EXCHANGE_ROUND_BYTES
        where = f"{world.size} ranks"
        if world.replicas > 1:
            where = f"the {world.size} ranks of the mesh's shard dim, repeated by each of its {world.replicas} replicas"
        super().__init__(
            f"Newton-Schulz on FSDP2 owner ranks: {where} (each matrix's shards go to one owner and its rows come "
            f"back, in rounds of at most {self.round_bytes / 2**20:g} MiB per exchange buffer)"
        )
        self.world = world
        # HSDP: the replicas agree too (their flags are the same), so over the whole job where the mesh spans it.
        spans = world.replicas > 1 and world.size * world.replicas == torch.distributed.get_world_size()
        self.agreement = make_agreement(None if spans else world.group)
        self.buffers = ExchangeBuffers()
        #: Rounds of exchanges the last step took.
        self.rounds = 0
        #: Bytes of the largest exchange buffer the last step needed (at most `round_bytes`, or one parameter).
        self.largest_buffer = 0

    def run(self, buckets: Sequence[Bucket], diagnose: Chooser | None) -> list[ParamDiagnostics]:
        assert self.world is not None
        self.exchanged_bytes = self.buffers.largest = 0
        self.rounds = self.largest_buffer = 0
        if not buckets:  # the same on every rank: which parameters have gradients was agreed
            return []
        # The local shards (views: in-place updates reach the DTensors) do all the elementwise work.
        local = [bucket.local() for bucket in buckets]
        size, limit = self.world.size, self.round_bytes
        rounds = self._planned(buckets, lambda: exchange_rounds(buckets, plan_jobs(buckets, size), size, limit), limit)
        chosen = {} if diagnose is None else chosen_rows(buckets, diagnose)
        values = torch.zeros(len(chosen), 2, device=local[0].params[0].device)
        for jobs in rounds:
            results = self._round(buckets, local, jobs)
            if chosen:
                measure_into(values, chosen, buckets, jobs, results)
        self.rounds, self.largest_buffer = len(rounds), self.buffers.largest
        if diagnose is None:
            return []
        # Owners measured the whole updates they computed; one all-reduce gives every rank every number.
        torch.distributed.all_reduce(values, group=self.world.group)
        return [
            ParamDiagnostics(buckets[b].names[i], tuple(buckets[b].params[i].shape), buckets[b].effective_lr, *row)
            for (b, i), row in zip(chosen, values, strict=True)
        ]

    def _round(self, buckets: Sequence[Bucket], local: Sequence[Bucket], jobs: Sequence[Job]) -> dict[int, Tensor]:
        """One round: momentum of the round's rows, shards to their owners, Newton-Schulz there, rows back,
        apply. Returns the whole results this rank computed, by the index of their job in ``jobs``."""
        assert self.world is not None
        touched: dict[int, list[int]] = {}  # bucket -> its positions in this round: one foreach call per bucket
        for job in jobs:
            touched.setdefault(job.bucket, []).extend(job.indices)
        parts = {b: (sorted(ix), sub_bucket(local[b], sorted(ix))) for b, ix in touched.items()}
        update_of: dict[tuple[int, int], Tensor] = {}
        for b, (ix, part) in parts.items():
            update_of.update(zip([(b, i) for i in ix], _update.momentum(part), strict=True))
        shards = [[update_of[job.bucket, i] for i in job.indices] for job in jobs]
        owners = [job.owner for job in jobs]
        layouts = [sub_bucket(buckets[job.bucket], job.indices).exchange_layout for job in jobs]
        whole = gather_to_owners(shards, owners, layouts, self.world, self.buffers)
        results = {j: _update.orthogonalise_stack(buckets[jobs[j].bucket].group, stack) for j, stack in whole.items()}
        device = local[0].params[0].device
        mine = scatter_from_owners(results, owners, layouts, self.world, device, self.buffers)
        self.exchanged_bytes += sum(
            s.numel() * layout[2].itemsize for ss, layout in zip(shards, layouts, strict=True) for s in ss
        ) + sum(r.numel() * r.element_size() for r in results.values())
        rows_of: dict[tuple[int, int], Tensor] = {}
        for job, got in zip(jobs, mine, strict=True):
            rows_of.update(zip([(job.bucket, i) for i in job.indices], got, strict=True))
        for b, (ix, part) in parts.items():
            _update.apply(part, [rows_of[b, i] for i in ix])
        return results


def chosen_rows(buckets: Sequence[Bucket], diagnose: Chooser) -> dict[tuple[int, int], int]:
    """``(bucket, position) -> row`` of every diagnosed parameter, in bucket order (as on one process)."""
    chosen = [(b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket.params) if diagnose(p)]
    return {key: row for row, key in enumerate(chosen)}


def measure_into(
    values: Tensor,
    chosen: dict[tuple[int, int], int],
    buckets: Sequence[Bucket],
    jobs: Sequence[Job],
    results: dict[int, Tensor],
) -> None:
    """Write the orthogonality error and update RMS of the diagnosed matrices among ``results`` (whole, by job)
    into their rows of ``values``."""
    for j, stack in results.items():
        job = jobs[j]
        picked = [k for k, i in enumerate(job.indices) if (job.bucket, i) in chosen]
        if picked:
            errors, rms = _update.measure(stack[picked], buckets[job.bucket].effective_lr)
            rows = [chosen[job.bucket, job.indices[k]] for k in picked]
            values[rows] = torch.stack([errors, rms], dim=1)


_log = logging.getLogger("lightning_muon")


def choose_strategy(params: Sequence[Tensor], split_ns: bool, stacks: bool = False) -> LocalStep:
    """The strategy for these parameters under the current process group (see the module docstring), said
    in one line on rank zero: at INFO where the work could be split (several ranks, or DTensor parameters), at
    DEBUG on a single process, and as a warning for a fallback that repeats the Newton-Schulz work on every rank.

    With ``stacks`` (some parameter holds a stack of matrices, sharded on its stack dim under FSDP2), every
    rank gathers the whole matrices instead of the owner exchange, which splits matrix rows.
    """
    strategy = _choose(params, split_ns, stacks)
    strategy.complete_state = any(is_dtensor(p) for p in params)
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if initialised and torch.distributed.get_rank() != 0:
        return strategy
    message = f"Muon: {strategy.description}."
    if strategy.fallback:
        warnings.warn(message, UserWarning, stacklevel=4)  # at the caller of Muon.step
    else:
        several = initialised and torch.distributed.get_world_size() > 1
        _log.log(logging.INFO if several or strategy.complete_state else logging.DEBUG, message)
    return strategy


def _choose(params: Sequence[Tensor], split_ns: bool, stacks: bool) -> LocalStep:
    several = torch.distributed.is_available() and torch.distributed.is_initialized()
    several = several and torch.distributed.get_world_size() > 1
    dtensors = any(is_dtensor(p) for p in params)
    if not split_ns:
        whole = "gathers and orthogonalises every whole matrix" if dtensors else "orthogonalises every matrix"
        return LocalStep(f"every rank {whole} (split_ns=False)") if several or dtensors else LocalStep()
    if dtensors:
        stacked = "a parameter holds a stack of matrices (sharded on its stack dim)"
        sharded = stacked if stacks else sharded_world(params)
        if isinstance(sharded, World):
            return ShardedStep(sharded)
        return LocalStep(f"every rank gathers and orthogonalises every whole matrix (not split: {sharded})", several)
    replicated = replicated_world(params) if params else None
    return ReplicatedStep(replicated) if replicated is not None else LocalStep()
