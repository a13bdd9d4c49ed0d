"""Argument and Trainer checks shared by the package's callbacks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import MisconfigurationException


def require_logger(trainer: pl.Trainer, callback: str) -> None:
    """Refuse, with the fix, a logging callback on a Trainer that has no logger."""
    if not trainer.loggers:
        raise MisconfigurationException(
            f"Cannot use {callback} with a Trainer that has no logger: pass logger=CSVLogger(...) "
            "(or any logger) to the Trainer, or remove the callback."
        )


def check_optional_count(name: str, value: Any) -> None:
    """Refuse anything but ``None`` or an int >= 1 (bools too), naming the argument."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise MisconfigurationException(f"{name} must be None or an int >= 1, got {value!r}")
