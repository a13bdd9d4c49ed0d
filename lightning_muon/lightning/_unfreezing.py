"""Parameters that become trainable during a fit: Lightning's finetuning callbacks under `MuonMixin`.

``BaseFinetuning`` freezes part of the model before the optimizers are built and, at some epoch, unfreezes it and
offers it to each optimizer with ``optimizer.add_param_group({"params": ..., "lr": ...})``. With the mixin's pair
that would put every unfrozen tensor, norms and biases included, into whichever optimizer is offered it first
(Muon), or fail on torch's "all optimizer param groups should be with/without names". `route_added_groups` makes
each of the fit's optimizers route what it is offered by the same rules as at the start (matrices to Muon, the
rest to AdamW, the first batch's roles applied): one new group per optimizer (named ``unfrozen_<n>``, fresh state)
at the same fraction of that optimizer's learning rate as the callback asked of the one it offered the group to
(exactly the lr asked, for that one); the group's other settings go to the optimizers that have them
(``weight_decay`` to both, ``betas`` to AdamW's part). An optimizer that gets none of the tensors still gets its
``unfrozen_<n>`` group, empty: every optimizer's last group is then the one just added, which is where
``BackboneFinetuning`` sets the backbone's lr in the epochs after. What another optimizer already holds is skipped,
so offering the same modules to both adds them once.

With a finetuning callback in the fit, both optimizers are built even where the start routes nothing to one of
them (a frozen backbone under a linear head: no matrix trains at first): that one holds an empty group
(`placeholder_group`) until the callback unfreezes something for it. The added groups keep the lr the callback
gives them: the fit's schedulers step the groups the optimizers were built with (`scheduled_groups_only`), as they
would in a single-optimizer fit on an older torch (a newer torch's schedulers refuse a grown optimizer).
``BackboneFinetuning`` itself is made per-optimizer by `lightning_muon.lightning._finetuning`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.lightning import _compat
from lightning_muon.routing import ADAMW, MUON, Routing

#: Group names of what a fit adds (``unfrozen_1``, ``unfrozen_2``, ...; `MuonMonitor` logs them as lr keys).
GROUP_PREFIX = "unfrozen_"
#: The name of the empty group an optimizer holds when the start of a fit with a finetuning callback routes
#: nothing to it (Muon's only group name; AdamW's group of parameters no rule names).
PLACEHOLDER_NAMES = {MUON: "hidden", ADAMW: "other"}


def finetuning_callbacks(callbacks: Iterable[Any]) -> list[Any]:
    """The ``BaseFinetuning`` callbacks (either Lightning package) among ``callbacks``."""
    return [c for c in callbacks if isinstance(c, _compat.lightning_classes(BaseFinetuning))]


def check_finetuning_callbacks(callbacks: list[Any], muon_enabled: bool) -> None:
    """Refuse, before the fit trains, a ``BackboneFinetuning`` given one absolute backbone lr for two optimizers."""
    if not muon_enabled:
        return
    for callback in callbacks:
        lr = getattr(callback, "backbone_initial_lr", None)
        if isinstance(callback, _compat.lightning_classes(BackboneFinetuning)) and lr is not None:
            raise MisconfigurationException(
                f"BackboneFinetuning(backbone_initial_lr={lr}) gives the backbone one absolute learning rate, and "
                "MuonMixin trains the backbone with two optimizers whose learning rates are on different scales "
                "(Muon's matrices, AdamW's norms and biases). Give it as a fraction of each optimizer's lr instead: "
                "BackboneFinetuning(backbone_initial_ratio_lr=...) (the lr you meant divided by the lr of the "
                "optimizer you meant it for), or use muon=None (AdamW alone)."
            )


def is_added(group: dict[str, Any]) -> bool:
    """Whether a param group was added during the fit (`route_added_groups` names it ``unfrozen_<n>``)."""
    return str(group.get("name", "")).startswith(GROUP_PREFIX)


def placeholder_group(algorithm: str) -> dict[str, Any]:
    """The empty group an optimizer is built with where the start routes nothing to it (a fit with a finetuning
    callback); named, like every group of the pair (torch wants all groups with names or none)."""
    return {"name": PLACEHOLDER_NAMES[algorithm], "params": [], "param_names": []}


def unfrozen_group(routing: Routing, algorithm: str, lr: float, name: str) -> dict[str, Any]:
    """One group ``name`` at ``lr`` with ``routing``'s parameters for ``algorithm`` (empty where it has none)."""
    groups = routing.groups(algorithm)
    group: dict[str, Any] = {"name": name, "params": [pair for g in groups for pair in g["params"]], "lr": lr}
    if not groups:
        group["param_names"] = []
    if any("matrix_layouts" in g for g in groups):
        group["matrix_layouts"] = [
            layout for g in groups for layout in g.get("matrix_layouts", ["flatten"] * len(g["params"]))
        ]
    return group


#: The keys of an offered group that the routing decides itself (the lr is scaled per optimizer).
_ROUTED_KEYS = {"params", "lr", "name", "param_names", "matrix_layouts"}


def _settings_for(optimizer: Optimizer, offered: dict[str, Any], optimizers: Iterable[Optimizer]) -> dict[str, Any]:
    """The other settings of an ``offered`` group (``weight_decay``, ``betas``, ...) that ``optimizer``'s part of it
    keeps: those ``optimizer`` has (both take ``weight_decay``; only AdamW ``betas``, only Muon ``momentum``), and
    those no optimizer of the fit has (kept in the group, as torch keeps them)."""
    known = set().union(*(o.defaults for o in optimizers))
    return {key: value for key, value in offered.items()
            if key not in _ROUTED_KEYS and (key in optimizer.defaults or key not in known)}


def added_groups(optimizers: Iterable[Optimizer]) -> list[tuple[str, list[str]]]:
    """Each ``unfrozen_<n>`` group name, in order, with the names of the parameters it holds in any optimizer."""
    added: dict[str, list[str]] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if is_added(group):
                added.setdefault(group["name"], []).extend(group.get("param_names", []))
    return list(added.items())


@contextlib.contextmanager
def scheduled_groups_only(optimizer: Optimizer) -> Iterator[None]:
    """``optimizer`` showing only the groups it was built with (those before its first added group) while a
    scheduler steps it: the finetuning callback owns the added groups' lr."""
    groups = optimizer.param_groups
    built = next((i for i, g in enumerate(groups) if is_added(g)), len(groups))
    if built == len(groups):
        yield
        return
    optimizer.param_groups = groups[:built]  # the same group dicts: what the scheduler sets, they keep
    try:
        yield
    finally:
        optimizer.param_groups = groups


def _lr(optimizer: Optimizer) -> float:
    """An optimizer's learning rate: its first group's (its default where it holds no group)."""
    return float(optimizer.param_groups[0]["lr"] if optimizer.param_groups else optimizer.defaults["lr"])


def _tensors(params: Any) -> list[Tensor]:
    """The tensors of a param group's ``params`` (a tensor, tensors, or ``(name, tensor)`` pairs)."""
    if isinstance(params, Tensor):
        return [params]
    return [p[1] if isinstance(p, tuple) else p for p in params]


def _next_name(optimizers: Iterable[Optimizer]) -> str:
    """The next ``unfrozen_<n>`` name: one past the highest any optimizer holds (a resumed fit goes on counting)."""
    numbers = [int(n) for name, _ in added_groups(optimizers) if (n := name[len(GROUP_PREFIX):]).isdigit()]
    return f"{GROUP_PREFIX}{max(numbers, default=0) + 1}"


def route_added_groups(optimizers: dict[str, Optimizer], routing: Callable[[], Routing]) -> None:
    """Make every optimizer of ``optimizers`` (by algorithm, the fit's) route the param groups it is offered
    (see the module's docstring); ``routing`` gives the module's routing as it stands (the unfrozen tensors in)."""
    add = {algorithm: optimizer.add_param_group for algorithm, optimizer in optimizers.items()}

    def offered_to(given: Optimizer) -> Callable[[dict[str, Any]], None]:
        def add_param_group(group: dict[str, Any]) -> None:
            held = {id(p) for o in optimizers.values() for g in o.param_groups for p in g["params"]}
            new = [p for p in _tensors(group["params"]) if id(p) not in held]
            if not new:
                return  # already routed when another optimizer was offered the same modules
            now = routing()
            by_id = {id(now.params[r.name]): r for r in now.routes}
            strangers = [tuple(p.shape) for p in new if id(p) not in by_id]
            if strangers:
                raise MisconfigurationException(
                    f"A param group was added with tensors of shapes {strangers} that are no trainable parameter of "
                    "the module (frozen, or not its own), so MuonMixin cannot route them. Make them trainable "
                    "(requires_grad_(True)) before adding them, or add them to the module."
                )
            asked = float(group.get("lr", _lr(given)))
            ratio = asked / _lr(given)
            routes = [by_id[id(p)] for p in new]
            missing = sorted({str(r.optimizer) for r in routes} - set(optimizers))
            if missing:
                raise MisconfigurationException(
                    f"Parameters unfrozen during the fit go to {missing[0]} by MuonMixin's rules, but the fit has no "
                    f"{missing[0]} optimizer (nothing was routed to it at the start): "
                    f"{[r.name for r in routes if str(r.optimizer) == missing[0]]}. Decide them with "
                    "muon_params=[...] or adamw_params=[...]."
                )
            name = _next_name(optimizers.values())
            for algorithm, optimizer in optimizers.items():
                lr = asked if optimizer is given else ratio * _lr(optimizer)
                mine = Routing([r for r in routes if r.optimizer == algorithm], now.params)
                add[algorithm]({**unfrozen_group(mine, algorithm, lr, name),
                                **_settings_for(optimizer, group, optimizers.values())})

        return add_param_group

    for optimizer in optimizers.values():
        optimizer.add_param_group = offered_to(optimizer)  # type: ignore[method-assign,assignment]
