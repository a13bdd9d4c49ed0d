"""`MuonBackboneFinetuning`: Lightning's ``BackboneFinetuning`` with one backbone learning rate per optimizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_muon.optim.groups import NAME

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

__all__ = ["MuonBackboneFinetuning"]


class MuonBackboneFinetuning(BackboneFinetuning):
    """``BackboneFinetuning`` for a module trained by several optimizers, such as `lightning_muon.MuonMixin`'s Muon
    and AdamW: each optimizer's backbone group follows that optimizer's own learning rate.

    Lightning's ``BackboneFinetuning`` keeps one ``previous_backbone_lr`` for all optimizers, so with Muon (lr 0.02)
    and AdamW (lr 3e-4) each epoch would scale one optimizer's backbone lr from the other's. This subclass takes
    the same arguments and keeps one previous lr per optimizer (in its checkpoint state): at
    ``unfreeze_backbone_at_epoch`` each optimizer's part of the backbone starts at
    ``backbone_initial_ratio_lr`` times that optimizer's lr, then grows by ``lambda_func(epoch + 1)`` an epoch,
    capped at that optimizer's lr (``should_align``). The lr is set on the group the unfreeze added to each
    optimizer, found by its name, not on whichever group is last.

    Under `lightning_muon.MuonMixin` a plain ``BackboneFinetuning`` is refused before training with the fix: use
    this class with the same arguments (in YAML, ``class_path: lightning_muon.MuonBackboneFinetuning``).
    ``backbone_initial_lr`` (one absolute lr for every optimizer) is refused with several optimizers.

    Examples:
        ```python
        import lightning as L

        from lightning_muon import MuonBackboneFinetuning

        trainer = L.Trainer(callbacks=[MuonBackboneFinetuning(unfreeze_backbone_at_epoch=1)])
        ```
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Each optimizer's previous backbone lr, in the order of ``trainer.optimizers`` (``None``: not set yet).
        self.previous_backbone_lrs: list[float | None] = []
        #: The name of the group the unfreeze added to each optimizer (``None``: none added).
        self.backbone_groups: list[str | None] = []
        #: The epoch whose start last set the backbone lrs (``None``: none yet), and that of the checkpoint the fit
        #: resumed: a fit resumed within that epoch has set them already.
        self.lrs_epoch: int | None = None
        self._resumed_epoch: int | None = None

    @property
    @override
    def state_key(self) -> str:
        # BackboneFinetuning's key: a checkpoint saved with either class resumes with either.
        return "BackboneFinetuning"

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lrs": list(self.previous_backbone_lrs),
                "backbone_groups": list(self.backbone_groups), "lrs_epoch": self.lrs_epoch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.previous_backbone_lrs = list(state_dict.get("previous_backbone_lrs", []))
        self.backbone_groups = list(state_dict.get("backbone_groups", []))
        self.lrs_epoch = self._resumed_epoch = state_dict.get("lrs_epoch")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.backbone_initial_lr is not None and len(trainer.optimizers) > 1:
            raise MisconfigurationException(
                f"MuonBackboneFinetuning(backbone_initial_lr={self.backbone_initial_lr}) gives the backbone one "
                f"absolute learning rate, and this module trains it with {len(trainer.optimizers)} optimizers whose "
                "learning rates are on different scales (Muon's matrices, AdamW's norms and biases). Give it as a "
                "fraction of each optimizer's lr instead: backbone_initial_ratio_lr=... (the lr you meant divided "
                "by the lr of the optimizer you meant it for)."
            )
        super().on_fit_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        count = len(trainer.optimizers)
        self.previous_backbone_lrs += [self.previous_backbone_lr] * (count - len(self.previous_backbone_lrs))
        self.backbone_groups += [None] * (count - len(self.backbone_groups))
        if self._resumed_epoch == trainer.current_epoch:
            # Resumed within the epoch whose start set the lrs (Lightning releases before 2.6 run this hook again
            # then): the checkpoint holds that epoch's lrs, which would otherwise grow twice.
            self._resumed_epoch = None
            return
        self._resumed_epoch = None
        super().on_train_epoch_start(trainer, pl_module)
        if trainer.current_epoch >= self.unfreeze_backbone_at_epoch:
            self.lrs_epoch = trainer.current_epoch

    @override
    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Optimizer) -> None:
        index = next(i for i, o in enumerate(pl_module.trainer.optimizers) if o is optimizer)
        lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            before = {g.get(NAME) for g in optimizer.param_groups}
            initial = lr * self.backbone_initial_ratio_lr
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, initial, train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)
            added = [g.get(NAME) for g in optimizer.param_groups if g.get(NAME) not in before]
            if len(added) != 1 or added[0] is None:
                raise MisconfigurationException(
                    f"MuonBackboneFinetuning's unfreeze at epoch {epoch} gave optimizer {index} the param groups "
                    f"{added}, where one group of the backbone was expected: from the next epoch on the callback "
                    "sets that group's lr. Let `pl_module.backbone` hold exactly the parameters to unfreeze, frozen "
                    "until then (none trainable already, none shared with the rest of the model)."
                )
            self.backbone_groups[index] = str(added[0])
            self.previous_backbone_lrs[index] = self.previous_backbone_lr = initial
        elif epoch > self.unfreeze_backbone_at_epoch:
            group = self._backbone_group(optimizer, index)
            previous = self.previous_backbone_lrs[index]
            assert previous is not None
            backbone_lr = self.lambda_func(epoch + 1) * previous
            backbone_lr = lr if self.should_align and backbone_lr > lr else backbone_lr
            group["lr"] = self.previous_backbone_lrs[index] = self.previous_backbone_lr = backbone_lr

    def _backbone_group(self, optimizer: Optimizer, index: int) -> dict[str, Any]:
        name = self.backbone_groups[index]
        group = next((g for g in optimizer.param_groups if name is not None and g.get(NAME) == name), None)
        if group is None:
            raise MisconfigurationException(
                f"MuonBackboneFinetuning sets the lr of the backbone group its unfreeze added, and optimizer {index} "
                f"holds no group named {name!r}. Was the checkpoint this fit resumed from saved with another "
                "unfreeze_backbone_at_epoch, or another finetuning callback? Resume with the callback's arguments the "
                "checkpoint was trained with."
            )
        return group
