"""`Muon`: momentum, then Newton-Schulz orthogonalisation, for the hidden matrices of a network.

A drop-in superset of ``torch.optim.Muon``: the same constructor arguments,
defaults, maths and state key (``momentum_buffer``), so a config or a state
dict can move between the two for 2D parameters. Beyond it:

- parameters with more than two dimensions (conv kernels) are orthogonalised
  as the flattened ``(shape[0], prod(shape[1:]))`` matrix, and their learning
  rate is adjusted for that flattened shape;
- matrices of the same shape are orthogonalised together in one batched call
  (up to ``ns_batch_bytes`` per call), and the elementwise work uses
  ``torch._foreach_*`` kernels;
- the Newton-Schulz compute dtype is a choice (``ns_dtype``);
- ``adjust_lr_fn`` also offers ``"spectral"`` and ``"none"``;
- on request, a step records how orthogonal each update was
  (`Muon.record_diagnostics`), at no cost on other steps.

Only hidden-layer matrices belong here. Embeddings, the output head, norms,
biases and every other parameter with fewer than two dimensions belong to
AdamW: `lightning_muon.route_parameters` sorts them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.distributed import (
    World,
    any_rank,
    assign_owners,
    exchange,
    gather_to_owners,
    is_dtensor,
    replicated_world,
    scatter_from_owners,
    sharded_world,
)
from lightning_muon.newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    ns_flops,
    orthogonality_error,
    zeropower_via_newtonschulz,
)

__all__ = ["Muon", "ParamDiagnostics", "adjust_lr", "ADJUST_LR_FNS"]

#: Accepted values of ``adjust_lr_fn`` (``None`` means ``"original"``).
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral", "none")

#: CPU matmuls reach their peak on one matrix once it is about 1 MiB in bf16
#: (measured: batching 768x2304 matrices ran at 0.8x), while small matrices
#: gain 1.7-2.3x from batching; accelerators gain at every size.
_DEFAULT_BATCH_BYTES = {"cpu": 1 << 20}
_DEFAULT_BATCH_BYTES_ACCELERATOR = 1 << 28


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The ``(rows, cols)`` Muon works on: ``(shape[0], prod(shape[1:]))``."""
    return shape[0], math.prod(shape[1:])


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


class _Job(NamedTuple):
    """Same-shape matrices of one group, orthogonalised in one (batched) Newton-Schulz call."""

    group: dict[str, Any]
    params: list[Tensor]
    grads: list[Tensor]
    bufs: list[Tensor]
    names: list[str]
    shape: tuple[int, int]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ns_dtype(group: dict[str, Any]) -> torch.dtype:
    """A group's Newton-Schulz dtype (stored by name; a torch.dtype from older state dicts works too)."""
    dtype = group["ns_dtype"]
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype.removeprefix("torch."))


def scalar(x: float | Tensor) -> float:
    """A learning rate (or any 1-element number) as a Python float: ``lr`` may be a tensor."""
    return x.item() if isinstance(x, Tensor) else float(x)


def _step_lr(job: _Job) -> float:
    """The shape-adjusted learning rate of a job's matrices."""
    return adjust_lr(scalar(job.group["lr"]), job.group["adjust_lr_fn"], job.shape)


def _ns_kwargs(group: dict[str, Any]) -> dict[str, Any]:
    """`zeropower_via_newtonschulz`'s settings for a param group."""
    return {
        "ns_coefficients": group["ns_coefficients"],
        "ns_steps": group["ns_steps"],
        "eps": group["eps"],
        "dtype": _ns_dtype(group),
    }


def _measure(updates: Tensor, step_lr: float) -> tuple[Tensor, Tensor]:
    """Orthogonality error and applied-update RMS (``step_lr * O``) of a ``(k, m, n)`` stack, in float32."""
    stack = updates.float()
    return orthogonality_error(stack), stack.pow(2).mean(dim=(-2, -1)).sqrt() * step_lr


class Muon(Optimizer):
    """Muon: SGD-momentum whose update is orthogonalised by Newton-Schulz iterations.

    For every parameter ``p`` with gradient ``g`` and momentum buffer ``B``
    (exactly as ``torch.optim.Muon``)::

        B <- momentum * B + (1 - momentum) * g          (B.lerp_(g, 1 - momentum))
        U <- (1 - momentum) * g + momentum * B  if nesterov else B
        O <- NewtonSchulz(U viewed as shape[0] x prod(shape[1:]))
        p <- p * (1 - lr * weight_decay)
        p <- p - adjust_lr(lr, adjust_lr_fn, p.shape) * O

    Args:
        params: parameters, ``named_parameters()`` or param groups (extra keys
            such as ``name`` are kept). Every parameter needs at least 2 dimensions.
        lr: learning rate (default: 1e-3).
        weight_decay: decoupled weight decay, applied with the unadjusted lr (default: 0.1).
        momentum: momentum factor (default: 0.95).
        nesterov: use Nesterov momentum (default: True).
        ns_coefficients: ``(a, b, c)`` of the quintic iteration (default: Keller Jordan's).
        eps: floor of the norm that normalises each matrix (default: 1e-7).
        ns_steps: Newton-Schulz iterations (default: 5).
        adjust_lr_fn: shape scaling of the lr, see `adjust_lr`: ``None``/``"original"``,
            ``"match_rms_adamw"``, ``"spectral"`` or ``"none"`` (default: None).
        ns_dtype: compute dtype of Newton-Schulz (default: ``torch.bfloat16``, as
            torch; ``torch.float32`` where bf16 matmuls are slow); a name such as
            ``"float32"`` is accepted too.
        ns_batch_bytes: most bytes (in ``ns_dtype``) of one batched Newton-Schulz
            call over same-shape matrices; ``0`` orthogonalises one matrix at a
            time, exactly as ``torch.optim.Muon``. Default ``None``: 1 MiB on
            CPU, 256 MiB on accelerators.
        split_ns: under DDP (an initialised process group of several ranks and
            plain, replicated parameters) each rank orthogonalises a share of
            the matrices, balanced by FLOPs, and the results are all-gathered
            (one copy of the updates in ``ns_dtype``); every rank still keeps
            every momentum buffer. Under FSDP2 (DTensor parameters sharded on
            dim 0 over one mesh) each matrix's shards are sent to an owner rank,
            which orthogonalises the whole matrix and sends every rank back its
            rows; momentum stays sharded. ``False``: every rank does all the
            work, as ``torch.optim.Muon`` (under FSDP2 every rank gathers and
            orthogonalises every whole matrix). Newton-Schulz never runs on a shard.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        ns_batch_bytes: int | None = None,
        split_ns: bool = True,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate lr: {lr} (must be >= 0)")
        if not 0.0 <= momentum:
            raise ValueError(f"Invalid momentum value: {momentum} (must be >= 0)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid eps value: {eps} (must be >= 0)")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Invalid adjust_lr_fn: {adjust_lr_fn!r} (must be None or one of {ADJUST_LR_FNS})")
        if len(tuple(ns_coefficients)) != 3:
            raise ValueError(f"Invalid ns_coefficients: {ns_coefficients!r} (must be three numbers (a, b, c))")
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
            raise ValueError(f"Invalid ns_steps: {ns_steps!r} (must be an int in [0, 100))")
        if isinstance(ns_dtype, str):  # "bfloat16" or "torch.bfloat16", as YAML and saved hparams spell it
            ns_dtype = getattr(torch, ns_dtype.removeprefix("torch."), ns_dtype)
        if not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
            raise ValueError(f"Invalid ns_dtype: {ns_dtype!r} (must be a floating dtype, e.g. torch.bfloat16)")
        if ns_batch_bytes is not None and (
            isinstance(ns_batch_bytes, bool) or not isinstance(ns_batch_bytes, int) or ns_batch_bytes < 0
        ):
            raise ValueError(f"Invalid ns_batch_bytes: {ns_batch_bytes!r} (must be None or an int >= 0)")

        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            # Kept by name: torch.distributed.checkpoint cannot save a torch.dtype in param groups.
            "ns_dtype": _dtype_name(ns_dtype),
            "ns_batch_bytes": ns_batch_bytes,
        }
        #: Split the Newton-Schulz work across ranks: under DDP each rank orthogonalises a share of the
        #: matrices (results all-gathered); under FSDP2 each matrix is orthogonalised on one owner rank.
        self.split_ns = split_ns
        #: Bytes this rank put into the last distributed step's exchanges, its share to itself included
        #: (0 when nothing was exchanged).
        self.last_exchange_bytes = 0
        self._exchange_buffers: dict = {}
        self._diagnose: Callable[[Tensor], bool] | None = None
        #: What the last step that recorded diagnostics did, one entry per diagnosed matrix.
        self.diagnostics: list[ParamDiagnostics] = []
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, refusing parameters with fewer than 2 dimensions."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        first_index = sum(len(g["params"]) for g in self.param_groups[:-1])
        for i, p in enumerate(group["params"]):
            if p.ndim < 2:
                self.param_groups.pop()  # refuse the whole group, as if it had never been added
                raise ValueError(
                    f"Muon got {self._describe(group, i, first_index + i)} of shape {tuple(p.shape)}: "
                    "Muon orthogonalises matrices, so every parameter needs at least 2 dimensions. "
                    "Optimize biases, norms, scalars and embeddings with AdamW "
                    "(lightning_muon.route_parameters splits a model for you)."
                )

    @staticmethod
    def _describe(group: dict[str, Any], i: int, index: int) -> str:
        names = group.get("param_names")
        return f"parameter `{names[i]}` (index {index})" if names else f"parameter {index}"

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A state dict saved by torch.optim.Muon has none of our extra keys: keep this optimizer's own.
        for group in self.param_groups:
            group.setdefault("ns_dtype", self.defaults.get("ns_dtype", "bfloat16"))
            group.setdefault("ns_batch_bytes", self.defaults.get("ns_batch_bytes"))
        self.__dict__.setdefault("_diagnose", None)
        self.__dict__.setdefault("split_ns", True)
        self.__dict__.setdefault("last_exchange_bytes", 0)
        self.__dict__.setdefault("_exchange_buffers", {})
        self.__dict__.setdefault("diagnostics", [])

    def effective_lr(self, param: Tensor) -> float:
        """The learning rate `param` really gets: its group's ``lr`` after `adjust_lr`."""
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return adjust_lr(scalar(group["lr"]), group["adjust_lr_fn"], param.shape)
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not in this optimizer")

    # ------------------------------------------------------------- diagnostics

    def record_diagnostics(self, params: Iterable[Tensor] | None = None) -> None:
        """Record, during the next `step` only, how orthogonal each update is.

        After that step, `diagnostics` holds one `ParamDiagnostics` per matrix
        that had a gradient (only those in ``params`` when given). The error is
        computed from the orthogonalised update the step already made (one
        ``r x r`` Gram matrix per parameter); steps without a request do no
        diagnostic work at all.
        """
        if params is None:
            self._diagnose = lambda p: True
        else:
            chosen = {id(p) for p in params}
            self._diagnose = lambda p: id(p) in chosen

    def clear_diagnostics(self) -> None:
        """Forget recorded diagnostics and any request not yet answered by a step."""
        self._diagnose = None
        self.diagnostics = []

    # --------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        diagnose, self._diagnose = self._diagnose, None
        if diagnose is not None:
            self.diagnostics = []
        every = [p for group in self.param_groups for p in group["params"]]
        sharded = sharded_world(every) if self.split_ns else None
        world = replicated_world(every) if self.split_ns and every and sharded is None else None
        has_grad = [p.grad is not None for p in every]
        if sharded or world:
            # Every rank must build the same jobs: a gradient missing on one rank is zero there.
            has_grad = any_rank(has_grad, every[0].device, (sharded or world).group)
        jobs, index = [], 0
        for group in self.param_groups:
            params, grads, bufs, names = [], [], [], []
            for i, p in enumerate(group["params"]):
                if not has_grad[index + i]:
                    continue
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                self._check_grad(group, i, index + i, p, grad)
                params.append(p)
                grads.append(grad)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
                names.append(self._name(group, i, index + i) if diagnose is not None else "")
            index += len(group["params"])
            for bucket in self._buckets(group, params, whole_dtensors=sharded is None, synced=bool(sharded or world)):
                pick = [params[k] for k in bucket], [grads[k] for k in bucket], [bufs[k] for k in bucket]
                jobs.append(_Job(group, *pick, [names[k] for k in bucket], matrix_shape(params[bucket[0]].shape)))

        if sharded is not None:
            self._step_sharded(jobs, sharded, diagnose)
        elif world is None:
            # Job by job, so a matrix's buffer and gradient are still in cache for its whole update
            # (on CPU, sweeping every buffer first and orthogonalising afterwards measured slower).
            for job in jobs:
                self._apply(job, self._orthogonalise(job.group, self._momentum(job), job.shape), diagnose)
        else:
            self._step_split(jobs, world, diagnose)
        return loss

    def _step_split(self, jobs: list[_Job], world: World, diagnose: Callable[[Tensor], bool] | None) -> None:
        """Each rank orthogonalises its share of the jobs; the results are all-gathered; all apply all."""
        if not jobs:  # the same on every rank: which parameters have gradients was agreed above
            return
        owners = assign_owners([ns_flops(*job.shape) * len(job.params) for job in jobs], world.size)
        local = {}
        for j, job in enumerate(jobs):
            if owners[j] == world.rank:
                local[j] = self._orthogonalise(job.group, self._momentum(job), job.shape)
            else:  # every rank keeps every momentum buffer; only the owner needs the update itself
                self._momentum(job, update=False)
        layouts = [(len(job.params), job.shape, _ns_dtype(job.group)) for job in jobs]
        device = jobs[0].params[0].device
        gathered = exchange(local, owners, layouts, world, device, self._exchange_buffers)
        self.last_exchange_bytes = int(sum(t.numel() * t.element_size() for ts in local.values() for t in ts))
        for job, orthogonal in zip(jobs, gathered):
            self._apply(job, orthogonal, diagnose)

    def _step_sharded(self, jobs: list[_Job], world: World, diagnose: Callable[[Tensor], bool] | None) -> None:
        """FSDP2: each job's row shards go to its owner rank, which orthogonalises the whole matrices
        and sends every rank back its rows of the result; every rank applies its own rows."""
        self.last_exchange_bytes = 0
        if not jobs:  # the same on every rank: which parameters have gradients was agreed above
            return
        # The local shards (views: in-place updates reach the DTensors) do all the elementwise work.
        local = [
            job._replace(
                params=[p.to_local() for p in job.params],
                grads=[g.to_local() for g in job.grads],
                bufs=[b.to_local() for b in job.bufs],
            )
            for job in jobs
        ]
        owners = assign_owners([ns_flops(*job.shape) * len(job.params) for job in jobs], world.size)
        layouts = [(len(job.params), job.shape, _ns_dtype(job.group)) for job in jobs]
        shards = [self._momentum(job) for job in local]
        whole = gather_to_owners(shards, owners, layouts, world)
        results = {j: self._orthogonalise_stack(jobs[j].group, stack) for j, stack in whole.items()}
        device = local[0].params[0].device
        mine = scatter_from_owners(results, owners, layouts, world, device)
        self.last_exchange_bytes = sum(
            s.numel() * layout[2].itemsize for ss, layout in zip(shards, layouts) for s in ss
        ) + sum(r.numel() * r.element_size() for r in results.values())
        for job, orthogonal in zip(local, mine):
            self._apply(job, orthogonal, None)
        if diagnose is not None:
            self._record_sharded(jobs, results, world, diagnose)

    def _record_sharded(
        self, jobs: list[_Job], results: dict[int, Tensor], world: World, diagnose: Callable[[Tensor], bool]
    ) -> None:
        """Owners measure the whole updates they computed; one all-reduce gives every rank every number."""
        chosen = [[i for i, p in enumerate(job.params) if diagnose(p)] for job in jobs]
        starts = [0]
        for picked in chosen:
            starts.append(starts[-1] + len(picked))
        values = torch.zeros(starts[-1], 2, device=jobs[0].params[0].device)
        for j, stack in results.items():
            if chosen[j]:
                errors, rms = _measure(stack[chosen[j]], _step_lr(jobs[j]))
                values[starts[j] : starts[j + 1]] = torch.stack([errors, rms], dim=1)
        torch.distributed.all_reduce(values, group=world.group)
        for j, job in enumerate(jobs):
            for row, i in zip(values[starts[j] : starts[j + 1]], chosen[j]):
                p = job.params[i]
                self.diagnostics.append(ParamDiagnostics(job.names[i], tuple(p.shape), _step_lr(job), row[0], row[1]))

    @staticmethod
    def _momentum(job: _Job, update: bool = True) -> list[Tensor]:
        """Update the momentum buffers; return the tensors to orthogonalise (Nesterov or the buffers)."""
        momentum = job.group["momentum"]
        torch._foreach_lerp_(job.bufs, job.grads, 1 - momentum)
        if not update:
            return []
        # A fresh tensor when nesterov; otherwise the buffer itself, which Newton-Schulz only reads
        # (it copies into ns_dtype first).
        return torch._foreach_lerp(job.grads, job.bufs, momentum) if job.group["nesterov"] else job.bufs

    def _apply(self, job: _Job, orthogonal: list[Tensor], diagnose: Callable[[Tensor], bool] | None) -> None:
        """Decoupled weight decay with the base lr, then the shape-adjusted orthogonalised step."""
        lr = scalar(job.group["lr"])
        decay = 1 - lr * job.group["weight_decay"]
        step_lr = _step_lr(job)
        if decay != 1.0:
            torch._foreach_mul_(job.params, decay)
        # 2D updates go in as they are (a tall one is a transposed view: no copy); ND ones are unflattened.
        shaped = [o if o.shape == p.shape else o.reshape(p.shape) for o, p in zip(orthogonal, job.params)]
        torch._foreach_add_(job.params, shaped, alpha=-step_lr)
        if diagnose is not None:
            self._record(job, orthogonal, step_lr, diagnose)

    def _check_grad(self, group: dict[str, Any], i: int, index: int, p: Tensor, grad: Tensor) -> None:
        if torch.is_complex(p) or torch.is_complex(grad):
            raise RuntimeError(f"Muon does not support complex parameters: {self._describe(group, i, index)}")
        if grad.is_sparse:
            raise RuntimeError(f"Muon does not support sparse gradients: {self._describe(group, i, index)}")

    @staticmethod
    def _name(group: dict[str, Any], i: int, index: int) -> str:
        names = group.get("param_names")
        return names[i] if names else f"{group.get('name', 'params')}.{index}"

    @staticmethod
    def _buckets(
        group: dict[str, Any], params: list[Tensor], whole_dtensors: bool = True, synced: bool = False
    ) -> list[list[int]]:
        """Indices of ``params`` in runs of same flattened shape, dtypes and device, within the byte cap.

        With ``whole_dtensors``, sharded (DTensor) matrices are orthogonalised one at a time, each
        gathered whole on every rank (the fallback for layouts other than FSDP2's). ``synced`` (ranks
        exchanging work) leaves gradient dtypes out: every rank must build the same buckets, and a
        gradient missing on one rank is zeros there in the parameter's dtype.
        """
        same: dict[tuple, list[int]] = defaultdict(list)
        for k, p in enumerate(params):
            grad_dtype = p.grad.dtype if p.grad is not None and not synced else p.dtype
            key = (matrix_shape(p.shape), p.dtype, grad_dtype, p.device)
            same[(*key, k) if whole_dtensors and is_dtensor(p) else key].append(k)
        buckets = []
        for (shape, _, _, device, *_), ks in same.items():
            cap = group["ns_batch_bytes"]
            if cap is None:
                cap = _DEFAULT_BATCH_BYTES.get(device.type, _DEFAULT_BATCH_BYTES_ACCELERATOR)
            per_matrix = math.prod(shape) * _ns_dtype(group).itemsize
            per_call = max(1, cap // per_matrix)
            buckets.extend(ks[i : i + per_call] for i in range(0, len(ks), per_call))
        return buckets

    @staticmethod
    def _orthogonalise(group: dict[str, Any], updates: list[Tensor], shape: tuple[int, int]) -> list[Tensor]:
        kwargs = _ns_kwargs(group)
        if len(updates) == 1 and is_dtensor(updates[0]):
            # FSDP2: Newton-Schulz needs the whole matrix, never a shard. Gather it, orthogonalise,
            # and keep this rank's shard of the result (every rank computes the same full matrix).
            from torch.distributed.tensor import distribute_tensor

            update = updates[0]
            full = zeropower_via_newtonschulz(update.full_tensor().reshape(shape), **kwargs)
            shard = distribute_tensor(
                full.reshape(update.shape), update.device_mesh, update.placements, src_data_rank=None
            )
            return [shard]
        if len(updates) == 1:
            return [zeropower_via_newtonschulz(updates[0].reshape(shape), **kwargs)]
        stack = torch.stack([u.reshape(shape) for u in updates])
        return list(zeropower_via_newtonschulz(stack, **kwargs).unbind(0))

    @staticmethod
    def _orthogonalise_stack(group: dict[str, Any], stack: Tensor) -> Tensor:
        """Newton-Schulz of a ``(k, m, n)`` stack; a lone matrix takes the 2D path, as on one process."""
        if len(stack) == 1:
            return zeropower_via_newtonschulz(stack[0], **_ns_kwargs(group)).unsqueeze(0)
        return zeropower_via_newtonschulz(stack, **_ns_kwargs(group))

    def _record(
        self, job: _Job, orthogonal: list[Tensor], step_lr: float, diagnose: Callable[[Tensor], bool]
    ) -> None:
        chosen = [j for j, p in enumerate(job.params) if diagnose(p)]
        if not chosen:
            return
        matrices = [orthogonal[j] for j in chosen]
        if is_dtensor(matrices[0]):
            matrices = [m.full_tensor().reshape(job.shape) for m in matrices]
        errors, rms = _measure(torch.stack(matrices), step_lr)
        for j, err, r in zip(chosen, errors, rms):
            p = job.params[j]
            self.diagnostics.append(ParamDiagnostics(job.names[j], tuple(p.shape), step_lr, err, r))
