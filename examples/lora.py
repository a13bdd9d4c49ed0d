"""LoRA fine-tuning of the pretrained byte-level GPT, with PEFT: the recipe behind ``gpt_lora_muon.yaml``.

`LoraGPT` loads a `GPT` checkpoint (``init_from``), freezes it, and adds
PEFT's LoRA adapters (``lora_A``, ``r x in``, and ``lora_B``, ``out x r``) to the
block matrices (``qkv``, ``proj``, ``fc``; never the embeddings or the head).
Only the adapters train. `MuonLoraGPT` is the same model under `MuonMixin`:
the routing puts ``lora_A`` on Muon and ``lora_B`` on AdamW (where they trained
best, ``benchmarks/finetune.py``), and the mixin's routing settings choose
otherwise (``muon_params: ["*lora_B*"]`` puts ``lora_B`` on Muon too; ``muon:
null`` puts everything on AdamW).
Two commands, a few minutes on 2 CPU cores::

    lightning-muon fit --config gpt_adamw.yaml      # pretrain on the standard library's sources
    lightning-muon fit --config gpt_lora_muon.yaml \\
        --model.init_from lightning_logs/gpt_adamw/version_0/checkpoints/epoch=0-step=300.ckpt

After training, ``module.model`` is the PEFT model: ``module.model.merge_and_unload()`` gives a plain `GPT`
with the adapters merged into its weights.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_muon import MuonMixin
from lightning_muon.examples._extras import require
from lightning_muon.examples.char_gpt import GPT, ByteLM

__all__ = ["LORA_TARGETS", "LoraGPT", "MuonLoraGPT", "base_arguments"]

#: The block matrices LoRA adapts by default: attention ``qkv`` and ``proj``, MLP ``fc`` and ``proj``.
LORA_TARGETS = ("qkv", "proj", "fc")


class LoraGPT(ByteLM):
    """A pretrained `GPT`, frozen, with PEFT LoRA adapters on its block matrices; only the adapters train.

    On its own it trains with AdamW (lr 1e-3, betas (0.9, 0.95)) on the adapters under automatic optimization;
    `MuonLoraGPT` is the Muon version. ``self.model`` is the ``peft.PeftModel`` around the `GPT`.

    Args:
        init_from: the pretrained weights: a Lightning checkpoint of `GPT` or `CharGPT` (``lightning-muon fit
            --config gpt_adamw.yaml`` writes one), or a ``torch.save``'d state dict with ``base`` given.
            Required to fine-tune; not a saved hyperparameter (a checkpoint of this module holds the base
            weights too, so it loads without that file).
        lora_rank: ``r``, the adapters' rank.
        lora_alpha: the adapters' scale is ``lora_alpha / lora_rank``.
        lora_targets: the block matrices to adapt, by module name (``qkv``, ``proj``, ``fc``).
        lora_dropout: dropout on the adapters' input.
        base: `GPT`'s arguments for the base model; default: those saved in ``init_from``'s checkpoint. Saved
            with this module's hyperparameters, so ``load_from_checkpoint`` rebuilds the model without
            ``init_from`` (without ``init_from``, the base is `GPT`'s random init until a checkpoint loads).
    """

    def __init__(
        self,
        init_from: str | None = None,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_targets: Sequence[str] = LORA_TARGETS,
        lora_dropout: float = 0.0,
        base: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        peft = require("peft", "peft", "examples")
        if init_from is None and base is None:
            raise ValueError(
                f"{type(self).__name__} fine-tunes a pretrained GPT: give init_from, a Lightning checkpoint of GPT "
                "or CharGPT (lightning-muon fit --config gpt_adamw.yaml writes one under lightning_logs/gpt_adamw/; "
                "then --model.init_from PATH)"
            )
        if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
            raise ValueError(f"lora_rank must be an int >= 1, got {lora_rank!r}")
        if base is None:
            assert init_from is not None
            base = base_arguments(init_from)
        self.save_hyperparameters(ignore=["init_from"])
        self.hparams["base"] = dict(base)  # what init_from's checkpoint said: load_from_checkpoint needs no file
        config = peft.LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=list(lora_targets),
                                 lora_dropout=lora_dropout)
        self.model = peft.get_peft_model(GPT(**base, init_from=init_from), config)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(batch, time, 256)`` of the adapted model for byte indices ``idx`` of shape ``(batch, time)``."""
        return self.model(idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW on the adapters: used by `LoraGPT` alone, never by `MuonLoraGPT` (the mixin brings its own pair)."""
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3, betas=(0.9, 0.95))


def base_arguments(path: str | os.PathLike) -> dict[str, Any]:
    """`GPT`'s arguments as saved in the Lightning checkpoint ``path`` (of `GPT`, `CharGPT`, or any module that
    saves them); an error naming the fix when it holds none."""
    saved = torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None
    if saved is None:
        raise FileNotFoundError(f"init_from={str(path)!r}: no such file (a Lightning checkpoint of GPT or CharGPT)")
    hparams = saved.get("hyper_parameters") if isinstance(saved, dict) else None
    names = [n for n in inspect.signature(GPT.__init__).parameters if n not in ("self", "init_from")]
    if not isinstance(hparams, dict) or not any(n in hparams for n in names):
        raise ValueError(f"init_from={str(path)!r} holds no GPT hyperparameters (a plain state dict?): give the "
                         "base model's arguments too, base={'n_layer': ..., 'n_embd': ...}")
    return {n: hparams[n] for n in names if n in hparams}


class MuonLoraGPT(MuonMixin, LoraGPT):
    """`LoraGPT` trained with `MuonMixin`: ``lora_A`` on Muon and ``lora_B`` on AdamW (the routing's measured
    default), unless the routing settings say otherwise (``muon_params: ["*lora_B*"]``, or ``muon: null``).

    Takes `LoraGPT`'s arguments and `lightning_muon.MuonMixin`'s keyword-only optimizer arguments (``muon``,
    ``adamw``, ``muon_params``, ``adamw_params``, ...).
    """
