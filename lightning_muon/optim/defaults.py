"""The default settings, in one table.

Two sets: `lightning_muon.Muon`'s own defaults (``torch.optim.Muon``'s, so the class stays a drop-in
replacement), and the Muon and AdamW settings that the pair starts from in both ways in,
`lightning_muon.MuonMixin` and `lightning_muon.MuonWithAdamW` (Keller Jordan's Muon on the hidden matrices;
AdamW on embeddings, heads, norms and biases). The constructors keep explicit keyword signatures (LightningCLI
and ``--help`` read them); their default values come from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_muon.optim._strategies import EXCHANGE_ROUND_BYTES
from lightning_muon.optim.newton_schulz import DEFAULT_EPS, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS

__all__ = ["DEFAULT_GRAM_ASPECT", "MUON_CLASS", "PAIRED_ADAMW", "PAIRED_MUON", "AdamWDefaults", "MuonDefaults"]

#: Matrices at least this many times longer than wide go through Gram Newton-Schulz by default: from 3:1 on
#: it measured faster at every size (0.73-0.90x the standard iteration's time at 3:1, 0.53-0.70x at 9:1; at 2:1
#: 0.86-1.00x), by the sweep of benchmarks/optimizer_step.py (bf16, CPU); the iteration's result is the same.
DEFAULT_GRAM_ASPECT = 3.0


@dataclass(frozen=True)
class MuonDefaults:
    """`lightning_muon.Muon`'s keyword arguments and their default values (see its docstring)."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] | str = DEFAULT_NS_COEFFICIENTS
    eps: float = DEFAULT_EPS
    ns_steps: int = DEFAULT_NS_STEPS
    adjust_lr_fn: str | None = None
    #: ``None``: by hardware, bf16 where the device computes it natively, float32 where it would be emulated
    #: (``lightning_muon.optim._precision``); ``torch.optim.Muon`` always computes in bf16.
    ns_dtype: torch.dtype | None = None
    ns_batch_bytes: int | None = None
    ns_gram_aspect: float | None = DEFAULT_GRAM_ASPECT
    #: ``None``: Frobenius normalisation; ``"aol"``: Turbo-Muon's AOL preconditioning (`newton_schulz.aol_scale`).
    ns_precondition: str | None = None
    split_ns: bool = True
    exchange_round_bytes: int = EXCHANGE_ROUND_BYTES
    normuon_beta2: float | None = None
    cautious_weight_decay: bool = False


@dataclass(frozen=True)
class AdamWDefaults:
    """``torch.optim.AdamW``'s settings for the parameters that are not Muon's."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    eps: float = 1e-8  # torch's
    amsgrad: bool = False  # torch's


#: `lightning_muon.Muon`'s own defaults: ``torch.optim.Muon``'s, and the extras' (`MuonDefaults`).
MUON_CLASS = MuonDefaults()
#: Muon as `lightning_muon.MuonMixin` and `lightning_muon.MuonWithAdamW` start it: Keller Jordan's settings.
PAIRED_MUON = MuonDefaults(lr=0.02, weight_decay=0.01, momentum=0.95)
#: AdamW as `lightning_muon.MuonMixin` and `lightning_muon.MuonWithAdamW` start it, on embeddings, heads, norms
#: and biases.
PAIRED_ADAMW = AdamWDefaults(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
