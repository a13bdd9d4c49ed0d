"""What the fit's training batches show, applied: the ranks agree on it, and people are told what it did.

The optimizers are built (``configure_optimizers``) before any batch is seen, from the name and structure rules.
The first batch of the fit shows what those rules can only guess: which matrices feed the loss through no other
matrix (output heads, all of them), which read the batch through no other matrix (input layers, whatever
their width), and which tensors are no matrix by their use. Finding those roles is one pure step of
`lightning_muon.routing` (`trace_step`, which returns them); the routing they give is `MuonConfig.route`'s, and
the optimizer pair moves parameters between its groups (`OptimizerPair.regroup`). What the first batch did not
reach (a task's branch, an auxiliary loss every k steps) is routed by the batch that first reaches it
(`OptimizerPair.place`), for at most `UNREACHED_UPDATES` updates, after which a warning names what is still
unreached (`unreached_warning`).

This module makes the ranks agree on what their batches showed (`agreed_roles`: a parameter one rank did not reach
takes the role the others saw), checks that every rank reached the same routing (`check_ranks_agree`) and says
what the batches did (`moves_message`, `reached_message`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.optim.groups import NAME
from lightning_muon.routing import ADAMW, MUON, GraphRoles, Route, Routing, Rule

#: The updates, from the first followed one, whose batches the fit follows while the first did not reach some
#: parameters; then it warns, naming what is still unreached, and follows no more batches.
UNREACHED_UPDATES = 50
#: The rules whose routes no batch changes (what is routed by them is not waited for).
_DECIDED_WITHOUT_BATCH = (Rule.PATTERN, Rule.MODULE_TYPE, Rule.TIE)

if TYPE_CHECKING:
    import lightning.pytorch as pl


def group_layout(routing: Routing) -> list[list[tuple[str, list[str]]]]:
    """Each optimizer's groups as ``(group name, parameter names)``, Muon's first: what the optimizers hold."""
    return [[(g[NAME], [n for n, _ in g["params"]]) for g in routing.groups(opt)] for opt in (MUON, ADAMW)]


def moves_message(before: Routing, after: Routing, roles: GraphRoles, took_s: float) -> str:
    """What the first batch did to the routing, for people: confirmed it, moved parameters, or could not tell; and
    what it did not reach."""
    took = f"{took_s * 1000:.0f} ms" + (f"; {roles.note}" if roles.note else "")
    if roles.heads is None and roles.inputs is None:
        return (f"MuonMixin: the first training batch could not be followed ({roles.note}); output heads and "
                "input layers stay as names and structure decided them.")
    moved = [a for a, b in zip(after.routes, before.routes, strict=True)
             if (a.optimizer, a.group) != (b.optimizer, b.group)]
    waiting = waited_for(after, roles)
    unreached = (f" It did not reach {len(waiting)} parameter(s) ({_some(waiting)}): they stay where names and "
                 "structure routed them until a batch reaches them, then go where that batch shows."
                 if waiting else "")
    if not moved:
        return f"MuonMixin: the first training batch confirmed the routing ({took}).{unreached}"
    lines = "\n".join(f"  {r.name}: {r.optimizer} ({r.reason})" for r in moved)
    return (f"MuonMixin: the first training batch moved {len(moved)} parameter(s) before the first update ({took}):"
            f"\n{lines}\n{unreached.strip()}{chr(10) if unreached else ''}" + after.render())


def waited_for(routing: Routing, roles: GraphRoles | None) -> list[str]:
    """The parameters no batch has reached yet whose route a batch could still change (those a user pattern, their
    module type or a tie decides are not waited for), in routing order."""
    if roles is None or not roles.unreached:
        return []
    return [r.name for r in routing.routes if r.name in roles.unreached and r.rule not in _DECIDED_WITHOUT_BATCH]


def reached_message(update: int, before: Routing, after: Routing, newly: Collection[str], moved: Collection[str],
                    took_s: float) -> str:
    """What a later batch did, for people: the parameters it first reached, where each goes, and which it moved
    there before their first update."""
    old = {r.name: r for r in before.routes}
    lines = "\n".join(f"  {r.name}: {_where_to(r)}" + (f", moved from {_where_to(old[r.name], False)}"
                                                       if r.name in moved else "")
                      for r in after.routes if r.name in newly)
    return (f"MuonMixin: the training batch of update {update} reached {len(newly)} parameter(s) no batch had "
            f"reached, and placed them before their first update ({took_s * 1000:.0f} ms):\n{lines}")


def warn_unreached(routing: Routing, names: Collection[str], updates: int) -> None:
    """Warn (rank zero) about what no batch reached in the fit's first ``updates`` followed updates."""
    lines = "\n".join(f"  {r.name}: {_where_to(r)}" for r in routing.routes if r.name in names)
    rank_zero_warn(
        f"MuonMixin: no training batch reached {len(names)} parameter(s) in {updates} updates (they got no "
        "gradient), so they stay where names and structure routed them, and later batches are no longer "
        f"followed:\n{lines}\nIf a later batch trains them, decide where with MuonMixin(muon_params=[...]) or "
        "adamw_params=[...]; if nothing uses them, freeze them (requires_grad_(False))."
    )


def warn_lacking(routing: Routing, names: Collection[str]) -> None:
    """Warn (rank zero) about parameters a later batch showed belong on an optimizer the fit did not build."""
    lines = "\n".join(f"  {r.name}: {r.optimizer} ({r.reason})" for r in routing.routes if r.name in names)
    rank_zero_warn(
        "MuonMixin: a training batch first reached parameters that belong on an optimizer this fit did not build, "
        f"so they stay where they are:\n{lines}\nDecide them with MuonMixin(muon_params=[...]) or "
        "adamw_params=[...]."
    )


def _where_to(route: Route, reason: bool = True) -> str:
    where = f"{route.optimizer}/{route.group}"
    return f"{where} ({route.reason})" if reason else where


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def agreed_roles(trainer: pl.Trainer, roles: GraphRoles, trainable: Collection[str]) -> GraphRoles:
    """What every rank's batch of this step showed, together (`GraphRoles.combined`: a parameter one rank did not
    reach takes the role the ranks that did saw), the same on every rank; refused, on every rank, where two ranks
    that reached a trainable parameter saw it in different roles."""
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return roles
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, roles.to_dict())
    per_rank = [GraphRoles.from_dict(data) for data in gathered]
    combined, conflicts = GraphRoles.combined(per_rank)
    conflicts = [n for n in conflicts if n in trainable]
    if not conflicts:
        return combined
    lines = [f"  {name}: " + ", ".join(f"{r.role(name) or 'not reached'} on rank {rank}"
                                         for rank, r in enumerate(per_rank)) for name in conflicts[:20]]
    raise MisconfigurationException(
        "The ranks' training batches showed different roles for parameters they reached:\n" + "\n".join(lines)
        + "\nA layer used one way on one rank and another way on another cannot be placed from the batches: decide "
        "those parameters with MuonMixin(muon_params=[...]) or adamw_params=[...], which the batches do not overrule."
    )


def check_ranks_agree(trainer: pl.Trainer, routing: Routing) -> None:
    """Every rank must train with the same routing (each saw its own batch): refuse, on every rank, otherwise."""
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    layouts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, group_layout(routing))
    if all(layout == layouts[0] for layout in layouts):
        return
    where = [_where(layout) for layout in layouts]
    differences = [
        f"  {name}: {'/'.join(where[0][name])} on rank 0, {'/'.join(where[rank].get(name, ('?', '?')))} on rank {rank}"
        for rank in range(1, len(where)) for name in where[0] if where[rank].get(name) != where[0][name]
    ] or ["  (the same parameters in another order)"]
    raise MisconfigurationException(
        "The ranks' first training batches showed different routings:\n" + "\n".join(differences[:20])
        + "\nA batch may leave some layers unused (an MoE expert, a branch): decide those parameters with "
        "MuonMixin(muon_params=[...]) or adamw_params=[...], which the batch does not overrule."
    )


def _where(layout: list[list[tuple[str, list[str]]]]) -> dict[str, tuple[str, str]]:
    """Parameter name -> (optimizer, group), from a `group_layout`."""
    return {n: (o, g) for o, groups in zip((MUON, ADAMW), layout, strict=True) for g, names in groups for n in names}
