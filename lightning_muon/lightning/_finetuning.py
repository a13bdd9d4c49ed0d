"""Lightning's finetuning callbacks (``BaseFinetuning`` and its subclasses) in a `MuonMixin` fit: which are refused
before training, and what a resumed fit gives back.

The callbacks themselves are left as the user built them. What they unfreeze is routed by the pair
(`lightning_muon.lightning._pair.OptimizerPair.accept`, on the pair's own optimizers), and the pair restores the
groups they added from the mixin's own checkpoint record. A plain ``BackboneFinetuning`` keeps one backbone lr for
all optimizers, which cannot hold for Muon and AdamW: it is refused, naming
`lightning_muon.MuonBackboneFinetuning`, which keeps one per optimizer.

`restore_unfrozen`: on resume, Lightning's ``BaseFinetuning.setup`` freezes the backbone again and its
``on_fit_start`` gives the optimizers their groups back but not ``requires_grad`` (Lightning issue #21901): the
backbone would silently never train again. The mixin makes what the added groups hold trainable again.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_muon.lightning import _compat
from lightning_muon.lightning.finetuning import MuonBackboneFinetuning

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn


def finetuning_callbacks(callbacks: Iterable[Any]) -> list[Any]:
    """The ``BaseFinetuning`` callbacks (either Lightning package) among ``callbacks``."""
    return [c for c in callbacks if isinstance(c, _compat.lightning_classes(BaseFinetuning))]


def check_finetuning_callbacks(callbacks: list[Any], muon_enabled: bool) -> None:
    """Refuse, before the fit trains, a ``BackboneFinetuning`` that would scale one optimizer's backbone lr from the
    other's (every one but `MuonBackboneFinetuning`), and an absolute backbone lr for two optimizers."""
    if not muon_enabled:
        return
    for callback in callbacks:
        if not isinstance(callback, _compat.lightning_classes(BackboneFinetuning)):
            continue
        lr = callback.backbone_initial_lr
        if lr is not None:
            raise MisconfigurationException(
                f"BackboneFinetuning(backbone_initial_lr={lr}) gives the backbone one absolute learning rate, and "
                "MuonMixin trains the backbone with two optimizers whose learning rates are on different scales "
                "(Muon's matrices, AdamW's norms and biases). Give it as a fraction of each optimizer's lr instead: "
                "MuonBackboneFinetuning(backbone_initial_ratio_lr=...) (the lr you meant divided by the lr of the "
                "optimizer you meant it for), or use muon=None (AdamW alone)."
            )
        if not isinstance(callback, MuonBackboneFinetuning):
            raise MisconfigurationException(
                f"BackboneFinetuning keeps one backbone learning rate for every optimizer ({type(callback).__name__} "
                "here), and MuonMixin trains the backbone with two (Muon's lr and AdamW's are on different "
                "scales): from the epoch after the unfreeze each would be scaled from the other's. Use "
                "lightning_muon.MuonBackboneFinetuning with the same arguments (in YAML: class_path: "
                "lightning_muon.MuonBackboneFinetuning), which keeps one per optimizer, or muon=None (AdamW alone)."
            )


def restores_groups(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """Whether a fit resuming from ``checkpoint`` has the ``BaseFinetuning`` callback that added groups to the
    optimizers (its state, with groups, is in the checkpoint), restored before the optimizers are set up (every
    strategy but the ones that set up the model first)."""
    if trainer.strategy.restore_checkpoint_after_setup:
        return False
    callbacks = finetuning_callbacks(_compat.trainer_callbacks(trainer))
    return any(_compat.saved_finetuning_groups(c, checkpoint) for c in callbacks)


def restore_unfrozen(module: nn.Module, names: Collection[str]) -> list[str]:
    """Make trainable again the parameters ``names`` (those a checkpoint's optimizers held in groups a finetuning
    callback added) where they are frozen (a resumed fit, Lightning issue #21901); BatchNorm layers among them
    track running stats again, as ``BaseFinetuning.make_trainable`` made them. Returns the names made trainable."""
    frozen = {id(p) for name, p in module.named_parameters() if name in names and not p.requires_grad}
    if not frozen:
        return []
    made = [name for name, p in module.named_parameters() if id(p) in frozen]
    for layer in module.modules():
        mine = [p for p in layer.parameters(recurse=False) if id(p) in frozen]
        for p in mine:
            p.requires_grad_(True)
        if mine and isinstance(layer, _BatchNorm):
            layer.track_running_stats = True
    rank_zero_info(
        f"MuonMixin: {len(made)} parameter(s) unfrozen by a finetuning callback before the checkpoint was saved "
        "are trainable again (BaseFinetuning freezes them when a fit resumes, Lightning issue #21901)."
    )
    return made
