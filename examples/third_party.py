"""Models other libraries wrote, built from small configs with random init (nothing is downloaded), trained with Muon.

`ThirdPartyLM` wraps a causal language model that ``transformers`` or ``litgpt`` builds (``family``: a
transformers Llama or GPT-2, or a litgpt GPT) as a byte-level LightningModule for `StdlibTextDataModule`'s
windows; `ThirdPartyDigits` wraps transformers' ``ResNetForImageClassification`` for `DigitsDataModule`'s 8x8
digits. Neither says which parameter is what: Muon's routing finds the embeddings, heads and input layers on
its own (`MuonThirdPartyLM`, `MuonThirdPartyDigits` are the one-line Muon versions). They are the models of
``benchmarks/third_party.py``'s quality table::

    lightning-muon compare --sweep --seeds 2 llama_muon.yaml llama_adamw.yaml   # configs that name these classes
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_muon import MuonMixin
from lightning_muon.examples._extras import require
from lightning_muon.examples.char_gpt import ByteLM
from lightning_muon.examples.digits_cnn import DigitsClassifier

__all__ = ["FAMILIES", "MuonThirdPartyDigits", "MuonThirdPartyLM", "ThirdPartyDigits", "ThirdPartyLM", "build_lm"]

#: The language-model families `ThirdPartyLM` builds, and the library each comes from.
FAMILIES = {"llama": "transformers", "gpt2": "transformers", "qwen3_moe": "transformers", "litgpt": "litgpt"}
VOCAB_SIZE = 256  # bytes


def build_lm(family: str, n_layer: int, n_head: int, n_embd: int, block_size: int) -> nn.Module:
    """The ``family``'s causal LM with a 256-byte vocabulary, random init: transformers' ``LlamaForCausalLM``
    (grouped-query attention, SwiGLU MLP ``2.75 x n_embd``, RoPE, untied head), ``GPT2LMHeadModel`` (tied head,
    ``Conv1D`` weights stored ``in x out``) or ``Qwen3MoeForCausalLM`` (Llama-style attention with q/k norms; each
    MLP 8 SwiGLU experts of width ``n_embd``, 2 chosen a token by a linear router, stored as fused 3-D stacks; no
    load-balancing loss), or litgpt's ``GPT`` (Llama-style: RMSNorm, SwiGLU, RoPE, untied)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(map(repr, FAMILIES))}, got {family!r}")
    if family == "litgpt":
        litgpt = require("litgpt", "litgpt", "test")
        config = litgpt.Config(
            n_layer=n_layer, n_head=n_head, n_query_groups=max(1, n_head // 2), n_embd=n_embd,
            block_size=block_size, vocab_size=VOCAB_SIZE, padded_vocab_size=VOCAB_SIZE, bias=False,
            norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=int(2.75 * n_embd),
            rotary_percentage=1.0, parallel_residual=False,
        )
        return litgpt.GPT(config)
    transformers = require("transformers", "transformers", "test")
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=n_embd, intermediate_size=int(2.75 * n_embd),
            num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=max(1, n_head // 2),
            max_position_embeddings=block_size, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        )
        return transformers.LlamaForCausalLM(config)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB_SIZE, hidden_size=n_embd, intermediate_size=int(2.75 * n_embd),
            moe_intermediate_size=n_embd, num_experts=8, num_experts_per_tok=2, num_hidden_layers=n_layer,
            num_attention_heads=n_head, num_key_value_heads=max(1, n_head // 2), head_dim=n_embd // n_head,
            max_position_embeddings=block_size, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        )
        return transformers.Qwen3MoeForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=block_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        bos_token_id=0, eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class ThirdPartyLM(ByteLM):
    """A byte-level causal LM another library builds (`build_lm`), trained on ``(inputs, targets)`` windows.

    Its steps and logs are `ByteLM`'s (``train_loss``, ``val_loss``, ``val_bpb``, as `GPT`'s). On its own it
    trains with AdamW (lr 1e-3, betas (0.9, 0.95)); `MuonThirdPartyLM` is the Muon version.

    Args:
        family: ``"llama"``, ``"gpt2"`` or ``"qwen3_moe"`` (transformers) or ``"litgpt"``.
        n_layer: transformer blocks.
        n_head: attention heads (half as many key/value heads for Llama and litgpt).
        n_embd: width of the residual stream.
        block_size: longest context in bytes.
    """

    def __init__(self, family: str = "llama", n_layer: int = 2, n_head: int = 4, n_embd: int = 128,
                 block_size: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.family = family
        self.model = build_lm(family, n_layer, n_head, n_embd, block_size)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(batch, time, 256)`` for byte indices ``(batch, time)``."""
        if self.family == "litgpt":
            return self.model(idx)
        return self.model(input_ids=idx).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW on every parameter (`MuonThirdPartyLM` replaces it with the Muon pair)."""
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))


class MuonThirdPartyLM(MuonMixin, ThirdPartyLM):
    """`ThirdPartyLM` with Muon on the hidden matrices and AdamW on the rest, as routing finds them."""


class ThirdPartyDigits(DigitsClassifier):
    """transformers' ``ResNetForImageClassification`` (random init, one input channel) on 8x8 digits.

    Its steps and logs are `DigitsClassifier`'s (as `CNN`'s). On its own it trains with AdamW (lr 3e-3);
    `MuonThirdPartyDigits` is the Muon version.

    Args:
        hidden_sizes: channels of each ResNet stage.
        depths: basic blocks in each stage.
        embedding_size: channels of the stem conv.
    """

    def __init__(self, hidden_sizes: tuple[int, ...] = (32, 64), depths: tuple[int, ...] = (1, 1),
                 embedding_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        transformers = require("transformers", "transformers", "test")
        config = transformers.ResNetConfig(
            num_channels=1, embedding_size=embedding_size, hidden_sizes=list(hidden_sizes), depths=list(depths),
            layer_type="basic", downsample_in_first_stage=False, num_labels=10,
        )
        self.model = transformers.ResNetForImageClassification(config)

    def forward(self, images: Tensor) -> Tensor:
        """Logits ``(batch, 10)`` for images ``(batch, 1, 8, 8)``."""
        return self.model(pixel_values=images).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW on every parameter (`MuonThirdPartyDigits` replaces it with the Muon pair)."""
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class MuonThirdPartyDigits(MuonMixin, ThirdPartyDigits):
    """`ThirdPartyDigits` with Muon on the hidden conv kernels and AdamW on the stem, norms and classifier."""
