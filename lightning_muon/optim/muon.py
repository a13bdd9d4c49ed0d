"""`Muon`: momentum, then Newton-Schulz orthogonalisation, for the hidden matrices of a network.

A drop-in superset of ``torch.optim.Muon``: the same constructor arguments,
defaults, maths and state key (``momentum_buffer``), so a config or a state
dict can move between the two for 2D parameters. Beyond it:

- parameters with more than two dimensions: conv kernels are orthogonalised
  as the flattened ``(shape[0], prod(shape[1:]))`` matrix (the default), stacks
  of matrices (MoE experts) each on its own, and a weight stored ``in x out``
  gets the lr of its real shape; a param group's ``matrix_layouts`` names the
  layout of each parameter (``"flatten"``, ``"stack"``, ``"in_out"``), and
  `lightning_muon.route_parameters` fills it in;
- matrices of the same shape are orthogonalised together in one batched call
  (up to ``ns_batch_bytes`` per call), and the elementwise work uses
  ``torch._foreach_*`` kernels;
- the Newton-Schulz compute dtype is a choice (``ns_dtype``);
- ``adjust_lr_fn`` also offers ``"spectral"`` and ``"none"``;
- on request, a step records how orthogonal each update was
  (`Muon.record_diagnostics`), at no cost on other steps.

Only hidden-layer matrices belong here. Embeddings, the output head, norms,
biases and every other parameter with fewer than two dimensions belong to
AdamW: `lightning_muon.route_parameters` sorts them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.optim import _update
from lightning_muon.optim._strategies import LocalStep, choose_strategy
from lightning_muon.optim._update import ADJUST_LR_FNS, Bucket, Chooser, ParamDiagnostics, adjust_lr
from lightning_muon.optim.newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    NS_COEFFICIENT_SCHEDULES,
)

__all__ = ["ADJUST_LR_FNS", "DEFAULT_GRAM_ASPECT", "Muon", "ParamDiagnostics", "adjust_lr"]

#: Matrices at least this many times longer than wide go through Gram Newton-Schulz by default: from 3:1 on
#: it measured faster at every size (0.73-0.90x the standard iteration's time at 3:1, 0.53-0.70x at 9:1; at 2:1
#: 0.86-1.00x), by the sweep of benchmarks/optimizer_step.py (bf16, CPU); the iteration's result is the same.
DEFAULT_GRAM_ASPECT = 3.0

#: Param group keys ``torch.optim.Muon`` does not have, with the value a group saved without them gets.
_OWN_GROUP_KEYS: dict[str, Any] = {
    "ns_dtype": "bfloat16", "ns_batch_bytes": None, "ns_gram_aspect": DEFAULT_GRAM_ASPECT
}


def _checked_arguments(
    lr: float | Tensor,
    weight_decay: float,
    momentum: float,
    eps: float,
    adjust_lr_fn: str | None,
    ns_coefficients: tuple[float, float, float] | str,
    ns_steps: int,
    ns_dtype: torch.dtype | str,
    ns_batch_bytes: int | None,
    ns_gram_aspect: float | None,
) -> torch.dtype:
    """Refuse bad constructor arguments as ``torch.optim.Muon`` does (quoting the value); the NS dtype."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate lr: {lr} (must be >= 0)")
    # Stricter than torch.optim.Muon, which accepts both: at momentum 1 the buffer never takes in a gradient
    # (the matrices never move), above 1 it grows without bound (NaN weights from finite gradients).
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum value: {momentum} (must be in [0, 1); Keller Jordan's default is 0.95)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid eps value: {eps} (must be >= 0)")
    if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"Invalid adjust_lr_fn: {adjust_lr_fn!r} (must be None or one of {ADJUST_LR_FNS})")
    if isinstance(ns_coefficients, str):
        if ns_coefficients not in NS_COEFFICIENT_SCHEDULES:
            raise ValueError(
                f"Invalid ns_coefficients: {ns_coefficients!r} (must be three numbers (a, b, c) or one of "
                f"{sorted(NS_COEFFICIENT_SCHEDULES)})"
            )
    elif len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"Invalid ns_coefficients: {ns_coefficients!r} (must be three numbers (a, b, c))")
    if ns_gram_aspect is not None and (
        isinstance(ns_gram_aspect, bool) or not isinstance(ns_gram_aspect, int | float) or not ns_gram_aspect >= 1
    ):
        raise ValueError(f"Invalid ns_gram_aspect: {ns_gram_aspect!r} (must be None or a number >= 1)")
    # Stricter than torch: 0 steps would apply the normalised momentum itself, not an orthogonalised update.
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 1 <= ns_steps < 100:
        raise ValueError(f"Invalid ns_steps: {ns_steps!r} (must be an int in [1, 100); the default is 5)")
    if isinstance(ns_dtype, str):  # "bfloat16" or "torch.bfloat16", as YAML and saved hparams spell it
        ns_dtype = getattr(torch, ns_dtype.removeprefix("torch."), ns_dtype)
    if not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
        raise ValueError(f"Invalid ns_dtype: {ns_dtype!r} (must be a floating dtype, e.g. torch.bfloat16)")
    if ns_batch_bytes is not None and (
        isinstance(ns_batch_bytes, bool) or not isinstance(ns_batch_bytes, int) or ns_batch_bytes < 0
    ):
        raise ValueError(f"Invalid ns_batch_bytes: {ns_batch_bytes!r} (must be None or an int >= 0)")
    return ns_dtype


def _refusal(p: Tensor, layout: str) -> str | None:
    """Why Muon cannot take ``p`` with this matrix layout, or ``None``."""
    if p.ndim < 2:
        return (
            "Muon orthogonalises matrices, so every parameter needs at least 2 dimensions. "
            "Optimize biases, norms, scalars and embeddings with AdamW "
            "(lightning_muon.route_parameters splits a model for you)."
        )
    if layout not in _update.LAYOUTS:
        return f"its matrix layout {layout!r} is none of {_update.LAYOUTS}."
    if (layout == "stack" and p.ndim < 3) or (layout == "in_out" and p.ndim != 2):
        return f"the layout {layout!r} needs {'3 or more' if layout == 'stack' else '2'} dimensions."
    return None


class Muon(Optimizer):
    """Muon: SGD-momentum whose update is orthogonalised by Newton-Schulz iterations.

    For every parameter ``p`` with gradient ``g`` and momentum buffer ``B``
    (exactly as ``torch.optim.Muon``)::

        B <- momentum * B + (1 - momentum) * g          (B.lerp_(g, 1 - momentum))
        U <- (1 - momentum) * g + momentum * B  if nesterov else B
        O <- NewtonSchulz(U viewed as shape[0] x prod(shape[1:]))
        p <- p * (1 - lr * weight_decay)
        p <- p - adjust_lr(lr, adjust_lr_fn, p.shape) * O

    Args:
        params: parameters, ``named_parameters()`` or param groups (extra keys
            such as ``name`` are kept). Every parameter needs at least 2 dimensions.
        lr: learning rate (default: 1e-3).
        weight_decay: decoupled weight decay, applied with the unadjusted lr (default: 0.1).
        momentum: momentum factor (default: 0.95).
        nesterov: use Nesterov momentum (default: True).
        ns_coefficients: ``(a, b, c)`` of the quintic (default: Keller Jordan's), or ``"polar_express"``
            (Amsel et al. 2025: per-iteration coefficients, singular values much closer to 1).
        eps: floor of the norm that normalises each matrix (default: 1e-7).
        ns_steps: Newton-Schulz iterations (default: 5).
        adjust_lr_fn: shape scaling of the lr, see `adjust_lr`: ``None``/``"original"``,
            ``"match_rms_adamw"``, ``"spectral"`` or ``"none"`` (default: None).
        ns_dtype: compute dtype of Newton-Schulz (default: ``torch.bfloat16``, as torch; ``torch.float32``
            where bf16 matmuls are slow); a name such as ``"float32"`` is accepted too.
        ns_batch_bytes: most bytes (in ``ns_dtype``) of one batched Newton-Schulz call over same-shape
            matrices; ``0`` orthogonalises one matrix at a time, exactly as ``torch.optim.Muon``.
            Default ``None``: 1 MiB on CPU, 256 MiB on accelerators.
        ns_gram_aspect: matrices at least this many times longer than wide use Gram Newton-Schulz
            (the same iteration on the small Gram matrix, fewer FLOPs); ``None``: never; never on the
            exact path (``ns_batch_bytes=0``). Default `DEFAULT_GRAM_ASPECT`, where it measured faster.
        split_ns: under DDP (an initialised process group of several ranks and plain, replicated
            parameters) each rank orthogonalises a share of the matrices, balanced by FLOPs, and the
            results are all-gathered (one copy of the updates in ``ns_dtype``); every rank still keeps
            every momentum buffer. Under FSDP2 (DTensor parameters sharded on dim 0 over one mesh) each
            matrix's shards are sent to an owner rank, which orthogonalises the whole matrix and sends
            every rank back its rows; momentum stays sharded (HSDP: within each replica's shard group).
            ``False``: every rank does all the work, as ``torch.optim.Muon`` (under FSDP2 every rank
            gathers and orthogonalises every whole matrix). Newton-Schulz never runs on a shard.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] | str = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        ns_batch_bytes: int | None = None,
        ns_gram_aspect: float | None = DEFAULT_GRAM_ASPECT,
        split_ns: bool = True,
    ) -> None:
        ns_dtype = _checked_arguments(
            lr, weight_decay, momentum, eps, adjust_lr_fn, ns_coefficients, ns_steps, ns_dtype, ns_batch_bytes,
            ns_gram_aspect,
        )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients if isinstance(ns_coefficients, str) else tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            # Kept by name: torch.distributed.checkpoint cannot save a torch.dtype in param groups.
            "ns_dtype": _update.dtype_name(ns_dtype),
            "ns_batch_bytes": ns_batch_bytes,
            "ns_gram_aspect": ns_gram_aspect,
        }
        #: Split the Newton-Schulz work across ranks: under DDP each rank orthogonalises a share of the
        #: matrices (results all-gathered); under FSDP2 each matrix is orthogonalised on one owner rank.
        self.split_ns = split_ns
        #: Bytes this rank put into the last distributed step's exchanges, its share to itself included
        #: (0 when nothing was exchanged).
        self.last_exchange_bytes = 0
        #: ``(split_ns, strategy)``, chosen at the first step (`lightning_muon.optim._strategies`).
        self._strategy: tuple[bool, LocalStep] | None = None
        self._diagnose: Chooser | None = None
        #: What the last step that recorded diagnostics did, one entry per diagnosed matrix.
        self.diagnostics: list[ParamDiagnostics] = []
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, refusing parameters with fewer than 2 dimensions."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        first_index = sum(len(g["params"]) for g in self.param_groups[:-1])
        layouts = group.get("matrix_layouts")
        if layouts is not None and (isinstance(layouts, str) or len(layouts) != len(group["params"])):
            self.param_groups.pop()
            raise ValueError(
                f"matrix_layouts must be a list with one of {_update.LAYOUTS} per parameter of the group "
                f"({len(group['params'])}), got {layouts!r}"
            )
        for i, (p, layout) in enumerate(zip(group["params"], _update.layouts_of(group), strict=True)):
            problem = _refusal(p, layout)
            if problem is not None:
                self.param_groups.pop()  # refuse the whole group, as if it had never been added
                raise ValueError(
                    f"Muon got {_update.describe_param(group, i, first_index + i)} of shape {tuple(p.shape)}: "
                    + problem
                )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A state dict saved by torch.optim.Muon has none of our extra keys: keep this optimizer's own.
        for group in self.param_groups:
            for key, default in _OWN_GROUP_KEYS.items():
                group.setdefault(key, self.defaults.get(key, default))
        attributes: dict[str, Any] = {"_diagnose": None, "split_ns": True, "last_exchange_bytes": 0, "_strategy": None}
        for name, value in {**attributes, "diagnostics": []}.items():
            self.__dict__.setdefault(name, value)

    def effective_lr(self, param: Tensor) -> float:
        """The learning rate `param` really gets: its group's ``lr`` after `adjust_lr`."""
        for group in self.param_groups:
            for p, layout in zip(group["params"], _update.layouts_of(group), strict=True):
                if p is param:
                    return _update.group_effective_lr(group, param.shape, layout)
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not in this optimizer")

    # ------------------------------------------------------------- diagnostics

    def record_diagnostics(self, params: Iterable[Tensor] | None = None) -> None:
        """Record, during the next `step` only, how orthogonal each update is.

        After that step, `diagnostics` holds one `ParamDiagnostics` per matrix
        that had a gradient (only those in ``params`` when given). The error is
        computed from the orthogonalised update the step already made (one
        ``r x r`` Gram matrix per parameter); steps without a request do no
        diagnostic work at all.
        """
        if params is None:
            self._diagnose = lambda p: True
        else:
            chosen = {id(p) for p in params}
            self._diagnose = lambda p: id(p) in chosen

    def clear_diagnostics(self) -> None:
        """Forget recorded diagnostics and any request not yet answered by a step."""
        self._diagnose = None
        self.diagnostics = []

    # --------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        diagnose, self._diagnose = self._diagnose, None
        strategy = self._strategy_for_step()
        buckets = self._buckets(strategy, diagnose is not None)
        diagnostics = strategy.run(buckets, diagnose)
        self.last_exchange_bytes = strategy.exchanged_bytes
        if diagnose is not None:
            self.diagnostics = diagnostics
        return loss

    def _strategy_for_step(self) -> LocalStep:
        """The distribution strategy, chosen at the first step (and again if ``split_ns`` changes)."""
        if self._strategy is None or self._strategy[0] != self.split_ns:
            every = [p for group in self.param_groups for p in group["params"]]
            stacks = any("stack" in _update.layouts_of(group) for group in self.param_groups)
            self._strategy = (self.split_ns, choose_strategy(every, self.split_ns, stacks))
        return self._strategy[1]

    def _buckets(self, strategy: LocalStep, named: bool) -> list[Bucket]:
        """The buckets of this step: every parameter with a gradient (on any rank of the strategy's world)."""
        every = [p for group in self.param_groups for p in group["params"]]
        has_grad = [p.grad is not None for p in every]
        if strategy.world is not None and every:
            # Every rank must build the same buckets: a gradient missing on one rank is zero there.
            has_grad = strategy.agree(has_grad, every[0].device)
        if strategy.complete_state:  # a zero buffer steps exactly as a fresh one when a gradient comes
            for p in every:
                self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        return _update.collect_buckets(
            self.param_groups,
            self.state,
            has_grad,
            whole_dtensors=strategy.whole_dtensors,
            synced=strategy.world is not None,
            named=named,
        )
