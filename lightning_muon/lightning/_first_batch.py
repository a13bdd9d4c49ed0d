"""What the fit's first training batch shows, applied: the ranks agree on it, and people are told what it did.

The optimizers are built (``configure_optimizers``) before any batch is seen, from the name and structure rules.
The first batch of the fit shows what those rules can only guess: which matrices feed the loss through no other
matrix (output heads, all of them) and which read the batch through no other matrix (input layers, whatever
their width). Finding those roles is one pure step of `lightning_muon.routing` (`trace_step`, which returns
them); the routing they give is `MuonConfig.route`'s, and the optimizer pair moves parameters between its groups
(`OptimizerPair.regroup`). This module checks that every rank reached the same routing (`check_ranks_agree`) and
says what the batch did (`moves_message`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.optim.groups import NAME
from lightning_muon.routing import ADAMW, MUON, GraphRoles, Routing

if TYPE_CHECKING:
    import lightning.pytorch as pl


def group_layout(routing: Routing) -> list[list[tuple[str, list[str]]]]:
    """Each optimizer's groups as ``(group name, parameter names)``, Muon's first: what the optimizers hold."""
    return [[(g[NAME], [n for n, _ in g["params"]]) for g in routing.groups(opt)] for opt in (MUON, ADAMW)]


def moves_message(before: Routing, after: Routing, roles: GraphRoles, took_s: float) -> str:
    """What the first batch did to the routing, for people: confirmed it, moved parameters, or could not tell."""
    took = f"{took_s * 1000:.0f} ms" + (f"; {roles.note}" if roles.note else "")
    if roles.heads is None and roles.inputs is None:
        return (f"MuonMixin: the first training batch could not be followed ({roles.note}); output heads and "
                "input layers stay as names and structure decided them.")
    moved = [a for a, b in zip(after.routes, before.routes, strict=True)
             if (a.optimizer, a.group) != (b.optimizer, b.group)]
    if not moved:
        return f"MuonMixin: the first training batch confirmed the routing ({took})."
    lines = "\n".join(f"  {r.name}: {r.optimizer} ({r.reason})" for r in moved)
    return (f"MuonMixin: the first training batch moved {len(moved)} parameter(s) before the first update ({took}):"
            f"\n{lines}\n" + after.render())


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
