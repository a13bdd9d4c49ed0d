"""The routing a fit trains with: built from the structural rules, then corrected from the first training batch.

The optimizers are built (``configure_optimizers``) before any batch is seen, from the name and structure rules.
The first batch of the fit shows what those rules can only guess: which matrices feed the loss through no other
matrix (output heads, all of them) and which read the batch through no other matrix (input layers, whatever
their width). Finding those roles is one pure step of `lightning_muon.routing` (`trace_step`, which returns
them); this module applies them, with explicit arguments: `routing_for` the routing they give, `check_ranks_agree`
that every rank reached the same one, and `correct_optimizers` moves parameters between the optimizers' groups
before their first step, while they hold no state (schedulers are built again for the new groups).

The module keeps the roles (`MuonMixin.muon_roles`) for the rest of its life and in its checkpoints, so a resumed
fit trains with the routing it was saved with; `restore_roles_first` gives a distributed checkpoint's roles to the
optimizers before its optimizer states load into them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_muon.lightning import _unfreezing
from lightning_muon.lightning._checkpoint import CHECKPOINT_KEY
from lightning_muon.optim.muon import Muon
from lightning_muon.routing import ADAMW, MUON, Algorithm, GraphRoles, Routing, route_parameters

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_muon.lightning._config import MuonConfig


def routing_for(module: nn.Module, config: MuonConfig, roles: GraphRoles | None) -> Routing:
    """Where ``module``'s trainable parameters go under ``config`` (patterns, Muon class, ``muon=None``), with
    the output heads and input layers of ``roles`` (``None``: from names and structure)."""
    muon_class = config.muon_class
    routing = route_parameters(
        module,
        muon_params=config.muon_params,
        adamw_params=config.adamw_params,
        muon_nd=muon_class is not None and issubclass(muon_class, Muon),
        graph=roles,
    )
    return routing if config.muon_enabled else routing.all_on_adamw("muon=None: on AdamW")


def group_layout(routing: Routing) -> list[list[tuple[str, list[str]]]]:
    """Each optimizer's groups as ``(group name, parameter names)``, Muon's first: what the optimizers hold."""
    return [[(g["name"], [n for n, _ in g["params"]]) for g in routing.groups(opt)] for opt in (MUON, ADAMW)]


def groups_for(routing: Routing, optimizers: list[torch.optim.Optimizer], algorithms: list[str],
               placeholders: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The groups each algorithm's optimizer holds under ``routing``: the routing's groups (an empty placeholder
    where it has none and the fit keeps every optimizer, ``placeholders``), then each group a finetuning callback
    added to ``optimizers`` (which ``algorithms`` says are which) during the fit, its parameters split again by
    ``routing``, at the lr that optimizer's group has: a first batch after an unfreeze keeps what it added apart."""
    added = _unfreezing.added_groups(optimizers)
    in_added = {n for _, names in added for n in names}
    base = Routing([r for r in routing.routes if r.name not in in_added], routing.params)
    lrs = {(a, g["name"]): g["lr"] for a, o in zip(algorithms, optimizers, strict=True) for g in o.param_groups}
    groups: dict[str, list[dict[str, Any]]] = {}
    for algorithm in (MUON, ADAMW):
        kept = placeholders and algorithm in algorithms
        groups[algorithm] = base.groups(algorithm) or ([_unfreezing.placeholder_group(algorithm)] if kept else [])
        for name, names in added:
            mine = Routing([r for r in routing.routes if r.name in set(names)], routing.params)
            group = _unfreezing.unfrozen_group(mine, algorithm, lrs.get((algorithm, name), 0.0), name)
            if algorithm in algorithms or group["params"]:  # (an optimizer the fit lacks: refused by the caller)
                groups[algorithm].append(group)
    return groups


def holds(optimizers: list[torch.optim.Optimizer], routing: Routing, algorithms: list[str],
          placeholders: bool = False) -> bool:
    """Whether ``optimizers`` (``algorithms``: which each is) hold ``routing``'s groups (`groups_for`)."""
    wanted = groups_for(routing, optimizers, algorithms, placeholders)
    if any(wanted[a] for a in (MUON, ADAMW) if a not in algorithms):
        return False
    held = [[(g["name"], list(g.get("param_names", []))) for g in o.param_groups] for o in optimizers]
    return held == [[(g["name"], [n for n, _ in g["params"]]) for g in wanted[a]] for a in algorithms]


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


def correct_optimizers(trainer: pl.Trainer, routing: Routing, config: MuonConfig, algorithms: list[str],
                       placeholders: bool = False) -> None:
    """Give the fit's optimizers (which hold no state yet; ``algorithms`` says which each is) the param groups of
    ``routing`` (`groups_for`, groups a finetuning callback added kept apart), built as ``config`` builds them, in
    place, and build their schedulers again for the groups they were built with. The optimizer objects stay the
    same (callbacks may hold them); one left without parameters steps nothing."""
    optimizers = list(trainer.optimizers)
    if any(o.state for o in optimizers):
        raise RuntimeError("lightning_muon: the routing can only be corrected before the optimizers' first step")
    # The tensors the optimizers hold, by name: during a training step FSDP2's modules hold unsharded copies of
    # their parameters, while the optimizers must keep the sharded ones they were built with.
    held = {n: p for o in optimizers for g in o.param_groups
            for n, p in zip(g["param_names"], g["params"], strict=True)}
    routed = {r.name for r in routing.routes}
    if set(held) != routed:
        raise MisconfigurationException(
            "The trainable parameters changed between building the optimizers and the first training batch: "
            f"now trainable but in no optimizer: {sorted(routed - set(held))[:10]}; in an optimizer but now frozen: "
            f"{sorted(set(held) - routed)[:10]}. A hook or callback froze or unfroze them in between. Freeze before "
            "the optimizers are built (in __init__, configure_model or a callback's setup, where "
            "BaseFinetuning.freeze_before_training runs), and unfreeze during the fit with a finetuning callback "
            "(BaseFinetuning.unfreeze_and_add_param_group), which adds them to the optimizers."
        )
    wanted = groups_for(routing, optimizers, algorithms, placeholders)
    groups = {a: [{**g, "params": [(n, held[n]) for n, _ in g["params"]]} for g in wanted[a]] for a in (MUON, ADAMW)}
    for algorithm in (MUON, ADAMW):
        if any(g["params"] for g in groups[algorithm]) and algorithm not in algorithms:
            raise MisconfigurationException(
                f"The first training batch routed parameters to {algorithm} where the structural rules had routed "
                f"none, so the fit has no {algorithm} optimizer to give them: {routing.names(algorithm)}. Decide "
                "them with MuonMixin(muon_params=[...]) or adamw_params=[...] (or use muon=None for AdamW alone)."
            )
    for optimizer, algorithm in zip(optimizers, algorithms, strict=True):
        build = config.build_adamw if algorithm == ADAMW else functools.partial(config.build, Algorithm.MUON)
        optimizer.param_groups[:] = build(groups[algorithm]).param_groups if groups[algorithm] else []
    if config.lr_scheduler_factory is None:
        return
    with contextlib.ExitStack() as built_groups_only:
        for optimizer in optimizers:
            built_groups_only.enter_context(_unfreezing.scheduled_groups_only(optimizer))
        rebuilt = config.build_schedulers(optimizers, lambda: trainer.estimated_stepping_batches)
    for scheduler_config, built_config in zip(trainer.lr_scheduler_configs, rebuilt, strict=True):
        scheduler_config.scheduler = built_config["scheduler"]


def saved_roles(saved: dict[str, Any], resuming: bool) -> GraphRoles | None:
    """The roles a checkpoint's record (``checkpoint["lightning_muon"]``) trained with. A resumed fit whose
    checkpoint has none (saved before a first batch was followed) keeps the structural routing it was saved with
    (empty roles); a load without a fit, ``None``. Records written before the key was ``"roles"`` say ``"graph"``."""
    data = saved.get("roles", saved.get("graph"))
    if data is not None:
        return GraphRoles.from_dict(data)
    return GraphRoles() if resuming else None


def restore_roles_first(load: Callable[..., Any], load_roles: Callable[[dict[str, Any]], None]) -> Callable[..., Any]:
    """``load`` (a strategy's ``load_checkpoint``), giving a distributed checkpoint's record to ``load_roles``
    before it reads the file: a directory's optimizer states load into the optimizers as they stand, so they must
    hold the checkpoint's routing first (its ``meta.pt`` has the roles). One-file checkpoints are left alone."""

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        meta = Path(checkpoint_path) / "meta.pt" if isinstance(checkpoint_path, (str, Path)) else None
        if meta is not None and meta.is_file():
            saved = torch.load(meta, map_location="cpu", weights_only=False).get(CHECKPOINT_KEY)
            if saved is not None:
                load_roles(saved)
        return load(checkpoint_path, *args, **kwargs)

    return load_checkpoint
