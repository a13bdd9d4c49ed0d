"""Checkpoints of a `MuonMixin` fit: the routing they record and the check that a resumed model still matches
it, errors that say what is wrong with an unreadable file, and the FSDP2-to-one-file conversion.

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
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.optim import Optimizer

from lightning_muon.lightning._unfreezing import GROUP_PREFIX
from lightning_muon.routing import ADAMW, MUON, GraphRoles, Routing

#: The checkpoint entry lightning_muon writes.
CHECKPOINT_KEY = "lightning_muon"


def optimizer_names(routing: Routing) -> dict[str, list[str]]:
    """The parameter names each optimizer holds, in order, from where the parameters really go
    (`MuonMixin.muon_routing`: all on AdamW, ``hidden`` group first, for ``muon=None``)."""
    return {MUON: routing.names(MUON), ADAMW: routing.names(ADAMW)}


def optimizer_groups(optimizers: Iterable[Optimizer]) -> list[list[list[Any]]]:
    """What each optimizer holds, in order: ``[group name, [parameter names]]`` per group (the positions its
    state is saved by)."""
    return [[[g.get("name"), list(g.get("param_names", []))] for g in o.param_groups] for o in optimizers]


def record(routing: Routing, roles: GraphRoles | None, loop_state: dict[str, int], settings: dict[str, Any],
           optimizers: list[Optimizer] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint holds under `CHECKPOINT_KEY`: each optimizer's parameter names by the routing, every
    routed parameter's shape, the first batch's roles (where one was seen), the update loop's counters, the
    mixin's settings as plain data (``settings``, `MuonConfig.to_hparams`), the groups the optimizers really
    hold (``optimizers``: the fit's; groups a finetuning callback added included) and the fit's ``extra``
    (`FitState.record`)."""
    saved: dict[str, Any] = {
        "routing": optimizer_names(routing),
        "shapes": {r.name: list(r.shape) for r in routing.routes},
        "settings": settings,
        **loop_state,
        **(extra or {}),
    }
    if roles is not None:
        saved["roles"] = roles.to_dict()
    if optimizers:
        saved["groups"] = optimizer_groups(optimizers)
    return saved


def unfrozen_names(saved: dict[str, Any]) -> set[str]:
    """The parameters the checkpoint's optimizers held in groups a finetuning callback added during the fit."""
    return {n for groups in saved.get("groups", []) for name, names in groups
            if str(name).startswith(GROUP_PREFIX) for n in names}


def check_resume(saved: dict[str, Any], routing: Routing, module: nn.Module, restores_groups: bool = False) -> None:
    """Refuse a resume whose model (`check_same_model`) or routing (`check_routing`) differs from the saved;
    ``routing`` is ``module``'s. Parameters that a finetuning callback unfroze and added to the optimizers during
    the saved fit, frozen again by its ``setup`` (Lightning issue #21901), are taken as the checkpoint's where the
    fit has that callback to give their groups back (``restores_groups``; MuonMixin then makes them trainable
    again, `lightning_muon.lightning._finetuning.restore_unfrozen`); without it the resume is refused."""
    current = optimizer_names(routing)
    named = dict(module.named_parameters())
    frozen = {n for n, p in named.items() if not p.requires_grad}
    refrozen = frozen & unfrozen_names(saved)
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


def check_groups(saved: dict[str, Any], optimizers: list[Optimizer], algorithms: list[str]) -> None:
    """Refuse a resumed fit whose optimizers (``algorithms``: which each is) hold other param groups than the
    checkpoint's optimizer states were saved with (they load by position); checkpoints without the record pass."""
    then, now = saved.get("groups"), optimizer_groups(optimizers)
    if then is None or then == now:
        return
    count = max(len(then), len(now))
    then, now = then + [[]] * (count - len(then)), now + [[]] * (count - len(now))
    names = [*algorithms, *(f"optimizer {i}" for i in range(len(algorithms), count))]
    lines = [f"  {name}: {_describe(a)} in the checkpoint, {_describe(b)} now" if _describe(a) != _describe(b)
             else f"  {name}: {_describe(a)}, with other parameters or in another order"
             for name, a, b in zip(names, then, now, strict=False) if a != b]
    added = sorted({str(name) for groups in then for name, _ in groups if str(name).startswith(GROUP_PREFIX)}
                   - {str(name) for groups in now for name, _ in groups})
    fix = (f"The checkpoint's groups {added} were added during the fit by a finetuning callback, and only that "
           "callback gives them back: resume with the finetuning callback the checkpoint was trained with (the same "
           "class and arguments)." if added else
           "Resume with the callbacks the checkpoint was trained with (a BaseFinetuning callback gives back the "
           "groups it added) and the same muon_params/adamw_params.")
    raise MisconfigurationException(
        "The optimizers of this resumed fit hold other param groups than the checkpoint's optimizer states were "
        f"saved with, so the states would load into the wrong parameters:\n{first_lines(lines, 10)}\n{fix}"
    )


def _describe(groups: list[list[Any]]) -> str:
    """``[hidden: 2, unfrozen_1: 1]``: each group's name and how many parameters it holds."""
    return "[" + ", ".join(f"{name}: {len(names)}" for name, names in groups) + "]"


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


def model_differences(saved: dict[str, Any], current: dict[str, list[str]],
                      shapes: dict[str, tuple[int, ...]], frozen: Collection[str] = ()) -> list[str]:
    """One line per trainable parameter added, removed, frozen (``frozen``: the model's frozen parameters) or
    reshaped since the checkpoint was saved (shapes are compared where the checkpoint recorded them)."""
    then = set(saved["routing"][MUON]) | set(saved["routing"][ADAMW])
    now = set(current[MUON]) | set(current[ADAMW])
    saved_shapes = {name: tuple(shape) for name, shape in saved.get("shapes", {}).items()}
    lines = [f"  {name}: trainable in the checkpoint, frozen in this model" if name in frozen else
             f"  {name}: in the checkpoint, not in this model" for name in sorted(then - now)]
    lines += [f"  {name}: in this model, not in the checkpoint" for name in sorted(now - then)]
    lines += [
        f"  {name}: {_dims(saved_shapes[name])} in the checkpoint, {_dims(shapes[name])} in this model"
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
    lines = model_differences(saved, current, shapes or {}, frozen)
    if not lines:
        return
    if any("frozen in this model" in line for line in lines):
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


def naming_unreadable_files(load: Callable[..., Any], strategy_name: str) -> Callable[..., Any]:
    """``load`` (strategy ``strategy_name``'s ``load_checkpoint``), saying what is wrong with the file and what to
    do instead of torch's bare errors: an empty or truncated file (a run stopped while saving it), an FSDP2
    checkpoint directory on a strategy that reads one file, a one-file checkpoint under FSDP2 (Lightning maps each
    optimizer's states onto the model's parameters in order, which does not hold for Muon + AdamW). The fit's
    ``ckpt_path`` is loaded by ``strategy.load_checkpoint`` before any module hook runs, hence a wrapper."""
    name = strategy_name

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
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
            if "Missing optimizer state for parameter" in str(error):
                raise RuntimeError(
                    f"{checkpoint_path} holds one process's (or DDP's) optimizer states, by position; {name} "
                    "maps each optimizer's states onto the model's parameters in order, which does not hold for "
                    "Muon + AdamW. Resume it with one process or DDP, or start the FSDP2 fit from its weights "
                    "with fresh optimizers (load its state_dict into the model before fully_shard, fit without "
                    "ckpt_path)."
                ) from error
            raise

    return load_checkpoint


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
