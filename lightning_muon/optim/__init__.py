"""The optimizer: `Muon` (a drop-in superset of ``torch.optim.Muon``), its Newton-Schulz maths and schedules.

Layers, bottom to top: `newton_schulz` (pure batched functions), ``_collectives``
(process groups and byte exchanges), ``_update`` (momentum, orthogonalise, apply,
diagnostics on buckets of same-shape matrices), ``_plan`` (which rank orthogonalises
which matrices, exchange rounds), ``_strategies`` (local, DDP-split, FSDP2-owner),
`muon` (the optimizer class). `schedulers` stands apart. Nothing here imports
Lightning (``tests/test_layout.py`` checks it).
"""

from lightning_muon.optim.muon import Muon, ParamDiagnostics, adjust_lr
from lightning_muon.optim.newton_schulz import orthogonality_error, zeropower_via_newtonschulz
from lightning_muon.optim.schedulers import WarmupCosine

__all__ = ["Muon", "ParamDiagnostics", "WarmupCosine", "adjust_lr", "orthogonality_error", "zeropower_via_newtonschulz"]
