"""The optimizer: `Muon` (a drop-in superset of ``torch.optim.Muon``), its Newton-Schulz maths and schedules.

Layers, bottom to top: `newton_schulz` (pure batched functions) and `groups` (what a param group's settings mean:
shapes, effective lr, Newton-Schulz dtype and path; a public tier of its own, see `lightning_muon`; read by the
callbacks and the Lightning config), ``_bucket`` (the same-shape matrices one Newton-Schulz call takes), `rules` (the
update rules, one class each, and `rules.register_rule` for a user's: a public tier too), ``_update`` (momentum,
orthogonalise, apply, diagnostics on buckets), ``_collectives`` (process groups and byte exchanges), ``_plan`` (which
rank orthogonalises which matrices, exchange rounds), ``_strategies`` (local, DDP-split, FSDP2-owner: they call the
rules and name none), ``_choice`` (which strategy, said once, and `StrategyInfo`, what `Muon.strategy` tells of it),
`muon` (the optimizer class), `adamw` (torch's AdamW with cautious weight decay, for the pair's other half).
``_precision`` (the Newton-Schulz dtype by hardware, agreed across ranks) and ``_registry`` (the rules by their group
key) serve `groups`; ``_dtensor`` (is a tensor a DTensor?) and `norms` (norms, clipping and rank agreement over
tensors and DTensors, which the mixin's update loop imports too) sit under them all, `schedulers` stands apart.
Nothing here imports Lightning (``tests/test_layout.py`` checks it).
"""

from lightning_muon.optim import groups
from lightning_muon.optim._choice import StrategyInfo
from lightning_muon.optim._update import preview_update
from lightning_muon.optim.adamw import AdamW
from lightning_muon.optim.muon import Muon, ParamDiagnostics, adjust_lr
from lightning_muon.optim.newton_schulz import orthogonality_error, zeropower_via_newtonschulz
from lightning_muon.optim.schedulers import WarmupCosine

__all__ = [
    "AdamW",
    "Muon",
    "ParamDiagnostics",
    "StrategyInfo",
    "WarmupCosine",
    "adjust_lr",
    "groups",
    "orthogonality_error",
    "preview_update",
    "zeropower_via_newtonschulz",
]
