"""Who orthogonalises what in a distributed Muon step: the step's buckets cut into per-owner jobs.

A bucket (`lightning_muon.optim._update.Bucket`) groups same-shape matrices up to ``ns_batch_bytes``
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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

from lightning_muon.optim._collectives import assign_owners, layout_bytes
from lightning_muon.optim._update import Bucket

T = TypeVar("T")


class Job(NamedTuple):
    """The parameters of one bucket that one rank orthogonalises (in one batched Newton-Schulz call)."""

    #: Index of the bucket in the step's list of buckets.
    bucket: int
    #: The rank that orthogonalises them.
    owner: int
    #: Their positions in the bucket, ascending.
    indices: tuple[int, ...]


def sub_bucket(bucket: Bucket, indices: Sequence[int]) -> Bucket:
    """The bucket restricted to the parameters at ``indices``: every per-parameter list field is sliced
    (``params``, ``grads``, ``bufs``, ``names`` and any other list with one entry per parameter); the
    group, shape and layout stay. The whole bucket itself when ``indices`` covers it in order."""
    count = len(bucket.params)
    if list(indices) == list(range(count)):
        return bucket
    fields = {
        name: [value[i] for i in indices]
        for name, value in zip(bucket._fields, bucket, strict=True)
        if isinstance(value, list) and len(value) == count
    }
    sliced: Bucket = bucket._replace(**fields)  # type: ignore[arg-type]  # list fields only, by construction
    return sliced


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
        part = sub_bucket(buckets[job.bucket], job.indices)
        sent[job.owner] += layout_bytes(part.exchange_layout)
        flops[job.owner] += part.flops
    return Balance(sent, flops)
