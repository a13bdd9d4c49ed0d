"""`LaterGroups`: what later training batches make of the pair's param groups (`OptimizerPair` owns it).

A parameter the fit's first batch did not reach is routed by names and structure until a later batch reaches it;
it holds no optimizer state then, so the pair moves it to where that batch shows at no cost (`LaterGroups.place`).
It leaves its group (an emptied group stays, so that every scheduler keeps the groups it steps) and joins the
group of its route, or a *late* group of that name added at the end of its optimizer's groups, with the settings
of that optimizer's first group, which it follows through every scheduler step (`follow`: the optimizer's
schedulers were built for the groups before it), at its own ratio to them where the groups' own settings
(``group_settings``) differ (`late_settings`). A checkpoint records the late groups and that the groups were so
arranged (`record`); a resumed fit gives the optimizers that order and those empty groups back (`arrange`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.optim.groups import MATRIX_BLOCKS, MATRIX_LAYOUTS, NAME, PARAM_NAMES
from lightning_muon.routing import SETTING_KEYS

#: The keys of a group that say what it holds (the rest are its settings, which schedulers may move).
_STRUCTURE_KEYS = {"params", NAME, PARAM_NAMES, MATRIX_LAYOUTS, MATRIX_BLOCKS}

#: One optimizer's groups as ``[group name, [parameter names]]``: what a checkpoint records of it.
Layout = list[list[Any]]


def settings_of(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings (lr, momentum, betas, weight decay, what schedulers add: ``initial_lr``, ...)."""
    return {key: value for key, value in group.items() if key not in _STRUCTURE_KEYS}


def _structure_of(group: dict[str, Any] | None) -> dict[str, Any]:
    """What a param group holds (its parameters, their names, layouts and blocks); empty for ``None``."""
    if group is None:
        return {"params": [], PARAM_NAMES: []}
    return {key: value for key, value in group.items() if key in _STRUCTURE_KEYS - {NAME}}


def held_tensors(optimizers: Iterable[Optimizer]) -> dict[str, Tensor]:
    """The tensors ``optimizers`` hold, by parameter name."""
    return {n: p for o in optimizers for g in o.param_groups
            for n, p in zip(g[PARAM_NAMES], g["params"], strict=True)}


def stepped(optimizers: Iterable[Optimizer], names: Iterable[str]) -> set[str]:
    """Those of ``names`` whose tensors hold optimizer state in ``optimizers`` that is not all zeros (a fresh
    buffer steps as none): moving them would lose what their optimizer learned."""
    wanted = set(names)
    found = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for name, p in zip(group[PARAM_NAMES], group["params"], strict=True):
                state = optimizer.state.get(p) if name in wanted else None
                if state and any(isinstance(v, Tensor) and bool(v.any()) for k, v in state.items() if k != "step"):
                    found.add(name)
    return found


#: A group's base settings by its name (its `group_settings` over its optimizer's defaults).
Bases = Callable[[str], dict[str, Any]]


def group_bases(defaults: dict[str, Any], settings: dict[str, dict[str, Any]]) -> Bases:
    """The base settings of an optimizer's groups by name: its ``defaults`` (the factory's), with each group's own
    (``group_settings``) over them."""

    def of(name: str) -> dict[str, Any]:
        own = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.get(name, {}).items()}
        return {**{k: defaults[k] for k in SETTING_KEYS if k in defaults}, **own}

    return of


def late_settings(first: dict[str, Any], own: dict[str, Any], head: dict[str, Any]) -> dict[str, Any]:
    """A late group's settings: its optimizer's ``first`` group's (what the schedulers set), where the late group's
    base settings (``own``) differ from the first group's (``head``) a number at the same ratio to the first group's
    (an lr ``own["lr"] / head["lr"]`` times the first group's scheduled lr, its ``initial_lr`` its own), anything
    else (betas, or a number whose first group's base is 0) as ``own`` gives it."""
    settings = settings_of(first)
    for key, value in own.items():
        base = head.get(key)
        if value == base:
            continue
        number = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, base)) and base != 0
        number = number and key in settings
        settings[key] = value * (settings[key] / base) if number else value  # (exact where no schedule moved it)
        if key == "lr" and "initial_lr" in settings:
            settings["initial_lr"] = value
    return settings


def regrouped(groups: list[dict[str, Any]], built: list[dict[str, Any]],
              bases: Bases) -> tuple[list[dict[str, Any]], list[str]]:
    """An optimizer's ``groups`` holding what the groups ``built`` for it hold, by name, each keeping its settings
    (a group ``built`` has none of becomes empty), then the ``built`` groups it has no group of yet, with the
    settings of its first group (at their own ratio to them, `late_settings` of ``bases``); and the names of
    those."""
    fresh = {g[NAME]: g for g in built}
    kept = [{**settings_of(g), NAME: g[NAME], **_structure_of(fresh.pop(g[NAME], None))} for g in groups]
    kept += [{**settings_of(g), **(late_settings(groups[0], bases(name), bases(groups[0][NAME])) if groups else {}),
              NAME: name, **_structure_of(g)} for name, g in fresh.items()]
    return kept, list(fresh)


@dataclass
class LaterGroups:
    """The late groups of the pair's optimizers, and whether later batches arranged its groups (see the module's
    docstring)."""

    #: The late groups of each optimizer by algorithm, in order.
    late: dict[str, list[str]] = field(default_factory=dict)
    #: Whether the groups were arranged for what later batches reach (`place`, or a placeholder kept for them at
    #: the first batch): a checkpoint then records their order and empty groups, and a resume keeps them.
    arranged: bool = False

    def is_late(self, algorithm: str | None, group: dict[str, Any]) -> bool:
        """Whether ``group`` of the ``algorithm`` optimizer is a late one."""
        return algorithm is not None and group.get(NAME) in self.late.get(algorithm, ())

    def keep(self, wanted: dict[str, list[dict[str, Any]]], placeholder: Callable[[str], dict[str, Any]],
             algorithms: Iterable[str]) -> None:
        """Give each of the fit's optimizers (``algorithms``) that ``wanted`` leaves without a group a
        ``placeholder`` one: a later batch may place parameters there, in a group its schedulers step."""
        for algorithm in algorithms:
            if not wanted[algorithm]:
                self.arranged = True
                wanted[algorithm] = [placeholder(algorithm)]

    def place(self, optimizers: dict[str, Optimizer], wanted: dict[str, list[dict[str, Any]]],
              build: Callable[[str, list[dict[str, Any]]], Optimizer],
              settings: dict[str, dict[str, Any]]) -> list[str]:
        """Make ``optimizers`` (by algorithm) hold the groups ``wanted`` where it moves parameters (which hold no
        state worth keeping: a later batch first reached them), built as ``build`` builds them; returns the moved
        parameters' names (see the module's docstring; ``settings``: the groups' own, `group_bases`)."""
        held = held_tensors(optimizers.values())
        now = {n: (a, g[NAME]) for a, o in optimizers.items() for g in o.param_groups for n in g[PARAM_NAMES]}
        then = {n: (a, g[NAME]) for a, groups in wanted.items() for g in groups for n, _ in g["params"] if n in held}
        moved = sorted(n for n in then if now.get(n) != then[n])
        if any(then[n][0] not in optimizers for n in moved):
            raise RuntimeError(f"lightning_muon: {moved} would go to an optimizer this fit lacks")
        self.arranged |= bool(moved)
        for algorithm in {then[n][0] for n in moved} | {now[n][0] for n in moved if n in now}:
            optimizer = optimizers[algorithm]
            groups = [{**g, "params": [(n, held[n]) for n, _ in g["params"]]} for g in wanted[algorithm]]
            built = build(algorithm, groups).param_groups if groups else []
            optimizer.param_groups[:], late = regrouped(optimizer.param_groups, built,
                                                        group_bases(optimizer.defaults, settings))
            self.late.setdefault(algorithm, []).extend(late)
            for name in moved:
                optimizer.state.pop(held[name], None)  # (a fresh, all-zero buffer: see `stepped`)
        return moved

    def follow(self, algorithm: str | None, groups: list[dict[str, Any]], bases: Bases) -> None:
        """After a scheduler stepped an optimizer's first groups: its late ``groups`` take their first group's
        settings, at their own ratio to them (`late_settings`; ``bases``: the groups' base settings)."""
        for group in groups:
            if self.is_late(algorithm, group) and group is not groups[0]:
                group.update(late_settings(groups[0], bases(group[NAME]), bases(groups[0][NAME])))

    def record(self) -> dict[str, Any]:
        """What a checkpoint records of them (nothing where later batches arranged no group)."""
        return {"late_groups": {a: list(names) for a, names in self.late.items()}} if self.arranged else {}

    def restore(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's record of them (``saved``: the mixin's entry)."""
        self.arranged = "late_groups" in saved
        self.late = {a: list(names) for a, names in saved.get("late_groups", {}).items()}

    def arrange(self, wanted: dict[str, list[dict[str, Any]]], algorithms: list[str],
                layouts: list[Layout]) -> dict[str, list[dict[str, Any]]]:
        """``wanted``'s groups (by algorithm) in the order of ``layouts`` (what the fit's optimizers, ``algorithms``,
        held: a checkpoint's record), with an empty group where they held one ``wanted`` has not (a group whose
        parameters a later batch moved away, a placeholder), then any other; ``wanted`` itself where later batches
        arranged nothing."""
        if not self.arranged:
            return wanted
        done = dict(wanted)
        for algorithm, layout in zip(algorithms, layouts, strict=False):
            groups = {g[NAME]: g for g in wanted.get(algorithm, [])}
            order = [groups.pop(name) if name in groups else {NAME: name, "params": [], PARAM_NAMES: []}
                     for name, _ in layout]
            done[algorithm] = order + list(groups.values())
        return done
