"""What `MuonMixin` refuses or warns about: a subclass that bypasses it, and fits manual optimization breaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import LearningRateFinder, StochasticWeightAveraging
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.lightning import _compat
from lightning_muon.lightning._replaced import replaced_message

if TYPE_CHECKING:
    from lightning_muon.lightning.mixin import MuonMixin

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


def by_hand(module: LightningModule, where: str) -> MisconfigurationException:
    """The refusal of a module that optimizes by hand, found at run time (``where`` says how)."""
    return MisconfigurationException(BY_HAND.format(where=where, cls=type(module).__name__))


def check_callbacks(module: LightningModule, muon_enabled: bool) -> None:
    """Before the fit's checks and callbacks run: refuse the callbacks that need a single optimizer."""
    if not muon_enabled:
        return
    for callback in _compat.trainer_callbacks(module.trainer):
        if isinstance(callback, StochasticWeightAveraging):
            raise MisconfigurationException(
                "StochasticWeightAveraging works with one optimizer and MuonMixin trains with two (Muon and "
                "AdamW). Use muon=None (AdamW alone, the A/B baseline) with SWA, or remove the callback."
            )
        if isinstance(callback, LearningRateFinder):
            raise MisconfigurationException(
                "lr_find (LearningRateFinder) sweeps the learning rate of one optimizer, and MuonMixin trains "
                "with two (Muon and AdamW), whose learning rates are not on the same scale. Run lr_find on the "
                "muon=None baseline (its suggestion becomes AdamW's lr for the next fit), and sweep Muon's lr "
                "(--model.muon.init_args.lr) with a few short fits, e.g. `lightning-muon compare`."
            )


def check_bases(cls: type, mixin: type[MuonMixin]) -> None:
    """At class definition: the mixin must come before every base that defines ``training_step`` or
    ``configure_optimizers``, and the class itself must not define ``configure_optimizers``."""
    mro = cls.__mro__
    for klass in mro[1 : mro.index(mixin)]:
        if issubclass(klass, mixin):
            continue
        overrides = [hook for hook in ("training_step", "configure_optimizers") if hook in vars(klass)]
        if overrides:
            bases = [b for b in cls.__bases__ if not issubclass(b, mixin) or b is mixin]
            fixed = ", ".join([mixin.__name__] + [b.__name__ for b in bases if b is not mixin])
            raise TypeError(
                f"{mixin.__name__} must come first in the bases of {cls.__name__}: {klass.__name__} defines "
                f"{' and '.join(overrides)}, which would replace the mixin's. Write:\n"
                f"    class {cls.__name__}({fixed}):"
            )
    if "configure_optimizers" in vars(cls):
        raise TypeError(
            f"{cls.__name__} defines configure_optimizers, which replaces {mixin.__name__}'s pair of optimizers. "
            "Remove it and configure the optimizers with the mixin's arguments "
            "(muon=..., adamw=..., lr_scheduler=...)."
        )


def check_fit(module: LightningModule, mixin: type[MuonMixin]) -> None:
    """At fit start: refuse FSDP1 and a replaced ``configure_optimizers``; warn about parent hooks that
    manual optimization will never call."""
    if isinstance(module.trainer.strategy, FSDPStrategy):
        raise MisconfigurationException(
            "MuonMixin cannot run under strategy='fsdp' (FSDP1): manual optimization and its flattened "
            "parameters cannot work together. Use FSDP2: strategy=ModelParallelStrategy() with "
            "fully_shard in configure_model."
        )
    if "configure_optimizers" in vars(module):
        raise MisconfigurationException(
            "configure_optimizers was replaced on this model (LightningCLI --optimizer/--lr_scheduler do "
            "this), which would drop MuonMixin's pair of optimizers. Configure them with --model.muon, "
            "--model.adamw and --model.lr_scheduler instead."
        )
    for hook in UNCALLED_HOOKS:
        owner = parent_defining(module, mixin, hook)
        if owner is not None:
            rank_zero_warn(
                f"{owner.__name__}.{hook} will never be called: MuonMixin runs the optimizers itself under "
                f"manual optimization. Move what it does into the mixin's arguments "
                f"(gradient_clip_val, lr_scheduler, muon/adamw) or into training_step."
            )


def parent_defining(module: LightningModule, mixin: type[MuonMixin], hook: str) -> type | None:
    """The first class of the model's own (not the mixin's, not Lightning's) that defines ``hook``."""
    return next(
        (k for k in type(module).__mro__ if hook in vars(k) and k is not mixin and k not in LightningModule.__mro__),
        None,
    )


def tell_replaced(module: LightningModule, mixin: type[MuonMixin]) -> None:
    """Say, once, what the parent's ``configure_optimizers`` would have built and what the mixin trains with."""
    owner = parent_defining(module, mixin, "configure_optimizers")
    if owner is None:
        return
    message, is_warning = replaced_message(module, owner, list(module.trainer.optimizers))
    (rank_zero_warn if is_warning else rank_zero_info)(message)
