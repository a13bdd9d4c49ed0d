"""What the parent's ``configure_optimizers`` would have built, against what `MuonMixin` trains with: the
one message a user gets about the replacement (INFO when only the optimizer choice differs, a warning when
schedulers or per-group settings of theirs are now ignored)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from torch.optim import Optimizer

from lightning_muon.lightning import _compat


def _describe(optimizer: Optimizer) -> str:
    lrs = sorted({float(g["lr"]) for g in optimizer.param_groups})
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    lr = f"lr={lrs[0]:g}" if len(lrs) == 1 else f"lrs={', '.join(f'{x:g}' for x in lrs)}"
    return f"{type(optimizer).__name__}({lr}) on {count} tensor{'s' * (count != 1)}"


def _per_group_settings(optimizer: Optimizer) -> bool:
    """Whether the param groups differ in any setting (per-group weight decay, lr, ...)."""
    settings = [{k: repr(v) for k, v in g.items() if k not in ("params", "param_names", "name")}
                for g in optimizer.param_groups]
    return any(s != settings[0] for s in settings)


def replaced_message(module: LightningModule, owner: type, used: list[Any]) -> tuple[str, bool]:
    """The message, and whether it is a warning: ``owner.configure_optimizers`` (the parent's) against the
    optimizers ``used`` (``trainer.optimizers``)."""
    head = f"{owner.__name__}.configure_optimizers is replaced by MuonMixin's"
    ours = " and ".join(_describe(getattr(o, "optimizer", o)) for o in used)
    try:
        theirs, schedulers = _compat.optimizers_and_schedulers(owner.configure_optimizers(module))  # type: ignore[attr-defined]
    except Exception as error:  # describing is best-effort: the parent's method may need what the mixin skips
        return f"{head}: it trains with {ours} (the parent's could not be described: {error!r}).", False
    theirs = [getattr(o, "optimizer", o) for o in theirs]
    lines = [f"{head}: it would have built {' and '.join(_describe(o) for o in theirs) or 'no optimizer'}; "
             f"MuonMixin trains with {ours}."]
    ignored = []
    if schedulers:
        ignored.append(
            f"its scheduler{'s' * (len(schedulers) > 1)} ({', '.join(type(s).__name__ for s in schedulers)}) "
            "will not run: pass lr_scheduler=... to the mixin"
        )
    if any(_per_group_settings(o) for o in theirs):
        ignored.append("its per-group settings are not used: the mixin routes parameters itself "
                       "(muon_params=/adamw_params=, and the muon/adamw factories' settings)")
    if ignored:
        lines.append("Ignored: " + "; ".join(ignored) + ".")
    return " ".join(lines), bool(ignored)
