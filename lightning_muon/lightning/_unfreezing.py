"""Parameters that become trainable during a fit: Lightning's finetuning callbacks under `MuonMixin`.

``BaseFinetuning`` freezes part of the model before the optimizers are built and, at some epoch, unfreezes it and
offers it to each optimizer with ``optimizer.add_param_group({"params": ..., "lr": ...})``. With the mixin's pair
that would put every unfrozen tensor, norms and biases included, into whichever optimizer is offered it first
(Muon), or fail on torch's "all optimizer param groups should be with/without names". `route_added_groups` makes
each of the fit's optimizers route what it is offered by the same rules as at the start (matrices to Muon, the
rest to AdamW, the first batch's roles applied): one new group per optimizer (named ``unfrozen_<n>``, fresh state)
at the same fraction of that optimizer's learning rate as the callback asked of the one it offered the group to.
What another optimizer already holds is skipped, so offering the same modules to both adds them once.

``BackboneFinetuning`` is refused at fit start (`check_finetuning_callbacks`): it keeps one backbone learning rate
across every optimizer it is given (``previous_backbone_lr``, ``param_groups[-1]``), so under two optimizers it
would carry AdamW's lr into Muon's backbone group from the next epoch on, silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.lightning import _compat
from lightning_muon.routing import Routing

#: Group names of what a fit adds (``unfrozen_1``, ``unfrozen_2``, ...; `MuonMonitor` logs them as lr keys).
GROUP_PREFIX = "unfrozen_"


def check_finetuning_callbacks(callbacks: list[Any], muon_enabled: bool) -> None:
    """Refuse, before the fit trains, a finetuning callback whose lr schedule assumes a single optimizer."""
    if not muon_enabled:
        return
    for callback in callbacks:
        if isinstance(callback, _compat.lightning_classes(BackboneFinetuning)):
            raise MisconfigurationException(
                "BackboneFinetuning keeps one backbone learning rate for every optimizer it is given, and "
                "MuonMixin trains with two (Muon and AdamW), whose learning rates are not on the same scale: from "
                "the epoch after the unfreeze it would give Muon's backbone matrices AdamW's lr. Use a "
                "BaseFinetuning subclass whose finetune_function calls self.unfreeze_and_add_param_group(...) "
                "(MuonMixin routes what it unfreezes: matrices to Muon, the rest to AdamW, each at the same "
                "fraction of its optimizer's lr), or muon=None (AdamW alone) with BackboneFinetuning."
            )


def _lr(optimizer: Optimizer) -> float:
    """An optimizer's learning rate: its first group's (its default where it holds no group)."""
    return float(optimizer.param_groups[0]["lr"] if optimizer.param_groups else optimizer.defaults["lr"])


def _tensors(params: Any) -> list[Tensor]:
    """The tensors of a param group's ``params`` (a tensor, tensors, or ``(name, tensor)`` pairs)."""
    if isinstance(params, Tensor):
        return [params]
    return [p[1] if isinstance(p, tuple) else p for p in params]


def route_added_groups(optimizers: dict[str, Optimizer], routing: Callable[[], Routing]) -> None:
    """Make every optimizer of ``optimizers`` (by algorithm, the fit's) route the param groups it is offered
    (see the module's docstring); ``routing`` gives the module's routing as it stands (the unfrozen tensors in)."""
    add = {algorithm: optimizer.add_param_group for algorithm, optimizer in optimizers.items()}
    added = [0]

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
            ratio = float(group.get("lr", _lr(given))) / _lr(given)
            routes = [by_id[id(p)] for p in new]
            missing = sorted({str(r.optimizer) for r in routes} - set(optimizers))
            if missing:
                raise MisconfigurationException(
                    f"Parameters unfrozen during the fit go to {missing[0]} by MuonMixin's rules, but the fit has no "
                    f"{missing[0]} optimizer (nothing was routed to it at the start): "
                    f"{[r.name for r in routes if str(r.optimizer) == missing[0]]}. Decide them with "
                    "muon_params=[...] or adamw_params=[...]."
                )
            added[0] += 1
            for algorithm, optimizer in optimizers.items():
                _add_group(add[algorithm], optimizer, Routing([r for r in routes if r.optimizer == algorithm],
                                                               now.params), algorithm, ratio, added[0])

        return add_param_group

    for optimizer in optimizers.values():
        optimizer.add_param_group = offered_to(optimizer)  # type: ignore[method-assign,assignment]


def _add_group(add: Callable[[dict[str, Any]], None], optimizer: Optimizer, routing: Routing, algorithm: str,
               ratio: float, index: int) -> None:
    """Add ``routing``'s parameters for ``algorithm`` to ``optimizer`` as one group at ``ratio`` of its lr."""
    groups = routing.groups(algorithm)
    if not groups:
        return
    group: dict[str, Any] = {
        "name": f"{GROUP_PREFIX}{index}",
        "params": [pair for g in groups for pair in g["params"]],
        "lr": ratio * _lr(optimizer),
    }
    if any("matrix_layouts" in g for g in groups):
        group["matrix_layouts"] = [
            layout for g in groups for layout in g.get("matrix_layouts", ["flatten"] * len(g["params"]))
        ]
    add(group)
