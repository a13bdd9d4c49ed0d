"""`OptimizerPair`: a fit's optimizers (Muon's first, then AdamW's) and where each of their param groups came from.

A group is one of four origins (`Origin`), recorded as data, never read from its name:

- **routed**: a group of the routing (``hidden``, ``head``, ...), built with the optimizers and corrected by the
  first training batch (`regroup`);
- **late**: a group of the routing that an optimizer did not hold when a later batch first reached parameters
  the first batch did not, and the routing sent them there (`place`, `lightning_muon.lightning._late`): added at the
  end of that optimizer's groups, it follows its first group through every scheduler step;
- **placeholder**: the empty group an optimizer is built with where the start of a fit with a finetuning callback
  routes nothing to it (a frozen backbone under a linear head: no matrix trains at first), so that both
  optimizers exist when the callback unfreezes something for them;
- **added**: what a finetuning callback adds during the fit (``optimizer.add_param_group``, which the pair takes
  over on its own optimizers: `accept`). The offered tensors are routed by the same rules as at the start
  (matrices to Muon, the rest to AdamW, the first batch's roles applied), one new group per optimizer under one
  name, ``unfrozen_<n>``: the optimizer offered the group gets its part at once, at the lr asked of it; each
  other optimizer's part waits until that optimizer is offered the same tensors (Lightning's ``BaseFinetuning``
  offers them to every optimizer in turn: each gets its part at the lr asked of it, in its own call, so the
  callback's record of the groups holds it), or, at the latest, until the next training batch starts
  (`add_waiting`), at the same fraction of its lr as the callback asked of the one it offered them to. The
  group's other settings go to the optimizers that have them (``weight_decay`` to both, ``betas`` to AdamW's).

The pair is the one place that builds the groups, corrects them after the first batch, places what a later batch
first reaches, accepts a group a callback adds, gives schedulers the groups they were built with
(`scheduled_groups`: the added ones keep the lr the callback gives them, the late ones follow), and records and
restores the groups in a checkpoint (`record`, `restore`): a checkpoint restored into a running fit (Lightning's
batch-size finder) gets optimizers that hold its groups before torch loads its states into them, or a refusal
that says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.lightning._late import LaterGroups, Layout, group_bases, held_tensors
from lightning_muon.lightning._schedulers import build_schedulers
from lightning_muon.optim.groups import MATRIX_BLOCKS, MATRIX_LAYOUTS, NAME, PARAM_NAMES, blocks_of, layouts_of
from lightning_muon.routing import ADAMW, MUON, Algorithm, Group, Routing

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_muon.lightning._config import MuonConfig


class Origin(str, Enum):
    """Where a param group of the pair came from (see the module's docstring)."""

    ROUTED = "routed"
    PLACEHOLDER = "placeholder"
    ADDED = "added"
    LATE = "late"


#: The name of the empty group an optimizer holds where the routing gives it nothing yet (the name the routing
#: gives Muon's matrices; AdamW's group of parameters no rule names).
PLACEHOLDER_NAMES = {MUON: Group.HIDDEN.value, ADAMW: Group.OTHER.value}
#: The name of the groups a finetuning callback adds (``unfrozen_1``, ``unfrozen_2``, ...; `MuonMonitor` logs
#: them as lr keys). The pair records which names it gave (`OptimizerPair.added`); it never parses one.
ADDED_NAME = "unfrozen_{}"
#: The keys of an offered group that the routing decides itself (the lr is scaled per optimizer).
_ROUTED_KEYS = {"params", "lr", NAME, PARAM_NAMES, MATRIX_LAYOUTS, MATRIX_BLOCKS}


def layout_of(optimizer: Optimizer) -> Layout:
    """What ``optimizer`` holds: ``[group name, [parameter names]]`` per group (the positions its states are
    saved by)."""
    return [[g.get(NAME), list(g.get(PARAM_NAMES, []))] for g in optimizer.param_groups]


def members_of(layouts: list[Layout], names: list[str]) -> dict[str, list[str]]:
    """The parameter names the groups ``names`` hold across ``layouts`` (each optimizer's `layout_of`, or a
    checkpoint's record of them), by group name, in the order of ``names``."""
    members: dict[str, list[str]] = {name: [] for name in names}
    for layout in layouts:
        for name, params in layout:
            if name in members:
                members[name].extend(params)
    return members


def placeholder_group(algorithm: str) -> dict[str, Any]:
    """The empty group an optimizer is built with where the start routes nothing to it; named, like every group of
    the pair (torch wants all groups with names or none)."""
    return {NAME: PLACEHOLDER_NAMES[algorithm], "params": [], PARAM_NAMES: []}


def added_group(routing: Routing, algorithm: str, lr: float, name: str) -> dict[str, Any]:
    """One group ``name`` at ``lr`` with ``routing``'s parameters for ``algorithm`` (empty where it has none)."""
    groups = routing.groups(algorithm)
    group: dict[str, Any] = {NAME: name, "params": [pair for g in groups for pair in g["params"]], "lr": lr}
    if not groups:
        group[PARAM_NAMES] = []
    if any(MATRIX_LAYOUTS in g for g in groups):
        group[MATRIX_LAYOUTS] = [
            layout for g in groups for layout in g.get(MATRIX_LAYOUTS, ["flatten"] * len(g["params"]))
        ]
    if any(MATRIX_BLOCKS in g for g in groups):  # fused projections split into their blocks
        group[MATRIX_BLOCKS] = [
            blocks for g in groups for blocks in g.get(MATRIX_BLOCKS, [None] * len(g["params"]))
        ]
    return group


def _tensors(params: Any) -> list[Tensor]:
    """The tensors of a param group's ``params`` (a tensor, tensors, or ``(name, tensor)`` pairs)."""
    if isinstance(params, Tensor):
        return [params]
    return [p[1] if isinstance(p, tuple) else p for p in params]


def _lr(optimizer: Optimizer) -> float:
    """An optimizer's learning rate: its first group's (its default where it holds no group)."""
    return float(optimizer.param_groups[0]["lr"] if optimizer.param_groups else optimizer.defaults["lr"])


def wanted_groups(routing: Routing, algorithms: list[str], added: dict[str, list[str]],
                  lrs: dict[tuple[str, str], float], keep_both: bool) -> dict[str, list[dict[str, Any]]]:
    """The groups each algorithm's optimizer holds under ``routing`` (``algorithms``: the fit's optimizers): the
    routing's groups (a placeholder where it has none and the fit ``keep_both``), then each added group (``added``:
    its parameter names by group name), its parameters split again by ``routing``, at the lr that optimizer's part
    has (``lrs``, by algorithm and group name): a first batch after an unfreeze keeps what it added apart."""
    in_added = {n for names in added.values() for n in names}
    base = dataclasses.replace(routing, routes=[r for r in routing.routes if r.name not in in_added])
    groups: dict[str, list[dict[str, Any]]] = {}
    for algorithm in (MUON, ADAMW):
        kept = keep_both and algorithm in algorithms
        groups[algorithm] = base.groups(algorithm) or ([placeholder_group(algorithm)] if kept else [])
        for name, names in added.items():
            mine = Routing([r for r in routing.routes if r.name in set(names)], routing.params)
            group = added_group(mine, algorithm, lrs.get((algorithm, name), 0.0), name)
            if algorithm in algorithms or group["params"]:  # (an optimizer the fit lacks: refused by the caller)
                groups[algorithm].append(group)
    return groups


def settings_for(optimizer: Optimizer, offered: dict[str, Any], optimizers: list[Optimizer]) -> dict[str, Any]:
    """The other settings of an ``offered`` group (``weight_decay``, ``betas``, ...) that ``optimizer``'s part of it
    keeps: those ``optimizer`` has (both take ``weight_decay``; only AdamW ``betas``, only Muon ``momentum``), and
    those none of the fit's ``optimizers`` has (kept in the group, as torch keeps them)."""
    known = set().union(*(o.defaults for o in optimizers))
    return {key: value for key, value in offered.items()
            if key not in _ROUTED_KEYS and (key in optimizer.defaults or key not in known)}


def next_added_name(optimizers: Iterable[Optimizer], added: int) -> str:
    """The next ``unfrozen_<n>``: one past the ``added`` groups so far (a resumed fit goes on counting), skipping any
    name a group of ``optimizers`` already has."""
    taken = {g.get(NAME) for o in optimizers for g in o.param_groups}
    number = added + 1
    while ADDED_NAME.format(number) in taken:
        number += 1
    return ADDED_NAME.format(number)


class OptimizerPair:
    """A fit's optimizers by algorithm, in order, and the origin of each of their param groups.

    Args:
        config: what the optimizers are built from (with ``parent_lr=True``: at the parent's lr).
        routing: the module's routing as it stands (what a callback unfreezes included).
        keep_both: build both optimizers even where the start routes nothing to one (a finetuning callback will
            unfreeze parameters for it), that one holding a placeholder group until then.
    """

    def __init__(self, config: MuonConfig, routing: Callable[[], Routing], keep_both: bool = False) -> None:
        self.config, self.routing, self.keep_both = config, routing, keep_both
        #: The optimizers by algorithm (`MUON`, `ADAMW`), in the order the fit holds them.
        self.optimizers: dict[str, Optimizer] = {}
        #: The names of the groups added during the fit, in order (each optimizer holds its part under the name).
        self.added: list[str] = []
        #: Parts of added groups waiting for their optimizer: (algorithm, part, the ids of every tensor of the group
        #: offered), in the order they were routed.
        self._waiting: list[tuple[str, dict[str, Any], set[int]]] = []
        #: The late groups and what later batches arranged (`place`).
        self.later = LaterGroups()

    # ------------------------------------------------------------------ building

    def build(self, routing: Routing) -> dict[str, Optimizer]:
        """The optimizers over ``routing``'s groups, by algorithm (Muon's first), each only where it has parameters
        (AdamW where nothing has: a model whose every parameter is frozen is refused before) or, with
        ``keep_both``, each with a placeholder where it has none. Says once what is left without an optimizer."""
        config = self.config
        if routing.muon_groups or self.keep_both:
            self.optimizers[MUON] = config.build(Algorithm.MUON, routing.muon_groups or [placeholder_group(MUON)])
        elif config.muon_enabled:
            rank_zero_warn("MuonMixin: no parameter was routed to Muon; only AdamW will train this model.")
        if routing.adamw_groups or self.keep_both:
            self.optimizers[ADAMW] = config.build_adamw(routing.adamw_groups or [placeholder_group(ADAMW)])
        else:  # every trainable parameter is a hidden matrix (LoRA adapters, a frozen model's blocks)
            rank_zero_info("MuonMixin: no parameter was routed to AdamW; Muon alone trains this model.")
        for algorithm in (MUON, ADAMW):
            if self.keep_both and not routing.groups(algorithm):
                rank_zero_info(f"MuonMixin: no parameter is routed to {algorithm} yet: it holds an empty group until "
                               "a finetuning callback unfreezes parameters for it.")
        for algorithm, optimizer in self.optimizers.items():
            # The pair's own optimizers only: what a finetuning callback offers either is routed (`accept`).
            optimizer.add_param_group = functools.partial(self.accept, algorithm)  # type: ignore[method-assign]
        return self.optimizers

    @property
    def algorithms(self) -> list[str]:
        """Which algorithm each of the fit's optimizers is, in order."""
        return list(self.optimizers)

    def origin(self, group: dict[str, Any], algorithm: str | None = None) -> Origin:
        """Where ``group`` (one of the pair's; of the ``algorithm`` optimizer, where it may be a late one) came
        from."""
        if group.get(NAME) in self.added:
            return Origin.ADDED
        if self.later.is_late(algorithm, group):
            return Origin.LATE
        return Origin.ROUTED if group["params"] else Origin.PLACEHOLDER

    # ------------------------------------------------------------------ the first batch

    def _wanted(self, routing: Routing) -> dict[str, list[dict[str, Any]]]:
        """`wanted_groups` with the added groups and lrs the optimizers hold."""
        lrs = {(a, g[NAME]): g["lr"] for a, o in self.optimizers.items() for g in o.param_groups}
        return wanted_groups(routing, self.algorithms, self.added_members(), lrs, self.keep_both)

    def added_members(self) -> dict[str, list[str]]:
        """Each added group's name, in order, with the names of the parameters its parts hold."""
        return members_of([layout_of(o) for o in self.optimizers.values()], self.added)

    def layouts(self) -> list[Layout]:
        """What the optimizers hold now (`layout_of` each)."""
        return [layout_of(o) for o in self.optimizers.values()]

    def _layouts_of(self, wanted: dict[str, list[dict[str, Any]]]) -> list[Layout] | None:
        """``wanted``'s groups as the fit's optimizers would hold them; ``None`` where some go to an optimizer
        the fit lacks."""
        if any(wanted[a] for a in (MUON, ADAMW) if a not in self.optimizers):
            return None
        return [[[g[NAME], [n for n, _ in g["params"]]] for g in wanted[a]] for a in self.optimizers]

    def holds(self, routing: Routing) -> bool:
        """Whether the optimizers hold ``routing``'s groups (`wanted_groups`)."""
        return self.layouts() == self._layouts_of(self._wanted(routing))

    def regroup(self, trainer: pl.Trainer, routing: Routing, keep_both: bool = False) -> None:
        """Give the optimizers (which hold no state yet) ``routing``'s groups (`wanted_groups`), in place, and
        build their schedulers again for the groups they were built with. The optimizer objects stay the same
        (callbacks may hold them); one left without parameters steps nothing, or, with ``keep_both`` (a later batch
        may place parameters in it), holds a placeholder group whose settings its schedulers move."""
        if any(o.state for o in self.optimizers.values()):
            raise RuntimeError("lightning_muon: the routing can only be corrected before the optimizers' first step")
        # The tensors the optimizers hold, by name: during a training step FSDP2's modules hold unsharded copies of
        # their parameters, while the optimizers must keep the sharded ones they were built with.
        held = held_tensors(self.optimizers.values())
        routed = {r.name for r in routing.routes}
        if set(held) != routed:
            raise _trainables_changed(set(held), routed)
        wanted = self._wanted(routing)
        if keep_both and not self.keep_both:
            self.later.keep(wanted, placeholder_group, self.optimizers)
        self._set_groups(trainer, wanted, held, routing)

    # ------------------------------------------------------------------ what a later batch first reaches

    def place(self, routing: Routing) -> list[str]:
        """Make the optimizers hold ``routing``'s groups where it moves parameters that hold no optimizer state (a
        later batch first reached them: moving them costs nothing), as `LaterGroups.place` does; returns the moved
        parameters' names. Their optimizers must exist in the fit (the caller keeps parameters for a missing one in
        place)."""
        held = held_tensors(self.optimizers.values())
        # (what the optimizers do not hold yet, such as a parameter unfrozen by hand, stays out of them)
        wanted = self._wanted(dataclasses.replace(routing, routes=[r for r in routing.routes if r.name in held]))
        return self.later.place(self.optimizers, wanted, self._build, self.config.group_settings)

    def _build(self, algorithm: str, groups: list[dict[str, Any]]) -> Optimizer:
        """An optimizer of ``algorithm`` over ``groups``, built as the config builds the fit's (to read groups from)."""
        if algorithm == ADAMW:
            return self.config.build_adamw(groups)
        return self.config.build(Algorithm.MUON, groups)

    def _set_groups(self, trainer: pl.Trainer, wanted: dict[str, list[dict[str, Any]]], held: dict[str, Tensor],
                    routing: Routing) -> None:
        """Make each optimizer hold ``wanted``'s groups over the tensors ``held`` (by name), built as the config
        builds them, and build the schedulers again."""
        groups = {a: [{**g, "params": [(n, held[n]) for n, _ in g["params"]]} for g in wanted[a]] for a in wanted}
        for algorithm in (MUON, ADAMW):
            if any(g["params"] for g in groups[algorithm]) and algorithm not in self.optimizers:
                raise MisconfigurationException(
                    f"The first training batch routed parameters to {algorithm} where the structural rules had "
                    f"routed none, so the fit has no {algorithm} optimizer to give them: {routing.names(algorithm)}. "
                    "Decide them with MuonMixin(muon_params=[...]) or adamw_params=[...] (or use muon=None for AdamW "
                    "alone)."
                )
        for algorithm, optimizer in self.optimizers.items():
            optimizer.param_groups[:] = self._build(algorithm, groups[algorithm]).param_groups if groups[algorithm] \
                else []
        if not self.config.scheduled:
            return
        with contextlib.ExitStack() as built_groups_only:
            for optimizer in self.optimizers.values():
                built_groups_only.enter_context(self.scheduled_groups(optimizer))
            rebuilt = build_schedulers(self.config.scheduler_factories, self.optimizers,
                                       lambda: trainer.estimated_stepping_batches)
        for scheduler_config, built_config in zip(trainer.lr_scheduler_configs, rebuilt, strict=True):
            scheduler_config.scheduler = built_config["scheduler"]

    # ------------------------------------------------------------------ groups a callback adds

    def accept(self, algorithm: str, group: dict[str, Any]) -> None:
        """``add_param_group`` of the pair's ``algorithm`` optimizer: route the offered ``group`` (see the module's
        docstring)."""
        given = self.optimizers[algorithm]
        offered = _tensors(group["params"])
        asked = float(group.get("lr", _lr(given)))
        for waiting in [w for w in self._waiting if w[0] == algorithm]:  # its part of a group offered to another
            if any(id(p) in waiting[2] for p in offered):
                self._waiting.remove(waiting)
                self._add(algorithm, {**waiting[1], "lr": asked, **self._settings(given, group)})
        held = {id(p) for o in self.optimizers.values() for g in o.param_groups for p in g["params"]}
        waiting_ids = {i for _, _, ids in self._waiting for i in ids}
        new = [p for p in offered if id(p) not in held and id(p) not in waiting_ids]
        if not new:
            return  # routed when another optimizer was offered the same tensors
        now = self.routing()
        by_id = {id(now.params[r.name]): r for r in now.routes}
        strangers = [tuple(p.shape) for p in new if id(p) not in by_id]
        if strangers:
            raise _strangers_refused(strangers)
        routes = [by_id[id(p)] for p in new]
        missing = sorted({str(r.optimizer) for r in routes} - set(self.optimizers))
        if missing:
            raise _no_optimizer_for(missing[0], [r.name for r in routes if str(r.optimizer) == missing[0]])
        name = next_added_name(self.optimizers.values(), len(self.added))
        self.added.append(name)
        ratio = asked / _lr(given)
        for other, optimizer in self.optimizers.items():
            mine = Routing([r for r in routes if r.optimizer == other], now.params)
            part = {**added_group(mine, other, asked if other == algorithm else ratio * _lr(optimizer), name),
                    **self._settings(optimizer, group)}
            if other == algorithm:
                self._add(other, part)
            else:
                self._waiting.append((other, part, {id(p) for p in new}))

    def add_waiting(self) -> None:
        """Give every optimizer its part of the groups added to another (a callback that offered them to one
        optimizer only): before the next training batch, so that no unfrozen tensor misses an update."""
        waiting, self._waiting = self._waiting, []
        for algorithm, group, _ in waiting:
            self._add(algorithm, group)

    def _add(self, algorithm: str, group: dict[str, Any]) -> None:
        type(self.optimizers[algorithm]).add_param_group(self.optimizers[algorithm], group)

    def _settings(self, optimizer: Optimizer, offered: dict[str, Any]) -> dict[str, Any]:
        return settings_for(optimizer, offered, list(self.optimizers.values()))

    @contextlib.contextmanager
    def scheduled_groups(self, optimizer: Optimizer) -> Iterator[None]:
        """``optimizer`` showing only the groups it was built with (those before its first added or late group)
        while a scheduler steps it: the finetuning callback owns the added groups' lr; the late groups then take
        the settings the scheduler gave the first group."""
        groups = optimizer.param_groups
        algorithm = next((a for a, o in self.optimizers.items() if o is optimizer), None)
        built = next((i for i, g in enumerate(groups) if self.origin(g, algorithm) in (Origin.ADDED, Origin.LATE)),
                     len(groups))
        if built == len(groups):  # nothing added: the optimizer as it is (every scheduler step comes here)
            yield
            return
        optimizer.param_groups = groups[:built]  # the same group dicts: what the scheduler sets, they keep
        try:
            yield
        finally:
            optimizer.param_groups = groups
            self.later.follow(algorithm, groups, group_bases(optimizer.defaults, self.config.group_settings))

    # ------------------------------------------------------------------ checkpoints

    def record(self) -> dict[str, Any]:
        """What a checkpoint records of the pair: each optimizer's groups (`layout_of`), the added groups' names
        and, where later batches arranged the groups, the late groups' by algorithm (`LaterGroups.record`)."""
        return {"groups": self.layouts(), "added_groups": list(self.added), **self.later.record()}

    def restore(self, trainer: pl.Trainer, saved: dict[str, Any], routing: Routing) -> None:
        """Make the optimizers hold the groups a checkpoint's record (``saved``) was saved with, before its optimizer
        states load into them, where ``routing`` (the module's, with the checkpoint's roles) gives those groups:
        the states the checkpoint holds replace any the optimizers have. A checkpoint whose groups this fit cannot
        hold is refused, naming the differences. Records without groups pass."""
        then = saved.get("groups")
        if then is None:
            return
        self.added = saved_added(saved)
        self.later.restore(saved)
        self._waiting = []
        # (the lrs do not matter: the checkpoint's param groups bring theirs when its states load); groups later
        # batches emptied, kept or added, where they were
        wanted = wanted_groups(routing, self.algorithms, members_of(then, self.added), {}, self.keep_both)
        wanted = self.later.arrange(wanted, self.algorithms, then)
        now = self._layouts_of(wanted)
        if now != then:
            raise _unloadable(self.algorithms, then, now, self.added)
        if self.layouts() == then:
            return
        for optimizer in self.optimizers.values():
            optimizer.state.clear()  # the checkpoint's states replace them
        self._set_groups(trainer, wanted, routing.params, routing)


def _strangers_refused(shapes: list[tuple[int, ...]]) -> MisconfigurationException:
    """The refusal of a param group a callback adds with tensors of ``shapes`` the module does not train."""
    return MisconfigurationException(
        f"A param group was added with tensors of shapes {shapes} that are no trainable parameter of "
        "the module (frozen, or not its own), so MuonMixin cannot route them. Make them trainable "
        "(requires_grad_(True)) before adding them, or add them to the module."
    )


def _no_optimizer_for(algorithm: str, names: list[str]) -> MisconfigurationException:
    """The refusal of parameters unfrozen during the fit (``names``) that go to an optimizer the fit lacks."""
    return MisconfigurationException(
        f"Parameters unfrozen during the fit go to {algorithm} by MuonMixin's rules, but the fit has no "
        f"{algorithm} optimizer (nothing was routed to it at the start): {names}. Decide them with "
        "muon_params=[...] or adamw_params=[...]."
    )


def _trainables_changed(held: set[str], routed: set[str]) -> MisconfigurationException:
    """The refusal of a first batch whose trainable parameters (``routed``) are not those the optimizers ``held``."""
    return MisconfigurationException(
        "The trainable parameters changed between building the optimizers and the first training batch: "
        f"now trainable but in no optimizer: {sorted(routed - held)[:10]}; in an optimizer but now "
        f"frozen: {sorted(held - routed)[:10]}. A hook or callback froze or unfroze them in between. "
        "Freeze before the optimizers are built (in __init__, configure_model or a callback's setup, where "
        "BaseFinetuning.freeze_before_training runs), and unfreeze during the fit with a finetuning callback "
        "(BaseFinetuning.unfreeze_and_add_param_group), which adds them to the optimizers."
    )


def _unloadable(algorithms: list[str], then: list[Layout], now: list[Layout] | None,
                added: list[str]) -> MisconfigurationException:
    """The refusal of a checkpoint whose groups (``then``) are not those this fit's optimizers would hold (``now``;
    ``None``: some would go to an optimizer the fit lacks)."""
    lines = [f"  {name}: {_describe(a)} in the checkpoint, {_describe(b)} in this fit"
             for name, a, b in zip(algorithms, then, now or [], strict=False) if a != b]
    fix = (f"The checkpoint's groups {added} were added during the fit by a finetuning callback: "
           "resume with the finetuning callback the checkpoint was trained with (the same class and "
           "arguments)." if added else
           "Resume with the model, callbacks and muon_params/adamw_params the checkpoint was saved with.")
    return MisconfigurationException(
        "This checkpoint's optimizer states were saved for other param groups than this fit's optimizers "
        "hold, so they would load into the wrong parameters:\n" + "\n".join(lines or ["  (other optimizers)"])
        + f"\n{fix}"
    )


def saved_added(saved: dict[str, Any]) -> list[str]:
    """The names of the groups added during the fit that a checkpoint's record (``saved``) was saved with. Records
    written before they named them (no ``added_groups``): the groups whose name is none of the routing's `Group`
    names (the only others those releases made were the added ones)."""
    if "added_groups" in saved:
        return list(saved["added_groups"])
    names = [str(name) for layout in saved.get("groups", []) for name, _ in layout]
    return list(dict.fromkeys(n for n in names if n not in {g.value for g in Group}))


def saved_added_members(saved: dict[str, Any]) -> set[str]:
    """The parameters a checkpoint's optimizers held in groups added during the fit."""
    members = members_of(saved.get("groups", []), saved_added(saved))
    return {n for names in members.values() for n in names}


def _describe(layout: Layout) -> str:
    """``[hidden: 2, unfrozen_1: 1]``: each group's name and how many parameters it holds."""
    return "[" + ", ".join(f"{name}: {len(names)}" for name, names in layout) + "]"



def conform_structure(pair: OptimizerPair, routing: Routing) -> None:
    """Give each Muon group the matrix structure (``matrix_layouts``, ``matrix_blocks``) ``routing`` gives its
    parameters now, where a resumed checkpoint's param groups brought another: torch's ``load_state_dict`` takes the
    saved groups' keys, so a checkpoint saved before a routing change (an LSTM's gates split, a grouped kernel per
    group, ``split_fused`` or ``matrix_blocks`` changed) would go on stepping as it was saved while the table says
    otherwise. The momentum buffers are the whole parameters' and carry over; an update rule's state shaped by the
    old layout cannot, and such a resume is refused. Said once, naming the parameters."""
    muon = pair.optimizers.get(MUON)
    if muon is None:
        return
    wanted = {g[NAME]: g for g in pair._wanted(routing).get(MUON, [])}
    changed = []
    for group in muon.param_groups:
        want = wanted.get(group.get(NAME))
        if want is not None and [n for n, _ in want["params"]] == group.get(PARAM_NAMES):
            changed += _conform_group(muon, group, want)
        # (groups the fit arranged otherwise, added or late ones, stay as they are)
    if changed:
        rank_zero_warn(
            "MuonMixin: the checkpoint's Muon param groups were saved with another matrix structure than the routing "
            f"gives now; resuming with the routing's (the momentum buffers carry over): {', '.join(changed[:10])}"
            + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
        )


def _conform_group(muon: Optimizer, group: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """`conform_structure` of one group: the parameters whose layout or blocks changed, in words."""
    layouts, blocks, new_layouts, new_blocks = layouts_of(group), blocks_of(group), layouts_of(want), blocks_of(want)
    if (layouts, blocks) == (new_layouts, new_blocks):
        return []
    changed = []
    for i, name in enumerate(group[PARAM_NAMES]):
        rule_state = sorted(k for k in muon.state.get(group["params"][i], {}) if k != "momentum_buffer")
        if layouts[i] != new_layouts[i] and rule_state:
            raise MisconfigurationException(
                f"The checkpoint's Muon state of `{name}` was made with its matrices laid out as {layouts[i]!r}; the "
                f"routing now lays them out as {new_layouts[i]!r}, and its update rule's state ({rule_state}) cannot "
                "follow. Resume with the lightning_muon version that saved it, or start a new fit from these weights."
            )
        if (layouts[i], blocks[i]) != (new_layouts[i], new_blocks[i]):
            changed.append(f"{name} (blocks {blocks[i]} -> {new_blocks[i]})")
    for key in (MATRIX_LAYOUTS, MATRIX_BLOCKS):
        if key in want:
            group[key] = list(want[key])
        else:
            group.pop(key, None)
    return changed
