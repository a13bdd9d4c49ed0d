"""One optimizer holding both algorithms: `MuonWithAdamW` (Muon on the hidden matrices, AdamW on the rest), for
frameworks that take a single optimizer (transformers' ``Trainer``, recipe configs, Lightning's automatic
optimization), and the conversion of its state to and from the pair ``[Muon, AdamW]`` (`split_state_dict`,
`merge_state_dicts`).

A layer above ``optim/`` and ``routing/`` (it routes a model and delegates to `lightning_muon.Muon` and
``torch.optim.AdamW``), below ``lightning/``; like them it imports no Lightning (``tests/test_layout.py``).
"""

from lightning_muon.combined.muon_with_adamw import MuonWithAdamW
from lightning_muon.combined.state import merge_state_dicts, split_state_dict

__all__ = ["MuonWithAdamW", "merge_state_dicts", "split_state_dict"]
