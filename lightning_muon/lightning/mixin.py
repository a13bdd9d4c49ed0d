"""`MuonMixin`: Muon on the hidden matrices and AdamW on the rest, for any LightningModule.

Two optimizers in Lightning 2.x mean manual optimization, which switches off
gradient accumulation, clipping, AMP loss-scaling bookkeeping, scheduler
stepping and a correct ``global_step``. The mixin puts all of that back:

```python
class MyModel(MuonMixin, MyExistingModule):   # mixin FIRST
    pass                                       # training_step returns the loss
```

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
``configure_callbacks`` and dropped when the fit ends, by an exception or an
interrupt too, by the fit's own callback: everything the fit borrowed is given
back then). Each hook hands over to the method of the same name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.lightning import _checkpoint, _checks, _compat
from lightning_muon.lightning._config import DEFAULT_ADAMW, DEFAULT_MUON, MuonConfig
from lightning_muon.lightning._fit import FitEnd, FitState, build_optimizers, check_resume, checkpoint_record, end_fit
from lightning_muon.lightning._hparams import save_hyperparameters, settings_from_checkpoint
from lightning_muon.lightning._pair import OptimizerPair
from lightning_muon.lightning._schedulers import check_layout
from lightning_muon.lightning._update_loop import UpdateLoop, UpdateSettings, bind_step
from lightning_muon.optim.groups import update_rule
from lightning_muon.routing import Algorithm, GraphRoles, Routing

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
        return self._muon_step(functools.partial(fn, self), args, kwargs)

    training_step._muon_wrapped = True  # type: ignore[attr-defined]
    return training_step


class MuonMixin(_LightningModuleBase):
    """Train any LightningModule with Muon on its hidden matrices and AdamW on everything else.

    Put it first in the bases: ``class MyModel(MuonMixin, MyExistingModule)``. Its keyword-only arguments are the
    whole configuration; every other argument, positional or keyword, goes to the wrapped module's constructor
    (``MuonModel(64, 3, gradient_clip_val=1.0)``) and is saved as the parent's hyperparameters exactly as without
    the mixin.

    Examples:
        ```python
        class MyModel(MuonMixin, MyExistingModule):  # yours: its training_step returns the loss
            pass

        model = MyModel(muon=functools.partial(lightning_muon.Muon, lr=0.02), gradient_clip_val=1.0)
        ```

    Args:
        muon: factory of the Muon optimizer, called with the routed param groups (default: `lightning_muon.Muon`
            with lr 0.02, momentum 0.95, weight decay 0.01; ``torch.optim.Muon`` works too, its tensors of more than
            2 dimensions then go to AdamW). ``None`` puts every parameter on AdamW with the same training loop: the
            baseline for A/B runs.
        adamw: factory of the optimizer for everything else (default: ``torch.optim.AdamW`` with lr 3e-4, betas
            (0.9, 0.95), weight decay 0, fused where the device supports it).
        lr_scheduler: factory of a scheduler (stepped once per update) or of Lightning's scheduler dict
            (``interval``, ``frequency``, ``monitor``), applied to each optimizer separately, e.g.
            `lightning_muon.WarmupCosine` (its ``total_steps`` defaults to the number of updates of the fit).
            ``None``: constant lr.
        muon_lr_scheduler: Muon's own scheduler factory, as ``lr_scheduler``, which it replaces for Muon.
        adamw_lr_scheduler: AdamW's own, the same way.
        muon_params: glob patterns of parameter names forced onto Muon.
        adamw_params: glob patterns of parameter names forced onto AdamW.
        accumulate_grad_batches: micro-batches per update (as ``Trainer(accumulate_grad_batches=...)``: give one).
        gradient_clip_val: clip the global gradient norm over both optimizers to this value (as
            ``Trainer(gradient_clip_val=...)`` does, which also takes ``gradient_clip_algorithm="value"``);
            ``None``: no clipping.
        parent_lr: train at the lr and weight decay of the parent's ``configure_optimizers`` (its first optimizer's):
            AdamW at them, Muon with ``adjust_lr_fn="match_rms_adamw"``. Off by default: on three forecasting
            modules (TFT, N-BEATS, DeepAR) the mixin's own lrs reached a lower loss on two.
        split_fused: orthogonalise each block of a fused projection the routing finds (GPT-2's ``c_attn``,
            ``nn.MultiheadAttention``'s ``in_proj_weight``, litgpt's ``qkv``, fused MoE ``gate_up_proj``) on its
            own, as separate layers would be (``True``), or each whole (``False``); ``None`` (the default) splits
            equal q, k, v blocks only (measured better; `route_parameters`). The routing table names them. An
            LSTM's or GRU's gates are split whatever it says (measured better).
        matrix_blocks: glob pattern -> row-block sizes of those Muon matrices (``{"*.qkv.weight": [64, 64, 64]}``),
            or ``None`` to keep a found one whole; the first matching pattern decides, over ``split_fused``.
        split_heads: orthogonalise each attention head of q, k and v on its own (`route_parameters`); off by
            default (measured no better than a split per projection).
        group_settings: a routing group's own settings over its optimizer's (keys ``lr``, ``weight_decay``,
            ``betas``, ``eps``, ``momentum``): ``{"embeddings": {"lr": 0.01}, "head": {"weight_decay": 0.0}}``.
        max_consecutive_skips: updates with non-finite gradients are skipped for both optimizers; after this many in
            a row, fit stops with an error naming the parameters (16-mixed overflows do not count).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _checks.check_bases(cls, MuonMixin)
        step = vars(cls).get("training_step")
        if step is not None and not getattr(step, "_muon_wrapped", False):
            # The subclass's own training_step becomes the one that updates (the mixin's would be bypassed).
            cls.training_step = _wrap_training_step(step)  # type: ignore[method-assign]

    def __init__(
        self,
        *args: Any,
        muon: OptimizerCallable | None = DEFAULT_MUON,  # type: ignore[assignment]
        adamw: OptimizerCallable = DEFAULT_ADAMW,  # type: ignore[assignment]
        lr_scheduler: LRSchedulerCallable | None = None,
        muon_lr_scheduler: LRSchedulerCallable | None = None,
        adamw_lr_scheduler: LRSchedulerCallable | None = None,
        muon_params: Sequence[str] = (),
        adamw_params: Sequence[str] = (),
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        max_consecutive_skips: int = 5,
        parent_lr: bool = False,
        split_fused: bool | None = None,
        matrix_blocks: dict[str, list[int] | None] | None = None,
        group_settings: dict[str, dict[str, Any]] | None = None,
        split_heads: bool = False,
        **kwargs: Any,
    ) -> None:
        config = MuonConfig.from_arguments(
            muon=muon, adamw=adamw, lr_scheduler=lr_scheduler, muon_lr_scheduler=muon_lr_scheduler,
            adamw_lr_scheduler=adamw_lr_scheduler, muon_params=muon_params, adamw_params=adamw_params,
            accumulate_grad_batches=accumulate_grad_batches, gradient_clip_val=gradient_clip_val,
            max_consecutive_skips=max_consecutive_skips, parent_lr=parent_lr, split_fused=split_fused,
            matrix_blocks=matrix_blocks, group_settings=group_settings, split_heads=split_heads,
        )
        # Rebind the arguments to plain data before the parent's __init__ runs: a parent calling
        # save_hyperparameters() collects these frames' locals, and checkpoints must load with weights_only.
        muon, adamw, lr_scheduler = config.muon, config.adamw, config.lr_scheduler
        muon_lr_scheduler, adamw_lr_scheduler = config.muon_lr_scheduler, config.adamw_lr_scheduler
        muon_params, adamw_params = list(config.muon_params), list(config.adamw_params)
        super().__init__(*args, **kwargs)
        if not self.automatic_optimization:
            raise _checks.by_hand(self, f"{type(self).__name__}'s parent sets automatic_optimization = False")
        self.automatic_optimization = False
        self._muon_config = config
        self._muon_loop = UpdateLoop()
        self._muon_fit: FitState | None = None
        #: The last optimizers configure_optimizers built and their groups (kept after the fit, for its checkpoints).
        self._muon_pair: OptimizerPair | None = None
        #: What the first training batch showed (None until one is seen); kept in checkpoints.
        self._muon_roles: GraphRoles | None = None
        save_hyperparameters(self, config, MuonMixin, args)

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
        """What a fit's training batches showed (heads, input layers, hidden matrices, tensors used as no matrix),
        or ``None`` before one was seen; loaded from checkpoints. Set it (`lightning_muon.trace_roles`) before a fit
        to build the optimizers with it: no batch is followed then, unless it leaves parameters unreached."""
        return self._muon_roles

    @muon_roles.setter
    def muon_roles(self, roles: GraphRoles | None) -> None:
        if self._muon_fit is not None:
            raise RuntimeError("muon_roles is set before a fit, not during one (its optimizers hold the routing)")
        self._muon_roles = roles

    def muon_routing(self) -> Routing:
        """Where every trainable parameter goes (Muon or AdamW) and why: with ``muon=None``, all on AdamW.

        Until a fit's first training batch is seen, output heads and input layers come from names and
        structure; from then on, from that batch, and for what it did not reach, from the batch that first reaches
        it (see `lightning_muon.routing.trace_roles`)."""
        return self._muon_config.route(self, self._muon_roles)

    def muon_update_rules(self) -> list[str]:
        """Muon's update rule for each of its param groups, in words (``"Muon"``, ``"NorMuon (normuon_beta2=0.95)"``,
        with cautious weight decay where it is on), read from an optimizer built for the purpose and thrown away;
        empty where nothing is routed to Muon."""
        groups = self.muon_routing().muon_groups
        muon = _optimizer_config(self).build(Algorithm.MUON, groups) if groups and self.muon_enabled else None
        return [update_rule(g) for g in muon.param_groups] if muon is not None else []

    def muon_effective_lrs(self) -> dict[str, float]:
        """The learning rate each routed parameter will start with, by name (Muon's after the shape
        adjustment), read from optimizers built for the purpose and thrown away."""
        return _optimizer_config(self).effective_lrs(self.muon_routing())

    def configure_optimizers(self) -> Any:
        """``[muon, adamw]`` over the routed param groups (only AdamW when ``muon=None``), with their schedulers.

        A step of either inside the parent's ``training_step`` is refused before it moves a weight."""
        config = _optimizer_config(self)
        pair, schedulers = build_optimizers(self, self.muon_routing, config, self._muon_fit)
        self._muon_pair, optimizers = pair, list(pair.optimizers.values())
        self._muon_loop.optimizers_built(self, optimizers, pair.scheduled_groups)
        if self._muon_fit is not None:
            self._muon_fit.configure_optimizers(pair, schedulers)
        return (optimizers, schedulers) if config.scheduled else optimizers

    def configure_callbacks(self) -> Any:
        callbacks = super().configure_callbacks()
        if self.trainer.state.fn == "fit":  # Lightning's manual-optimization checks come next
            self._end_fit()  # a fit whose end Lightning never reported (none known): what it borrowed, back
            self._muon_loop.start_fit()
            fit_end = FitEnd(self._end_fit)  # Lightning skips the module's teardown when a fit raises
            load_record = functools.partial(_load_record, self)
            self._muon_fit = FitState.start(self, self._muon_config, load_record, fit_end)
            own = [] if not callbacks else list(callbacks) if isinstance(callbacks, Sequence) else [callbacks]
            callbacks = [*own, fit_end]
        return callbacks

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and self._muon_fit is not None:
            self._muon_fit.setup(self.trainer)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        own_classes = _checks.own_classes(type(self), MuonMixin)
        _checks.check_fit(self, own_classes)
        if self._muon_fit is not None:
            self._muon_fit.on_fit_start(self, own_classes, self._muon_config.lrs_given)

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        if self._muon_fit is not None:
            self._muon_fit.on_train_epoch_start(self.trainer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        self._muon_loop.on_train_batch_start(self)
        if self._muon_fit is not None:
            self._muon_fit.on_train_batch_start()
        return super().on_train_batch_start(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        self._muon_loop.on_train_epoch_end(self)

    def _end_fit(self) -> None:
        """The end of a fit, by any exit (`end_fit`): what the fit borrowed, back; once, whichever exit."""
        end_fit(self)

    def _muon_step(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return _run_step(self, step, args, kwargs)

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
        raise MisconfigurationException(_checks.TOGGLE_REFUSED)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the parent's ``training_step``, then backward and (on the last micro-batch) the update."""
        return self._muon_step(super().training_step, args, kwargs)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[_checkpoint.CHECKPOINT_KEY] = checkpoint_record(
            self, self._muon_config, self._muon_roles, self._muon_loop.state_dict(), self._muon_pair)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        _load_checkpoint(self, checkpoint)


def _load_record(module: MuonMixin, saved: dict[str, Any]) -> None:
    """A distributed checkpoint's record, before its optimizer states load: take its roles, and the fit's
    optimizers, built already, hold its groups."""
    module._muon_roles = _checkpoint.saved_roles(saved, resuming=True)
    if module._muon_fit is not None:
        module._muon_fit.restore(module.trainer, saved, module.muon_routing())


def _optimizer_config(module: MuonMixin) -> MuonConfig:
    """The config ``module``'s optimizers are built from: with ``parent_lr=True``, at the parent's lr and weight
    decay."""
    config = module._muon_config
    if not config.parent_lr:
        return config
    return config.with_lr(*_checks.parent_lr(module, _checks.own_classes(type(module), MuonMixin)))


def _run_step(module: MuonMixin, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The parent's ``step`` under the update loop; the first batch of a fit with Muon is followed first, and later
    ones while it left parameters unreached (`FitState.follows`)."""
    fit, config = module._muon_fit, module._muon_config
    run = bind_step(step, args, kwargs, fit.compiler if fit is not None else None)
    settings = fit.settings if fit is not None else UpdateSettings(  # the fit's: its Trainer flags included
        config.gradient_clip_val, "norm", config.max_consecutive_skips)
    if fit is None or not module.muon_enabled or not module.trainer.training \
            or not fit.follows(module, module._muon_roles):
        return module._muon_loop.training_step(module, run, settings)
    batch = args[0] if args else kwargs.get("batch")

    def run_followed(run: Callable[[], Any]) -> Any:  # uncompiled: the trace follows eager code
        output, module._muon_roles = fit.follow_batch(module, batch, bind_step(step, args, kwargs),
                                                      module._muon_roles)
        return output

    return module._muon_loop.training_step(module, run, settings, run_followed)


def _load_checkpoint(module: MuonMixin, checkpoint: dict[str, Any]) -> None:
    """``on_load_checkpoint``: the settings a checkpoint's hyperparameters could not hold (``load_from_checkpoint``),
    the roles it trained with, the check that a resumed fit meets it (its groups given to the fit's optimizers where
    they are built), the update loop's counters."""
    trainer = _compat.attached_trainer(module)  # None for load_from_checkpoint: weights only, no optimizers
    resuming = trainer is not None and trainer.state.fn == "fit"
    saved = _checkpoint.saved_record(checkpoint, resuming)
    if saved is None:
        return
    if trainer is None:  # built by load_from_checkpoint: the settings its hyperparameters could not hold
        module._muon_config = settings_from_checkpoint(checkpoint, saved, module._muon_config, MuonMixin)
    if (roles := _checkpoint.saved_roles(saved, resuming, _checkpoint.stepped(checkpoint))) is not None or resuming:
        module._muon_roles = roles
    if resuming:  # optimizer states follow: they must meet the parameters they were saved for, with their settings
        _checkpoint.check_group_settings(saved, module._muon_config.group_settings)
        check_resume(module, checkpoint, saved, module.muon_routing(), module._muon_fit)
        check_layout(checkpoint, saved, module._muon_config.to_hparams())  # the schedulers' states, by position
    module._muon_loop.load_state_dict(saved)
