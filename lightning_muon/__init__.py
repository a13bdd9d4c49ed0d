"""lightning_muon: the Muon optimizer as a one-line change for PyTorch Lightning."""

from lightning_muon.mixin import MuonMixin
from lightning_muon.monitor import MuonMonitor
from lightning_muon.muon import Muon, ParamDiagnostics, adjust_lr
from lightning_muon.newton_schulz import orthogonality_error, zeropower_via_newtonschulz
from lightning_muon.routing import Routing, route_parameters
from lightning_muon.schedulers import WarmupCosine

__all__ = [
    "Muon",
    "MuonMixin",
    "MuonMonitor",
    "ParamDiagnostics",
    "Routing",
    "WarmupCosine",
    "adjust_lr",
    "orthogonality_error",
    "route_parameters",
    "zeropower_via_newtonschulz",
]
__version__ = "0.1.0"
