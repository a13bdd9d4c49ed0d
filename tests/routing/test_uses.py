"""Tensors by their use and by what they are: a parameter is a hidden matrix only where the computation uses it as
one (`GraphRoles.elementwise`: only added, multiplied, indexed, concatenated, fed to a layer or broadcast over a
matrix is a table or a scale), and each tensor of a parametrization (`_roles.parametrized`: weight norm's
magnitude and direction, spectral norm's and orthogonal's originals, the older ``weight_g``/``weight_v``) by
what it is, its layer's rules included."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_routing_models import seeded
from torch import nn
from torch.nn.utils import parametrizations

from lightning_muon.routing import ADAMW, MUON, GraphRoles, Rule, route_parameters, trace_roles


def routes(model, graph=None):
    return {r.name: r for r in route_parameters(model, graph=graph).routes}


def placed(model, graph=None):
    return {name: (r.optimizer, r.group) for name, r in routes(model, graph).items()}


# ------------------------------------------------------------------ bare parameters by their use


class PosLM(nn.Module):
    """The issue's custom LM: a bare learned position table named ``pos`` (16 x 32), sliced and added."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 32)
        self.pos = nn.Parameter(torch.randn(16, 32) * 0.02)
        self.mlp = nn.Linear(32, 32)
        self.out = nn.Linear(32, 50)

    def forward(self, ids):
        h = self.tok(ids) + self.pos[: ids.shape[1]]
        return self.out(torch.relu(self.mlp(h)))


def lm_loss(model, ids):
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


IDS = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))


def test_a_bare_position_table_the_batch_only_adds_goes_to_adamw_whatever_its_name():
    model = seeded(PosLM)
    assert routes(model)["pos"].optimizer == MUON  # no batch: names and shape guess a hidden matrix
    found = trace_roles(model, IDS, lambda b: lm_loss(model, b))
    assert found.elementwise["pos"] == ("adds",) and "pos" not in found.seen
    pos = routes(model, found)["pos"]
    assert (pos.optimizer, pos.group, pos.rule) == (ADAMW, "embeddings", Rule.FIRST_BATCH)
    assert pos.reason == ("not a matrix, a table: the first batch only adds it to activations (not the hidden "
                          "matrix its shape suggests)")
    assert routes(model, found)["mlp.weight"].optimizer == MUON


class Uses(nn.Module):
    """Bare 2D parameters used every way but as a matrix, and one used both ways."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(4, 8))  # multiplied elementwise
        self.rows = nn.Parameter(torch.randn(10, 8))  # indexed by the batch
        self.queries = nn.Parameter(torch.randn(2, 8))  # fed to a layer as its input, then concatenated
        self.both = nn.Parameter(torch.randn(8, 8))  # added and applied as a matrix
        self.odd = nn.Parameter(torch.randn(4, 8))  # combined by a call the trace does not know
        self.head = nn.Linear(8, 3)

    def forward(self, batch):
        x, ids = batch
        h = self.lin(x) * self.gain + self.rows[ids]
        h = torch.cat([h, self.lin(self.queries).expand(h.shape[0], -1, -1)], 1)
        h = h @ self.both + self.both[0]
        h = torch.atan2(h[:, :4], self.odd)
        return self.head(h)


USES_BATCH = (torch.randn(3, 4, 8), torch.randint(0, 10, (3, 4)))


def test_what_the_batch_does_with_a_parameter_decides_whether_it_is_a_matrix():
    model = seeded(Uses)
    found = trace_roles(model, USES_BATCH, lambda b: model(b).square().mean())
    assert found.note == ""
    assert dict(found.elementwise) == {"gain": ("multiplies",), "rows": ("indexes",),
                                       "queries": ("concatenates", "feeds")}
    got = routes(model, found)
    assert (got["gain"].optimizer, got["gain"].group) == (ADAMW, "norms_and_biases")
    assert got["gain"].reason.startswith("not a matrix, a scale: the first batch only multiplies activations by it")
    assert (got["rows"].optimizer, got["rows"].group) == (ADAMW, "embeddings")
    assert got["queries"].reason.startswith(
        "not a matrix, a table: the first batch only concatenates it with activations and feeds it to a layer")
    assert got["both"].optimizer == MUON  # a matrix where any use is one
    assert got["odd"].optimizer == MUON and got["odd"].rule is Rule.SHAPE  # atan2: no verdict, its shape decides
    assert got["lin.weight"].group == "input"  # it reads the batch


def test_user_patterns_outrank_the_use():
    model = seeded(PosLM)
    found = trace_roles(model, IDS, lambda b: lm_loss(model, b))
    assert route_parameters(model, muon_params=["pos"], graph=found).names(MUON) == ["pos", "mlp.weight"]


class ByHandNormalised(nn.Module):
    """Weight normalisation written by hand with bare parameters: ``g`` (out x 1) only scales the matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.v = nn.Parameter(torch.randn(8, 8))
        self.g = nn.Parameter(torch.ones(8, 1))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        weight = self.g * self.v / self.v.norm(dim=1, keepdim=True)
        return self.head(torch.tanh(F.linear(torch.tanh(self.inp(x)), weight)))


def test_a_scale_broadcast_over_a_matrix_is_not_the_matrix():
    model = seeded(ByHandNormalised)
    found = trace_roles(model, torch.randn(5, 4), lambda b: model(b).square().mean())
    assert found.seen == {"inp.weight", "v", "head.weight"} and found.elementwise == {"g": ("scales",)}
    got = routes(model, found)
    assert (got["g"].optimizer, got["g"].group) == (ADAMW, "norms_and_biases")
    assert "scales a matrix by it (broadcast)" in got["g"].reason
    assert (got["v"].optimizer, got["v"].group) == (MUON, "hidden")


class Experts(nn.Module):
    """Experts stored as one stack, each chosen by a router's top-1 (an index from an activation)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 3)
        self.experts = nn.Parameter(torch.randn(3, 8, 8) * 0.1)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        chosen = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in chosen.unique():
            rows = chosen == e
            out[rows] = F.linear(x[rows], self.experts[e])
        return self.head(out)


def test_a_matrix_chosen_by_an_activation_is_still_applied_as_a_matrix():
    model = seeded(Experts)
    found = trace_roles(model, torch.randn(16, 8), lambda b: model(b).square().mean())
    assert "experts" in found.seen and "experts" not in found.elementwise
    assert routes(model, found)["experts"].optimizer == MUON


def test_a_matrix_applied_to_a_fresh_tensor_is_applied_not_computed_from_parameters():
    """A generator's first layer reads noise drawn in the step (no buffer, not the batch): it is applied to it."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    found = trace_roles(model, torch.zeros(1), lambda b: model(torch.randn(3, 4)).square().mean())
    assert found.heads == {"4.weight"} and found.seen == {"0.weight", "2.weight", "4.weight"}


# ------------------------------------------------------------------ parametrizations


class Normed(nn.Module):
    """A weight-normed 1-channel stem, hidden conv and head (HiFi-GAN's convs, a TTS head), a spectral-normed and an
    orthogonal Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = parametrizations.weight_norm(nn.Conv1d(1, 16, 3, padding=1))
        self.hid = parametrizations.weight_norm(nn.Conv1d(16, 16, 3, padding=1))
        self.sn = parametrizations.spectral_norm(nn.Linear(16, 16))
        self.orth = parametrizations.orthogonal(nn.Linear(16, 16))
        self.head = parametrizations.weight_norm(nn.Linear(16, 1))

    def forward(self, x):
        h = torch.tanh(self.hid(torch.tanh(self.inp(x)))).mean(-1)
        return self.head(self.orth(torch.tanh(self.sn(h))))


WN = "parametrizations.weight.original"


def test_each_tensor_of_a_parametrization_goes_by_what_it_is():
    model = seeded(Normed)
    structural = routes(model)
    found = trace_roles(model, torch.randn(4, 1, 10), lambda b: model(b).square().mean())
    assert found.note == ""
    assert found.heads == {f"head.{WN}1"} and found.inputs == {f"inp.{WN}1"}
    assert found.seen == {f"{n}.{WN}1" for n in ("inp", "hid", "head")} | {f"{n}.{WN}" for n in ("sn", "orth")}
    traced = routes(model, found)
    for got in (structural, traced):
        for layer in ("inp", "hid", "head"):  # the magnitude: one scale per output, never Muon's
            assert got[f"{layer}.{WN}0"].optimizer == ADAMW
            assert f"weight norm's magnitude of `{layer}.weight`" in got[f"{layer}.{WN}0"].reason
        # the direction is its layer's weight: a conv kernel, flattened, not 16 stacked 16x3 matrices
        assert (got[f"hid.{WN}1"].optimizer, got[f"hid.{WN}1"].layout) == (MUON, "flatten")
        assert got[f"hid.{WN}1"].reason.startswith("3D kernel, orthogonalised as 16x48")
        assert got[f"hid.{WN}1"].reason.endswith("; weight norm's direction of `hid.weight`")
        assert (got[f"inp.{WN}1"].optimizer, got[f"inp.{WN}1"].group) == (ADAMW, "input")
        assert (got[f"head.{WN}1"].optimizer, got[f"head.{WN}1"].group) == (ADAMW, "head")
        assert got[f"head.{WN}0"].group == "head"  # a head's magnitude with its head, as its bias
        assert got[f"hid.{WN}0"].group == got[f"inp.{WN}0"].group == "norms_and_biases"
        assert got[f"sn.{WN}"].optimizer == got[f"orth.{WN}"].optimizer == MUON
        assert got[f"sn.{WN}"].reason == "hidden matrix; spectral norm's original of `sn.weight`"
        assert got[f"orth.{WN}"].reason == "hidden matrix; orthogonal's original of `orth.weight`"
    assert traced[f"head.{WN}1"].rule is traced[f"inp.{WN}1"].rule is Rule.FIRST_BATCH
    assert traced[f"head.{WN}0"].reason == ("output head's magnitude (first batch); weight norm's magnitude of "
                                            "`head.weight`")


def test_torchs_older_weight_norm_and_spectral_norm():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        model = seeded(lambda: nn.Sequential(
            nn.Linear(4, 8), nn.Tanh(), nn.utils.weight_norm(nn.Linear(8, 8)), nn.Tanh(),
            nn.utils.spectral_norm(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 2)))
    found = trace_roles(model, torch.randn(3, 4), lambda b: model(b).square().mean())
    assert found.seen == {"0.weight", "2.weight_v", "4.weight_orig", "6.weight"}
    for got in (placed(model), placed(model, found)):
        assert got["2.weight_g"] == (ADAMW, "norms_and_biases") and got["2.weight_v"] == (MUON, "hidden")
        assert got["4.weight_orig"] == (MUON, "hidden")
    assert routes(model)["2.weight_v"].reason == "hidden matrix; weight norm's direction of `2.weight`"


# ------------------------------------------------------------------ what the batch did not reach


class TwoTasks(nn.Module):
    """Task A's head reads the trunk; task B's branch (``aux``, then ``head_reg``) is computed only for task B."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 64)
        self.cls = nn.Linear(64, 5)
        self.head_reg = nn.Linear(64, 3)
        self.aux = nn.Linear(64, 64)  # registered last: the structural rules take it for the head

    def forward(self, x, task):
        h = torch.tanh(self.trunk(x))
        if task == "a":
            return self.cls(h).logsumexp(-1).mean()
        return self.head_reg(torch.tanh(self.aux(h))).square().mean()


def test_what_the_batch_did_not_reach_is_marked_and_routed_by_structure():
    model = seeded(TwoTasks)
    x = torch.randn(4, 8)
    first = trace_roles(model, x, lambda b: model(b, "a"))
    assert first.unreached == {"aux.weight", "aux.bias", "head_reg.weight", "head_reg.bias"}
    got = routes(model, first)
    # the blind routing the issue found, now said: the last Linear by structure, aux, taken for the head
    assert (got["head_reg.weight"].optimizer, got["aux.weight"].group) == (MUON, "head")
    assert got["aux.weight"].reason.endswith("; not reached by a batch yet")
    assert "not reached" not in got["cls.weight"].reason
    table = route_parameters(model, graph=first).render(width=250)
    assert "4 parameters no batch has reached yet" in table
    # a later batch that reaches them decides their roles; what the first decided stays
    later = trace_roles(model, x, lambda b: model(b, "b"))
    assert later.heads == {"head_reg.weight"} and later.unreached == {"cls.weight", "cls.bias"}
    merged = first.merge(later)
    assert merged.unreached == frozenset() and merged.late == {"aux.weight", "aux.bias", "head_reg.weight",
                                                               "head_reg.bias"}
    assert merged.heads == {"cls.weight", "head_reg.weight"}
    got = routes(model, merged)
    assert (got["head_reg.weight"].optimizer, got["head_reg.weight"].group) == (ADAMW, "head")
    assert got["head_reg.weight"].rule is Rule.LATER_BATCH
    assert got["head_reg.weight"].reason == "output head: feeds the loss through no other matrix (later batch)"
    assert got["head_reg.bias"].group == "head"
    assert (got["aux.weight"].optimizer, got["aux.weight"].group) == (MUON, "hidden")
    assert got["cls.weight"].rule is Rule.FIRST_BATCH
    assert merged == GraphRoles.from_dict(merged.to_dict())
    assert merged.merge(later) is merged  # nothing left to reach


def test_a_branch_computed_but_left_out_of_the_loss_is_not_reached():
    model = seeded(TwoTasks)

    def loss(b):
        h = torch.tanh(model.trunk(b))
        model.head_reg(torch.tanh(model.aux(h)))  # computed (logged, say), not trained this step
        return model.cls(h).logsumexp(-1).mean()

    found = trace_roles(model, torch.randn(4, 8), loss)
    assert "aux.weight" in found.seen and found.role("aux.weight") is None
    assert found.unreached == {"aux.weight", "aux.bias", "head_reg.weight", "head_reg.bias"}


def test_ranks_combine_what_each_reached_and_name_what_they_saw_differently():
    model = seeded(TwoTasks)
    x = torch.randn(4, 8)
    a, b = (trace_roles(model, x, lambda batch, t=t: model(batch, t)) for t in "ab")
    both, conflicts = GraphRoles.combined([a, b])
    assert conflicts == [] and both.unreached == frozenset()
    assert both.heads == {"cls.weight", "head_reg.weight"} and both.role("aux.weight") == "hidden"
    assert GraphRoles.combined([a, a]) == (a, [])
    swapped = GraphRoles(seen=b.seen, heads=frozenset({"aux.weight"}), inputs=b.inputs, unreached=b.unreached)
    assert GraphRoles.combined([b, swapped])[1] == ["aux.weight", "head_reg.weight"]


@pytest.mark.parametrize("saved", [{}, {"seen": ["x"], "heads": ["x"], "inputs": None, "note": ""}])
def test_roles_saved_before_uses_and_reach_were_recorded_take_everything_as_reached(saved):
    roles = GraphRoles.from_dict(saved)
    assert roles.unreached is None and roles.elementwise == {} and roles.late == frozenset()
