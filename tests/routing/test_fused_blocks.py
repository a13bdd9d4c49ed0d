"""Fused projections found by module type and shape (or an attention's ``qk_layout()``), named in the routing
table, and orthogonalised per block by default where their blocks are equal q, k, v, with ``split_fused=True``
or a ``matrix_blocks`` pattern elsewhere: on GPT-2 (``Conv1D`` ``c_attn``, stored ``in x out``),
``nn.MultiheadAttention`` (``in_proj_weight``), litgpt (``qkv`` with grouped-query attention's unequal blocks) and
Mixtral (fused experts' ``gate_up_proj``), each model's Muon step equals, bit for bit, a Muon over the same model
with each fused tensor replaced by separate parameters holding its blocks, as separate layers would. GPT-OSS's
interleaved ``gate_up_proj`` is named and kept whole."""

from __future__ import annotations

import pytest
from litgpt import GPT, Config
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM

from lightning_muon.routing import route_parameters

from helpers import assert_blocks_step_as_separate_parameters, built

SMALL = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 16}


MODELS = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                               bos_token_id=0, eos_token_id=0)),
    "mha": lambda: nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
                                 nn.Linear(32, 8)),
    "litgpt": lambda: GPT(Config(n_layer=1, n_head=4, n_query_groups=2, n_embd=32, block_size=16, vocab_size=64,
                                 padded_vocab_size=64)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(intermediate_size=24, num_local_experts=4,
                                                        num_experts_per_tok=2, **SMALL)),
}
#: model -> (the fused parameter, its layout, its blocks, the reason's words for it)
FUSED = {
    "gpt2": ("transformer.h.0.attn.c_attn.weight", "in_out", (32, 32, 32), "fused q, k, v 32+32+32"),
    "mha": ("1.self_attn.in_proj_weight", "flatten", (32, 32, 32), "fused q, k, v 32+32+32"),
    "litgpt": ("transformer.h.0.attn.qkv.weight", "flatten", (32, 16, 16), "fused q, k, v 32+16+16"),
    "mixtral": ("model.layers.0.mlp.experts.gate_up_proj", "stack", (24, 24), "fused gate, up 24+24"),
}


#: What the default (``split_fused=None``) does: equal q, k, v blocks split, unequal ones and MoE gate/up whole.
SPLIT_BY_DEFAULT = {"gpt2": True, "mha": True, "litgpt": False, "mixtral": False}


@pytest.mark.parametrize("model", list(MODELS))
def test_found_and_named_equal_qkv_split_by_default(model):
    name, layout, sizes, words = FUSED[model]
    routing = route_parameters(built(MODELS[model]))
    route = next(r for r in routing.routes if r.name == name)
    if SPLIT_BY_DEFAULT[model]:
        assert (route.layout, route.blocks) == (layout, sizes)
        assert route.reason.endswith(f"; {words}: each block orthogonalised"), route.reason
        assert f"{words}: each block orthogonalised" in routing.plain_table()  # the table says it
    else:
        assert (route.layout, route.blocks) == (layout, None)
        assert route.reason.endswith(f"; {words}, orthogonalised whole (split_fused=True splits it)"), route.reason
        assert all("matrix_blocks" not in g for g in routing.muon_groups)  # Muon's groups as in 0.1
        assert f"{words}, orthogonalised whole" in routing.plain_table()


@pytest.mark.parametrize("model", list(MODELS))
def test_split_fused_false_keeps_every_one_whole(model):
    name, layout, _, words = FUSED[model]
    routing = route_parameters(built(MODELS[model]), split_fused=False)
    route = next(r for r in routing.routes if r.name == name)
    assert (route.layout, route.blocks) == (layout, None)
    assert route.reason.endswith(f"; {words}, orthogonalised whole (split_fused=True splits it)"), route.reason
    assert all("matrix_blocks" not in g for g in routing.muon_groups)


def test_the_default_keeps_fused_whole_for_torch_muon():
    """``muon_nd=False`` (``torch.optim.Muon``, which cannot split): the default keeps q, k, v whole, and says why,
    where ``split_fused=True`` is refused (`test_blocks_that_cannot_be_are_refused_with_the_fix`)."""
    name, _, _, words = FUSED["gpt2"]
    route = next(r for r in route_parameters(built(MODELS["gpt2"]), muon_nd=False).routes if r.name == name)
    assert route.blocks is None
    assert route.reason.endswith(f"; {words}, orthogonalised whole (torch.optim.Muon cannot split)"), route.reason


def test_an_attention_s_qk_layout_names_its_fused_qkv():
    """The shipped GPT's attention holds q, k and v in one ``qkv`` weight, which only its ``qk_layout()`` says: found
    there, split by default into the blocks ``configs/gpt_muon_split.yaml``'s pattern gives by hand."""
    from lightning_muon.examples.char_gpt import GPT

    net = built(lambda: GPT(n_layer=2, n_head=4, n_embd=32, block_size=16))
    found = route_parameters(net)
    by_hand = route_parameters(net, split_fused=False, matrix_blocks={"*.qkv.weight": [32, 32, 32]})
    assert [(r.name, r.blocks) for r in found.routes] == [(r.name, r.blocks) for r in by_hand.routes]
    assert found.muon_groups[0]["matrix_blocks"] == by_hand.muon_groups[0]["matrix_blocks"]
    qkv = next(r for r in found.routes if r.name == "blocks.0.attn.qkv.weight")
    assert qkv.reason.endswith("; fused q, k, v 32+32+32: each block orthogonalised"), qkv.reason


@pytest.mark.parametrize("model", list(MODELS))
def test_split_each_block_steps_as_a_separate_layer(model):
    """``split_fused=True``: three Muon steps on the whole model equal a Muon over the same parameters with the
    fused tensor replaced by its blocks as separate parameters (same gradients), bit for bit."""
    name, layout, sizes, words = FUSED[model]
    net = built(MODELS[model])
    routing = route_parameters(net, split_fused=True)
    route = next(r for r in routing.routes if r.name == name)
    assert route.blocks == sizes and f"{words}: each block orthogonalised" in route.reason
    assert route.layout == layout  # its blocks along this layout's output dim
    assert assert_blocks_step_as_separate_parameters(routing.muon_groups) == {name: sizes}


def test_interleaved_gate_up_is_named_and_kept_whole():
    """GPT-OSS interleaves gate and up columns (``gate_up[..., ::2]``): no contiguous blocks to split."""
    net = built(lambda: GptOssForCausalLM(GptOssConfig(intermediate_size=24, num_local_experts=4,
                                                       num_experts_per_tok=2, head_dim=8,
                                                       layer_types=["full_attention"], **SMALL)))
    route = next(r for r in route_parameters(net, split_fused=True).routes
                 if r.name == "model.layers.0.mlp.experts.gate_up_proj")
    assert route.blocks is None and route.reason.endswith("; fused gate, up, interleaved: orthogonalised whole")


def test_a_pattern_sets_or_turns_off_a_layout():
    net = built(MODELS["gpt2"])
    routing = route_parameters(net, split_fused=True, matrix_blocks={"*c_attn.weight": None,
                                                                     "*mlp.c_fc.weight": [64, 64]})
    routes = {r.name: r for r in routing.routes}
    c_attn, c_fc = routes["transformer.h.0.attn.c_attn.weight"], routes["transformer.h.0.mlp.c_fc.weight"]
    assert c_attn.blocks is None and "orthogonalised whole (matrix_blocks '*c_attn.weight')" in c_attn.reason
    assert c_fc.blocks == (64, 64)
    assert c_fc.reason.endswith("; blocks 64+64: each block orthogonalised (matrix_blocks '*mlp.c_fc.weight')")
    group = routing.muon_groups[0]
    assert [b for (n, _), b in zip(group["params"], group["matrix_blocks"]) if b] == [[64, 64]]


ERRORS = [
    ({"matrix_blocks": {"*c_fc.weight": [64, 60]}}, r"matrix_blocks pattern '\*c_fc.weight' gives "
     r"`transformer.h.0.mlp.c_fc.weight` of shape \(32, 128\) the blocks \[64, 60\], which do not add up to its 128 "
     r"output rows; give positive sizes that do"),
    ({"matrix_blocks": {"*ln_1.weight": [16, 16]}}, r"matrix_blocks pattern '\*ln_1.weight' matches "
     r"`transformer.h.0.ln_1.weight`, which goes to AdamW \(norm layer \(LayerNorm\)\); blocks are Muon's"),
    ({"matrix_blocks": {"*nothing*": [1]}}, r"matrix_blocks pattern '\*nothing\*' matches no trainable parameter"),
    ({"split_fused": True, "muon_nd": False}, r"split_fused splits `transformer.h.0.attn.c_attn.weight` into "
     r"blocks, which torch.optim.Muon cannot do"),
]


@pytest.mark.parametrize(("kwargs", "pattern"), ERRORS, ids=["sum", "adamw", "no-match", "torch-muon"])
def test_blocks_that_cannot_be_are_refused_with_the_fix(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        route_parameters(built(MODELS["gpt2"]), **kwargs)


def test_muon_with_adamw_takes_the_split_with_the_model_only():
    from lightning_muon import MuonWithAdamW

    net = built(MODELS["gpt2"])
    opt = MuonWithAdamW.from_model(net, split_fused=True)
    muon = next(g for g in opt.param_groups if g["algorithm"] == "muon")
    blocks = dict(zip(muon["param_names"], muon["matrix_blocks"], strict=True))
    assert blocks["transformer.h.0.attn.c_attn.weight"] == [32, 32, 32]
    assert opt.muon.effective_lr(net.get_parameter("transformer.h.0.attn.c_attn.weight")) == pytest.approx(0.02)
    with pytest.raises(ValueError, match=r"split_fused / split_heads / matrix_blocks are routing settings"):
        MuonWithAdamW(route_parameters(net), split_fused=True)
