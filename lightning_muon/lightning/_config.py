"""`MuonConfig`: the mixin's settings as one frozen, typed, validated object, with its factories resolved from
their specs (`lightning_muon.lightning._specs`), and the default factories `DEFAULT_MUON` and `DEFAULT_ADAMW`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_muon.lightning._specs import from_spec, plain_data, target_class, to_spec
from lightning_muon.optim.defaults import PAIRED_ADAMW, PAIRED_MUON
from lightning_muon.optim.groups import PARAM_NAMES, group_effective_lrs, is_count
from lightning_muon.optim.muon import Muon
from lightning_muon.routing import (
    ADAMW,
    MUON,
    Algorithm,
    GraphRoles,
    Routing,
    check_group_settings,
    check_pattern_list,
    check_settings_taken,
    route_parameters,
)

__all__ = ["DEFAULT_ADAMW", "DEFAULT_MUON", "MuonConfig", "plain_data"]  # plain_data: from _specs, for mixin.py

# Defaults are specs (plain data) rather than partials, so LightningCLI can print and save them and
# checkpoints hold plain hyperparameters; the config resolves them to factories.
#: lightning_muon.Muon with Keller Jordan's settings.
DEFAULT_MUON: dict = {
    "class_path": "lightning_muon.Muon",
    "init_args": {"lr": PAIRED_MUON.lr, "momentum": PAIRED_MUON.momentum, "weight_decay": PAIRED_MUON.weight_decay},
}
#: AdamW for embeddings, head, norms and biases; fused where the device supports it.
DEFAULT_ADAMW: dict = {
    "class_path": "torch.optim.AdamW",
    "init_args": {
        "lr": PAIRED_ADAMW.lr, "betas": list(PAIRED_ADAMW.betas), "weight_decay": PAIRED_ADAMW.weight_decay
    },
}


def _check_switches(parent_lr: object, split_fused: object, split_heads: object) -> None:
    """Refuse a switch of the mixin's that is not a bool (a YAML ``"yes"``, say)."""
    if not isinstance(parent_lr, bool):
        raise ValueError(f"parent_lr must be True or False, got {parent_lr!r}")
    if split_fused is not None and not isinstance(split_fused, bool):
        raise ValueError(f"split_fused must be True, False or None (the default: equal q, k, v blocks split), got "
                         f"{split_fused!r}")
    if not isinstance(split_heads, bool):
        raise ValueError(f"split_heads must be True or False, got {split_heads!r}")


@dataclass(frozen=True, kw_only=True)
class MuonConfig:
    """`MuonMixin`'s keyword-only arguments, validated, with the factories resolved.

    The settings, the compared fields, are plain data (what hyperparameters and checkpoints hold: specs for the
    factories); the ``*_factory`` fields are what the mixin calls (the original factory where one was given, so
    a factory that has no spec still works in this process). Two configs are equal when their settings are.
    """

    muon: Any
    adamw: Any
    lr_scheduler: Any
    #: Each optimizer's own lr scheduler spec, which replaces ``lr_scheduler`` for it (`_schedulers`).
    muon_lr_scheduler: Any = None
    adamw_lr_scheduler: Any = None
    muon_params: tuple[str, ...]
    adamw_params: tuple[str, ...]
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    max_consecutive_skips: int
    parent_lr: bool = False
    #: Orthogonalise the blocks of every fused projection the routing finds on their own (`route_parameters`).
    split_fused: bool | None = None
    #: Orthogonalise each attention head of q, k and v on its own (`route_parameters`' ``split_heads``).
    split_heads: bool = False
    #: Glob pattern -> the row-block sizes of those Muon parameters, or ``None`` to keep a found one whole.
    matrix_blocks: dict[str, list[int] | None] = field(default_factory=dict, hash=False)
    #: Group name -> that group's own settings (``{"embeddings": {"lr": 0.01}}``), over its optimizer's defaults.
    group_settings: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)
    #: ``None`` for ``muon=None``, the AdamW-only baseline.
    muon_factory: Callable[..., Any] | None = field(compare=False, repr=False)
    adamw_factory: Callable[..., Any] = field(compare=False, repr=False)
    lr_scheduler_factory: Callable[..., Any] | None = field(compare=False, repr=False)
    muon_lr_scheduler_factory: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    adamw_lr_scheduler_factory: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_arguments(
        cls,
        *,
        muon: Any,
        adamw: Any,
        lr_scheduler: Any,
        muon_lr_scheduler: Any = None,
        adamw_lr_scheduler: Any = None,
        muon_params: Sequence[str],
        adamw_params: Sequence[str],
        accumulate_grad_batches: int,
        gradient_clip_val: float | None,
        max_consecutive_skips: int,
        parent_lr: bool = False,
        split_fused: bool | None = None,
        matrix_blocks: Mapping[str, Sequence[int] | None] | None = None,
        group_settings: Mapping[str, Mapping[str, Any]] | None = None,
        split_heads: bool = False,
    ) -> MuonConfig:
        """Validate the mixin's arguments (a `ValueError` naming the bad value and the fix) and resolve them."""
        if not is_count(accumulate_grad_batches):
            raise ValueError(f"accumulate_grad_batches must be an int >= 1, got {accumulate_grad_batches!r}")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"gradient_clip_val must be > 0 or None, got {gradient_clip_val!r}")
        check_pattern_list("muon_params", muon_params)
        check_pattern_list("adamw_params", adamw_params)
        if not is_count(max_consecutive_skips):
            raise ValueError(
                f"max_consecutive_skips must be >= 1, got {max_consecutive_skips!r} (a whole number of updates)"
            )
        _check_switches(parent_lr, split_fused, split_heads)
        if matrix_blocks is not None and not isinstance(matrix_blocks, Mapping):
            raise ValueError(
                f"matrix_blocks must map glob patterns to row-block sizes (or None), e.g. "
                f"{{'*.c_attn.weight': [768, 768, 768]}}; got {matrix_blocks!r}"
            )
        settings = check_group_settings(group_settings)
        muon_factory, adamw_factory, lr_scheduler_factory = from_spec(muon), from_spec(adamw), from_spec(lr_scheduler)
        if adamw_factory is None:
            raise ValueError("adamw must be an optimizer factory; it holds every parameter that is not on Muon")
        specs = {"muon": to_spec(muon), "adamw": to_spec(adamw), "lr_scheduler": to_spec(lr_scheduler),
                 "muon_lr_scheduler": to_spec(muon_lr_scheduler), "adamw_lr_scheduler": to_spec(adamw_lr_scheduler)}
        for name, spec in specs.items():
            if isinstance(spec, dict) and "callable" in spec:
                rank_zero_warn(
                    f"MuonMixin: `{name}` ({spec['callable']}) cannot be saved as a loadable spec, so "
                    "load_from_checkpoint will not rebuild it. Pass a class, functools.partial(cls, plain "
                    "keywords) or a spec like {'class_path': ..., 'init_args': {...}} instead."
                )
        return cls(
            muon=specs["muon"],
            adamw=specs["adamw"],
            lr_scheduler=specs["lr_scheduler"],
            muon_lr_scheduler=specs["muon_lr_scheduler"],
            adamw_lr_scheduler=specs["adamw_lr_scheduler"],
            muon_params=tuple(muon_params),
            adamw_params=tuple(adamw_params),
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            max_consecutive_skips=max_consecutive_skips,
            parent_lr=parent_lr,
            split_fused=split_fused,
            split_heads=split_heads,
            matrix_blocks={str(k): None if v is None else [int(x) for x in v]
                           for k, v in (matrix_blocks or {}).items()},
            group_settings=settings,
            muon_factory=muon_factory,
            adamw_factory=adamw_factory,
            lr_scheduler_factory=lr_scheduler_factory,
            muon_lr_scheduler_factory=from_spec(muon_lr_scheduler),
            adamw_lr_scheduler_factory=from_spec(adamw_lr_scheduler),
        )

    @property
    def muon_class(self) -> type | None:
        """The class the Muon factory builds, where that can be known without calling it."""
        return target_class(self.muon_factory)

    def build(self, algorithm: Algorithm, groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
        """Call the Muon or the AdamW factory; a bad setting is reported with the argument it came from."""
        muon = algorithm is Algorithm.MUON
        factory = self.muon_factory if muon else self.adamw_factory
        assert factory is not None, f"no {algorithm} factory"
        spec = self.muon if muon else self.adamw
        try:
            optimizer = factory(groups, **kwargs)
        except (ValueError, TypeError) as error:
            raise ValueError(f"MuonMixin could not build the `{algorithm.key}` optimizer ({spec}): {error}") from error
        check_settings_taken(optimizer, self.group_settings, f"the `{algorithm.key}` optimizer ({spec})")
        return optimizer

    def build_adamw(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The AdamW optimizer; torch's AdamW fused where every parameter's device supports it (several
        times faster, CPU and CUDA in torch >= 2.4), unless the factory chose ``fused`` itself."""
        factory = self.adamw_factory
        if target_class(factory) is torch.optim.AdamW and getattr(factory, "keywords", {}).get("fused") is None:
            params = [p for g in groups for _, p in g["params"]]
            if all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params):
                return self.build(Algorithm.ADAMW, groups, fused=True)
        return self.build(Algorithm.ADAMW, groups)

    def route(self, module: torch.nn.Module, roles: GraphRoles | None) -> Routing:
        """Where ``module``'s trainable parameters go under this config (patterns, Muon class, ``muon=None``), with
        the output heads and input layers of ``roles`` (``None``: from names and structure)."""
        muon_class = self.muon_class
        routing = route_parameters(
            module,
            muon_params=self.muon_params,
            adamw_params=self.adamw_params,
            muon_nd=muon_class is not None and issubclass(muon_class, Muon),
            graph=roles,
            split_fused=self.split_fused,
            split_heads=self.split_heads,
            matrix_blocks=self.matrix_blocks or None,
            group_settings=self.group_settings,
        )
        return routing if self.muon_enabled else routing.all_on_adamw("muon=None: on AdamW")

    def effective_lrs(self, routing: Routing) -> dict[str, float]:
        """The learning rate each routed parameter will start with, by name (Muon's after the shape
        adjustment), read from optimizers built for the purpose and thrown away. ``routing`` is where the
        parameters really go (`MuonMixin.muon_routing`: all on AdamW for ``muon=None``)."""
        lrs: dict[str, float] = {}
        if routing.muon_groups:
            for group in self.build(Algorithm.MUON, routing.muon_groups).param_groups:
                lrs.update(zip(group[PARAM_NAMES], group_effective_lrs(group), strict=True))
        if routing.adamw_groups:  # (a LoRA model routes nothing to AdamW)
            for group in self.build(Algorithm.ADAMW, routing.adamw_groups).param_groups:
                for name in group[PARAM_NAMES]:
                    lrs[name] = float(group["lr"])
        return lrs

    @property
    def scheduler_factories(self) -> dict[str, Callable[..., Any] | None]:
        """The lr scheduler factory of each optimizer, by algorithm: its own (``muon_lr_scheduler``,
        ``adamw_lr_scheduler``) where given, else the shared ``lr_scheduler`` (`_schedulers.build_schedulers`); none
        for Muon with ``muon=None``."""
        muon = self.muon_lr_scheduler_factory or self.lr_scheduler_factory
        return {MUON: muon if self.muon_enabled else None,
                ADAMW: self.adamw_lr_scheduler_factory or self.lr_scheduler_factory}

    @property
    def scheduled(self) -> bool:
        """Whether any optimizer has an lr scheduler."""
        return any(f is not None for f in self.scheduler_factories.values())

    def with_adamw_lr(self, lr: float) -> MuonConfig:
        """This config with AdamW's lr replaced (``lr_find``'s suggestion for the ``muon=None`` baseline)."""
        factory = functools.partial(self.adamw_factory, lr=lr)
        return dataclasses.replace(self, adamw=to_spec(factory), adamw_factory=factory)

    @property
    def muon_enabled(self) -> bool:
        """Whether a Muon optimizer is configured (``False`` for the ``muon=None`` AdamW baseline)."""
        return self.muon_factory is not None

    @property
    def lrs_given(self) -> bool:
        """Whether the learning rates were chosen (``parent_lr=True``, or a ``muon``/``adamw`` other than the
        defaults), rather than left at the mixin's defaults."""
        chosen_muon = self.muon is not None and self.muon != DEFAULT_MUON
        return self.parent_lr or chosen_muon or self.adamw != DEFAULT_ADAMW

    def with_lr(self, lr: float, weight_decay: float) -> MuonConfig:
        """This config's factories with AdamW at ``lr`` and ``weight_decay``, and Muon at the same with
        ``adjust_lr_fn="match_rms_adamw"`` (its update RMS matched to AdamW's, as in Moonlight): ``parent_lr=True``.
        The specs stay as given (they record ``parent_lr``, not the numbers)."""
        muon = None
        if self.muon_factory is not None:
            matched = {"lr": lr, "weight_decay": weight_decay, "adjust_lr_fn": "match_rms_adamw"}
            muon = functools.partial(self.muon_factory, **matched)
        adamw = functools.partial(self.adamw_factory, lr=lr, weight_decay=weight_decay)
        return dataclasses.replace(self, muon_factory=muon, adamw_factory=adamw)

    def to_hparams(self) -> dict[str, Any]:
        """The settings (the compared fields) as plain data, tuples as lists, as checkpoints save them."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        return {name: list(value) if isinstance(value, tuple) else value for name, value in settings.items()}

