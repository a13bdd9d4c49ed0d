"""Routing on real model families: every parameter that matters lands on the optimizer and group the rules say.

`test_routing.py` pins the rules on hand-written toy models; this module pins them on the models people really
train, built from tiny configs with random (seeded) weights and never downloaded: transformers' GPT-2 (``Conv1D``
weights stored ``in x out``), Llama (tied and untied), BERT (masked LM, sequence classification, pre-training with
two heads), ViT (token and position tables as bare parameters, the patch embedding as input layer), ResNet (the
stem conv as input layer), Mixtral (stacked expert matrices, each orthogonalised on its own); litgpt's GPT; plain
torch attention, LSTM and GRU models; lazy modules; a model built in ``configure_model``; ``muon=None``. A few short
real fits check that such models train under `MuonMixin`.

Groups: Muon has ``hidden``; AdamW has ``embeddings``, ``input``, ``head``, ``norms_and_biases``, ``other``.
"""

from __future__ import annotations

import functools
import math
import re

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    ResNetConfig,
    ResNetForImageClassification,
    ViTConfig,
    ViTForImageClassification,
)

from lightning_muon import Muon, MuonMixin
from lightning_muon.commands.cli import main
from lightning_muon.routing import ADAMW, MUON, Route, route_parameters

from helpers import make_trainer

GROUP_ORDER = {MUON: ["hidden"], ADAMW: ["adapters", "embeddings", "input", "head", "norms_and_biases", "other"]}
VOCAB, WIDTH, SEQ = 64, 32, 16
LR = 0.02

# ------------------------------------------------------------------ tiny shared batches and models

_g = torch.Generator().manual_seed(0)
TOKENS = torch.randint(0, VOCAB, (4, SEQ), generator=_g)  # 4 sequences of 16 tokens
IMAGES = torch.randn(4, 3, 16, 16, generator=_g)  # 4 RGB images 16x16
LABELS = torch.randint(0, 3, (4,), generator=_g)  # 3 classes


def seeded(build, *args, **kwargs):
    torch.manual_seed(0)
    return build(*args, **kwargs)


def gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=1, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return seeded(GPT2LMHeadModel, config)


def llama(tie: bool) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=tie)
    return seeded(LlamaForCausalLM, config)


def bert_config(**kwargs) -> BertConfig:
    # hidden_size == max_position_embeddings on purpose: a Linear with 32 outputs must not look like a head
    # because the position table has 32 rows.
    return BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=4,
                      intermediate_size=48, max_position_embeddings=WIDTH, **kwargs)


def vit() -> ViTForImageClassification:
    config = ViTConfig(hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                       image_size=16, patch_size=4, num_channels=3, num_labels=3)
    return seeded(ViTForImageClassification, config)


def resnet() -> ResNetForImageClassification:
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    return seeded(ResNetForImageClassification, config)


def mixtral() -> MixtralForCausalLM:
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=SEQ)
    return seeded(MixtralForCausalLM, config)


# ------------------------------------------------------------------ assertions


def route(model: nn.Module, **kwargs) -> dict[str, Route]:
    """Every route by name, after checking what holds for every model: each trainable parameter (each tensor,
    tied ones once) lands in exactly one group, and the groups come in the documented order."""
    routing = route_parameters(model, **kwargs)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    grouped = [name for g in routing.muon_groups + routing.adamw_groups for name, _ in g["params"]]
    assert sorted(grouped) == sorted(trainable)
    assert len(grouped) == len(set(grouped))
    for optimizer, groups in ((MUON, routing.muon_groups), (ADAMW, routing.adamw_groups)):
        names = [g["name"] for g in groups]
        assert names == [n for n in GROUP_ORDER[optimizer] if n in names], names
    routes = {r.name: r for r in routing.routes}
    assert sorted(routes) == sorted(trainable)
    return routes


def assert_routes(routes: dict[str, Route], expected: dict[str, tuple[str, str]]) -> None:
    got = {name: (routes[name].optimizer, routes[name].group) for name in expected if name in routes}
    missing = sorted(set(expected) - set(routes))
    assert not missing, f"not routed: {missing}"
    wrong = {name: (got[name], want) for name, want in expected.items() if got[name] != want}
    assert not wrong, f"(got, expected): {wrong}"


def hidden(*names: str) -> dict[str, tuple[str, str]]:
    return dict.fromkeys(names, (MUON, "hidden"))


def adamw(group: str, *names: str) -> dict[str, tuple[str, str]]:
    return dict.fromkeys(names, (ADAMW, group))


def rest_on_adamw_norms_and_biases(routes: dict[str, Route], model: nn.Module, exclude: set[str] = frozenset()):
    """Every 1D parameter not in ``exclude`` (biases, norm weights) goes to AdamW ``norms_and_biases``."""
    one_d = [n for n, p in model.named_parameters() if p.ndim == 1 and n not in exclude]
    assert one_d
    assert_routes(routes, adamw("norms_and_biases", *one_d))


def muon_layouts(model: nn.Module, **kwargs) -> dict[str, str]:
    """``matrix_layouts`` of the Muon groups `route_parameters` builds, by parameter name (a group without the key
    is all ``"flatten"``, the default)."""
    layouts = {}
    for group in route_parameters(model, **kwargs).muon_groups:
        names = [name for name, _ in group["params"]]
        group_layouts = group.get("matrix_layouts", ["flatten"] * len(names))
        assert len(group_layouts) == len(names)
        layouts.update(zip(names, group_layouts))
    return layouts


def muon_for(model: nn.Module, **kwargs) -> tuple[Muon, dict[str, torch.Tensor]]:
    routing = route_parameters(model)
    return Muon(routing.muon_groups, lr=LR, **kwargs), dict(model.named_parameters())


# ------------------------------------------------------------------ transformers language models

GPT2_CONV1D = ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
               "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight")


def test_gpt2_conv1d_in_x_out_on_muon_tied_head_once():
    model = gpt2()
    routes = route(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" not in routes  # the tied head is the embedding, routed once
    assert_routes(routes, {
        **adamw("embeddings", "transformer.wte.weight", "transformer.wpe.weight"),
        **hidden(*GPT2_CONV1D),
    })
    rest_on_adamw_norms_and_biases(routes, model)
    for name in GPT2_CONV1D:
        assert "in x out" in routes[name].reason, (name, routes[name].reason)
    assert muon_layouts(model) == dict.fromkeys(GPT2_CONV1D, "in_out")  # every Muon matrix is a Conv1D weight


def test_gpt2_conv1d_effective_lr_reads_the_real_fan_out_and_fan_in():
    model = gpt2()
    opt, params = muon_for(model)
    lrs = {name: opt.effective_lr(params[name]) for name in GPT2_CONV1D}
    assert lrs == pytest.approx({
        # 32 -> 96, stored (32, 96): split by default into q, k, v, each lr-scaled as a 32 -> 32 layer
        "transformer.h.0.attn.c_attn.weight": LR,
        "transformer.h.0.attn.c_proj.weight": LR,  # 32 -> 32
        "transformer.h.0.mlp.c_fc.weight": 0.04,  # 32 -> 128, stored (32, 128)
        "transformer.h.0.mlp.c_proj.weight": 0.02,  # 128 -> 32, stored (128, 32)
    })


LLAMA_MATRICES = tuple(f"model.layers.0.{m}.weight" for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llama_embeddings_head_and_projections(tie):
    model = llama(tie)
    routes = route(model)
    expected = {
        **adamw("embeddings", "model.embed_tokens.weight"),
        **hidden(*LLAMA_MATRICES),
        **adamw("norms_and_biases", "model.norm.weight", "model.layers.0.input_layernorm.weight",
                "model.layers.0.post_attention_layernorm.weight"),
    }
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in routes
    else:
        expected["lm_head.weight"] = (ADAMW, "head")
        assert routes["lm_head.weight"].reason.startswith("output head"), routes["lm_head.weight"].reason
    assert_routes(routes, expected)
    assert len(routes) == len(expected)


BERT_ENCODER = tuple(f"bert.encoder.layer.0.{m}.weight" for m in (
    "attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
    "intermediate.dense", "output.dense",  # `output` modules hold hidden matrices, not heads
))
BERT_EMBEDDINGS = ("bert.embeddings.word_embeddings.weight", "bert.embeddings.position_embeddings.weight",
                   "bert.embeddings.token_type_embeddings.weight")


def test_bert_masked_lm_decoder_tied_to_word_embeddings():
    model = seeded(BertForMaskedLM, bert_config())
    routes = route(model)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert "cls.predictions.decoder.weight" not in routes  # routed once, as the word embedding
    assert_routes(routes, {
        **adamw("embeddings", *BERT_EMBEDDINGS),
        **hidden(*BERT_ENCODER, "cls.predictions.transform.dense.weight"),
        **adamw("head", "cls.predictions.bias"),  # the decoder's bias
    })
    rest_on_adamw_norms_and_biases(routes, model, exclude={"cls.predictions.bias"})


def test_bert_sequence_classification_head_is_the_classifier_not_the_pooler():
    model = seeded(BertForSequenceClassification, bert_config(num_labels=3))
    routes = route(model)
    assert_routes(routes, {
        **adamw("embeddings", *BERT_EMBEDDINGS),
        **hidden(*BERT_ENCODER, "bert.pooler.dense.weight"),
        **adamw("head", "classifier.weight", "classifier.bias"),
    })
    assert routes["classifier.weight"].reason.startswith("output head"), routes["classifier.weight"].reason
    rest_on_adamw_norms_and_biases(routes, model, exclude={"classifier.bias"})


def test_bert_pretraining_two_heads():
    model = seeded(BertForPreTraining, bert_config())
    routes = route(model)
    assert "cls.predictions.decoder.weight" not in routes
    assert_routes(routes, {
        **adamw("embeddings", *BERT_EMBEDDINGS),
        **hidden(*BERT_ENCODER, "bert.pooler.dense.weight", "cls.predictions.transform.dense.weight"),
        **adamw("head", "cls.seq_relationship.weight", "cls.seq_relationship.bias", "cls.predictions.bias"),
    })
    assert routes["cls.seq_relationship.weight"].reason.startswith("output head")


# ------------------------------------------------------------------ transformers vision models

VIT_MATRICES = tuple(f"vit.layers.0.{m}.weight" for m in (
    "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj", "mlp.fc1", "mlp.fc2",
))


def test_vit_tables_input_layer_and_classifier():
    model = vit()
    routes = route(model)
    assert_routes(routes, {
        **adamw("embeddings", "vit.embeddings.cls_token", "vit.embeddings.position_embeddings"),
        **adamw("input", "vit.embeddings.patch_embeddings.projection.weight"),
        **adamw("head", "classifier.weight", "classifier.bias"),
        **hidden(*VIT_MATRICES),
    })
    for name in ("vit.embeddings.cls_token", "vit.embeddings.position_embeddings"):
        assert routes[name].reason.startswith("token or position table"), routes[name].reason
    assert "input layer" in routes["vit.embeddings.patch_embeddings.projection.weight"].reason
    assert routes["classifier.weight"].reason.startswith("output head")
    assert routes["vit.embeddings.patch_embeddings.projection.bias"].optimizer == ADAMW
    rest_on_adamw_norms_and_biases(
        routes, model, exclude={"classifier.bias", "vit.embeddings.patch_embeddings.projection.bias"}
    )


RESNET_STEM = "resnet.embedder.embedder.convolution.weight"


def test_resnet_stem_is_the_input_layer_other_convs_hidden():
    model = resnet()
    routes = route(model)
    convs = [n for n, p in model.named_parameters() if p.ndim == 4 and n != RESNET_STEM]
    assert len(convs) == 7  # 3 per bottleneck, and stage 1's shortcut
    assert_routes(routes, {
        **adamw("input", RESNET_STEM),
        **hidden(*convs),
        **adamw("head", "classifier.1.weight", "classifier.1.bias"),
    })
    assert "input layer" in routes[RESNET_STEM].reason
    for name in convs:
        shape = routes[name].shape
        assert routes[name].reason == f"4D kernel, orthogonalised as {shape[0]}x{math.prod(shape[1:])}"
    rest_on_adamw_norms_and_biases(routes, model, exclude={"classifier.1.bias"})  # BatchNorm weights and biases
    assert set(muon_layouts(model).values()) == {"flatten"}


def test_resnet_stem_forced_onto_muon():
    routes = route(resnet(), muon_params=[RESNET_STEM])
    assert (routes[RESNET_STEM].optimizer, routes[RESNET_STEM].group) == (MUON, "hidden")
    assert "muon_params" in routes[RESNET_STEM].reason


# ------------------------------------------------------------------ Mixtral: stacks of expert matrices

EXPERTS = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")


def test_mixtral_expert_stacks_routed_as_stacks():
    model = mixtral()
    routes = route(model)
    assert [routes[n].shape for n in EXPERTS] == [(4, 32, 32), (4, 32, 16)]
    assert_routes(routes, {
        **hidden(*EXPERTS, *(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo")),
        **adamw("embeddings", "model.embed_tokens.weight"),
        **adamw("head", "lm_head.weight"),
    })
    for name in EXPERTS:
        assert "each orthogonalised" in routes[name].reason, routes[name].reason
    assert "4 stacked matrices 32x32" in routes[EXPERTS[0]].reason
    layouts = muon_layouts(model)
    assert [layouts[n] for n in EXPERTS] == ["stack", "stack"]


def conditioned(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random matrices with singular values in [1, 3]: Newton-Schulz maps each of them into its band.

    (A square Gaussian matrix has near-zero singular values that five quintic steps leave far below 0.5 even
    when each matrix is orthogonalised on its own, so a plain ``randn`` gradient cannot tell the two apart.)
    """
    *batch, m, n = shape
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(*batch, m, k, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(*batch, n, k, generator=generator))
    s = 1 + 2 * torch.rand(*batch, k, generator=generator)
    return u @ torch.diag_embed(s) @ v.mT


def test_mixtral_each_expert_matrix_orthogonalised_on_its_own():
    model = mixtral()
    opt, params = muon_for(model, weight_decay=0.0, momentum=0.0, nesterov=False, ns_dtype=torch.float32)
    assert opt.effective_lr(params[EXPERTS[0]]) == pytest.approx(LR)  # 32x32
    assert opt.effective_lr(params[EXPERTS[1]]) == pytest.approx(LR * math.sqrt(2))  # 32x16 each
    g = torch.Generator().manual_seed(1)
    for name in EXPERTS:
        params[name].grad = conditioned(tuple(params[name].shape), g)
    before = {name: params[name].detach().clone() for name in EXPERTS}
    opt.step()
    for name in EXPERTS:
        update = (before[name] - params[name].detach()) / opt.effective_lr(params[name])
        for e in range(update.shape[0]):
            sv = torch.linalg.svdvals(update[e])
            assert 0.5 <= sv.min() and sv.max() <= 1.3, (name, e, sv.min().item(), sv.max().item())


# ------------------------------------------------------------------ litgpt


def test_litgpt_gpt():
    from litgpt import GPT, Config

    model = seeded(GPT, Config(n_layer=1, n_head=4, n_embd=WIDTH, block_size=SEQ, vocab_size=VOCAB,
                               padded_vocab_size=VOCAB))
    routes = route(model)
    assert_routes(routes, {
        **adamw("embeddings", "transformer.wte.weight"),
        **adamw("head", "lm_head.weight"),
        **hidden(*(f"transformer.h.0.{m}.weight" for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))),
    })
    assert routes["lm_head.weight"].reason.startswith("output head")
    rest_on_adamw_norms_and_biases(routes, model)


# ------------------------------------------------------------------ plain torch: attention, recurrent, lazy


class AttentionClassifier(nn.Module):
    """The classifier registered first, then an input Linear, then attention (whose out_proj is a Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(WIDTH, 3)
        self.proj_in = nn.Linear(8, WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x)
        h, _ = self.attn(h, h, h)
        return self.classifier(h.mean(dim=1))


def test_attention_out_proj_is_never_the_head():
    model = seeded(AttentionClassifier)
    routes = route(model)
    assert_routes(routes, {
        **adamw("head", "classifier.weight", "classifier.bias"),
        **hidden("attn.in_proj_weight", "attn.out_proj.weight", "proj_in.weight"),
        **adamw("norms_and_biases", "attn.in_proj_bias", "attn.out_proj.bias", "proj_in.bias"),
    })
    assert routes["classifier.weight"].reason.startswith("output head")


class RecurrentLM(nn.Module):
    def __init__(self, rnn: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.rnn = rnn(WIDTH, WIDTH, batch_first=True)
        self.fc = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(self.embedding(tokens))[0])


@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
def test_recurrent_weights_on_muon(rnn):
    model = seeded(RecurrentLM, rnn)
    routes = route(model)
    assert_routes(routes, {
        **adamw("embeddings", "embedding.weight"),
        **hidden("rnn.weight_ih_l0", "rnn.weight_hh_l0"),
        **adamw("norms_and_biases", "rnn.bias_ih_l0", "rnn.bias_hh_l0"),
        **adamw("head", "fc.weight", "fc.bias"),
    })
    assert len(routes) == 7


def test_unmaterialised_lazy_module_is_a_clear_error():
    model = nn.Sequential(nn.LazyLinear(WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    with pytest.raises(ValueError) as info:
        route_parameters(model)
    message = str(info.value)
    assert re.search(r"uninitiali[sz]ed|not initiali[sz]ed", message, re.IGNORECASE), message
    assert "forward" in message, message  # how to fix it
    assert "Can't access the shape" not in message


class RegressionBase(L.LightningModule):
    """A tiny regression: 8 inputs, one output; 12 fixed samples in batches of 4."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=4)


class LazyInInit(RegressionBase):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                 nn.Linear(WIDTH, 1))
        self.net(torch.zeros(1, 8))  # materialise with an example batch


class LazyInSetup(RegressionBase):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                 nn.Linear(WIDTH, 1))

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.net(torch.zeros(1, 8))


class MuonLazyInInit(MuonMixin, LazyInInit):
    pass


class MuonLazyInSetup(MuonMixin, LazyInSetup):
    pass


@pytest.mark.parametrize("cls", [MuonLazyInInit, MuonLazyInSetup], ids=["init", "setup"])
def test_materialised_lazy_module_fits(tmp_path, cls):
    model = seeded(cls)
    trainer = make_trainer(tmp_path, max_steps=3)
    trainer.fit(model)
    assert trainer.global_step == 3
    assert model.net[0].weight.shape == (WIDTH, 8)
    routes = {r.name: r for r in model.muon_routing().routes}
    # the lazy first layer, materialised, is found reading the batch: the input layer
    assert (routes["net.0.weight"].group, routes["net.2.weight"].optimizer) == ("input", MUON)


# ------------------------------------------------------------------ a model built in configure_model


class BuiltInConfigureModel(RegressionBase):
    def __init__(self) -> None:
        super().__init__()
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                     nn.Linear(WIDTH, 1))


class MuonBuiltInConfigureModel(MuonMixin, BuiltInConfigureModel):
    pass


def table_rows(out: str) -> dict[str, list[str]]:
    """The rows of a printed routing table, by parameter name: shape, optimizer, group, reason, lr."""
    return {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]] for line in out.splitlines()
            if line.startswith("│") and "." in line.split("│")[1]}


def test_inspect_a_model_built_in_configure_model(tmp_path, capsys):
    main(["inspect", "--model", "test_routing_models.MuonBuiltInConfigureModel", "--trainer.logger=false",
          f"--trainer.default_root_dir={tmp_path}"])
    rows = table_rows(capsys.readouterr().out)
    assert sorted(rows) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight", "net.4.bias", "net.4.weight"]
    assert rows["net.2.weight"][1:3] == ["Muon", "hidden"]
    assert rows["net.4.weight"][1:3] == ["AdamW", "head"]


# ------------------------------------------------------------------ short real fits under MuonMixin


class GPT2Wrapper(L.LightningModule):
    """GPT-2 trained on one fixed batch of tokens, repeated."""

    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        return DataLoader(TensorDataset(TOKENS.repeat(10, 1)), batch_size=len(TOKENS))


class ViTWrapper(L.LightningModule):
    """ViT trained on one fixed batch of images, repeated."""

    def __init__(self) -> None:
        super().__init__()
        self.model = vit()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = self.model(pixel_values=images, labels=labels).loss
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        return DataLoader(TensorDataset(IMAGES.repeat(10, 1, 1, 1), LABELS.repeat(10)), batch_size=len(IMAGES))


class MuonGPT2(MuonMixin, GPT2Wrapper):
    pass


class MuonViT(MuonMixin, ViTWrapper):
    pass


@pytest.mark.parametrize("cls", [MuonGPT2, MuonViT], ids=["gpt2", "vit"])
def test_short_fit_lowers_the_loss(tmp_path, cls):
    model = cls()
    trainer = make_trainer(tmp_path, max_steps=10)
    trainer.fit(model)
    assert trainer.global_step == 10
    assert len(model.losses) == 10
    assert model.losses[-1] < model.losses[0], model.losses


def test_mixin_effective_lrs_for_gpt2_conv1d():
    lrs = MuonGPT2().muon_effective_lrs()
    assert lrs["model.transformer.h.0.mlp.c_fc.weight"] == pytest.approx(0.04)
    assert lrs["model.transformer.h.0.mlp.c_proj.weight"] == pytest.approx(0.02)


# ------------------------------------------------------------------ muon=None and torch.optim.Muon


class SmallConvNet(L.LightningModule):
    """A stem conv on 1 channel (the raw input), a hidden conv, a hidden Linear and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.stem(images).relu()).relu().mean(dim=(2, 3))
        return self.head(self.fc(h).relu())

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)


class MuonSmallConvNet(MuonMixin, SmallConvNet):
    pass


def test_muon_none_routes_everything_to_adamw():
    model = MuonSmallConvNet(muon=None)
    routing = model.muon_routing()
    assert len(routing.routes) == 8
    assert {r.optimizer for r in routing.routes} == {ADAMW}
    text = routing.render()
    rows = table_rows(text)
    assert sorted(rows) == sorted(n for n, _ in model.named_parameters())
    assert {row[1] for row in rows.values()} == {"AdamW"}
    assert "Muon: 0 tensors, 0 parameters" in text


def test_torch_muon_sends_kernels_to_adamw():
    model = MuonSmallConvNet(muon=functools.partial(torch.optim.Muon, lr=LR))
    routes = {r.name: r for r in model.muon_routing().routes}
    got = {name: (r.optimizer, r.group) for name, r in routes.items() if name.endswith("weight")}
    assert got == {
        "stem.weight": (ADAMW, "input"),
        "conv.weight": (ADAMW, "other"),
        "fc.weight": (MUON, "hidden"),
        "head.weight": (ADAMW, "head"),
    }
    ours = {r.name: (r.optimizer, r.group) for r in MuonSmallConvNet().muon_routing().routes}
    assert ours["conv.weight"] == (MUON, "hidden")
