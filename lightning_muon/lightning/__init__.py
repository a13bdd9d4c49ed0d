"""The Lightning side: `MuonMixin` (a thin facade) over its config, update loop, checkpoint check and
``_compat`` (every use of Lightning's private API, in one module); and `muon_subclass`, the mixed class under
the parent's own name, for libraries that look a model up by its class name."""

from lightning_muon.lightning._named import muon_subclass
from lightning_muon.lightning.mixin import MuonMixin

__all__ = ["MuonMixin", "muon_subclass"]
