"""lightning_muon: the Muon optimizer as a one-line change for PyTorch Lightning.

The public API is what this module exports; everything else (modules and names
starting with ``_``, and the subpackages' internals) may change between releases.
"""

from lightning_muon.callbacks import MuonMonitor, WallClock
from lightning_muon.lightning import MuonMixin
from lightning_muon.optim import (
    Muon,
    ParamDiagnostics,
    WarmupCosine,
    adjust_lr,
    orthogonality_error,
    zeropower_via_newtonschulz,
)
from lightning_muon.routing import Routing, route_parameters

__all__ = [
    "Muon",
    "MuonMixin",
    "MuonMonitor",
    "ParamDiagnostics",
    "Routing",
    "WallClock",
    "WarmupCosine",
    "adjust_lr",
    "orthogonality_error",
    "route_parameters",
    "zeropower_via_newtonschulz",
]
__version__ = "0.1.0"
