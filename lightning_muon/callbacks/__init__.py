"""Callbacks: `MuonMonitor` (learning rates and orthogonality in the logger), `WallClock` (time and tokens) and
`QKClip` (the per-head max attention logit, logged and capped)."""

from lightning_muon.callbacks.clock import WallClock
from lightning_muon.callbacks.monitor import MuonMonitor
from lightning_muon.callbacks.qk_clip import QKClip

__all__ = ["MuonMonitor", "QKClip", "WallClock"]
