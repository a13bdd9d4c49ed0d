"""The Lightning side: `MuonMixin` (a thin facade) over its config, update loop, checkpoint check and
``_compat`` (every use of Lightning's private API, in one module)."""

from lightning_muon.lightning.mixin import MuonMixin

__all__ = ["MuonMixin"]
