"""Muon on Lightning's DDP strategy (2 CPU processes, gloo): split Newton-Schulz work, same result as 1 process.

Also FSDP2 (through ``fsdp2_run.py``), explicit process groups and device meshes, resumes and hangs; how the work
is planned, without processes, is in ``tests/optim/test_plan.py``."""

from __future__ import annotations

import datetime
import functools
import itertools
import logging
import math
import os
import re
import time
import warnings
from pathlib import Path

import fsdp2_run
import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessRaisedException

from lightning_muon import Muon, MuonMixin
from lightning_muon.commands.cli import main
from lightning_muon.optim import _strategies
from lightning_muon.optim._dtensor import is_dtensor
from lightning_muon.optim.groups import SECOND_MOMENT
from lightning_muon.optim.newton_schulz import zeropower_via_newtonschulz

from helpers import (
    RANKS_START_METHOD,
    EndProcessGroup,
    ForkedDDP,
    MuonNet,
    SaveEveryRank,
    epoch_checkpoints,
    make_trainer,
    muon_factory,
    run_ranks,
)

#: 2 ranks x batch 4 and 1 process x batch 8 differ only in float32 summation order; fp32 Newton-Schulz
#: keeps 10 updates of that within this.
TOLERANCE = 1e-4


def train(tmp_path: Path, devices: int, split_ns: bool = True, unused_every: int = 0, steps: int = 10) -> list[dict]:
    muon = muon_factory(split_ns)
    L.seed_everything(0)
    # net.0 reads the batch (an input layer, AdamW's): its pattern keeps it on Muon for the work split's four shapes
    model = MuonNet(batch_size=8 // devices, unused_every=unused_every, muon=muon,
                    muon_params=["sometimes.weight", "net.0.weight"], adamw_params=["net.8.*"])
    kwargs = {"strategy": ForkedDDP(find_unused_parameters=True)} if devices > 1 else {}
    tmp_path.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveEveryRank(tmp_path), EndProcessGroup()],
        **kwargs,
    )
    trainer.fit(model)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(devices)]


@pytest.mark.distributed
@pytest.mark.parametrize("split_ns", [True, False], ids=["split", "not-split"])
def test_two_ranks_with_half_batches_equal_one_process(tmp_path, split_ns):
    (single,) = train(tmp_path / "one", devices=1)
    rank0, rank1 = train(tmp_path / "two", devices=2, split_ns=split_ns)
    for name, p in single["params"].items():
        assert torch.equal(rank0["params"][name], rank1["params"][name]), f"{name} differs between ranks"
        torch.testing.assert_close(rank0["params"][name], p, atol=TOLERANCE, rtol=0, msg=name)
    sent = [rank0["exchange_bytes"], rank1["exchange_bytes"]]
    if split_ns:
        # fp32 updates of 16x8, 2 x 16x16, 24x16 (`sometimes` had no gradient on the last step):
        # each rank sent only its share, together exactly one copy.
        assert sum(sent) == 4 * (16 * 8 + 2 * 16 * 16 + 24 * 16) and min(sent) > 0
    else:
        assert sent == [0, 0]


@pytest.mark.distributed
def test_a_parameter_without_gradient_on_some_steps_does_not_hang_or_diverge(tmp_path):
    (single,) = train(tmp_path / "one", devices=1, unused_every=3)
    rank0, rank1 = train(tmp_path / "two", devices=2, unused_every=3)
    for name, p in single["params"].items():
        assert torch.equal(rank0["params"][name], rank1["params"][name]), name
        torch.testing.assert_close(rank0["params"][name], p, atol=TOLERANCE, rtol=0, msg=name)


def _agreement_worker(rank: int, init_file: str, out: str) -> None:
    """Under a (pretended) NCCL world, Muon agrees on gradient presence over a gloo group, on CPU tensors."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    dist.get_backend = lambda group=None: "nccl"  # what choose_strategy sees; the real group stays gloo
    reduced = []
    all_reduce = dist.all_reduce

    def recording(tensor, *args, group=None, **kwargs):
        reduced.append((str(tensor.device), group is None))
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = recording
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 4)) for _ in range(3)]
    optimizer = Muon(params, lr=0.1, ns_dtype=torch.float32)
    for p in params[1:]:
        p.grad = torch.ones_like(p)
    params[0].grad = torch.ones_like(params[0]) if rank == 0 else None  # missing on rank 1 only
    optimizer.step()
    strategy = optimizer._choice.chosen  # private: the agreement itself is no public API
    flags = strategy.agree([rank == 0, rank == 1, False], torch.device("cpu"))
    path = optimizer.strategy.description
    torch.save({"reduced": reduced, "flags": flags, "sent": optimizer.last_exchange_bytes, "path": path,
                "buffer": optimizer.state[params[0]]["momentum_buffer"].clone()}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    os._exit(0)  # as _sharded_worker: no interpreter teardown


@pytest.mark.distributed
def test_a_device_only_backend_agrees_on_a_gloo_group_of_cpu_tensors(tmp_path):
    mp.start_processes(
        _agreement_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
        start_method=RANKS_START_METHOD,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        # Two agreements (the step's and the direct call), each a CPU tensor on a group of its own.
        assert r["reduced"] == [("cpu", False), ("cpu", False)]
        assert r["flags"] == [True, True, False]
        assert r["path"].startswith("Newton-Schulz split over 2 DDP ranks")
        assert r["sent"] > 0
    # The parameter that only rank 0 had a gradient for was stepped on both (rank 1 with zeros).
    assert ranks[0]["buffer"].abs().sum() > 0 and ranks[1]["buffer"].abs().sum() == 0


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_a_single_process_says_which_path_it_takes_only_at_debug(caplog, level):
    """On one process the path line informs nobody, so it is said at DEBUG only (a distributed run says it at
    INFO, from rank zero: `test_cli.test_distributed_config_fits_with_two_processes`)."""
    p = nn.Parameter(torch.randn(4, 4))
    p.grad = torch.ones_like(p)
    optimizer = Muon([p], ns_dtype=torch.float32)  # the dtype by hardware has a line of its own, once a process
    with caplog.at_level(level, logger="lightning_muon"):
        optimizer.step()
        optimizer.step()
    told = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith("Muon:")]
    assert told == ([(logging.DEBUG, "Muon: Newton-Schulz runs on this process alone.")] if level == logging.DEBUG
                    else [])


def test_a_muon_stepped_before_init_process_group_chooses_its_strategy_again_after_it(tmp_path):
    """The strategy follows the default process group: chosen again once per change of it, not every step (two
    ranks take the split path after init: `test_an_explicit_process_group_or_device_mesh_is_where_the_work_runs`)."""
    p = nn.Parameter(torch.randn(4, 4))
    optimizer = Muon([p])
    p.grad = torch.ones_like(p)
    optimizer.step()
    before = optimizer.strategy  # one object per choice
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        optimizer.step()
        during = optimizer.strategy
        optimizer.step()
        assert optimizer.strategy is during
        # An explicit group (here the default one) is used as given, and not chosen again after a change.
        explicit = Muon([p], process_group=dist.group.WORLD)
        explicit.step()
        given = explicit.strategy
    finally:
        dist.destroy_process_group()
    optimizer.step()
    explicit.step()
    assert during is not before and optimizer.strategy is not during
    assert explicit.strategy is given
    # One rank: nothing to split, so every choice is the local path.
    assert all(s.kind == "local" and s.ranks == 1 for s in (before, during, given, optimizer.strategy))


#: Replicated matrices of the explicit-group worker: a tall one and its wide twin, two squares.
WHERE_SHAPES = [(8, 4), (6, 6), (4, 8), (6, 6)]


def _where_worker(rank: int, init_file: str, out: str) -> None:
    """A Muon stepped before ``init_process_group`` and after; one given a process group, one a device mesh;
    the refusals of arguments that do not fit; the path again after ``destroy_process_group``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    initial = [torch.randn(shape) for shape in WHERE_SHAPES]
    grads = [torch.randn(shape) for shape in WHERE_SHAPES]  # the same on both ranks, as under DDP
    place = lambda x: x  # noqa: E731

    def stepped(optimizer: Muon, params: list[nn.Parameter]) -> Muon:
        for p, g in zip(params, grads):
            p.grad = place(g.clone())
        optimizer.step()
        return optimizer

    def fresh(**kwargs) -> tuple[Muon, list[nn.Parameter]]:
        params = [nn.Parameter(place(x.clone())) for x in initial]
        return Muon(params, lr=0.1, ns_dtype=torch.float32, **kwargs), params

    def refusal(**kwargs) -> str:
        try:
            fresh(**kwargs)
        except ValueError as error:
            return str(error)
        return "accepted"

    results: dict = {}
    # `strategy.description`: the path line is logged from rank zero only, so each rank reads it here.
    early, early_params = fresh()
    results["before"] = stepped(early, early_params).strategy.description
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results["after"] = (stepped(early, early_params).strategy.description, early.last_exchange_bytes)
    results["kinds"] = {"after": (early.strategy.kind, early.strategy.ranks, early.strategy.fallback)}
    group, only_zero = dist.new_group([0, 1]), dist.new_group([0])  # collective: every rank creates both
    gathered_over, all_gather = [], dist.all_gather

    def recording(tensors, tensor, group=None, **kwargs):
        gathered_over.append(group)
        return all_gather(tensors, tensor, group=group, **kwargs)

    dist.all_gather = recording
    explicit = stepped(*fresh(process_group=group))
    dist.all_gather = all_gather
    alone = stepped(*fresh(split_ns=False))
    results["explicit"] = {
        "path": explicit.strategy.description,
        "sent": explicit.last_exchange_bytes,
        "over_the_group": [g is group for g in gathered_over],
        "params": [p.detach().clone() for group in explicit.param_groups for p in group["params"]],
        "alone": [p.detach().clone() for group in alone.param_groups for p in group["params"]],
    }
    if rank == 0:
        results["only_zero"] = stepped(*fresh(process_group=only_zero)).strategy.description
    else:
        results["only_zero"] = refusal(process_group=only_zero)
    mesh, other_mesh = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (1, 2))
    results["plain_on_a_mesh"] = refusal(device_mesh=mesh)
    place = functools.partial(distribute_tensor, device_mesh=mesh, placements=[Shard(0)])
    sharded = stepped(*fresh(device_mesh=mesh))
    results["kinds"]["mesh"] = (sharded.strategy.kind, sharded.strategy.ranks, sharded.strategy.fallback)
    results["mesh"] = {
        "path": sharded.strategy.description,
        "sent": sharded.last_exchange_bytes,
        "params": [p.full_tensor().detach() for group in sharded.param_groups for p in group["params"]],
    }
    results["dtensor_with_a_group"] = refusal(process_group=group)
    results["dtensor_on_another_mesh"] = refusal(device_mesh=other_mesh)
    dist.barrier()
    dist.destroy_process_group()
    place = lambda x: x  # noqa: E731
    results["destroyed"] = stepped(early, early_params).strategy.description
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    os._exit(0)  # as _sharded_worker: no interpreter teardown


@pytest.mark.distributed
def test_an_explicit_process_group_or_device_mesh_is_where_the_work_runs(tmp_path):
    mp.start_processes(
        _where_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
        start_method=RANKS_START_METHOD,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    alone = "Newton-Schulz runs on this process alone"
    for r in ranks:
        # Stepped before init_process_group: alone; after it, the same optimizer splits the work; after
        # destroy_process_group, alone again.
        assert r["before"] == alone and r["destroyed"] == alone
        path, sent = r["after"]
        assert path.startswith("Newton-Schulz split over 2 DDP ranks (") and sent > 0
        # An explicit group: the split over it, every all-gather on it, the result of one process.
        explicit = r["explicit"]
        assert explicit["path"].startswith("Newton-Schulz split over 2 DDP ranks of the given process group (")
        assert explicit["sent"] > 0 and explicit["over_the_group"] == [True]
        torch.testing.assert_close(explicit["params"], explicit["alone"], atol=1e-6, rtol=0)
        # An explicit mesh: FSDP2's owner ranks on it, the result of one process.
        assert r["mesh"]["path"].startswith("Newton-Schulz on FSDP2 owner ranks: 2 ranks (") and r["mesh"]["sent"] > 0
        # What `Muon.strategy` tells besides the words.
        assert r["kinds"] == {"after": ("replicated", 2, False), "mesh": ("sharded", 2, False)}
        torch.testing.assert_close(r["mesh"]["params"], explicit["alone"], atol=1e-5, rtol=0)
        # Arguments that do not fit the parameters are refused at construction, naming the parameter.
        assert re.search(r"parameter 0 of shape \(8, 4\): device_mesh is for DTensor parameters",
                         r["plain_on_a_mesh"])
        assert re.search(r"parameter 0 of shape \(8, 4\): it is a DTensor.*pass device_mesh, not process_group",
                         r["dtensor_with_a_group"])
        assert re.search(r"parameter 0 of shape \(8, 4\): it lives on DeviceMesh.*not on device_mesh DeviceMesh",
                         r["dtensor_on_another_mesh"])
    for got0, got1 in zip(ranks[0]["explicit"]["params"], ranks[1]["explicit"]["params"]):
        assert torch.equal(got0, got1)
    # A group of rank 0 alone: one rank, nothing to split there; rank 1 is not in it and is told so.
    assert ranks[0]["only_zero"] == alone
    assert "process_group=-100 is torch.distributed's mark of a group this rank is not in" in ranks[1]["only_zero"]


def test_orthogonalising_a_shard_is_not_orthogonalising_the_matrix():
    """Why FSDP2 gathers whole matrices: Newton-Schulz of each row shard differs from the full one."""
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    full = zeropower_via_newtonschulz(g, dtype=torch.float32)
    per_shard = torch.cat([zeropower_via_newtonschulz(s, dtype=torch.float32) for s in g.chunk(2)])
    relative = (per_shard - full).norm() / full.norm()
    assert relative > 0.1, relative


#: Uneven row shards on purpose: 5 rows split 3 + 2, 1 row split 1 + 0; a conv kernel; two 7x7 (one batch).
SHARDED_SHAPES = [(5, 3), (7, 7), (1, 4), (3, 2, 2, 2), (7, 7), (16, 8)]
#: A second param group, orthogonalised in bf16 without Nesterov: two dtypes travel in one exchange.
BF16_SHAPES = [(3, 3), (2, 9), (3, 3)]
SHARDED_CASES = {  # name -> (shard dim, or "mixed": 0 and 1 in turn; split_ns, fp32 group shapes, bf16 group shapes)
    "owners": (0, True, SHARDED_SHAPES, BF16_SHAPES),
    "every-rank": (0, False, SHARDED_SHAPES, BF16_SHAPES),
    # Tensor parallelism's rowwise weights: column shards (uneven, an empty one, a conv kernel's whole in-channels).
    "columns": (1, True, [*SHARDED_SHAPES, (4, 1)], BF16_SHAPES),
    # Colwise and rowwise weights on one mesh: the two 7x7 are cut both ways, one Newton-Schulz batch on one owner.
    "mixed": ("mixed", True, SHARDED_SHAPES, BF16_SHAPES),
    "dim2-fallback": (2, True, [(3, 2, 4, 2), (2, 3, 4)], []),
    "rank-1-owns-nothing": (0, True, [(1, 4)], []),  # rank 1 holds 0 rows of the only matrix
    "hsdp-2x2": (0, True, SHARDED_SHAPES, BF16_SHAPES),  # 2 replicas x 2 shards, (Replicate(), Shard(0))
}
#: NorMuon's modes add a group of stacks (an MoE's experts, stored out x in and in x out), split on the case's dim.
NORMUON_STACKS = {"shapes": [(3, 4, 5), (2, 5, 3)], "matrix_layouts": ["stack", "stack_in_out"]}
#: The device mesh of each case (2 ranks, 1-D, unless named here).
MESHES = {"hsdp-2x2": (2, 2)}
#: The "owners" case also runs its exchanges in rounds of this limit ("rounds"): the 16x8 fp32 matrix
#: (2 x 256 bytes) fills an owner's round alone.
ROUND_BYTES = 512


def _sharded_worker(rank: int, init_file: str, case: str, out: str) -> None:
    """Steps Muon on DTensor parameters (the case's mesh) and on the same whole tensors (no sharding); saves both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    shard_dim, split_ns, fp32_shapes, bf16_shapes = SHARDED_CASES[case]
    shape = MESHES.get(case, (2,))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=math.prod(shape))
    mesh = init_device_mesh("cpu", shape)
    shapes = fp32_shapes + bf16_shapes
    dims = [k % 2 for k in range(len(shapes))] if shard_dim == "mixed" else [shard_dim] * len(shapes)
    placements = [[Shard(d)] if len(shape) == 1 else [Replicate(), Shard(d)] for d in dims]
    torch.manual_seed(0)
    initial = [torch.randn(shape) for shape in shapes]
    grads = [[torch.randn(shape) for shape in shapes] for _ in range(3)]

    def shard(x: torch.Tensor, k: int) -> torch.Tensor:
        """``x`` (parameter ``k``, or its gradient) on the mesh, with the placements of parameter ``k``."""
        return distribute_tensor(x, mesh, placements[k])

    # NorMuon's modes: every group NorMuon's, and the stacks' group (the case's shard dim, Shard(0) for "mixed").
    stack_dim = 0 if shard_dim == "mixed" else shard_dim
    stacks = [torch.randn(shape) for shape in NORMUON_STACKS["shapes"]]
    stack_grads = [[torch.randn(shape) for shape in NORMUON_STACKS["shapes"]] for _ in range(3)]
    stack_placements = [Shard(stack_dim)] if len(shape) == 1 else [Replicate(), Shard(stack_dim)]

    results = {}
    modes = [("sharded", shard, split_ns), ("whole", lambda x, k: x, False)]
    modes += [(f"{name}-normuon", place, split) for name, place, split in modes]
    for name, place, split in modes + ([("rounds", shard, True)] if case == "owners" else []):
        normuon = name.endswith("-normuon")
        params = [nn.Parameter(place(x.clone(), k)) for k, x in enumerate(initial)]
        groups = [{"params": params[: len(fp32_shapes)], "ns_dtype": "float32"}]
        if bf16_shapes:
            groups.append({"params": params[len(fp32_shapes) :], "ns_dtype": "bfloat16", "nesterov": False})
        round_bytes = ROUND_BYTES if name == "rounds" else _strategies.EXCHANGE_ROUND_BYTES
        optimizer = Muon(groups, lr=0.1, weight_decay=0.01, split_ns=split, exchange_round_bytes=round_bytes,
                         normuon_beta2=0.95 if normuon else None)
        optimizers = [optimizer]
        if normuon:  # the stacks in an optimizer of their own: sharded on their stack dim, they are gathered whole
            on_mesh = name.startswith("sharded")
            params += [nn.Parameter(distribute_tensor(x.clone(), mesh, stack_placements) if on_mesh else x.clone())
                       for x in stacks]
            stacked = {"params": params[len(shapes) :], "matrix_layouts": NORMUON_STACKS["matrix_layouts"]}
            optimizers.append(Muon([stacked], lr=0.1, weight_decay=0.01, ns_dtype="float32", normuon_beta2=0.95))
        exchanges = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step, step_grads in enumerate(grads):
                for i, (p, g) in enumerate(zip(params, step_grads)):
                    unused = step == 1 and i == 0  # no gradient on any rank for one step
                    p.grad = None if unused else place(g, i)
                for p, g in zip(params[len(shapes) :], stack_grads[step]):
                    p.grad = distribute_tensor(g, mesh, stack_placements) if is_dtensor(p) else g
                optimizer.record_diagnostics()
                for each in optimizers:
                    each.step()
                chosen = optimizer._choice.chosen  # private: exchange rounds and buffers are no public API
                if isinstance(chosen, _strategies.ShardedStep):
                    exchanges.append((chosen.rounds, chosen.largest_buffer, chosen.buffers.kept_bytes))
        results[name] = {
            "path": (optimizer.strategy.description, optimizer.strategy.fallback),
            "warned": [str(w.message) for w in caught if str(w.message).startswith("Muon:")],
            "exchanges": exchanges,
            "params": [(p.full_tensor() if is_dtensor(p) else p).detach() for p in params],
            "moments": [o.state[p].get(SECOND_MOMENT) for o in optimizers for g in o.param_groups for p in g["params"]],
            "diagnostics": sorted(
                (d.name, d.orthogonality_error.item(), d.update_rms.item()) for d in optimizer.diagnostics
            ),
            "sent": optimizer.last_exchange_bytes,
        }
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    # Leave without interpreter teardown: under pytest, torch 2.13's exit-time destructors now and then
    # abort a spawned rank after its work is done ("terminate called without an active exception").
    os._exit(0)


#: What each case's run says it does (`choose_strategy`'s line): a pattern and whether it is a fallback.
SHARDED_PATHS = {
    "owners": (r"FSDP2 owner ranks: 2 ranks \(", False),
    "every-rank": (r"every rank gathers and orthogonalises every whole matrix \(split_ns=False\)", False),
    "columns": (r"tensor-parallel owner ranks: 2 ranks \(.* its rows or columns come back", False),
    "mixed": (r"tensor-parallel owner ranks: 2 ranks \(", False),
    "dim2-fallback": (r"every rank gathers .* \(not split: placements \(Shard\(dim=2\)\) on a 1-D mesh", True),
    "rank-1-owns-nothing": (r"FSDP2 owner ranks: 2 ranks \(", False),
    "hsdp-2x2": (r"FSDP2 owner ranks: the 2 ranks of the mesh's shard dim, repeated by each of its 2 replicas", False),
}


@pytest.mark.distributed
@pytest.mark.parametrize(  # 4 processes on the 2 cores of CI: slow
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in MESHES else c for c in SHARDED_CASES]
)
def test_sharded_parameters_are_orthogonalised_whole(tmp_path, case):
    """DTensor parameters (FSDP2's row shards, tensor parallelism's column shards and both mixed, uneven and
    empty ones included) give the unsharded result: through owner ranks and two all-to-alls (FSDP2's and
    tensor parallelism's layouts on a 1-D mesh, and HSDP's within each replica), or gathered whole on every
    rank (split off, other layouts); two param groups with different Newton-Schulz dtypes share the exchange."""
    shard_dim, split_ns, fp32_shapes, bf16_shapes = SHARDED_CASES[case]
    shape = MESHES.get(case, (2,))
    world, replicas = math.prod(shape), shape[0] if len(shape) == 2 else 1
    mp.start_processes(
        _sharded_worker, args=(str(tmp_path / "init"), case, str(tmp_path)), nprocs=world, join=True,
        start_method=RANKS_START_METHOD,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    owners = shard_dim in (0, 1, "mixed") and split_ns
    pattern, fallback = SHARDED_PATHS[case]
    assert re.search(pattern, ranks[0]["sharded"]["path"][0]) and ranks[0]["sharded"]["path"][1] == fallback
    # A fallback is a warning, once, on rank zero only (the other paths are an info line).
    assert ranks[0]["sharded"]["warned"] == ([f"Muon: {ranks[0]['sharded']['path'][0]}."] if fallback else [])
    assert all(r["sharded"]["warned"] == [] for r in ranks[1:])
    for r, suffix in itertools.product(ranks, ["", "-normuon"]):
        # NorMuon: each owner's rows' statistics from its whole matrices, every rank normalising its own rows.
        sharded, whole = r[f"sharded{suffix}"], r[f"whole{suffix}"]
        assert sharded["path"] == r["sharded"]["path"]
        moments = [(a, b) for a, b in zip(sharded["moments"], whole["moments"]) if b is not None]
        for got, expected in [*zip(sharded["params"], whole["params"]), *moments]:
            if owners:  # the owners batch exactly as one process does: the same bits
                assert torch.equal(got, expected)
            else:  # one matrix at a time instead of batched same shapes: float rounding
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        got, expected = sharded["diagnostics"], whole["diagnostics"]
        assert [d[0] for d in got] == [d[0] for d in expected]  # every matrix, on every rank
        torch.testing.assert_close([d[1:] for d in got], [d[1:] for d in expected], atol=1e-5, rtol=0)
    for other, suffix in itertools.product(ranks[1:], ["", "-normuon"]):
        for got0, got in zip(ranks[0][f"sharded{suffix}"]["params"], other[f"sharded{suffix}"]["params"]):
            assert torch.equal(got0, got)
    assert all(v is not None for r in ranks for v in r["sharded-normuon"]["moments"])  # every parameter has one
    sent = [r["sharded"]["sent"] for r in ranks]
    if owners:
        # Every shard once to its owner, every result once back: two copies of the matrices in all (in each
        # replica), each group in its own Newton-Schulz dtype.
        numel = [sum(torch.Size(s).numel() for s in shapes) for shapes in (fp32_shapes, bf16_shapes)]
        assert sum(sent) == replicas * 2 * (4 * numel[0] + 2 * numel[1])
    else:
        assert sent == [0] * world
    if case == "rank-1-owns-nothing":
        assert sent[1] == 0
    if owners:  # everything in one round at the default limit (none on a step without gradients)
        assert all(max(rounds for rounds, *_ in r["sharded"]["exchanges"]) == 1 for r in ranks)
    if case == "owners":
        for r in ranks:
            # In rounds: a batch may be cut between rounds (rounding only), the same bytes travel.
            for got, expected in zip(r["rounds"]["params"], r["whole"]["params"]):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
            got, expected = r["rounds"]["diagnostics"], r["sharded"]["diagnostics"]
            assert [d[0] for d in got] == [d[0] for d in expected]
            torch.testing.assert_close([d[1:] for d in got], [d[1:] for d in expected], atol=1e-5, rtol=0)
            # Several rounds, no buffer over the limit, three kept buffers in all; the last step repeats the
            # first one's exchanges (the second lacks a gradient) and allocates nothing.
            exchanges = r["rounds"]["exchanges"]
            assert all(rounds > 1 and largest <= ROUND_BYTES for rounds, largest, _ in exchanges), exchanges
            kept = [kept for *_, kept in exchanges]
            assert kept[2] == kept[1] and max(kept) <= 3 * ROUND_BYTES, exchanges
        assert sum(r["rounds"]["sent"] for r in ranks) == sum(sent)


def run_fsdp2(out: Path, *args: str) -> list[dict]:
    """Run tests/fsdp2_run.py on 2 ranks."""
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(fsdp2_run.main, [str(out), *args], 2)
    return [{**torch.load(out / f"rank{r}.pt"), "syncs": torch.load(out / f"syncs{r}.pt")} for r in range(2)]


@pytest.fixture(scope="module")
def fsdp2_and_one_process(tmp_path_factory) -> tuple[list[dict], dict]:
    """Two FSDP2 ranks and one process, 4 updates of the same batches each: shared by the equality test and the
    accumulation test (its reduce-scatter count without accumulation), one launch for both."""
    out = tmp_path_factory.mktemp("fsdp2")
    (single,) = train(out / "one", devices=1, steps=4)
    return run_fsdp2(out / "fsdp2", "--max-steps", "4", "--first-layer-on-muon"), single


@pytest.mark.distributed
def test_fsdp2_two_ranks_equal_one_process(fsdp2_and_one_process):
    """ModelParallelStrategy + fully_shard: every matrix is orthogonalised whole, so sharded training
    matches one process (a per-shard Newton-Schulz would be off by >10%, see the test above)."""
    (rank0, rank1), single = fsdp2_and_one_process
    assert rank0["world"] == 2
    for name, p in single["params"].items():
        assert torch.equal(rank0["params"][name], rank1["params"][name]), name
        torch.testing.assert_close(rank0["params"][name], p, atol=TOLERANCE, rtol=0, msg=name)
    # The owner path ran: fp32 shards of 16x8, 2 x 16x16, 24x16 went to their owners and the results came
    # back, two copies in all (`sometimes` is never used here, so it has no gradient and stays out).
    assert rank0["exchange_bytes"] + rank1["exchange_bytes"] == 2 * 4 * (16 * 8 + 2 * 16 * 16 + 24 * 16)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_split_heads_on_the_shipped_gpt_equals_one_process(tmp_path):
    """The shipped GPT (`fsdp2_run.HeadsGPT`: ``gpt_muon_fsdp2.yaml``'s model and sharding) with ``split_heads``:
    each fused ``qkv`` (72 rows, 36 a rank: a key head across the shard boundary) stepped as 9 heads of 8 rows under
    FSDP2, as one process does, and the routing table the 2-rank fit printed names the split."""
    fsdp2_run.main([str(tmp_path / "one"), "--heads", "--devices", "1", "--max-steps", "4", "--batch-size", "8"])
    single = torch.load(tmp_path / "one" / "rank0.pt")
    rank0, rank1 = run_fsdp2(tmp_path / "fsdp2", "--heads", "--max-steps", "4")
    assert rank0["world"] == 2 and rank0["exchange_bytes"] + rank1["exchange_bytes"] > 0  # the owner path ran
    for name, p in single["params"].items():
        assert torch.equal(rank0["params"][name], rank1["params"][name]), name
        torch.testing.assert_close(rank0["params"][name], p, atol=TOLERANCE, rtol=0, msg=name)
    table = (tmp_path / "fsdp2" / "said.txt").read_text()
    split = [line for line in table.splitlines() if "attn.qkv.weight" in line]
    assert len(split) == 2 and all("split by projection, then per head: 3" in line for line in split), table
    heads = {f"blocks.{i}.attn.qkv.weight": [8] * 9 for i in range(2)}
    assert [torch.load(tmp_path / "fsdp2" / f"blocks{r}.pt") for r in range(2)] == [heads, heads]


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_accumulation_reduces_gradients_only_on_the_last_micro_batch(tmp_path, fsdp2_and_one_process):
    plain, single = fsdp2_and_one_process  # batch 4 a rank, no accumulation
    accumulated = run_fsdp2(tmp_path / "accumulated", "--max-steps", "4", "--batch-size", "2", "--accumulate", "2",
                            "--first-layer-on-muon")
    # Twice the backward passes, the same number of reduce-scatters: none on the first micro-batch.
    assert [r["syncs"] for r in accumulated] == [r["syncs"] for r in plain]
    assert plain[0]["syncs"] > 0
    for name, p in single["params"].items():
        assert torch.equal(accumulated[0]["params"][name], accumulated[1]["params"][name]), name
        torch.testing.assert_close(accumulated[0]["params"][name], p, atol=TOLERANCE, rtol=0, msg=name)


class CountGradientSyncs(L.Callback):
    """Counts DDP's gradient all-reduces (a comm hook) and saves the count with the rank's parameters."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.calls = 0

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):
            self.calls += 1
            return default_hooks.allreduce_hook(state, bucket)

        trainer.strategy.model.register_comm_hook(None, hook)

    def on_train_end(self, trainer, pl_module):
        torch.save(self.calls, self.directory / f"syncs{trainer.global_rank}.pt")


@pytest.mark.distributed
def test_accumulation_syncs_gradients_only_on_the_last_micro_batch(tmp_path):
    (single,) = train(tmp_path / "one", devices=1, steps=4)
    L.seed_everything(0)
    model = MuonNet(batch_size=2, muon=muon_factory(), accumulate_grad_batches=2,
                    muon_params=["sometimes.weight", "net.0.weight"], adamw_params=["net.8.*"])
    out = tmp_path / "two"
    out.mkdir()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=ForkedDDP(find_unused_parameters=True),
        callbacks=[SaveEveryRank(out), CountGradientSyncs(out), EndProcessGroup()],
    )
    trainer.fit(model)
    # 4 updates of 2 micro-batches: one all-reduce per update (the model fits in one DDP bucket).
    assert [torch.load(out / f"syncs{r}.pt") for r in range(2)] == [4, 4]
    rank0, rank1 = (torch.load(out / f"rank{r}.pt") for r in range(2))
    for name, p in single["params"].items():
        assert torch.equal(rank0["params"][name], rank1["params"][name]), name
        torch.testing.assert_close(rank0["params"][name], p, atol=TOLERANCE, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_resume_from_an_epoch_boundary_equals_the_uninterrupted_run(tmp_path):
    """The uninterrupted run keeps Lightning's epoch-end checkpoints; a run resumed from the first one ends on
    the same weights, bit for bit, on both ranks."""

    def fit(out: Path, ckpt_path: Path | None = None, save: Path | None = None) -> None:
        L.seed_everything(0)
        model = MuonNet(batch_size=4, muon=muon_factory(), muon_params=["sometimes.weight"], adamw_params=["net.8.*"])
        out.mkdir(parents=True)
        callbacks = [SaveEveryRank(out), EndProcessGroup()] + ([epoch_checkpoints(save)] if save else [])
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_checkpointing=save is not None,
            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
            strategy=ForkedDDP(find_unused_parameters=True),
        )
        trainer.fit(model, ckpt_path=ckpt_path)

    fit(tmp_path / "straight", save=tmp_path / "checkpoints")
    fit(tmp_path / "resumed", ckpt_path=tmp_path / "checkpoints" / "epoch0.ckpt")
    straight = torch.load(tmp_path / "straight" / "rank0.pt")["params"]
    for r in range(2):
        resumed = torch.load(tmp_path / "resumed" / f"rank{r}.pt")["params"]
        for name, p in straight.items():
            assert torch.equal(resumed[name], p), f"rank {r}: {name}"


class NoneOnSecondBatch(MuonNet):
    def training_step(self, batch, batch_idx):
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


@pytest.mark.distributed
def test_none_loss_under_ddp_is_refused_rather_than_hanging(tmp_path):
    model = NoneOnSecondBatch(batch_size=4, muon=muon_factory())
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=ForkedDDP(find_unused_parameters=True),
    )
    # The spawn launcher re-raises the rank's MisconfigurationException, its traceback in the message.
    with pytest.raises(ProcessRaisedException, match=r"Return `loss \* 0` to skip a batch") as raised:
        trainer.fit(model)
    assert "MisconfigurationException: training_step returned None" in str(raised.value)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("rule", ["muon", "normuon", "normuon-blocks", "heads"])
def test_fsdp2_resume_through_a_distributed_checkpoint_is_exact(tmp_path, rule):
    """Also with NorMuon: its second moments (whole on every rank) are saved, resumed and converted too; and with two
    matrices split into row blocks (stepped on whole copies on every rank), which resume and convert alike; and the
    shipped GPT with ``split_heads`` (`fsdp2_run.HeadsGPT`), its per-head blocks in the converted param groups."""
    checkpoint = tmp_path / "checkpoints" / "epoch0.ckpt"  # kept by the uninterrupted run, at its first epoch's end
    settings = {"normuon_beta2": 0.95} if rule.startswith("normuon") else {}
    blocks = fsdp2_run.BLOCKS if rule.endswith("-blocks") else None
    heads = {f"blocks.{i}.attn.qkv.weight": [8] * 9 for i in range(2)} if rule == "heads" else None
    flags = (["--normuon"] if settings else []) + (["--blocks"] if blocks else []) + (["--heads"] if heads else [])
    run_fsdp2(tmp_path / "straight", "--max-epochs", "2", "--save", str(tmp_path / "checkpoints"), *flags)
    run_fsdp2(tmp_path / "resumed", "--max-epochs", "2", "--ckpt", str(checkpoint), *flags)
    assert checkpoint.is_dir()  # sharded: torch.distributed.checkpoint, not one file
    straight = torch.load(tmp_path / "straight" / "rank0.pt")
    for r in range(2):
        resumed = torch.load(tmp_path / "resumed" / f"rank{r}.pt")
        for name, p in straight["params"].items():
            assert torch.equal(resumed["params"][name], p), f"rank {r}: {name}"
        for got, expected in zip(resumed["second_moments"], straight["second_moments"], strict=True):
            assert (got is None) == (not settings) and (got is None or torch.equal(got, expected))
    # On one process the directory is refused, naming the conversion (not a raw IsADirectoryError) ...
    def one_process() -> MuonMixin:  # 1 process x batch 8 sees the gradients of 2 ranks x batch 4
        if heads:
            return fsdp2_run.HeadsGPT(batch_size=8, muon=muon_factory(**settings))
        return MuonNet(batch_size=8, muon=muon_factory(**settings), muon_params=["sometimes.weight"],
                       adamw_params=["net.8.*"], matrix_blocks=blocks)

    with pytest.raises(RuntimeError, match=r"is a distributed checkpoint .* reads a single file. Convert it"):
        make_trainer(tmp_path / "one", max_epochs=2).fit(one_process(), ckpt_path=checkpoint)
    # ... and the converted file resumes the run on one process: it ends where the 2-rank run ended.
    main(["convert-checkpoint", str(checkpoint), str(tmp_path / "one.ckpt")])
    converted = torch.load(tmp_path / "one.ckpt", weights_only=False)["optimizer_states"][0]
    assert all((SECOND_MOMENT in state) == bool(settings) for state in converted["state"].values())
    given = [sizes for group in converted["param_groups"] for sizes in group.get("matrix_blocks") or [] if sizes]
    assert sorted(given) == sorted((blocks or heads or {}).values())
    model = one_process()
    trainer = make_trainer(tmp_path / "one", max_epochs=2)
    trainer.fit(model, ckpt_path=tmp_path / "one.ckpt")
    assert trainer.global_step == 2 * torch.load(checkpoint / "meta.pt", weights_only=False)["global_step"]
    for name, p in straight["params"].items():
        torch.testing.assert_close(model.get_parameter(name).detach(), p, atol=TOLERANCE, rtol=0, msg=name)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_one_process_checkpoint_under_fsdp2_is_refused_saying_why(tmp_path):
    """Lightning's conversion maps each optimizer's states onto the model's parameters in order: wrong for two."""
    L.seed_everything(0)
    one = MuonNet(batch_size=4, muon=muon_factory(), muon_params=["sometimes.weight"], adamw_params=["net.8.*"])
    trainer = make_trainer(tmp_path / "one", max_epochs=1)
    trainer.fit(one)
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    refusal = "holds one process's \\(or DDP's\\) optimizer states, by position; ModelParallelStrategy"
    with pytest.raises(ProcessRaisedException, match=refusal):
        run_fsdp2(tmp_path / "fsdp2", "--max-epochs", "2", "--ckpt", str(tmp_path / "one.ckpt"))


class HangingRank(MuonNet):
    """Rank 1 stops answering (a hung rank, not a dead one) on its second batch."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 1:
            time.sleep(20)
        return super().training_step(batch, batch_idx)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_short_process_group_timeout_ends_a_hung_rank_fit(tmp_path):
    """The README's advice: the strategy's ``timeout`` bounds how long the other ranks wait (default 30 min)."""
    strategy = ForkedDDP(find_unused_parameters=True, timeout=datetime.timedelta(seconds=5))
    # gloo words the same timeout two ways, depending on where the waiting rank stands when it fires. No
    # wall-clock bound: that was a timing assertion, and it failed on a loaded machine where start-up is slow.
    timed_out = r"Timed out waiting 5000ms|Application timeout caused pair closure"
    with pytest.raises(ProcessRaisedException, match=timed_out):
        make_trainer(tmp_path, devices=2, max_steps=4, strategy=strategy).fit(HangingRank(muon=muon_factory()))
