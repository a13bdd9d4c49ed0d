"""The measured per-head max logit is the max of the logits the attention itself materialises (its softmax
input, or ``q @ k^T * scale`` rebuilt from what it hands SDPA), on every supported family: RoPE, GQA, causal and
padding masks, partial rotary, GPT-2's per-layer scale; and the chunked maths against the full matrix."""

from __future__ import annotations

import pytest
import qk_models
import torch
from torch import nn

from lightning_muon.attention import (
    QKClipper,
    QKLayout,
    QKProjection,
    UnsupportedAttentionError,
    find_attention,
    max_attention_logits,
)


def measured(model: nn.Module, ids: torch.Tensor, spy, **kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(ours per layer, the spy's per layer) for one training-mode forward."""
    model.train()
    with QKClipper(model, tau=None) as clipper, clipper.recording(), spy as reference:
        qk_models.logits_of(model, ids, **kwargs)
        ours = list(clipper.max_logits().values())
    return ours, [r.float() for r in reference]


def assert_same(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert len(ours) == len(reference) and ours
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


IDS = torch.randint(qk_models.VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))
PADDED = torch.ones(3, 12, dtype=torch.long)
PADDED[1, :4] = 0  # left padding on one sequence
PADDED[2, 9:] = 0  # right padding on another


def _sharpen(model: nn.Module) -> nn.Module:
    """Larger q/k weights, so the maxima are far apart and a wrong mask or head shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("padding", [False, True])
def test_transformers_llama_gqa_rope(attn, padding):
    model = _sharpen(qk_models.llama(attn))
    spy = qk_models.softmax_inputs(4) if attn == "eager" else qk_models.sdpa_logits()
    kwargs = {"attention_mask": PADDED} if padding else {}
    assert_same(*measured(model, IDS, spy, **kwargs))


def test_transformers_qwen2_multi_query_with_biases():
    model = _sharpen(qk_models.qwen2("sdpa"))
    (site, *_) = find_attention(model)
    assert (site.layout.num_heads, site.layout.num_kv_heads) == (4, 1) and site.layout.query.bias is not None
    assert_same(*measured(model, IDS, qk_models.sdpa_logits()))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_transformers_gpt2_fused_conv1d(attn):
    model = _sharpen(qk_models.gpt2(attn))
    (site, *_) = find_attention(model)
    assert site.layout.query.transposed and site.layout.key.offset == 32
    spy = qk_models.softmax_inputs(4) if attn == "eager" else qk_models.sdpa_logits()
    assert_same(*measured(model, IDS, spy, attention_mask=PADDED))


def test_litgpt_fused_qkv_gqa_partial_rope():
    model = _sharpen(qk_models.litgpt())
    sites = find_attention(model)
    assert [s.family for s in sites] == ["litgpt", "litgpt"]
    assert (sites[0].layout.num_kv_heads, sites[0].layout.key.offset) == (2, 32)
    assert_same(*measured(model, IDS, qk_models.sdpa_logits()))


def test_torch_multihead_attention_with_causal_and_padding_masks():
    model = _sharpen(qk_models.MHALM())
    padding = PADDED == 0  # MultiheadAttention: True = ignore
    assert_same(*measured(model, IDS, qk_models.sdpa_logits(), key_padding_mask=padding))


def test_own_attention_through_the_adapter():
    model = _sharpen(qk_models.OwnLM())
    assert [s.family for s in find_attention(model)] == ["adapter", "adapter"]
    assert_same(*measured(model, IDS, qk_models.sdpa_logits()))


def test_validation_forwards_outside_recording_are_not_measured():
    model = qk_models.OwnLM()
    with QKClipper(model, tau=None) as clipper:
        model(IDS)
        assert all(torch.isneginf(t).all() for t in clipper.max_logits().values())


def test_capture_is_removed():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = qk_models.llama("sdpa")
    lit = qk_models.litgpt()
    with QKClipper(model, tau=None), QKClipper(lit, tau=None):
        assert "get_interface" in vars(ALL_ATTENTION_FUNCTIONS)
        assert "scaled_dot_product_attention" in vars(lit.transformer.h[0].attn)
    assert "get_interface" not in vars(ALL_ATTENTION_FUNCTIONS)
    assert "scaled_dot_product_attention" not in vars(lit.transformer.h[0].attn)


# ------------------------------------------------------------------ the chunked maths


def _full(q, k, scale, causal, keep):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    rows, cols = q.shape[2], k.shape[2]
    if causal:
        logits = logits.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(cols - rows + 1), float("-inf"))
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("chunk", [1, 37, 1 << 22])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv", "rows", "cols"), [(4, 4, 9, 9), (6, 2, 7, 11), (4, 1, 1, 5)])
def test_chunks_give_the_full_matrix_max(chunk, causal, heads, kv, rows, cols):
    g = torch.Generator().manual_seed(heads * 100 + rows)
    q, k = torch.randn(2, heads, rows, 8, generator=g), torch.randn(2, kv, cols, 8, generator=g)
    keep = torch.rand(2, 1, rows, cols, generator=g) > 0.3
    keep[..., 0] = True  # every query row sees something
    for mask in (None, keep):
        found = max_attention_logits(q, k, scale=0.35, causal=causal, keep=mask, chunk_elements=chunk)
        torch.testing.assert_close(found, _full(q, k, 0.35, causal, mask), rtol=1e-6, atol=1e-6)


def test_a_head_that_sees_nothing_is_minus_infinity():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    keep = torch.zeros(1, 2, 3, 3, dtype=torch.bool)
    keep[:, 1] = True
    found = max_attention_logits(q, k, scale=1.0, keep=keep)
    assert torch.isneginf(found[0]) and torch.isfinite(found[1])


# ------------------------------------------------------------------ refusals


class LooksLikeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 24)


class WrongLayout(qk_models.OwnAttention):
    def qk_layout(self) -> QKLayout:
        return QKLayout(query=QKProjection(self.wq.weight), key=QKProjection(self.wk.weight, offset=8),
                        num_heads=4, num_kv_heads=2, head_dim=8)


def _net(inner: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), inner)


REFUSALS = [
    (lambda: _net(LooksLikeAttention()), UnsupportedAttentionError, r"1 \(LooksLikeAttention\).*qk_layout.*exclude"),
    (lambda: _net(nn.MultiheadAttention(8, 2, add_bias_kv=True)), UnsupportedAttentionError, "add_bias_kv"),
    (lambda: _net(WrongLayout()), ValueError, r"1: 2 key heads of 8 from output feature 8 need 24"),
    (lambda: nn.Sequential(nn.Linear(8, 8)), ValueError, "found no attention module in Sequential"),
]


@pytest.mark.parametrize(("build", "error", "message"), REFUSALS)
def test_refusals_name_the_module_and_the_fix(build, error, message):
    with pytest.raises(error, match=message):
        QKClipper(build(), tau=None)


def test_excluded_modules_are_not_refused():
    sites = find_attention(nn.Sequential(LooksLikeAttention(), qk_models.OwnAttention()), exclude=["0"])
    assert [s.name for s in sites] == ["1"]


def test_qk_norm_is_measured_but_not_clipped():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen3ForCausalLM(config)
    with pytest.raises(UnsupportedAttentionError, match=r"model.layers.0.self_attn \(Qwen3Attention\).*QK-norm"):
        QKClipper(model, tau=100.0)
    assert_same(*measured(model, IDS, qk_models.sdpa_logits()))


def test_a_found_attention_that_reports_nothing_is_an_error():
    model = nn.ModuleDict({"used": qk_models.OwnAttention(), "unused": qk_models.OwnAttention()})
    with QKClipper(model, tau=10.0) as clipper:
        with clipper.recording():
            model["used"](torch.randn(1, 5, 32))
        with pytest.raises(UnsupportedAttentionError, match=r"no q/k capture of unused \(OwnAttention\)"):
            clipper.clip()


def test_one_meter_per_module_at_a_time():
    from lightning_muon.attention.layout import RECORDERS

    model = qk_models.OwnLM()
    with QKClipper(model.blocks[1], tau=None):
        with pytest.raises(RuntimeError, match=r"blocks.1 \(OwnAttention\) is measured already"):
            QKClipper(model, tau=None)
        assert model.blocks[0] not in RECORDERS  # the failed clipper took back what it had installed
    QKClipper(model, tau=None).remove()  # free again once the first is removed


def test_flash_style_padding_masks_are_read_as_batch_by_key():
    """transformers' flash attention gets a (batch, S) 0/1 padding mask and applies causality itself."""
    from lightning_muon.attention._families import _measured

    seen = []

    class Causal(nn.Module):
        is_causal = True

    module = Causal()
    from lightning_muon.attention.layout import RECORDERS

    RECORDERS[module] = lambda q, k, scale, causal, keep: seen.append((scale, causal, keep))
    try:
        q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
        padding = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
        _measured(lambda *a, **kw: None)(module, q, k, k, padding, scaling=0.5)
    finally:
        del RECORDERS[module]
    ((scale, causal, keep),) = seen
    assert scale == 0.5 and causal and keep.shape == (2, 1, 1, 5)
    assert keep[1, 0, 0].tolist() == [False, False, True, True, True]


def test_flex_attention_is_refused_at_construction():
    model = qk_models.llama("sdpa")
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "flex_attention"
    with pytest.raises(UnsupportedAttentionError, match=r"model.layers.0.self_attn \(LlamaAttention\) runs flex"):
        QKClipper(model, tau=None)
