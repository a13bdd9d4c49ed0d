"""Step the fit's schedulers as Lightning's automatic loop would: by ``interval`` and ``frequency``, with the
monitored metric for ``ReduceLROnPlateau``.

Lightning steps nothing under manual optimization; `MuonMixin` calls `step_schedulers` at the points where the
automatic loop does: ``"step"`` schedulers after each update (``frequency`` counts batches of the epoch, as
Lightning's ``batch_idx + 1``), ``"epoch"`` ones after the epoch's last batch, and monitor-driven ones once
the metrics they read are logged (after a step's validation, after the epoch's ``on_train_epoch_end``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule


def step_schedulers(module: LightningModule, *, interval: str, plateau: bool, index: int) -> None:
    """Step every scheduler of ``interval`` (``"step"`` or ``"epoch"``) whose ``frequency`` divides ``index``
    (1-based), either the monitor-driven ones (``plateau``) or the others, through ``lr_scheduler_step``."""
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
        module.lr_scheduler_step(config.scheduler, metric)
