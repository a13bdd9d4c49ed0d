"""`MuonWithAdamW` on 2 gloo ranks steps exactly as the pair ``Muon`` + ``torch.optim.AdamW`` there: under
DDP (replicated parameters, averaged gradients: the inner Muon takes the DDP split) and under FSDP2 (DTensor
row shards: the inner Muon takes the owner ranks, torch's AdamW steps the shards)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from lightning_muon import Muon, MuonWithAdamW, route_parameters

from helpers import RANKS_START_METHOD

MUON_KW = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}
ADAMW_KW = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.05}
SINGLE_KW = {**MUON_KW, **{f"adamw_{k}": v for k, v in ADAMW_KW.items()}}
STEPS = 3


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Flatten(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 32),
                         nn.GELU(), nn.Linear(32, 24), nn.GELU(), nn.Linear(24, 16))


def pair_of(model: nn.Module) -> list[torch.optim.Optimizer]:
    routing = route_parameters(model)
    return [Muon(routing.muon_groups, **MUON_KW), torch.optim.AdamW(routing.adamw_groups, **ADAMW_KW)]


def ddp_run(rank: int) -> dict:
    """Each rank its half of a batch, gradients averaged over the ranks (what DDP does), both optimizers."""
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS):
        x = torch.randint(16, (32, 8), generator=g)
        data.append((x[rank::2], ((x[:, 0] + x[:, 1]) % 16)[rank::2]))
    results = {}
    for name in ("single", "pair"):
        model = make_net()
        optimizers = [MuonWithAdamW.from_model(model, **SINGLE_KW)] if name == "single" else pair_of(model)
        for x, y in data:
            F.cross_entropy(model(x), y).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= 2
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        muon = optimizers[0].muon if name == "single" else optimizers[0]
        results[name] = {"params": [p.detach().clone() for p in model.parameters()],
                         "path": muon.strategy.description}
    return results


def fsdp2_run(rank: int) -> dict:
    """Every parameter a DTensor of row shards on a 2-rank mesh, the same gradients on both optimizers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(2)
    shapes = [p.shape for p in make_net().parameters()]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(STEPS)]
    results = {}
    for name in ("single", "pair"):
        model = make_net()
        for module in model.modules():
            for key, p in list(module.named_parameters(recurse=False)):
                setattr(module, key, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        optimizers = [MuonWithAdamW.from_model(model, **SINGLE_KW)] if name == "single" else pair_of(model)
        for step_grads in grads:
            for p, grad in zip(model.parameters(), step_grads):
                p.grad = distribute_tensor(grad, mesh, [Shard(0)])
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        muon = optimizers[0].muon if name == "single" else optimizers[0]
        results[name] = {"params": [p.full_tensor().detach().clone() for p in model.parameters()],
                         "path": muon.strategy.description}
    return results


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results = {"ddp": ddp_run(rank), "fsdp2": fsdp2_run(rank)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    os._exit(0)  # no interpreter teardown: see tests/test_distributed.py (torch 2.13 + gloo abort at exit)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_step_as_the_pair_under_ddp_and_fsdp2(tmp_path):
    mp.start_processes(
        _worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method=RANKS_START_METHOD
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    paths = {"ddp": "DDP", "fsdp2": "FSDP2 owner ranks"}
    for case, path in paths.items():
        for rank in ranks:
            single, pair = rank[case]["single"], rank[case]["pair"]
            assert path in single["path"] and single["path"] == pair["path"], (single["path"], pair["path"])
            diff = max((a - b).abs().max().item() for a, b in zip(single["params"], pair["params"]))
            assert diff == 0.0, f"{case}: max abs diff {diff}"
        for a, b in zip(ranks[0][case]["single"]["params"], ranks[1][case]["single"]["params"]):
            assert torch.equal(a, b)  # the ranks agree
        initial = [p.detach() for p in make_net().parameters()]
        assert not any(torch.equal(a, b) for a, b in zip(initial, ranks[0][case]["single"]["params"]))
