"""Which rule decided each route (`Route.rule`, shown in the table), and the one name of each algorithm
(`Algorithm`: the value tables and checkpoints use, the key `MuonWithAdamW`'s groups use)."""

from __future__ import annotations

import pickle
import re

import torch
from test_routing import NanoGPT
from torch import nn

from lightning_muon.routing import ADAMW, MUON, Algorithm, Rule, route_parameters, trace_roles


class HeadNamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.mix = nn.Linear(4, 4)
        self.classifier = nn.Linear(4, 2)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 4))

    def forward(self, x):
        h = self.stem(x).mean((2, 3)) + self.cls_token[0, 0]
        return self.classifier(torch.tanh(self.mix(h)))


class HeadDeclared(nn.Module):
    """A head the model names itself (timm's ``get_classifier``), under a name no rule knows."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4)
        self.fc_out = nn.Linear(4, 2)
        self.last = nn.Linear(2, 2)

    def get_classifier(self) -> nn.Module:
        return self.fc_out


def rules(routing) -> dict[str, Rule]:
    return {r.name: r.rule for r in routing.routes}


def test_every_route_names_the_rule_that_decided():
    tied = rules(route_parameters(NanoGPT(tie=True, head_first=True), muon_params=["transformer.h.0.c_fc.weight"]))
    assert tied["lm_head.weight"] is Rule.TIE
    assert tied["transformer.wpe.weight"] is Rule.MODULE_TYPE
    assert tied["transformer.h.0.ln_1.weight"] is Rule.MODULE_TYPE
    assert tied["transformer.h.0.c_fc.weight"] is Rule.PATTERN
    assert tied["transformer.h.0.c_attn.weight"] is Rule.SHAPE
    assert tied["transformer.h.0.c_attn.bias"] is Rule.SHAPE

    named = rules(route_parameters(HeadNamed()))
    assert (named["classifier.weight"], named["classifier.bias"]) == (Rule.NAME, Rule.NAME)
    assert named["stem.weight"] is Rule.STRUCTURE  # a first conv on 3 channels: the input layer
    assert named["cls_token"] is Rule.NAME  # a table by its name

    declared = rules(route_parameters(HeadDeclared()))
    assert declared["fc_out.weight"] is Rule.CONVENTION
    assert declared["last.weight"] is Rule.SHAPE  # not the head: the model said which one is

    structural = rules(route_parameters(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))))
    assert structural["2.weight"] is Rule.STRUCTURE


def test_the_first_batch_rule_and_the_table():
    model = HeadNamed()
    graph = trace_roles(model, torch.randn(2, 3, 5, 5), lambda x: model(x).square().mean())
    routing = route_parameters(model, graph=graph)
    routes = {r.name: r for r in routing.routes}
    assert routes["classifier.weight"].rule is Rule.FIRST_BATCH
    assert routes["classifier.bias"].rule is Rule.FIRST_BATCH
    assert routes["mix.weight"].rule is Rule.SHAPE  # hidden, as the structural rules had it too
    rows = {line.split()[0]: line for line in routing.plain_table().splitlines() if line.strip()}
    assert re.search(r" hidden matrix +shape$", rows["mix.weight"])  # the rule, in its own column
    assert re.search(r" output head: feeds the loss through no other matrix \(first batch\) +first batch$",
                     rows["classifier.weight"])
    assert "Output heads and input layers: from the first batch's computation." in routing.plain_table()
    wide = max(map(len, routing.plain_table().splitlines()))
    narrow = routing.plain_table(width=wide - 20).splitlines()  # 20 columns fewer: the reasons wrap
    assert max(map(len, narrow)) <= wide - 20
    head = next(i for i, line in enumerate(narrow) if line.startswith("classifier.weight "))
    assert narrow[head].endswith("first batch")  # the rule stays on the row's first line
    continued = [narrow[head]]
    for line in narrow[head + 1:]:
        if not line.startswith(" "):
            break
        continued.append(line)
    assert len(continued) > 1  # the reason wrapped onto the lines under it, and nothing of it was lost
    reason_at = narrow[1].index("reason")
    words = " ".join(line[reason_at:].removesuffix("first batch") for line in continued).split()
    assert " ".join(words) == "output head: feeds the loss through no other matrix (first batch)"


def test_one_name_per_algorithm():
    assert (Algorithm.MUON, Algorithm.ADAMW) == (MUON, ADAMW) == ("Muon", "AdamW")
    assert [a.key for a in Algorithm] == ["muon", "adamw"]
    assert Algorithm.from_key("adamw") is Algorithm.ADAMW and Algorithm("Muon") is Algorithm.MUON
    assert f"{Algorithm.MUON}: {Algorithm.ADAMW!s}" == "Muon: AdamW"
    saved = pickle.loads(pickle.dumps({"Muon": ["a"], "AdamW": ["b"]}))  # a checkpoint's routing record
    assert saved[Algorithm.MUON] == ["a"] and saved[Algorithm.ADAMW] == ["b"]
    assert type(MUON) is str  # what checkpoints are keyed by: weights_only loading refuses unknown classes
