"""`FitState`: what one fit of a `MuonMixin` module holds beyond each batch.

``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)``, ``Trainer(accumulate_grad_batches=...)`` and a
``GradientAccumulationScheduler`` mean what they mean under automatic optimization, and the mixin's own
``gradient_clip_val`` and ``accumulate_grad_batches`` do the same: the fit takes the Trainer's flags off it (so
that Lightning's manual-optimization check lets them through), resolves them against the mixin's arguments, and
gives them back at its end. Given in both places with different values, the fit is refused before it trains,
naming both.

The fit's state holds the fit's optimizers and the origin of their param groups (`OptimizerPair`), applies what
the fit's first training batch shows (`follow_batch`: the roles of `lightning_muon.routing.trace_step`, agreed
and checked by `lightning_muon.lightning._first_batch`, applied by the pair), and what later batches show of the
parameters the first did not reach (followed while there are some, `follows`, for a bounded number of updates),
and, for
``trainer.fit(torch.compile(model))``, compiles the parent's ``training_step`` alone (`compiler`), never the
update around it.

The mixin creates a `FitState` in ``configure_callbacks`` (the first hook of a fit), which also gives the fit its
own callback, `FitEnd`: Lightning calls the module's ``teardown`` only when a fit ends normally, and the callbacks'
``on_exception`` when it ends by an exception or an interrupt, so the callback ends the fit on either exit, giving
back everything it borrowed (`FitState.teardown`). The state's other methods are named after the hooks that call
them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.lightning import _checkpoint, _checks, _compat, _finetuning, _first_batch
from lightning_muon.lightning._config import MuonConfig
from lightning_muon.lightning._late import stepped
from lightning_muon.lightning._pair import OptimizerPair, conform_structure, layout_of, saved_added_members
from lightning_muon.lightning._schedulers import build_schedulers
from lightning_muon.lightning._update_loop import UpdateSettings
from lightning_muon.optim.groups import ns_dtype_line
from lightning_muon.routing import MUON, GraphRoles, Routing, loss_in, trace_step

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch import LightningModule


@dataclass(frozen=True)
class Accumulation:
    """Micro-batches per update: a fixed number, or a ``GradientAccumulationScheduler``'s by epoch."""

    batches: int = 1
    #: The ``GradientAccumulationScheduler`` taken off the Trainer, if one was given (it decides from then on).
    scheduler: GradientAccumulationScheduler | None = None

    def at(self, epoch: int) -> int:
        """Micro-batches per update during ``epoch``."""
        return self.batches if self.scheduler is None else self.scheduler.get_accumulate_grad_batches(epoch)


class FitEnd(Callback):
    """The callback a `MuonMixin` fit adds to its Trainer (through the module's ``configure_callbacks``): it ends the
    fit (``end``: give back what it borrowed, drop its state) on whichever exit it takes. Lightning calls the
    callbacks' ``teardown`` when a fit ends normally (or a tuner ends it), and their ``on_exception`` when it ends
    by an exception or an interrupt (a ``KeyboardInterrupt`` included), where it calls no hook of the module.
    ``end`` takes the callback out of the Trainer's callbacks."""

    def __init__(self, end: Callable[[], None]) -> None:
        self._end = end

    def teardown(self, trainer: pl.Trainer, pl_module: LightningModule, stage: str) -> None:
        self._end()

    def on_exception(self, trainer: pl.Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._end()


class FitState:
    """One fit's settings, what it borrowed from the Trainer, and its optimizers.

    Args:
        config: the mixin's configuration.
        settings: what each update uses (clipping, the skip limit).
        accumulation: micro-batches per update.
        trainer_flags: what the Trainer was given, put back at the end of the fit.
    """

    def __init__(self, config: MuonConfig, settings: UpdateSettings, accumulation: Accumulation,
                 trainer_flags: _compat.TrainerFlags) -> None:
        self.config = config
        self.settings = settings
        self.accumulation = accumulation
        self.trainer_flags = trainer_flags
        #: The monitor-driven schedulers: id -> (metric, strict), which manual optimization would drop.
        self.monitors: dict[int, tuple[str, bool]] = {}
        #: ``torch.compile(model)``'s compiler, for the parent's ``training_step`` (``None``: not compiled).
        self.compiler: Callable[[Callable[..., Any]], Any] | None = None
        #: What ``torch.compile(model)`` gave the module and the fit took off it (``None``: not compiled).
        self._compiled: _compat.CompiledStep | None = None
        #: The strategy whose ``load_checkpoint`` the fit wraps, and its own before (``None``: its class's).
        self._wrapped_load: tuple[Any, Callable[..., Any] | None] | None = None
        #: The fit's Trainer (what it borrowed is given back there) and its callback there (`FitEnd`).
        self.trainer: pl.Trainer | None = None
        self.callback: FitEnd | None = None
        #: Whether both optimizers are built even where the start routes nothing to one (a finetuning callback
        #: will unfreeze parameters for it).
        self.keep_both = False
        #: The fit's optimizers and their groups (from configure_optimizers).
        self.pair: OptimizerPair | None = None
        #: The record of the checkpoint the fit resumes (``None``: a fresh fit, or a strategy that restores after
        #: on_fit_start).
        self.resumed: dict[str, Any] | None = None
        #: The parameters no batch has reached yet whose route a batch could change (``None``: not worked out yet).
        self._waiting: list[str] | None = None
        #: Whether the Muon groups' matrix structure was checked against the routing after the states loaded.
        self._structure_conformed = False
        #: The global step of the fit's first followed batch, from which `_first_batch.UNREACHED_UPDATES` count.
        self._following_since: int | None = None
        #: Whether the fit stopped following batches with parameters still unreached (said once, as a warning).
        self._gave_up = False

    @classmethod
    def start(cls, module: LightningModule, config: MuonConfig, load_record: Callable[[dict[str, Any]], None],
              callback: FitEnd) -> FitState:
        """From the mixin's ``configure_callbacks``, before Lightning checks the fit: refuse what cannot work, take
        the Trainer's clipping and accumulation flags (and ``GradientAccumulationScheduler``) for the mixin and
        resolve them against ``config``; make the strategy's checkpoint loading name unreadable files and give a
        distributed checkpoint's record to ``load_record`` first; take ``torch.compile``'s compiler off the step.
        ``callback`` (which the mixin gives Lightning) ends the fit, however it ends, and leaves the Trainer then."""
        trainer = module.trainer
        _checks.check_strategy(trainer.strategy)  # before the strategy flattens anything (FSDP1, DeepSpeed)
        _checks.check_callbacks(module, config.muon_enabled)
        flags = _compat.take_trainer_flags(trainer)
        try:
            fit = resolve(config, flags)
        except Exception:
            _compat.restore_trainer_flags(trainer, flags)
            raise
        fit.trainer, fit.callback = trainer, callback
        fit._wrap_load(trainer.strategy, load_record)
        fit._compiled = _compat.take_compiled_training_step(module)
        fit.compiler = fit._compiled.compiler if fit._compiled is not None else None
        return fit

    def _wrap_load(self, strategy: Any, load_record: Callable[[dict[str, Any]], None]) -> None:
        self._wrapped_load = (strategy, vars(strategy).get("load_checkpoint"))
        named = _checkpoint.naming_unreadable_files(strategy.load_checkpoint, type(strategy).__name__,
                                                    by_order=_compat.maps_optimizer_states_by_order(strategy))
        strategy.load_checkpoint = _checkpoint.restore_record_first(named, load_record)

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's loop already knows how to count accumulated batches (logger steps, validation zero_grad,
        ``estimated_stepping_batches``): give it the fit's number. The fit's callbacks are all attached now (the
        module's ``configure_callbacks`` too): refuse a finetuning callback that cannot work with the pair, and
        keep both optimizers where one may come."""
        _compat.set_accumulate_grad_batches(trainer, self.accumulation.at(trainer.current_epoch))
        callbacks = _compat.trainer_callbacks(trainer)
        _finetuning.check_finetuning_callbacks(callbacks, self.config.muon_enabled)
        self.keep_both = self.config.muon_enabled and bool(_finetuning.finetuning_callbacks(callbacks))

    def configure_optimizers(self, pair: OptimizerPair, schedulers: list[dict[str, Any]]) -> None:
        """Keep the fit's optimizers (``pair``); keep the monitor of each monitor-driven scheduler config (manual
        optimization drops it) for `on_fit_start`, taking it out of the config Lightning validates."""
        self.pair = pair
        self.monitors = {
            id(c["scheduler"]): (c.pop("monitor"), c.pop("strict", True)) for c in schedulers if "monitor" in c
        }

    def on_fit_start(self, module: LightningModule, own_classes: Sequence[type], lrs_given: bool) -> None:
        """Give the monitor-driven schedulers back their metric; say what the parent's ``configure_optimizers``
        (the first of ``own_classes`` that defines it) would have built (``lrs_given``: the user chose the lrs);
        on resume, make what a finetuning callback unfroze trainable again (`_finetuning.restore_unfrozen`) and
        give the optimizers the checkpoint's groups, before its optimizer states load."""
        trainer = module.trainer
        for config in trainer.lr_scheduler_configs:
            monitor = self.monitors.get(id(config.scheduler))
            if monitor is not None:
                config.reduce_on_plateau, (config.monitor, config.strict) = True, monitor
        _checks.tell_replaced(module, own_classes, lrs_given)
        saved = self.resumed
        if saved is not None and self.pair is not None:
            if _finetuning.restore_unfrozen(module, saved_added_members(saved)):
                _checkpoint.check_routing(saved, _checkpoint.optimizer_names(self.pair.routing()))
            self.pair.restore(trainer, saved, self.pair.routing())

    def record(self) -> dict[str, Any]:
        """What the fit adds to its checkpoints' record: the pair's groups (`OptimizerPair.record`)."""
        return self.pair.record() if self.pair is not None else {}

    def on_train_epoch_start(self, trainer: pl.Trainer) -> None:
        """A ``GradientAccumulationScheduler``'s number for this epoch (what the callback itself would set)."""
        if self.accumulation.scheduler is not None:
            _compat.set_accumulate_grad_batches(trainer, self.accumulation.at(trainer.current_epoch))

    def on_train_batch_start(self) -> None:
        """Before a training batch (the first of an epoch too, right after the finetuning callbacks' epoch start):
        every optimizer holds its part of the groups added so far."""
        if self.pair is not None:
            self.pair.add_waiting()
            if not self._structure_conformed:  # after a resumed checkpoint's param groups loaded
                self._structure_conformed = True
                conform_structure(self.pair, self.pair.routing())

    def follows(self, module: LightningModule, roles: GraphRoles | None) -> bool:
        """Whether the fit follows this training batch: its first (``roles`` is ``None``), or, while the batches so
        far have not reached some parameters whose route a batch could change, one of the first
        `_first_batch.UNREACHED_UPDATES` updates from the first followed one; after them a warning names what is
        still unreached, and no batch is followed again. Every rank decides the same (the roles and the step
        agree)."""
        if roles is None:
            return True
        if self._waiting is None:  # roles given before the fit, or from the checkpoint it resumes
            self._waiting = _first_batch.waited_for(self.config.route(module, roles), roles)
        if not self._waiting or self._gave_up:
            return False
        step = module.trainer.global_step
        if self._following_since is None:
            self._following_since = step
        if step - self._following_since < _first_batch.UNREACHED_UPDATES:
            return True
        self._gave_up = True
        _first_batch.warn_unreached(self.config.route(module, roles), self._waiting, step - self._following_since)
        return False

    def follow_batch(self, module: LightningModule, batch: Any, run: Callable[[], Any],
                     roles: GraphRoles | None) -> tuple[Any, GraphRoles | None]:
        """Run the parent's step (``run``) on a training batch, following it, and apply the roles it shows before
        the backward: on the fit's first batch (``roles`` is ``None``), the ranks agree, the optimizers are corrected
        where it moves parameters, and what it did is said (INFO); on a later one, the parameters it first reaches
        are placed where it shows (`OptimizerPair.place`), said once. Returns the step's output and the roles so far
        (unchanged where the step returned no loss: the next batch is followed instead)."""
        start = time.perf_counter()
        output, seen = trace_step(module, batch, run, loss_in)
        if loss_in(output) is None:
            return output, roles
        trainer = module.trainer
        if self._following_since is None:
            self._following_since = trainer.global_step
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        seen = _first_batch.agreed_roles(trainer, seen, trainable)
        if roles is None:
            before = self.config.route(module, None)
            after = self.config.route(module, seen)
            _first_batch.check_ranks_agree(trainer, after)
            self._waiting = _first_batch.waited_for(after, seen)
            self.hold(trainer, after, keep_both=bool(self._waiting))
            rank_zero_info(_first_batch.moves_message(before, after, seen, time.perf_counter() - start))
            return output, seen
        return output, self._place_reached(module, roles, seen, start)

    def _place_reached(self, module: LightningModule, roles: GraphRoles, seen: GraphRoles, start: float) -> GraphRoles:
        """``roles`` with what ``seen``, a later batch's, showed of the parameters no batch had reached, placed by the
        pair. One that holds optimizer state all the same (it trained by a path the batches could not show) keeps
        its place, as one whose new optimizer this fit lacks (said)."""
        if self.pair is None or roles.unreached is None or seen.unreached is None:
            return roles
        newly = roles.unreached - seen.unreached
        if not newly:
            return roles
        roles = roles.reached(stepped(self.pair.optimizers.values(), newly))
        before = self.config.route(module, roles)
        merged = roles.merge(seen)
        after = self.config.route(module, merged)
        lacking = {r.name for r in after.routes if r.name in merged.late - roles.late
                   and str(r.optimizer) not in self.pair.optimizers}
        if lacking:
            _first_batch.warn_lacking(after, lacking)
            merged = roles.reached(frozenset(lacking)).merge(seen)
            after = self.config.route(module, merged)
        moved = self.pair.place(after)
        update = module.trainer.global_step + 1
        rank_zero_info(_first_batch.reached_message(update, before, after, merged.late - roles.late, moved,
                                                    time.perf_counter() - start))
        self._waiting = _first_batch.waited_for(after, merged)
        return merged

    def hold(self, trainer: pl.Trainer, routing: Routing, keep_both: bool = False) -> None:
        """Make the fit's optimizers, where they are built and hold no state yet, hold ``routing``'s groups (with
        ``keep_both``, a placeholder in one left without any: a later batch may place parameters there)."""
        pair = self.pair
        if pair is not None and trainer.optimizers and not any(o.state for o in trainer.optimizers) \
                and not pair.holds(routing):
            pair.regroup(trainer, routing, keep_both)

    def restore(self, trainer: pl.Trainer, saved: dict[str, Any], routing: Routing) -> None:
        """A checkpoint restored into this fit after its optimizers were built (a tool that saves and restores
        within the fit, such as Lightning's batch-size finder; a strategy that restores after setting up): the
        optimizers hold its groups before its optimizer states load (`OptimizerPair.restore`)."""
        if self.pair is not None and trainer.optimizers:
            self.pair.restore(trainer, saved, routing)

    def teardown(self, module: LightningModule, config: MuonConfig) -> MuonConfig:
        """The end of the fit, however it ended (`FitEnd`): give the Trainer its flags and callbacks, the strategy
        its ``load_checkpoint`` and the module its compiled ``training_step`` back; return ``config`` for the
        next fit: with AdamW's lr set to ``lr_find``'s suggestion where this fit ran one that writes its
        suggestion back, on the ``muon=None`` baseline (the saved hyperparameters say so too)."""
        trainer = self.trainer if self.trainer is not None else module.trainer
        if self.callback is not None:
            _compat.drop_callback(trainer, self.callback)
        _compat.restore_trainer_flags(trainer, self.trainer_flags)
        if self._wrapped_load is not None:
            strategy, own = self._wrapped_load
            if own is not None:
                strategy.load_checkpoint = own
            else:
                vars(strategy).pop("load_checkpoint", None)
        if self._compiled is not None:
            _compat.give_back_compiled_training_step(module, self._compiled)
        finders = _compat.lightning_classes(LearningRateFinder)
        finder = next((c for c in _compat.trainer_callbacks(trainer) if isinstance(c, finders)), None)
        if finder is None or finder.optimal_lr is None or not _compat.lr_finder_updates_attr(finder):
            return config
        lr = finder.optimal_lr.suggestion()
        if lr is None or config.muon_enabled:
            return config
        config = config.with_adamw_lr(lr)
        module.hparams["adamw"] = config.adamw
        rank_zero_info(f"MuonMixin: lr_find's suggestion, lr={lr:g}, is AdamW's lr from the next fit on.")
        return config


def end_fit(module: Any) -> None:
    """The end of ``module``'s (a `MuonMixin`'s) fit, by any exit (from the fit's callback, `FitEnd`: Lightning
    calls the module's ``teardown`` only when a fit ends normally): the Trainer, its strategy and the module get
    back what the fit borrowed, lr_find's suggestion is kept, the update loop's hooks come off; once, whichever
    exit."""
    fit, module._muon_fit = module._muon_fit, None
    if fit is None:
        return
    try:
        module._muon_config = fit.teardown(module, module._muon_config)
    finally:
        module._muon_loop.end_fit()


def build_optimizers(module: LightningModule, routing_now: Callable[[], Routing], config: MuonConfig,
                     fit: FitState | None = None) -> tuple[OptimizerPair, list[dict[str, Any]]]:
    """The optimizer pair over the param groups of the module's routing as it stands (``routing_now``: asked again
    for what a finetuning callback unfreezes later) (`OptimizerPair.build`; with both optimizers where the
    ``fit`` keeps both: it has a finetuning callback) and their schedulers' configs (none without
    ``lr_scheduler`` or an optimizer's own: `_schedulers.build_schedulers`). The routing table is printed once
    (INFO), and a model with nothing trainable refused by name."""
    routing = routing_now()
    if not routing.routes:
        raise MisconfigurationException(
            f"{type(module).__name__} has no trainable parameter: every parameter has requires_grad=False (or "
            "the layers are built after the optimizers). Unfreeze what should train "
            "(`layer.requires_grad_(True)`), or build the layers in __init__ or configure_model."
        )
    rank_zero_info("\n" + routing.render())
    pair = OptimizerPair(config, routing_now, keep_both=fit is not None and fit.keep_both)
    optimizers = pair.build(routing)
    if (precision := ns_dtype_line(pair.optimizers.get(MUON))) is not None:  # every rank: they agree
        rank_zero_info(precision)  # the Newton-Schulz dtype chosen by hardware
    if not config.scheduled:
        return pair, []
    return pair, build_schedulers(config.scheduler_factories, optimizers,
                                  lambda: module.trainer.estimated_stepping_batches)


def checkpoint_record(module: Any, config: MuonConfig, roles: GraphRoles | None, loop_state: dict[str, int],
                      pair: OptimizerPair | None) -> dict[str, Any]:
    """What ``module``'s (a `MuonMixin`'s) checkpoint holds under `_checkpoint.CHECKPOINT_KEY`
    (`_checkpoint.record`): its routing and ``config``'s settings, with the groups its Trainer's optimizers hold
    (``pair``'s record where they are its optimizers, also after the fit ended)."""
    trainer = _compat.attached_trainer(module)
    optimizers = list(trainer.optimizers) if trainer is not None else []
    held = None
    if pair is not None and len(optimizers) == len(pair.optimizers) and all(
            a is b for a, b in zip(optimizers, pair.optimizers.values(), strict=True)):
        held = pair.record()
    elif optimizers:
        held = {"groups": [layout_of(o) for o in optimizers]}
    return _checkpoint.record(module.muon_routing(), roles, loop_state, config.to_hparams(), held)


def check_resume(module: LightningModule, checkpoint: dict[str, Any], saved: dict[str, Any], routing: Routing,
                 fit: FitState | None) -> None:
    """Refuse a resume from ``checkpoint`` (its record: ``saved``) that cannot meet ``module`` (its ``routing``:
    `_checkpoint.check_resume`, told whether a finetuning callback gives back the groups it added). Where the
    ``fit``'s optimizers are built already (a checkpoint restored within the fit), they take its groups now;
    otherwise the record is kept for the fit's ``on_fit_start``, which gives them (where the strategy restores
    before that: one process, DDP)."""
    trainer = module.trainer
    _checkpoint.check_resume(saved, routing, module, _finetuning.restores_groups(trainer, checkpoint))
    if fit is None:
        return
    if fit.pair is not None:
        fit.restore(trainer, saved, routing)
    elif not trainer.strategy.restore_checkpoint_after_setup:
        fit.resumed = saved


def resolve(config: MuonConfig, flags: _compat.TrainerFlags) -> FitState:
    """The fit's state from the mixin's arguments and the Trainer's flags taken off it; a
    `MisconfigurationException` naming both values where the Trainer and the mixin disagree."""
    schedulers = [c for _, c in flags.accumulation_schedulers]
    if len(schedulers) > 1:
        raise MisconfigurationException(
            f"{len(schedulers)} GradientAccumulationScheduler callbacks were given; keep one."
        )
    scheduler = schedulers[0] if schedulers else None
    own_n, trainer_n = config.accumulate_grad_batches, flags.accumulate_grad_batches
    if scheduler is not None and own_n != 1:
        raise MisconfigurationException(
            f"GradientAccumulationScheduler(scheduling={scheduler.scheduling}) and MuonMixin(accumulate_grad_batches="
            f"{own_n}) both set the accumulation: keep one of them."
        )
    if own_n != 1 and trainer_n != 1 and own_n != trainer_n:
        raise MisconfigurationException(
            f"Trainer(accumulate_grad_batches={trainer_n}) and MuonMixin(accumulate_grad_batches={own_n}) disagree: "
            "give the number of micro-batches per update in one place (either works)."
        )
    clip, algorithm = _resolve_clipping(config.gradient_clip_val, flags)
    settings = UpdateSettings(clip, algorithm, config.max_consecutive_skips)
    return FitState(config, settings, Accumulation(own_n if own_n != 1 else trainer_n, scheduler), flags)


def _resolve_clipping(own_clip: float | None, flags: _compat.TrainerFlags) -> tuple[float | None, str]:
    """The clip value and algorithm, from the mixin's ``gradient_clip_val`` and the Trainer's two flags."""
    trainer_clip = flags.gradient_clip_val
    algorithm = flags.gradient_clip_algorithm or "norm"
    if trainer_clip is not None and not trainer_clip > 0:
        trainer_clip = None  # Lightning reads gradient_clip_val=0 as "no clipping"
    if own_clip is not None and trainer_clip is not None and (own_clip != trainer_clip or algorithm != "norm"):
        raise MisconfigurationException(
            f"Trainer(gradient_clip_val={trainer_clip}, gradient_clip_algorithm={algorithm!r}) and MuonMixin("
            f"gradient_clip_val={own_clip}) (a global norm) disagree: give the clipping in one place."
        )
    if trainer_clip is None and flags.gradient_clip_algorithm is not None and own_clip is not None:
        algorithm = flags.gradient_clip_algorithm  # Trainer(gradient_clip_algorithm=...) with the mixin's value
        if algorithm != "norm":
            raise MisconfigurationException(
                f"Trainer(gradient_clip_algorithm={algorithm!r}) with MuonMixin(gradient_clip_val={own_clip}): the "
                f"mixin's value is a norm. Use Trainer(gradient_clip_val={own_clip}, gradient_clip_algorithm="
                f"{algorithm!r}) instead."
            )
    return own_clip if own_clip is not None else trainer_clip, algorithm
