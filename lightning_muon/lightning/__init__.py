"""The Lightning side: `MuonMixin` (a thin facade over the fit's state, its optimizer pair, update loop and
checkpoints; every use of Lightning's private API in ``_compat``), `MuonBackboneFinetuning` (Lightning's
``BackboneFinetuning`` with one backbone lr per optimizer), and `muon_subclass`, the mixed class under the parent's
own name, for libraries that look a model up by its class name; `consolidate`, an FSDP2 checkpoint directory as one
file (``lightning-muon convert-checkpoint``); `SKIPPED_STEPS_KEY`, the key the update loop logs skipped updates
under."""

from lightning_muon.lightning._checkpoint import consolidate
from lightning_muon.lightning._named import muon_subclass
from lightning_muon.lightning._update_loop import SKIPPED_STEPS_KEY
from lightning_muon.lightning.finetuning import MuonBackboneFinetuning
from lightning_muon.lightning.mixin import MuonMixin

__all__ = ["SKIPPED_STEPS_KEY", "MuonBackboneFinetuning", "MuonMixin", "consolidate", "muon_subclass"]
