"""Flattened parameters are refused, never trained silently wrong (issue 47).

- DeepSpeed's ZeRO optimizer (stages 1, 2 and 3) flattens each param group's matrices into one 1-D buffer and writes
  it into ``group["params"]`` of the optimizer it wraps; FSDP1 makes each parameter's data a 1-D view of its shard.
  `Muon` (and so `MuonWithAdamW`) records what each parameter was given as and refuses, at the step and before
  anything moves, a parameter that is no longer that matrix. The ZeRO write is reproduced here as DeepSpeed's
  ``DeepSpeedZeroOptimizer.__init__`` does it (``param_group['params'] = [single_partition_of_fp32_groups[i]]``,
  the flat fp32 copy, its gradient set before the wrapped optimizer's step): DeepSpeed stays out of the tests.
- FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) on 2 gloo ranks: `route_parameters` (and so
  `MuonWithAdamW`) refuses a model it has flattened, with and without ``use_orig_params``, wrapped whole or from
  outside, naming FSDP2; `Muon` refuses its flattened tensors when given them.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_muon import Muon, MuonWithAdamW, route_parameters

from helpers import RANKS_START_METHOD

#: The step-time refusal's cause and ways out.
REPLACED = (r"something reshaped or replaced the optimizer's parameters after it was built\. DeepSpeed's ZeRO "
            r"optimizer .* FSDP2 .* DeepSpeed's own Muon")
#: route_parameters' refusal of a model FSDP1 flattened.
FSDP1 = r"route_parameters got a model that FSDP1 \(torch\.distributed\.fsdp\.FullyShardedDataParallel\) has flattened"


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 32), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 32), nn.GELU(),
                         nn.Linear(32, 16))


def give_grads(params: list[torch.Tensor], seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def zero_flatten(optimizer: torch.optim.Optimizer, group_index: int) -> torch.Tensor:
    """What DeepSpeed's ZeRO stage 1/2 optimizer does to the group it wraps: the group's tensors flattened into one
    fp32 1-D partition (the whole of it: one rank) written into ``group["params"]``, its gradient the flat
    gradients. Returns the flat tensor."""
    group = optimizer.param_groups[group_index]
    flat = torch.cat([p.detach().reshape(-1) for p in group["params"]]).float().requires_grad_()
    flat.grad = torch.cat([p.grad.reshape(-1) for p in group["params"]])
    group["params"] = [flat]
    return flat


def test_muon_refuses_a_group_zero_flattened_before_anything_moves():
    model = make_net()
    routing = route_parameters(model)
    muon = Muon(routing.muon_groups, lr=0.02)
    give_grads([p for g in muon.param_groups for p in g["params"]])
    flat = zero_flatten(muon, 0)
    assert flat.shape == (32 * 16 + 16 * 32,)
    before = flat.detach().clone()
    with pytest.raises(RuntimeError, match=r"Muon: param group 0 holds a tensor of shape \(1024,\) \(index 0\) that "
                                           r"it was not given and cannot take as a matrix: " + REPLACED):
        muon.step()
    assert torch.equal(flat, before) and not muon.state  # refused before any update or momentum


def test_muon_with_adamw_refuses_its_zero_flattened_muon_group_before_adamw_steps():
    model = make_net()
    optimizer = MuonWithAdamW.from_model(model, lr=0.02)
    give_grads(list(model.parameters()))
    (muon_index,) = [k for k, g in enumerate(optimizer.param_groups) if g["algorithm"] == "muon"]
    zero_flatten(optimizer, muon_index)  # ZeRO wraps the outer optimizer: the inner Muon shares the group dict
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"holds a tensor of shape \(1024,\) .*" + REPLACED):
        optimizer.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # AdamW did not step either
    assert not optimizer.state


def test_muon_refuses_a_parameter_flattened_in_place():
    # FSDP1's use_orig_params=True makes a parameter's data a 1-D view of its shard, after the optimizer saw it
    w = nn.Parameter(torch.randn(32, 16))
    v = nn.Parameter(torch.randn(16, 32))
    muon = Muon([{"params": [v, w], "param_names": ["v", "w"]}], lr=0.02)
    give_grads([v, w])
    muon.step()
    w.data = w.data.reshape(-1)
    w.grad = torch.randn(w.shape)
    kept = [v.detach().clone(), muon.state[v]["momentum_buffer"].clone()]
    with pytest.raises(RuntimeError, match=r"Muon: parameter `w` \(index 1\) was given as a tensor of shape "
                                           r"\(32, 16\) and is one of shape \(512,\) at this step: " + REPLACED):
        muon.step()
    assert torch.equal(v, kept[0]) and torch.equal(muon.state[v]["momentum_buffer"], kept[1])


def test_tensors_swapped_for_others_of_the_same_kind_still_step():
    # the paths that legitimately hand Muon tensors it was not given: a group rebuilt over the model's tensors (the
    # mixin's first-batch regrouping), a copy of the optimizer, a state dict loaded
    model = make_net()
    routing = route_parameters(model)
    muon = Muon(routing.muon_groups, lr=0.02)
    other = [nn.Parameter(p.detach().clone()) for p in muon.param_groups[0]["params"]]
    start = [p.detach().clone() for p in other]
    muon.param_groups[:] = Muon([{**muon.param_groups[0], "params": other}], lr=0.02).param_groups
    give_grads(other)
    muon.step()
    copied = copy.deepcopy(muon)
    give_grads(copied.param_groups[0]["params"])
    copied.step()
    fresh = Muon([{**muon.param_groups[0], "params": other}], lr=0.02)
    fresh.load_state_dict(copied.state_dict())
    give_grads(other)
    fresh.step()
    assert not any(torch.equal(p, s) for p, s in zip(other, start)) and set(fresh.state) == set(other)


# ------------------------------------------------------------------ FSDP1 on 2 ranks


def _fsdp1_refusals(rank: int) -> dict[str, str]:
    """Each way FSDP1 can hand a model to the routing or Muon: the refusal's message (or ``"routed"``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    cpu = torch.device("cpu")
    found: dict[str, str] = {}
    for orig in (False, True):
        wrapped = FSDP(make_net(), use_orig_params=orig, device_id=cpu)
        inner = make_net()  # its second Linear wrapped alone, the whole wrapped again (an auto-wrap policy's result)
        inner[3] = FSDP(inner[3], use_orig_params=orig, device_id=cpu)
        nested = FSDP(inner, use_orig_params=orig, device_id=cpu)
        cases = {"whole": lambda w=wrapped: route_parameters(w),
                 "inner module": lambda w=wrapped: route_parameters(w.module),  # wrapped from outside
                 "nested": lambda n=nested: route_parameters(n),
                 "MuonWithAdamW": lambda w=wrapped: MuonWithAdamW.from_model(w),
                 "Muon by hand": lambda w=wrapped: Muon([p for p in w.parameters() if p.ndim >= 2] or
                                                        list(w.parameters()), lr=0.02)}
        for case, call in cases.items():
            try:
                call()
                found[f"{case}, use_orig_params={orig}"] = "routed"
            except ValueError as error:
                found[f"{case}, use_orig_params={orig}"] = str(error)
        found[f"shapes, use_orig_params={orig}"] = str([tuple(p.shape) for p in wrapped.parameters()])
    # FSDP2 is the way: its parameters (DTensors) keep their shapes and route as they would unsharded
    from torch.distributed.fsdp import fully_shard

    sharded = make_net()
    fully_shard(sharded)
    found["FSDP2"] = str(route_parameters(sharded).names("Muon"))
    return found


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.save(_fsdp1_refusals(rank), os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    os._exit(0)  # no interpreter teardown: see tests/test_distributed.py (torch 2.13 + gloo abort at exit)


@pytest.mark.distributed
def test_fsdp1_flattened_models_are_refused_naming_fsdp2(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method=RANKS_START_METHOD)
    for rank in range(2):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        assert found.pop("FSDP2") == str(route_parameters(make_net()).names("Muon")) == "['1.weight', '3.weight']"
        shapes = {key: found.pop(key) for key in [k for k in found if k.startswith("shapes")]}
        assert all(re.fullmatch(r"\[(\(\d+,\)(, )?)+\]", s) for s in shapes.values()), shapes  # all 1-D shards
        for case, message in found.items():
            if case.startswith("Muon by hand"):
                assert re.match(r"Muon got parameter 0 of shape \(\d+,\): FSDP1 .* has flattened it .* FSDP2",
                                message), (case, message)
            else:
                assert re.match(FSDP1 + r": (wrapped at|flattened parameters) .*\. FSDP1 hands the optimizer flat "
                                r"1-D shards .*fully_shard .*ModelParallelStrategy", message), (case, message)
        whole, outside = found["whole, use_orig_params=True"], found["inner module, use_orig_params=True"]
        assert "wrapped at the model itself; flattened parameters '_fsdp_wrapped_module.0.weight'," in whole
        assert "has flattened: flattened parameters '0.weight', '1.weight', '1.bias' and 4 more." in outside


# ------------------------------------------------------------------ DeepSpeed itself, where it is installed

#: One process of DeepSpeed's ZeRO at stage ``argv[1]`` on CPU (gloo), given MuonWithAdamW and Muon: each line says
#: whether the engine's first step was refused (DeepSpeed runs in its own interpreter: importing it changes what
#: transformers and accelerate import in this one).
ZERO_RUN = """
import os, sys
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
import deepspeed, torch
from torch import nn
from lightning_muon import Muon, MuonWithAdamW, route_parameters
deepspeed.init_distributed(dist_backend="gloo")
config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": int(sys.argv[1])},
          "zero_allow_untested_optimizer": True}
for kind in ("MuonWithAdamW", "Muon"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 32), nn.GELU(),
                          nn.Linear(32, 4))
    optimizer = (MuonWithAdamW.from_model(model, lr=0.02) if kind == "MuonWithAdamW"
                 else Muon(route_parameters(model).muon_groups, lr=0.02))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
    try:
        engine.step()
        print(kind, "stepped")
    except RuntimeError as error:
        print(kind, "refused:", str(error).replace(chr(10), " "))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_is_refused_at_the_first_step(stage, tmp_path):
    # DeepSpeed stays out of CI (`.ci/run` does not install it): this runs only where it is installed
    pytest.importorskip("deepspeed")
    import subprocess
    import sys

    from helpers import free_port

    script = tmp_path / "zero_run.py"
    script.write_text(ZERO_RUN)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(stage), str(free_port())], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("MuonWithAdamW ", "Muon "))]
    assert len(lines) == 2, done.stdout + done.stderr
    for line in lines:  # ZeRO wrote one flat buffer of the Muon group's 4 matrices (1,280 elements) into its group
        assert re.search(r" refused: Muon: param group 0 holds a tensor of shape \(1280,\) \(index 0\) that it was "
                         r"not given and cannot take as a matrix: " + REPLACED, line), line
