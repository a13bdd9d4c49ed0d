"""The first batch's roles (`lightning_muon.routing.trace_roles`): output heads and input layers found from the
computation itself, on small torch.nn models that name nothing, and on models with known conventions
(transformers, litgpt), where the trace must agree with what those conventions say."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_routing_models import IMAGES, LABELS, TOKENS, bert_config, gpt2, llama, mixtral, resnet, seeded, vit
from torch import nn

from lightning_muon.routing import ADAMW, MUON, GraphRoles, route_parameters, trace_roles


def roles(model: nn.Module, batch, loss_of) -> GraphRoles:
    return trace_roles(model, batch, loss_of)


# ------------------------------------------------------------------ small models that name nothing


class Prescaled(nn.Module):
    """pytorch-forecasting's shape: one Linear(1, n) per raw variable, then hidden layers, two parallel heads."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.ModuleList([nn.Linear(1, 8) for _ in range(3)])
        self.mix = nn.Linear(24, 16)
        self.out = nn.ModuleList([nn.Linear(16, 1) for _ in range(2)])

    def forward(self, x):
        h = torch.relu(self.mix(torch.cat([s(x[:, i : i + 1]) for i, s in enumerate(self.scale)], -1)))
        return torch.cat([o(h) for o in self.out], -1)


class Stem13(nn.Module):
    """A 13-band stem (Sentinel-2), two convs, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(13, 8, 3, padding=1)
        self.convs = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.convs(torch.relu(self.stem(x))).mean((2, 3)))


class Blocks(nn.Module):
    """N-BEATS' shape: each block reads the residual and adds a forecast from its own projection."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList([nn.Linear(12, 16) for _ in range(3)])
        self.backcast = nn.ModuleList([nn.Linear(16, 12) for _ in range(3)])
        self.forecast = nn.ModuleList([nn.Linear(16, 4) for _ in range(3)])

    def forward(self, x):
        total = 0
        for fc, back, fore in zip(self.fc, self.backcast, self.forecast):
            h = torch.relu(fc(x))
            x = x - back(h)
            total = total + fore(h)
        return total


class Recurrent(nn.Module):
    """DeepAR's shape: raw lags next to a category's embedding, into a 2-layer LSTM, and three distribution heads
    (parallel Linear(hidden, 1) in a ModuleList)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 2)
        self.rnn = nn.LSTM(6, 8, num_layers=2, batch_first=True)
        self.proj = nn.ModuleList([nn.Linear(8, 1) for _ in range(3)])

    def forward(self, lags, category):
        static = self.embed(category)[:, None, :].expand(-1, lags.shape[1], -1)
        h, _ = self.rnn(torch.cat([lags / lags.abs().mean(), static], -1))
        return [p(h) for p in self.proj]


class RotaryAttention(nn.Module):
    """Attention with constant rotary tables and a padding mask from the batch: nothing after q/k/v reads the
    batch, however the mask and tables are applied."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.lm_head = nn.Linear(8, 11)
        self.register_buffer("cos", torch.rand(5, 8))

    def forward(self, ids, mask):
        x = self.embed(ids)
        q, k = self.q(x) * self.cos, self.k(x) * self.cos
        scores = q @ k.transpose(-1, -2) + (1.0 - mask[:, None, :].float()) * -1e4
        h = x + self.o(scores.softmax(-1) @ self.v(x))
        return self.lm_head(h * mask[..., None])


class TiedFunctional(nn.Module):
    """A head that is the embedding's weight, applied with F.linear outside its module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.block = nn.Linear(8, 8)

    def forward(self, ids):
        return F.linear(torch.tanh(self.block(self.embed(ids))), self.embed.weight)


class WeightNormHead(nn.Module):
    """A head applied through a parametrization (weight norm): the applied matrix is computed from parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 6)
        self.head = nn.utils.parametrizations.weight_norm(nn.Linear(6, 2))

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(x)))


class WrittenIntoABuffer(nn.Module):
    """Heads whose outputs are written into a preallocated tensor (x[...] = y)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 6)
        self.heads = nn.ModuleList([nn.Linear(6, 1) for _ in range(2)])

    def forward(self, x):
        h = torch.tanh(self.hidden(x))
        out = torch.zeros(x.shape[0], 2)
        for i, head in enumerate(self.heads):
            out[:, i] = head(h)[:, 0]
        return out


def mse(model, x):
    return model(x).square().mean()


CASES = [
    # (model, batch, loss, heads, inputs)
    (Prescaled, torch.randn(4, 3), mse, {"out.0.weight", "out.1.weight"},
     {"scale.0.weight", "scale.1.weight", "scale.2.weight"}),
    (Stem13, torch.randn(2, 13, 8, 8), mse, {"fc.weight"}, {"stem.weight"}),
    (Blocks, torch.randn(4, 12), mse, {"forecast.0.weight", "forecast.1.weight", "forecast.2.weight"},
     {"fc.0.weight"}),
    (Recurrent, (torch.randn(2, 5, 4), torch.tensor([1, 3])),
     lambda m, b: sum(o.square().mean() for o in m(*b)), {"proj.0.weight", "proj.1.weight", "proj.2.weight"},
     {"rnn.weight_ih_l0", "embed.weight"}),
    (RotaryAttention, (torch.randint(0, 11, (2, 5)), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])),
     lambda m, b: m(*b).logsumexp(-1).mean(), {"lm_head.weight"}, {"embed.weight"}),
    (TiedFunctional, torch.randint(0, 11, (2, 5)), lambda m, b: m(b).logsumexp(-1).mean(), {"embed.weight"},
     {"embed.weight"}),
    (WeightNormHead, torch.randn(4, 6), mse,  # the applied matrix's direction; its gain (2x1) only scales it
     {"head.parametrizations.weight.original1"}, {"hidden.weight"}),
    (WrittenIntoABuffer, torch.randn(4, 6), mse, {"heads.0.weight", "heads.1.weight"}, {"hidden.weight"}),
]


@pytest.mark.parametrize(("build", "batch", "loss", "heads", "inputs"), CASES, ids=[c[0].__name__ for c in CASES])
def test_heads_and_input_layers_from_the_computation(build, batch, loss, heads, inputs):
    model = seeded(build)
    found = roles(model, batch, lambda b: loss(model, b))
    assert found.note == ""
    assert found.heads == heads
    assert found.inputs == inputs


def test_recurrent_state_and_upper_layers_stay_hidden():
    model = seeded(Recurrent)
    batch = (torch.randn(2, 5, 4), torch.tensor([1, 3]))
    routes = {r.name: r for r in route_parameters(
        model, graph=roles(model, batch, lambda b: sum(o.square().mean() for o in model(*b)))).routes}
    assert routes["rnn.weight_ih_l0"].optimizer == ADAMW and routes["rnn.weight_ih_l0"].group == "input"
    assert all(routes[n].optimizer == MUON for n in ("rnn.weight_hh_l0", "rnn.weight_ih_l1", "rnn.weight_hh_l1"))
    assert routes["rnn.weight_ih_l0"].reason == "input layer: reads the batch through no other matrix (first batch)"
    assert [routes[f"proj.{i}.weight"].group for i in range(3)] == ["head"] * 3


def test_a_loss_the_trace_cannot_follow_gives_no_head_verdict():
    model = seeded(Prescaled)
    found = roles(model, torch.randn(4, 3), lambda b: torch.tensor(model(b).square().mean().item()))
    assert found.heads is None and "loss could not be followed" in found.note
    # without a head verdict, nothing is declared hidden: the structural rules decide every role
    assert found.role("mix.weight") is None
    structural = {r.name: (r.optimizer, r.group) for r in route_parameters(model).routes}
    assert {r.name: (r.optimizer, r.group) for r in route_parameters(model, graph=found).routes} == {
        **structural, **{f"scale.{i}.weight": (ADAMW, "input") for i in range(3)}}


def test_the_trace_never_breaks_the_forward():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x).sum()

    model = seeded(Odd)
    batch = torch.randn(2, 3)
    with pytest.MonkeyPatch.context() as patch:
        from lightning_muon.routing import _trace

        def broken(*args, **kwargs):
            raise KeyError("bookkeeping")

        patch.setattr(_trace.RoleTrace, "_follow", broken)
        found = roles(model, batch, lambda b: model(b))
    assert found.heads is None and found.inputs is None and "trace failed" in found.note
    assert found == GraphRoles.from_dict(found.to_dict())


def test_a_compiled_model_is_traced_eagerly_and_compiles_once_afterwards(recwarn):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() keeps them: graphs compiled by earlier tests would count here
    model = seeded(Prescaled)
    compiled = torch.compile(model, backend="eager")
    batch = torch.randn(4, 3)
    found = roles(model, batch, lambda b: compiled(b).square().mean())
    assert found == roles(model, batch, lambda b: mse(model, b))
    assert counters["stats"]["unique_graphs"] == 0  # nothing compiled under the trace
    for _ in range(3):
        compiled(batch)
    assert counters["stats"]["unique_graphs"] == 1  # then compiled once, as without it
    assert not [w for w in recwarn if "global hooks" in str(w.message)]


def test_user_patterns_and_tables_outrank_the_batch():
    model = seeded(Prescaled)
    found = roles(model, torch.randn(4, 3), lambda b: mse(model, b))
    routes = {r.name: r for r in route_parameters(model, muon_params=["out.0.weight"], graph=found).routes}
    assert routes["out.0.weight"].optimizer == MUON
    assert routes["out.1.weight"].group == "head"


# ------------------------------------------------------------------ models with known conventions: agreement


def lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def structural_and_traced(model, batch, loss_of):
    found = roles(model, batch, loss_of)
    assert found.note == ""
    structural = {r.name: (r.optimizer, r.group) for r in route_parameters(model).routes}
    traced = {r.name: (r.optimizer, r.group) for r in route_parameters(model, graph=found).routes}
    return structural, traced, found


MASK = torch.ones_like(TOKENS).index_fill_(1, torch.tensor([14, 15]), 0)  # the last two tokens are padding

AGREEING = {
    "gpt2": (gpt2, TOKENS, lm_loss),
    "llama-tied": (lambda: llama(True), TOKENS, lm_loss),
    "llama-untied": (lambda: llama(False), TOKENS, lm_loss),
    "llama-masked": (lambda: llama(False), TOKENS,
                     lambda m, b: m(input_ids=b, attention_mask=MASK, labels=b).loss),
    "mixtral": (mixtral, TOKENS, lm_loss),
    "bert-mlm": (lambda: seeded(__import__("transformers").BertForMaskedLM, bert_config()), TOKENS,
                 lambda m, b: m(input_ids=b, attention_mask=MASK, labels=b).loss),
    "vit": (vit, IMAGES, lambda m, b: m(pixel_values=b, labels=LABELS).loss),
    "resnet": (resnet, IMAGES, lambda m, b: m(pixel_values=b, labels=LABELS).loss),
}


@pytest.mark.parametrize("name", list(AGREEING))
def test_the_trace_agrees_with_the_ecosystems_conventions(name):
    build, batch, loss = AGREEING[name]
    model = build()
    model.train()
    structural, traced, found = structural_and_traced(model, batch, lambda b: loss(model, b))
    assert traced == structural
    assert found.heads  # the head is found from the loss, not only by its name


def test_litgpt_agrees():
    from litgpt import GPT, Config

    model = seeded(GPT, Config(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64))
    batch = TOKENS % 64
    structural, traced, found = structural_and_traced(
        model, batch, lambda b: F.cross_entropy(model(b).flatten(0, 1), b.flatten()))
    assert traced == structural
    assert found.heads == {"lm_head.weight"}


# ------------------------------------------------------------------ frozen parts are structure, not absence


def trainable_routes(model, found):
    return {r.name: (r.optimizer, r.group) for r in route_parameters(model, graph=found).routes}


def test_a_frozen_tied_embedding_keeps_every_block_matrix_on_muon():
    """GPT-2 with its tied embedding (so its head) frozen: the loss is followed through the frozen head, not past
    it, so no block's projection becomes an "output head" (they did, when frozen matrices were not layers)."""
    model = gpt2()
    model.train()
    structural = trainable_routes(model, None)
    model.transformer.wte.weight.requires_grad_(False)
    found = roles(model, TOKENS, lambda b: lm_loss(model, b))
    assert found.heads == {"transformer.wte.weight"} and found.note == ""  # the tied head, by its first name
    routes = trainable_routes(model, found)
    matrices = [n for n in routes if n.startswith("transformer.h.") and n.endswith(("c_attn.weight", "c_proj.weight",
                                                                                   "c_fc.weight"))]
    assert len(matrices) == 4 and all(routes[n] == (MUON, "hidden") for n in matrices)
    assert routes == {n: route for n, route in structural.items() if n != "transformer.wte.weight"}


def test_lora_adapters_behind_a_frozen_base_are_neither_heads_nor_input_layers():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama(False), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.train()
    found = roles(model, TOKENS, lambda b: lm_loss(model, b))
    routes = trainable_routes(model, found)
    assert len(routes) == 4 and all("lora_" in n for n in routes)  # one layer: q and v, A and B
    # Not heads nor inputs: A is a hidden matrix on Muon, B AdamW's by the adapter rule (as measured)
    assert {n: r for n, r in routes.items()} == {
        n: (MUON, "hidden") if ".lora_A." in n else (ADAMW, "adapters") for n in routes}
    assert found.heads == {"base_model.model.lm_head.weight"}
    assert found.inputs == {"base_model.model.model.embed_tokens.weight"}


def test_a_frozen_backbone_with_a_trainable_head_keeps_its_structural_routing():
    model = seeded(Stem13)
    batch = torch.randn(2, 13, 8, 8)
    structural = trainable_routes(model, None)
    for p in [*model.stem.parameters(), *model.convs.parameters()]:
        p.requires_grad_(False)
    found = roles(model, batch, lambda b: model(b).square().mean())
    assert found.heads == {"fc.weight"} and found.inputs == {"stem.weight"}
    assert trainable_routes(model, found) == {n: structural[n] for n in ("fc.weight", "fc.bias")}
