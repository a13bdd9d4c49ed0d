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
optimizers, both steps, one scaler update, both scheduler steps, zero grads.
``trainer.global_step`` advances once per update.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import FSDPStrategy, ParallelStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.factories import describe, plain_data, resolve, target_class
from lightning_muon.muon import Muon
from lightning_muon.routing import ADAMW, MUON, Routing, route_parameters

__all__ = ["MuonMixin", "DEFAULT_MUON", "DEFAULT_ADAMW"]

# Defaults are specs (plain data) rather than partials, so LightningCLI can print and save them and
# checkpoints hold plain hyperparameters; the mixin resolves them to factories.
#: lightning_muon.Muon with Keller Jordan's settings.
DEFAULT_MUON: dict = {"class_path": "lightning_muon.Muon", "init_args": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}}
#: AdamW for embeddings, head, norms and biases; fused where the device supports it.
DEFAULT_ADAMW: dict = {
    "class_path": "torch.optim.AdamW",
    "init_args": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.0},
}

#: Parent hooks that manual optimization never calls.
_UNCALLED_HOOKS = ("optimizer_step", "configure_gradient_clipping", "lr_scheduler_step", "optimizer_zero_grad")
_CHECKPOINT_KEY = "lightning_muon"


def _accepted_positional(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` (a bound method) takes; a large number for ``*args``."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 1 << 30
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _wrap_training_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make a ``training_step`` defined below the mixin perform the update (once, however nested)."""

    @functools.wraps(fn)
    def training_step(self: MuonMixin, *args: Any, **kwargs: Any) -> Any:
        return self._muon_training_step(functools.partial(fn, self), args, kwargs)

    training_step._muon_wrapped = True  # type: ignore[attr-defined]
    return training_step


class MuonMixin:
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
        lr_scheduler: factory of a scheduler applied to each optimizer
            separately and stepped once per update, e.g.
            `lightning_muon.WarmupCosine` (its ``total_steps`` defaults to the
            number of updates of the fit). ``None``: constant lr.
        muon_params: glob patterns of parameter names forced onto Muon.
        adamw_params: glob patterns of parameter names forced onto AdamW.
        accumulate_grad_batches: micro-batches per update (use this instead
            of ``Trainer(accumulate_grad_batches=...)``, which manual
            optimization refuses).
        gradient_clip_val: clip the global gradient norm over both optimizers
            to this value (instead of ``Trainer(gradient_clip_val=...)``);
            ``None`` for no clipping.
        max_consecutive_skips: updates with non-finite gradients are skipped
            for both optimizers; after this many in a row, fit stops with an
            error naming the parameters (16-mixed overflows are the scaler's
            business and do not count).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        position = mro.index(MuonMixin)
        for klass in mro[1:position]:
            if issubclass(klass, MuonMixin):
                continue
            overrides = [hook for hook in ("training_step", "configure_optimizers") if hook in vars(klass)]
            if overrides:
                bases = [b for b in cls.__bases__ if not issubclass(b, MuonMixin) or b is MuonMixin]
                fixed = ", ".join(["MuonMixin"] + [b.__name__ for b in bases if b is not MuonMixin])
                raise TypeError(
                    f"MuonMixin must come first in the bases of {cls.__name__}: {klass.__name__} defines "
                    f"{' and '.join(overrides)}, which would replace the mixin's. Write:\n"
                    f"    class {cls.__name__}({fixed}):"
                )
        if "configure_optimizers" in vars(cls):
            raise TypeError(
                f"{cls.__name__} defines configure_optimizers, which replaces MuonMixin's pair of optimizers. "
                "Remove it and configure the optimizers with the mixin's arguments "
                "(muon=..., adamw=..., lr_scheduler=...)."
            )
        step = vars(cls).get("training_step")
        if step is not None and not getattr(step, "_muon_wrapped", False):
            cls.training_step = _wrap_training_step(step)

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
        **kwargs: Any,
    ) -> None:
        if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int) or (
            accumulate_grad_batches < 1
        ):
            raise ValueError(f"accumulate_grad_batches must be an int >= 1, got {accumulate_grad_batches!r}")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"gradient_clip_val must be > 0 or None, got {gradient_clip_val!r}")
        for kind, patterns in (("muon_params", muon_params), ("adamw_params", adamw_params)):
            if isinstance(patterns, str):
                raise ValueError(f"{kind} must be a list of glob patterns, got the string {patterns!r}; write [{patterns!r}]")
        if max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips!r}")
        factories = {"muon": resolve(muon), "adamw": resolve(adamw), "lr_scheduler": resolve(lr_scheduler)}
        if factories["adamw"] is None:
            raise ValueError("adamw must be an optimizer factory; it holds every parameter that is not on Muon")
        for name, factory in (("muon", muon), ("adamw", adamw), ("lr_scheduler", lr_scheduler)):
            spec = describe(factory)
            if isinstance(spec, dict) and "callable" in spec:
                rank_zero_warn(
                    f"MuonMixin: `{name}` ({spec['callable']}) cannot be saved as a loadable spec, so "
                    "load_from_checkpoint will not rebuild it. Pass a class, functools.partial(cls, plain "
                    "keywords) or a spec like {'class_path': ..., 'init_args': {...}} instead."
                )
        # Rebind the arguments to plain data before the parent's __init__ runs: a parent calling
        # save_hyperparameters() collects these frames' locals, and checkpoints must load with weights_only.
        muon, adamw, lr_scheduler = describe(muon), describe(adamw), describe(lr_scheduler)
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self._muon_factories = factories
        self._muon_settings = {
            "muon": muon,
            "adamw": adamw,
            "lr_scheduler": lr_scheduler,
            "muon_params": muon_params,
            "adamw_params": adamw_params,
            "accumulate_grad_batches": accumulate_grad_batches,
            "gradient_clip_val": gradient_clip_val,
            "max_consecutive_skips": max_consecutive_skips,
        }
        # Hyperparameters: what the parent saved (if it did), plus this constructor's arguments as plain
        # data, including those forwarded to the parent (or LightningCLI's config, when it built the model).
        saved_by_parent = dict(self.hparams)
        if not saved_by_parent:  # the parent chose nothing (if it did, its `ignore=` choices stand)
            self.save_hyperparameters()
        hparams, dropped = plain_data({**saved_by_parent, **self.hparams, **self._muon_settings_for_hparams()})
        if dropped:
            rank_zero_warn(
                f"MuonMixin left {sorted(dropped)} out of the saved hyperparameters: they are not plain data, and "
                "checkpoints must load with weights_only=True. Pass plain values (or specs) instead."
            )
        self.hparams.clear()  # save_hyperparameters(dict) updates: start from the plain set alone
        self.save_hyperparameters(hparams)
        #: Updates skipped because of non-finite gradients (16-mixed overflows included), and in a row.
        self.skipped_updates = 0
        self._consecutive_skips = 0
        self._micro_batches = 0
        self._losses_in_update = 0
        self._in_training_step = False
        self._warned_none = False

    def _muon_settings_for_hparams(self) -> dict[str, Any]:
        """The mixin's settings as plain data; LightningCLI's config already has them in its own form."""
        given = self.hparams.get("_class_path") is not None
        return {} if given else self._muon_settings

    # ----------------------------------------------------------------- routing

    def muon_routing(self) -> Routing:
        """Where every trainable parameter goes (Muon or AdamW) and why."""
        muon_class = target_class(self._muon_factories["muon"])
        muon_nd = muon_class is not None and issubclass(muon_class, Muon)
        return route_parameters(
            self,  # type: ignore[arg-type]
            muon_params=self._muon_settings["muon_params"],
            adamw_params=self._muon_settings["adamw_params"],
            muon_nd=muon_nd,
        )

    def _optimizer_names(self) -> dict[str, list[str]]:
        """The parameter names each optimizer holds (what checkpoints record and check)."""
        routing = self.muon_routing()
        if self._muon_factories["muon"] is None or not routing.muon_groups:
            return {MUON: [], ADAMW: routing.names(MUON) + routing.names(ADAMW)}
        return {MUON: routing.names(MUON), ADAMW: routing.names(ADAMW)}

    def configure_optimizers(self) -> Any:
        """``[muon, adamw]`` over the routed param groups (only AdamW when ``muon=None``), with their schedulers."""
        routing = self.muon_routing()
        rank_zero_info("\n" + routing.render())
        if self._muon_factories["muon"] is not None and not routing.muon_groups:
            rank_zero_warn("MuonMixin: no parameter was routed to Muon; only AdamW will train this model.")
        if self._muon_factories["muon"] is None or not routing.muon_groups:
            optimizers = [self._make_adamw(routing.muon_groups + routing.adamw_groups)]
        else:
            optimizers = [self._build("muon", routing.muon_groups), self._make_adamw(routing.adamw_groups)]
        factory = self._muon_factories["lr_scheduler"]
        if factory is None:
            return optimizers
        schedulers = []
        for optimizer in optimizers:
            scheduler = factory(optimizer)
            if getattr(scheduler, "total_steps", 0) is None:
                total = self.trainer.estimated_stepping_batches
                if not math.isfinite(total):
                    raise MisconfigurationException(
                        f"{type(scheduler).__name__} needs the length of the fit, which is unbounded here: set "
                        "Trainer(max_steps=...) or max_epochs, or give the scheduler total_steps=..."
                    )
                scheduler.total_steps = int(total)
            schedulers.append({"scheduler": scheduler, "interval": "step"})
        return optimizers, schedulers

    def _build(self, which: str, groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
        """Call the ``which`` factory; a bad setting is reported with the argument it came from."""
        try:
            return self._muon_factories[which](groups, **kwargs)
        except (ValueError, TypeError) as error:
            raise ValueError(f"MuonMixin could not build the `{which}` optimizer ({self._muon_settings[which]}): {error}") from error

    def _make_adamw(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        factory = self._muon_factories["adamw"]
        # Fused AdamW is several times faster where the device supports it (CPU and CUDA in torch >= 2.4).
        if target_class(factory) is torch.optim.AdamW and getattr(factory, "keywords", {}).get("fused") is None:
            params = [p for g in groups for _, p in g["params"]]
            if all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params):
                return self._build("adamw", groups, fused=True)
        return self._build("adamw", groups)

    # -------------------------------------------------------------- fit checks

    def setup(self, stage: str) -> None:
        super().setup(stage)  # type: ignore[misc]
        if stage == "fit":
            # Lightning's loop already knows how to count accumulated batches (logger steps, validation
            # zero_grad, estimated_stepping_batches); manual optimization only refuses it at validation.
            self.trainer.accumulate_grad_batches = self._muon_settings["accumulate_grad_batches"]

    def teardown(self, stage: str) -> None:
        if stage == "fit":
            self.trainer.accumulate_grad_batches = 1
        super().teardown(stage)  # type: ignore[misc]

    def on_fit_start(self) -> None:
        super().on_fit_start()  # type: ignore[misc]
        strategy = self.trainer.strategy
        if isinstance(strategy, FSDPStrategy):
            raise MisconfigurationException(
                "MuonMixin cannot run under strategy='fsdp' (FSDP1): manual optimization and its flattened "
                "parameters cannot work together. Use FSDP2: strategy=ModelParallelStrategy() with "
                "fully_shard in configure_model."
            )
        if "configure_optimizers" in vars(self):
            raise MisconfigurationException(
                "configure_optimizers was replaced on this model (LightningCLI --optimizer/--lr_scheduler do "
                "this), which would drop MuonMixin's pair of optimizers. Configure them with --model.muon, "
                "--model.adamw and --model.lr_scheduler instead."
            )
        for hook in _UNCALLED_HOOKS + ("configure_optimizers",):
            owners = [
                k.__name__
                for k in type(self).__mro__
                if hook in vars(k) and k is not MuonMixin and k not in LightningModule.__mro__
            ]
            if owners:
                rank_zero_warn(
                    f"{owners[0]}.{hook} will never be called: MuonMixin runs the optimizers itself under "
                    f"manual optimization. Move what it does into the mixin's arguments "
                    f"(gradient_clip_val, lr_scheduler, muon/adamw) or into training_step."
                )

    def toggle_optimizer(self, optimizer: Any) -> None:
        raise MisconfigurationException(
            "toggle_optimizer switches off the gradients of the other optimizer's parameters, but MuonMixin "
            "steps Muon and AdamW together on one loss. Remove the toggle_optimizer/untoggle_optimizer calls."
        )

    # -------------------------------------------------------------------- step

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the parent's ``training_step``, then backward and (on the last micro-batch) the update."""
        parent = super().training_step  # type: ignore[misc]
        return self._muon_training_step(parent, args, kwargs)

    def _muon_training_step(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._in_training_step or not self.trainer.training:
            # A subclass's training_step calling super() (only the outer one updates), or a
            # validation_step reusing training_step (no backward, no update).
            return step(*args[: _accepted_positional(step)], **kwargs)
        self._in_training_step = True
        try:
            output = step(*args[: _accepted_positional(step)], **kwargs)
        finally:
            self._in_training_step = False
        loss = self._loss_of(output)
        update_now = not self.trainer.fit_loop.epoch_loop._should_accumulate()
        if loss is not None:
            scaled = loss / self._muon_settings["accumulate_grad_batches"]
            if update_now:
                self.manual_backward(scaled)
            else:
                with self._no_gradient_sync():
                    self.manual_backward(scaled)
            self._losses_in_update += 1
        self._micro_batches += 1
        if update_now:
            if self._losses_in_update:
                self._muon_update()
            self._micro_batches = 0
            self._losses_in_update = 0
        return output

    @contextlib.contextmanager
    def _no_gradient_sync(self) -> Iterator[None]:
        """Backward of a non-final micro-batch: gradients accumulate locally, no cross-rank reduction.

        DDP through the strategy's ``no_sync``; FSDP2 (``fully_shard`` modules, which Lightning's
        ``ModelParallelStrategy`` leaves alone here) through ``set_requires_gradient_sync``, switched
        back on afterwards (the last micro-batch of an update always syncs).
        """
        sharded = []
        if torch.distributed.is_available():
            from torch.distributed.fsdp import FSDPModule

            sharded = [m for m in self.modules() if isinstance(m, FSDPModule)]
        for module in sharded:
            module.set_requires_gradient_sync(False, recurse=False)
        strategy = self.trainer.strategy
        try:
            if isinstance(strategy, ParallelStrategy):
                with strategy.block_backward_sync():
                    yield
            else:
                yield
        finally:
            for module in sharded:
                module.set_requires_gradient_sync(True, recurse=False)

    def _loss_of(self, output: Any) -> torch.Tensor | None:
        if output is None:
            if self.trainer.world_size > 1:
                raise MisconfigurationException(
                    "training_step returned None on a run with several processes: skipping the batch on one "
                    "rank would leave the others waiting for its gradients (or drifting apart). Return "
                    "`loss * 0` to skip a batch under DDP/FSDP."
                )
            if not self._warned_none:
                rank_zero_warn("training_step returned None: MuonMixin skips that batch (no backward, no update).")
                self._warned_none = True
            return None
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, dict) and "loss" in output:
            return output["loss"]
        raise MisconfigurationException(
            f"training_step must return the loss (a tensor, a dict with a 'loss' key, or None to skip the batch); "
            f"got {type(output).__name__}{' with keys ' + str(list(output)) if isinstance(output, dict) else ''}."
        )

    def _muon_update(self) -> None:
        """One update over both optimizers: unscale, hooks, clip, check, step, scaler update, schedulers, zero."""
        trainer = self.trainer
        lightning_optimizers = self.optimizers()
        if not isinstance(lightning_optimizers, list):
            lightning_optimizers = [lightning_optimizers]
        optimizers = [o.optimizer for o in lightning_optimizers]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        # The manual loop counts global_step through these hooks of a LightningOptimizer: call them once.
        lightning_optimizers[0]._on_before_step()
        try:
            if scaler is not None:
                for optimizer in optimizers:
                    scaler.unscale_(optimizer)
            for optimizer in optimizers:
                call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
                call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
            params = [p for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            if not bool(torch.isfinite(norm)) and all(bool(torch.isfinite(g).all()) for g in grads):
                # Every element is finite but the norm overflowed its dtype (fp16 past 65504): recompute.
                norm = torch.nn.utils.get_total_norm([g.double() for g in grads])
            if bool(torch.isfinite(norm)):
                clip = self._muon_settings["gradient_clip_val"]
                if clip is not None:
                    torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
                for optimizer in optimizers:  # already unscaled and checked: the scaler has nothing to add
                    optimizer.step()
                self._consecutive_skips = 0
            else:
                self._skip_update(optimizers, counts_toward_limit=scaler is None)
            if scaler is not None:
                scaler.update()
            for config in trainer.lr_scheduler_configs:
                config.scheduler.step()
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
        finally:
            lightning_optimizers[0]._on_after_step()

    def _skip_update(self, optimizers: list[torch.optim.Optimizer], counts_toward_limit: bool) -> None:
        self.skipped_updates += 1
        self.log("muon/skipped_steps", float(self.skipped_updates), on_step=True, on_epoch=False)
        if not counts_toward_limit:
            return
        self._consecutive_skips += 1
        names = {id(p): n for n, p in self.named_parameters()}
        bad = [
            names.get(id(p), "?")
            for o in optimizers
            for g in o.param_groups
            for p in g["params"]
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]
        shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        if self._consecutive_skips >= self._muon_settings["max_consecutive_skips"]:
            raise RuntimeError(
                f"{self._consecutive_skips} updates in a row had non-finite gradients (in {shown}); no weight "
                "was changed by them. Lower the learning rate, add gradient_clip_val, or check the data and loss."
            )
        rank_zero_warn(f"MuonMixin skipped an update: non-finite gradients in {shown}. No weight was changed.")

    # ------------------------------------------------------------- checkpoints

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        checkpoint[_CHECKPOINT_KEY] = {
            "routing": self._optimizer_names(),
            "skipped_updates": self.skipped_updates,
            "consecutive_skips": self._consecutive_skips,
            "micro_batches": self._micro_batches,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        saved = checkpoint.get(_CHECKPOINT_KEY)
        if saved is None:
            return
        current = self._optimizer_names()
        differences = []
        for optimizer in (MUON, ADAMW):
            then, now = set(saved["routing"][optimizer]), set(current[optimizer])
            differences += [f"  {name}: was on {optimizer}, not now" for name in sorted(then - now)]
            differences += [f"  {name}: now on {optimizer}, was not" for name in sorted(now - then)]
            if then == now and saved["routing"][optimizer] != current[optimizer]:
                # Optimizer state is matched to parameters by position: the order matters too.
                differences.append(f"  {optimizer}: the same parameters in a different order")
        if differences:
            raise MisconfigurationException(
                "This checkpoint's optimizer states were saved with a different routing, so they would be "
                "loaded into the wrong parameters. Differences:\n" + "\n".join(differences) + "\n"
                "Resume with the muon_params/adamw_params (and muon class) the checkpoint was trained with."
            )
        self.skipped_updates = saved["skipped_updates"]
        self._consecutive_skips = saved["consecutive_skips"]
        if saved["micro_batches"]:
            rank_zero_warn(
                f"The checkpoint was saved after {saved['micro_batches']} accumulated micro-batches; their "
                "gradients are not in checkpoints, so the first update after resuming uses fewer."
            )
