"""The hyperparameters a `MuonMixin` module saves: what its parent saves, exactly as the parent saves it, and the
mixin's own settings beside it as plain data, so a mixin checkpoint loads wherever the parent's does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities import rank_zero_warn

from lightning_muon.lightning import _compat
from lightning_muon.lightning._config import MuonConfig, plain_data

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule


def save_hyperparameters(module: LightningModule, config: MuonConfig) -> None:
    """Called from the mixin's ``__init__`` after the parent's: what the parent saved, exactly as it saved it
    (objects included: its checkpoints load as they would without the mixin), with the mixin's own settings
    beside it as plain data. When the parent saved nothing, the constructor's arguments, those forwarded to the
    parent included, where they are plain data (or LightningCLI's config, when it built the model)."""
    saved_by_parent = dict(module.hparams)
    dropped: list[str] = []
    if not saved_by_parent:  # the parent chose nothing (if it did, its `ignore=` choices stand)
        module.save_hyperparameters()  # Lightning reads the __init__ frames above this one
        saved_by_parent, dropped = plain_data(dict(module.hparams))
    if dropped:
        left_out = sorted({path.split(".")[0] for path in dropped})
        rank_zero_warn(
            f"MuonMixin left {left_out} out of the saved hyperparameters: the parent saves none itself, and "
            f"they hold what is not plain data ({', '.join(sorted(dropped))}), so load_from_checkpoint needs "
            "them passed again, as without the mixin. Call self.save_hyperparameters() in the parent to keep "
            "them in its checkpoints."
        )
    # LightningCLI's config already has the mixin's settings, in its own form.
    own = {} if _compat.cli_class_path(saved_by_parent) is not None else config.to_hparams()
    module.hparams.clear()  # save_hyperparameters(dict) updates: start from the chosen set alone
    module.save_hyperparameters({**saved_by_parent, **own})
