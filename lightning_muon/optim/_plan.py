"""Who orthogonalises what in a distributed Muon step: the step's buckets cut into per-owner jobs.

A bucket (`lightning_muon.optim._bucket.Bucket`) groups same-shape matrices up to ``ns_batch_bytes``
for one batched Newton-Schulz call; with the accelerator default (256 MiB) a whole GPT-2-small forms
4 buckets. Giving each bucket to one rank would leave ranks idle from ``world > buckets`` on and
make the all-gather pad every rank's share to the largest bucket. So owners are assigned per
parameter (its matrices, FLOP-balanced, largest first: `assign_owners`), and each bucket is cut into
one job per owner: the parameters of the bucket that rank owns, still orthogonalised in one batched
call. Hence:

- there are at least ``world`` jobs whenever there are at least ``world`` parameters (every rank
  gets one before any gets a second), and every rank makes at most one Newton-Schulz call per bucket;
- the busiest rank does at most the mean plus one parameter's FLOPs (the greedy bound; measured
  1.00-1.02x the mean for GPT-2-small at 2-8 ranks, see ``benchmarks/distributed.py --plan``);
- the plan is a pure function of the buckets, the same on every rank without communicating.

Under FSDP2 the jobs' exchanges then run in rounds (`exchange_rounds`), so that no exchange buffer
grows with the model.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from lightning_muon.optim._bucket import Bucket
from lightning_muon.optim._collectives import ExchangeLayout

T = TypeVar("T")


class Job(NamedTuple):
    """The parameters of one bucket that one rank orthogonalises (in one batched Newton-Schulz call)."""

    #: Index of the bucket in the step's list of buckets.
    bucket: int
    #: The rank that orthogonalises them.
    owner: int
    #: Their positions in the bucket, ascending.
    indices: tuple[int, ...]


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


def plan_jobs(buckets: Sequence[Bucket], world_size: int) -> list[Job]:
    """Cut every bucket into one job per owner rank, owners assigned per parameter (see the module docstring).

    Jobs come bucket by bucket, owners ascending within a bucket: the same list on every rank.
    """
    costs, where = [], []
    for b, bucket in enumerate(buckets):
        per_param = bucket.flops / len(bucket.params)  # same-shape matrices: an equal share each
        costs += [per_param] * len(bucket.params)
        where += [(b, i) for i in range(len(bucket.params))]
    owned: dict[tuple[int, int], list[int]] = {}
    for (b, i), owner in zip(where, assign_owners(costs, world_size), strict=True):
        owned.setdefault((b, owner), []).append(i)
    return [Job(b, owner, tuple(owned[b, owner])) for b, owner in sorted(owned)]


def in_bucket_order(buckets: Sequence[Bucket], jobs: Sequence[Job], per_job: Sequence[Sequence[T]]) -> list[list[T]]:
    """Per-job results (one per parameter of the job) put back in their buckets' order."""
    ordered: list[list] = [[None] * len(bucket.params) for bucket in buckets]
    for job, results in zip(jobs, per_job, strict=True):
        for i, result in zip(job.indices, results, strict=True):
            ordered[job.bucket][i] = result
    return ordered


class PlanCache(Generic[T]):
    """The last step's plan, computed again only when what a plan reads changes: the buckets' parameter
    counts, FLOPs and exchange layouts, and the exchange limit. A plan of a large model is milliseconds of
    Python (1,000 matrices, 64 ranks: ~5 ms) that most steps would repeat."""

    def __init__(self) -> None:
        #: ``(key, plan)`` of the last step.
        self._last: tuple[Any, T] | None = None

    def get(self, buckets: Sequence[Bucket], plan: Callable[[], T], limit: int = 0) -> T:
        """``plan()``, or the last one where ``buckets`` and ``limit`` ask for the same work."""
        key = (tuple((len(b.params), b.flops, b.exchange_layout) for b in buckets), limit)
        if self._last is None or self._last[0] != key:
            self._last = (key, plan())
        return self._last[1]


class Balance(NamedTuple):
    """How evenly a plan spreads a step over the ranks."""

    #: Bytes each rank sends in the DDP all-gather (its jobs' updates, in ``ns_dtype``, 8-byte aligned).
    bytes: list[int]
    #: Newton-Schulz FLOPs of each rank.
    flops: list[float]

    @property
    def bytes_over_minimum(self) -> float:
        """What the all-gather sends (every rank's share padded to the largest: ``world * max``) over the
        least it could (every update once: the sum)."""
        return len(self.bytes) * max(self.bytes) / max(1, sum(self.bytes))

    @property
    def flops_max_over_mean(self) -> float:
        """The busiest rank's Newton-Schulz work over the mean (a step waits for the busiest)."""
        return max(self.flops) * len(self.flops) / max(1.0, sum(self.flops))


def balance(buckets: Sequence[Bucket], jobs: Sequence[Job], world_size: int) -> Balance:
    """Bytes and FLOPs per rank of a plan of these buckets."""
    sent, flops = [0] * world_size, [0.0] * world_size
    for job in jobs:
        part = buckets[job.bucket].subset(job.indices)
        sent[job.owner] += part.exchange_layout.nbytes
        flops[job.owner] += part.flops
    return Balance(sent, flops)


# ----------------------------------------------------------------- FSDP2 exchange rounds


def param_exchange_bytes(bucket: Bucket, world_size: int) -> tuple[int, int]:
    """What one parameter of the bucket weighs in an FSDP2 exchange buffer: ``(whole, rows)``, the bytes its
    owner receives (every rank's shard, each 8-byte aligned; as much again for the stack and the results it
    sends back), and the most bytes any rank sends of it (its largest part). Where the bucket's parameters are
    cut in different ways (tensor parallelism's row and column shards), the larger of each over its parameters."""
    layout = bucket.exchange_layout
    whole, rows = 0, 0
    for block in {cut: block for block, cut in enumerate(layout.cuts or [None])}.values():
        sizes = [ExchangeLayout(1, layout.part_shape(part), layout.dtype).nbytes
                 for part in layout.parts(block, world_size)]
        whole, rows = max(whole, sum(sizes)), max(rows, *sizes)
    return whole, rows


def round_bytes(buckets: Sequence[Bucket], jobs: Sequence[Job], world_size: int) -> tuple[int, int]:
    """``(whole, rows)`` of a round of these jobs: the most bytes any owner receives (its jobs' matrices),
    and the most bytes any rank sends (its rows of every job). Every exchange buffer of the round holds one of
    the two, or less."""
    whole, rows = [0] * world_size, 0
    for job in jobs:
        w, r = param_exchange_bytes(buckets[job.bucket], world_size)
        whole[job.owner] += w * len(job.indices)
        rows += r * len(job.indices)
    return max(whole), rows


def exchange_rounds(buckets: Sequence[Bucket], jobs: Sequence[Job], world_size: int, limit: int) -> list[list[Job]]:
    """The jobs of an FSDP2 step in rounds of exchanges, every owner busy in every round it has work for.

    Each round takes from every owner's parameters (in plan order) as many as keep its received bytes
    (`round_bytes`' ``whole``) and every rank's sent rows (``rows``) within ``limit``, and at least one, so
    that no owner waits a round while another works. A job that does not fit is cut between rounds at a
    parameter boundary. Hence every exchange buffer of a round holds at most ``max(limit, P)`` bytes, with
    ``P`` the largest of any parameter's whole bytes and ``world_size`` times its first rank's rows (what the
    owners' first parameters of a round may send together). Within a round jobs come bucket by bucket, owners
    ascending: the same rounds on every rank.
    """
    queues: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]  # per owner: (bucket, position)
    for job in jobs:
        queues[job.owner] += [(job.bucket, i) for i in job.indices]
    sizes = [param_exchange_bytes(bucket, world_size) for bucket in buckets]
    rounds: list[list[Job]] = []
    taken = [0] * world_size  # how far each owner's queue is done
    while any(taken[o] < len(queues[o]) for o in range(world_size)):
        current: dict[tuple[int, int], list[int]] = {}
        whole, rows, added = [0] * world_size, 0, True
        while added:  # owners take turns, one parameter each, until none fits
            added = False
            for owner in range(world_size):
                if taken[owner] == len(queues[owner]):
                    continue
                b, i = queues[owner][taken[owner]]
                w, r = sizes[b]
                if whole[owner] and (whole[owner] + w > limit or rows + r > limit):
                    continue
                current.setdefault((b, owner), []).append(i)
                whole[owner], rows, taken[owner], added = whole[owner] + w, rows + r, taken[owner] + 1, True
        rounds.append([Job(b, owner, tuple(sorted(ix))) for (b, owner), ix in sorted(current.items())])
    return rounds
