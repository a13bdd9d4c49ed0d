"""Lightning's finetuning callbacks (``BaseFinetuning``, ``BackboneFinetuning``) under `MuonMixin`'s pair of
optimizers, resumed exactly.

`Finetuning` wraps, for one fit, the Trainer's ``BaseFinetuning`` callbacks (instance attributes, given back when
the fit ends):

- their ``on_train_epoch_start`` and ``state_dict`` keep the callback's record of the optimizers' param groups
  (what its ``on_fit_start`` gives back on resume) equal to the optimizers' real groups. Lightning records the
  groups an optimizer gains during its own ``finetune_function`` call; under the pair the first optimizer's call
  adds a group to each (`lightning_muon.lightning._unfreezing.route_added_groups`), and the first training batch
  may correct the groups later, so AdamW's unfrozen parameters would otherwise be in no group after a resume.
  Lightning's warning that an optimizer already holds what it is offered is silenced there: under the pair the
  second optimizer always holds what the first one routed to it.
- ``BackboneFinetuning.finetune_function`` keeps one ``previous_backbone_lr`` per optimizer (swapped in and out
  around each call; kept in checkpoints, `record`) where Lightning keeps one for all: Muon's backbone group follows
  Muon's lr and AdamW's follows AdamW's, ``lr * backbone_initial_ratio_lr`` at the unfreeze epoch, then
  ``lambda_func(epoch + 1)`` times the previous one, capped at that optimizer's lr (``should_align``). The callback
  sets the lr of each optimizer's last group: that it is the group the unfreeze added is checked at the unfreeze
  epoch and before every later call, and the fit stops with the reason rather than rescale another group. A fit
  resumed within an epoch whose start set the lrs (Lightning releases that run ``on_train_epoch_start`` again
  then) skips the call: the checkpoint holds that epoch's lrs, which would otherwise grow twice.

`restore_unfrozen`: on resume, Lightning's ``BaseFinetuning.setup`` freezes the backbone again and its
``on_fit_start`` gives the optimizers their groups back but not ``requires_grad`` (Lightning issue #21901): the
backbone would silently never train again. The mixin makes what the added groups hold trainable again.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_muon.lightning import _compat
from lightning_muon.lightning._unfreezing import finetuning_callbacks, is_added

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn
    from torch.optim import Optimizer

#: The start of Lightning's warning that an optimizer already holds parameters it is offered.
ALREADY_HELD = "The provided params to be frozen already exist within another group of this optimizer"
#: The callback methods `Finetuning` wraps.
WRAPPED = ("on_train_epoch_start", "state_dict", "finetune_function")


class Finetuning:
    """One fit's ``BaseFinetuning`` callbacks, made right for the pair (see the module's docstring).

    Args:
        trainer: the fit's Trainer, its optimizers built.
        module: the fit's module.
        algorithms: which algorithm each of ``trainer.optimizers`` is, in order.
        backbone_lrs: each ``BackboneFinetuning``'s backbone lr per optimizer and the epoch it was set at, by
            ``state_key``, from the checkpoint the fit resumes (`record`); ``None``: the callback's own value for
            every optimizer.
    """

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule, algorithms: list[str],
                 backbone_lrs: dict[str, dict[str, Any]] | None = None) -> None:
        self.trainer, self.module, self.algorithms = trainer, module, algorithms
        #: Each BackboneFinetuning's previous backbone lr, one per optimizer, by the callback's ``state_key``.
        self.backbone_lrs: dict[str, list[float | None]] = {}
        #: The epoch whose start last set them, by ``state_key`` (``None``: none yet).
        self.epochs: dict[str, int | None] = {}
        #: Those of the checkpoint the fit resumes: a fit resumed within that epoch has set them already.
        self._resumed_epochs: dict[str, int | None] = {}
        #: How many groups each optimizer held when the current epoch's finetuning began.
        self._before: list[int] = []
        self._own: list[tuple[Any, dict[str, Any]]] = []
        count = len(trainer.optimizers)
        for callback in finetuning_callbacks(_compat.trainer_callbacks(trainer)):
            if isinstance(callback, _compat.lightning_classes(BackboneFinetuning)):
                saved = (backbone_lrs or {}).get(callback.state_key) or {}
                own = callback.previous_backbone_lr
                self.backbone_lrs[callback.state_key] = list(saved.get("lrs") or [own] * count)
                self.epochs[callback.state_key] = self._resumed_epochs[callback.state_key] = saved.get("epoch")
            self._wrap(callback)

    def record(self) -> dict[str, Any]:
        """What the fit's checkpoints hold for it (`lightning_muon.lightning._checkpoint.record`'s ``extra``)."""
        if not self.backbone_lrs:
            return {}
        return {"backbone_lrs": {key: {"epoch": self.epochs[key], "lrs": list(lrs)}
                                 for key, lrs in self.backbone_lrs.items()}}

    def teardown(self) -> None:
        """Give the callbacks their methods back, their record of the groups set to the groups the optimizers end
        the fit with (what a checkpoint saved after the fit holds)."""
        for callback, own in self._own:
            if self.trainer.optimizers:
                _compat.store_finetuning_groups(callback, self.module, self.trainer.optimizers)
            for name, value in own.items():
                if value is None:
                    vars(callback).pop(name, None)
                else:
                    setattr(callback, name, value)
        self._own = []

    def _wrap(self, callback: Any) -> None:
        own = {name: _own(callback, name) for name in WRAPPED}
        self._own.append((callback, own))

        def original(name: str) -> Callable[..., Any]:
            return own[name] if own[name] is not None else getattr(type(callback), name).__get__(callback)

        epoch_start, state_dict = original("on_train_epoch_start"), original("state_dict")

        def on_train_epoch_start(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._before = [len(o.param_groups) for o in trainer.optimizers]
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=ALREADY_HELD)
                epoch_start(trainer, pl_module)
            _compat.store_finetuning_groups(callback, pl_module, trainer.optimizers)
            if callback.state_key in self.epochs:
                self.epochs[callback.state_key] = trainer.current_epoch
                self._resumed_epochs.pop(callback.state_key, None)

        def stored_state_dict() -> dict[str, Any]:
            _compat.store_finetuning_groups(callback, self.module, self.trainer.optimizers)
            return state_dict()

        wrappers: dict[str, Callable[..., Any]] = {"on_train_epoch_start": on_train_epoch_start,
                                                   "state_dict": stored_state_dict}
        if callback.state_key in self.backbone_lrs:
            wrappers["finetune_function"] = self._per_optimizer(callback, original("finetune_function"))
        for name, wrapper in wrappers.items():
            wrapper._muon_own = own[name]  # type: ignore[attr-defined]
            setattr(callback, name, wrapper)

    def _per_optimizer(self, callback: Any, finetune: Callable[..., None]) -> Callable[..., None]:
        """``BackboneFinetuning.finetune_function`` with the optimizer's own previous backbone lr."""
        lrs = self.backbone_lrs[callback.state_key]

        def finetune_function(pl_module: pl.LightningModule, epoch: int, optimizer: Optimizer) -> None:
            if self._resumed_epochs.get(callback.state_key) == epoch:
                return  # resumed within the epoch: its start set the backbone lrs the checkpoint holds already
            index = next(i for i, o in enumerate(self.trainer.optimizers) if o is optimizer)
            unfreeze_at = callback.unfreeze_backbone_at_epoch
            if epoch > unfreeze_at:
                self._check_last_group(optimizer, index)
            callback.previous_backbone_lr = lrs[index]
            finetune(pl_module, epoch, optimizer)
            lrs[index] = callback.previous_backbone_lr
            if epoch == unfreeze_at:
                self._check_added(optimizer, index, epoch)
                if lrs[index] is not None:  # this optimizer's own lr * ratio (the first one's group has it already)
                    optimizer.param_groups[-1]["lr"] = lrs[index]

        return finetune_function

    def _check_last_group(self, optimizer: Optimizer, index: int) -> None:
        last = optimizer.param_groups[-1] if optimizer.param_groups else {}
        if not is_added(last):
            raise MisconfigurationException(
                f"BackboneFinetuning sets the backbone's lr on the last param group of each optimizer, and "
                f"{self.algorithms[index]}'s last group is {last.get('name')!r}, which holds no unfrozen backbone: "
                "the callback would change the lr of other parameters. Was the checkpoint this fit resumed from "
                "saved with another unfreeze_backbone_at_epoch? Resume with the callback's arguments the checkpoint "
                "was trained with."
            )

    def _check_added(self, optimizer: Optimizer, index: int, epoch: int) -> None:
        before = self._before[index] if index < len(self._before) else len(optimizer.param_groups) - 1
        added = [g.get("name") for g in optimizer.param_groups[before:]]
        if len(added) != 1 or not is_added(optimizer.param_groups[-1]):
            raise MisconfigurationException(
                f"BackboneFinetuning's unfreeze at epoch {epoch} gave {self.algorithms[index]} the param groups "
                f"{added}, where one group of the backbone (unfrozen_<n>) was expected: from the next epoch on the "
                "callback sets the lr of the last group alone. Let `pl_module.backbone` hold exactly the parameters "
                "to unfreeze, frozen until then (none trainable already, none shared with the rest of the model)."
            )


def _own(callback: Any, name: str) -> Any:
    """The callback's own instance attribute ``name`` (``None``: its class's method), under a wrapper a fit that
    ended in an error left there (its ``teardown`` never ran)."""
    value = vars(callback).get(name)
    return getattr(value, "_muon_own", value)


def restores_groups(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """Whether a fit resuming from ``checkpoint`` has a ``BaseFinetuning`` callback that gives the optimizers back
    the groups it added (its state is in the checkpoint, and the strategy restores callbacks before the
    callbacks' ``on_fit_start``, as every strategy but the ones that set up the model first does)."""
    if trainer.strategy.restore_checkpoint_after_setup:
        return False
    callbacks = finetuning_callbacks(_compat.trainer_callbacks(trainer))
    return any(_compat.saved_finetuning_groups(c, checkpoint) for c in callbacks)


def restore_unfrozen(module: nn.Module, optimizers: list[Optimizer]) -> list[str]:
    """Make trainable again what ``optimizers`` hold in groups a finetuning callback added, where it is frozen (a
    resumed fit, Lightning issue #21901); BatchNorm layers among them track running stats again, as
    ``BaseFinetuning.make_trainable`` made them. Returns the names of the parameters made trainable."""
    frozen = {id(p) for o in optimizers for g in o.param_groups if is_added(g) for p in g["params"]
              if not p.requires_grad}
    if not frozen:
        return []
    names = [name for name, p in module.named_parameters() if id(p) in frozen]
    for layer in module.modules():
        mine = [p for p in layer.parameters(recurse=False) if id(p) in frozen]
        for p in mine:
            p.requires_grad_(True)
        if mine and isinstance(layer, _BatchNorm):
            layer.track_running_stats = True
    rank_zero_info(
        f"MuonMixin: {len(names)} parameter(s) unfrozen by a finetuning callback before the checkpoint was saved "
        "are trainable again (BaseFinetuning freezes them when a fit resumes, Lightning issue #21901)."
    )
    return names
