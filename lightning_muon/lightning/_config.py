"""`MuonConfig`: the mixin's settings as one frozen, typed, validated object, and factory specs.

The mixin takes factories (``OptimizerCallable``: ``params -> Optimizer``).
Checkpoint hyperparameters must be plain data (loadable with
``weights_only=True``), so a factory is saved as a spec
``{"class_path": "torch.optim.AdamW", "init_args": {...}}`` (`to_spec`) and a
spec is accepted wherever a factory is (`from_spec`). Lightning's own
``instantiate_class`` builds an object from a spec; it cannot give back a
factory (a class with some keywords bound), nor turn a factory into a spec.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer

from lightning_muon.optim.defaults import PAIRED_ADAMW, PAIRED_MUON
from lightning_muon.optim.groups import group_effective_lrs, is_count
from lightning_muon.routing import Algorithm, Routing, check_pattern_list

_PLAIN = (bool, int, float, str, type(None))


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _plain(value: Any) -> Any:
    """Tuples become lists (weights_only unpickling accepts both; YAML only lists)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def plain_data(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` with torch dtypes spelled by name, and the keys whose values are not plain data left out.

    A dict that holds something that is not plain data is left out whole (a part of it would be another value,
    and would build another model without a word); the second result names what was not plain, as dotted paths
    (``model_kwargs.distr_output``)."""
    kept, dropped = {}, []
    for key, value in values.items():
        if isinstance(value, dict):
            value, inner = plain_data(value)
            if inner:
                dropped += [f"{key}.{path}" for path in inner]
                continue
        else:
            value = _plain_value(value)
        if _is_plain(value):
            kept[key] = value
        else:
            dropped.append(key)
    return kept, dropped


def _path(obj: Any) -> str:
    """The import path of a class or function; the package's top level when it re-exports the object
    there (``lightning_muon.Muon``, not the module it is defined in, so specs survive internal moves)."""
    module, name = obj.__module__, obj.__qualname__
    top = module.split(".")[0]
    public = getattr(sys.modules.get(top), name, None) is obj
    return f"{top}.{name}" if public else f"{module}.{name}"


def _target_of_partial(factory: functools.partial) -> Any:
    """The class a partial builds: ``partial(cls, ...)``, or jsonargparse's ``partial(f, instantiator, cls, ...)``."""
    if inspect.isclass(factory.func):
        return factory.func
    return next((a for a in reversed(factory.args) if inspect.isclass(a)), None)


def target_class(factory: Any) -> type | None:
    """The class a factory builds, where that can be known without calling it."""
    if isinstance(factory, dict):
        factory = from_spec(factory)
    if inspect.isclass(factory):
        return factory
    if isinstance(factory, functools.partial):
        return _target_of_partial(factory)
    return None


def _plain_value(value: Any) -> Any:
    """A keyword argument as plain data (torch dtypes as their name), or the value itself if it has none."""
    if isinstance(value, torch.dtype):
        return str(value)
    return _plain(value)


def to_spec(factory: Any) -> Any:
    """A plain-data description of ``factory``: ``None``, a spec dict, or (last resort) its import path."""
    if factory is None or isinstance(factory, dict):
        return factory
    if inspect.isclass(factory):
        return {"class_path": _path(factory)}
    if isinstance(factory, functools.partial):
        target = _target_of_partial(factory)
        keywords = {k: _plain_value(v) for k, v in factory.keywords.items()}
        if target is not None and all(_is_plain(v) for v in keywords.values()):
            return {"class_path": _path(target), "init_args": keywords} if keywords else {"class_path": _path(target)}
    return {"callable": _path(factory) if hasattr(factory, "__qualname__") else repr(factory)}


def from_spec(spec: Any) -> Callable[..., Any] | None:
    """The factory for a spec from `to_spec` (or a factory, returned unchanged)."""
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, dict) or ("class_path" not in spec and "callable" not in spec):
        raise ValueError(
            f"expected an optimizer/scheduler factory or a spec like "
            f"{{'class_path': 'torch.optim.AdamW', 'init_args': {{'lr': 0.001}}}}, got {spec!r}"
        )
    path = spec.get("class_path") or spec["callable"]
    module_name, _, name = path.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"cannot import {path!r} from the factory spec {spec!r}: {error}") from error
    init_args = spec.get("init_args") or {}
    return functools.partial(target, **init_args) if init_args else target


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


@dataclass(frozen=True)
class MuonConfig:
    """`MuonMixin`'s keyword-only arguments, validated, with the factories resolved.

    The spec fields are plain data (what hyperparameters and checkpoints hold); the
    ``*_factory`` fields are what the mixin calls (the original factory where one was
    given, so a factory that has no spec still works in this process). Two configs
    are equal when their specs and settings are.
    """

    muon: Any
    adamw: Any
    lr_scheduler: Any
    muon_params: tuple[str, ...]
    adamw_params: tuple[str, ...]
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    max_consecutive_skips: int
    parent_lr: bool = False
    muon_factory: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    adamw_factory: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    lr_scheduler_factory: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_arguments(
        cls,
        *,
        muon: Any,
        adamw: Any,
        lr_scheduler: Any,
        muon_params: Sequence[str],
        adamw_params: Sequence[str],
        accumulate_grad_batches: int,
        gradient_clip_val: float | None,
        max_consecutive_skips: int,
        parent_lr: bool = False,
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
        if not isinstance(parent_lr, bool):
            raise ValueError(f"parent_lr must be True or False, got {parent_lr!r}")
        factories = {"muon": from_spec(muon), "adamw": from_spec(adamw), "lr_scheduler": from_spec(lr_scheduler)}
        if factories["adamw"] is None:
            raise ValueError("adamw must be an optimizer factory; it holds every parameter that is not on Muon")
        specs = {"muon": to_spec(muon), "adamw": to_spec(adamw), "lr_scheduler": to_spec(lr_scheduler)}
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
            muon_params=tuple(muon_params),
            adamw_params=tuple(adamw_params),
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            max_consecutive_skips=max_consecutive_skips,
            parent_lr=parent_lr,
            muon_factory=factories["muon"],
            adamw_factory=factories["adamw"],
            lr_scheduler_factory=factories["lr_scheduler"],
        )

    @property
    def muon_class(self) -> type | None:
        """The class the Muon factory builds, where that can be known without calling it."""
        return target_class(self.muon_factory)

    def build(
        self, which: Algorithm | Literal["muon", "adamw"], groups: list[dict[str, Any]], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """Call the Muon or the AdamW factory (``which``: an `Algorithm`, or its key ``"muon"``/``"adamw"``, the
        mixin's argument); a bad setting is reported with the argument it came from."""
        algorithm = which if isinstance(which, Algorithm) else Algorithm.from_key(which)
        muon = algorithm is Algorithm.MUON
        factory = self.muon_factory if muon else self.adamw_factory
        assert factory is not None, f"no {algorithm} factory"
        try:
            return factory(groups, **kwargs)
        except (ValueError, TypeError) as error:
            spec = self.muon if muon else self.adamw
            raise ValueError(f"MuonMixin could not build the `{algorithm.key}` optimizer ({spec}): {error}") from error

    def build_adamw(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The AdamW optimizer; torch's AdamW fused where every parameter's device supports it (several
        times faster, CPU and CUDA in torch >= 2.4), unless the factory chose ``fused`` itself."""
        factory = self.adamw_factory
        if target_class(factory) is torch.optim.AdamW and getattr(factory, "keywords", {}).get("fused") is None:
            params = [p for g in groups for _, p in g["params"]]
            if all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params):
                return self.build(Algorithm.ADAMW, groups, fused=True)
        return self.build(Algorithm.ADAMW, groups)

    def effective_lrs(self, routing: Routing) -> dict[str, float]:
        """The learning rate each routed parameter will start with, by name (Muon's after the shape
        adjustment), read from optimizers built for the purpose and thrown away. ``routing`` is where the
        parameters really go (`MuonMixin.muon_routing`: all on AdamW for ``muon=None``)."""
        lrs: dict[str, float] = {}
        if routing.muon_groups:
            for group in self.build(Algorithm.MUON, routing.muon_groups).param_groups:
                lrs.update(zip(group["param_names"], group_effective_lrs(group), strict=True))
        for group in self.build(Algorithm.ADAMW, routing.adamw_groups).param_groups:
            for name in group["param_names"]:
                lrs[name] = float(group["lr"])
        return lrs

    def build_schedulers(self, optimizers: list[Optimizer], fit_length: Callable[[], float]) -> list[dict[str, Any]]:
        """One scheduler per optimizer, as Lightning's scheduler configs.

        The factory may return a scheduler (stepped per update) or a Lightning scheduler dict
        (``{"scheduler": ..., "interval": "epoch", "frequency": 2, "monitor": "val_loss"}``; ``interval``
        defaults to ``"step"``). A ``ReduceLROnPlateau`` is stepped per epoch on its ``monitor`` (the dict's, or
        the scheduler's own attribute as ``lightning.pytorch.cli.ReduceLROnPlateau`` has it).
        A scheduler whose ``total_steps`` is ``None`` after construction (`lightning_muon.WarmupCosine`'s
        protocol) gets the fit's number of updates, ``fit_length()``.
        """
        assert self.lr_scheduler_factory is not None
        schedulers = []
        for optimizer in optimizers:
            built = self.lr_scheduler_factory(optimizer)
            config = dict(built) if isinstance(built, dict) else {"scheduler": built}
            scheduler = config["scheduler"]
            if getattr(scheduler, "total_steps", 0) is None:
                total = fit_length()
                if not math.isfinite(total):
                    raise MisconfigurationException(
                        f"{type(scheduler).__name__} needs the length of the fit, which is unbounded here: set "
                        "Trainer(max_steps=...) or max_epochs, or give the scheduler total_steps=..."
                    )
                scheduler.total_steps = int(total)
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                config.setdefault("monitor", getattr(scheduler, "monitor", None))
                config.setdefault("interval", "epoch")
                if config["monitor"] is None:
                    raise MisconfigurationException(
                        "lr_scheduler builds a ReduceLROnPlateau but names no metric to monitor: use "
                        "lightning.pytorch.cli.ReduceLROnPlateau(optimizer, monitor='val_loss', ...) or return "
                        "{'scheduler': ReduceLROnPlateau(optimizer), 'monitor': 'val_loss'} from the factory."
                    )
            config.setdefault("interval", "step")
            if config["interval"] not in ("step", "epoch"):
                raise MisconfigurationException(
                    f"lr_scheduler's interval must be 'step' or 'epoch', got {config['interval']!r}"
                )
            schedulers.append(config)
        return schedulers

    def with_adamw_lr(self, lr: float) -> MuonConfig:
        """This config with AdamW's lr replaced (``lr_find``'s suggestion for the ``muon=None`` baseline)."""
        assert self.adamw_factory is not None
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
        assert self.adamw_factory is not None
        muon = None
        if self.muon_factory is not None:
            matched = {"lr": lr, "weight_decay": weight_decay, "adjust_lr_fn": "match_rms_adamw"}
            muon = functools.partial(self.muon_factory, **matched)
        adamw = functools.partial(self.adamw_factory, lr=lr, weight_decay=weight_decay)
        return dataclasses.replace(self, muon_factory=muon, adamw_factory=adamw)

    def to_hparams(self) -> dict[str, Any]:
        """The settings as plain data (lists, not tuples), as checkpoints save them."""
        return {
            "muon": self.muon,
            "adamw": self.adamw,
            "lr_scheduler": self.lr_scheduler,
            "muon_params": list(self.muon_params),
            "adamw_params": list(self.adamw_params),
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "gradient_clip_val": self.gradient_clip_val,
            "max_consecutive_skips": self.max_consecutive_skips,
            "parent_lr": self.parent_lr,
        }
