"""Muon's update maths on lists of tensors: buckets, momentum, orthogonalisation, apply, diagnostics.

Pure functions (no optimizer state of their own) over `Bucket`s: the
same-shape matrices of one param group that one Newton-Schulz call
orthogonalises together. `lightning_muon.Muon` and its distribution
strategies call them; `lightning_muon.MuonMonitor` calls `preview_update` to
recompute what ``torch.optim.Muon`` is about to do. Every Newton-Schulz call
of the package goes through `orthogonalise`, a group's settings and a stack of matrices. What a group's update
rules do is theirs (`lightning_muon.optim.rules`): `apply` and `apply_shards`
call them, naming none.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from lightning_muon.optim._bucket import Bucket, Chooser, GroupSettings, ParamDiagnostics, settings_of
from lightning_muon.optim._dtensor import is_dtensor
from lightning_muon.optim.groups import (
    STACKED,
    describe_param,
    lr_value,
    matrices_in,
    matrix_shape,
    param_name,
    split_blocks,
)
from lightning_muon.optim.newton_schulz import (
    gram_newton_schulz,
    orthogonality_error,
    zeropower_via_newtonschulz,
)
from lightning_muon.optim.rules import UpdateRule, rules_for

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

#: The optimizer-state key of a parameter's momentum buffer (``torch.optim.Muon``'s).
MOMENTUM_BUFFER = "momentum_buffer"


def bucket_indices(
    settings: GroupSettings,
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
        sharded = is_dtensor(p)  # a DTensor never shares a bucket with a plain tensor (a gathered block's)
        key = (shape, layout, p.dtype, grad_dtype, p.device, sharded)
        same[(*key, k) if whole_dtensors and sharded else key].append(k)
    buckets: list[list[int]] = []
    itemsize = settings.ns_dtype.itemsize
    for (shape, _, _, _, device, *_), ks in same.items():
        per_call = max(1, settings.batch_cap(device) // (math.prod(shape) * itemsize))
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
    complete: bool = False,
    owner_blocks: bool = False,
) -> list[Bucket]:
    """The buckets of one step, over the parameters flagged in ``has_grad`` (in param-group order).

    A flagged parameter without a gradient (it has one on another rank) steps with zeros; momentum
    buffers and the group's update rules' state are created in ``state`` (the optimizer's) on first use, for
    every parameter with ``complete`` (`init_state`). ``named`` fills in the parameter names (for diagnostics).
    Each group's settings are resolved here, once a step (`settings_of`), and handed down with its buckets.

    A DTensor parameter split into blocks (``matrix_blocks``) steps on whole copies (`gather_whole`): its blocks are
    the one-process ones, in plain-tensor buckets that carry the copies to write back (`Bucket.gathered`,
    `write_back`). With ``owner_blocks`` (the sharded strategy, no diagnostics), one flattened (`owns_blocks`) is a
    bucket of its own instead, whole, with its blocks (`Bucket.blocks`), for an owner rank to split.
    """
    buckets, index = [], 0
    for group in param_groups:
        params, grads, bufs, names, layouts = [], [], [], [], []
        backs: list[tuple[tuple[Tensor, Tensor], ...]] = []  # per block: the whole copies its step writes back
        rules, settings = rules_for(group), settings_of(group)
        keys = [key for rule in rules for key in rule.state_keys]
        states: dict[str, list[Tensor]] = {key: [] for key in keys}
        group_layouts, group_blocks = settings.layouts, settings.blocks
        for i, p in enumerate(group["params"]):
            if complete:  # a zero state steps exactly as a fresh one when a gradient comes
                init_state(state[p], p, p, group_layouts[i], rules)
            if not has_grad[index + i]:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            _check_grad(group, i, index + i, p, grad)
            name, layout, sizes = param_name(group, i, index + i) if named else "", group_layouts[i], group_blocks[i]
            init_state(state[p], p, grad, layout, rules)
            # A fused projection's blocks step as separate parameters would: views of the tensor, its gradient,
            # its momentum buffer and the rules' state (which stay whole in the optimizer state); equal blocks as one
            # stack of them (off the exact path).
            whole = [p, grad, state[p][MOMENTUM_BUFFER], *(state[p][key] for key in keys)]
            back: tuple[tuple[Tensor, Tensor], ...] = ()
            if owner_blocks and sizes is not None and owns_blocks(whole, layout):
                owned = {key: [t] for key, t in zip(keys, whole[3:], strict=True)}
                buckets.append(Bucket(group, [p], [whole[1]], [whole[2]], [name], matrix_shape(p.shape), layout, 1,
                                      owned, settings, (), tuple(sizes)))
                continue
            if sizes is not None and is_dtensor(p):
                whole, back = gather_whole(whole)
            stacked, split = block_pieces(whole, layout, sizes, exact=settings.exact)
            for k, pieces in enumerate(split):
                params.append(pieces[0])
                grads.append(pieces[1])
                bufs.append(pieces[2])
                for key, piece in zip(keys, pieces[3:], strict=True):
                    states[key].append(piece)
                names.append(f"{name}[{k}]" if named and sizes and not stacked else name)
                layouts.append("stack" if stacked else layout)
                backs.append(back)
        index += len(group["params"])
        for ks in bucket_indices(settings, params, whole_dtensors=whole_dtensors, synced=synced, layouts=layouts):
            pick = [params[k] for k in ks], [grads[k] for k in ks], [bufs[k] for k in ks], [names[k] for k in ks]
            layout, shape = layouts[ks[0]], params[ks[0]].shape
            picked = {key: [tensors[k] for k in ks] for key, tensors in states.items()}
            matrices = matrix_shape(shape, layout), layout, matrices_in(shape, layout)
            gathered = tuple({id(pair[0]): pair for k in ks for pair in backs[k]}.values())
            buckets.append(Bucket(group, *pick, *matrices, picked, settings, gathered))
    return buckets


def owns_blocks(tensors: Sequence[Tensor], layout: str) -> bool:
    """Whether a parameter split into blocks can step on an owner rank (the sharded strategy's): a DTensor of the
    ``"flatten"`` layout whose rules' state (``tensors[3:]``, after the parameter, gradient and momentum buffer) is
    plain tensors, whole on every rank. Others are gathered whole on every rank (`gather_whole`)."""
    return layout == "flatten" and is_dtensor(tensors[0]) and not any(is_dtensor(t) for t in tensors[3:])


def gather_whole(tensors: Sequence[Tensor]) -> tuple[list[Tensor], tuple[tuple[Tensor, Tensor], ...]]:
    """A DTensor parameter's step tensors (the parameter, its gradient, momentum buffer and the rules' state) as
    whole plain copies, gathered on every rank (``full_tensor``), so that its blocks step exactly as on one process;
    with ``(DTensor, whole copy)`` of each tensor the step changes (all but the gradient), for `write_back`. A rule's
    plain state (one value per neuron, whole on every rank) is used as it is."""
    wholes, back = [], []
    for j, t in enumerate(tensors):
        if not is_dtensor(t):
            wholes.append(t)
            continue
        full = cast("DTensor", t).full_tensor()
        full = full.clone() if full._base is not None else full  # its own base: its blocks' ``_base`` (diagnostics)
        wholes.append(full)
        if j != 1:
            back.append((t, full))
    return wholes, tuple(back)


def write_back(buckets: Sequence[Bucket]) -> None:
    """Each rank's shard of the whole copies a step changed (`gather_whole`) into its DTensors, once each."""
    from torch.distributed.tensor import distribute_tensor

    done: set[int] = set()
    for bucket in buckets:
        for target, full in bucket.gathered:
            if id(target) not in done:
                done.add(id(target))
                placed = cast("DTensor", target)
                shard = distribute_tensor(full, placed.device_mesh, placed.placements, src_data_rank=None)
                placed.to_local().copy_(shard.to_local())


def whole_chooser(buckets: Sequence[Bucket], diagnose: Chooser) -> Chooser:
    """``diagnose`` for the whole copies of gathered parameters too (`gather_whole`): a copy is chosen with its
    DTensor."""
    origin = {id(full): target for bucket in buckets for target, full in bucket.gathered}
    if not origin:
        return diagnose
    return lambda t: diagnose(origin.get(id(t), t))


def block_pieces(tensors: Sequence[Tensor], layout: str, sizes: Sequence[int] | None, *, exact: bool
                 ) -> tuple[bool, list[Sequence[Tensor]]]:
    """``tensors`` (a parameter and what steps with it, shaped alike) as the pieces that step as separate parameters
    would: their equal row blocks as one stack (``True``; off the ``exact`` path, `equal_blocks_as_stack`), else
    each block (`groups.split_blocks`; the whole tensors without ``sizes``), each piece one tensor per input."""
    stack = None if exact else equal_blocks_as_stack(tensors, layout, sizes)
    if stack is not None:
        return True, [stack]
    return False, list(zip(*(split_blocks(t, layout, sizes) for t in tensors), strict=True))


def equal_blocks_as_stack(tensors: Sequence[Tensor], layout: str, sizes: Sequence[int] | None) -> list[Tensor] | None:
    """A flattened parameter's equal row blocks (a grouped convolution's groups, a depthwise kernel's channels, q, k
    and v of one size) as one stack of matrices ``blocks x rows x cols``: views of ``tensors`` (the parameter, its
    gradient, momentum buffer and the rules' state), stepped as a stack of experts is, in one batched call instead
    of one view a block. ``None`` where there are no blocks or they differ in size, the layout is not ``"flatten"``,
    or a tensor's memory cannot be viewed so (a channels-last kernel): then the blocks go one by one."""
    if sizes is None or layout != "flatten" or len(sizes) < 2 or len(set(sizes)) != 1:
        return None
    if any(is_dtensor(t) for t in tensors):
        return None
    try:
        return [t.view(len(sizes), sizes[0], -1) for t in tensors]
    except RuntimeError:  # not viewable row by row
        return None


def init_state(param_state: dict[str, Any], param: Tensor, like: Tensor, layout: str,
               rules: Sequence[UpdateRule]) -> None:
    """A parameter's state before its first step, where it has none yet: its momentum buffer (zeros like ``like``:
    the gradient, or the parameter itself) and each of its group's rules' state (`UpdateRule.new_state`)."""
    if MOMENTUM_BUFFER not in param_state:
        param_state[MOMENTUM_BUFFER] = torch.zeros_like(like, memory_format=torch.preserve_format)
    for rule in rules:
        if any(key not in param_state for key in rule.state_keys):
            for key, tensor in rule.new_state(param, layout).items():
                param_state.setdefault(key, tensor)


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


def orthogonalise(settings: GroupSettings, matrices: Tensor) -> Tensor:
    """Newton-Schulz of a ``(k, m, n)`` stack with a param group's settings, in one call: Gram Newton-Schulz
    where `uses_gram`, else the standard iteration. A lone matrix (``k == 1``) takes the 2D path, whose
    kernels are ``torch.optim.Muon``'s (bit-identical results). Returns ``(k, m, n)`` in ``ns_dtype``."""
    gram = settings.uses_gram((matrices.size(-2), matrices.size(-1)))
    iterate = gram_newton_schulz if gram else zeropower_via_newtonschulz
    if len(matrices) == 1:
        return iterate(matrices[0], **settings.ns_kwargs).unsqueeze(0)
    return iterate(matrices, **settings.ns_kwargs)


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

    full = orthogonalise(bucket.settings, update.full_tensor().reshape(-1, *bucket.shape))
    return distribute_tensor(full.reshape(update.shape), update.device_mesh, update.placements, src_data_rank=None)


def _orthogonalise_as_stored(bucket: Bucket, updates: list[Tensor]) -> list[Tensor]:
    """The bucket's matrices one after another, as the parameters hold them (a stack's matrices together)."""
    matrices = (-1, *bucket.shape)
    stack = updates[0].reshape(matrices) if len(updates) == 1 else torch.cat([u.reshape(matrices) for u in updates])
    orthogonal = orthogonalise(bucket.settings, stack)
    if bucket.per_param == 1:
        return list(orthogonal.unbind(0))
    return list(orthogonal.reshape(len(updates), bucket.per_param, *bucket.shape).unbind(0))


def _orthogonalise_wide(buckets: Sequence[Bucket], updates: Sequence[list[Tensor]]) -> list[list[Tensor]]:
    """One batched call on a stack of the matrices in their wide orientation: one pass casts (and transposes
    the tall ones) into the stack, so every matmul of the iteration reads contiguous wide matrices (torch.stack,
    then a cast, measured a second full copy; transposed operands, more copies inside the matmuls)."""
    settings, (m, n) = buckets[0].settings, buckets[0].shape
    wide = (min(m, n), max(m, n))
    tall = [b.shape[0] > b.shape[1] for b in buckets]
    sources = [
        u.reshape(b.shape).mT if t else u.reshape(b.shape)
        for b, us, t in zip(buckets, updates, tall, strict=True)
        for u in us
    ]
    stack = torch.empty(len(sources), *wide, dtype=settings.ns_dtype, device=sources[0].device)
    torch._foreach_copy_(list(stack.unbind(0)), sources)
    orthogonal = orthogonalise(settings, stack).unbind(0)
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
        group, settings, (m, n) = bucket.group, bucket.settings, bucket.shape
        if bucket.per_param != 1 or settings.exact or is_dtensor(bucket.params[0]):
            batches.append([j])
            continue
        device = bucket.params[0].device
        key = (id(group), min(m, n), max(m, n), device)
        nbytes = len(bucket.params) * m * n * settings.ns_dtype.itemsize
        if key in open_batches and open_batches[key][1] + nbytes <= settings.batch_cap(device):
            batch, used = open_batches[key]
            batch.append(j)
            open_batches[key] = (batch, used + nbytes)
        else:
            batches.append([j])
            open_batches[key] = (batches[-1], nbytes)
    return batches


def rule_updates(bucket: Bucket, updates: list[Tensor], rules: Sequence[UpdateRule]) -> list[Tensor]:
    """The whole orthogonalised updates of a bucket after its group's rules (`UpdateRule.update`), in order.
    DTensor updates (the fallback that gathers sharded matrices whole on every rank) are changed whole and
    sharded again."""
    for rule in rules:
        if type(rule).update is UpdateRule.update:  # a rule that does not change the update (a decay rule)
            continue
        if is_dtensor(updates[0]):
            updates = _whole_dtensor_update(rule, bucket, updates)
        else:
            updates = rule.update(bucket, updates)
    return updates


def _whole_dtensor_update(rule: UpdateRule, bucket: Bucket, updates: list[Tensor]) -> list[Tensor]:
    """`UpdateRule.update` on the whole matrices of DTensor updates, sharded again as they were; a rule's state that
    is a DTensor (shaped like its parameter) is gathered whole for it too, and each rank keeps its shard after."""
    from torch.distributed.tensor import distribute_tensor

    def whole(t: Tensor) -> Tensor:
        return cast("DTensor", t).full_tensor() if is_dtensor(t) else t

    def shard(full: Tensor, like: Tensor) -> DTensor:
        placed = cast("DTensor", like)
        return distribute_tensor(full, placed.device_mesh, placed.placements, src_data_rank=None)

    states = {key: [whole(t) for t in tensors] for key, tensors in bucket.states.items()}
    wholes = rule.update(bucket._replace(states=states), [whole(u) for u in updates])
    for key, tensors in bucket.states.items():
        for t, full in zip(tensors, states[key], strict=True):
            if is_dtensor(t):
                cast("DTensor", t).to_local().copy_(shard(full, t).to_local())
    return [shard(w, u) for w, u in zip(wholes, updates, strict=True)]


def apply(bucket: Bucket, orthogonal: list[Tensor], ruled: bool = False) -> None:
    """The group's update rules on the whole orthogonalised updates (`rule_updates`; unless ``ruled`` says they
    ran: `apply_shards`), then decoupled weight decay with the base lr (a rule's own `UpdateRule.decay` where one
    of the group's rules has one, else ``p * (1 - lr * weight_decay)``), then the shape-adjusted step."""
    group, rules = bucket.group, rules_for(bucket.group)
    if not ruled:
        orthogonal = rule_updates(bucket, orthogonal, rules)
    # 2D updates go in as they are (a tall one is a transposed view: no copy); ND ones are unflattened.
    shaped = [o if o.shape == p.shape else o.reshape(p.shape) for o, p in zip(orthogonal, bucket.params, strict=True)]
    coefficient = lr_value(group["lr"]) * group["weight_decay"]
    decayed = bool(coefficient) and any(rule.decay(bucket.params, shaped, coefficient) for rule in rules)
    if not decayed and 1 - coefficient != 1.0:
        decay(bucket.params, 1 - coefficient)
    torch._foreach_add_(bucket.params, shaped, alpha=-bucket.effective_lr)


def decay(params: list[Tensor], factor: float) -> None:
    """``p <- factor * p`` for each of ``params`` (one dtype: a bucket's). ``torch._foreach_mul_`` with a Python
    scalar first rounds the scalar to a 16-bit tensor's dtype (torch 2.13: ``1 - 0.002`` becomes ``0.99609375`` in
    bf16, twice the decay asked for; ``1 - 2e-4`` becomes 1, none), where ``Tensor.mul_`` multiplies in float32 as
    ``torch.optim.Muon`` does; so 16-bit parameters are multiplied one by one."""
    if params[0].dtype.itemsize >= 4:
        torch._foreach_mul_(params, factor)
    else:
        for p in params:
            p.mul_(factor)


def apply_shards(bucket: Bucket, shards: list[Tensor], statistics: dict[str, list[tuple[Tensor, ...]]],
                 sharded: Sequence[Tensor]) -> None:
    """`apply` on this rank's shards of a bucket's updates (``bucket``: the local one), each rule changing them
    from the whole matrices' statistics their owners computed (``statistics``: by rule key, one tuple per
    parameter; a rule without any is absent). ``sharded``: the DTensor parameters, for where each shard lies."""
    for rule in rules_for(bucket.group):
        if type(rule).update is UpdateRule.update and type(rule).update_shards is UpdateRule.update_shards:
            continue
        given = statistics.get(rule.key) or [()] * len(shards)
        shards = rule.update_shards(bucket, shards, given, sharded)
    apply(bucket, shards, ruled=True)


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
        ParamDiagnostics(bucket.names[j], _own_shape(bucket.params[j]), lr, error, r)
        for j, error, r in zip(chosen, errors, rms, strict=True)
    ]


def _own_shape(p: Tensor) -> tuple[int, ...]:
    """A parameter's shape as diagnostics show it: its own, also where it steps as a stack view of its equal blocks
    (`equal_blocks_as_stack`); a block's where it steps block by block."""
    base = p._base
    return tuple(base.shape if base is not None and base.numel() == p.numel() else p.shape)


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
        resolved=settings_of(group),
    )
    return orthogonalise_buckets([bucket], [momentum(bucket)])[0][0].float()
