"""Routing: the exact group of every parameter on real model shapes, and the errors."""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch.demos import Transformer
from torch import nn

from lightning_muon.routing import ADAMW, MUON, find_output_heads, route_parameters


class Block(nn.Module):
    """A nanoGPT-style block: pre-norm attention projections and an MLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, layers: int = 2, tie: bool = True, head_first: bool = False):
        super().__init__()
        if head_first:  # the head registered before the embedding, as litgpt does
            self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, d),
                "wpe": nn.Embedding(8, d),
                "h": nn.ModuleList([Block(d) for _ in range(layers)]),
                "ln_f": nn.LayerNorm(d),
            }
        )
        if not head_first:
            self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.transformer.wte.weight


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, (3, 5), padding=(1, 2)),
            nn.GroupNorm(4, 16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.1), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))


def groups_of(routing) -> dict[str, tuple[str, str]]:
    return {r.name: (r.optimizer, r.group) for r in routing.routes}


def block_expectations(prefix: str) -> dict[str, tuple[str, str]]:
    expected = {}
    for layer in ("c_attn", "c_proj", "c_fc", "mlp_proj"):
        expected[f"{prefix}.{layer}.weight"] = (MUON, "hidden")
        expected[f"{prefix}.{layer}.bias"] = (ADAMW, "norms_and_biases")
    for norm in ("ln_1", "ln_2"):
        expected[f"{prefix}.{norm}.weight"] = (ADAMW, "norms_and_biases")
        expected[f"{prefix}.{norm}.bias"] = (ADAMW, "norms_and_biases")
    return expected


def test_nanogpt_tied_head_goes_to_adamw_once():
    model = NanoGPT(tie=True)
    routing = route_parameters(model)
    expected = {
        "transformer.wte.weight": (ADAMW, "embeddings"),
        "transformer.wpe.weight": (ADAMW, "embeddings"),
        "transformer.ln_f.weight": (ADAMW, "norms_and_biases"),
        "transformer.ln_f.bias": (ADAMW, "norms_and_biases"),
        **block_expectations("transformer.h.0"),
        **block_expectations("transformer.h.1"),
    }
    assert groups_of(routing) == expected  # the tied head appears once, under the embedding
    assert [g["name"] for g in routing.muon_groups] == ["hidden"]
    assert [g["name"] for g in routing.adamw_groups] == ["embeddings", "norms_and_biases"]


def test_nanogpt_tied_head_registered_first_is_routed_as_tied():
    model = NanoGPT(tie=True, head_first=True)
    routing = route_parameters(model)
    route = next(r for r in routing.routes if r.name == "lm_head.weight")
    assert (route.optimizer, route.group) == (ADAMW, "embeddings")
    assert route.reason == "tied to embedding `transformer.wte.weight`"
    assert "transformer.wte.weight" not in groups_of(routing)


@pytest.mark.parametrize("head_first", [False, True])
def test_nanogpt_untied_head(head_first):
    routing = route_parameters(NanoGPT(tie=False, head_first=head_first))
    assert groups_of(routing)["lm_head.weight"] == (ADAMW, "head")
    assert find_output_heads(NanoGPT(tie=False, head_first=head_first)) == ["lm_head"]


def test_lightning_demo_transformer():
    model = Transformer(vocab_size=100, ninp=32, nhead=2, nhid=64, nlayers=2)
    routing = route_parameters(model)
    got = groups_of(routing)
    # The top-level `decoder` Linear is the head; the `transformer.decoder` stack is hidden.
    assert find_output_heads(model) == ["decoder"]
    assert got["decoder.weight"] == (ADAMW, "head")
    assert got["decoder.bias"] == (ADAMW, "head")
    assert got["embedding.weight"] == (ADAMW, "embeddings")
    for name, p in model.named_parameters():
        if name.startswith("transformer."):
            is_norm = ".norm" in name
            expected = (MUON, "hidden") if p.ndim == 2 and not is_norm else (ADAMW, "norms_and_biases")
            assert got[name] == expected, name
    assert sum(r.optimizer == MUON for r in routing.routes) == 20  # 2x4 encoder + 2x6 decoder matrices


def test_small_cnn_conv_kernels_on_muon_classifier_head_on_adamw():
    routing = route_parameters(SmallCNN())
    assert groups_of(routing) == {
        "features.0.weight": (ADAMW, "input"),  # Conv2d(1, 8): reads the raw input
        "features.0.bias": (ADAMW, "norms_and_biases"),
        "features.1.weight": (ADAMW, "norms_and_biases"),
        "features.1.bias": (ADAMW, "norms_and_biases"),
        "features.3.weight": (MUON, "hidden"),
        "features.3.bias": (ADAMW, "norms_and_biases"),
        "features.4.weight": (ADAMW, "norms_and_biases"),
        "features.4.bias": (ADAMW, "norms_and_biases"),
        "classifier.1.weight": (MUON, "hidden"),
        "classifier.1.bias": (ADAMW, "norms_and_biases"),
        "classifier.3.weight": (ADAMW, "head"),
        "classifier.3.bias": (ADAMW, "head"),
    }
    reason = next(r.reason for r in routing.routes if r.name == "features.3.weight")
    assert reason == "4D kernel, orthogonalised as 16x120"


def test_two_d_only_muon_sends_kernels_to_adamw():
    routing = route_parameters(SmallCNN(), muon_nd=False)
    got = groups_of(routing)
    assert got["features.0.weight"] == (ADAMW, "input")
    assert got["features.3.weight"] == (ADAMW, "other")
    assert got["classifier.1.weight"] == (MUON, "hidden")


def test_user_patterns_take_precedence():
    model = SmallCNN()
    routing = route_parameters(model, adamw_params=["features.0.*"], muon_params=["classifier.3.weight"])
    got = groups_of(routing)
    assert got["features.0.weight"] == (ADAMW, "input")
    assert got["features.0.bias"] == (ADAMW, "norms_and_biases")
    assert got["classifier.3.weight"] == (MUON, "hidden")
    reasons = {r.name: r.reason for r in routing.routes}
    assert reasons["classifier.3.weight"] == "matches muon_params 'classifier.3.weight'"


def test_frozen_parameters_go_nowhere_and_every_trainable_lands_once():
    model = NanoGPT(tie=False)
    model.transformer.h[0].c_attn.weight.requires_grad_(False)
    routing = route_parameters(model)
    names = [name for group in routing.muon_groups + routing.adamw_groups for name, _ in group["params"]]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(names) == sorted(trainable)
    assert len(names) == len(set(names))
    assert "transformer.h.0.c_attn.weight" not in names


def test_groups_feed_torch_optimizers_with_names():
    model = NanoGPT(tie=False)
    routing = route_parameters(model)
    muon = torch.optim.Muon(routing.muon_groups, lr=0.02)
    adamw = torch.optim.AdamW(routing.adamw_groups, lr=1e-3)
    assert [g["name"] for g in adamw.param_groups] == ["embeddings", "head", "norms_and_biases"]
    assert muon.param_groups[0]["param_names"] == routing.names(MUON)
    assert adamw.state_dict()["param_groups"][1]["param_names"] == ["lm_head.weight"]


def test_table_renders_every_parameter_and_totals():
    model = NanoGPT(tie=False)
    routing = route_parameters(model)
    text = routing.render(effective_lr=lambda r: 0.02 if r.optimizer == MUON else None)
    for name, _ in model.named_parameters():
        assert name in text
    assert "Muon: 8 tensors, 6,144 parameters" in text
    assert "0.02" in text


ERRORS = [
    ({"muon_params": ["nothing.*"]}, ValueError, r"muon_params pattern 'nothing\.\*' matches no trainable parameter"),
    ({"adamw_params": ["*.nope"]}, ValueError, r"adamw_params pattern '\*\.nope' matches no trainable parameter"),
    ({"muon_params": "features.*"}, ValueError, r"must be a list of glob patterns"),
    ({"muon_params": ["features.0.bias"]}, ValueError, r"matches `features.0.bias` of shape \(8,\).*at least 2"),
    ({"muon_params": ["features.0.weight"], "muon_nd": False}, ValueError, r"2D-only"),
    (
        {"muon_params": ["classifier.*.weight"], "adamw_params": ["classifier.3.*"]},
        ValueError,
        r"`classifier.3.weight` matches muon_params pattern 'classifier\.\*\.weight' and adamw_params",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "pattern"), ERRORS)
def test_routing_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        route_parameters(SmallCNN(), **kwargs)


def test_unmatched_pattern_error_shows_real_names():
    with pytest.raises(ValueError) as info:
        route_parameters(SmallCNN(), adamw_params=["stem.*"])
    assert re.search(r"such as: features\.0\.weight", str(info.value))


def test_a_class_merely_named_like_a_norm_is_not_a_norm_layer():
    class NormalizedLinear(nn.Linear):
        pass

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = NormalizedLinear(8, 8)
            self.rms = type("RMSNorm", (nn.Module,), {})()
            self.rms.weight = nn.Parameter(torch.ones(8, 8))  # a 2D weight, still a norm's
            self.head = nn.Linear(8, 2)

    got = groups_of(route_parameters(Model()))
    assert got["proj.weight"] == (MUON, "hidden")
    assert got["rms.weight"] == (ADAMW, "norms_and_biases")
