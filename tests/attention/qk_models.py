"""Tiny attention models of the four supported families (random init, no downloads), an adapter module, and
spies that record the logits an attention materialises, to check the measured max logits against.

Importable as ``qk_models`` from the tests in this directory (pytest puts a test's directory on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_muon.attention import QKLayout, QKProjection, record_qk

VOCAB = 64


def llama(
    attn: str = "eager", *, heads: int = 4, kv_heads: int = 2, bias: bool = False, layers: int = 2
) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=64, attention_bias=bias, bos_token_id=0,
        eos_token_id=1, pad_token_id=2,
    )
    config._attn_implementation = attn
    return LlamaForCausalLM(config)


def qwen2(attn: str = "sdpa", *, layers: int = 2) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
    )
    config._attn_implementation = attn
    return Qwen2ForCausalLM(config)


def gpt2(attn: str = "eager", *, layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=layers, n_head=4, bos_token_id=0, eos_token_id=1,
        scale_attn_by_inverse_layer_idx=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    config._attn_implementation = attn
    return GPT2LMHeadModel(config)


def litgpt(*, heads: int = 4, groups: int = 2, layers: int = 2) -> nn.Module:
    from litgpt import GPT, Config

    config = Config(
        n_layer=layers, n_head=heads, n_query_groups=groups, n_embd=32, block_size=32, vocab_size=VOCAB,
        padded_vocab_size=VOCAB, rotary_percentage=0.5, bias=True,
    )
    return GPT(config)


class MHALM(nn.Module):
    """A causal LM of ``nn.TransformerEncoderLayer`` blocks (``nn.MultiheadAttention``, batch first)."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        x = self.embed(ids)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=torch.bool)
        for block in self.blocks:
            x = block(x, src_mask=causal, src_key_padding_mask=key_padding_mask)
        return self.head(x)


def rope(x: Tensor) -> Tensor:
    """A plain rotary embedding over the last dim of ``(B, H, T, D)``."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class OwnAttention(nn.Module):
    """A user's own GQA attention with RoPE and separate wq/wk/wv, through the adapter."""

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.wq = nn.Linear(width, width, bias=True)
        self.wk = nn.Linear(width, kv_heads * self.head_dim, bias=True)
        self.wv = nn.Linear(width, kv_heads * self.head_dim)
        self.out = nn.Linear(width, width)

    def qk_layout(self) -> QKLayout:
        return QKLayout(
            query=QKProjection(self.wq.weight, self.wq.bias), key=QKProjection(self.wk.weight, self.wk.bias),
            num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
        )

    def forward(self, x: Tensor) -> Tensor:
        q = rope(self.wq(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2))
        k = rope(self.wk(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2))
        v = self.wv(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        record_qk(self, q, k, scale=self.head_dim**-0.5, causal=True)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).flatten(2))


class OwnLM(nn.Module):
    def __init__(self, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(OwnAttention(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def logits_of(model: nn.Module, ids: Tensor, **kwargs: object) -> Tensor:
    out = model(ids, **kwargs)
    return out if isinstance(out, Tensor) else out.logits if hasattr(out, "logits") else out[0]


# ------------------------------------------------------------------ spies on what attention materialises


def _per_head_max(logits: Tensor) -> Tensor:
    return logits.float().amax(dim=(0, 2, 3))


@contextlib.contextmanager
def softmax_inputs(heads: int) -> Iterator[list[Tensor]]:
    """Record the per-head max of every ``F.softmax`` input (eager attention's materialised logits, masked
    entries at -inf or the dtype's min), ``(B*H, T, S)`` inputs viewed as ``(B, H, T, S)``."""
    found: list[Tensor] = []
    original = F.softmax

    def spy(input: Tensor, *args: object, **kwargs: object) -> Tensor:
        x = input if input.dim() == 4 else input.unflatten(0, (-1, heads))
        found.append(_per_head_max(x))
        return original(input, *args, **kwargs)

    F.softmax = spy  # type: ignore[assignment]
    try:
        yield found
    finally:
        F.softmax = original


@contextlib.contextmanager
def sdpa_logits() -> Iterator[list[Tensor]]:
    """Record, per ``F.scaled_dot_product_attention`` call, the per-head max of ``q @ k^T * scale`` materialised
    in full with the call's own mask (``is_causal``, bool or additive ``attn_mask``, GQA keys repeated)."""
    found: list[Tensor] = []
    original = F.scaled_dot_product_attention

    def spy(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
            is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        factor = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
        logits = (q.double() @ kk.double().transpose(-1, -2)) * factor
        if is_causal:
            logits = logits.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), float("-inf"))
        if attn_mask is not None:
            boolean = attn_mask.dtype == torch.bool
            logits = logits.masked_fill(~attn_mask, float("-inf")) if boolean else logits + attn_mask
        found.append(_per_head_max(logits))
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = spy  # type: ignore[assignment]
    try:
        yield found
    finally:
        F.scaled_dot_product_attention = original
