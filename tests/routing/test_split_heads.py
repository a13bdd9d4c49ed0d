"""``split_heads``: attention projections orthogonalised per head, the heads read from the model.

On a transformers Llama (grouped-query attention: 4 query heads, 2 key-value heads of 8), GPT-2 (``c_attn``, a
``Conv1D`` stored ``in x out``: heads are columns there), litgpt (fused ``qkv`` under grouped-query attention),
``nn.MultiheadAttention`` (fused ``in_proj_weight``, and separate q/k/v weights) and the shipped GPT (fused ``qkv``
read from its ``qk_layout()``), the blocks are the ones written out here by hand, the output projection stays whole,
and three Muon steps equal, bit for bit, a Muon over the same parameters with every split tensor replaced by one
parameter per head (as separate layers). A pattern decides over ``split_heads``; an attention whose heads cannot be
read is refused by name."""

from __future__ import annotations

import pytest
import torch
from litgpt import GPT, Config
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lightning_muon import Muon, MuonWithAdamW
from lightning_muon.examples.char_gpt import GPT as CharGPTModel
from lightning_muon.routing import route_parameters

from helpers import assert_blocks_step_as_separate_parameters, built

MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=16)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                               bos_token_id=0, eos_token_id=0)),
    "litgpt": lambda: GPT(Config(n_layer=1, n_head=4, n_query_groups=2, n_embd=32, block_size=16, vocab_size=64,
                                 padded_vocab_size=64)),
    "mha": lambda: nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
                                 nn.Linear(32, 8)),
    "mha_kdim": lambda: nn.Sequential(nn.Linear(8, 32), nn.MultiheadAttention(32, 4, kdim=16, vdim=24)),
    "char_gpt": lambda: CharGPTModel(n_layer=1, n_head=4, n_embd=32),
}
#: model -> {parameter: its blocks, written out by hand}; every other Muon matrix stays whole.
HEADS = {
    "llama": {"model.layers.0.self_attn.q_proj.weight": (8,) * 4,  # 4 query heads of 8 rows
              "model.layers.0.self_attn.k_proj.weight": (8,) * 2,  # 2 key-value heads
              "model.layers.0.self_attn.v_proj.weight": (8,) * 2},
    # q, k, v of 4 heads of 8 each: the stored 32 x 96 weight's columns
    "gpt2": {"transformer.h.0.attn.c_attn.weight": (8,) * 12},
    # 4 query heads, then 2 key heads, then 2 value heads (litgpt 0.5.9: q | k | v, not interleaved per group)
    "litgpt": {"transformer.h.0.attn.qkv.weight": (8,) * 8},
    "mha": {"1.self_attn.in_proj_weight": (8,) * 12},
    "mha_kdim": {"1.q_proj_weight": (8,) * 4, "1.k_proj_weight": (8,) * 4, "1.v_proj_weight": (8,) * 4},
    "char_gpt": {"blocks.0.attn.qkv.weight": (8,) * 12},
}
#: model -> (a parameter, the words its reason ends with).
WORDS = {
    "llama": ("model.layers.0.self_attn.k_proj.weight", "; split per head: 2 key heads of 8 rows"),
    "gpt2": ("transformer.h.0.attn.c_attn.weight", "; split by projection, then per head: 4 query heads of 8 columns"
             " + 4 key heads of 8 columns + 4 value heads of 8 columns"),
    "litgpt": ("transformer.h.0.attn.qkv.weight", "; split by projection, then per head: 4 query heads of 8 rows"
               " + 2 key heads of 8 rows + 2 value heads of 8 rows"),
    "mha": ("1.self_attn.in_proj_weight", "; split by projection, then per head: 4 query heads of 8 rows"
            " + 4 key heads of 8 rows + 4 value heads of 8 rows"),
    "mha_kdim": ("1.v_proj_weight", "; split per head: 4 value heads of 8 rows"),
    "char_gpt": ("blocks.0.attn.qkv.weight", "; split by projection, then per head: 4 query heads of 8 rows"
                 " + 4 key heads of 8 rows + 4 value heads of 8 rows"),
}
#: model -> its attention's output projection: its heads are columns, so it stays whole.
OUTPUT = {"llama": "model.layers.0.self_attn.o_proj.weight", "gpt2": "transformer.h.0.attn.c_proj.weight",
          "litgpt": "transformer.h.0.attn.proj.weight", "mha": "1.self_attn.out_proj.weight",
          "mha_kdim": "1.out_proj.weight", "char_gpt": "blocks.0.attn.proj.weight"}


@pytest.mark.parametrize("model", list(MODELS))
def test_the_blocks_are_the_heads(model):
    routing = route_parameters(built(MODELS[model]), split_heads=True)
    blocks = {r.name: r.blocks for r in routing.routes if r.blocks is not None}
    assert blocks == HEADS[model]
    routes = {r.name: r for r in routing.routes}
    assert routes[OUTPUT[model]].optimizer == "Muon" and routes[OUTPUT[model]].blocks is None
    name, words = WORDS[model]
    assert routes[name].reason.endswith(words), routes[name].reason
    assert words[2:] in routing.plain_table()  # the table says it
    unsplit = route_parameters(built(MODELS[model]))  # off by default: the heads are not read
    assert all(r.blocks is None or len(r.blocks) < len(HEADS[model].get(r.name, ())) for r in unsplit.routes)


@pytest.mark.parametrize("model", list(MODELS))
def test_each_head_steps_as_a_separate_parameter(model):
    """Three Muon steps with ``split_heads`` equal a Muon over the same parameters with each split tensor replaced
    by one parameter per head (same gradients), bit for bit."""
    routing = route_parameters(built(MODELS[model]), split_heads=True)
    split = assert_blocks_step_as_separate_parameters(routing.muon_groups)
    assert set(split) == set(HEADS[model])


def test_a_pattern_decides_over_split_heads():
    net = built(MODELS["llama"])
    routing = route_parameters(net, split_heads=True, matrix_blocks={"*q_proj.weight": None,
                                                                     "*v_proj.weight": [16]})
    routes = {r.name: r for r in routing.routes}
    q, k, v = (routes[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    assert q.blocks is None and q.reason.endswith("(matrix_blocks '*q_proj.weight')"), q.reason
    assert k.blocks == (8, 8)
    assert v.blocks == (16,) and "(matrix_blocks '*v_proj.weight')" in v.reason


def test_split_heads_implies_the_fused_split_first():
    """With both switches, a fused qkv is split by projection and then by head, never into q, k, v alone."""
    net = built(MODELS["litgpt"])
    routes = {r.name: r for r in route_parameters(net, split_heads=True, split_fused=True).routes}
    assert routes["transformer.h.0.attn.qkv.weight"].blocks == (8,) * 8


class OwnAttention(nn.Module):
    """An attention of one's own, with no ``qk_layout()``: its heads cannot be read."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(16, 16, bias=False) for _ in range(4))

    def forward(self, x):
        return self.wo(self.wv(x) + self.wq(x) * self.wk(x))


def test_an_attention_whose_heads_cannot_be_read_is_refused_by_name():
    net = nn.Sequential(nn.Linear(4, 16), OwnAttention(), nn.Linear(16, 4))
    route_parameters(net)  # not read without split_heads
    with pytest.raises(ValueError, match=r"^split_heads cannot read every attention's heads: cannot find the query "
                                         r"and key heads of 1 \(OwnAttention\): .* give such a module's weights their "
                                         r"head blocks by hand with matrix_blocks"):
        route_parameters(net, split_heads=True)
    blocks = {"1.w[qkv].weight": [4, 4, 4, 4], "1.wo.weight": None}  # every matrix of it decided: not read
    routes = {r.name: r for r in route_parameters(net, split_heads=True, matrix_blocks=blocks).routes}
    assert [routes[f"1.w{x}.weight"].blocks for x in "qkvo"] == [(4, 4, 4, 4)] * 3 + [None]
    net[1].requires_grad_(False)  # frozen: nothing of it to split, so its heads are not read
    assert all(r.blocks is None for r in route_parameters(net, split_heads=True).routes)


def test_a_muon_class_that_cannot_split_refuses_it():
    with pytest.raises(ValueError, match=r"split_heads splits `model.layers.0.self_attn.q_proj.weight` into blocks, "
                                         r"which torch.optim.Muon cannot do"):
        route_parameters(built(MODELS["llama"]), split_heads=True, muon_nd=False)


def test_muon_with_adamw_takes_it_with_a_model():
    net = built(MODELS["llama"])
    opt = MuonWithAdamW.from_model(net, split_heads=True)
    (muon_group,) = [g for g in opt.param_groups if g["algorithm"] == "muon"]
    held = {n: b for n, b in zip(muon_group["param_names"], muon_group["matrix_blocks"], strict=True) if b}
    assert held == {n: list(b) for n, b in HEADS["llama"].items()}
    with pytest.raises(ValueError, match=r"split_fused / split_heads / matrix_blocks are routing settings"):
        MuonWithAdamW(route_parameters(net), split_heads=True)


def _heads_stepped() -> tuple[list[torch.Tensor], str]:
    """The shipped GPT routed with ``split_heads``, two Muon steps on seeded gradients (the same on every rank, as
    after DDP's all-reduce): its Muon matrices, and the path the Newton-Schulz work took."""
    routing = route_parameters(built(MODELS["char_gpt"]), split_heads=True)
    opt = Muon(routing.muon_groups, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    params = [p for group in opt.param_groups for p in group["params"]]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in params], opt.strategy.description


def _ddp_worker(rank: int, init_file: str, out: str) -> None:
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    params, path = _heads_stepped()
    torch.save({"params": params, "path": path}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_heads_under_ddp_split_equal_one_process(tmp_path):
    """Under DDP the heads' Newton-Schulz work is split over the ranks (each head a matrix of its own there), and
    the result is one process's."""
    import torch.multiprocessing as mp

    from helpers import RANKS_START_METHOD

    mp.start_processes(_ddp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method=RANKS_START_METHOD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    params, _ = _heads_stepped()
    for r in ranks:
        assert r["path"].startswith("Newton-Schulz split over 2 DDP ranks (")
        torch.testing.assert_close(r["params"], params, atol=1e-6, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True))
