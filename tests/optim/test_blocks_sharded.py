"""Blocks on sharded (DTensor) parameters: a fused projection split into equal and unequal blocks
(``matrix_blocks``), a grouped convolution split into its groups and an LSTM into its gates (route_parameters'
defaults), with NorMuon and cautious weight decay, step under FSDP2 (the owner path, its gather path when a step
diagnoses, and ``split_ns=False``), HSDP, tensor parallelism (colwise rows, rowwise columns) and FSDP2 over it on
2 and 4 gloo ranks bit for bit as on one process: rows sharded unevenly, blocks that straddle the shard boundary,
momentum sharded as the parameter, NorMuon's moments per block; weights stored ``in x out`` gathered whole;
``split_heads``' per-head blocks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from lightning_muon import Muon, route_parameters
from lightning_muon.optim.groups import SECOND_MOMENT

from helpers import run_ranks

STEPS = 3
#: The blocks given by hand. On 2 ranks: ``qkv`` (12 rows) shards 6/6, its middle block (rows 4-7) straddles;
#: ``up`` (9 rows) shards 5/4 (uneven), its block of 2 (rows 4-5) straddles.
BLOCKS = {"qkv.weight": [4, 4, 4], "qkv2.weight": [4, 4, 4], "up.weight": [4, 2, 3]}


class Net(nn.Module):
    """``qkv`` and ``qkv2`` (equal blocks; one process batches the two stacks in one call), ``up`` (unequal), a
    grouped conv (3 groups of 2 output rows: the middle one straddles the 3/3 shards) and an LSTM (4 gates of 5 rows
    each, split by default), then a head."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.qkv = nn.Linear(8, 12, bias=False)
            self.qkv2 = nn.Linear(8, 12, bias=False)
            self.up = nn.Linear(12, 9, bias=False)
            self.conv = nn.Conv1d(9, 6, 3, groups=3, padding=1, bias=False)
            self.lstm = nn.LSTM(6, 5, batch_first=True, bias=False)
            self.head = nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(torch.tanh(self.qkv(x)) * torch.tanh(self.qkv2(x))))
        h = torch.tanh(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(self.lstm(h)[0])


def _muon(model: nn.Module, names: list[str], split_ns: bool = True, **settings) -> Muon:
    """Muon on the named matrices, with route_parameters' blocks (the gates and groups by default, ``BLOCKS`` by
    hand), NorMuon and cautious weight decay."""
    others = [n for n, _ in model.named_parameters() if n not in names]
    routing = route_parameters(model, muon_params=names, adamw_params=others,
                               matrix_blocks={k: v for k, v in BLOCKS.items() if k in names})
    groups = routing.groups("Muon")
    return Muon(groups, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, normuon_beta2=0.9, split_ns=split_ns,
                cautious_weight_decay=True, **settings)


def _fit(model: nn.Module, muon: Muon) -> tuple[list[tuple], int]:
    """``STEPS`` steps on the same batch on every rank (so FSDP2's averaged gradients are one process's): the last
    one's diagnostics (name, shape, effective lr, orthogonality error, update RMS; a step that diagnoses gathers
    split parameters whole on every rank), and the bytes the first step exchanged (an owner's exchange)."""
    generator, sent = torch.Generator().manual_seed(1), 0
    for step in range(STEPS):
        x = torch.randn(2, 4, 8, generator=generator)
        y = torch.randn(2, 4, 3, generator=generator)
        nn.functional.mse_loss(model(x), y).backward()
        if step == STEPS - 1:
            muon.record_diagnostics()
        muon.step()
        muon.zero_grad()
        sent = muon.last_exchange_bytes if step == 0 else sent
    return [(d.name, d.shape, d.effective_lr, float(d.orthogonality_error), float(d.update_rms))
            for d in muon.diagnostics], sent


def _step_given(params: dict[str, nn.Parameter], muon: Muon) -> None:
    """``STEPS`` steps on seeded whole gradients, each DTensor parameter given its shard of them (tensor
    parallelism's backward sums partial products in another order than one process: its gradients are not
    the subject here)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        for p in params.values():
            g = torch.randn(p.shape, generator=generator)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
        muon.step()


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


MUON = ["qkv.weight", "qkv2.weight", "up.weight", "conv.weight", "lstm.weight_ih_l0", "lstm.weight_hh_l0"]
TP = ["qkv.weight", "up.weight"]


def _ranks_main(argv: list[str]) -> None:
    """On each of 2 ranks: the net under FSDP2 (owner exchange and every rank), HSDP (a 1 x 2 mesh) and tensor
    parallelism (``qkv`` colwise, ``up`` rowwise, on given gradients); the whole parameters saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for name, shape, split in (("fsdp2", (2,), True), ("fsdp2-every-rank", (2,), False), ("hsdp", (1, 2), True)):
        model, mesh = Net(), init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        for module in (model.qkv, model.qkv2, model.up, model.conv, model.lstm, model.head):
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # HSDP in exchange rounds of at most 256 bytes a rank: about one split tensor a round
        muon = _muon(model, MUON, split_ns=split, **({"exchange_round_bytes": 256} if name == "hsdp" else {}))
        diagnostics, sent = _fit(model, muon)
        qkv = model.get_parameter("qkv.weight")
        results[name] = (_whole(model), muon.strategy.kind, muon.state[qkv]["momentum_buffer"].to_local().shape,
                         muon.state[qkv][SECOND_MOMENT], diagnostics, sent)
    for name, shape in (("tp", (2,)), ("2d", (1, 2))):  # 2-D: FSDP2 over tensor parallelism, on a 1 x 2 mesh
        model, mesh = Net(), init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[-len(shape):])
        parallelize_module(model, mesh["tp"], {"qkv": ColwiseParallel(), "up": RowwiseParallel()})
        if len(shape) == 2:
            for module in (model.qkv, model.up):
                fully_shard(module, mesh=mesh["dp"])
        muon = _muon(model, TP)
        _step_given({n: model.get_parameter(n) for n in TP}, muon)
        up = model.get_parameter("up.weight")
        results[name] = (_whole(model), muon.strategy.kind, muon.state[up]["momentum_buffer"].to_local().shape,
                          [p.placements for p in muon.param_groups[0]["params"]], muon.last_exchange_bytes)
    results["in_out"] = _in_out(init_device_mesh("cpu", (2,)))
    model, mesh = Attention(), init_device_mesh("cpu", (2,))
    fully_shard(model.attn, mesh=mesh)
    fully_shard(model, mesh=mesh)
    results["heads"] = _heads(model)
    torch.save(results, Path(argv[0]) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _in_out(mesh=None) -> tuple[list[torch.Tensor], int]:
    """Two weights stored ``in x out`` (GPT-2's ``c_attn``: blocks along dim 1), one sharded on its rows, one on its
    columns (the blocks' dim: the middle block straddles), stepped on given gradients (on ``mesh``, or one process):
    their whole values and the bytes the last step exchanged (none: this layout is gathered whole)."""
    from torch.distributed.tensor import distribute_tensor

    generator = torch.Generator().manual_seed(3)
    starts = [torch.randn(8, 12, generator=generator) for _ in range(2)]
    if mesh is None:
        params = {f"w{k}": nn.Parameter(w) for k, w in enumerate(starts)}
    else:
        params = {f"w{k}": nn.Parameter(distribute_tensor(w, mesh, [Shard(k)])) for k, w in enumerate(starts)}
    muon = Muon([{"params": list(params.values()), "matrix_layouts": ["in_out"] * 2,
                  "matrix_blocks": [[4, 4, 4]] * 2}], lr=0.02, weight_decay=0.1, ns_dtype=torch.float32,
                normuon_beta2=0.9)
    _step_given(params, muon)
    return [(p.full_tensor() if mesh is not None else p).detach() for p in params.values()], muon.last_exchange_bytes


class Attention(nn.Module):
    """``nn.MultiheadAttention`` of 3 heads of 2: ``in_proj_weight`` (18 rows, 9 a rank on 2) split per head by
    ``split_heads``, the head of rows 8-9 across the shard boundary."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.attn = nn.MultiheadAttention(6, 3, bias=False, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def _heads(model: Attention) -> tuple[dict[str, torch.Tensor], list]:
    """``STEPS`` steps of Muon with ``split_heads`` on the same batch: the whole parameters, and the blocks."""
    routing = route_parameters(model, muon_params=["attn.in_proj_weight", "attn.out_proj.weight"], split_heads=True)
    muon = Muon(routing.groups("Muon"), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, normuon_beta2=0.9)
    generator = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        x = torch.randn(2, 5, 6, generator=generator)
        model(x).square().mean().backward()
        muon.step()
        muon.zero_grad()
    return _whole(model), [b for g in muon.param_groups for b in g.get("matrix_blocks") or []]


@pytest.mark.slow
@pytest.mark.distributed
def test_blocks_on_sharded_parameters_step_exactly_as_one_process(tmp_path):
    run_ranks(_ranks_main, [str(tmp_path)], 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    alone = Net()
    muon = _muon(alone, MUON)
    diagnostics, _ = _fit(alone, muon)
    # the defaults split the gates and the groups; the blocks given by hand are kept
    blocks = dict(zip(muon.param_groups[0]["param_names"], muon.param_groups[0]["matrix_blocks"], strict=True))
    assert blocks == {**BLOCKS, "conv.weight": [2, 2, 2], "lstm.weight_ih_l0": [5] * 4,
                      "lstm.weight_hh_l0": [5] * 4}
    one = _whole(alone)
    tp_alone = Net()
    _step_given({n: tp_alone.get_parameter(n) for n in TP}, _muon(tp_alone, TP))
    expected = {"fsdp2": ("sharded", one), "fsdp2-every-rank": ("local", one), "hsdp": ("sharded", one),
                "tp": ("sharded", _whole(tp_alone)), "2d": ("sharded", _whole(tp_alone))}
    for name, (kind, whole) in expected.items():
        for r, got in enumerate(ranks):
            params, strategy = got[name][0], got[name][1]
            assert strategy == kind, name
            for key, p in whole.items():  # bit for bit, on both ranks
                assert torch.equal(params[key], p), f"{name}, rank {r}: {key}"
        assert any(not torch.equal(p, q) for p, q in zip(whole.values(), Net().state_dict().values())), name
    # momentum sharded as the parameter: qkv's rows (6 a rank), up's columns (tensor parallelism's rowwise weight)
    assert [r["fsdp2"][2] for r in ranks] == [torch.Size([6, 8])] * 2
    assert [r["tp"][2] for r in ranks] == [torch.Size([9, 6])] * 2
    # NorMuon's moments, per block on the whole rows, as one process's
    assert torch.equal(ranks[0]["fsdp2"][3], muon.state[alone.qkv.weight][SECOND_MOMENT])
    # diagnostics block by block (equal blocks: one stack), as one process's
    assert [d[:2] for d in diagnostics] == [("qkv.weight", (12, 8)), ("qkv2.weight", (12, 8)),
                                            ("up.weight[0]", (4, 12)), ("up.weight[1]", (2, 12)),
                                            ("up.weight[2]", (3, 12)),
                                            ("conv.weight", (6, 3, 3)), ("lstm.weight_ih_l0", (20, 6)),
                                            ("lstm.weight_hh_l0", (20, 5))]
    for name in ("fsdp2", "fsdp2-every-rank", "hsdp"):
        assert sorted(ranks[0][name][4]) == sorted(diagnostics), name
    # every Muon matrix is split: the owner exchange moved them (each rank its shards, and each owner its results)
    assert [r["fsdp2"][5] > 0 and r["hsdp"][5] > 0 and r["fsdp2-every-rank"][5] == 0 for r in ranks] == [True] * 2
    assert ranks[0]["tp"][3] == [(Shard(0),), (Shard(1),)]
    assert len(ranks[0]["2d"][3][0]) == 2  # on both mesh dims
    assert all(r[name][4] > 0 for r in ranks for name in ("tp", "2d"))  # owners' exchange
    # split_heads (per-head blocks) under FSDP2, as one process
    heads, blocks = _heads(Attention())
    assert [2] * 9 in blocks
    for r in ranks:
        assert r["heads"][1] == blocks
        assert all(torch.equal(r["heads"][0][key], p) for key, p in heads.items())
    # weights stored in x out: gathered whole on every rank, as one process
    alone_in_out, _ = _in_out()
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["in_out"][0], alone_in_out, strict=True))
        assert r["in_out"][1] == 0


def _four_ranks_main(argv: list[str]) -> None:
    """On each of 4 ranks, on given gradients: HSDP on a 2 x 2 mesh (two replicas of 2 shards) and FSDP2 over tensor
    parallelism on a 2 x 2 mesh (each rank a block of ``qkv`` and ``up``); the whole parameters saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=4)
    results = {}
    model, mesh = Net(), init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for module in (model.qkv, model.qkv2, model.up, model.conv, model.lstm, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    muon = _muon(model, MUON)
    _step_given({n: model.get_parameter(n) for n in MUON}, muon)
    results["hsdp"] = (_whole(model), muon.strategy.kind, muon.last_exchange_bytes)
    model, mesh = Net(), init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"qkv": ColwiseParallel(), "up": RowwiseParallel()})
    for module in (model.qkv, model.up):
        fully_shard(module, mesh=mesh["dp"])
    muon = _muon(model, TP)
    _step_given({n: model.get_parameter(n) for n in TP}, muon)
    results["2d"] = (_whole(model), muon.strategy.kind, muon.last_exchange_bytes)
    torch.save(results, Path(argv[0]) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_blocks_on_four_ranks_in_2d_and_hsdp_step_exactly_as_one_process(tmp_path):
    """Two real mesh dims: HSDP's replicas each gather their own shards; FSDP2 over tensor parallelism cuts ``qkv``
    (12 rows) into 4 row shards of 3 (each of its blocks across a boundary) and ``up`` into row and column shards."""
    run_ranks(_four_ranks_main, [str(tmp_path)], 4)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for name, names in (("hsdp", MUON), ("2d", TP)):
        alone = Net()
        _step_given({n: alone.get_parameter(n) for n in names}, _muon(alone, names))
        for r, got in enumerate(ranks):
            assert got[name][1] == "sharded" and got[name][2] > 0, name  # on owners
            for key, p in _whole(alone).items():
                assert torch.equal(got[name][0][key], p), f"{name}, rank {r}: {key}"
