"""lightning_muon: the Muon optimizer as a one-line change for PyTorch Lightning.

The public API, in four tiers (named here and nowhere else; ``tests/test_public_api.py`` pins their names):

1. this module, ``lightning_muon.__all__``: the optimizer (`Muon`, `MuonWithAdamW`), the mixin, the callbacks,
   the routing and the Newton-Schulz functions;
2. ``lightning_muon.attention``: QK-Clip in plain PyTorch (`QKClipper`), and the adapter (`QKLayout`,
   `QKProjection`, `record_qk`) that teaches it an attention it does not know;
3. ``lightning_muon.optim.groups``: what a param group's settings mean (shapes, layouts, the effective lr, the
   Newton-Schulz dtype and path), for code that reads the optimizers' param groups;
4. ``lightning_muon.optim.rules``: the update rules (NorMuon, cautious weight decay), one class each, and
   `register_rule` for a rule of your own.

The names these hand out are public with them (`Muon.strategy`'s ``lightning_muon.optim.StrategyInfo``). Each
subpackage declares in its ``__all__`` what it exports to the tiers and to the subpackages above it; everything
else (modules and names starting with ``_``, and every module not named above) may change between releases.
The command line (``lightning-muon``) is an interface of its own.

Names load on first use, so ``from lightning_muon import Muon`` (or ``import
lightning_muon.optim``, or ``MuonWithAdamW``) needs torch only: Lightning is imported
by the names that need it (`MuonMixin`, `muon_subclass`, `MuonMonitor`, `QKClip`, `WallClock`,
`MomentumSchedule`, `WeightDecaySchedule`).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_muon.callbacks import MomentumSchedule, MuonMonitor, QKClip, WallClock, WeightDecaySchedule
    from lightning_muon.combined import MuonWithAdamW
    from lightning_muon.lightning import MuonBackboneFinetuning, MuonMixin, muon_subclass
    from lightning_muon.optim import (
        Muon,
        ParamDiagnostics,
        WarmupCosine,
        adjust_lr,
        orthogonality_error,
        zeropower_via_newtonschulz,
    )
    from lightning_muon.routing import GraphRoles, Routing, route_parameters, trace_roles

#: Each public name and the subpackage that defines it.
_EXPORTS = {
    "GraphRoles": "lightning_muon.routing",
    "MomentumSchedule": "lightning_muon.callbacks",
    "Muon": "lightning_muon.optim",
    "MuonBackboneFinetuning": "lightning_muon.lightning",
    "MuonMixin": "lightning_muon.lightning",
    "MuonMonitor": "lightning_muon.callbacks",
    "MuonWithAdamW": "lightning_muon.combined",
    "ParamDiagnostics": "lightning_muon.optim",
    "QKClip": "lightning_muon.callbacks",
    "Routing": "lightning_muon.routing",
    "WallClock": "lightning_muon.callbacks",
    "WarmupCosine": "lightning_muon.optim",
    "WeightDecaySchedule": "lightning_muon.callbacks",
    "adjust_lr": "lightning_muon.optim",
    "orthogonality_error": "lightning_muon.optim",
    "route_parameters": "lightning_muon.routing",
    "trace_roles": "lightning_muon.routing",
    "muon_subclass": "lightning_muon.lightning",
    "zeropower_via_newtonschulz": "lightning_muon.optim",
}

__all__ = [
    "GraphRoles",
    "MomentumSchedule",
    "Muon",
    "MuonBackboneFinetuning",
    "MuonMixin",
    "MuonMonitor",
    "MuonWithAdamW",
    "ParamDiagnostics",
    "QKClip",
    "Routing",
    "WallClock",
    "WarmupCosine",
    "WeightDecaySchedule",
    "adjust_lr",
    "muon_subclass",
    "orthogonality_error",
    "route_parameters",
    "trace_roles",
    "zeropower_via_newtonschulz",
]
__version__ = "0.1.0"

# A library adds no output of its own to its logger (the ``lightning_muon`` logger: the optimizer's line on which
# path a distributed run takes), only a handler that drops what no other handler takes; the application (the
# ``lightning-muon`` command: `lightning_muon.commands.cli.main`) decides where the records go.
logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    """Import a public name's subpackage on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_muon' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The declared public surface (`__all__`), not the module's own imports and helpers."""
    return sorted(__all__)
