"""The routing a fit trains with: built from the structural rules, then corrected from the first training batch.

The optimizers are built (``configure_optimizers``) before any batch is seen, from the name and structure rules.
The first batch of the fit shows what those rules can only guess: which matrices feed the loss through no other
matrix (output heads, all of them) and which read the batch through no other matrix (input layers, whatever
their width). `FirstBatch` follows that batch's forward (`lightning_muon.routing.traced`), checks that every rank
reached the same routing, and, where it differs from the structural one, moves the parameters between the
optimizers' groups before their first step, while they hold no state; schedulers are built again for the new
groups. The module keeps what the batch showed (`GraphRoles`) for the rest of its life and in its checkpoints,
so a resumed fit trains with the routing it was saved with.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.lightning._checkpoint import CHECKPOINT_KEY
from lightning_muon.routing import ADAMW, MUON, GraphRoles, Routing, traced
from lightning_muon.routing._trace import RoleTrace

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.strategies import Strategy

    from lightning_muon.lightning._config import MuonConfig
    from lightning_muon.lightning.mixin import MuonMixin


def group_layout(routing: Routing) -> list[list[tuple[str, list[str]]]]:
    """Each optimizer's groups as ``(group name, parameter names)``, Muon's first: what the optimizers hold."""
    return [[(g["name"], [n for n, _ in g["params"]]) for g in routing.groups(opt)] for opt in (MUON, ADAMW)]


def holds(optimizers: list[torch.optim.Optimizer], routing: Routing) -> bool:
    """Whether ``optimizers`` hold ``routing``'s groups (an optimizer without groups counts as absent)."""
    held = [[(g["name"], list(g["param_names"])) for g in o.param_groups] for o in optimizers]
    return [groups for groups in held if groups] == [groups for groups in group_layout(routing) if groups]


class FirstBatch:
    """Follows the first training batch of a fit and applies what it shows (see the module's docstring)."""

    def __init__(self) -> None:
        self._trace: RoleTrace | None = None

    @contextlib.contextmanager
    def trace(self, module: LightningModule, args: tuple, kwargs: dict) -> Iterator[None]:
        """Follow the parent's ``training_step`` run inside this block; its batch is its first argument."""
        batch = args[0] if args else kwargs.get("batch")
        with traced(module, batch) as trace:
            self._trace = trace
            yield

    def decide(self, module: MuonMixin, loss: torch.Tensor | None) -> None:
        """Keep what the batch showed on the module, once every rank agrees; correct the optimizers where it moves
        parameters, and say what moved (INFO)."""
        assert self._trace is not None, "decide() after trace()"
        start = time.perf_counter()
        roles = self._trace.roles(loss)
        before = module.muon_routing()
        module._muon_graph = roles
        try:
            after = module.muon_routing()
            check_ranks_agree(module, after)
        except BaseException:
            module._muon_graph = None  # a later fit follows its own first batch
            raise
        if not holds(module.trainer.optimizers, after):
            correct_optimizers(module, after)
        took = f"{(time.perf_counter() - start) * 1000:.0f} ms" + (f"; {roles.note}" if roles.note else "")
        moved = [a for a, b in zip(after.routes, before.routes, strict=True) if (a.optimizer, a.group) != (
            b.optimizer, b.group)]
        if not moved:
            rank_zero_info(f"MuonMixin: the first training batch confirmed the routing ({took}).")
            return
        lines = "\n".join(f"  {r.name}: {r.optimizer} ({r.reason})" for r in moved)
        rank_zero_info(
            f"MuonMixin: the first training batch moved {len(moved)} parameter(s) before the first update ({took}):"
            f"\n{lines}\n" + after.render()
        )


def check_ranks_agree(module: LightningModule, routing: Routing) -> None:
    """Every rank must train with the same routing (each saw its own batch): refuse, on every rank, otherwise."""
    if module.trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
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


def correct_optimizers(module: MuonMixin, routing: Routing) -> None:
    """Give the fit's optimizers (which hold no state yet) the param groups of ``routing``, in place, and build
    their schedulers again for the new groups. The optimizer objects stay the same (callbacks may hold them)."""
    trainer = module.trainer
    optimizers = list(trainer.optimizers)
    if any(o.state for o in optimizers):
        raise RuntimeError("lightning_muon: the routing can only be corrected before the optimizers' first step")
    config: MuonConfig = module._optimizer_config()
    # The tensors the optimizers hold, by name: during a training step FSDP2's modules hold unsharded copies of
    # their parameters, while the optimizers must keep the sharded ones they were built with.
    held = {n: p for o in optimizers for g in o.param_groups
            for n, p in zip(g["param_names"], g["params"], strict=True)}
    if set(held) != {r.name for r in routing.routes}:
        raise RuntimeError("lightning_muon: the optimizers hold other parameters than the routing names")

    def holding(optimizer: str) -> list[dict]:
        return [{**g, "params": [(n, held[n]) for n, _ in g["params"]]} for g in routing.groups(optimizer)]

    groups = [config.build("muon", holding(MUON)).param_groups if routing.muon_groups else []]
    groups.append(config.build_adamw(holding(ADAMW)).param_groups)
    if len(optimizers) == 1:  # no Muon was built: the structural rules routed no parameter to it
        if groups[0]:
            raise MisconfigurationException(
                "The first training batch routed parameters to Muon where the structural rules had routed none, "
                "so the fit has no Muon optimizer to give them. Name them with MuonMixin(muon_params=[...]) (or "
                f"use muon=None for AdamW alone): {routing.names(MUON)}"
            )
        groups = groups[1:]
    for optimizer, new_groups in zip(optimizers, groups, strict=True):
        optimizer.param_groups[:] = new_groups  # Muon with no group (every matrix left it) steps nothing
    if config.lr_scheduler_factory is None:
        return
    rebuilt = config.build_schedulers(optimizers, lambda: trainer.estimated_stepping_batches)
    for scheduler_config, built_config in zip(trainer.lr_scheduler_configs, rebuilt, strict=True):
        scheduler_config.scheduler = built_config["scheduler"]


def restore_roles(module: MuonMixin, saved: dict[str, Any], resuming: bool) -> None:
    """A checkpoint's record (``checkpoint["lightning_muon"]``) gives the module the roles it trained with; a
    resumed fit whose checkpoint has none (saved before a first batch was followed) keeps the structural routing
    it was saved with. Optimizers built already (FSDP2 restores after setup), still without state, get the
    routing's groups before their states are loaded."""
    if "graph" in saved:
        module._muon_graph = GraphRoles.from_dict(saved["graph"])
    elif resuming:
        module._muon_graph = GraphRoles()
    optimizers = module.trainer.optimizers if resuming else []
    if optimizers and not any(o.state for o in optimizers):
        routing = module.muon_routing()
        if not holds(optimizers, routing):
            correct_optimizers(module, routing)


def restore_roles_before_loading(strategy: Strategy, checkpoint_path: Any) -> None:
    """Before a distributed checkpoint (a directory, FSDP2) is read: its optimizer states load into the
    optimizers as they stand, so they must hold the checkpoint's routing first (its ``meta.pt`` has the roles)."""
    module = strategy.lightning_module
    meta = Path(checkpoint_path) / "meta.pt" if isinstance(checkpoint_path, (str, Path)) else None
    if meta is None or not meta.is_file() or not hasattr(module, "_muon_graph"):
        return
    saved = torch.load(meta, map_location="cpu", weights_only=False).get(CHECKPOINT_KEY)
    if saved is not None:
        restore_roles(module, saved, resuming=True)  # type: ignore[arg-type]  # a MuonMixin (checked above)
