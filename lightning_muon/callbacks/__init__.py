"""Callbacks: `MuonMonitor` (learning rates and orthogonality in the logger) and `WallClock` (time and tokens)."""

from lightning_muon.callbacks.clock import WallClock
from lightning_muon.callbacks.monitor import MuonMonitor

__all__ = ["MuonMonitor", "WallClock"]
