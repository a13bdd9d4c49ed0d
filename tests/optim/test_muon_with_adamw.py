"""`MuonWithAdamW`: one optimizer that steps exactly as the pair ``Muon(routing.muon_groups)``,
``torch.optim.AdamW(routing.adamw_groups)``, with one state that moves to and from the pair's state dicts."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_muon import Muon, MuonWithAdamW, route_parameters
from lightning_muon.combined import merge_state_dicts, split_state_dict
from lightning_muon.optim import AdamW

MUON_KW = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}
ADAMW_KW = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.05}
SINGLE_KW = {**MUON_KW, **{f"adamw_{k}": v for k, v in ADAMW_KW.items()}}


class Net(nn.Module):
    """Every kind of route: an embedding, a conv kernel (flattened, 3:1: Gram Newton-Schulz), hidden matrices,
    a stack of matrices, a norm, biases and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.hidden = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.experts = nn.Parameter(torch.randn(2, 32, 32) / 32**0.5)
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.embed(x).transpose(1, 2)).flatten(1)
        h = self.norm(F.gelu(self.hidden(h)))
        h = h + sum(F.gelu(h @ e) for e in self.experts.unbind(0))
        return self.head(h)


def batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(16, (32, 8), generator=g)
        out.append((x, (x[:, 0] + x[:, 1]) % 16))
    return out


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_pair(model: nn.Module) -> list[torch.optim.Optimizer]:
    routing = route_parameters(model)
    return [Muon(routing.muon_groups, **MUON_KW), torch.optim.AdamW(routing.adamw_groups, **ADAMW_KW)]


def step_single(model, opt, data, scheduler=None) -> list[float]:
    losses = []
    for x, y in data:
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        losses.append(float(opt.step(closure).detach()))
        if scheduler is not None:
            scheduler.step()
    return losses


def step_pair(model, pair, data, schedulers=()) -> list[float]:
    losses = []
    for x, y in data:
        for opt in pair:
            opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for opt in pair:
            opt.step()
        for scheduler in schedulers:
            scheduler.step()
        losses.append(float(loss.detach()))
    return losses


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: max abs diff {(p - q).abs().max().item()}"


# ------------------------------------------------------------------ building


def test_from_model_routes_as_route_parameters_and_shares_groups_with_the_inner_optimizers():
    model = make_net()
    opt = MuonWithAdamW.from_model(model, **SINGLE_KW)
    routing = route_parameters(model)
    assert str(opt.routing) == str(routing)  # the same table and reasons
    expected = [("muon", g["name"], [n for n, _ in g["params"]]) for g in routing.muon_groups]
    expected += [("adamw", g["name"], [n for n, _ in g["params"]]) for g in routing.adamw_groups]
    assert [(g["algorithm"], g["name"], g["param_names"]) for g in opt.param_groups] == expected
    assert {n for g in opt.param_groups if g["algorithm"] == "adamw" for n in g["param_names"]} >= {
        "embed.weight", "head.weight", "head.bias", "norm.weight"
    }
    assert opt.param_groups[0]["param_names"] == ["experts", "conv.weight", "hidden.weight"]
    assert opt.param_groups[0]["matrix_layouts"] == ["stack", "flatten", "flatten"]
    assert isinstance(opt.muon, Muon) and type(opt.adamw) is AdamW and isinstance(opt.adamw, torch.optim.AdamW)
    assert [id(g) for g in opt.muon.param_groups] == [id(g) for g in opt.param_groups if g["algorithm"] == "muon"]
    assert [id(g) for g in opt.adamw.param_groups] == [id(g) for g in opt.param_groups if g["algorithm"] == "adamw"]
    assert opt.muon.state is opt.state and opt.adamw.state is opt.state
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[1]["lr"] == 3e-3
    assert opt.param_groups[1]["betas"] == (0.9, 0.95) and opt.param_groups[1]["weight_decay"] == 0.05


def test_the_constructor_takes_the_model_a_routing_or_groups_of_named_parameters():
    model = make_net()
    routing = route_parameters(model, adamw_params=["hidden.weight"])
    named = dict(model.named_parameters())
    muon_names = routing.names("Muon")
    groups = [
        {"algorithm": "muon", "params": [(n, named[n]) for n in muon_names], "name": "matrices", "lr": 0.05},
        {"algorithm": "adamw", "params": [(n, p) for n, p in model.named_parameters() if n not in muon_names]},
    ]
    explicit = MuonWithAdamW(groups)
    assert explicit.routing is None
    assert explicit.param_groups[0]["param_names"] == muon_names and explicit.param_groups[0]["lr"] == 0.05
    assert explicit.param_groups[0]["name"] == "matrices" and explicit.param_groups[1]["lr"] == 3e-4
    assert "hidden.weight" not in muon_names
    assert MuonWithAdamW(routing).routing is routing
    by_pattern = MuonWithAdamW(model, adamw_params=["hidden.weight"])
    assert [g["param_names"] for g in by_pattern.param_groups] == [g["param_names"] for g in MuonWithAdamW(routing)
                                                                   .param_groups]


def test_add_param_group_joins_the_algorithm_it_names():
    model = make_net()
    extra = nn.Linear(4, 4)
    opt = MuonWithAdamW.from_model(model)
    opt.add_param_group({"algorithm": "muon", "params": [("extra.weight", extra.weight)], "lr": 0.1})
    opt.add_param_group({"algorithm": "adamw", "params": [("extra.bias", extra.bias)]})
    assert opt.muon.param_groups[-1] is opt.param_groups[-2] and opt.adamw.param_groups[-1] is opt.param_groups[-1]
    assert opt.param_groups[-2]["momentum"] == 0.95 and opt.param_groups[-1]["betas"] == (0.9, 0.95)
    before = extra.weight.detach().clone()
    extra.weight.grad = torch.randn(4, 4)
    opt.step()
    assert "momentum_buffer" in opt.state[extra.weight] and not torch.equal(before, extra.weight)


def test_a_model_with_one_algorithm_only():
    model = nn.Sequential(nn.Embedding(8, 4))  # nothing for Muon
    opt = MuonWithAdamW.from_model(model, adamw_lr=0.1)
    assert opt.muon is None and [g["algorithm"] for g in opt.param_groups] == ["adamw"]
    model[0].weight.grad = torch.ones(8, 4)
    opt.step()
    assert opt.state_dict()["state"][0]["step"].item() == 1.0


def _linear_groups(first: str, second: str, shared: bool = False) -> list[dict]:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    return [
        {"algorithm": first, "params": [a.weight]},
        {"algorithm": second, "params": [a.weight if shared else b.weight]},
    ]


#: (params, kwargs, error type, message pattern): bad input, refused at construction as torch words it.
REFUSALS = [
    ("model", {"lr": -1.0}, ValueError, r"Invalid learning rate lr: -1\.0"),
    ("model", {"momentum": 1.0}, ValueError, r"Invalid momentum value: 1\.0"),
    ("model", {"ns_steps": 0}, ValueError, r"Invalid ns_steps: 0"),
    ("model", {"adamw_lr": -1.0}, ValueError, r"Invalid learning rate: -1\.0"),
    ("model", {"adamw_betas": (1.5, 0.9)}, ValueError, r"Invalid beta parameter at index 0: 1\.5"),
    ("model", {"adamw_eps": -1.0}, ValueError, r"Invalid epsilon value: -1\.0"),
    ("embedding only", {"lr": -1.0}, ValueError, r"Invalid learning rate lr: -1\.0"),  # no Muon group: checked anyway
    ("model", {"muon_params": ["nothing.*"]}, ValueError, r"muon_params pattern 'nothing\.\*' matches no"),
    ("parameters", {}, ValueError, r"needs to know which parameters are Muon's"),
    ("named parameters", {}, ValueError, r"got tuples, not param groups"),
    ("transformers groups", {}, ValueError, r"param group 0 has no 'algorithm'.*optimizer_cls_and_kwargs"),
    ("sgd group", {}, ValueError, r"Invalid algorithm: 'sgd' \(must be one of \('muon', 'adamw'\)\)"),
    ("1D muon group", {}, ValueError, r"Muon got .* of shape \(4,\): .*at least 2 dimensions"),
    ("shared", {}, ValueError, r"both a Muon and an AdamW group \(params\[0\]\)"),
    ("groups", {"adamw_params": ["*.bias"]}, ValueError, r"are routing patterns: give the model itself"),
    ("routing", {"muon_params": ["hidden.weight"]}, ValueError, r"are routing patterns: give the model itself"),
    ("empty", {}, ValueError, r"empty parameter list"),
]


def _params(kind: str):
    model = make_net()
    lin = nn.Linear(4, 4)
    return {
        "model": model,
        "embedding only": nn.Embedding(4, 4),
        "parameters": model.parameters(),
        "named parameters": model.named_parameters(),
        "transformers groups": [{"params": list(model.parameters()), "weight_decay": 0.0}],
        "sgd group": [{"algorithm": "sgd", "params": [lin.weight]}],
        "1D muon group": [{"algorithm": "muon", "params": [lin.bias]}],
        "shared": _linear_groups("muon", "adamw", shared=True),
        "groups": _linear_groups("muon", "adamw"),
        "routing": route_parameters(model),
        "empty": [],
    }[kind]


@pytest.mark.parametrize(
    ("kind", "kwargs", "error", "pattern"), REFUSALS, ids=[f"{r[0]}-{r[3][:24]}" for r in REFUSALS]
)
def test_bad_input_is_refused_quoting_it(kind, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        MuonWithAdamW(_params(kind), **kwargs)


def test_a_refused_group_leaves_the_optimizer_as_it_was():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = MuonWithAdamW([{"algorithm": "muon", "params": [a.weight]}, {"algorithm": "adamw", "params": [b.weight]}])
    with pytest.raises(ValueError, match="both a Muon and an AdamW"):
        opt.add_param_group({"algorithm": "adamw", "params": [a.weight]})
    assert len(opt.param_groups) == 2 and len(opt.adamw.param_groups) == 1
    only_muon = MuonWithAdamW([{"algorithm": "muon", "params": [a.weight]}])
    with pytest.raises(ValueError, match="both a Muon and an AdamW"):  # the first AdamW group: no AdamW after it
        only_muon.add_param_group({"algorithm": "adamw", "params": [a.weight]})
    assert only_muon.adamw is None and len(only_muon.param_groups) == 1 and only_muon.defaults["adamw"] == {}
    only_muon.add_param_group({"algorithm": "adamw", "params": [a.bias], "betas": (0.8, 0.9)})
    assert only_muon.adamw.param_groups == [only_muon.param_groups[1]] and only_muon.adamw.state is only_muon.state
    assert only_muon.defaults["adamw"]["betas"] == (0.9, 0.95) and only_muon.param_groups[1]["betas"] == (0.8, 0.9)
    assert only_muon.defaults["muon"]["lr"] == 0.02


def test_after_load_state_dict_the_groups_lrs_still_reach_the_inner_optimizers():
    """load_state_dict builds new group dicts: the inner optimizers step with them (a scheduler's writes)."""
    model = make_net()
    opt = MuonWithAdamW.from_model(model, **SINGLE_KW)
    step_single(model, opt, batches(1))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for group in opt.param_groups:
        group["lr"] = 0.0 if group["algorithm"] == "muon" else group["lr"]
    muon_before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    adamw_before = [p.detach().clone() for g in opt.param_groups[1:] for p in g["params"]]
    step_single(model, opt, batches(1, seed=1))
    assert all(torch.equal(b, p) for b, p in zip(muon_before, opt.param_groups[0]["params"]))  # lr 0: no move
    adamw_after = [p for g in opt.param_groups[1:] for p in g["params"]]
    assert not any(torch.equal(b, p) for b, p in zip(adamw_before, adamw_after))


# ------------------------------------------------------------------ equivalence with the pair


def test_steps_equal_the_pair_bit_for_bit_with_weight_decay_and_a_scheduler():
    data = batches(6)
    single_model, pair_model = make_net(), make_net()
    single = MuonWithAdamW.from_model(single_model, **SINGLE_KW)
    pair = make_pair(pair_model)

    def warmup(step: int) -> float:
        return min(1.0, (step + 1) / 3) * 0.9**step

    scheduler = torch.optim.lr_scheduler.LambdaLR(single, warmup)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, warmup) for opt in pair]
    single_losses = step_single(single_model, single, data, scheduler)
    pair_losses = step_pair(pair_model, pair, data, schedulers)
    assert single_losses == pair_losses
    assert single_losses[-1] < single_losses[0]
    assert max_abs_diff(single_model, pair_model) == 0.0
    assert_same_weights(single_model, pair_model)
    # the scheduler wrote every group's lr, and the inner optimizers stepped with it
    assert [g["lr"] for g in single.muon.param_groups] == [g["lr"] for g in pair[0].param_groups]
    assert single.param_groups[0]["lr"] == pytest.approx(0.02 * 0.9**6)
    muon_sd, adamw_sd = single.pair_state_dicts()
    assert _same_state(muon_sd, pair[0].state_dict()) and _same_state(adamw_sd, pair[1].state_dict())


def _same_state(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        a["state"][i].keys() == b["state"][i].keys()
        and all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i])
        for i in a["state"]
    )


def test_a_state_dict_resumes_exactly():
    data = batches(6)
    through, resumed_model = make_net(), make_net()
    opt = MuonWithAdamW.from_model(through, **SINGLE_KW)
    step_single(through, opt, data[:3])
    saved = copy.deepcopy(opt.state_dict())
    resumed_model.load_state_dict(through.state_dict())
    resumed = MuonWithAdamW.from_model(resumed_model, **SINGLE_KW)
    resumed.load_state_dict(saved)
    assert resumed.muon.param_groups[0] is resumed.param_groups[0] and resumed.muon.state is resumed.state
    assert [id(g) for g in resumed.adamw.param_groups] == [id(g) for g in resumed.param_groups[1:]]
    step_single(through, opt, data[3:])
    step_single(resumed_model, resumed, data[3:])
    assert_same_weights(through, resumed_model)


def test_state_moves_from_the_pair_to_the_single_optimizer_and_back():
    data = batches(9)
    # pair -> single
    pair_model, single_model = make_net(), make_net()
    pair = make_pair(pair_model)
    step_pair(pair_model, pair, data[:3])
    single_model.load_state_dict(pair_model.state_dict())
    single = MuonWithAdamW.from_model(single_model, **SINGLE_KW)
    single.load_pair_state_dicts(*(copy.deepcopy(opt.state_dict()) for opt in pair))
    step_pair(pair_model, pair, data[3:6])
    step_single(single_model, single, data[3:6])
    assert max_abs_diff(single_model, pair_model) == 0.0
    # single -> pair
    back_model = make_net()
    back_model.load_state_dict(single_model.state_dict())
    back = make_pair(back_model)
    for opt, state in zip(back, copy.deepcopy(single.pair_state_dicts())):
        opt.load_state_dict(state)
    step_single(single_model, single, data[6:])
    step_pair(back_model, back, data[6:])
    assert_same_weights(single_model, back_model)


def test_the_conversion_functions_renumber_and_keep_the_group_order():
    a, b, c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    opt = MuonWithAdamW([
        {"algorithm": "adamw", "params": [a.bias], "name": "first"},
        {"algorithm": "muon", "params": [a.weight, b.weight], "name": "m"},
        {"algorithm": "adamw", "params": [b.bias, c.bias], "name": "last"},
    ])
    for p in (a.weight, b.weight, a.bias, b.bias):  # c.bias has no gradient: no state
        p.grad = torch.ones_like(p)
    opt.step()
    muon_sd, adamw_sd = opt.pair_state_dicts()
    assert [g["params"] for g in muon_sd["param_groups"]] == [[0, 1]]
    assert [(g["name"], g["params"]) for g in adamw_sd["param_groups"]] == [("first", [0]), ("last", [1, 2])]
    assert "algorithm" not in muon_sd["param_groups"][0]
    assert sorted(adamw_sd["state"]) == [0, 1] and sorted(muon_sd["state"]) == [0, 1]
    assert adamw_sd["state"][1]["exp_avg"] is opt.state[b.bias]["exp_avg"]  # shared, as state_dict() shares
    merged = merge_state_dicts(muon_sd, adamw_sd, ["adamw", "muon", "adamw"])
    assert merged["param_groups"] == opt.state_dict()["param_groups"]
    assert sorted(merged["state"]) == [0, 1, 2, 3]
    default = merge_state_dicts(muon_sd, adamw_sd)
    assert [(g["algorithm"], g["params"]) for g in default["param_groups"]] == [
        ("muon", [0, 1]), ("adamw", [2]), ("adamw", [3, 4])
    ]
    assert split_state_dict(default)[0]["param_groups"] == muon_sd["param_groups"]
    with pytest.raises(ValueError, match=r"algorithms \['muon', 'adamw'\] must name 'muon' once per Muon group"):
        merge_state_dicts(muon_sd, adamw_sd, ["muon", "adamw"])
    with pytest.raises(ValueError, match=r"algorithm None, not one of"):
        split_state_dict(muon_sd)
    with pytest.raises(ValueError, match=r"algorithms \['adamw', 'muon', 'adamw'\], this optimizer's"):
        MuonWithAdamW([*_linear_groups("muon", "adamw"), _linear_groups("adamw", "adamw")[0]]).load_state_dict(
            opt.state_dict()
        )


def test_a_copy_or_an_unpickled_optimizer_steps_its_own_groups():
    model = make_net()
    opt = MuonWithAdamW.from_model(model, **SINGLE_KW)
    data = batches(2)
    step_single(model, opt, data[:1])
    for twin in (copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))):
        twin_model, twin_opt = twin
        assert twin_opt.muon.param_groups[0] is twin_opt.param_groups[0] and twin_opt.adamw.state is twin_opt.state
        step_single(twin_model, twin_opt, data[1:])
        assert twin_opt.state[twin_model.hidden.weight]["momentum_buffer"] is not None
    step_single(model, opt, data[1:])
    assert_same_weights(model, twin_model)
