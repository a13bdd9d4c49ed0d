"""What `MuonMixin` refuses or warns about: a subclass that bypasses it, and fits manual optimization breaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from lightning_muon.lightning.mixin import MuonMixin

#: Parent hooks that manual optimization never calls.
UNCALLED_HOOKS = ("optimizer_step", "configure_gradient_clipping", "lr_scheduler_step", "optimizer_zero_grad")


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
    for hook in (*UNCALLED_HOOKS, "configure_optimizers"):
        owners = [
            k.__name__
            for k in type(module).__mro__
            if hook in vars(k) and k is not mixin and k not in LightningModule.__mro__
        ]
        if owners:
            rank_zero_warn(
                f"{owners[0]}.{hook} will never be called: MuonMixin runs the optimizers itself under "
                f"manual optimization. Move what it does into the mixin's arguments "
                f"(gradient_clip_val, lr_scheduler, muon/adamw) or into training_step."
            )
