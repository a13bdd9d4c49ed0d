"""Factories as plain data, and back: `to_spec`, `from_spec`, `target_class`, and `plain_data` for saved
hyperparameters.

The mixin takes factories (``OptimizerCallable``: ``params -> Optimizer``).
Checkpoint hyperparameters must be plain data (loadable with
``weights_only=True``), so a factory is saved as a spec
``{"class_path": "torch.optim.AdamW", "init_args": {...}}`` (`to_spec`) and a
spec is accepted wherever a factory is (`from_spec`). Lightning's own
``instantiate_class`` builds an object from a spec; it cannot give back a
factory (a class with some keywords bound), nor turn a factory into a spec.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["from_spec", "plain_data", "target_class", "to_spec"]

_PLAIN = (bool, int, float, str, type(None))


def _is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data: bools, numbers, strings, ``None``, and lists, tuples and str-keyed dicts
    of them."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _plain(value: Any) -> Any:
    """``value`` as hyperparameters keep it: a torch dtype by its name, tuples as lists (weights_only unpickling
    accepts both, YAML only lists), inside tuples and dicts too; anything else as it is."""
    if isinstance(value, torch.dtype):
        return str(value)
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
            value = _plain(value)
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


def to_spec(factory: Any) -> Any:
    """A plain-data description of ``factory``: ``None``, a spec dict, or (last resort) its import path."""
    if factory is None or isinstance(factory, dict):
        return factory
    if inspect.isclass(factory):
        return {"class_path": _path(factory)}
    if isinstance(factory, functools.partial):
        target = _target_of_partial(factory)
        keywords = {k: _plain(v) for k, v in factory.keywords.items()}
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
