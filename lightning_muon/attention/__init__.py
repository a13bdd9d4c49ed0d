"""QK-Clip (MuonClip) for any attention, in plain PyTorch: find the attention modules and their q/k heads,
measure each head's exact max attention logit from the q and k the attention uses, and clip.

No Lightning here: `lightning_muon.QKClip` is the callback over `QKClipper`.
"""

from lightning_muon.attention._families import AttentionSite, UnsupportedAttentionError, find_attention
from lightning_muon.attention.clip import clip_factors, qk_clip_
from lightning_muon.attention.clipper import QKClipper, QKClipStats
from lightning_muon.attention.layout import QKLayout, QKProjection, record_qk
from lightning_muon.attention.logits import max_attention_logits

__all__ = [
    "AttentionSite",
    "QKClipStats",
    "QKClipper",
    "QKLayout",
    "QKProjection",
    "UnsupportedAttentionError",
    "clip_factors",
    "find_attention",
    "max_attention_logits",
    "qk_clip_",
    "record_qk",
]
