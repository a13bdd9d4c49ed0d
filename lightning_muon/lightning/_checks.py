"""What `MuonMixin` refuses, warns about or tells once: optimizing by hand, fits that manual optimization
breaks, parent hooks it will never call, and what the parent's ``configure_optimizers`` would have built.

The functions that look at the model's classes take ``own_classes``: the model's classes, most derived first,
without the mixin and Lightning's own (what `MuonMixin` passes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import LearningRateFinder, StochasticWeightAveraging
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_muon.lightning import _compat
from lightning_muon.optim.groups import NAME, PARAM_NAMES

#: Parent hooks that manual optimization never calls (``lr_scheduler_step`` is: the mixin steps through it).
UNCALLED_HOOKS = ("optimizer_step", "configure_gradient_clipping", "optimizer_zero_grad")

#: What a module that optimizes by hand does, and what to do instead.
BY_HAND = (
    "{where}: {cls} optimizes by hand, but MuonMixin owns the optimization step. A module that optimizes "
    "itself (automatic_optimization = False, self.optimizers(), manual_backward, opt.step(), toggle_optimizer) "
    "cannot run under MuonMixin, which steps Muon and AdamW together on the loss training_step returns. "
    "Either let training_step return the loss and drop the manual calls, or, for a GAN-style model with "
    "an optimizer per sub-network, leave MuonMixin out and build each sub-network's own pair in "
    "configure_optimizers: routing = lightning_muon.route_parameters(self.generator), then "
    "lightning_muon.Muon(routing.muon_groups) and torch.optim.AdamW(routing.adamw_groups) (the same for "
    "the discriminator)."
)

#: Why ``toggle_optimizer`` is refused.
TOGGLE_REFUSED = (
    "toggle_optimizer switches off the gradients of the other optimizer's parameters, but MuonMixin "
    "steps Muon and AdamW together on one loss. Remove the toggle_optimizer/untoggle_optimizer calls."
)


#: Why FSDP1 is refused, and the way.
FSDP1_REFUSED = (
    "MuonMixin cannot run under strategy='fsdp' (FSDP1): FSDP1 flattens the parameters before the optimizers are "
    "built, so Muon would get flat 1-D shards instead of weight matrices, and manual optimization cannot work with "
    "them. Use FSDP2: strategy=ModelParallelStrategy() with fully_shard in configure_model."
)

#: Why DeepSpeed is refused, and the ways.
DEEPSPEED_REFUSED = (
    "MuonMixin cannot run under DeepSpeed (DeepSpeedStrategy): the mixin trains a pair of optimizers, Muon on the "
    "hidden matrices and AdamW on the rest, under manual optimization, and DeepSpeed's engine takes one optimizer "
    "whose param groups its ZeRO stages flatten into 1-D buffers, which Muon cannot orthogonalise. For sharded "
    "training use FSDP2: strategy=ModelParallelStrategy() with fully_shard in configure_model (the distributed "
    "guide). To stay on DeepSpeed, use DeepSpeed's own Muon (\"optimizer\": {\"type\": \"Muon\"} in its config, "
    "with ZeRO) on the module without MuonMixin."
)


def check_strategy(strategy: Strategy) -> None:
    """When the fit starts, before the strategy sets anything up (it would flatten the parameters and build the
    optimizers over them): refuse the strategies that flatten parameters, FSDP1 and DeepSpeed."""
    if isinstance(strategy, _compat.lightning_classes(FSDPStrategy)):
        raise MisconfigurationException(FSDP1_REFUSED)
    if isinstance(strategy, _compat.lightning_classes(DeepSpeedStrategy)):
        raise MisconfigurationException(DEEPSPEED_REFUSED)


def by_hand(module: LightningModule, where: str) -> MisconfigurationException:
    """The refusal of a module that optimizes by hand, found at run time (``where`` says how)."""
    return MisconfigurationException(BY_HAND.format(where=where, cls=type(module).__name__))


def refuse_by_hand(module: LightningModule, optimizers: Iterable[Optimizer],
                   inside: Callable[[], bool]) -> list[RemovableHandle]:
    """While ``inside()`` (the parent's ``training_step`` runs, where the mixin owns the update), make a step of any
    of ``optimizers`` raise before it moves a weight (a step pre-hook), and a backward that accumulates into their
    parameters' gradients raise as it does (``loss.backward()`` by hand would add a second gradient to the loop's
    own). Both hooks do nothing otherwise (the update loop runs them). Returns their handles."""

    def refuse_step(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if inside():
            raise by_hand(module, "training_step steps an optimizer itself (opt.step())")

    def refuse_backward(param: Tensor) -> None:
        if inside():
            raise by_hand(module, "training_step runs a backward itself (loss.backward())")

    handles = []
    for optimizer in optimizers:
        handles.append(optimizer.register_step_pre_hook(refuse_step))
        for group in optimizer.param_groups:
            handles += [p.register_post_accumulate_grad_hook(refuse_backward) for p in group["params"]]
    return handles


def check_callbacks(module: LightningModule, muon_enabled: bool) -> None:
    """Before the fit's checks and callbacks run: refuse the callbacks that need a single optimizer."""
    if not muon_enabled:
        return
    for callback in _compat.trainer_callbacks(module.trainer):
        if isinstance(callback, _compat.lightning_classes(StochasticWeightAveraging)):
            raise MisconfigurationException(
                "StochasticWeightAveraging works with one optimizer and MuonMixin trains with two (Muon and "
                "AdamW). Use muon=None (AdamW alone, the A/B baseline) with SWA; for the average of the "
                "weights without SWA's lr schedule, WeightAveraging or EMAWeightAveraging, which work with the "
                "pair; or remove the callback."
            )
        if isinstance(callback, _compat.lightning_classes(LearningRateFinder)):
            raise MisconfigurationException(
                "lr_find (LearningRateFinder) sweeps the learning rate of one optimizer, and MuonMixin trains "
                "with two (Muon and AdamW), whose learning rates are not on the same scale. Run lr_find on the "
                "muon=None baseline (its suggestion becomes AdamW's lr for the next fit), and sweep Muon's lr "
                "(--model.muon.init_args.lr) with a few short fits, e.g. `lightning-muon compare`."
            )


def check_fit(module: LightningModule, own_classes: Sequence[type]) -> None:
    """At fit start: refuse a replaced ``configure_optimizers``; warn about parent hooks that manual optimization
    will never call. (The strategy was checked before it set up: `check_strategy`.)"""
    if "configure_optimizers" in vars(module):
        raise MisconfigurationException(
            "configure_optimizers was replaced on this model (LightningCLI --optimizer/--lr_scheduler do "
            "this), which would drop MuonMixin's pair of optimizers. Configure them with --model.muon, "
            "--model.adamw and --model.lr_scheduler instead."
        )
    for hook in UNCALLED_HOOKS:
        owner = parent_defining(own_classes, hook)
        if owner is not None:
            rank_zero_warn(
                f"{owner.__name__}.{hook} will never be called: MuonMixin runs the optimizers itself under "
                f"manual optimization. Move what it does into the mixin's arguments "
                f"(gradient_clip_val, lr_scheduler, muon/adamw) or into training_step."
            )


def parent_defining(own_classes: Sequence[type], hook: str) -> type | None:
    """The first of the model's own classes that defines ``hook``."""
    return next((k for k in own_classes if hook in vars(k)), None)


def tell_replaced(module: LightningModule, own_classes: Sequence[type], lrs_given: bool) -> None:
    """Say what the parent's ``configure_optimizers`` would have built and what the mixin trains with: INFO when
    only the optimizer choice differs (or its lr gives way to lrs the user chose, ``lrs_given``), a warning when
    its lr, schedulers or per-group settings are dropped without a word from the user."""
    owner = parent_defining(own_classes, "configure_optimizers")
    if owner is None:
        return
    message, is_warning = replaced_message(module, owner, list(module.trainer.optimizers), lrs_given)
    (rank_zero_warn if is_warning else rank_zero_info)(message)


def parent_lr(module: LightningModule, own_classes: Sequence[type]) -> tuple[float, float]:
    """The learning rate and weight decay of the first optimizer the parent's ``configure_optimizers`` builds
    (its defaults), for ``parent_lr=True``; a `MisconfigurationException` where there is none to read."""
    owner = parent_defining(own_classes, "configure_optimizers")
    if owner is None:
        raise MisconfigurationException(
            f"parent_lr=True, but no class of {type(module).__name__} defines configure_optimizers to read a learning "
            "rate from. Leave parent_lr out (the mixin's defaults) or give the lrs: muon=..., adamw=...."
        )
    try:
        optimizers, _ = _parent_optimizers(module, owner)
    except Exception as error:
        raise MisconfigurationException(
            f"parent_lr=True: {owner.__name__}.configure_optimizers could not be called to read its learning rate "
            f"({error!r}). Give the lrs instead: muon=..., adamw=...."
        ) from error
    if not optimizers:
        raise MisconfigurationException(f"parent_lr=True: {owner.__name__}.configure_optimizers builds no optimizer.")
    defaults = optimizers[0].defaults
    return float(defaults["lr"]), float(defaults.get("weight_decay", 0.0))


def _parent_optimizers(module: LightningModule, owner: type) -> tuple[list[Optimizer], list[Any]]:
    """What ``owner.configure_optimizers`` (the parent's) builds for ``module``: its optimizers, unwrapped from
    Lightning's, and its schedulers."""
    optimizers, schedulers = _compat.optimizers_and_schedulers(owner.configure_optimizers(module))  # type: ignore[attr-defined]
    return [getattr(o, "optimizer", o) for o in optimizers], schedulers


def _describe(optimizer: Optimizer) -> str:
    """``Muon(lr=0.02) on 2 tensors``: the lrs given (a scheduler's ``initial_lr``, not its first step's)."""
    lrs = sorted({float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups})
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    lr = f"lr={lrs[0]:g}" if len(lrs) == 1 else f"lrs={', '.join(f'{x:g}' for x in lrs)}"
    return f"{type(optimizer).__name__}({lr}) on {count} tensor{'s' * (count != 1)}"


def _per_group_settings(optimizer: Optimizer) -> bool:
    """Whether the param groups differ in any setting (per-group weight decay, lr, ...)."""
    settings = [{k: repr(v) for k, v in g.items() if k not in ("params", PARAM_NAMES, NAME)}
                for g in optimizer.param_groups]
    return any(s != settings[0] for s in settings)


def replaced_message(
    module: LightningModule, owner: type, used: list[Any], lrs_given: bool = False
) -> tuple[str, bool]:
    """The message, and whether it is a warning: ``owner.configure_optimizers`` (the parent's) against the
    optimizers ``used`` (``trainer.optimizers``); ``lrs_given``: the user chose the lrs trained at."""
    head = f"{owner.__name__}.configure_optimizers is replaced by MuonMixin's"
    ours = " and ".join(_describe(getattr(o, "optimizer", o)) for o in used)
    try:
        theirs, schedulers = _parent_optimizers(module, owner)
    except Exception as error:  # describing is best-effort: the parent's method may need what the mixin skips
        return f"{head}: it trains with {ours} (the parent's could not be described: {error!r}).", False
    lines = [f"{head}: it would have built {' and '.join(_describe(o) for o in theirs) or 'no optimizer'}; "
             f"MuonMixin trains with {ours}."]
    ignored = []
    parent_lr = float(theirs[0].defaults["lr"]) if theirs and "lr" in theirs[0].defaults else None
    used_lrs = {float(g["lr"]) for o in used for g in getattr(o, "optimizer", o).param_groups}
    if parent_lr is not None and parent_lr not in used_lrs and lrs_given:
        lines.append(f"Its lr ({parent_lr:g}) gives way to the lrs given to the mixin.")
    elif parent_lr is not None and parent_lr not in used_lrs:
        ignored.append(
            f"its lr ({parent_lr:g}) is not used: give the lrs to train at (muon=..., adamw=...), or parent_lr=True "
            "to train at the parent's lr and weight decay (AdamW at them, Muon at them with "
            "adjust_lr_fn='match_rms_adamw')"
        )
    if schedulers:
        ignored.append(
            f"its scheduler{'s' * (len(schedulers) > 1)} ({', '.join(type(s).__name__ for s in schedulers)}) "
            "will not run: pass lr_scheduler=... to the mixin"
        )
    if any(_per_group_settings(o) for o in theirs):
        ignored.append("its per-group settings are not used: the mixin routes parameters itself "
                       "(muon_params=/adamw_params=, and the muon/adamw factories' settings)")
    if ignored:
        lines.append("Ignored: " + "; ".join(ignored) + ".")
    return " ".join(lines), bool(ignored)


def own_classes(cls: type, mixin: type) -> list[type]:
    """The model's own classes, most derived first: its MRO without ``mixin`` and Lightning's classes."""
    return [k for k in cls.__mro__ if k is not mixin and not _compat.is_lightning_module_base(k)]


def check_bases(cls: type, mixin: type) -> None:
    """At class definition: ``mixin`` must come before every base that defines ``training_step`` or
    ``configure_optimizers``, and the class itself must not define ``configure_optimizers``."""
    mro = cls.__mro__
    for klass in mro[1 : mro.index(mixin)]:
        if issubclass(klass, mixin):
            continue
        overrides = [hook for hook in ("training_step", "configure_optimizers") if hook in vars(klass)]
        if overrides:
            bases = [b.__name__ for b in cls.__bases__ if not issubclass(b, mixin)]
            raise TypeError(
                f"{mixin.__name__} must come first in the bases of {cls.__name__}: {klass.__name__} defines "
                f"{' and '.join(overrides)}, which would replace the mixin's. Write:\n"
                f"    class {cls.__name__}({', '.join([mixin.__name__, *bases])}):"
            )
    if "configure_optimizers" in vars(cls):
        raise TypeError(
            f"{cls.__name__} defines configure_optimizers, which replaces {mixin.__name__}'s pair of optimizers. "
            "Remove it and configure the optimizers with the mixin's arguments "
            "(muon=..., adamw=..., lr_scheduler=...)."
        )
