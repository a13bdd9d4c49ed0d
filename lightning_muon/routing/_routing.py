"""`Routing`: every parameter's `Route`, and the param groups they make."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor

from lightning_muon.optim.groups import MATRIX_BLOCKS, MATRIX_LAYOUTS, NAME
from lightning_muon.routing import _table
from lightning_muon.routing._route import Route
from lightning_muon.routing._settings import group_setting_values
from lightning_muon.routing._vocabulary import Algorithm, Group

__all__ = ["Route", "Routing"]

#: Group names, in the order the groups are returned.
_GROUP_ORDER = {Algorithm.MUON: (Group.HIDDEN,), Algorithm.ADAMW: tuple(Group)}


@dataclass
class Routing:
    """Every trainable parameter's route, and the param groups for the two optimizers.

    What `lightning_muon.route_parameters` returns: print it for the table (who goes where, and why), and give
    `muon_groups` and `adamw_groups` to the two optimizers (each group named: ``hidden``, ``embeddings``,
    ``input``, ``head``, ``norms_and_biases``, ...).

    Examples:
        ```python
        import torch
        from torch import nn
        from lightning_muon import Muon, route_parameters

        model = nn.Sequential(nn.Embedding(16, 32), nn.Flatten(), nn.Linear(8 * 32, 64), nn.ReLU(),
                              nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
        routing = route_parameters(model)
        muon = Muon(routing.muon_groups, lr=0.02)
        adamw = torch.optim.AdamW(routing.adamw_groups, lr=3e-4)
        print(routing.names("Muon"))  # ['2.weight', '4.weight']
        print([g["name"] for g in routing.adamw_groups])  # ['embeddings', 'head', 'norms_and_biases']
        print(routing.plain_table(width=100))  # lightning_muon routing: the table, reasons wrapped
        ```
    """

    #: Every trainable parameter's route (name, shape, optimizer, group, reason, the rule that decided), in the
    #: model's order.
    routes: list[Route]
    #: The routed parameters by name.
    params: dict[str, Tensor]
    #: Where output heads and input layers came from, for people (the table's last lines say it).
    roles_from: str = "names and structure (no training batch seen)"
    #: Each group's own settings by group name (``{"embeddings": {"lr": 0.01}}``), put into its param group, where
    #: they take precedence over the optimizer's defaults (`route_parameters`' ``group_settings``).
    group_settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def groups(self, optimizer: str) -> list[dict[str, Any]]:
        """Param groups for ``optimizer`` (``"Muon"`` or ``"AdamW"``), non-empty, in a fixed order.

        Each group is ``{"name": ..., "params": [(param_name, tensor), ...]}``,
        which every ``torch.optim.Optimizer`` accepts (it keeps the names as
        ``param_names``); a Muon group with stacked or ``in x out`` matrices also has
        ``"matrix_layouts"``, one per parameter, and one with fused projections split into blocks
        ``"matrix_blocks"``; a group with `group_settings` has them too (``"lr"``, ``"weight_decay"``, ...).
        """
        algorithm = Algorithm(optimizer)
        groups: list[dict[str, Any]] = []
        for group in _GROUP_ORDER[algorithm]:
            routes = [r for r in self.routes if r.optimizer is algorithm and r.group == group]
            if not routes:
                continue
            groups.append({NAME: group.value, "params": [(r.name, self.params[r.name]) for r in routes],
                           **group_setting_values(self.group_settings.get(group.value, {}))})
            if any(r.layout != "flatten" for r in routes):  # only where needed: plain groups stay as they were
                groups[-1][MATRIX_LAYOUTS] = [r.layout for r in routes]
            if any(r.blocks for r in routes):
                groups[-1][MATRIX_BLOCKS] = [list(r.blocks) if r.blocks else None for r in routes]
        return groups

    @property
    def muon_groups(self) -> list[dict[str, Any]]:
        """The param groups for the Muon optimizer (``groups("Muon")``): ``hidden``, with each parameter's
        ``matrix_layouts`` and ``matrix_blocks`` where it needs them."""
        return self.groups(Algorithm.MUON)

    @property
    def adamw_groups(self) -> list[dict[str, Any]]:
        """The param groups for the AdamW optimizer (``groups("AdamW")``): one per group that has parameters,
        named (``embeddings``, ``input``, ``head``, ``norms_and_biases``, ...), so each can take its own lr."""
        return self.groups(Algorithm.ADAMW)

    def names(self, optimizer: str) -> list[str]:
        """The names of the parameters routed to ``optimizer``, in group order."""
        return [name for group in self.groups(optimizer) for name, _ in group["params"]]

    def all_on_adamw(self, why: str) -> Routing:
        """The same routes with every Muon parameter on AdamW instead (the ``muon=None`` baseline), so the
        table shows where parameters really go; their group stays ``hidden``."""
        moved = [
            replace(r, optimizer=Algorithm.ADAMW, reason=f"{r.reason}; {why}", layout="flatten", blocks=None)
            if r.optimizer is Algorithm.MUON else r
            for r in self.routes
        ]
        return replace(self, routes=moved)

    # The table (`lightning_muon.routing._table`).

    def rich_table(self, effective_lr: Callable[[Route], float | None] | None = None) -> Any:
        """A ``rich.table.Table`` (rich installed): parameter, shape, optimizer, group, reason, the rule that
        decided (and effective lr); each group's own settings close it."""
        return _table.rich_table(self.routes, self.roles_from, effective_lr, self.group_settings)

    def plain_table(self, effective_lr: Callable[[Route], float | None] | None = None, width: int | None = None) -> str:
        """The table in aligned plain-text columns (what `render` gives without rich); with ``width``, each reason
        wraps onto more lines so that the rows fit that many columns."""
        return _table.plain_table(self.routes, self.roles_from, effective_lr, width, self.group_settings)

    def render(self, effective_lr: Callable[[Route], float | None] | None = None, width: int = 140) -> str:
        """The table as plain text in ``width`` columns: drawn by rich when it is installed, else `plain_table`
        (its reasons wrapped)."""
        return _table.render(self.routes, self.roles_from, effective_lr, width, self.group_settings)

    def __str__(self) -> str:
        return self.render()
