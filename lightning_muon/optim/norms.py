"""Norms, finiteness and clipping over a mix of plain tensors and DTensors on one or several meshes, and the
one-flag-per-tensor agreement of the ranks (`any_rank`). Plumbing the optimizer and the subpackages above it share
(the mixin's update loop and checks): its ``__all__`` is what they import.

Under tensor parallelism (Lightning's ``ModelParallelStrategy`` with ``parallelize_module``) a model's
parameters are DTensors where the plan shards them and plain tensors elsewhere (its embedding, norms and head in
Lightning's tutorial plan), and under 2-D (data x tensor parallel) the DTensors live on two meshes. A foreach
kernel (``torch.nn.utils.get_total_norm``, ``clip_grads_with_norm_``, ``clip_grad_value_``) refuses such a
mix. `by_mesh` splits tensors into groups a foreach kernel takes; the functions here run torch's own kernel on
each group and combine the results into one plain tensor, so every caller (the mixin's clipping and non-finite
check, the weight health check, the monitor) computes the same numbers as one process, with one helper.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.optim._dtensor import is_dtensor

__all__ = ["any_rank", "by_mesh", "clip_value_", "clip_with_norm_", "is_finite", "total_norm"]


def by_mesh(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """``tensors`` in groups that a foreach kernel takes: the plain tensors, then the DTensors of each mesh, in
    the order first met."""
    groups: dict[object, list[Tensor]] = {}
    for t in tensors:
        key = t.device_mesh if is_dtensor(t) else None  # type: ignore[attr-defined]
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def _plain(norm: Tensor) -> Tensor:
    """A group's norm as a plain tensor: a DTensor's is reduced across its mesh (its placement is partial)."""
    return norm.full_tensor() if is_dtensor(norm) else norm  # type: ignore[attr-defined]


def total_norm(tensors: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all ``tensors`` together, as ``torch.nn.utils.get_total_norm`` gives it for one
    kind of tensor, as a plain tensor (zero for no tensor)."""
    groups = by_mesh(tensors)
    if not groups:
        return torch.zeros(())
    norms = [_plain(torch.nn.utils.get_total_norm(group, norm_type)) for group in groups]
    if len(norms) == 1:
        return norms[0]
    norms = [n.to(norms[0].device) for n in norms]
    if math.isinf(norm_type):
        return torch.stack(norms).max()
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_with_norm_(params: list[Tensor], max_norm: float, norm: Tensor) -> None:
    """Scale every ``params``' gradient by ``max_norm / norm`` where that is below 1 (``norm``: `total_norm` of
    the gradients), as ``torch.nn.utils.clip_grads_with_norm_`` does for one kind of tensor."""
    for group in by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)


def clip_value_(params: list[Tensor], clip_value: float) -> None:
    """Clamp every ``params``' gradient to ``[-clip_value, clip_value]`` (``torch.nn.utils.clip_grad_value_``)."""
    for group in by_mesh(params):
        torch.nn.utils.clip_grad_value_(group, clip_value)


def is_finite(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is finite (a DTensor's whole matrix: every rank of its mesh calls it)."""
    whole = tensor.full_tensor() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
    return bool(torch.isfinite(whole).all())


def any_rank(flags: list[bool], device: torch.device, group: dist.ProcessGroup | None = None) -> list[bool]:
    """Element-wise OR of ``flags`` over all ranks of ``group`` (one small all-reduce of a tensor on ``device``;
    reading it back waits for that device: on an accelerator, for everything queued before it)."""
    tensor = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [bool(x) for x in tensor.tolist()]
