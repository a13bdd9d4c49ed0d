"""`UpdateLoop`: what one training batch does under `MuonMixin`, and the counters that span batches.

Per micro-batch: take the loss from the parent's ``training_step``, backward
``loss / N`` (no gradient sync unless it ends an update). On the last
micro-batch, one update over every optimizer: the gradients DDP does not
reduce averaged (`_unsynced`), unscale (16-mixed), ``on_before_optimizer_step``
hooks, one global gradient-norm clip, a non-finite check that skips every
optimizer, the steps, one scaler update, the scheduler steps, zero grads.
``trainer.global_step`` advances once per update.

The loop also steps the schedulers where Lightning's automatic loop would, and
guards what it owns: a backward that is not its own (from ``training_step``, a
hook or a callback) and an optimizer step inside the parent's ``training_step``
are refused before they run, so before any weight moves.

Its settings (`UpdateSettings`) are an input of each batch, from the fit's
state: the loop keeps only the counters that span batches.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer

from lightning_muon.lightning import _compat, _health
from lightning_muon.lightning._checks import by_hand, refuse_by_hand
from lightning_muon.lightning._unsynced import UnsyncedGradients
from lightning_muon.optim import norms
from lightning_muon.routing import loss_in

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

#: The logged count of skipped updates (the monitor logs the same key in its own rows).
SKIPPED_STEPS_KEY = "muon/skipped_steps"


@dataclass(frozen=True)
class UpdateSettings:
    """How one fit's updates clip and when they give up (the mixin's arguments and the Trainer's flags together)."""

    gradient_clip_val: float | None = None
    #: ``"norm"``: the global norm over every optimizer's gradients; ``"value"``: each element, in all of them.
    gradient_clip_algorithm: str = "norm"
    #: Updates with non-finite gradients in a row after which the fit stops (16-mixed overflows do not count).
    max_consecutive_skips: int = 5


#: The groups a scheduler of an optimizer steps (`OptimizerPair.scheduled_groups`: those it was built with).
ScheduledGroups = Callable[[Optimizer], contextlib.AbstractContextManager[None]]


def _all_groups(optimizer: Optimizer) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def step_schedulers(module: LightningModule, *, interval: str, plateau: bool, index: int,
                    scheduled_groups: ScheduledGroups = _all_groups) -> None:
    """Step every scheduler of ``interval`` (``"step"`` or ``"epoch"``) whose ``frequency`` divides ``index``
    (1-based), either the monitor-driven ones (``plateau``) or the others, through ``lr_scheduler_step``.

    Lightning steps nothing under manual optimization; the loop calls this where the automatic loop steps:
    ``"step"`` schedulers after each update (``frequency`` counts batches of the epoch, as Lightning's
    ``batch_idx + 1``), ``"epoch"`` ones after the epoch's last batch, and monitor-driven ones once the metrics
    they read are logged (after a step's validation, after the epoch's ``on_train_epoch_end``). A scheduler steps
    the groups its optimizer was built with (``scheduled_groups``): those a finetuning callback added keep the lr
    the callback gives them.
    """
    trainer = module.trainer
    for config in trainer.lr_scheduler_configs:
        if config.reduce_on_plateau != plateau or config.interval != interval or index % config.frequency:
            continue
        metric = None
        if config.reduce_on_plateau:
            assert config.monitor is not None
            metric = trainer.callback_metrics.get(config.monitor)
            if metric is None:
                if config.strict:
                    raise MisconfigurationException(
                        f"{type(config.scheduler).__name__} monitors {config.monitor!r}, which was not logged. "
                        f"Logged metrics: {sorted(trainer.callback_metrics)}. Log it with self.log("
                        f"{config.monitor!r}, ...) or change the scheduler's monitor."
                    )
                rank_zero_warn(
                    f"{type(config.scheduler).__name__} monitors {config.monitor!r}, which was not logged "
                    "(strict=False): its learning rate is not updated this time.",
                    category=RuntimeWarning,
                )
                continue
        optimizer = getattr(config.scheduler, "optimizer", None)
        with scheduled_groups(optimizer) if optimizer is not None else contextlib.nullcontext():
            module.lr_scheduler_step(config.scheduler, metric)  # (the groups a finetuning callback added: its lr)


@functools.cache
def _positional_count(function: Callable[..., Any]) -> int:
    """How many positional arguments a plain function takes after ``self``; a large number for ``*args``."""
    params = list(inspect.signature(function).parameters.values())[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 1 << 30
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def bind_step(step: Callable[..., Any], args: tuple, kwargs: dict,
              compiler: Callable[[Callable[..., Any]], Any] | None = None) -> Callable[[], Any]:
    """A ``training_step`` (bound, or ``partial(function, self)``) with its arguments bound, as many positionals as
    it takes (``training_step(self, batch)`` is fine where Lightning passes ``batch, batch_idx``), compiled by
    ``compiler`` where one is given (``torch.compile(model)``: the parent's step, not the update)."""
    function = step.func if isinstance(step, functools.partial) else getattr(step, "__func__", None)
    count = _positional_count(function) if function is not None else len(args)
    return functools.partial(compiler(step) if compiler is not None else step, *args[:count], **kwargs)


@contextlib.contextmanager
def _no_gradient_sync(module: LightningModule) -> Iterator[None]:
    """Backward of a non-final micro-batch: gradients accumulate locally, no cross-rank reduction.

    DDP through the strategy's ``no_sync``; FSDP2 (``fully_shard`` modules, which Lightning's
    ``ModelParallelStrategy`` leaves alone here) through ``set_requires_gradient_sync``, switched
    back on afterwards (the last micro-batch of an update always syncs).
    """
    sharded = []
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for fsdp_module in sharded:
        fsdp_module.set_requires_gradient_sync(False, recurse=False)
    strategy = module.trainer.strategy
    try:
        if isinstance(strategy, _compat.lightning_classes(ParallelStrategy)):  # type: ignore[type-abstract]
            with strategy.block_backward_sync():
                yield
        else:
            yield
    finally:
        for fsdp_module in sharded:
            fsdp_module.set_requires_gradient_sync(True, recurse=False)


class UpdateLoop:
    """The per-batch sequence of `MuonMixin`, with its counters (saved in checkpoints)."""

    def __init__(self) -> None:
        #: Updates skipped because of non-finite gradients (16-mixed overflows included).
        self.skipped_updates = 0
        #: Skipped updates in a row that count toward ``max_consecutive_skips``.
        self.consecutive_skips = 0
        #: Micro-batches of the current update so far, and the losses they gave (detached).
        self.micro_batches = 0
        self._losses: list[torch.Tensor] = []
        #: 16-mixed: updates the GradScaler skipped in a row, and the stop when its scale collapses.
        self._scaler_watch = _health.ScalerWatch()
        self._in_training_step = False
        #: Whether the loop's own backward is running (the only backward `check_backward` lets through).
        self._own_backward = False
        self._warned_none = False
        #: The 1-based batch index of the last update, until its monitor-driven "step" schedulers step.
        self._plateau_pending: int | None = None
        #: The optimizers' step pre-hooks and the parameters' gradient hooks of `guard_steps` (removed when the fit
        #: ends, or when optimizers built outside a fit are guarded again).
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        #: The gradients DDP will not reduce in this fit (parameters frozen when it wrapped the model).
        self._unsynced = UnsyncedGradients()
        #: The groups each optimizer's scheduler steps (from `optimizers_built`).
        self._scheduled_groups: ScheduledGroups = _all_groups

    @property
    def in_training_step(self) -> bool:
        """Whether the parent's ``training_step`` is running (where the mixin owns the optimizers)."""
        return self._in_training_step

    # ------------------------------------------------------ the by-hand guard

    def check_backward(self, module: LightningModule, call: str) -> None:
        """Refuse a backward that is not this loop's own (``call`` says how it was made): the mixin owns the
        backward, so any other one, from ``training_step``, a hook or a callback, optimizes by hand."""
        if not self._own_backward:
            where = "training_step" if self._in_training_step else "a hook or callback outside training_step"
            raise by_hand(module, f"{where} {call}")

    def optimizers_built(self, module: LightningModule, optimizers: Iterable[Optimizer],
                         scheduled_groups: ScheduledGroups = _all_groups) -> None:
        """From ``configure_optimizers``, which Lightning's DDP strategy calls right after wrapping the model: guard
        the optimizers' steps (`guard_steps`), note what DDP will not reduce (`UnsyncedGradients`) and which groups
        each optimizer's scheduler steps (``scheduled_groups``)."""
        self.guard_steps(module, optimizers)
        self._scheduled_groups = scheduled_groups
        trainer = _compat.attached_trainer(module)
        self._unsynced = UnsyncedGradients.at_wrap(trainer.strategy.model if trainer else None, module)

    def guard_steps(self, module: LightningModule, optimizers: Iterable[Optimizer]) -> None:
        """Refuse a step of ``optimizers`` or a backward into their parameters' gradients inside the parent's
        ``training_step`` (`_checks.refuse_by_hand`), the hooks of optimizers built before taken off."""
        self._remove_hooks()  # optimizers built again: one hook per parameter, not one per build
        self._hooks = refuse_by_hand(module, optimizers, lambda: self._in_training_step)

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------- per fit

    def start_fit(self) -> None:
        """A fit starts with no update under way (a fit that ended by an exception may have left one): no
        micro-batch counted (Lightning zeroes the module's gradients as its stage starts), no scheduler step
        pending, no skipped update in a row (a resumed fit takes the checkpoint's count)."""
        self.micro_batches, self._losses, self._plateau_pending = 0, [], None
        self.consecutive_skips = 0
        self._scaler_watch = _health.ScalerWatch()

    def end_fit(self) -> None:
        """The fit's hooks come off its optimizers and the module's parameters (`guard_steps`), and what the loop
        knew of the fit's strategy and schedulers is dropped."""
        self._remove_hooks()
        self._unsynced = UnsyncedGradients()
        self._scheduled_groups = _all_groups

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, int]:
        return {
            "skipped_updates": self.skipped_updates,
            "consecutive_skips": self.consecutive_skips,
            "micro_batches": self.micro_batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_updates = state["skipped_updates"]
        self.consecutive_skips = state["consecutive_skips"]
        if state["micro_batches"]:
            rank_zero_warn(
                f"The checkpoint was saved after {state['micro_batches']} accumulated micro-batches; their "
                "gradients are not in checkpoints, so the first update after resuming uses fewer."
            )

    # -------------------------------------------------------------- per batch

    def training_step(
        self,
        module: LightningModule,
        run: Callable[[], Any],
        settings: UpdateSettings,
        run_followed: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> Any:
        """Run the parent's ``training_step`` (``run``: its arguments bound, see `bind_step`), then backward and
        (on the last micro-batch) the update. ``run_followed``, where given, runs ``run`` in its place and returns
        its output, before the backward (a batch the fit follows: its first, and later ones for what the first did
        not reach, `FitState.follows`)."""
        if self._in_training_step or not module.trainer.training:
            # A subclass's training_step calling super() (only the outer one updates), or a
            # validation_step reusing training_step (no backward, no update).
            return run()
        self._in_training_step = True
        try:
            output = run_followed(run) if run_followed is not None else run()
        finally:
            self._in_training_step = False
        loss = self._loss_of(module, output)
        update_now = _compat.ends_update(module.trainer)
        if loss is not None:
            scaled = loss / module.trainer.accumulate_grad_batches
            if update_now:
                self._backward(module, scaled)
            else:
                with _no_gradient_sync(module):
                    self._backward(module, scaled)
            self._losses.append(loss.detach())
        self.micro_batches += 1
        if update_now:
            if self._losses:
                self._update(module, settings)
            self.micro_batches = 0
            self._losses = []
        if _compat.ends_epoch(module.trainer):
            step_schedulers(module, interval="epoch", plateau=False, index=module.trainer.current_epoch + 1,
                            scheduled_groups=self._scheduled_groups)
        return output

    def on_train_batch_start(self, module: LightningModule) -> None:
        """The last update's monitor-driven ``"step"`` schedulers, now that its metrics (and any validation
        after it) are logged."""
        self._step_pending_plateau(module)

    def on_train_epoch_end(self, module: LightningModule) -> None:
        """After the module's ``on_train_epoch_end``: the last update's and the epoch's monitor-driven
        schedulers."""
        self._step_pending_plateau(module)
        if _compat.ends_epoch(module.trainer):
            step_schedulers(module, interval="epoch", plateau=True, index=module.trainer.current_epoch + 1,
                            scheduled_groups=self._scheduled_groups)

    def _step_pending_plateau(self, module: LightningModule) -> None:
        if self._plateau_pending is not None:
            index, self._plateau_pending = self._plateau_pending, None
            step_schedulers(module, interval="step", plateau=True, index=index,
                            scheduled_groups=self._scheduled_groups)

    def _backward(self, module: LightningModule, loss: torch.Tensor) -> None:
        """The loop's own backward, the one `check_backward` lets through."""
        self._own_backward = True
        try:
            module.manual_backward(loss)
        finally:
            self._own_backward = False

    def _loss_of(self, module: LightningModule, output: Any) -> torch.Tensor | None:
        if output is None:
            if module.trainer.world_size > 1:
                raise MisconfigurationException(
                    "training_step returned None on a run with several processes: skipping the batch on one "
                    "rank would leave the others waiting for its gradients (or drifting apart). Return "
                    "`loss * 0` to skip a batch under DDP/FSDP."
                )
            if not self._warned_none:
                rank_zero_warn("training_step returned None: MuonMixin skips that batch (no backward, no update).")
                self._warned_none = True
            return None
        if (loss := loss_in(output)) is not None:
            return loss
        raise MisconfigurationException(
            f"training_step must return the loss (a tensor, a dict with a 'loss' key, or None to skip the batch); "
            f"got {type(output).__name__}{' with keys ' + str(list(output)) if isinstance(output, dict) else ''}."
        )

    # ------------------------------------------------------------- the update

    def _update(self, module: LightningModule, settings: UpdateSettings) -> None:
        """One update over every optimizer: unscale, hooks, clip, check, step, scaler update, schedulers, zero."""
        trainer = module.trainer
        lightning_optimizers = module.optimizers()
        if not isinstance(lightning_optimizers, list):
            lightning_optimizers = [lightning_optimizers]
        optimizers = [o.optimizer for o in lightning_optimizers]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._unsynced.average(p for o in optimizers for g in o.param_groups for p in g["params"])
        with _compat.one_optimizer_step(lightning_optimizers[0]):
            if scaler is not None:
                for optimizer in optimizers:
                    scaler.unscale_(optimizer)
            for optimizer in optimizers:
                _compat.call_on_before_optimizer_step(trainer, optimizer)
            params = [p for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
            norm = _gradient_norm(params)
            finite = bool(torch.isfinite(norm))  # one device sync decides the update
            if finite:
                _clip(params, norm, settings)
                for optimizer in optimizers:  # already unscaled and checked: the scaler has nothing to add
                    optimizer.step()
                _health.check_weights_finite(optimizers, module)
                self.consecutive_skips = 0
            else:
                limit = settings.max_consecutive_skips if scaler is None else None  # the scaler's own business
                self._skip(module, optimizers, limit)
            if scaler is not None:
                scaler.update()
                self._scaler_watch.after_update(not finite, scaler.get_scale(), self._losses)
            index = trainer.fit_loop.epoch_loop.batch_idx + 1  # Lightning's count for "step" frequencies
            step_schedulers(module, interval="step", plateau=False, index=index,
                            scheduled_groups=self._scheduled_groups)
            self._plateau_pending = index
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)

    def _skip(self, module: LightningModule, optimizers: list[Optimizer], limit: int | None) -> None:
        """Count a skipped update; stop the fit after ``limit`` in a row (``None``: no limit)."""
        self.skipped_updates += 1
        module.log(SKIPPED_STEPS_KEY, float(self.skipped_updates), on_step=True, on_epoch=False)
        if limit is None:
            return
        self.consecutive_skips += 1
        names = {id(p): n for n, p in module.named_parameters()}
        bad = [
            names.get(id(p), "?")
            for o in optimizers
            for g in o.param_groups
            for p in g["params"]
            if p.grad is not None and not norms.is_finite(p.grad)
        ]
        shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        if self.consecutive_skips >= limit:
            raise RuntimeError(
                f"{self.consecutive_skips} updates in a row had non-finite gradients (in {shown}); no weight "
                "was changed by them. Lower the learning rate, add gradient_clip_val, or check the data and loss."
            )
        rank_zero_warn(f"MuonMixin skipped an update: non-finite gradients in {shown}. No weight was changed.")


def _clip(params: list[torch.Tensor], norm: torch.Tensor, settings: UpdateSettings) -> None:
    """The fit's clipping over every optimizer's gradients: by value, or by the global norm already taken."""
    clip = settings.gradient_clip_val
    if clip is not None and settings.gradient_clip_algorithm == "value":
        norms.clip_value_(params, clip)
    elif clip is not None:
        norms.clip_with_norm_(params, clip, norm)


def _gradient_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The global norm of ``params``' gradients; recomputed in float64 where every element is finite but the
    norm overflowed its dtype (fp16 past 65504)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = norms.total_norm(grads)
    if not bool(torch.isfinite(norm)) and all(norms.is_finite(g) for g in grads):
        norm = norms.total_norm([g.double() for g in grads])
    return norm
