"""Gradients DDP does not reduce: parameters that became trainable after ``DistributedDataParallel`` wrapped the
model.

DDP hands its reducer the parameters that require a gradient when it wraps the model, and all-reduces only those.
Lightning's finetuning callbacks freeze the backbone in their ``setup`` hook, before the DDP strategy wraps the
model, and unfreeze it during the fit: from then on every rank would step the backbone with its own local gradient
and the replicas would drift apart, silently (measured on 2 ranks: after one epoch unfrozen the ranks' backbones
differed by more than either had moved; Lightning's own automatic loop does the same,
Lightning-AI/pytorch-lightning#20340).

`UnsyncedGradients` remembers what was frozen when DDP wrapped the model (the mixin's ``configure_optimizers`` runs
right after the wrap) and, at each update, averages the gradients of those that train now across DDP's process
group, before anything reads them: every rank then unscales, clips by the same global norm, checks and steps the
same gradients, as DDP's own all-reduce would have given them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_muon.optim.norms import any_rank


class UnsyncedGradients:
    """The parameters DDP left out of its all-reduce because they were frozen when it wrapped the model.

    Args:
        frozen: their names, by ``id`` of the parameter (empty: nothing to do, the fit is not under DDP or nothing
            was frozen).
        group: DDP's process group.
    """

    def __init__(self, frozen: dict[int, str] | None = None, group: Any = None) -> None:
        self.frozen = frozen or {}
        self.group = group
        self._said = False

    @classmethod
    def at_wrap(cls, model: nn.Module | None, module: nn.Module) -> UnsyncedGradients:
        """What ``model`` (the strategy's model: a ``DistributedDataParallel`` once DDP has wrapped ``module``)
        will not reduce: ``module``'s parameters that are frozen now, except those DDP was told to ignore."""
        if not isinstance(model, DistributedDataParallel):
            return cls()
        ignored = {id(p) for name, p in model.module.named_parameters() if name in model.parameters_to_ignore}
        frozen = {id(p): name for name, p in module.named_parameters() if not p.requires_grad and id(p) not in ignored}
        return cls(frozen, model.process_group)

    def average(self, params: Iterable[Tensor]) -> None:
        """Average across the ranks the gradients of those of ``params`` (every rank passes the same, in the same
        order) that DDP does not reduce; a parameter without a gradient on some ranks counts zeros there, and keeps
        none where no rank has one."""
        if not self.frozen:  # not under DDP, or nothing was frozen at the wrap: every update of most fits
            return
        late = [p for p in params if id(p) in self.frozen]
        if not late:
            return
        if not self._said:
            names = [self.frozen[id(p)] for p in late]
            rank_zero_info(
                f"MuonMixin averages the gradients of {len(late)} parameters across the ranks itself: they became "
                f"trainable after DDP wrapped the model, so DDP does not reduce them ({', '.join(names[:5])}"
                f"{' and more' if len(names) > 5 else ''})."
            )
            self._said = True
        has = any_rank([p.grad is not None for p in late], late[0].device, self.group)
        grads: list[Tensor] = []
        for p, on_some_rank in zip(late, has, strict=True):
            if on_some_rank:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        ranks = dist.get_world_size(self.group)
        for dtype in sorted({g.dtype for g in grads}, key=str):  # every rank in the same order
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.group)
            flat.div_(ranks)
            for g, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
                g.copy_(part.view_as(g))
