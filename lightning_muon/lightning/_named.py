"""`muon_subclass`: ``class Parent(MuonMixin, Parent)``, the Muon version of a LightningModule class under the
parent's own name, for libraries that look a model up by its class name.

``class MuonNHITS(MuonMixin, NHITS)`` has another ``__name__``, and the mixin-first bases make its ``__base__``
the mixin: a library that finds the model's kind by ``type(model).__name__`` (or ``__base__.__name__``), as
neuralforecast's ``NeuralForecast.save`` does, refuses it. The class `muon_subclass` builds is named as the
parent, so the library saves it as the parent and loads it back into the parent (for serving), or, through
``muon_subclass(Parent).load(...)``, into the Muon class again.

It pickles by reference wherever the parent does (``torch.save(model)``, spawned processes, Ray): its
``__qualname__`` encodes the parent's import path, and this module's ``__getattr__`` builds (or finds) the class
again from it in any process.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

from lightning_muon.lightning.mixin import MuonMixin

__all__ = ["muon_subclass"]

_T = TypeVar("_T")

#: The class built for each parent: one per parent, so ``muon_subclass(P) is muon_subclass(P)``.
_BUILT: dict[type, type] = {}


def _pickle_name(parent: type) -> str | None:
    """The name this module answers with the class for ``parent`` (``NHITS@neuralforecast:models:nhits``), or
    ``None`` when the parent cannot be imported by name (defined in a function): no dots, which pickle would
    follow as attributes."""
    if "<locals>" in parent.__qualname__:
        return None
    return f"{parent.__qualname__}@{parent.__module__}".replace(".", ":")


def muon_subclass(parent: type[_T]) -> type[_T]:
    """``class <Parent>(MuonMixin, Parent)``: ``parent`` trained with `MuonMixin`, under the parent's own name.

    For libraries that look a model up by its class name: neuralforecast's ``NeuralForecast.save`` and ``load``
    take ``muon_subclass(NHITS)(h=..., input_size=..., ...)`` as an ``NHITS`` (``load`` gives back the plain
    ``NHITS``, the same weights, for serving; ``muon_subclass(NHITS).load(path)`` the Muon one). Anywhere else,
    ``class MuonX(MuonMixin, X)`` is the same class under a name of your own.

    The class is built once per parent (calling again returns it), its ``__module__`` and ``__qualname__`` make
    it pickle by reference wherever the parent does, and ``load_from_checkpoint`` works on it as on any mixin
    class. Its constructor is the mixin's: the mixin's keyword-only settings, and the parent's arguments,
    positional or by keyword.

    Args:
        parent: the LightningModule class to train with the mixin.

    Examples:
        ```python
        from torch import nn
        from lightning_muon import muon_subclass

        class Net(L.LightningModule):  # a library's module, looked up by its name
            def __init__(self, hidden: int = 8):
                super().__init__()
                self.net = nn.Linear(hidden, hidden)

        MuonNet = muon_subclass(Net)
        model = MuonNet(hidden=16, gradient_clip_val=1.0)  # Net's arguments and the mixin's
        print(MuonNet.__name__, MuonNet.__mro__[1].__name__)  # Net MuonMixin
        ```

    Raises:
        TypeError: ``parent`` is not a class, or already has the mixin.
    """
    if not isinstance(parent, type):
        raise TypeError(f"muon_subclass takes a LightningModule class, got {parent!r}")
    if issubclass(parent, MuonMixin):
        raise TypeError(f"{parent.__qualname__} already has MuonMixin in its bases: use it as it is")
    built = _BUILT.get(parent)
    if built is None:
        pickle_name = _pickle_name(parent)
        namespace = {
            "__module__": __name__ if pickle_name is not None else parent.__module__,
            "__qualname__": pickle_name or parent.__qualname__,
            "__doc__": f"{parent.__name__} trained with MuonMixin (built by lightning_muon.muon_subclass).\n\n"
            f"{parent.__doc__ or ''}",
        }
        built = _BUILT[parent] = type(parent.__name__, (MuonMixin, parent), namespace)
    return built


def __getattr__(name: str) -> Any:
    """The class `muon_subclass` built for the parent that ``name`` encodes (PEP 562): how pickle finds it."""
    qualname, at, module = name.replace(":", ".").rpartition("@")
    if not at or not module:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        parent: Any = importlib.import_module(module)
        for part in qualname.split("."):
            parent = getattr(parent, part)
    except (ImportError, AttributeError) as error:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {error}") from error
    return muon_subclass(parent)
