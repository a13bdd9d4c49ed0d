"""Every use of Lightning's private API in lightning_muon, each wrapped once.

Manual optimization leaves the update to the module, but a correct update
still has to speak to the loop: whether this micro-batch ends an update, the
hooks ``optimizer.step()`` would run, the ``global_step`` count, the step the
loggers use. Lightning has no public API for these, so this module is the only
place that touches its internals; ``tests/lightning/test_compat.py`` checks each one
against the installed Lightning and fails naming the wrapper to update.
No other module of the package may use a private Lightning name.

It also answers for both Lightning packages: many libraries still build on the standalone ``pytorch_lightning``,
whose classes are copies of ``lightning.pytorch``'s, not the same classes. `lightning_classes` gives a class's
copy in each package that is loaded, for every ``isinstance`` check the package makes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from lightning.pytorch.callbacks import BaseFinetuning, Callback, GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities import GradClipAlgorithmType

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from torch.optim import Optimizer

#: The Lightning releases these wrappers were checked against (``tests/lightning/test_compat.py``).
CHECKED_LIGHTNING = ("2.5", "2.6")
#: The two packages Lightning ships as: the unified ``lightning`` one and the standalone ``pytorch_lightning``.
PACKAGES = ("lightning.pytorch", "pytorch_lightning")


_T = TypeVar("_T")


def lightning_classes(cls: type[_T]) -> tuple[type[_T], ...]:
    """``cls`` (a ``lightning.pytorch`` class) and, when ``pytorch_lightning`` is loaded, its copy there: what
    ``isinstance`` needs to accept either package's objects. ``pytorch_lightning`` is never imported here (a
    module that uses it has imported it already)."""
    return cast("tuple[type[_T], ...]", _copies(cast(type, cls), "pytorch_lightning" in sys.modules))


@functools.cache
def _copies(cls: type, standalone_loaded: bool) -> tuple[type, ...]:
    if not standalone_loaded:
        return (cls,)
    module = importlib.import_module(cls.__module__.replace(PACKAGES[0], PACKAGES[1], 1))
    return cls, getattr(module, cls.__qualname__)


def is_lightning_module_base(cls: type) -> bool:
    """Whether ``cls`` is ``LightningModule`` or one of its bases (``nn.Module``, the hyperparameter mixins, ...)
    in either Lightning package: the classes that are not the user's own."""
    from lightning.pytorch import LightningModule

    return any(cls in module.__mro__ for module in lightning_classes(LightningModule))


def ends_update(trainer: pl.Trainer) -> bool:
    """Whether the current training batch is the last micro-batch of an update (Lightning's own decision:
    ``accumulate_grad_batches``, the end of the epoch, and the last batches of a fit)."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


@contextlib.contextmanager
def one_optimizer_step(lightning_optimizer: LightningOptimizer) -> Iterator[None]:
    """Count what runs inside as one optimizer step: ``trainer.global_step`` advances by one, however many
    optimizers step (the manual loop counts through these hooks of a ``LightningOptimizer``)."""
    lightning_optimizer._on_before_step()
    try:
        yield
    finally:
        lightning_optimizer._on_after_step()


def call_on_before_optimizer_step(trainer: pl.Trainer, optimizer: Optimizer) -> None:
    """Run ``on_before_optimizer_step`` of every callback, then of the module, as ``optimizer.step()`` would."""
    call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
    call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)


def cli_class_path(hparams: Any) -> str | None:
    """The class path LightningCLI stores in a model's hparams when it built the model (else ``None``)."""
    return hparams.get("_class_path")


def logger_step(trainer: pl.Trainer) -> int:
    """The step loggers give the metrics of the current batch (what ``LearningRateMonitor`` logs at)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def log_every_n_steps(trainer: pl.Trainer) -> int:
    """``Trainer(log_every_n_steps=...)`` (set by the logger connector, not declared on the Trainer)."""
    return trainer.log_every_n_steps  # type: ignore[attr-defined]


def set_accumulate_grad_batches(trainer: pl.Trainer, value: int) -> None:
    """Let the loop count ``value`` micro-batches per update (logger steps, ``estimated_stepping_batches``,
    the accumulation decision). Manual optimization refuses the Trainer flag only when it validates the
    loop's settings, which happens before ``LightningModule.setup``: written from ``setup``, it stands."""
    trainer.accumulate_grad_batches = value


def ends_epoch(trainer: pl.Trainer) -> bool:
    """Whether the current training batch is the last of its epoch (when Lightning's automatic loop steps the
    schedulers whose ``interval`` is ``"epoch"``)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def lr_finder_updates_attr(finder: LearningRateFinder) -> bool:
    """Whether a ``LearningRateFinder`` (``Tuner.lr_find``'s) writes its suggestion back (``update_attr``)."""
    return bool(finder._update_attr)


def trainer_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """``trainer.callbacks`` (set by the callback connector, not declared on the Trainer)."""
    return trainer.callbacks  # type: ignore[attr-defined]


def drop_callback(trainer: pl.Trainer, callback: Callback) -> None:
    """Take ``callback`` (one the module's ``configure_callbacks`` gave the fit) out of ``trainer.callbacks``, so the
    Trainer holds what it was built with again. A new list: Lightning may be iterating the old one, calling a hook
    of each callback (``on_exception``)."""
    trainer.callbacks = [c for c in trainer_callbacks(trainer) if c is not callback]  # type: ignore[attr-defined]


@dataclass
class TrainerFlags:
    """What the Trainer was given for the update that manual optimization makes its own: its values, taken
    off the Trainer for the fit (`take_trainer_flags`) and put back afterwards (`restore_trainer_flags`)."""

    gradient_clip_val: float | None
    gradient_clip_algorithm: str | None
    accumulate_grad_batches: int
    #: ``GradientAccumulationScheduler`` callbacks, with their places in ``trainer.callbacks``.
    accumulation_schedulers: list[tuple[int, GradientAccumulationScheduler]] = field(default_factory=list)


def take_trainer_flags(trainer: pl.Trainer) -> TrainerFlags:
    """Take ``Trainer(gradient_clip_val=, gradient_clip_algorithm=, accumulate_grad_batches=)`` and every
    ``GradientAccumulationScheduler`` off the Trainer, so that MuonMixin can honour them itself.

    Lightning refuses these for manual optimization in ``_verify_loop_configurations`` (and the callback in
    its ``on_train_start``); ``Trainer._run`` calls the module's ``configure_callbacks`` just before that check,
    which is where MuonMixin calls this. ``tests/lightning/test_compat.py`` pins that order through a real fit.
    """
    algorithm = trainer.gradient_clip_algorithm
    flags = TrainerFlags(
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=None if algorithm is None else str(getattr(algorithm, "value", algorithm)),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        accumulation_schedulers=[
            (i, c)
            for i, c in enumerate(trainer_callbacks(trainer))
            if isinstance(c, lightning_classes(GradientAccumulationScheduler))
        ],
    )
    trainer.gradient_clip_val = None
    trainer.gradient_clip_algorithm = None
    trainer.accumulate_grad_batches = 1
    taken = {id(c) for _, c in flags.accumulation_schedulers}
    trainer.callbacks = [c for c in trainer_callbacks(trainer) if id(c) not in taken]  # type: ignore[attr-defined]
    return flags


def restore_trainer_flags(trainer: pl.Trainer, flags: TrainerFlags) -> None:
    """Put back what `take_trainer_flags` took, so the Trainer reads as it was built (and a next fit takes it
    again)."""
    trainer.gradient_clip_val = flags.gradient_clip_val
    if flags.gradient_clip_algorithm is not None:
        trainer.gradient_clip_algorithm = GradClipAlgorithmType(flags.gradient_clip_algorithm)
    trainer.accumulate_grad_batches = flags.accumulate_grad_batches
    callbacks = list(trainer_callbacks(trainer))
    for index, callback in flags.accumulation_schedulers:
        if callback not in callbacks:
            callbacks.insert(min(index, len(callbacks)), callback)
    trainer.callbacks = callbacks  # type: ignore[attr-defined]


def optimizers_and_schedulers(optim_conf: Any) -> tuple[list[Any], list[Any]]:
    """The optimizers and schedulers in whatever a ``configure_optimizers`` returned (an optimizer, lists, a
    tuple of lists, dicts with ``"optimizer"`` and ``"lr_scheduler"``), read as Lightning reads it."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    optimizers, schedulers, _ = _configure_optimizers(optim_conf)
    return list(optimizers), [s["scheduler"] if isinstance(s, dict) else s for s in schedulers]


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The Trainer a module is attached to, or ``None`` (``module.trainer`` raises when there is none)."""
    return module._trainer


@dataclass(frozen=True)
class CompiledStep:
    """What `take_compiled_training_step` took off a module compiled with ``torch.compile(model)``."""

    #: The compiler (Lightning's ``dynamo_ctx``), for the parent's ``training_step`` alone.
    compiler: Callable[[Callable[..., Any]], Any]
    #: The compiled ``training_step`` Lightning gave the module (``None``: it had none), given back at the fit's end.
    step: Callable[..., Any] | None


def take_compiled_training_step(module: pl.LightningModule) -> CompiledStep | None:
    """``trainer.fit(torch.compile(model))``: Lightning (``from_compiled``) gives the module a compiled
    ``training_step``, which would compile MuonMixin's whole update (backward, optimizer steps, the first batch's
    trace) into the region. Give the module its class's ``training_step`` back for the fit and return the compiler
    (the ``dynamo_ctx`` Lightning keeps in ``_compiler_ctx``) for the parent's step alone, with the compiled step
    taken (`give_back_compiled_training_step`); ``None`` when the module was not compiled."""
    context = getattr(module, "_compiler_ctx", None)
    if not context or context.get("compiler") != "dynamo":
        return None
    return CompiledStep(context["dynamo_ctx"], vars(module).pop("training_step", None))


def give_back_compiled_training_step(module: pl.LightningModule, taken: CompiledStep) -> None:
    """Give the module the compiled ``training_step`` `take_compiled_training_step` took, as Lightning left it
    (``lightning.pytorch.utilities.compile.to_uncompiled`` reads it there)."""
    if taken.step is not None and "training_step" not in vars(module):
        module.training_step = taken.step  # type: ignore[method-assign]


def store_finetuning_groups(callback: BaseFinetuning, module: pl.LightningModule, optimizers: list[Optimizer]) -> None:
    """Make a ``BaseFinetuning`` callback's record of the optimizers' param groups (``_internal_optimizer_metadata``,
    saved in checkpoints and given back to the optimizers by its ``on_fit_start`` on resume) every optimizer's real
    groups, by parameter name. Lightning records only the groups an optimizer gains during its own
    ``finetune_function`` call; under MuonMixin the first optimizer's call adds a group to each."""
    mapping = {p: n for n, p in module.named_parameters()}
    callback._internal_optimizer_metadata = {
        i: callback._apply_mapping_to_param_groups(o.param_groups, mapping) for i, o in enumerate(optimizers)
    }


def saved_finetuning_groups(callback: BaseFinetuning, checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` holds param groups that ``callback`` will give back to the optimizers when the fit
    resumes (its state, under its ``state_key``, with groups in it)."""
    state = checkpoint.get("callbacks", {}).get(callback.state_key) or {}
    return bool(state.get("internal_optimizer_metadata"))


def maps_optimizer_states_by_order(strategy: Any) -> bool:
    """Whether ``strategy`` loads a one-file checkpoint's optimizer states onto the model's parameters in order
    (``ModelParallelStrategy``, FSDP2's), where Muon + AdamW's states are not in that order."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, lightning_classes(ModelParallelStrategy))


def validates_by_batches(trainer: pl.Trainer) -> bool:
    """Whether the fit loop decides when to validate by counting training batches (``val_check_interval`` a
    number of batches, or a fraction of a sized epoch), not by time or only at the end of an endless epoch: what
    `validate_after_this_batch` needs."""
    return isinstance(trainer.val_check_batch, int)


def validate_after_this_batch(trainer: pl.Trainer, validate: bool) -> None:
    """Make the fit loop validate after the current training batch, or not, whatever its ``val_check_interval``.
    Called from ``on_train_batch_end``: the loop asks right after it whether ``(batch index + 1) %
    trainer.val_check_batch == 0``, which holds for every batch at 1 and for none at ``sys.maxsize``."""
    trainer.val_check_batch = 1 if validate else sys.maxsize
