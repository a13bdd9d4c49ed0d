"""Settings per role: a routing group's own lr, weight decay, betas, eps or momentum (``group_settings``), checked
and kept as plain data, so that hyperparameters, checkpoints and YAML hold them as given."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch.optim import Optimizer

from lightning_muon.routing._vocabulary import Group

__all__ = ["SETTING_KEYS", "check_group_settings", "check_settings_taken", "group_setting_values"]

#: The keys a group's settings may set (each optimizer takes its own: AdamW ``betas`` and ``eps``, Muon
#: ``momentum``; both ``lr`` and ``weight_decay``).
SETTING_KEYS = ("lr", "weight_decay", "betas", "eps", "momentum")


def _number(group: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"group_settings[{group!r}][{key!r}] must be a finite number >= 0, got {value!r}")
    return float(value)


def _betas(group: str, value: Any) -> list[float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"group_settings[{group!r}]['betas'] must be two numbers in [0, 1), got {value!r}")
    betas = [_number(group, "betas", b) for b in value]
    if not all(b < 1 for b in betas):
        raise ValueError(f"group_settings[{group!r}]['betas'] must be two numbers in [0, 1), got {value!r}")
    return betas


def check_group_settings(settings: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``settings`` (group name -> its settings) checked and as plain data (betas as a list of floats).

    Raises:
        ValueError: not a mapping of mappings, a group name that is none of the routing's (`Group`), a key that is
            none of `SETTING_KEYS`, or a value out of range; the message names it and the valid ones.
    """
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise ValueError(f"group_settings must map group names to settings, e.g. {{'embeddings': {{'lr': 0.01}}}}; "
                         f"got {settings!r}")
    names = [g.value for g in Group]
    checked: dict[str, dict[str, Any]] = {}
    for group, values in settings.items():
        if group not in names:
            raise ValueError(f"group_settings names the group {group!r}, which is none of the routing's groups "
                             f"{names}")
        if not isinstance(values, Mapping):
            raise ValueError(f"group_settings[{group!r}] must map setting names ({list(SETTING_KEYS)}) to values, "
                             f"got {values!r}")
        unknown = [k for k in values if k not in SETTING_KEYS]
        if unknown:
            raise ValueError(f"group_settings[{group!r}] sets {unknown}, which are none of the settings a group takes "
                             f"{list(SETTING_KEYS)}")
        checked[str(group)] = {k: _betas(group, v) if k == "betas" else _number(group, k, v) for k, v in values.items()}
    return checked


def group_setting_values(settings: dict[str, Any]) -> dict[str, Any]:
    """A group's settings as torch's optimizers keep them in a param group (``betas`` as a tuple)."""
    return {k: tuple(v) if k == "betas" else v for k, v in settings.items()}


def check_settings_taken(optimizer: Optimizer, group_settings: dict[str, dict[str, Any]],
                         which: str) -> None:
    """Refuse a group setting ``optimizer`` (``which``, in words) does not take: torch keeps any key in a param
    group, so a ``momentum`` given to AdamW's group, or ``betas`` to Muon's, would be ignored without a word."""
    for group in optimizer.param_groups:
        unknown = sorted(k for k in group_settings.get(group.get("name", ""), {}) if k not in optimizer.defaults)
        if unknown:
            taken = sorted(k for k in optimizer.defaults if k in SETTING_KEYS)
            raise ValueError(
                f"group_settings[{group['name']!r}] sets {unknown}, which {which} does not take (its settings: "
                f"{taken}); set only those, or route the group's parameters to the other optimizer"
            )
