"""`MuonMixin`: Muon on the hidden matrices and AdamW on the rest, for any LightningModule.

Two optimizers in Lightning 2.x mean manual optimization, which switches off
gradient accumulation, clipping, AMP loss-scaling bookkeeping, scheduler
stepping and a correct ``global_step``. The mixin puts all of that back:

    class MyModel(MuonMixin, MyExistingModule):   # mixin FIRST
        pass                                       # training_step returns the loss

It wraps the parent's ``training_step`` and, from the loss it returns, does:
backward (loss / N); gradient accumulation over N micro-batches (no DDP
all-reduce or FSDP2 reduce-scatter until the last one); on the last micro-batch one update:
unscale (16-mixed), ``on_before_optimizer_step`` hooks, one global
gradient-norm clip over both optimizers, a non-finite check that skips both
optimizers, both steps, one scaler update, the scheduler steps (by their
interval and frequency), zero grads.
``trainer.global_step`` advances once per update.

The mixin's state is three objects: its config (`MuonConfig`, the constructor's
arguments), its update loop (`UpdateLoop`, the per-batch sequence and the counters
that span fits) and, during a fit, the fit's state (`FitState`, created by
``configure_callbacks`` and dropped by ``teardown``). Each hook hands over to the
method of the same name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.lightning import _checkpoint, _checks, _compat
from lightning_muon.lightning._config import DEFAULT_ADAMW, DEFAULT_MUON, MuonConfig, plain_data
from lightning_muon.lightning._first_batch import FirstBatch, restore_roles
from lightning_muon.lightning._fit import FitState
from lightning_muon.lightning._update_loop import UpdateLoop, UpdateSettings
from lightning_muon.optim.muon import Muon
from lightning_muon.routing import GraphRoles, Routing, route_parameters

__all__ = ["DEFAULT_ADAMW", "DEFAULT_MUON", "MuonMixin"]


# Type checkers see the mixin as the LightningModule it always ends up in; at run time it is a plain class
# (LightningModule comes from the user's own bases, after it).
if TYPE_CHECKING:
    _LightningModuleBase = LightningModule
else:
    _LightningModuleBase = object


def _wrap_training_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make a ``training_step`` defined below the mixin perform the update (once, however nested)."""

    @functools.wraps(fn)
    def training_step(self: MuonMixin, *args: Any, **kwargs: Any) -> Any:
        return self._muon_loop.training_step(
            self, functools.partial(fn, self), args, kwargs, self._muon_settings(), self._first_batch()
        )

    training_step._muon_wrapped = True  # type: ignore[attr-defined]
    return training_step


class MuonMixin(_LightningModuleBase):
    """Train any LightningModule with Muon on its hidden matrices and AdamW on everything else.

    Put it first in the bases: ``class MyModel(MuonMixin, MyExistingModule)``.
    Its keyword-only arguments are the whole configuration; every other
    argument goes to the wrapped module's constructor.

    Args:
        muon: factory of the Muon optimizer, called with the routed param
            groups (default: `lightning_muon.Muon` with lr 0.02, momentum
            0.95, weight decay 0.01; ``torch.optim.Muon`` works too, its
            >2D tensors then go to AdamW). ``None`` puts every parameter on
            AdamW with the same training loop: the baseline for A/B runs.
        adamw: factory of the optimizer for everything else (default:
            ``torch.optim.AdamW`` with lr 3e-4, betas (0.9, 0.95), weight decay
            0, fused where the device supports it).
        lr_scheduler: factory of a scheduler (stepped once per update) or of
            Lightning's scheduler dict (``interval``, ``frequency``,
            ``monitor``), applied to each optimizer separately, e.g.
            `lightning_muon.WarmupCosine` (its ``total_steps`` defaults to the
            number of updates of the fit). ``None``: constant lr.
        muon_params: glob patterns of parameter names forced onto Muon.
        adamw_params: glob patterns of parameter names forced onto AdamW.
        accumulate_grad_batches: micro-batches per update (the same as
            ``Trainer(accumulate_grad_batches=...)``; give it in one place).
        gradient_clip_val: clip the global gradient norm over both optimizers
            to this value (as ``Trainer(gradient_clip_val=...)`` does, which also
            takes ``gradient_clip_algorithm="value"``); ``None``: no clipping.
        parent_lr: train with the learning rate and weight decay of the parent's
            ``configure_optimizers`` (its first optimizer's): AdamW at them, Muon
            at them with ``adjust_lr_fn="match_rms_adamw"`` (its update RMS
            matched to AdamW's). Off by default: on three forecasting modules
            (TFT, N-BEATS, DeepAR) the mixin's own lrs reached a lower loss on two.
        max_consecutive_skips: updates with non-finite gradients are skipped
            for both optimizers; after this many in a row, fit stops with an
            error naming the parameters (16-mixed overflows are the scaler's
            business and do not count).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_bases(cls)
        step = vars(cls).get("training_step")
        if step is not None and not getattr(step, "_muon_wrapped", False):
            # The subclass's own training_step becomes the one that updates (the mixin's would be bypassed).
            cls.training_step = _wrap_training_step(step)  # type: ignore[method-assign]

    def __init__(
        self,
        *,
        muon: OptimizerCallable | None = DEFAULT_MUON,  # type: ignore[assignment]
        adamw: OptimizerCallable = DEFAULT_ADAMW,  # type: ignore[assignment]
        lr_scheduler: LRSchedulerCallable | None = None,
        muon_params: Sequence[str] = (),
        adamw_params: Sequence[str] = (),
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        max_consecutive_skips: int = 5,
        parent_lr: bool = False,
        **kwargs: Any,
    ) -> None:
        config = MuonConfig.from_arguments(
            muon=muon,
            adamw=adamw,
            lr_scheduler=lr_scheduler,
            muon_params=muon_params,
            adamw_params=adamw_params,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            max_consecutive_skips=max_consecutive_skips,
            parent_lr=parent_lr,
        )
        # Rebind the arguments to plain data before the parent's __init__ runs: a parent calling
        # save_hyperparameters() collects these frames' locals, and checkpoints must load with weights_only.
        muon, adamw, lr_scheduler = config.muon, config.adamw, config.lr_scheduler
        muon_params, adamw_params = list(config.muon_params), list(config.adamw_params)
        super().__init__(**kwargs)
        if not self.automatic_optimization:
            raise _checks.by_hand(self, f"{type(self).__name__}'s parent sets automatic_optimization = False")
        self.automatic_optimization = False
        self._muon_config = config
        self._muon_loop = UpdateLoop()
        self._muon_fit: FitState | None = None
        #: What the first training batch showed (None until one is seen); kept in checkpoints.
        self._muon_graph: GraphRoles | None = None
        self._save_hyperparameters(config)

    def _save_hyperparameters(self, config: MuonConfig) -> None:
        """What the parent saved, exactly as it saved it (objects included: its checkpoints load as they would
        without the mixin), with the mixin's own settings beside it as plain data. When the parent saved
        nothing, this constructor's arguments, those forwarded to the parent included, where they are plain
        data (or LightningCLI's config, when it built the model)."""
        saved_by_parent = dict(self.hparams)
        dropped: list[str] = []
        if not saved_by_parent:  # the parent chose nothing (if it did, its `ignore=` choices stand)
            self.save_hyperparameters()
            saved_by_parent, dropped = plain_data(dict(self.hparams))
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
        self.hparams.clear()  # save_hyperparameters(dict) updates: start from the chosen set alone
        self.save_hyperparameters({**saved_by_parent, **own})

    # ------------------------------------------------ read-only surface (callbacks, commands)

    @property
    def muon_enabled(self) -> bool:
        """Whether a Muon optimizer is configured (``False`` for the ``muon=None`` AdamW baseline)."""
        return self._muon_config.muon_enabled

    @property
    def muon_skipped_updates(self) -> int:
        """Updates skipped so far because of non-finite gradients (16-mixed overflows included)."""
        return self._muon_loop.skipped_updates

    @property
    def muon_roles(self) -> GraphRoles | None:
        """What a fit's first training batch showed (output heads, input layers, hidden matrices), or ``None``
        before one was seen; loaded from checkpoints with the weights. Set it (from
        `lightning_muon.trace_roles`) before a fit to build the optimizers with it: no batch is followed then."""
        return self._muon_graph

    @muon_roles.setter
    def muon_roles(self, roles: GraphRoles | None) -> None:
        if self._muon_fit is not None:
            raise RuntimeError("muon_roles is set before a fit, not during one (its optimizers hold the routing)")
        self._muon_graph = roles

    def muon_routing(self) -> Routing:
        """Where every trainable parameter goes (Muon or AdamW) and why: with ``muon=None``, all on AdamW.

        Until a fit's first training batch is seen, output heads and input layers come from names and
        structure; from then on, from that batch (see `lightning_muon.routing.trace_roles`)."""
        muon_class = self._muon_config.muon_class
        routing = route_parameters(
            self,
            muon_params=self._muon_config.muon_params,
            adamw_params=self._muon_config.adamw_params,
            muon_nd=muon_class is not None and issubclass(muon_class, Muon),
            graph=self._muon_graph,
        )
        return routing if self.muon_enabled else routing.all_on_adamw("muon=None: on AdamW")

    def muon_effective_lrs(self) -> dict[str, float]:
        """The learning rate each routed parameter will start with, by name (Muon's after the shape
        adjustment), read from optimizers built for the purpose and thrown away."""
        return self._optimizer_config().effective_lrs(self.muon_routing())

    # -------------------------------------------------------------- optimizers

    def configure_optimizers(self) -> Any:
        """``[muon, adamw]`` over the routed param groups (only AdamW when ``muon=None``), with their schedulers.

        A step of either inside the parent's ``training_step`` is refused before it moves a weight."""
        routing, config = self.muon_routing(), self._optimizer_config()
        if not routing.routes:
            raise MisconfigurationException(
                f"{type(self).__name__} has no trainable parameter: every parameter has requires_grad=False (or "
                "the layers are built after the optimizers). Unfreeze what should train "
                "(`layer.requires_grad_(True)`), or build the layers in __init__ or configure_model."
            )
        rank_zero_info("\n" + routing.render())
        if self.muon_enabled and not routing.muon_groups:
            rank_zero_warn("MuonMixin: no parameter was routed to Muon; only AdamW will train this model.")
        optimizers = [config.build_adamw(routing.adamw_groups)]
        if routing.muon_groups:
            optimizers.insert(0, config.build("muon", routing.muon_groups))
        self._muon_loop.guard_steps(self, optimizers)
        if config.lr_scheduler_factory is None:
            return optimizers
        schedulers = config.build_schedulers(optimizers, lambda: self.trainer.estimated_stepping_batches)
        if self._muon_fit is not None:
            self._muon_fit.configure_optimizers(schedulers)
        return optimizers, schedulers

    # ------------------------------------------------------------------ a fit

    def configure_callbacks(self) -> Any:
        callbacks = super().configure_callbacks()
        if self.trainer.state.fn == "fit":  # Lightning's manual-optimization checks come next
            self._muon_fit = FitState.configure_callbacks(self, self._muon_config)
        return callbacks

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and self._muon_fit is not None:
            self._muon_fit.setup(self.trainer)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        own_classes = _own_classes(type(self))
        _checks.check_fit(self, own_classes)
        if self._muon_fit is not None:
            self._muon_fit.on_fit_start(self, own_classes, self._muon_config.lrs_given)

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        if self._muon_fit is not None:
            self._muon_fit.on_train_epoch_start(self.trainer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        self._muon_loop.on_train_batch_start(self)
        return super().on_train_batch_start(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        self._muon_loop.on_train_epoch_end(self)

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self._muon_fit is not None:
            lr = self._muon_fit.teardown(self.trainer)  # gives the Trainer its flags back
            self._muon_fit = None
            if lr is not None and not self.muon_enabled:
                self._muon_config = self._muon_config.with_adamw_lr(lr)
                self.hparams["adamw"] = self._muon_config.adamw
                rank_zero_info(f"MuonMixin: lr_find's suggestion, lr={lr:g}, is AdamW's lr from the next fit on.")
        super().teardown(stage)

    def _optimizer_config(self) -> MuonConfig:
        """The config the optimizers are built from: with ``parent_lr=True``, at the parent's lr and weight decay."""
        config = self._muon_config
        if not config.parent_lr:
            return config
        return config.with_lr(*_checks.parent_lr(self, _own_classes(type(self))))

    def _first_batch(self) -> FirstBatch | None:
        """A `FirstBatch` to follow this batch, while a fit with Muon has seen none (else ``None``)."""
        if self._muon_fit is None or self._muon_graph is not None or not self.muon_enabled:
            return None
        return FirstBatch()

    def _muon_settings(self) -> UpdateSettings:
        """What each update uses: the fit's (its Trainer flags included), else the mixin's own arguments."""
        if self._muon_fit is not None:
            return self._muon_fit.settings
        config = self._muon_config
        return UpdateSettings(config.gradient_clip_val, "norm", config.max_consecutive_skips)

    # ------------------------------------------ refusals of optimizing by hand

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """Lightning's, except inside the parent's ``training_step``, where the mixin owns the optimizers."""
        if self._muon_loop.in_training_step:
            raise _checks.by_hand(self, "training_step calls self.optimizers()")
        return super().optimizers(use_pl_optimizer)

    def manual_backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        """The update loop's own backward; any other call (training_step, a hook, a callback) is refused."""
        self._muon_loop.check_backward(self, "calls manual_backward()")
        super().manual_backward(loss, *args, **kwargs)

    def on_before_backward(self, loss: Any) -> None:
        """Lightning calls this before every backward it runs: refuse one that went around `manual_backward`."""
        self._muon_loop.check_backward(
            self, "runs a backward around MuonMixin (super().manual_backward() or trainer.strategy.backward())"
        )
        super().on_before_backward(loss)

    def toggle_optimizer(self, optimizer: Any) -> None:
        raise MisconfigurationException(
            "toggle_optimizer switches off the gradients of the other optimizer's parameters, but MuonMixin "
            "steps Muon and AdamW together on one loss. Remove the toggle_optimizer/untoggle_optimizer calls."
        )

    # -------------------------------------------------------------------- step

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the parent's ``training_step``, then backward and (on the last micro-batch) the update."""
        return self._muon_loop.training_step(
            self, super().training_step, args, kwargs, self._muon_settings(), self._first_batch()
        )

    # ------------------------------------------------------------- checkpoints

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        routing = _checkpoint.optimizer_names(self.muon_routing())
        checkpoint[_checkpoint.CHECKPOINT_KEY] = {"routing": routing, **self._muon_loop.state_dict()}
        if self._muon_graph is not None:
            checkpoint[_checkpoint.CHECKPOINT_KEY]["graph"] = self._muon_graph.to_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get(_checkpoint.CHECKPOINT_KEY)
        trainer = _compat.attached_trainer(self)  # None for load_from_checkpoint: weights only, no optimizers
        resuming = trainer is not None and trainer.state.fn == "fit"
        if saved is None:
            if resuming:
                _checkpoint.refuse_foreign_optimizer_states(checkpoint)
            return
        restore_roles(self, saved, resuming)
        if resuming:  # optimizer states follow: they must meet the parameters they were saved for
            current = _checkpoint.optimizer_names(self.muon_routing())
            _checkpoint.check_same_model(saved, current)
            _checkpoint.check_routing(saved, current)
        self._muon_loop.load_state_dict(saved)


def _own_classes(cls: type) -> list[type]:
    """The model's own classes, most derived first: its MRO without `MuonMixin` and Lightning's classes."""
    return [k for k in cls.__mro__ if k is not MuonMixin and not _compat.is_lightning_module_base(k)]


def _check_bases(cls: type) -> None:
    """At class definition: the mixin must come before every base that defines ``training_step`` or
    ``configure_optimizers``, and the class itself must not define ``configure_optimizers``."""
    mro = cls.__mro__
    for klass in mro[1 : mro.index(MuonMixin)]:
        if issubclass(klass, MuonMixin):
            continue
        overrides = [hook for hook in ("training_step", "configure_optimizers") if hook in vars(klass)]
        if overrides:
            bases = [b.__name__ for b in cls.__bases__ if not issubclass(b, MuonMixin)]
            raise TypeError(
                f"MuonMixin must come first in the bases of {cls.__name__}: {klass.__name__} defines "
                f"{' and '.join(overrides)}, which would replace the mixin's. Write:\n"
                f"    class {cls.__name__}({', '.join(['MuonMixin', *bases])}):"
            )
    if "configure_optimizers" in vars(cls):
        raise TypeError(
            f"{cls.__name__} defines configure_optimizers, which replaces MuonMixin's pair of optimizers. "
            "Remove it and configure the optimizers with the mixin's arguments "
            "(muon=..., adamw=..., lr_scheduler=...)."
        )
