"""Mixture-of-experts and adapter models routed whole: every tensor where its nature says.

On transformers 5's MoE models built from tiny configs (Mixtral, Qwen3-MoE, GPT-OSS, random weights, never
downloaded) and PEFT's adapter methods beyond LoRA, every trainable tensor's place is pinned: optimizer, group,
layout, the rule that decided and words of its reason. A stack of matrices goes to Muon as a stack (GPT-OSS's,
stored ``E x in x out``, oriented by its experts' own ``is_transposed``); a stack of vectors (a per-expert bias,
a router's gate vector per expert) and an adapter's scales, magnitudes and other coefficients go to AdamW,
whatever their number of dimensions and whether a side is 1. Each expert's update equals, bit for bit, a lone
Muon's on that expert's real ``out x in`` matrix.
"""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from torch import nn
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from lightning_muon import Muon
from lightning_muon.routing import ADAMW, MUON, Route, Rule, route_parameters

SMALL = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 16}
LAYER = "model.layers.0."


def seeded(build, config):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-OSS's rope scaling note on a tiny config
        return build(config)


def mixtral() -> nn.Module:
    return seeded(MixtralForCausalLM, MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                    **SMALL))


def qwen3_moe() -> nn.Module:
    return seeded(Qwen3MoeForCausalLM, Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                                      num_experts_per_tok=2, **SMALL))


def qwen2_moe() -> nn.Module:
    """With a shared expert and its gate (``Linear(hidden, 1)``)."""
    return seeded(Qwen2MoeForCausalLM, Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                                      num_experts_per_tok=2, shared_expert_intermediate_size=40,
                                                      **SMALL))


def gpt_oss() -> nn.Module:
    return seeded(GptOssForCausalLM, GptOssConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                  head_dim=8, layer_types=["full_attention"], **SMALL))


def routes_of(model: nn.Module) -> dict[str, Route]:
    routing = route_parameters(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(r.name for r in routing.routes) == sorted(trainable)
    return {r.name: r for r in routing.routes}


#: (optimizer, group, layout, rule, words of the reason)
Place = tuple[str, str, str, Rule, str]

HIDDEN: Place = (MUON, "hidden", "flatten", Rule.SHAPE, "hidden matrix")
NORM: Place = (ADAMW, "norms_and_biases", "flatten", Rule.MODULE_TYPE, "norm layer")
BIAS: Place = (ADAMW, "norms_and_biases", "flatten", Rule.SHAPE, "bias")
ROUTER: Place = (ADAMW, "norms_and_biases", "flatten", Rule.MODULE_TYPE,
                 "router: a stack of vectors, one gate vector per expert (4 experts)")
ATTENTION = {f"{LAYER}self_attn.{p}_proj.weight": HIDDEN for p in "qkvo"}
ENDS = {
    "model.embed_tokens.weight": (ADAMW, "embeddings", "flatten", Rule.MODULE_TYPE, "Embedding weight"),
    "lm_head.weight": (ADAMW, "head", "flatten", Rule.CONVENTION, "output head `lm_head`"),
    f"{LAYER}input_layernorm.weight": NORM,
    f"{LAYER}post_attention_layernorm.weight": NORM,
    "model.norm.weight": NORM,
}

#: A router and its experts stored ``E x out x in`` (Mixtral's, Qwen3-MoE's and Qwen2-MoE's layout).
ROUTED_EXPERTS = {
    f"{LAYER}mlp.gate.weight": ROUTER,
    f"{LAYER}mlp.experts.gate_up_proj": (MUON, "hidden", "stack", Rule.SHAPE,
                                         "4 stacked matrices 48x32, each orthogonalised"),
    f"{LAYER}mlp.experts.down_proj": (MUON, "hidden", "stack", Rule.SHAPE,
                                      "4 stacked matrices 32x24, each orthogonalised"),
}

EXPECTED: dict[str, dict[str, Place]] = {
    "mixtral": {
        **ENDS, **ATTENTION,
        **ROUTED_EXPERTS,
    },
    "qwen3_moe": {
        **ENDS, **ATTENTION,
        f"{LAYER}self_attn.q_norm.weight": NORM,
        f"{LAYER}self_attn.k_norm.weight": NORM,
        **ROUTED_EXPERTS,
    },
    "qwen2_moe": {
        **ENDS, **ATTENTION,
        **{f"{LAYER}self_attn.{p}_proj.bias": BIAS for p in "qkv"},
        **ROUTED_EXPERTS,
        **{f"{LAYER}mlp.shared_expert.{p}_proj.weight": HIDDEN for p in ("gate", "up", "down")},
        f"{LAYER}mlp.shared_expert_gate.weight": (ADAMW, "norms_and_biases", "flatten", Rule.STRUCTURE,
                                                  "gate beside the experts: a vector (1 row)"),
    },
    "gpt_oss": {
        **ENDS, **ATTENTION,
        **{f"{LAYER}self_attn.{p}_proj.bias": BIAS for p in "qkvo"},
        f"{LAYER}self_attn.sinks": (ADAMW, "norms_and_biases", "flatten", Rule.SHAPE, "1D tensor"),
        f"{LAYER}mlp.router.weight": ROUTER,
        f"{LAYER}mlp.router.bias": BIAS,
        f"{LAYER}mlp.experts.gate_up_proj": (MUON, "hidden", "stack_in_out", Rule.CONVENTION,
                                             "4 stacked matrices stored in x out (48x32 out x in"),
        f"{LAYER}mlp.experts.down_proj": (MUON, "hidden", "stack_in_out", Rule.CONVENTION,
                                          "4 stacked matrices stored in x out (32x24 out x in"),
        f"{LAYER}mlp.experts.gate_up_proj_bias": (ADAMW, "norms_and_biases", "flatten", Rule.STRUCTURE,
                                                  "stack of vectors (4x48): one bias per matrix of `gate_up_proj`"),
        f"{LAYER}mlp.experts.down_proj_bias": (ADAMW, "norms_and_biases", "flatten", Rule.STRUCTURE,
                                               "stack of vectors (4x32): one bias per matrix of `down_proj`"),
    },
}
MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe, "gpt_oss": gpt_oss}


def assert_places(routes: dict[str, Route], expected: dict[str, Place]) -> None:
    """Every route is the expected one, and every tensor has an expectation."""
    assert sorted(routes) == sorted(expected)
    for name, (optimizer, group, layout, rule, words) in expected.items():
        r = routes[name]
        assert (r.optimizer, r.group, r.layout, r.rule) == (optimizer, group, layout, rule), (name, r)
        assert words in r.reason, (name, r.reason)


@pytest.mark.parametrize("model", list(MODELS))
def test_every_moe_tensor_in_its_place(model):
    assert_places(routes_of(MODELS[model]()), EXPECTED[model])


#: The experts' stacks, and whether their matrices are stored ``in x out``.
EXPERTS = {"mixtral": False, "qwen3_moe": False, "qwen2_moe": False, "gpt_oss": True}


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("model", list(MODELS))
def test_each_expert_steps_as_a_lone_muon_on_its_real_matrix(model, ns_dtype):
    """Three steps of the routed Muon on the whole model equal, bit for bit, a lone ``Muon`` per expert on that
    expert's ``out x in`` matrix (GPT-OSS's stored ``in x out``: the lr's shape scaling reads the real one)."""
    net = MODELS[model]()
    transposed = EXPERTS[model]
    params = dict(net.named_parameters())
    names = [f"{LAYER}mlp.experts.gate_up_proj", f"{LAYER}mlp.experts.down_proj"]
    settings = {"lr": 0.02, "weight_decay": 0.1, "ns_dtype": ns_dtype}
    opt = Muon(route_parameters(net).muon_groups, **settings)

    def real(matrix: torch.Tensor) -> torch.Tensor:
        return matrix.mT if transposed else matrix

    lone = {n: [nn.Parameter(real(e).detach().clone()) for e in params[n].unbind(0)] for n in names}
    lone_opts = {n: [Muon([q], **settings) for q in lone[n]] for n in names}
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for n in names:
            params[n].grad = torch.randn(params[n].shape, generator=g)
            for q, expert_grad, o in zip(lone[n], params[n].grad.unbind(0), lone_opts[n], strict=True):
                q.grad = real(expert_grad).clone()
                o.step()
        opt.step()
    for n in names:
        assert real(params[n][0]).shape[0] == (48 if "gate_up" in n else 32)  # out x in, as the lone Muon saw it
        for e, q in enumerate(lone[n]):
            assert torch.equal(real(params[n].detach()[e]), q.detach()), (n, e)
    assert not torch.equal(lone[names[0]][0].detach(), real(MODELS[model]().get_parameter(names[0])[0]).detach())


# ------------------------------------------------------------------ PEFT's adapter methods

TARGETS = ["q_proj", "v_proj", "down_proj"]
V = "base_model.model.model.layers.0.self_attn.v_proj."
DOWN = "base_model.model.model.layers.0.mlp.down_proj."

MATRIX: Place = HIDDEN
LORA_B: Place = (ADAMW, "adapters", "flatten", Rule.CONVENTION, "LoRA's B")


def coefficients(words: str) -> Place:
    return ADAMW, "adapters", "flatten", Rule.CONVENTION, f"not a matrix: {words}"


#: Method -> (its config, where each of the adapter's tensors of ``v_proj`` and ``down_proj`` goes, by the name
#: after the layer's path). ``q_proj`` holds the same as ``v_proj``.
ADAPTERS: dict[str, tuple[peft.PeftConfig, dict[str, Place]]] = {
    "lora": (peft.LoraConfig(r=4, target_modules=TARGETS),
             {"lora_A.default.weight": MATRIX, "lora_B.default.weight": LORA_B}),
    "dora": (peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True),
             {"lora_A.default.weight": MATRIX, "lora_B.default.weight": LORA_B,
              "lora_magnitude_vector.default.weight": coefficients("DoRA's magnitude")}),
    "loha": (peft.LoHaConfig(r=4, target_modules=TARGETS),
             {f"hada_w{i}_{s}.default": MATRIX for i in (1, 2) for s in "ab"}),
    "lokr": (peft.LoKrConfig(r=4, target_modules=TARGETS),
             {"lokr_w1.default": MATRIX, "lokr_w2.default": MATRIX}),
    "ia3": (peft.IA3Config(target_modules=TARGETS, feedforward_modules=["down_proj"]),  # 16x1 and 1x48
            {"ia3_l.default": coefficients("IA3's scaling vector")}),
    "adalora": (peft.AdaLoraConfig(r=4, target_modules=TARGETS, total_step=10),
                {"lora_A.default": MATRIX, "lora_B.default": LORA_B,
                 "lora_E.default": coefficients("AdaLoRA's singular values")}),
    "oft": (peft.OFTConfig(r=0, oft_block_size=8, target_modules=TARGETS),
            {"oft_R.default.weight": coefficients("OFT's rotation generators")}),
    "boft": (peft.BOFTConfig(boft_block_size=4, target_modules=TARGETS),  # boft_R 1x8x4x4, boft_s 16x1
             {"boft_R.default": coefficients("BOFT's rotation generators"),
              "boft_s.default": coefficients("BOFT's scale")}),
    "vera": (peft.VeraConfig(r=4, target_modules=["v_proj"]),
             {"vera_lambda_b.default": coefficients("VeRA's scaling vector"),
              "vera_lambda_d.default": coefficients("VeRA's scaling vector")}),
    "randlora": (peft.RandLoraConfig(r=4, target_modules=["v_proj"]),
                 {"randlora_lambda.default": coefficients("RandLoRA's diagonal scales"),
                  "randlora_gamma.default": coefficients("RandLoRA's diagonal scales")}),
    "fourierft": (peft.FourierFTConfig(n_frequency=16, target_modules=TARGETS),
                  {"fourierft_spectrum.default": coefficients("FourierFT's spectral coefficients")}),
    "waveft": (peft.WaveFTConfig(n_frequency=16, target_modules=TARGETS),
               {"waveft_spectrum.default": coefficients("WaveFT's wavelet coefficients")}),
    "vblora": (peft.VBLoRAConfig(r=4, num_vectors=8, vector_length=8, target_modules=TARGETS),  # logits 4x4x8
               {"vblora_logits_A.default": coefficients("VB-LoRA's selection logits"),
                "vblora_logits_B.default": coefficients("VB-LoRA's selection logits")}),
    "hra": (peft.HRAConfig(r=4, target_modules=TARGETS),
            {"hra_u.default": coefficients("HRA's Householder vectors")}),
    "c3a": (peft.C3AConfig(block_size=8, target_modules=TARGETS),  # kernels 2x4x8
            {"c3a_kernel.default": coefficients("C3A's circular-convolution kernels")}),
    "shira": (peft.ShiraConfig(r=4, target_modules=TARGETS),
              {"shira_weight.default": coefficients("SHiRA's sparse entries")}),
    "miss": (peft.MissConfig(r=4, target_modules=TARGETS), {"miss_block.default": MATRIX}),
    "delora": (peft.DeloraConfig(r=4, target_modules=TARGETS),
               {"delora_A.default": MATRIX, "delora_B.default": MATRIX,
                "delora_lambda.default": coefficients("DeLoRA's norm bound")}),
    "gralora": (peft.GraloraConfig(r=4, gralora_k=2, target_modules=TARGETS),
                {"gralora_A.default": (MUON, "hidden", "stack", Rule.SHAPE, "2 stacked matrices"),
                 "gralora_B.default": (MUON, "hidden", "stack", Rule.SHAPE, "2 stacked matrices")}),
}


@pytest.mark.parametrize("method", list(ADAPTERS))
def test_every_adapter_tensor_in_its_place(method):
    config, places = ADAPTERS[method]
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(intermediate_size=48, **SMALL))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base, config)
    routes = routes_of(model)
    targets = [t for t in ("q_proj", "v_proj", "down_proj") if t in str(config.target_modules)]
    prefixes = [f"base_model.model.model.layers.0.{'mlp' if t == 'down_proj' else 'self_attn'}.{t}." for t in targets]
    expected = {f"{prefix}{leaf}": place for prefix in prefixes for leaf, place in places.items()}
    shared = {n: r for n, r in routes.items() if n not in expected}  # a bank shared by the layers (VB-LoRA's)
    assert_places({n: r for n, r in routes.items() if n not in shared}, expected)
    assert list(shared) == (["base_model.model.model.layers.0.self_attn.q_proj.vblora_vector_bank.default"]
                            if method == "vblora" else [])
    for r in shared.values():
        assert (r.optimizer, r.group) == (ADAMW, "adapters") and "VB-LoRA's bank of sub-vectors" in r.reason


def test_a_stack_whose_matrices_have_a_side_of_one_is_a_stack_of_vectors():
    """Shapes alone, no convention: a stack of ``3 x 4 x 1`` is three vectors, not three matrices; a lone hidden
    ``Linear(4, 1)`` stays a matrix (measured: ``docs/guides/routing.md``, degenerate matrices)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.narrow = nn.Linear(4, 1, bias=False)
            self.mix = nn.Linear(1, 4)
            self.scales = nn.Parameter(torch.ones(3, 4, 1))
            self.head = nn.Linear(4, 8)

    routes = routes_of(Net())
    assert (routes["scales"].optimizer, routes["scales"].group, routes["scales"].rule) == (
        ADAMW, "norms_and_biases", Rule.SHAPE)
    assert routes["scales"].reason == "stack of vectors (3x4x1): its matrices have a side of 1"
    assert routes["narrow.weight"].optimizer == MUON and routes["mix.weight"].optimizer == MUON


def test_a_router_beside_a_list_of_experts_by_structure():
    """A router whose class no rule knows (a plain ``nn.Linear``) beside a list of experts named so, one row per
    expert: one gate vector per expert, AdamW."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(16, 3, bias=False)
            self.experts = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])

    r = routes_of(nn.Sequential(Block(), nn.Linear(16, 16)))
    assert (r["0.gate.weight"].optimizer, r["0.gate.weight"].rule) == (ADAMW, Rule.STRUCTURE)
    assert "one gate vector per expert (3 experts)" in r["0.gate.weight"].reason
    assert r["0.experts.0.weight"].optimizer == MUON


def test_a_pattern_still_puts_a_router_on_muon():
    r = route_parameters(mixtral(), muon_params=["*mlp.gate.weight"])
    gate = next(x for x in r.routes if x.name == f"{LAYER}mlp.gate.weight")
    assert (gate.optimizer, gate.rule, gate.layout) == (MUON, Rule.PATTERN, "flatten")
