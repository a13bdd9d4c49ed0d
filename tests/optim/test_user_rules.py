"""The update rules' home (``lightning_muon.optim.rules``): a rule a user writes (the optimizer guide's `MatchRMS`, run
from the guide's own text) steps on one process as a hand-written reference says, and under DDP and FSDP2 on 2 gloo
ranks as on one process, after NorMuon and cautious decay in one group and before a rule with state shaped like its
parameter in another; its key is checked and its words said; the registry refuses a key that is taken."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_muon import Muon
from lightning_muon.optim import groups
from lightning_muon.optim.newton_schulz import zeropower_via_newtonschulz
from lightning_muon.optim.rules import NorMuon, UpdateRule, register_rule, rules_for

from helpers import code_blocks, run_ranks

#: The guide's rule (its first Python block), registered as the guide registers it: here, and in every rank this
#: module is imported in.
GUIDE: dict = {"__name__": "optimizer_guide"}
exec(compile(code_blocks("guides/optimizer.md")[0], "docs/guides/optimizer.md block 0", "exec"), GUIDE)
MatchRMS = GUIDE["MatchRMS"]

LR, WD, MOMENTUM, TARGET = 0.02, 0.1, 0.95, 0.2
SHAPES = [(16, 8), (16, 16), (9, 16), (4, 9)]  # 9 rows: uneven shards on 2 ranks
STEPS = 3


def test_the_guide_s_example_runs_and_says_the_group_s_rules(capsys):
    exec(compile(code_blocks("guides/optimizer.md")[1], "docs/guides/optimizer.md block 1", "exec"), {})
    assert capsys.readouterr().out.strip() == "NorMuon (normuon_beta2=0.95), MatchRMS (update_rms=0.2)"


def _reference(w: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """Muon (nesterov, fp32 Newton-Schulz, the original lr scaling) with the guide's rule, by hand: the
    orthogonalised update scaled to RMS ``TARGET`` before the decay and the step."""
    w, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        buf = buf.lerp(g, 1 - MOMENTUM)
        o = zeropower_via_newtonschulz(g.lerp(buf, MOMENTUM), ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5,
                                       eps=1e-7, dtype=torch.float32)
        o = o * (TARGET / o.square().mean().sqrt())
        w = w * (1 - LR * WD) - LR * math.sqrt(max(1, w.shape[0] / w.shape[1])) * o
    return w


def test_a_user_rule_steps_as_its_hand_written_reference():
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=generator) for s in SHAPES]
    grads = [[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(STEPS)]
    params = [nn.Parameter(w.clone()) for w in start]
    muon = Muon([{"params": params, "update_rms": TARGET}], lr=LR, weight_decay=WD, ns_dtype=torch.float32,
                ns_batch_bytes=0)
    plain = [nn.Parameter(w.clone()) for w in start]
    plain_muon = Muon(plain, lr=LR, weight_decay=WD, ns_dtype=torch.float32, ns_batch_bytes=0)
    for step_grads in grads:
        for p, q, g in zip(params, plain, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        muon.step()
        plain_muon.step()
    for k, p in enumerate(params):
        torch.testing.assert_close(p.detach(), _reference(start[k], [g[k] for g in grads]), rtol=0, atol=1e-6)
        assert (p.detach() - plain[k].detach()).abs().max() > 1e-4  # the rule changed the step
    assert [type(rule) for rule in rules_for(muon.param_groups[0])] == [MatchRMS]
    assert set(muon.state[params[0]]) == {"momentum_buffer"}  # a rule without state keeps none


def test_a_user_rule_s_update_has_its_rms_exactly():
    """No decay, no lr scaling: one step moves a matrix by ``lr`` times an update of RMS ``update_rms`` (plain Muon's
    bf16 Newton-Schulz leaves the RMS off by whatever its singular values are)."""
    p = nn.Parameter(torch.randn(12, 20))
    before = p.detach().clone()
    p.grad = torch.randn(12, 20)
    Muon([{"params": [p], "update_rms": TARGET}], lr=LR, weight_decay=0.0, adjust_lr_fn="none").step()
    rms = ((before - p.detach()) / LR).square().mean().sqrt()
    torch.testing.assert_close(rms, torch.tensor(TARGET), rtol=1e-3, atol=0)


def test_a_user_rule_s_setting_is_checked_and_its_key_is_its_own():
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"Invalid update_rms: -1 \(must be a positive number\)"):
        Muon([{"params": [p], "update_rms": -1}])
    with pytest.raises(ValueError, match=r"Invalid normuon_beta2: 1\.5 \(must be None \(plain Muon\)"):
        Muon([{"params": [p], "normuon_beta2": 1.5}])  # a group's own setting, checked as the constructor's
    assert register_rule(MatchRMS) is MatchRMS  # again: nothing changes

    class Other(UpdateRule):
        key = "update_rms"

    class Momentum(UpdateRule):
        key = "momentum"

    with pytest.raises(ValueError, match=r"Other's key 'update_rms' is MatchRMS's already; give it another"):
        register_rule(Other)
    with pytest.raises(ValueError, match=r"Momentum's key 'momentum' is a setting of Muon itself"):
        register_rule(Momentum)
    assert groups.update_rule({"update_rms": None, "cautious_weight_decay": True}) == "Muon, cautious weight decay"


@register_rule
class ZeroDecay(UpdateRule):
    """A rule whose decay is none at all."""

    key = "test_zero_decay"

    def decay(self, params, updates, coefficient):
        return True


def test_two_rules_that_each_decay_are_refused_and_one_decays_in_place_of_the_plain_decay():
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"cautious_weight_decay, test_zero_decay each decay the weights their own"):
        Muon([{"params": [p], "test_zero_decay": True}], cautious_weight_decay=True)
    q = nn.Parameter(torch.ones(4, 4))
    q.grad = torch.ones(4, 4)
    Muon([{"params": [q], "test_zero_decay": True}], lr=0.1, weight_decay=0.5, adjust_lr_fn="none",
         ns_dtype=torch.float32).step()
    # the rule's decay (none) in place of the plain one: only the step moved the entries
    plain = nn.Parameter(torch.ones(4, 4))
    plain.grad = torch.ones(4, 4)
    Muon([plain], lr=0.1, weight_decay=0.0, adjust_lr_fn="none", ns_dtype=torch.float32).step()
    assert torch.equal(q.detach(), plain.detach())


@register_rule
class AveragedUpdate(UpdateRule):
    """A rule with state shaped like its parameter (a DTensor parameter's then sharded like it): each entry of the
    update replaced by its running average, ``a <- a.lerp(O, 1 - test_update_average)``; elementwise, so the
    default `update_shards` (`update` on the shards) is right."""

    key = "test_update_average"
    state_keys = ("test_average",)

    def new_state(self, param, layout):
        return {"test_average": torch.zeros_like(param, dtype=torch.float32)}

    def update(self, bucket, updates):
        averages = bucket.states["test_average"]
        for average, u in zip(averages, updates, strict=True):
            average.lerp_(u.float().reshape(average.shape), 1 - bucket.group[self.key])
        return [average.clone() for average in averages]


# --------------------------------------------------------------------------- one process, DDP, FSDP2


def _net() -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Sequential(nn.Linear(s[1], s[0], bias=False), nn.Tanh()) for s in SHAPES))


def _train(model: nn.Module, split_ns: bool = True) -> Muon:
    """Two groups: the guide's rule then a rule with state, and the guide's rule after NorMuon with cautious decay;
    the same batch on every rank (so averaged gradients are one process's, exactly)."""
    weights = [layer[0].weight for layer in model]
    muon = Muon([{"params": weights[:2], "update_rms": TARGET, "test_update_average": 0.5},
                 {"params": weights[2:], "update_rms": TARGET, "normuon_beta2": 0.9, "cautious_weight_decay": True}],
                lr=LR, weight_decay=WD, ns_dtype=torch.float32, split_ns=split_ns)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(16, SHAPES[0][1], generator=generator)
        y = torch.randn(16, SHAPES[-1][0], generator=generator)
        nn.functional.mse_loss(model(x), y).backward()
        if dist.is_initialized() and not _sharded(model):
            for p in model.parameters():  # DDP: average the ranks' gradients
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        muon.step()
        muon.zero_grad()
    return muon


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(next(model.parameters()), DTensor)


def _whole(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if _sharded(model) else p).detach().clone() for p in model.parameters()]


def _ranks_main(argv: list[str]) -> None:
    """On each of 2 ranks: the net under DDP (split Newton-Schulz), under FSDP2 (``fully_shard``: owner ranks), and
    under FSDP2 with ``split_ns=False`` (every rank gathers every matrix whole); each one's parameters saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = Path(argv[0])
    results = {}
    model = _net()
    results["ddp"] = (_whole(model) if _train(model).strategy.kind == "replicated" else None)
    for name, split in (("fsdp2", True), ("fsdp2-every-rank", False)):
        model, mesh = _net(), init_device_mesh("cpu", (2,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        muon = _train(model, split_ns=split)
        state = muon.state[next(model.parameters())]
        results[name] = (_whole(model), muon.strategy.kind, sorted(state), state["test_average"].full_tensor())
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_user_rule_under_ddp_and_fsdp2_steps_as_one_process(tmp_path):
    """The rule's scale needs the whole matrix's RMS: under FSDP2 each owner computes it from the whole update and
    every rank scales its rows by it (a rank scaling its shard by the shard's own RMS would step differently)."""
    run_ranks(_ranks_main, [str(tmp_path)], 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    model = _net()
    muon = _train(model)
    alone = _whole(model)
    assert muon.strategy.kind == "local"
    assert ranks[0]["fsdp2"][1] == "sharded" and ranks[0]["fsdp2-every-rank"][1] == "local"
    for name in ("ddp", "fsdp2", "fsdp2-every-rank"):
        got = ranks[0][name] if name == "ddp" else ranks[0][name][0]
        assert got is not None, name
        # DDP's split does not merge a tall bucket with its wide twin as one process does: float rounding
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-6, msg=name)
        other = ranks[1][name] if name == "ddp" else ranks[1][name][0]
        assert all(torch.equal(a, b) for a, b in zip(got, other)), name
    # the rule's state beside the momentum buffer, sharded as its parameter, and as one process's
    assert ranks[0]["fsdp2"][2] == ["momentum_buffer", "test_average"]
    for name in ("fsdp2", "fsdp2-every-rank"):
        torch.testing.assert_close(ranks[0][name][3], muon.state[next(model.parameters())]["test_average"], rtol=0,
                                   atol=1e-6)


def test_normuon_is_one_class_the_strategies_do_not_name():
    """The strategies move tensors and call the rules: no rule's name or state key in them."""
    package = Path(sys.modules["lightning_muon"].__file__).parent
    text = (package / "optim" / "_strategies.py").read_text().lower()
    assert "normuon" not in text and "cautious" not in text and NorMuon.state_keys[0] not in text
    assert "normuon" not in (package / "optim" / "_update.py").read_text().lower()
