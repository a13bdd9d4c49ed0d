"""Optimizer and scheduler factories as plain data, and back.

The mixin takes factories (``OptimizerCallable``: ``params -> Optimizer``).
Checkpoint hyperparameters must be plain data (loadable with
``weights_only=True``), so a factory is saved as a spec
``{"class_path": "torch.optim.AdamW", "init_args": {...}}`` and a spec is
accepted wherever a factory is.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["describe", "plain_data", "resolve", "target_class"]

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
    """``values`` with torch dtypes spelled by name, and the keys whose values are not plain data left out."""
    kept, dropped = {}, []
    for key, value in values.items():
        value = _plain_value(value) if not isinstance(value, dict) else plain_data(value)[0]
        if _is_plain(value):
            kept[key] = value
        else:
            dropped.append(key)
    return kept, dropped


def _path(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _target_of_partial(factory: functools.partial) -> Any:
    """The class a partial builds: ``partial(cls, ...)``, or jsonargparse's ``partial(f, instantiator, cls, ...)``."""
    if inspect.isclass(factory.func):
        return factory.func
    return next((a for a in reversed(factory.args) if inspect.isclass(a)), None)


def target_class(factory: Any) -> type | None:
    """The class a factory builds, where that can be known without calling it."""
    if isinstance(factory, dict):
        factory = resolve(factory)
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


def describe(factory: Any) -> Any:
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


def resolve(spec: Any) -> Callable[..., Any] | None:
    """The factory for a spec from `describe` (or a factory, returned unchanged)."""
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
