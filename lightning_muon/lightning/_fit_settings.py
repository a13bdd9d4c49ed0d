"""`FitSettings`: how one fit accumulates and clips, from the mixin's arguments and the Trainer's flags together.

``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)``, ``Trainer(accumulate_grad_batches=...)`` and a
``GradientAccumulationScheduler`` mean what they mean under automatic optimization; the mixin's own
``gradient_clip_val`` and ``accumulate_grad_batches`` do the same. Given in both places with different values,
the fit is refused before it trains, naming both.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.lightning._compat import TrainerFlags
from lightning_muon.lightning._config import MuonConfig


@dataclass(frozen=True)
class FitSettings:
    """The accumulation and clipping one fit uses."""

    #: Micro-batches per update (before any ``GradientAccumulationScheduler`` changes it at an epoch start).
    accumulate_grad_batches: int = 1
    accumulation_scheduler: GradientAccumulationScheduler | None = None
    gradient_clip_val: float | None = None
    #: ``"norm"``: the global norm over both optimizers' gradients; ``"value"``: each element, in both.
    gradient_clip_algorithm: str = "norm"

    def accumulation_at(self, epoch: int) -> int:
        """Micro-batches per update during ``epoch``."""
        if self.accumulation_scheduler is None:
            return self.accumulate_grad_batches
        return self.accumulation_scheduler.get_accumulate_grad_batches(epoch)


def resolve(config: MuonConfig, flags: TrainerFlags) -> FitSettings:
    """The fit's settings; a `MisconfigurationException` naming both values where the Trainer and the mixin
    disagree."""
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
    own_clip, trainer_clip = config.gradient_clip_val, flags.gradient_clip_val
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
    return FitSettings(
        accumulate_grad_batches=own_n if own_n != 1 else trainer_n,
        accumulation_scheduler=scheduler,
        gradient_clip_val=own_clip if own_clip is not None else trainer_clip,
        gradient_clip_algorithm=algorithm,
    )
