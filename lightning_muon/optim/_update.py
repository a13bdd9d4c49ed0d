"""Muon's update maths on lists of tensors: buckets, momentum, orthogonalisation, apply, diagnostics.

Pure functions (no optimizer state of their own) over `Bucket`s: the
same-shape matrices of one param group that one Newton-Schulz call
orthogonalises together. `lightning_muon.Muon` and its distribution
strategies call them; `lightning_muon.MuonMonitor` calls `preview_update` to
recompute what ``torch.optim.Muon`` is about to do. Every Newton-Schulz call
of the package goes through `orthogonalise`, a group's settings and a stack of matrices.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch import Tensor

from lightning_muon.optim._collectives import ExchangeLayout
from lightning_muon.optim._dtensor import is_dtensor, local_slices, matrix_parts
from lightning_muon.optim.groups import (
    NORMUON_EPS,
    SECOND_MOMENT,
    STACKED,
    STORED_IN_OUT,
    batch_cap,
    blocks_of,
    describe_param,
    group_effective_lr,
    layouts_of,
    lr_value,
    matrices_in,
    matrix_shape,
    ns_dtype,
    ns_settings,
    on_exact_path,
    param_name,
    row_moment_shape,
    split_blocks,
    uses_gram,
)
from lightning_muon.optim.newton_schulz import (
    gram_newton_schulz,
    ns_flops,
    orthogonality_error,
    zeropower_via_newtonschulz,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

#: Which parameters a step diagnoses (`Muon.record_diagnostics`).
Chooser = Callable[[Tensor], bool]


class ParamDiagnostics(NamedTuple):
    """What one step did to one matrix (recorded on request, see `Muon.record_diagnostics`).

    The tensors are 0-dim float32 on the parameter's device, so reading them
    does not force a device sync until they are used.

    Examples:
        ```python
        import torch
        from lightning_muon import Muon

        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 32))
        optimizer = Muon([w], lr=0.02, ns_dtype=torch.float32)
        w.grad = torch.randn(64, 32)
        optimizer.record_diagnostics()  # for the next step only
        optimizer.step()
        (d,) = optimizer.diagnostics
        print(d.name, d.shape, f"{d.effective_lr:.4f}")  # params.0 (64, 32) 0.0283
        print(f"{d.orthogonality_error:.2f}")  # 0.38
        ```
    """

    #: The parameter's name (`param_name`: its ``param_names`` entry, else ``<group name>.<index>``).
    name: str
    #: The parameter's own shape (a conv kernel's or a stack's whole shape, not the matrices').
    shape: tuple[int, ...]
    #: The learning rate the step applied to it: its group's ``lr`` after `adjust_lr`.
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
    #: Matrices in each parameter (the stack size for the stacked layouts, else 1).
    per_param: int = 1
    #: NorMuon's per-row second moments, one per parameter (`row_moment_shape`); empty for plain Muon.
    moments: Sequence[Tensor] = ()

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
    def exchange_layout(self) -> ExchangeLayout:
        """What a distributed exchange needs to know of the bucket: one 2D block per parameter (its matrices one
        under the other), in the group's Newton-Schulz dtype, and how the ranks' shards cut each block where
        some are not plain row shards (tensor parallelism, 2-D: `matrix_parts`)."""
        m, n = self.shape
        cuts = tuple(matrix_parts(p) for p in self.params)
        layout = ExchangeLayout(len(self.params), (m * self.per_param, n), ns_dtype(self.group))
        return layout if all(cut is None for cut in cuts) else layout._replace(cuts=cuts)

    def local(self) -> Bucket:
        """The bucket on this rank's shards (views: in-place updates reach the DTensors); NorMuon's moments are
        whole on every rank (one value per neuron), and stay so."""
        return self._replace(params=_locals(self.params), grads=_locals(self.grads), bufs=_locals(self.bufs))

    def subset(self, indices: Sequence[int]) -> Bucket:
        """The bucket restricted to the parameters at ``indices`` (its group, shape and layout kept); the whole
        bucket itself when ``indices`` covers it in order."""
        if list(indices) == list(range(len(self.params))):
            return self
        return self._replace(
            params=[self.params[i] for i in indices],
            grads=[self.grads[i] for i in indices],
            bufs=[self.bufs[i] for i in indices],
            names=[self.names[i] for i in indices],
            moments=[self.moments[i] for i in indices] if self.moments else (),
        )


def _locals(tensors: list[Tensor]) -> list[Tensor]:
    return [cast("DTensor", t).to_local() for t in tensors]


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
        shape = tuple(p.shape) if layout in STACKED else matrix_shape(p.shape)
        key = (shape, layout, p.dtype, grad_dtype, p.device)
        same[(*key, k) if whole_dtensors and is_dtensor(p) else key].append(k)
    buckets: list[list[int]] = []
    itemsize = ns_dtype(group).itemsize
    for (shape, _, _, _, device, *_), ks in same.items():
        per_call = max(1, batch_cap(group, device) // (math.prod(shape) * itemsize))
        buckets.extend(ks[i : i + per_call] for i in range(0, len(ks), per_call))
    return buckets


def _check_grad(group: dict[str, Any], i: int, index: int, p: Tensor, grad: Tensor) -> None:
    if torch.is_complex(p) or torch.is_complex(grad):
        raise RuntimeError(f"Muon does not support complex parameters: {describe_param(group, i, index)}")
    if grad.is_sparse:
        raise RuntimeError(f"Muon does not support sparse gradients: {describe_param(group, i, index)}")


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
        moments: list[Tensor] = []
        group_layouts, group_blocks = layouts_of(group), blocks_of(group)
        normuon = group.get("normuon_beta2") is not None
        for i, p in enumerate(group["params"]):
            if not has_grad[index + i]:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            _check_grad(group, i, index + i, p, grad)
            if "momentum_buffer" not in state[p]:
                state[p]["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            name, layout, sizes = param_name(group, i, index + i) if named else "", group_layouts[i], group_blocks[i]
            if normuon and SECOND_MOMENT not in state[p]:
                state[p][SECOND_MOMENT] = new_second_moment(p, layout)
            # A fused projection's blocks step as separate parameters would: views of the tensor, its gradient,
            # its momentum buffer and NorMuon's second moment (which stay whole in the state).
            whole = [p, grad, state[p]["momentum_buffer"], *([state[p][SECOND_MOMENT]] if normuon else [])]
            for k, pieces in enumerate(zip(*(split_blocks(t, layout, sizes) for t in whole), strict=True)):
                params.append(pieces[0])
                grads.append(pieces[1])
                bufs.append(pieces[2])
                moments.extend(pieces[3:])
                names.append(f"{name}[{k}]" if named and sizes else name)
                layouts.append(layout)
        index += len(group["params"])
        for ks in bucket_indices(group, params, whole_dtensors=whole_dtensors, synced=synced, layouts=layouts):
            pick = [params[k] for k in ks], [grads[k] for k in ks], [bufs[k] for k in ks], [names[k] for k in ks]
            layout, shape = layouts[ks[0]], params[ks[0]].shape
            bucket = Bucket(group, *pick, matrix_shape(shape, layout), layout, matrices_in(shape, layout))
            buckets.append(bucket._replace(moments=[moments[k] for k in ks]) if normuon else bucket)
    return buckets


def new_second_moment(p: Tensor, layout: str) -> Tensor:
    """NorMuon's second moment of a parameter before its first step: float32 zeros, one per neuron
    (`row_moment_shape`), a plain tensor of the whole parameter's neurons also when it is a DTensor (every rank
    keeps them all, and every rank advances them alike)."""
    return torch.zeros(row_moment_shape(p.shape, layout), dtype=torch.float32, device=p.device)


def advance_momentum(bucket: Bucket) -> None:
    """Take the gradients into the momentum buffers: ``B <- B.lerp(g, 1 - momentum)``."""
    torch._foreach_lerp_(bucket.bufs, bucket.grads, 1 - bucket.group["momentum"])


def nesterov_input(bucket: Bucket) -> list[Tensor]:
    """What Newton-Schulz orthogonalises, from buffers already advanced (`advance_momentum`): the Nesterov
    mix ``g.lerp(B, momentum)`` (fresh tensors), or without ``nesterov`` the buffers themselves (Newton-Schulz
    only reads them: it copies into ``ns_dtype`` first)."""
    if bucket.group["nesterov"]:
        return list(torch._foreach_lerp(bucket.grads, bucket.bufs, bucket.group["momentum"]))
    return bucket.bufs


def momentum(bucket: Bucket) -> list[Tensor]:
    """`advance_momentum`, then the `nesterov_input` to orthogonalise."""
    advance_momentum(bucket)
    return nesterov_input(bucket)


def orthogonalise(group: dict[str, Any], matrices: Tensor) -> Tensor:
    """Newton-Schulz of a ``(k, m, n)`` stack with a param group's settings, in one call: Gram Newton-Schulz
    where `uses_gram`, else the standard iteration. A lone matrix (``k == 1``) takes the 2D path, whose
    kernels are ``torch.optim.Muon``'s (bit-identical results). Returns ``(k, m, n)`` in ``ns_dtype``."""
    gram = uses_gram(group, (matrices.size(-2), matrices.size(-1)))
    iterate = gram_newton_schulz if gram else zeropower_via_newtonschulz
    if len(matrices) == 1:
        return iterate(matrices[0], **ns_settings(group)).unsqueeze(0)
    return iterate(matrices, **ns_settings(group))


def orthogonalise_buckets(buckets: Sequence[Bucket], updates: Sequence[list[Tensor]]) -> list[list[Tensor]]:
    """`orthogonalise` of the updates of one `ns_batches` entry (a bucket, or one with its transposed twins),
    in one call. One result per update: ``(m, n)``, or ``(matrices, m, n)`` for a stack.

    Several plain matrices are stacked in their wide orientation (tall ones come back as transposed views);
    a lone matrix, and stacks of matrices, keep their own orientation; a lone DTensor is gathered whole."""
    bucket, first = buckets[0], updates[0]
    if len(buckets) == 1 and len(first) == 1 and is_dtensor(first[0]):
        return [[_orthogonalise_whole(bucket, cast("DTensor", first[0]))]]
    if len(buckets) == 1 and (len(first) == 1 or bucket.per_param > 1):
        return [_orthogonalise_as_stored(bucket, first)]
    return _orthogonalise_wide(buckets, updates)


def _orthogonalise_whole(bucket: Bucket, update: DTensor) -> Tensor:
    """Newton-Schulz needs the whole matrix, never a shard: gather it, orthogonalise, and keep this rank's
    shard of the result (every rank computes the same full matrix)."""
    from torch.distributed.tensor import distribute_tensor

    full = orthogonalise(bucket.group, update.full_tensor().reshape(-1, *bucket.shape))
    return distribute_tensor(full.reshape(update.shape), update.device_mesh, update.placements, src_data_rank=None)


def _orthogonalise_as_stored(bucket: Bucket, updates: list[Tensor]) -> list[Tensor]:
    """The bucket's matrices one after another, as the parameters hold them (a stack's matrices together)."""
    matrices = (-1, *bucket.shape)
    stack = updates[0].reshape(matrices) if len(updates) == 1 else torch.cat([u.reshape(matrices) for u in updates])
    orthogonal = orthogonalise(bucket.group, stack)
    if bucket.per_param == 1:
        return list(orthogonal.unbind(0))
    return list(orthogonal.reshape(len(updates), bucket.per_param, *bucket.shape).unbind(0))


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
    orthogonal = orthogonalise(group, stack).unbind(0)
    results, start = [], 0
    for us, t in zip(updates, tall, strict=True):
        results.append([o.mT if t else o for o in orthogonal[start : start + len(us)]])
        start += len(us)
    return results


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


def normalize_rows(bucket: Bucket, orthogonal: list[Tensor]) -> list[Tensor]:
    """NorMuon (Li et al. 2025, arXiv 2510.05491) on the whole orthogonalised updates of a bucket, in float32:
    each neuron's second moment ``v <- v.lerp(mean(O_row**2), 1 - normuon_beta2)`` (in the bucket's
    ``moments``, in place), each row divided by ``sqrt(v) + 1e-8``, and each matrix rescaled to the Frobenius
    norm ``O`` had. One result per update, its shape kept. DTensor updates (the fallback that gathers sharded
    matrices whole on every rank) are normalised whole and sharded again."""
    if is_dtensor(orthogonal[0]):
        from torch.distributed.tensor import distribute_tensor

        wholes = normalize_rows(bucket, [cast("DTensor", o).full_tensor() for o in orthogonal])
        return [distribute_tensor(w, o.device_mesh, o.placements, src_data_rank=None)  # type: ignore[attr-defined]
                for w, o in zip(wholes, orthogonal, strict=True)]
    normalized, _, _ = _normuon(bucket, orthogonal, in_place=True)
    return [u.reshape(o.shape) for u, o in zip(normalized.unbind(0), orthogonal, strict=True)]


def normuon_statistics(bucket: Bucket, orthogonal: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """What an owner of whole matrices tells the ranks that hold their shards (`normalize_shards`), one pair per
    update, in float32: each neuron's mean square ``mean(O_row**2)`` (shaped as its second moment,
    `row_moment_shape`) and each matrix's rescale (``(*stack, 1, 1)``, or ``(1, 1)``), as `normalize_rows`
    computes them; the bucket's moments are read, not changed."""
    _, mean_square, rescale = _normuon(bucket, orthogonal, in_place=False)
    moments = list(bucket.moments)
    return [(s.reshape(v.shape), r.reshape(*v.shape[:-2], 1, 1))
            for s, r, v in zip(mean_square.unbind(0), rescale.unbind(0), moments, strict=True)]


def _normuon(bucket: Bucket, orthogonal: list[Tensor], in_place: bool) -> tuple[Tensor, Tensor, Tensor]:
    """NorMuon's maths on a bucket's whole updates: the normalised updates ``(updates, per_param, m, n)``, the
    neurons' mean squares and the matrices' rescales; the moments advanced in place where ``in_place``."""
    m, n = bucket.shape
    per, dim = (bucket.per_param, m, n), (-2 if bucket.layout in STORED_IN_OUT else -1)
    updates = torch.stack([o.reshape(per) for o in orthogonal]).float()
    moments = torch.stack([v.reshape(bucket.per_param, *v.shape[-2:]) for v in bucket.moments]).float()
    norms = torch.linalg.vector_norm(updates, dim=(-2, -1), keepdim=True)
    mean_square = updates.square().mean(dim=dim, keepdim=True)
    moments.lerp_(mean_square, 1 - bucket.group["normuon_beta2"])
    normalized = updates / (moments.sqrt() + NORMUON_EPS)
    rescale = norms / torch.linalg.vector_norm(normalized, dim=(-2, -1), keepdim=True).clamp_min(NORMUON_EPS)
    normalized *= rescale
    if in_place:
        olds = list(bucket.moments)
        torch._foreach_copy_(olds, [v.reshape(old.shape) for v, old in zip(moments, olds, strict=True)])
    return normalized, mean_square, rescale


def normalize_shards(bucket: Bucket, shards: list[Tensor], statistics: Sequence[tuple[Tensor, Tensor]],
                     sharded: Sequence[Tensor]) -> list[Tensor]:
    """NorMuon on this rank's shards of a bucket's updates (``bucket``: the local one, whose ``moments`` are whole
    on every rank), from the whole matrices' `normuon_statistics` an owner computed: every rank advances every
    moment alike, then divides its rows by theirs and rescales them, element by element as `normalize_rows` does
    on one process. ``sharded``: the DTensor parameters, for where each shard lies. Results in float32."""
    results = []
    beta2 = bucket.group["normuon_beta2"]
    for shard, moment, (mean_square, rescale), param in zip(shards, bucket.moments, statistics, sharded,
                                                            strict=True):
        moment.lerp_(mean_square, 1 - beta2)
        rows, scale = moment_slices(param, bucket.layout)
        local = shard.float().reshape(_matrix_view(param.to_local().shape, bucket.layout))  # type: ignore[attr-defined]
        normalized = local / (moment[rows].sqrt() + NORMUON_EPS)
        normalized *= rescale[scale]
        results.append(normalized.reshape(shard.shape))
    return results


def _matrix_view(shape: torch.Size, layout: str) -> tuple[int, ...]:
    """A (local) parameter's shape as its second moment broadcasts against it: ``(rows, rest)`` for ``"flatten"``
    (a conv kernel's matrix), the shape itself for the other layouts."""
    return (shape[0], math.prod(shape[1:])) if layout == "flatten" else tuple(shape)


def moment_slices(param: Tensor, layout: str) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """Where this rank's shard of a DTensor parameter lies in its whole second moment (`row_moment_shape`) and
    in its matrices' rescales (``(*stack, 1, 1)`` or ``(1, 1)``)."""
    cut = local_slices(param)
    every = slice(None)
    if layout == "flatten":
        return (cut[0], every), (every, every)
    if layout == "in_out":
        return (every, cut[1]), (every, every)
    stack = cut[:-2]
    if layout == "stack":
        return (*stack, cut[-2], every), (*stack, every, every)
    return (*stack, every, cut[-1]), (*stack, every, every)


def apply(bucket: Bucket, orthogonal: list[Tensor], normalized: bool = False) -> None:
    """Decoupled weight decay with the base lr, then the shape-adjusted orthogonalised step. NorMuon groups
    (``normuon_beta2``) normalise the rows first (`normalize_rows`), unless ``normalized`` says it is done
    (`normalize_shards`); with ``cautious_weight_decay`` an entry decays only where it and its update have the
    same sign (``p * update >= 0``), as dion's ``cautious_wd``."""
    group = bucket.group
    if group.get("normuon_beta2") is not None and not normalized:
        orthogonal = normalize_rows(bucket, orthogonal)
    # 2D updates go in as they are (a tall one is a transposed view: no copy); ND ones are unflattened.
    shaped = [o if o.shape == p.shape else o.reshape(p.shape) for o, p in zip(orthogonal, bucket.params, strict=True)]
    coefficient = lr_value(group["lr"]) * group["weight_decay"]
    if group.get("cautious_weight_decay") and coefficient:
        decays = [p * (p * u >= 0) for p, u in zip(bucket.params, shaped, strict=True)]
        torch._foreach_add_(bucket.params, decays, alpha=-coefficient)
    elif 1 - coefficient != 1.0:
        torch._foreach_mul_(bucket.params, 1 - coefficient)
    torch._foreach_add_(bucket.params, shaped, alpha=-bucket.effective_lr)


def measure(updates: Tensor, effective_lr: float) -> tuple[Tensor, Tensor]:
    """Orthogonality error and applied-update RMS (``effective_lr * O``) of a ``(k, m, n)`` stack, in float32."""
    stack = updates.float()
    return orthogonality_error(stack), stack.pow(2).mean(dim=(-2, -1)).sqrt() * effective_lr


def record(bucket: Bucket, orthogonal: list[Tensor], diagnose: Chooser) -> list[ParamDiagnostics]:
    """Diagnostics of the chosen matrices of a bucket, from the updates the step just applied."""
    # A fused projection's block is a view: chosen with its parameter (``_base``).
    chosen = [j for j, p in enumerate(bucket.params) if diagnose(p if p._base is None else p._base)]
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
    return orthogonalise_buckets([bucket], [momentum(bucket)])[0][0].float()
