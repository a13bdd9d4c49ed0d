"""What the examples need beyond lightning_muon's own dependencies, imported with one clear error if missing."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def require(module: str, distribution: str, extra: str) -> ModuleType:
    """``import module``, or a ModuleNotFoundError that says which distribution and extra install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or not (module == error.name or module.startswith(f"{error.name}.")):
            raise  # something else is missing, inside an installed package
        raise ModuleNotFoundError(
            f'this example needs {distribution}, which is not installed: pip install "lightning-muon[{extra}]" '
            f"(or pip install {distribution})",
            name=error.name,
        ) from None


def sklearn_digits() -> Any:
    """scikit-learn's bundled 8x8 digits (``sklearn.datasets.load_digits()``)."""
    return require("sklearn.datasets", "scikit-learn", "examples").load_digits()
