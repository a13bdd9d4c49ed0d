"""Checkpoints of a `MuonMixin` fit: the routing they record and the check that a resumed model still matches
it, the roles they give back (before a distributed checkpoint's optimizer states load), errors that say what is
wrong with an unreadable file, and the FSDP2-to-one-file conversion.

Optimizer states are matched to parameters by position, so resuming with a
different routing (other patterns, another Muon class, a changed model) would
load every state into the wrong parameter without an error. Checkpoints hold
the parameter names of each optimizer; loading compares them and refuses,
listing every difference.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable, Collection
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_muon.lightning._pair import saved_added_members
from lightning_muon.routing import ADAMW, MUON, GraphRoles, Routing

#: The checkpoint entry lightning_muon writes.
CHECKPOINT_KEY = "lightning_muon"


def optimizer_names(routing: Routing) -> dict[str, list[str]]:
    """The parameter names each optimizer holds, in order, from where the parameters really go
    (`MuonMixin.muon_routing`: all on AdamW, ``hidden`` group first, for ``muon=None``)."""
    return {MUON: routing.names(MUON), ADAMW: routing.names(ADAMW)}


def record(routing: Routing, roles: GraphRoles | None, loop_state: dict[str, int], settings: dict[str, Any],
           pair: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint holds under `CHECKPOINT_KEY`: each optimizer's parameter names by the routing, every
    routed parameter's shape, the first batch's roles (where one was seen), the update loop's counters, the
    mixin's settings as plain data (``settings``, `MuonConfig.to_hparams`), and the groups the fit's optimizers
    really hold with the names of those added during the fit (``pair``: `OptimizerPair.record`)."""
    saved: dict[str, Any] = {
        "routing": optimizer_names(routing),
        "shapes": {r.name: list(r.shape) for r in routing.routes},
        "settings": settings,
        **loop_state,
        **(pair or {}),
    }
    if roles is not None:
        saved["roles"] = roles.to_dict()
    return saved


def check_resume(saved: dict[str, Any], routing: Routing, module: nn.Module, restores_groups: bool = False) -> None:
    """Refuse a resume whose model (`check_same_model`) or routing (`check_routing`) differs from the saved;
    ``routing`` is ``module``'s. Parameters that a finetuning callback unfroze and added to the optimizers during
    the saved fit, frozen again by its ``setup`` (Lightning issue #21901), are taken as the checkpoint's where the
    fit has that callback to give their groups back (``restores_groups``; MuonMixin then makes them trainable
    again, `lightning_muon.lightning._finetuning.restore_unfrozen`); without it the resume is refused."""
    current = optimizer_names(routing)
    named = dict(module.named_parameters())
    frozen = {n for n, p in named.items() if not p.requires_grad}
    refrozen = frozen & saved_added_members(saved)
    if refrozen and not restores_groups:
        raise MisconfigurationException(
            f"This checkpoint was saved after a finetuning callback unfroze {len(refrozen)} parameter(s) and added "
            f"them to the optimizers ({_some(sorted(refrozen))}); they are frozen "
            "in this model, and this fit has no BaseFinetuning callback holding their param groups to give them "
            "back (or its strategy restores callbacks only after the optimizers are set up). Resume with the "
            "finetuning callback the checkpoint was trained with, on a one-process or DDP strategy (MuonMixin makes "
            "what it unfroze trainable again), or start a new fit from these weights "
            "(model.load_state_dict(torch.load(path)['state_dict'])) without ckpt_path."
        )
    shapes = {r.name: r.shape for r in routing.routes} | {n: tuple(named[n].shape) for n in refrozen}
    with_refrozen = {o: current[o] + [n for n in saved["routing"][o] if n in refrozen] for o in (MUON, ADAMW)}
    check_same_model(saved, with_refrozen, shapes, frozen - refrozen)
    check_routing({**saved, "routing": {o: [n for n in saved["routing"][o] if n not in refrozen]
                                        for o in (MUON, ADAMW)}}, current)


def check_group_settings(saved: dict[str, Any], group_settings: dict[str, dict[str, Any]]) -> None:
    """Refuse a resume whose ``group_settings`` differ from those the checkpoint (its record, ``saved``) was trained
    with: torch's ``load_state_dict`` gives the optimizers the saved param groups' settings, so the new ones would
    not apply (and a scheduler's base lrs come from the checkpoint too). Records without settings pass."""
    settings = saved.get("settings")
    if not isinstance(settings, dict):
        return
    then = settings.get("group_settings") or {}
    if then != group_settings:
        raise MisconfigurationException(
            f"This checkpoint was trained with group_settings={then!r}; this fit gives group_settings="
            f"{group_settings!r}. A resume restores each param group's settings (and its scheduler's base lrs) from "
            "the checkpoint, so the new ones would not apply. Resume with the checkpoint's group_settings, or start "
            "a new fit from these weights (model.load_state_dict(torch.load(path)['state_dict'])) without ckpt_path."
        )


def _some(names: list[str], limit: int = 5) -> str:
    """At most ``limit`` of ``names``, comma-separated, then how many more there are."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def routing_differences(saved: dict[str, list[str]], current: dict[str, list[str]]) -> list[str]:
    """One line per parameter that moved between optimizers, and one per optimizer whose order changed."""
    differences = []
    for optimizer in (MUON, ADAMW):
        then, now = set(saved[optimizer]), set(current[optimizer])
        differences += [f"  {name}: was on {optimizer}, not now" for name in sorted(then - now)]
        differences += [f"  {name}: now on {optimizer}, was not" for name in sorted(now - then)]
        if then == now and saved[optimizer] != current[optimizer]:
            differences.append(f"  {optimizer}: the same parameters in a different order")
    return differences


class Change(str, Enum):
    """How a trainable parameter differs between a checkpoint and the model resuming it."""

    FROZEN = "frozen"
    REMOVED = "removed"
    ADDED = "added"
    RESHAPED = "reshaped"


def model_differences(saved: dict[str, Any], current: dict[str, list[str]],
                      shapes: dict[str, tuple[int, ...]], frozen: Collection[str] = ()) -> list[tuple[Change, str]]:
    """One ``(change, line)`` per trainable parameter added, removed, frozen (``frozen``: the model's frozen
    parameters) or reshaped since the checkpoint was saved (shapes are compared where the checkpoint recorded
    them)."""
    then = set(saved["routing"][MUON]) | set(saved["routing"][ADAMW])
    now = set(current[MUON]) | set(current[ADAMW])
    saved_shapes = {name: tuple(shape) for name, shape in saved.get("shapes", {}).items()}
    lines = [(Change.FROZEN, f"  {name}: trainable in the checkpoint, frozen in this model") if name in frozen else
             (Change.REMOVED, f"  {name}: in the checkpoint, not in this model") for name in sorted(then - now)]
    lines += [(Change.ADDED, f"  {name}: in this model, not in the checkpoint") for name in sorted(now - then)]
    lines += [
        (Change.RESHAPED, f"  {name}: {_dims(saved_shapes[name])} in the checkpoint, {_dims(shapes[name])} in this "
                          "model")
        for name in sorted(then & now) if name in saved_shapes and name in shapes and saved_shapes[name] != shapes[name]
    ]
    return lines


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def check_same_model(saved: dict[str, Any], current: dict[str, list[str]],
                     shapes: dict[str, tuple[int, ...]] | None = None, frozen: Collection[str] = ()) -> None:
    """Refuse a resume whose model has other trainable parameters (or other shapes) than the one that saved the
    checkpoint (built with other arguments, or another version of its code): that is not a routing choice, and
    the routing check would say it is."""
    differences = model_differences(saved, current, shapes or {}, frozen)
    if not differences:
        return
    lines = [line for _, line in differences]
    if any(change is Change.FROZEN for change, _ in differences):
        raise MisconfigurationException(
            "This checkpoint was saved with parameters trainable that are frozen in this model, and in no param "
            f"group a finetuning callback added during the fit:\n{first_lines(lines, 20)}\nFreeze the model as it "
            "was when the checkpoint was saved (a callback that unfreezes with unfreeze_and_add_param_group is "
            "resumed from; one that only sets requires_grad is not), or start a new fit from these weights "
            "(model.load_state_dict(torch.load(path)['state_dict'])) with the parameters unfrozen."
        )
    raise MisconfigurationException(
        "This checkpoint was saved by a model with other trainable parameters than this one: it was built "
        f"differently, which no routing choice explains. Differences:\n{first_lines(lines, 20)}\nBuild the model as "
        "it was when the checkpoint was saved (its hyperparameters are in checkpoint['hyper_parameters'])."
    )


def first_lines(lines: list[str], limit: int) -> str:
    """At most ``limit`` of ``lines``, then how many more there are."""
    return "\n".join(lines[:limit]) + (f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else "")


def check_routing(saved: dict[str, Any], current: dict[str, list[str]]) -> None:
    """Refuse a checkpoint whose optimizer states were saved with another routing."""
    differences = routing_differences(saved["routing"], current)
    if differences:
        raise MisconfigurationException(
            "This checkpoint's optimizer states were saved with a different routing, so they would be "
            "loaded into the wrong parameters. Differences:\n" + "\n".join(differences) + "\n"
            "Resume with the muon_params/adamw_params (and muon class) the checkpoint was trained with."
        )


def saved_record(checkpoint: dict[str, Any], resuming: bool) -> dict[str, Any] | None:
    """The checkpoint's `record` (``None`` where it has none); a fit ``resuming`` from a checkpoint with optimizer
    states but no record is refused (`refuse_foreign_optimizer_states`)."""
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None and resuming:
        refuse_foreign_optimizer_states(checkpoint)
    return saved


def refuse_foreign_optimizer_states(checkpoint: dict[str, Any]) -> None:
    """A fit resuming from a checkpoint with optimizer states but no routing record: refuse, with the way to
    start from its weights with fresh optimizers (its states belong to another module's optimizers)."""
    states = checkpoint.get("optimizer_states") or []
    if not states:
        return
    raise MisconfigurationException(
        f"This checkpoint holds {len(states)} optimizer state(s) but no MuonMixin routing record: it was saved by a "
        "module without MuonMixin, so its states cannot be matched to Muon and AdamW. To start from its weights "
        "with fresh optimizers, load them and fit without ckpt_path:\n"
        "    model.load_state_dict(torch.load(path, weights_only=True)['state_dict'])\n"
        "    trainer.fit(model)"
    )


def naming_unreadable_files(load: Callable[..., Any], strategy_name: str, by_order: bool = False) -> Callable[..., Any]:
    """``load`` (strategy ``strategy_name``'s ``load_checkpoint``), saying what is wrong with the file and what to
    do instead of torch's bare errors: an empty or truncated file (a run stopped while saving it), an FSDP2
    checkpoint directory on a strategy that reads one file, and, before loading it, a one-file checkpoint with
    optimizer states on a strategy that maps each optimizer's states onto the model's parameters in order
    (``by_order``: FSDP2's, which does not hold for Muon + AdamW). The fit's ``ckpt_path`` is loaded by
    ``strategy.load_checkpoint`` before any module hook runs, hence a wrapper."""
    name = strategy_name

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if by_order and _file_with_optimizer_states(checkpoint_path):
            raise RuntimeError(
                f"{checkpoint_path} holds one process's (or DDP's) optimizer states, by position; {name} "
                "maps each optimizer's states onto the model's parameters in order, which does not hold for "
                "Muon + AdamW. Resume it with one process or DDP, or start the FSDP2 fit from its weights "
                "with fresh optimizers (load its state_dict into the model before fully_shard, fit without "
                "ckpt_path)."
            )
        try:
            return load(checkpoint_path, *args, **kwargs)
        except IsADirectoryError as error:
            raise RuntimeError(
                f"{checkpoint_path} is a distributed checkpoint (a directory torch.distributed.checkpoint wrote "
                f"under FSDP2); {name} reads a single file. Convert it into one: `lightning-muon "
                f"convert-checkpoint {checkpoint_path} last.ckpt`, then resume from last.ckpt; or resume it with "
                "the strategy that saved it (ModelParallelStrategy with fully_shard in configure_model)."
            ) from error
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:
            if not os.path.isfile(checkpoint_path):
                raise
            if not zipfile.is_zipfile(checkpoint_path):
                size = os.path.getsize(checkpoint_path)
                raise RuntimeError(
                    f"{checkpoint_path} is not a complete checkpoint ({size:,} bytes; {type(error).__name__}: "
                    f"{error}). It is empty or truncated (a run stopped while saving it?): resume from another "
                    "checkpoint, or fit without ckpt_path."
                ) from error
            raise

    return load_checkpoint


def _file_with_optimizer_states(path: Any) -> bool:
    """Whether ``path`` is a complete one-file checkpoint holding optimizer states (read memory-mapped)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path) or not zipfile.is_zipfile(path):
        return False
    return bool(torch.load(path, map_location="cpu", mmap=True, weights_only=False).get("optimizer_states"))


def consolidate(directory: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Turn an FSDP2 distributed checkpoint (the directory ``ModelParallelStrategy`` saves) into one file that a
    one-process or DDP fit resumes from: whole tensors, and each optimizer's states keyed by position again.

    ``torch.distributed.checkpoint``'s ``dcp_to_torch_save`` gathers the tensors; Lightning keeps the rest of the
    checkpoint (loops, schedulers, this package's routing record) in ``meta.pt`` beside them.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory, out = Path(directory), Path(out)
    if not (directory / "meta.pt").is_file():
        raise ValueError(f"{directory} is not a ModelParallelStrategy (FSDP2) checkpoint directory: it has no meta.pt")
    with tempfile.TemporaryDirectory() as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(directory, whole)
        tensors = torch.load(whole, map_location="cpu", weights_only=False)
    checkpoint = torch.load(directory / "meta.pt", map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = tensors["state_dict"]
    names = sorted((k for k in tensors if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_by_position(tensors[k]) for k in names]
    torch.save(checkpoint, out)
    return out


def _by_position(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (distributed checkpoints) keyed by position (torch's)."""
    index: dict[str, int] = {}
    groups = []
    for group in optimizer_state["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    state = {index[name]: value for name, value in optimizer_state["state"].items()}
    return {"state": state, "param_groups": groups}


def saved_roles(saved: dict[str, Any], resuming: bool, stepped: bool = True) -> GraphRoles | None:
    """The roles a checkpoint's record (``checkpoint["lightning_muon"]``) trained with. A resumed fit whose
    checkpoint has none (saved before a first batch was followed) keeps the structural routing its optimizer states
    were saved with (empty roles), or, where they are empty (not ``stepped``: saved before any update, as the
    batch-size finder saves), follows its next first batch (``None``); a load without a fit, ``None``. Records
    written before the key was ``"roles"`` say ``"graph"``."""
    data = saved.get("roles", saved.get("graph"))
    if data is not None:
        return GraphRoles.from_dict(data)
    return GraphRoles() if resuming and stepped else None


def stepped(checkpoint: dict[str, Any]) -> bool:
    """Whether a checkpoint's optimizers had stepped (hold states), as far as the checkpoint shows: a distributed
    checkpoint's ``meta.pt`` holds no optimizer states, and is taken as stepped."""
    states = checkpoint.get("optimizer_states")
    return states is None or any(s.get("state") for s in states)


def restore_record_first(load: Callable[..., Any], load_record: Callable[[dict[str, Any]], None]) -> Callable[..., Any]:
    """``load`` (a strategy's ``load_checkpoint``), giving a distributed checkpoint's record to ``load_record``
    before it reads the file: a directory's optimizer states load into the optimizers as they stand, so they must
    hold the checkpoint's routing and groups first (its ``meta.pt`` has the record). One-file checkpoints are left
    alone."""

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        meta = Path(checkpoint_path) / "meta.pt" if isinstance(checkpoint_path, (str, Path)) else None
        if meta is not None and meta.is_file():
            saved = torch.load(meta, map_location="cpu", weights_only=False).get(CHECKPOINT_KEY)
            if saved is not None:
                load_record(saved)
        return load(checkpoint_path, *args, **kwargs)

    return load_checkpoint
