"""`QKClipper`: measure every attention's per-head max logit during the forward, then QK-Clip after the update.

For plain PyTorch and Fabric loops (the Lightning callback `lightning_muon.QKClip` drives the same object): the
loop is `QKClipper`'s example.

Under ``torch.distributed`` every rank's maxima are all-reduced (max) before the clip, so all ranks scale their
replicas by the same factors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType

import torch
from torch import Tensor, nn

from lightning_muon.attention._families import ADAPTER_HINT, AttentionSite, UnsupportedAttentionError, find_attention
from lightning_muon.attention.clip import qk_clip_
from lightning_muon.attention.layout import Recorder
from lightning_muon.attention.logits import DEFAULT_CHUNK_ELEMENTS, max_attention_logits
from lightning_muon.optim._dtensor import is_dtensor, local_slices

__all__ = ["MAX_LOGIT_KEY", "QKClipStats", "QKClipper"]

#: The logged keys: the max over layers, per layer (``MAX_LOGIT_KEY + "/" + name``), and the heads clipped.
MAX_LOGIT_KEY = "attention/max_logit"
CLIPPED_HEADS_KEY = "attention/clipped_heads"


@dataclass(frozen=True)
class QKClipStats:
    """What one `QKClipper.clip` saw and did: per attention module (in ``names`` order) the largest logit of
    the update's forward(s) (before the clip) and how many query heads were over ``tau`` (0-dim tensors on
    device until read)."""

    names: list[str]
    max_logits: Tensor
    clipped_heads: Tensor

    @property
    def max_logit(self) -> float:
        """The largest logit over every layer."""
        return float(self.max_logits.max())

    def metrics(self) -> dict[str, float]:
        """``attention/max_logit``, ``attention/max_logit/<module name>`` and ``attention/clipped_heads``."""
        values = self.max_logits.tolist()
        out = {MAX_LOGIT_KEY: max(values)}
        out.update({f"{MAX_LOGIT_KEY}/{name}": value for name, value in zip(self.names, values, strict=True)})
        out[CLIPPED_HEADS_KEY] = float(self.clipped_heads.sum())
        return out


class QKClipper:
    """Measure the per-head max attention logit of every attention module of ``model`` and apply QK-Clip.

    Args:
        model: the model; its attention modules are found without naming any weight (`find_attention`).
        tau: the threshold (Kimi K2 uses 100); ``None`` measures without clipping.
        exclude: ``fnmatch`` patterns of module names to leave out.
        chunk_elements: the largest logit block formed at once while measuring.
        sync: all-reduce the maxima (max) over ``torch.distributed``'s default group when it is initialised:
            DDP's and FSDP2's ranks measure every head on their own batches; under tensor parallelism each rank
            measures the heads of its shard of the query weight, and the all-reduce gives every rank all of them.

    Sharded (DTensor) q/k weights, FSDP2's and tensor parallelism's, are clipped on each rank's own shard, by the
    factors of the rows it holds.

    Raises:
        UnsupportedAttentionError: attention whose q/k cannot be found, or QK-norm attention with a ``tau``
            (scaling the projection cannot lower normalised logits).
        ValueError: a bad ``tau``, or a model without attention.

    Examples:
        In a plain PyTorch or Fabric loop:

        ```python
        clipper = QKClipper(model, tau=100.0)  # finds the attention modules itself
        for batch in loader:
            with clipper.recording():  # the training forward(s) of this update
                loss = model(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            stats = clipper.clip()  # the rule, per head; then a fresh measurement
        clipper.remove()  # or use the clipper as a context manager
        ```
    """

    def __init__(
        self,
        model: nn.Module,
        tau: float | None = 100.0,
        *,
        exclude: Iterable[str] = (),
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        sync: bool = True,
    ) -> None:
        if tau is not None and (
            isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < float("inf")
        ):
            raise ValueError(f"tau must be a finite number > 0 or None (measure only), got {tau!r}")
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements!r}")
        self.tau = None if tau is None else float(tau)
        self.sites: list[AttentionSite] = find_attention(model, exclude)
        if not self.sites:
            raise ValueError(
                f"found no attention module in {type(model).__name__} (supported: transformers q_proj/k_proj and "
                f"GPT-2, litgpt CausalSelfAttention, torch.nn.MultiheadAttention; for others: {ADAPTER_HINT})"
            )
        self._check_clippable()
        self.chunk_elements = chunk_elements
        self.sync = sync
        self._recording = False
        self._max: list[Tensor | None] = [None] * len(self.sites)
        self._ever_seen = [False] * len(self.sites)
        self._checked = False
        self._removers: list[Callable[[], None]] = []
        try:
            for i, site in enumerate(self.sites):
                self._removers.append(site.capture(self._recorder(i)))
        except BaseException:
            self.remove()  # none of this clipper's captures stays behind
            raise

    def _check_clippable(self) -> None:
        for site in self.sites:
            if self.tau is not None and site.layout.qk_norm:
                raise UnsupportedAttentionError(
                    f"{site.name} ({type(site.module).__name__}) normalises q and k after the projection (QK-norm): "
                    "scaling the projection cannot lower its logits. Measure only with tau=None, or exclude it."
                )

    def _recorder(self, index: int) -> Recorder:
        site = self.sites[index]

        def record(query: Tensor, key: Tensor, scale: float, causal: bool, keep: Tensor | None) -> None:
            if not self._recording:
                return
            with torch.no_grad():
                found = max_attention_logits(
                    query.detach(), key.detach(), scale=scale, causal=causal, keep=keep,
                    chunk_elements=self.chunk_elements,
                )
            found = _as_every_head(site, found)
            previous = self._max[index]
            self._max[index] = found if previous is None else torch.maximum(previous, found)
            self._ever_seen[index] = True

        return record

    # ------------------------------------------------------------------ recording

    def start(self) -> None:
        """Record the q and k of the forwards from now on (the training forwards of an update)."""
        self._recording = True

    def stop(self) -> None:
        """Stop recording (evaluation forwards are not measured)."""
        self._recording = False

    @contextlib.contextmanager
    def recording(self) -> Iterator[QKClipper]:
        """Record the forwards inside the block."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def max_logits(self) -> dict[str, Tensor]:
        """Per module, the per-head max logit recorded since the last clip (``-inf`` where nothing was seen)."""
        return {site.name: self._per_head(i) for i, site in enumerate(self.sites)}

    def _per_head(self, index: int) -> Tensor:
        found = self._max[index]
        if found is not None:
            return found
        weight = self.sites[index].layout.query.weight
        return torch.full((self.sites[index].layout.num_heads,), float("-inf"), device=weight.device)

    def reset(self) -> None:
        """Forget what was recorded."""
        self._max = [None] * len(self.sites)

    # ------------------------------------------------------------------ the clip

    def _check_seen(self) -> None:
        if self._checked:
            return
        pairs = zip(self.sites, self._ever_seen, strict=True)
        unseen = [f"{s.name} ({type(s.module).__name__})" for s, seen in pairs if not seen]
        if len(unseen) == len(self.sites):
            raise RuntimeError(
                "QK-Clip recorded no attention: run the training forward inside clipper.recording() (or between "
                "start() and stop()) before clip()"
            )
        if unseen:
            raise UnsupportedAttentionError(
                f"the forward went through no q/k capture of {', '.join(unseen)}: their attention is computed "
                f"some other way (or they were not used), so they could not be measured. Either {ADAPTER_HINT}"
            )
        self._checked = True

    def _synced(self) -> list[Tensor]:
        per_site = [self._per_head(i) for i in range(len(self.sites))]
        dist = torch.distributed
        if not (self.sync and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return per_site
        flat = torch.cat([t.float() for t in per_site])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        return list(flat.split([t.numel() for t in per_site]))

    def clip(self) -> QKClipStats:
        """Apply the rule to every module from what was recorded since the last clip, then start afresh."""
        self._check_seen()
        per_site = self._synced()
        clipped = []
        for site, found in zip(self.sites, per_site, strict=True):
            if self.tau is None:
                clipped.append(torch.zeros((), dtype=torch.long, device=found.device))
            else:
                clipped.append(qk_clip_(site.layout, found, self.tau).to(found.device))
        self.reset()
        return QKClipStats(
            names=[s.name for s in self.sites],
            max_logits=torch.stack([t.float().amax() for t in per_site]),
            clipped_heads=torch.stack(clipped),
        )

    # ------------------------------------------------------------------ life cycle

    def remove(self) -> None:
        """Stop capturing (the model's modules and transformers' dispatch are as they were)."""
        for remove in self._removers:
            remove()
        self._removers = []
        self._recording = False

    def __enter__(self) -> QKClipper:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.remove()


def _as_every_head(site: AttentionSite, found: Tensor) -> Tensor:
    """``found``, one max logit per query head the forward used, as one per head of the layout: the same where
    it used every head; under tensor parallelism, where it used the heads of this rank's shard of the query weight
    (a DTensor as the forward sees it: under FSDP2 over tensor parallelism, the gathered tensor-parallel shard),
    those in place and ``-inf`` for the other ranks' (the all-reduce of `QKClipper.clip` fills them)."""
    layout = site.layout
    if found.shape == (layout.num_heads,):
        return found
    query = site.current_layout().query
    if is_dtensor(query.weight):
        held = local_slices(query.weight)[query.out_dim]
        first = max(held.start - query.offset, 0) // layout.head_dim
        stop = min(held.stop - query.offset, layout.num_heads * layout.head_dim) // layout.head_dim
        if found.shape == (stop - first,):
            every = torch.full((layout.num_heads,), float("-inf"), dtype=found.dtype, device=found.device)
            every[first:stop] = found
            return every
    raise UnsupportedAttentionError(
        f"{site.name}: its attention used {found.numel()} query heads, its layout says {layout.num_heads}"
        + (" (and this rank's shard of the query weight holds a different number)" if is_dtensor(query.weight) else "")
    )
