"""Planning the split Newton-Schulz work (``optim/_plan.py``) and where ranks agree (``optim/_collectives.py``),
without processes: owners balanced by FLOPs and bytes on real model shapes (GPT-2 small, a 1B model, at up to 64
ranks), every rank busy, the same plan on every rank, FSDP2 exchanges cut into rounds under a byte limit, plans
cached until the work changes, and the agreement path each backend allows. The runs on 2 processes are in
``tests/test_distributed.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_muon import Muon
from lightning_muon.optim import _update
from lightning_muon.optim._collectives import agreement_path
from lightning_muon.optim._plan import (
    PlanCache,
    assign_owners,
    balance,
    exchange_rounds,
    param_exchange_bytes,
    plan_jobs,
    round_bytes,
)
from lightning_muon.optim.groups import DEFAULT_BATCH_BYTES_ACCELERATOR


def test_owner_assignment_balances_flops_deterministically():
    costs = [9.0, 1.0, 8.0, 2.0, 7.0]
    owners = assign_owners(costs, 2)
    assert owners == assign_owners(costs, 2)
    # Largest first, each to the least-loaded rank: 9 -> 0, 8 -> 1, 7 -> 1, 2 -> 0, 1 -> 0.
    assert owners == [0, 0, 1, 0, 1]
    assert [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)] == [12.0, 15.0]
    assert assign_owners(costs, 1) == [0] * 5


def gpt_shapes(layers: int, width: int) -> list[tuple[int, int]]:
    """The hidden matrices of ``layers`` GPT blocks (as benchmarks/_common.py's ``hidden_shapes``)."""
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers


def accelerator_buckets(shapes: list[tuple[int, int]]) -> list[_update.Bucket]:
    """One DDP step's buckets at the accelerator default of ``ns_batch_bytes``, built by the code on meta tensors."""
    params = [nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer = Muon(params, ns_batch_bytes=DEFAULT_BATCH_BYTES_ACCELERATOR)
    return _update.collect_buckets(optimizer.param_groups, optimizer.state, [True] * len(params),
                                   whole_dtensors=False, synced=True, named=False)


GPT2_SMALL, ONE_B = gpt_shapes(12, 768), gpt_shapes(24, 2048)


@pytest.mark.parametrize("world", [2, 4, 8, 48, 64])
def test_every_rank_gets_work_whenever_there_are_as_many_matrices(world):
    """With the accelerator default GPT-2-small forms 4 buckets; owners per bucket left 4 of 8 ranks idle."""
    buckets = accelerator_buckets(GPT2_SMALL)
    assert len(buckets) < 8  # what makes the test a test
    jobs = plan_jobs(buckets, world)
    # Every parameter in exactly one job, each job one owner's part of one bucket.
    placed = sorted((job.bucket, i) for job in jobs for i in job.indices)
    assert placed == [(b, i) for b, bucket in enumerate(buckets) for i in range(len(bucket.params))]
    assert len({(job.bucket, job.owner) for job in jobs}) == len(jobs)
    assert len(jobs) >= min(world, len(GPT2_SMALL))
    assert len({job.owner for job in jobs}) == min(world, len(GPT2_SMALL))


@pytest.mark.parametrize("shapes", [GPT2_SMALL, ONE_B], ids=["gpt2-small", "1b"])
def test_the_split_at_8_ranks_is_balanced_in_bytes_and_flops(shapes):
    """The issue's targets: the all-gather sends at most 1.2x the minimum, NS work max/mean at most 1.2."""
    buckets = accelerator_buckets(shapes)
    shares = balance(buckets, plan_jobs(buckets, 8), 8)
    assert shares.bytes_over_minimum <= 1.2 and shares.flops_max_over_mean <= 1.2, shares
    # The greedy bound, at any world size: the busiest rank does at most the mean plus one parameter's work.
    largest = max(b.flops / len(b.params) for b in buckets)
    for world in (2, 3, 8, 64):
        flops = balance(buckets, plan_jobs(buckets, world), world).flops
        assert max(flops) <= sum(flops) / world + largest


def test_the_plan_is_the_same_on_every_rank():
    """Each rank builds its own buckets (its own tensors) and plans alone: the plans must agree."""
    shapes = [(7, 7), (16, 8), (7, 7), (3, 5), (7, 7), (16, 8)]
    plans = [plan_jobs(accelerator_buckets(shapes), 3) for _ in range(2)]
    assert plans[0] == plans[1]
    assert plans[0] == plan_jobs(accelerator_buckets(shapes), 3)


@pytest.mark.parametrize("limit", [64 << 20, 20 << 20], ids=["64MiB", "20MiB"])
def test_fsdp2_exchanges_in_rounds_stay_within_the_limit_and_keep_every_owner_busy(limit):
    """~1B model at 8 ranks: one exchange of the whole model needs buffers of ~1/8 of it (300 MB) per rank."""
    buckets = accelerator_buckets(ONE_B)
    jobs = plan_jobs(buckets, 8)
    assert max(round_bytes(buckets, jobs, 8)) > 250 << 20
    rounds = exchange_rounds(buckets, jobs, 8, limit)
    assert len(rounds) > 1
    sizes = [param_exchange_bytes(b, 8) for b in buckets]
    largest = max(max(whole, 8 * rows) for whole, rows in sizes)  # 8192x2048 bf16: 32 MiB
    assert all(max(round_bytes(buckets, r, 8)) <= max(limit, largest) for r in rounds)
    # The same parameters with the same owners, only cut into rounds ...
    owned = sorted((job.bucket, i, job.owner) for r in rounds for job in r for i in job.indices)
    assert owned == sorted((job.bucket, i, job.owner) for job in jobs for i in job.indices)
    # ... and every owner takes part in every round until its work is done (no rank waits on another's NS).
    left = {owner: sum(len(job.indices) for job in jobs if job.owner == owner) for owner in range(8)}
    for r in rounds:
        assert {job.owner for job in r} == {owner for owner, n in left.items() if n}
        for job in r:
            left[job.owner] -= len(job.indices)


def test_a_strategy_plans_again_only_when_the_work_changes():
    planned = []
    plans: PlanCache[None] = PlanCache()
    gpt, other = accelerator_buckets(GPT2_SMALL), accelerator_buckets(GPT2_SMALL[:-1])
    for buckets in (gpt, accelerator_buckets(GPT2_SMALL), other, gpt):
        plans.get(buckets, lambda: planned.append(len(planned)))
    assert planned == [0, 1, 2]  # the second step (fresh buckets, same work) reuses the first one's plan


def test_a_sub_bucket_keeps_its_parameters_lists_aligned():
    (bucket,) = accelerator_buckets([(4, 4)] * 5)
    part = bucket.subset([1, 3])
    assert part.params == [bucket.params[1], bucket.params[3]]
    assert part.grads == [bucket.grads[1], bucket.grads[3]] and part.bufs == [bucket.bufs[1], bucket.bufs[3]]
    assert len(part.names) == 2 and part.shape == bucket.shape and part.group is bucket.group
    assert part.exchange_layout.blocks == 2 and part.flops * 5 == bucket.flops * 2
    assert bucket.subset(range(5)) is bucket


@pytest.mark.parametrize(
    ("backend", "spans_world", "path"),
    [
        ("gloo", True, "cpu"),
        ("gloo", False, "cpu"),
        ("cpu:gloo,cuda:nccl", False, "cpu"),  # init_process_group() without a backend on a GPU machine
        ("nccl", True, "gloo"),  # DDP on GPUs: a gloo group over all ranks, made once
        ("nccl", False, "device"),  # a subgroup: creating a group would need every rank of the job
    ],
)
def test_ranks_agree_on_gradients_without_the_device_wherever_the_backend_allows(backend, spans_world, path):
    assert agreement_path(backend, spans_world) == path
