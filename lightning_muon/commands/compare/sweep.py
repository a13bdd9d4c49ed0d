"""What ``compare --sweep`` sweeps: which learning rate of a config, its grid, the best of it, and the seeds.

A config whose model trains Muon + AdamW sweeps the Muon lr (AdamW keeps the config's lr on the embeddings,
norms and head); an AdamW-only config (``muon: null``) sweeps the AdamW lr. The grid is the config's lr times
each multiplier (x1/4, x1/2, x1, x2, x4 by default), or lrs given explicitly. Pure functions on plain data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_muon.commands.compare.fit import override_value

#: The default grid: the config's lr times these.
MULTIPLIERS = (0.25, 0.5, 1.0, 2.0, 4.0)
MUON_LR = "model.init_args.muon.init_args.lr"
ADAMW_LR = "model.init_args.adamw.init_args.lr"


@dataclass(frozen=True)
class SweptLr:
    """The learning rate a side sweeps.

    Attributes:
        key: the config key the sweep sets (``model.init_args.muon.init_args.lr`` or ``...adamw...``).
        optimizer: ``"Muon"`` or ``"AdamW"``.
        lr: the config's value of it (overrides included); ``None`` when the config does not say.
        rest_lr: on a Muon side, AdamW's lr on the other parameters (``None`` when not written, or AdamW-only).
    """

    key: str
    optimizer: str
    lr: float | None
    rest_lr: float | None = None

    @property
    def muon(self) -> bool:
        """Whether the side trains with Muon (False: the AdamW-only baseline)."""
        return self.optimizer == "Muon"

    def describe(self) -> str:
        """What is swept, for the table: ``Muon lr (AdamW 0.003 on the rest)`` or ``AdamW lr (all params)``."""
        if not self.muon:
            return "AdamW lr (all params)"
        rest = "the config's" if self.rest_lr is None else f"{self.rest_lr:g}"
        return f"Muon lr (AdamW {rest} on the rest)"


def _optimizer_lr(init_args: Mapping[str, Any], which: str) -> float | None:
    factory = init_args.get(which)
    lr = ((factory.get("init_args") or {}) if isinstance(factory, dict) else {}).get("lr")
    return None if lr is None else float(lr)


def swept_lr(config: Mapping[str, Any], overrides: Sequence[str] = ()) -> SweptLr:
    """The lr ``config`` (a merged LightningCLI config, plain data) sweeps, with the overrides every fit gets.

    ``model.init_args.muon`` null (in the config or ``--model.init_args.muon null``): the AdamW lr; otherwise
    (a Muon factory, or none written: the mixin's default Muon) the Muon lr.
    """
    init_args = ((config.get("model") or {}).get("init_args") or {}) if isinstance(config, Mapping) else {}
    muon_given = override_value(overrides, "model.init_args.muon")
    muon = init_args.get("muon", "default") is not None if muon_given is None else muon_given.lower() not in (
        "null", "none")
    key = MUON_LR if muon else ADAMW_LR
    given = override_value(overrides, key)
    lr = float(given) if given is not None else _optimizer_lr(init_args, "muon" if muon else "adamw")
    if not muon:
        return SweptLr(key, "AdamW", lr)
    rest = override_value(overrides, ADAMW_LR)
    return SweptLr(key, "Muon", lr, float(rest) if rest is not None else _optimizer_lr(init_args, "adamw"))


def check_multipliers(multipliers: Sequence[float]) -> list[float]:
    """The multipliers, sorted and without repeats; a non-positive or non-finite one is a ValueError naming it."""
    for m in multipliers:
        if not (math.isfinite(m) and m > 0):
            raise ValueError(f"--multipliers: every multiplier must be a positive number, got {m:g} "
                             f"(the default grid is {','.join(f'{x:g}' for x in MULTIPLIERS)})")
    if not multipliers:
        raise ValueError("--multipliers: give at least one multiplier, e.g. --multipliers 0.5,1,2")
    return sorted(set(multipliers))


def check_lrs(lrs: Sequence[float], what: str) -> list[float]:
    """Explicit lrs, sorted and without repeats; a non-positive or non-finite one is a ValueError naming ``what``."""
    for lr in lrs:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"{what}: every lr must be a positive number, got {lr:g}")
    if not lrs:
        raise ValueError(f"{what}: give at least one lr, e.g. 0.01,0.02,0.04")
    return sorted(set(lrs))


def lr_grid(lr: float, multipliers: Sequence[float] = MULTIPLIERS) -> list[float]:
    """``lr`` times each multiplier, rounded to 6 significant digits (as run names and tables print them), sorted."""
    return sorted({float(f"{lr * m:.6g}") for m in check_multipliers(multipliers)})


def side_grid(name: str, swept: SweptLr, multipliers: Sequence[float] | None,
              explicit: Sequence[float] | None) -> list[float]:
    """The lrs side ``name`` fits: ``explicit`` when given, else its config's lr times ``multipliers`` (None: no
    sweep, the config's lr alone). A config lr that cannot be read is an error saying how to give one."""
    if explicit is not None:
        return check_lrs(explicit, f"--lrs {name}=...")
    if swept.lr is None:
        raise ValueError(
            f"{name}: no {swept.optimizer} lr to {'sweep around' if multipliers else 'seed'}: the config does not "
            f"set {swept.key}. Write it in the config, pass --{swept.key} LR, or give the lrs: --lrs {name}=LR,LR,..."
        )
    return [swept.lr] if multipliers is None else lr_grid(swept.lr, multipliers)


def parse_lrs(specs: Sequence[str], names: Sequence[str]) -> dict[str, list[float]]:
    """``--lrs NAME=LR,LR,...`` (one per side at most) as ``{name: lrs}``; a name that is no side, a value that is
    no number, or a side given twice is a ValueError saying which."""
    grids: dict[str, list[float]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or name not in names:
            raise ValueError(f"--lrs {spec!r}: expected NAME=LR,LR,... with NAME one of {', '.join(names)}")
        if name in grids:
            raise ValueError(f"--lrs: {name} is given twice")
        try:
            lrs = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(
                f"--lrs {spec!r}: the lrs must be numbers separated by commas, e.g. {name}=0.01,0.02") from None
        grids[name] = check_lrs(lrs, f"--lrs {name}=...")
    return grids


def check_seeds(seeds: int) -> int:
    """``--seeds``: at least 1."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1 (seeds 0..N-1 at each side's best lr), got {seeds}")
    return seeds


def best_lr(finals: Mapping[float, float]) -> float:
    """The lr with the lowest final validation loss (a NaN loss, from a diverged run, is never the best)."""
    if not finals:
        raise ValueError("no lr to choose from")
    return min(finals, key=lambda lr: (math.isnan(finals[lr]), finals[lr], lr))


def edge(lr: float, grid: Sequence[float]) -> str | None:
    """``"lowest"`` or ``"highest"`` when ``lr`` is at that end of a grid of more than one lr, else None."""
    if len(grid) < 2:
        return None
    return "lowest" if lr == min(grid) else "highest" if lr == max(grid) else None
