"""`QKClip`: Kimi K2's QK-Clip (with Muon: MuonClip) after every update, on any attention, logged.

During every training batch the q and k each attention module actually uses (after RoPE and QK-norm) are
measured: per query head, the exact largest logit ``S_h = max_{i,j} scale * q_i . k_j`` over the pairs the
mask lets through (causal, padding, GQA sharing), in chunks (`lightning_muon.attention`). After the batch that
ends an update (``trainer.global_step`` moved on: `MuonMixin`'s update, or a plain optimizer's step under
automatic optimization; micro-batches of one update are measured together), every head over ``tau`` has its
query and key rows (biases too) scaled by ``sqrt(tau / S_h)`` each; a key head shared under GQA by the factor
of its group's largest logit, so no weight grows and every head ends at or under ``tau``. Heads under ``tau``
are left bit for bit. Validation forwards are not measured.

It logs, at the Trainer's ``log_every_n_steps`` (or its own), on the logger step of the update:

- ``attention/max_logit``: the largest logit over every attention module, before the clip;
- ``attention/max_logit/<module name>``: the same per module (its name in the LightningModule);
- ``attention/clipped_heads``: query heads over ``tau`` at that update, summed over modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_muon.attention import QKClipper, UnsupportedAttentionError
from lightning_muon.attention.logits import DEFAULT_CHUNK_ELEMENTS
from lightning_muon.callbacks._checks import check_optional_count
from lightning_muon.lightning import _compat

__all__ = ["QKClip"]


class QKClip(Callback):
    """QK-Clip every attention module of the model after each update, without naming any weight.

    Args:
        tau: the threshold on the per-head max logit (Kimi K2: 100); ``None`` measures and logs without
            clipping (QK-norm models, or to watch the logits first).
        exclude: ``fnmatch`` patterns of module names (as ``named_modules`` of the LightningModule gives them)
            to leave alone.
        log_every_n_steps: log after every this many updates (default: the Trainer's ``log_every_n_steps``).
        chunk_elements: the largest block of logits formed at once while measuring (float32 elements).

    Supported without any naming: transformers attention with ``q_proj``/``k_proj`` (Llama, Qwen2, Mistral,
    GQA), GPT-2 (fused ``c_attn``), litgpt ``CausalSelfAttention`` and ``torch.nn.MultiheadAttention``; any
    other through the adapter of `lightning_muon.attention.QKLayout`. Works with `MuonMixin` and with any
    optimizer under automatic optimization, on one process, DDP and Lightning's ``ModelParallelStrategy``
    (FSDP2, tensor parallelism: the maxima are all-reduced, sharded weights clipped shard by shard).

    Examples:
        ```python
        trainer = L.Trainer(callbacks=[QKClip(tau=100.0)], logger=CSVLogger("logs"))
        ```
    """

    def __init__(
        self,
        tau: float | None = 100.0,
        *,
        exclude: Sequence[str] = (),
        log_every_n_steps: int | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    ) -> None:
        if tau is not None and (
            isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < float("inf")
        ):
            raise MisconfigurationException(f"QKClip: tau must be a finite number > 0 or None, got {tau!r}")
        if isinstance(exclude, str) or not all(isinstance(p, str) for p in exclude):
            raise MisconfigurationException(f"QKClip: exclude must be a list of name patterns, got {exclude!r}")
        check_optional_count("log_every_n_steps", log_every_n_steps)
        check_optional_count("chunk_elements", chunk_elements)
        self.tau = None if tau is None else float(tau)
        self.exclude = list(exclude)
        self.log_every_n_steps = log_every_n_steps
        self.chunk_elements = chunk_elements
        self.clipper: QKClipper | None = None
        self._last_step = 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()
        try:
            self.clipper = QKClipper(
                pl_module, self.tau, exclude=self.exclude, chunk_elements=self.chunk_elements
            )
        except (UnsupportedAttentionError, ValueError) as error:
            raise MisconfigurationException(f"QKClip: {error}") from error
        # DDP itself and ModelParallelStrategy, not their subclasses (DeepSpeed's): the multi-process strategies
        # QKClip is tested under.
        tested = (*_compat.lightning_classes(DDPStrategy), *_compat.lightning_classes(ModelParallelStrategy))
        if trainer.world_size > 1 and type(trainer.strategy) not in tested:
            rank_zero_warn(
                f"QKClip runs under {type(trainer.strategy).__name__}: it is tested on one process, under DDP and "
                "under ModelParallelStrategy (FSDP2, tensor parallelism, both)."
            )
        self._every = self.log_every_n_steps or _compat.log_every_n_steps(trainer)
        self._last_step = trainer.global_step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.clipper is not None:
            self.clipper.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.clipper is None:
            return
        self.clipper.stop()
        if trainer.global_step == self._last_step:  # a micro-batch inside an update: keep measuring
            return
        self._last_step = trainer.global_step
        stats = self.clipper.clip()
        step = _compat.logger_step(trainer)
        if trainer.is_global_zero and trainer.loggers and (step + 1) % self._every == 0:
            metrics = stats.metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _remove(self) -> None:
        if self.clipper is not None:
            self.clipper.remove()
            self.clipper = None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()
