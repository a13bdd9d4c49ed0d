"""Callbacks: `MuonMonitor` (learning rates and orthogonality in the logger), `WallClock` (time and tokens) and
`QKClip` (the per-head max attention logit, logged and capped), `MomentumSchedule` and `WeightDecaySchedule`
(Muon's momentum warm-up and cooldown, weight decay following the lr)."""

from lightning_muon.callbacks.clock import WallClock
from lightning_muon.callbacks.monitor import MuonMonitor
from lightning_muon.callbacks.qk_clip import QKClip
from lightning_muon.callbacks.schedules import MomentumSchedule, WeightDecaySchedule

__all__ = ["MomentumSchedule", "MuonMonitor", "QKClip", "WallClock", "WeightDecaySchedule"]
