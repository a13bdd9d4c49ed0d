"""`FitState`: what one fit of a `MuonMixin` module holds beyond each batch.

``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)``, ``Trainer(accumulate_grad_batches=...)`` and a
``GradientAccumulationScheduler`` mean what they mean under automatic optimization, and the mixin's own
``gradient_clip_val`` and ``accumulate_grad_batches`` do the same: the fit takes the Trainer's flags off it (so
that Lightning's manual-optimization check lets them through), resolves them against the mixin's arguments, and
gives them back at its end. Given in both places with different values, the fit is refused before it trains,
naming both.

The fit's state also applies what the fit's first training batch shows (`follow_first_batch`: the roles of
`lightning_muon.routing.trace_step`, applied by `lightning_muon.lightning._first_batch`), and, for
``trainer.fit(torch.compile(model))``, compiles the parent's ``training_step`` alone (`compiler`), never the
update around it.

The mixin creates a `FitState` in ``configure_callbacks`` (the first hook of a fit) and drops it in
``teardown``; its methods are named after the hooks that call them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.lightning import _checkpoint, _checks, _compat, _finetuning, _first_batch, _unfreezing
from lightning_muon.lightning._config import MuonConfig
from lightning_muon.lightning._update_loop import UpdateSettings, loss_in
from lightning_muon.optim import _precision
from lightning_muon.routing import ADAMW, MUON, Algorithm, GraphRoles, Routing, trace_step

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch import LightningModule
    from torch.optim import Optimizer


class FitState:
    """One fit's settings and what it borrowed from the Trainer.

    Args:
        config: the mixin's configuration.
        settings: what each update uses (clipping, the skip limit).
        accumulate_grad_batches: micro-batches per update (before a ``GradientAccumulationScheduler`` changes it
            at an epoch start).
        accumulation_scheduler: the ``GradientAccumulationScheduler`` taken off the Trainer, if one was given.
        trainer_flags: what the Trainer was given, put back at the end of the fit.
    """

    def __init__(
        self,
        config: MuonConfig,
        settings: UpdateSettings,
        accumulate_grad_batches: int,
        accumulation_scheduler: GradientAccumulationScheduler | None,
        trainer_flags: _compat.TrainerFlags,
    ) -> None:
        self.config = config
        self.settings = settings
        self.accumulate_grad_batches = accumulate_grad_batches
        self.accumulation_scheduler = accumulation_scheduler
        self.trainer_flags = trainer_flags
        #: The monitor-driven schedulers: id -> (metric, strict), which manual optimization would drop.
        self.monitors: dict[int, tuple[str, bool]] = {}
        #: What the optimizers were built from (``parent_lr=True``: at the parent's lr), from configure_optimizers,
        #: and which algorithm each optimizer is, in order (an optimizer without parameters is not built).
        self.optimizer_config = config
        self.algorithms: list[str] = []
        #: ``torch.compile(model)``'s compiler, for the parent's ``training_step`` (``None``: not compiled).
        self.compiler: Callable[[Callable[..., Any]], Any] | None = None
        #: The strategy whose ``load_checkpoint`` the fit wraps, and its own before (``None``: its class's).
        self._wrapped_load: tuple[Any, Callable[..., Any] | None] | None = None
        #: Whether both optimizers are built even where the start routes nothing to one (a finetuning callback
        #: will unfreeze parameters for it), holding an empty group until then.
        self.keeps_optimizers = False
        #: The module's routing as it stands (from configure_optimizers), and the record of the checkpoint the fit
        #: resumes (``None``: a fresh fit, or a strategy that restores after on_fit_start).
        self._routing: Callable[[], Routing] | None = None
        self.resumed: dict[str, Any] | None = None
        #: The fit's finetuning callbacks, wrapped for the pair from on_fit_start (`_finetuning`).
        self.finetuning: _finetuning.Finetuning | None = None

    @classmethod
    def start(cls, module: LightningModule, config: MuonConfig,
              load_roles: Callable[[dict[str, Any]], None]) -> FitState:
        """From the mixin's ``configure_callbacks``, before Lightning checks the fit: refuse what cannot work, take
        the Trainer's clipping and accumulation flags (and ``GradientAccumulationScheduler``) for the mixin and
        resolve them against ``config``; make the strategy's checkpoint loading name unreadable files and give a
        distributed checkpoint's record to ``load_roles`` first; take ``torch.compile``'s compiler off the step."""
        trainer = module.trainer
        _checks.check_callbacks(module, config.muon_enabled)
        flags = _compat.take_trainer_flags(trainer)
        try:
            fit = resolve(config, flags)
        except Exception:
            _compat.restore_trainer_flags(trainer, flags)
            raise
        fit._wrap_load(trainer.strategy, load_roles)
        fit.compiler = _compat.take_compiled_training_step(module)
        return fit

    def _wrap_load(self, strategy: Any, load_roles: Callable[[dict[str, Any]], None]) -> None:
        self._wrapped_load = (strategy, vars(strategy).get("load_checkpoint"))
        named = _checkpoint.naming_unreadable_files(strategy.load_checkpoint, type(strategy).__name__)
        strategy.load_checkpoint = _first_batch.restore_roles_first(named, load_roles)

    def accumulation_at(self, epoch: int) -> int:
        """Micro-batches per update during ``epoch``."""
        if self.accumulation_scheduler is None:
            return self.accumulate_grad_batches
        return self.accumulation_scheduler.get_accumulate_grad_batches(epoch)

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's loop already knows how to count accumulated batches (logger steps, validation zero_grad,
        ``estimated_stepping_batches``): give it the fit's number. The fit's callbacks are all attached now (the
        module's ``configure_callbacks`` too): refuse a finetuning callback that cannot work with the pair, and
        keep both optimizers where one may come."""
        _compat.set_accumulate_grad_batches(trainer, self.accumulation_at(trainer.current_epoch))
        callbacks = _compat.trainer_callbacks(trainer)
        _unfreezing.check_finetuning_callbacks(callbacks, self.config.muon_enabled)
        self.keeps_optimizers = self.config.muon_enabled and bool(_unfreezing.finetuning_callbacks(callbacks))

    def configure_optimizers(self, optimizer_config: MuonConfig, built: dict[str, Optimizer],
                             schedulers: list[dict[str, Any]], routing: Callable[[], Routing]) -> None:
        """Keep what the optimizers were built from and which they are (``built``: by algorithm, in order); make
        them route what a finetuning callback adds (``routing``: the module's routing as it stands, see
        `_unfreezing`); keep the monitor of each monitor-driven scheduler config (manual optimization drops it)
        for `on_fit_start`, taking it out of the config Lightning validates."""
        self.optimizer_config = optimizer_config
        self.algorithms = list(built)
        self._routing = routing
        _unfreezing.route_added_groups(built, routing)
        self.monitors = {
            id(c["scheduler"]): (c.pop("monitor"), c.pop("strict", True)) for c in schedulers if "monitor" in c
        }

    def on_fit_start(self, module: LightningModule, own_classes: Sequence[type], lrs_given: bool) -> None:
        """Give the monitor-driven schedulers back their metric; say what the parent's ``configure_optimizers``
        (the first of ``own_classes`` that defines it) would have built (``lrs_given``: the user chose the lrs);
        wrap the finetuning callbacks for the pair; on resume (the callbacks' ``on_fit_start`` gave the optimizers
        back the groups they added), check the optimizers hold the checkpoint's groups and make what a finetuning
        callback unfroze trainable again (`_finetuning.restore_unfrozen`)."""
        trainer = module.trainer
        for config in trainer.lr_scheduler_configs:
            monitor = self.monitors.get(id(config.scheduler))
            if monitor is not None:
                config.reduce_on_plateau, (config.monitor, config.strict) = True, monitor
        _checks.tell_replaced(module, own_classes, lrs_given)
        saved = self.resumed
        self.finetuning = _finetuning.Finetuning(trainer, module, self.algorithms,
                                                 saved.get("backbone_lrs") if saved is not None else None)
        if saved is not None:
            _checkpoint.check_groups(saved, trainer.optimizers, self.algorithms)
            if _finetuning.restore_unfrozen(module, trainer.optimizers) and self._routing is not None:
                _checkpoint.check_routing(saved, _checkpoint.optimizer_names(self._routing()))

    def record(self) -> dict[str, Any]:
        """What the fit adds to its checkpoints' record (each optimizer's backbone lr, `_finetuning`)."""
        return self.finetuning.record() if self.finetuning is not None else {}

    def on_train_epoch_start(self, trainer: pl.Trainer) -> None:
        """A ``GradientAccumulationScheduler``'s number for this epoch (what the callback itself would set)."""
        if self.accumulation_scheduler is not None:
            _compat.set_accumulate_grad_batches(trainer, self.accumulation_at(trainer.current_epoch))

    def follow_first_batch(self, module: LightningModule, batch: Any,
                           run: Callable[[], Any]) -> tuple[Any, GraphRoles | None]:
        """Run the parent's step (``run``) on the fit's first training batch, following it, and apply the roles it
        shows before the backward: check that every rank reached the same routing, correct the optimizers where
        it moves parameters, say what it did (INFO). Returns the step's output and the roles (``None`` where the
        step returned no loss: the next batch is followed instead)."""
        start = time.perf_counter()
        output, roles = trace_step(module, batch, run, loss_in)
        if loss_in(output) is None:
            return output, None
        before = _first_batch.routing_for(module, self.config, None)
        after = _first_batch.routing_for(module, self.config, roles)
        _first_batch.check_ranks_agree(module.trainer, after)
        self.hold(module.trainer, after)
        rank_zero_info(_first_batch.moves_message(before, after, roles, time.perf_counter() - start))
        return output, roles

    def hold(self, trainer: pl.Trainer, routing: Routing) -> None:
        """Make the fit's optimizers, where they are built and hold no state yet, hold ``routing``'s groups."""
        optimizers = trainer.optimizers
        if optimizers and not any(o.state for o in optimizers) and not _first_batch.holds(
                optimizers, routing, self.algorithms, self.keeps_optimizers):
            _first_batch.correct_optimizers(trainer, routing, self.optimizer_config, self.algorithms,
                                            self.keeps_optimizers)

    def teardown(self, module: LightningModule, config: MuonConfig) -> MuonConfig:
        """Give the Trainer its flags and the strategy its ``load_checkpoint`` back; return ``config`` for the
        next fit: with AdamW's lr set to ``lr_find``'s suggestion where this fit ran one that writes its
        suggestion back, on the ``muon=None`` baseline (the saved hyperparameters say so too)."""
        trainer = module.trainer
        _compat.restore_trainer_flags(trainer, self.trainer_flags)
        if self.finetuning is not None:
            self.finetuning.teardown()
        if self._wrapped_load is not None:
            strategy, own = self._wrapped_load
            if own is not None:
                strategy.load_checkpoint = own
            else:
                vars(strategy).pop("load_checkpoint", None)
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


def build_optimizers(module: LightningModule, routing: Routing, config: MuonConfig,
                     fit: FitState | None = None) -> tuple[dict[str, Optimizer], list[dict[str, Any]]]:
    """The optimizers over ``routing``'s param groups, by algorithm (``{MUON: ..., ADAMW: ...}``, in that order),
    each only where it has parameters (with ``muon=None`` and no parameter at all, AdamW) or, where the ``fit``
    keeps both (it has a finetuning callback), each with an empty group where it has none; and their schedulers'
    configs (none without ``lr_scheduler``). The routing table is printed once (INFO), an optimizer left without
    parameters said once, and a model with nothing trainable refused by name."""
    if not routing.routes:
        raise MisconfigurationException(
            f"{type(module).__name__} has no trainable parameter: every parameter has requires_grad=False (or "
            "the layers are built after the optimizers). Unfreeze what should train "
            "(`layer.requires_grad_(True)`), or build the layers in __init__ or configure_model."
        )
    rank_zero_info("\n" + routing.render())
    keep_both = fit is not None and fit.keeps_optimizers
    built: dict[str, Optimizer] = {}
    if routing.muon_groups or keep_both:
        built[MUON] = config.build(Algorithm.MUON, routing.muon_groups or [_unfreezing.placeholder_group(MUON)])
    elif config.muon_enabled:
        rank_zero_warn("MuonMixin: no parameter was routed to Muon; only AdamW will train this model.")
    if routing.adamw_groups or keep_both:
        built[ADAMW] = config.build_adamw(routing.adamw_groups or [_unfreezing.placeholder_group(ADAMW)])
    else:  # every trainable parameter is a hidden matrix (LoRA adapters, a frozen model's blocks)
        rank_zero_info("MuonMixin: no parameter was routed to AdamW; Muon alone trains this model.")
    for algorithm in (MUON, ADAMW):
        if keep_both and not routing.groups(algorithm):
            rank_zero_info(f"MuonMixin: no parameter is routed to {algorithm} yet: it holds an empty group until a "
                           "finetuning callback unfreezes parameters for it.")
    if (precision := _precision.fit_start_line(built.get(MUON))) is not None:  # every rank: the ranks agree
        rank_zero_info(precision)  # the Newton-Schulz dtype chosen by hardware (issue 43)
    if config.lr_scheduler_factory is None:
        return built, []
    return built, config.build_schedulers(list(built.values()), lambda: module.trainer.estimated_stepping_batches)


def checkpoint_record(module: Any, config: MuonConfig, roles: GraphRoles | None, loop_state: dict[str, int],
                      fit: FitState | None) -> dict[str, Any]:
    """What ``module``'s (a `MuonMixin`'s) checkpoint holds under `_checkpoint.CHECKPOINT_KEY`
    (`_checkpoint.record`): its routing and ``config``'s settings, with the groups its Trainer's optimizers hold
    and what the ``fit`` adds (each optimizer's backbone lr)."""
    trainer = _compat.attached_trainer(module)
    return _checkpoint.record(module.muon_routing(), roles, loop_state, config.to_hparams(),
                              trainer.optimizers if trainer is not None else None,
                              fit.record() if fit is not None else None)


def check_resume(module: LightningModule, checkpoint: dict[str, Any], saved: dict[str, Any], routing: Routing,
                 fit: FitState | None) -> None:
    """Refuse a resume from ``checkpoint`` (its record: ``saved``) that cannot meet ``module`` (its ``routing``:
    `_checkpoint.check_resume`, told whether a finetuning callback gives back the groups it added); keep the
    record for the ``fit``'s ``on_fit_start``, which checks it against the optimizers (where the strategy
    restores before that: one process, DDP)."""
    trainer = module.trainer
    _checkpoint.check_resume(saved, routing, module, _finetuning.restores_groups(trainer, checkpoint))
    if fit is not None and not trainer.strategy.restore_checkpoint_after_setup:
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
    return FitState(config, settings, own_n if own_n != 1 else trainer_n, scheduler, flags)


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
