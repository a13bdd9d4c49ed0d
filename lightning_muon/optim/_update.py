"""Muon's update maths on lists of tensors: buckets, momentum, orthogonalisation, apply, diagnostics.

Pure functions (no optimizer state of their own) over `Bucket`s: the
same-shape matrices of one param group that one Newton-Schulz call
orthogonalises together. `lightning_muon.Muon` and its distribution
strategies call them; `lightning_muon.MuonMonitor` calls `preview_update` to
recompute what ``torch.optim.Muon`` is about to do. Every Newton-Schulz call
of the package goes through this module.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch import Tensor

from lightning_muon.optim._collectives import is_dtensor
from lightning_muon.optim.newton_schulz import (
    gram_newton_schulz,
    ns_flops,
    orthogonality_error,
    zeropower_via_newtonschulz,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

#: Accepted values of ``adjust_lr_fn`` (``None`` means ``"original"``).
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral", "none")

#: CPU matmuls reach their peak on one matrix once it is about 1 MiB in bf16
#: (measured: batching 768x2304 matrices ran at 0.8x), while small matrices
#: gain 1.7-2.3x from batching; accelerators gain at every size.
_DEFAULT_BATCH_BYTES = {"cpu": 1 << 20}
_DEFAULT_BATCH_BYTES_ACCELERATOR = 1 << 28

#: Which parameters a step diagnoses (`Muon.record_diagnostics`).
Chooser = Callable[[Tensor], bool]


#: How a parameter's tensor holds its matrices (a param group's ``matrix_layouts``, one per parameter):
#: ``"flatten"`` (the default: a 2D weight, or a conv kernel seen as ``shape[0] x prod(shape[1:])``),
#: ``"stack"`` (a batch of matrices over the leading dims, e.g. MoE experts ``E x out x in``: each
#: orthogonalised on its own) and ``"in_out"`` (a 2D weight stored ``in x out``, as transformers' ``Conv1D``:
#: Newton-Schulz does not care, the lr's shape scaling does).
LAYOUTS = ("flatten", "stack", "in_out")


def matrix_shape(shape: torch.Size | tuple[int, ...], layout: str = "flatten") -> tuple[int, int]:
    """The ``(rows, cols)`` of each matrix Newton-Schulz works on: ``(shape[0], prod(shape[1:]))``, or the
    last two dims for ``"stack"``."""
    if layout == "stack":
        return shape[-2], shape[-1]
    return shape[0], math.prod(shape[1:])


def fan_shape(shape: torch.Size | tuple[int, ...], layout: str = "flatten") -> tuple[int, int]:
    """``(fan_out, fan_in)`` of each matrix, what the lr's shape scaling reads (`adjust_lr`)."""
    rows, cols = matrix_shape(shape, layout)
    return (cols, rows) if layout == "in_out" else (rows, cols)


def matrices_in(shape: torch.Size | tuple[int, ...], layout: str = "flatten") -> int:
    """How many matrices a parameter of this shape holds (more than one only for ``"stack"``)."""
    return math.prod(shape[:-2]) if layout == "stack" else 1


def layouts_of(group: dict[str, Any]) -> list[str]:
    """The layout of each parameter of a param group (``"flatten"`` where the group names none)."""
    return group.get("matrix_layouts") or ["flatten"] * len(group["params"])


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size | tuple[int, ...]) -> float:
    """The learning rate one parameter really gets, from its flattened shape ``A x B``.

    - ``None`` or ``"original"`` (Keller Jordan): ``lr * sqrt(max(1, A / B))``
    - ``"match_rms_adamw"`` (Moonshot): ``lr * 0.2 * sqrt(max(A, B))``
    - ``"spectral"``: ``lr * sqrt(A / B)``
    - ``"none"``: ``lr``

    ``A, B = shape[0], prod(shape[1:])``; for a 2D parameter that is its shape,
    as in ``torch.optim.Muon``. Weight decay always uses the unadjusted ``lr``.
    """
    A, B = matrix_shape(shape)
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    elif adjust_lr_fn == "spectral":
        ratio = math.sqrt(A / B)
    elif adjust_lr_fn == "none":
        ratio = 1.0
    else:
        raise ValueError(f"adjust_lr_fn must be None or one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    return lr * ratio


def lr_value(lr: float | Tensor) -> float:
    """A learning rate as a Python float (``lr`` may be a 1-element tensor)."""
    return lr.item() if isinstance(lr, Tensor) else float(lr)


def group_effective_lr(group: dict[str, Any], shape: torch.Size | tuple[int, ...], layout: str = "flatten") -> float:
    """`adjust_lr` with a param group's ``lr`` and ``adjust_lr_fn`` (``torch.optim.Muon``'s groups too), for a
    parameter of this shape and layout."""
    return adjust_lr(lr_value(group["lr"]), group.get("adjust_lr_fn"), fan_shape(shape, layout))


def group_effective_lrs(group: dict[str, Any]) -> list[float]:
    """The effective lr of every parameter of a param group, in order."""
    layouts = layouts_of(group)
    return [group_effective_lr(group, p.shape, layout) for p, layout in zip(group["params"], layouts, strict=True)]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how param groups keep ``ns_dtype`` (distributed checkpoints
    cannot save a ``torch.dtype``)."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype


def ns_dtype(group: dict[str, Any]) -> torch.dtype:
    """A group's Newton-Schulz dtype: stored by name (a torch.dtype from older state dicts works too);
    bf16 for groups without one (``torch.optim.Muon``'s)."""
    dtype = group.get("ns_dtype", "bfloat16")
    return dtype if isinstance(dtype, torch.dtype) else _dtype_from_name(dtype)


def _ns_settings(group: dict[str, Any]) -> dict[str, Any]:
    """`zeropower_via_newtonschulz`'s keyword arguments for a param group."""
    return {
        "ns_coefficients": group["ns_coefficients"],
        "ns_steps": group["ns_steps"],
        "eps": group["eps"],
        "dtype": ns_dtype(group),
    }


def on_exact_path(group: dict[str, Any]) -> bool:
    """Whether a group steps exactly as ``torch.optim.Muon`` (``ns_batch_bytes == 0``: one matrix at a time,
    torch's kernels, no Gram iteration, no merged calls)."""
    return group.get("ns_batch_bytes") == 0


def uses_gram(group: dict[str, Any], shape: tuple[int, int]) -> bool:
    """Whether a group orthogonalises ``m x n`` matrices by `gram_newton_schulz`: its long side is at least
    ``ns_gram_aspect`` times its short side (``None``: never), and the group is not `on_exact_path`."""
    aspect = group.get("ns_gram_aspect")
    if aspect is None or on_exact_path(group):
        return False
    m, n = shape
    return max(m, n) >= aspect * min(m, n)


def newton_schulz(group: dict[str, Any], matrices: Tensor) -> Tensor:
    """Orthogonalise one ``(m, n)`` matrix or a ``(k, m, n)`` stack with a param group's settings: Gram
    Newton-Schulz where `uses_gram`, else the standard iteration (a lone 2D matrix: torch's exact kernels)."""
    shape = (matrices.size(-2), matrices.size(-1))
    if uses_gram(group, shape):
        return gram_newton_schulz(matrices, **_ns_settings(group))
    return zeropower_via_newtonschulz(matrices, **_ns_settings(group))


class ParamDiagnostics(NamedTuple):
    """What one step did to one matrix (recorded on request, see `Muon.record_diagnostics`).

    The tensors are 0-dim float32 on the parameter's device, so reading them
    does not force a device sync until they are used.
    """

    name: str
    shape: tuple[int, ...]
    effective_lr: float
    #: ``||O O^T - I_r||_F / sqrt(r)`` of the orthogonalised update ``O``.
    orthogonality_error: Tensor
    #: RMS of the applied update ``effective_lr * O`` (weight decay not included).
    update_rms: Tensor


class Bucket(NamedTuple):
    """Same-shape matrices of one param group, orthogonalised in one (batched) Newton-Schulz call."""

    group: dict[str, Any]
    params: list[Tensor]
    grads: list[Tensor]
    bufs: list[Tensor]
    names: list[str]
    #: The ``(m, n)`` shape of every matrix Newton-Schulz sees in the bucket.
    shape: tuple[int, int]
    #: How the parameters hold their matrices (`LAYOUTS`), the same for the whole bucket.
    layout: str = "flatten"
    #: Matrices in each parameter (the stack size for ``"stack"``, else 1).
    per_param: int = 1

    @property
    def effective_lr(self) -> float:
        """The shape-adjusted learning rate of the bucket's matrices (from the whole matrix shape, also
        when the bucket holds this rank's shards)."""
        return group_effective_lr(self.group, self.shape, self.layout)

    @property
    def flops(self) -> int:
        """Newton-Schulz FLOPs of the whole bucket (what owner assignment balances)."""
        gram = uses_gram(self.group, self.shape)
        flops = ns_flops(*self.shape, self.group["ns_steps"], gram=gram, dtype=ns_dtype(self.group))
        return flops * len(self.params) * self.per_param

    @property
    def exchange_layout(self) -> tuple[int, tuple[int, int], torch.dtype]:
        """``(count, (rows, cols), dtype)``: one 2D block per parameter (its matrices one under the other),
        what a distributed exchange needs to know of the bucket."""
        m, n = self.shape
        return len(self.params), (m * self.per_param, n), ns_dtype(self.group)

    def local(self) -> Bucket:
        """The bucket on this rank's shards (views: in-place updates reach the DTensors)."""
        return self._replace(params=_locals(self.params), grads=_locals(self.grads), bufs=_locals(self.bufs))


def _locals(tensors: list[Tensor]) -> list[Tensor]:
    return [cast("DTensor", t).to_local() for t in tensors]


def batch_cap(group: dict[str, Any], device: torch.device) -> int:
    """The most bytes of one batched Newton-Schulz call for a group's matrices on ``device``."""
    cap = group["ns_batch_bytes"]
    return _DEFAULT_BATCH_BYTES.get(device.type, _DEFAULT_BATCH_BYTES_ACCELERATOR) if cap is None else cap


def bucket_indices(
    group: dict[str, Any],
    params: list[Tensor],
    whole_dtensors: bool = True,
    synced: bool = False,
    layouts: list[str] | None = None,
) -> list[list[int]]:
    """Indices of ``params`` in runs of same flattened shape, dtypes and device, within the byte cap.

    With ``whole_dtensors``, sharded (DTensor) matrices are orthogonalised one at a time, each
    gathered whole on every rank (the fallback for layouts other than FSDP2's). ``synced`` (ranks
    exchanging work) leaves gradient dtypes out: every rank must build the same buckets, and a
    gradient missing on one rank is zeros there in the parameter's dtype.
    """
    layouts = layouts or ["flatten"] * len(params)
    same: dict[tuple, list[int]] = defaultdict(list)
    for k, (p, layout) in enumerate(zip(params, layouts, strict=True)):
        grad_dtype = p.grad.dtype if p.grad is not None and not synced else p.dtype
        # A stack's matrices count too: same-shape stacks only (a flattened shape suffices otherwise).
        shape = tuple(p.shape) if layout == "stack" else matrix_shape(p.shape)
        key = (shape, layout, p.dtype, grad_dtype, p.device)
        same[(*key, k) if whole_dtensors and is_dtensor(p) else key].append(k)
    buckets: list[list[int]] = []
    itemsize = ns_dtype(group).itemsize
    for (shape, _, _, _, device, *_), ks in same.items():
        per_call = max(1, batch_cap(group, device) // (math.prod(shape) * itemsize))
        buckets.extend(ks[i : i + per_call] for i in range(0, len(ks), per_call))
    return buckets


def describe_param(group: dict[str, Any], i: int, index: int) -> str:
    """``parameter `name` (index 3)`` for messages; the index alone when the group has no names."""
    names = group.get("param_names")
    return f"parameter `{names[i]}` (index {index})" if names else f"parameter {index}"


def _check_grad(group: dict[str, Any], i: int, index: int, p: Tensor, grad: Tensor) -> None:
    if torch.is_complex(p) or torch.is_complex(grad):
        raise RuntimeError(f"Muon does not support complex parameters: {describe_param(group, i, index)}")
    if grad.is_sparse:
        raise RuntimeError(f"Muon does not support sparse gradients: {describe_param(group, i, index)}")


def _param_name(group: dict[str, Any], i: int, index: int) -> str:
    names = group.get("param_names")
    return names[i] if names else f"{group.get('name', 'params')}.{index}"


def collect_buckets(
    param_groups: list[dict[str, Any]],
    state: Any,
    has_grad: list[bool],
    *,
    whole_dtensors: bool,
    synced: bool,
    named: bool,
) -> list[Bucket]:
    """The buckets of one step, over the parameters flagged in ``has_grad`` (in param-group order).

    A flagged parameter without a gradient (it has one on another rank) steps with zeros; momentum
    buffers are created in ``state`` (the optimizer's) on first use. ``named`` fills in the parameter
    names (for diagnostics).
    """
    buckets, index = [], 0
    for group in param_groups:
        params, grads, bufs, names, layouts = [], [], [], [], []
        group_layouts = layouts_of(group)
        for i, p in enumerate(group["params"]):
            if not has_grad[index + i]:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            _check_grad(group, i, index + i, p, grad)
            params.append(p)
            grads.append(grad)
            if "momentum_buffer" not in state[p]:
                state[p]["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            bufs.append(state[p]["momentum_buffer"])
            names.append(_param_name(group, i, index + i) if named else "")
            layouts.append(group_layouts[i])
        index += len(group["params"])
        for ks in bucket_indices(group, params, whole_dtensors=whole_dtensors, synced=synced, layouts=layouts):
            pick = [params[k] for k in ks], [grads[k] for k in ks], [bufs[k] for k in ks], [names[k] for k in ks]
            layout, shape = layouts[ks[0]], params[ks[0]].shape
            buckets.append(Bucket(group, *pick, matrix_shape(shape, layout), layout, matrices_in(shape, layout)))
    return buckets


def momentum(bucket: Bucket, update: bool = True) -> list[Tensor]:
    """Update the momentum buffers; return the tensors to orthogonalise (Nesterov, or the buffers)."""
    beta = bucket.group["momentum"]
    torch._foreach_lerp_(bucket.bufs, bucket.grads, 1 - beta)
    if not update:
        return []
    # A fresh tensor when nesterov; otherwise the buffer itself, which Newton-Schulz only reads
    # (it copies into ns_dtype first).
    return list(torch._foreach_lerp(bucket.grads, bucket.bufs, beta)) if bucket.group["nesterov"] else bucket.bufs


def orthogonalise(bucket: Bucket, updates: list[Tensor]) -> list[Tensor]:
    """Newton-Schulz of a bucket's updates, one matrix at a time on its own: one batched call for several
    matrices, the 2D path (bit-identical to ``torch.optim.Muon``) for a lone one. One result per update:
    ``(m, n)``, or ``(matrices, m, n)`` for a stack."""
    group = bucket.group
    matrix = bucket.shape if bucket.per_param == 1 else (-1, *bucket.shape)
    if len(updates) == 1 and is_dtensor(updates[0]):
        # Newton-Schulz needs the whole matrix, never a shard. Gather it, orthogonalise, and keep this
        # rank's shard of the result (every rank computes the same full matrix).
        from torch.distributed.tensor import DTensor, distribute_tensor

        update = updates[0]
        assert isinstance(update, DTensor)
        full = newton_schulz(group, update.full_tensor().reshape(matrix))
        shard = distribute_tensor(full.reshape(update.shape), update.device_mesh, update.placements, src_data_rank=None)
        return [shard]
    if len(updates) == 1:
        return [newton_schulz(group, updates[0].reshape(matrix))]
    if bucket.per_param == 1:
        return _orthogonalise_wide([bucket], [updates])[0]
    stacks = torch.cat([u.reshape(matrix) for u in updates])
    orthogonal = newton_schulz(group, stacks)
    return list(orthogonal.reshape(len(updates), bucket.per_param, *bucket.shape).unbind(0))


def ns_batches(buckets: Sequence[Bucket]) -> list[list[int]]:
    """Indices of the buckets orthogonalised in one Newton-Schulz call: a bucket of ``m x n`` matrices with
    one of ``n x m`` ones (same group, device, one matrix per parameter, plain tensors) while their bytes
    fit the group's batch cap. Newton-Schulz works on the wide orientation anyway, so the tall ones join
    transposed; one call instead of two (fewer, larger matmuls). Order kept; never on the exact path."""
    batches: list[list[int]] = []
    open_batches: dict[tuple, tuple[list[int], int]] = {}
    for j, bucket in enumerate(buckets):
        group, (m, n) = bucket.group, bucket.shape
        if bucket.per_param != 1 or on_exact_path(group) or is_dtensor(bucket.params[0]):
            batches.append([j])
            continue
        device = bucket.params[0].device
        key = (id(group), min(m, n), max(m, n), device)
        nbytes = len(bucket.params) * m * n * ns_dtype(group).itemsize
        if key in open_batches and open_batches[key][1] + nbytes <= batch_cap(group, device):
            batch, used = open_batches[key]
            batch.append(j)
            open_batches[key] = (batch, used + nbytes)
        else:
            batches.append([j])
            open_batches[key] = (batches[-1], nbytes)
    return batches


def orthogonalise_together(buckets: Sequence[Bucket], updates: Sequence[list[Tensor]]) -> list[list[Tensor]]:
    """`orthogonalise` of the buckets of one `ns_batches` entry in one call; tall matrices go in transposed
    and come back as transposed views."""
    if len(buckets) == 1:
        return [orthogonalise(buckets[0], updates[0])]
    return _orthogonalise_wide(buckets, updates)


def _orthogonalise_wide(buckets: Sequence[Bucket], updates: Sequence[list[Tensor]]) -> list[list[Tensor]]:
    """One batched call on a stack of the matrices in their wide orientation: one pass casts (and transposes
    the tall ones) into the stack, so every matmul of the iteration reads contiguous wide matrices (torch.stack,
    then a cast, measured a second full copy; transposed operands, more copies inside the matmuls)."""
    group, (m, n) = buckets[0].group, buckets[0].shape
    wide = (min(m, n), max(m, n))
    tall = [b.shape[0] > b.shape[1] for b in buckets]
    sources = [
        u.reshape(b.shape).mT if t else u.reshape(b.shape)
        for b, us, t in zip(buckets, updates, tall, strict=True)
        for u in us
    ]
    stack = torch.empty(len(sources), *wide, dtype=ns_dtype(group), device=sources[0].device)
    torch._foreach_copy_(list(stack.unbind(0)), sources)
    orthogonal = newton_schulz(group, stack).unbind(0)
    results, start = [], 0
    for us, t in zip(updates, tall, strict=True):
        results.append([o.mT if t else o for o in orthogonal[start : start + len(us)]])
        start += len(us)
    return results


def orthogonalise_stack(group: dict[str, Any], stack: Tensor) -> Tensor:
    """Newton-Schulz of a ``(k, m, n)`` stack; a lone matrix takes the 2D path, as on one process."""
    if len(stack) == 1:
        return newton_schulz(group, stack[0]).unsqueeze(0)
    return newton_schulz(group, stack)


def apply(bucket: Bucket, orthogonal: list[Tensor]) -> None:
    """Decoupled weight decay with the base lr, then the shape-adjusted orthogonalised step."""
    decay = 1 - lr_value(bucket.group["lr"]) * bucket.group["weight_decay"]
    if decay != 1.0:
        torch._foreach_mul_(bucket.params, decay)
    # 2D updates go in as they are (a tall one is a transposed view: no copy); ND ones are unflattened.
    shaped = [o if o.shape == p.shape else o.reshape(p.shape) for o, p in zip(orthogonal, bucket.params, strict=True)]
    torch._foreach_add_(bucket.params, shaped, alpha=-bucket.effective_lr)


def measure(updates: Tensor, effective_lr: float) -> tuple[Tensor, Tensor]:
    """Orthogonality error and applied-update RMS (``effective_lr * O``) of a ``(k, m, n)`` stack, in float32."""
    stack = updates.float()
    return orthogonality_error(stack), stack.pow(2).mean(dim=(-2, -1)).sqrt() * effective_lr


def record(bucket: Bucket, orthogonal: list[Tensor], diagnose: Chooser) -> list[ParamDiagnostics]:
    """Diagnostics of the chosen matrices of a bucket, from the updates the step just applied."""
    chosen = [j for j, p in enumerate(bucket.params) if diagnose(p)]
    if not chosen:
        return []
    matrices = [orthogonal[j] for j in chosen]
    if is_dtensor(matrices[0]):
        matrices = [cast("DTensor", m).full_tensor() for m in matrices]
    lr = bucket.effective_lr
    # (chosen, matrices per parameter, m, n): a stack's numbers are over all of its matrices.
    stacks = torch.stack([m.reshape(bucket.per_param, *bucket.shape) for m in matrices])
    errors, rms = measure(stacks.flatten(0, 1), lr)
    if bucket.per_param > 1:
        errors = errors.reshape(len(chosen), -1).mean(dim=1)
        rms = rms.reshape(len(chosen), -1).square().mean(dim=1).sqrt()
    return [
        ParamDiagnostics(bucket.names[j], tuple(bucket.params[j].shape), lr, error, r)
        for j, error, r in zip(chosen, errors, rms, strict=True)
    ]


@torch.no_grad()
def preview_update(group: dict[str, Any], grad: Tensor, buf: Tensor | None) -> Tensor:
    """The orthogonalised update (float32, flattened ``m x n``) a step would make from ``grad`` and the
    momentum buffer ``buf`` (``None`` before the first step), leaving ``buf`` as it is.

    For optimizers that cannot report their own diagnostics (``torch.optim.Muon``, whose param groups
    have the same keys); groups without an ``ns_dtype`` use bf16, as torch does.
    """
    bucket = Bucket(
        group=group,
        params=[grad],
        grads=[grad],
        bufs=[torch.zeros_like(grad) if buf is None else buf.clone()],
        names=[""],
        shape=matrix_shape(grad.shape),
    )
    return orthogonalise(bucket, momentum(bucket))[0].float()
