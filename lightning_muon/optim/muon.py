"""`Muon`: momentum, then Newton-Schulz orthogonalisation, for the hidden matrices of a network.

A drop-in superset of ``torch.optim.Muon``: the same constructor arguments,
defaults, maths and state key (``momentum_buffer``), so a config or a state
dict can move between the two for 2D parameters. Beyond it:

- parameters with more than two dimensions: conv kernels are orthogonalised
  as the flattened ``(shape[0], prod(shape[1:]))`` matrix (the default), stacks
  of matrices (MoE experts) each on its own, and a weight stored ``in x out``
  gets the lr of its real shape; a param group's ``matrix_layouts`` names the
  layout of each parameter (``"flatten"``, ``"stack"``, ``"in_out"``, ``"stack_in_out"``), and
  `lightning_muon.route_parameters` fills it in;
- a fused projection (``qkv``, ``gate_up_proj``, an LSTM's gates) or a grouped convolution's kernel (its groups)
  orthogonalised per block: a param group's ``matrix_blocks`` (one entry per parameter: ``None``, or the sizes of
  its row blocks along the output dim) steps each block exactly as a separate parameter holding it would (its own
  Newton-Schulz, its own lr scale); the momentum buffer stays whole. On DTensor parameters (FSDP2, HSDP, tensor
  parallelism) such a parameter goes whole to an owner rank that splits it (or, for the other layouts, is gathered
  whole on every rank), the same bits as one process;
- matrices of the same shape are orthogonalised together in one batched call
  (up to ``ns_batch_bytes`` per call), and the elementwise work uses
  ``torch._foreach_*`` kernels;
- the Newton-Schulz compute dtype is a choice (``ns_dtype``), by default the hardware's: bf16 where native,
  float32 where bf16 would be emulated;
- the update rule is a choice: NorMuon's per-neuron normalisation (``normuon_beta2``), and cautious
  weight decay (``cautious_weight_decay``), or a rule of your own, selected by its param-group key
  (`lightning_muon.optim.rules`: one class each);
- ``adjust_lr_fn`` also offers ``"spectral"`` and ``"none"``;
- on request, a step records how orthogonal each update was
  (`Muon.record_diagnostics`), at no cost on other steps;
- a parameter that is no longer the matrix it was given as (DeepSpeed's ZeRO writes flat 1-D buffers into
  ``group["params"]``; FSDP1 flattens parameters) is refused at the step, before anything moves; FSDP1's flattened
  tensors are refused when given.

Only hidden-layer matrices belong here. Embeddings, the output head, norms,
biases and every other parameter with fewer than two dimensions belong to
AdamW: `lightning_muon.route_parameters` sorts them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.optim import _precision, groups
from lightning_muon.optim._bucket import Chooser, ParamDiagnostics
from lightning_muon.optim._choice import StrategyChoice, StrategyInfo
from lightning_muon.optim._dtensor import fsdp1_flattened
from lightning_muon.optim._given import GivenShapes
from lightning_muon.optim._strategies import EXCHANGE_ROUND_BYTES
from lightning_muon.optim.defaults import DEFAULT_GRAM_ASPECT, MUON_CLASS
from lightning_muon.optim.groups import ADJUST_LR_FNS, adjust_lr, is_count
from lightning_muon.optim.newton_schulz import NS_COEFFICIENT_SCHEDULES, NS_PRECONDITIONERS
from lightning_muon.optim.rules import CautiousWeightDecay, NorMuon, rules_for

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ADJUST_LR_FNS", "DEFAULT_GRAM_ASPECT", "EXCHANGE_ROUND_BYTES", "Muon", "ParamDiagnostics", "adjust_lr"]

#: Param group keys ``torch.optim.Muon`` does not have, with the value a group saved without them gets.
_OWN_GROUP_KEYS: dict[str, Any] = {
    "ns_dtype": MUON_CLASS.ns_dtype,
    "ns_batch_bytes": MUON_CLASS.ns_batch_bytes,
    "ns_gram_aspect": MUON_CLASS.ns_gram_aspect,
    "ns_precondition": MUON_CLASS.ns_precondition,
    "normuon_beta2": MUON_CLASS.normuon_beta2,
    "cautious_weight_decay": MUON_CLASS.cautious_weight_decay,
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _valid_coefficients(value: Any) -> bool:
    return value in NS_COEFFICIENT_SCHEDULES if isinstance(value, str) else len(tuple(value)) == 3


#: The constructor's checks, in order, as ``torch.optim.Muon`` words them: argument -> (its name in the message,
#: whether a value is valid, what it must be); an update rule's setting as the rule checks it (`UpdateRule.valid`).
#: Stricter than torch on ``momentum`` (at 1 the buffer never takes in a gradient, so the matrices never move;
#: above 1 it grows without bound: NaN weights from finite gradients) and ``ns_steps`` (0 steps would apply the
#: normalised momentum itself, not an orthogonalised update).
_CHECKS: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "lr": ("learning rate lr", lambda v: 0.0 <= v, "must be >= 0"),
    "momentum": ("momentum value", lambda v: 0.0 <= v < 1.0, "must be in [0, 1); Keller Jordan's default is 0.95"),
    "weight_decay": ("weight_decay value", lambda v: 0.0 <= v, "must be >= 0"),
    "eps": ("eps value", lambda v: 0.0 <= v, "must be >= 0"),
    "adjust_lr_fn": (
        "adjust_lr_fn", lambda v: v is None or v in ADJUST_LR_FNS, f"must be None or one of {ADJUST_LR_FNS}"
    ),
    "ns_coefficients": (
        "ns_coefficients",
        _valid_coefficients,
        f"must be three numbers (a, b, c) or one of {sorted(NS_COEFFICIENT_SCHEDULES)}",
    ),
    "ns_gram_aspect": (
        "ns_gram_aspect", lambda v: v is None or (_is_number(v) and v >= 1), "must be None or a number >= 1"
    ),
    "ns_precondition": (
        "ns_precondition",
        lambda v: v is None or v in NS_PRECONDITIONERS,
        f"must be None or one of {NS_PRECONDITIONERS}",
    ),
    "ns_steps": ("ns_steps", lambda v: is_count(v) and v < 100, "must be an int in [1, 100); the default is 5"),
    "ns_dtype": (
        "ns_dtype",
        lambda v: v is None or (isinstance(v, torch.dtype) and v.is_floating_point),
        "must be None (by hardware) or a floating dtype, e.g. torch.bfloat16",
    ),
    "ns_batch_bytes": ("ns_batch_bytes", lambda v: v is None or is_count(v, minimum=0), "must be None or an int >= 0"),
    **{rule.key: (rule.key, rule().valid, rule.must) for rule in (NorMuon, CautiousWeightDecay)},
}


def _group_defaults(arguments: dict[str, Any]) -> dict[str, Any]:
    """The constructor's group settings, checked (`_CHECKS`, quoting a bad value), as param groups keep them:
    ``ns_coefficients`` a tuple or a schedule's name, ``ns_dtype`` by name (torch.distributed.checkpoint cannot
    save a ``torch.dtype`` in param groups)."""
    lr = arguments["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
    ns_dtype = arguments["ns_dtype"]
    if isinstance(ns_dtype, str):  # "bfloat16" or "torch.bfloat16", as YAML and saved hparams spell it
        ns_dtype = _precision.dtype_named(ns_dtype) or ns_dtype  # an unknown name stays, to be refused
    for name, (what, valid, must) in _CHECKS.items():
        value = ns_dtype if name == "ns_dtype" else arguments[name]
        if not valid(value):
            raise ValueError(f"Invalid {what}: {value!r} ({must})")
    coefficients = arguments["ns_coefficients"]
    return {
        **arguments,
        "ns_coefficients": coefficients if isinstance(coefficients, str) else tuple(coefficients),
        "ns_dtype": None if ns_dtype is None else _precision.dtype_name(ns_dtype),
    }


def _check_group(group: dict[str, Any], first_index: int, choice: StrategyChoice) -> None:
    """Refuse a param group Muon cannot take (`Muon.add_param_group`): a per-parameter list of the wrong length, an
    update rule's bad setting, two rules that each decay, a parameter it cannot step (named)."""
    count = len(group["params"])
    layouts = group.get(groups.MATRIX_LAYOUTS)
    if layouts is not None and (isinstance(layouts, str) or len(layouts) != count):
        raise ValueError(
            f"matrix_layouts must be a list with one of {groups.LAYOUTS} per parameter of the group ({count}), "
            f"got {layouts!r}"
        )
    blocks = group.get(groups.MATRIX_BLOCKS)
    if blocks is not None and (isinstance(blocks, str) or len(blocks) != count):
        raise ValueError(
            f"matrix_blocks must be a list with None or a list of block sizes per parameter of the group ({count}), "
            f"got {blocks!r}"
        )
    if group.get("ns_precondition") is not None and groups.on_exact_path(group):
        raise ValueError(
            f"ns_precondition={group['ns_precondition']!r} cannot run on the exact path (ns_batch_bytes=0 steps with "
            "torch.optim.Muon's kernels, which normalise by the Frobenius norm); set ns_batch_bytes=None or > 0, "
            "or ns_precondition=None"
        )
    if not (group.get("ns_precondition") is None or group["ns_precondition"] in NS_PRECONDITIONERS):
        raise ValueError(f"Invalid ns_precondition: {group['ns_precondition']!r} "
                         f"(must be None or one of {NS_PRECONDITIONERS})")
    chosen = rules_for(group)
    for rule in chosen:
        if not rule.valid(group[rule.key]):
            raise ValueError(f"Invalid {rule.key}: {group[rule.key]!r} ({rule.must})")
    decaying = [rule.key for rule in chosen if rule.decays]
    if len(decaying) > 1:
        raise ValueError(f"the update rules of {', '.join(decaying)} each decay the weights their own way; "
                         "choose one of them for the group")
    for i, (p, layout, sizes) in enumerate(zip(group["params"], groups.layouts_of(group), groups.blocks_of(group),
                                               strict=True)):
        problem = _param_refusal(choice, p, layout, sizes)
        if problem is not None:
            raise ValueError(
                f"Muon got {groups.describe_param(group, i, first_index + i)} of shape "
                f"{tuple(p.shape)}: " + problem
            )


def _refusal(p: Tensor, layout: str) -> str | None:
    """Why Muon cannot take ``p`` with this matrix layout, or ``None``."""
    if fsdp1_flattened(p):
        return (
            "FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) has flattened it (into a view of this rank's "
            "1-D shard, or one flat tensor per wrapped module), and Muon orthogonalises each matrix whole. Shard "
            "with FSDP2 instead: torch.distributed.fsdp.fully_shard (in Lightning, ModelParallelStrategy), whose "
            "parameters keep their shapes."
        )
    if p.ndim < 2:
        return (
            "Muon orthogonalises matrices, so every parameter needs at least 2 dimensions. "
            "Optimize biases, norms, scalars and embeddings with AdamW "
            "(lightning_muon.route_parameters splits a model for you)."
        )
    if layout not in groups.LAYOUTS:
        return f"its matrix layout {layout!r} is none of {groups.LAYOUTS}."
    if (layout in groups.STACKED and p.ndim < 3) or (layout == "in_out" and p.ndim != 2):
        return f"the layout {layout!r} needs {'3 or more' if layout in groups.STACKED else '2'} dimensions."
    return None


def _block_refusal(p: Tensor, layout: str, sizes: Any) -> str | None:
    """Why Muon cannot split ``p`` into these row blocks (a param group's ``matrix_blocks`` entry), or ``None``."""
    if sizes is None:
        return None
    if not groups.blocks_cover(p.shape, layout, sizes):
        rows = p.shape[groups.block_dim(layout)]
        return (
            f"its matrix_blocks {sizes!r} must be positive block sizes that add up to its {rows} output rows "
            f"(dim {groups.block_dim(layout)} for the layout {layout!r})."
        )
    return None


def _param_refusal(choice: StrategyChoice, p: Tensor, layout: str, sizes: Any) -> str | None:
    """Why a Muon whose strategy is chosen by ``choice`` cannot take ``p`` in this layout with these row blocks (a
    param group's ``matrix_blocks`` entry), or ``None``."""
    return _refusal(p, layout) or _block_refusal(p, layout, sizes) or choice.refusal(p)


class Muon(Optimizer):
    """Muon: SGD-momentum whose update is orthogonalised by Newton-Schulz iterations.

    For every parameter ``p`` with gradient ``g`` and momentum buffer ``B``
    (exactly as ``torch.optim.Muon``):

    ```text
    B <- momentum * B + (1 - momentum) * g          (B.lerp_(g, 1 - momentum))
    U <- (1 - momentum) * g + momentum * B  if nesterov else B
    O <- NewtonSchulz(U viewed as shape[0] x prod(shape[1:]))
    p <- p * (1 - lr * weight_decay)
    p <- p - adjust_lr(lr, adjust_lr_fn, p.shape) * O
    ```

    With ``normuon_beta2`` (NorMuon, Li et al. 2025), before the last two lines, for each neuron (row) ``i``
    of ``O``: ``v_i <- beta2 * v_i + (1 - beta2) * mean_j(O_ij**2)`` (state ``normuon_second_moment``,
    float32), ``O_i <- O_i / (sqrt(v_i) + 1e-8)``, then ``O`` is rescaled to the Frobenius norm it had.
    With ``cautious_weight_decay`` the decay applies only where ``p * O >= 0`` (the update already moves the
    entry toward zero).

    Examples:
        Muon on the hidden matrices only (`lightning_muon.route_parameters` picks them), AdamW on the rest:

        ```python
        import torch
        from torch import nn
        from lightning_muon import Muon, route_parameters

        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        routing = route_parameters(model)  # 0.weight, 2.weight to Muon (trace_roles would find 0 an input)
        muon = Muon(routing.groups("Muon"), lr=0.02, ns_dtype=torch.float32)  # the same bits on any machine
        adamw = torch.optim.AdamW(routing.groups("AdamW"), lr=3e-3)
        x = torch.randn(32, 16)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        muon.step()
        adamw.step()
        ```

    Args:
        params: parameters, ``named_parameters()`` or param groups (extra keys
            such as ``name`` are kept). Every parameter needs at least 2 dimensions.
        lr: learning rate.
        weight_decay: decoupled weight decay, applied with the unadjusted lr.
        momentum: momentum factor.
        nesterov: use Nesterov momentum.
        ns_coefficients: ``(a, b, c)`` of the quintic (default: Keller Jordan's), or ``"polar_express"``
            (Amsel et al. 2025: per-iteration coefficients, singular values much closer to 1), or
            ``"turbo_muon"`` (the schedule Turbo-Muon pairs with ``ns_precondition="aol"``).
        eps: floor of the norm that normalises each matrix.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: shape scaling of the lr, see `adjust_lr`: ``None``/``"original"``,
            ``"match_rms_adamw"``, ``"spectral"`` or ``"none"``.
        ns_dtype: compute dtype of Newton-Schulz; a name such as ``"float32"`` is accepted too. Default ``None``:
            by hardware, decided at the first step for the parameters' device, the same on every rank:
            ``torch.bfloat16`` (``torch.optim.Muon``'s) where the device computes it natively (CUDA from
            Ampere on, CPUs with AVX512-BF16 or AMX), ``torch.float32`` where bf16 would be emulated (AVX2
            CPUs: 24x faster there). Said once at INFO on the ``lightning_muon`` logger.
        ns_batch_bytes: most bytes (in ``ns_dtype``) of one batched Newton-Schulz call over same-shape
            matrices; ``0`` orthogonalises one matrix at a time, exactly as ``torch.optim.Muon``.
            Default ``None``: 1 MiB on CPU, 256 MiB on accelerators.
        ns_gram_aspect: matrices at least this many times longer than wide use Gram Newton-Schulz
            (the same iteration on the small Gram matrix, fewer FLOPs); ``None``: never; never on the
            exact path (``ns_batch_bytes=0``). The default, 3, is the aspect from
            which it measured faster.
        ns_precondition: ``None`` (default): each matrix is scaled by its Frobenius norm before the
            iteration. ``"aol"``: Turbo-Muon's AOL preconditioning (Boissin et al. 2025) instead: each row of
            the wide matrix scaled by one over the square root of its Gram row's absolute sum, that Gram
            reused by the first iteration (no extra product); small singular values start nearer to 1. The
            paper runs it with ``ns_coefficients="turbo_muon"`` and ``ns_steps=4``; with the default
            coefficients it does not replace a step (the optimizer guide's table).
            Standard and Gram iterations, every dtype and strategy; refused on the exact path
            (``ns_batch_bytes=0``, ``torch.optim.Muon``'s kernels).
        split_ns: under DDP (an initialised process group of several ranks and plain, replicated
            parameters) each rank orthogonalises a share of the matrices, balanced by FLOPs, and the
            results are all-gathered (one copy of the updates in ``ns_dtype``); every rank still keeps
            every momentum buffer. Under FSDP2 (DTensor parameters sharded on dim 0 over one mesh) each
            matrix's shards are sent to an owner rank, which orthogonalises the whole matrix and sends
            every rank back its rows; momentum stays sharded (HSDP: within each replica's shard group;
            tensor parallelism on a 1-D mesh: dim-0 and dim-1 shards, rows or columns travel; FSDP2 over
            tensor parallelism on a 2-D mesh: over all of its ranks, each rank's block travels).
            ``False``: every rank does all the work, as ``torch.optim.Muon`` (under FSDP2 every rank
            gathers and orthogonalises every whole matrix). Newton-Schulz never runs on a shard.
        process_group: the ranks that split the work of replicated (DDP) parameters (default: the default
            group). Without it (or ``device_mesh``) the path follows the default group: a step taken before
            ``init_process_group`` runs alone, and the first step after it chooses the split again.
        device_mesh: the mesh every DTensor parameter must live on, for FSDP2's owner ranks (1-D mesh),
            HSDP's (2-D: replicate, then shard) or FSDP2 over tensor parallelism's (2-D, sharded on both);
            default: the mesh the parameters share.
        exchange_round_bytes: most bytes of one FSDP2 exchange buffer per rank (the default is 64 MiB).
        normuon_beta2: ``None`` (default): plain Muon. A number in ``[0, 1)``: NorMuon, with this decay of
            each neuron's running mean squared update (0.95 in dion and the paper). Adds one float32 per
            row of each matrix to the state (``normuon_second_moment``); under DDP every rank updates every
            row's statistic from the gathered updates, as it does every momentum buffer. Under FSDP2 and
            tensor parallelism (DTensor parameters) each matrix's owner computes its rows' statistics from the
            whole matrix, one all-reduce shares them, and every rank keeps every row's second moment (one
            float32 a neuron: a plain tensor in the state, saved once in a distributed checkpoint).
        cautious_weight_decay: decay an entry only where it and its update have the same sign (dion's
            ``cautious_wd``, Chen et al. 2025); default ``False``: every entry decays.
    """

    #: Which parameters the next step diagnoses (`record_diagnostics`; ``None``: none).
    _diagnose: Chooser | None
    #: What the last step that recorded diagnostics did, one entry per diagnosed matrix.
    diagnostics: list[ParamDiagnostics]

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
        lr: float | Tensor = MUON_CLASS.lr,
        weight_decay: float = MUON_CLASS.weight_decay,
        momentum: float = MUON_CLASS.momentum,
        nesterov: bool = MUON_CLASS.nesterov,
        ns_coefficients: tuple[float, float, float] | str = MUON_CLASS.ns_coefficients,
        eps: float = MUON_CLASS.eps,
        ns_steps: int = MUON_CLASS.ns_steps,
        adjust_lr_fn: str | None = MUON_CLASS.adjust_lr_fn,
        *,
        ns_dtype: torch.dtype | str | None = MUON_CLASS.ns_dtype,
        ns_batch_bytes: int | None = MUON_CLASS.ns_batch_bytes,
        ns_gram_aspect: float | None = MUON_CLASS.ns_gram_aspect,
        ns_precondition: str | None = MUON_CLASS.ns_precondition,
        split_ns: bool = MUON_CLASS.split_ns,
        process_group: ProcessGroup | None = None,
        device_mesh: DeviceMesh | None = None,
        exchange_round_bytes: int = MUON_CLASS.exchange_round_bytes,
        normuon_beta2: float | None = MUON_CLASS.normuon_beta2,
        cautious_weight_decay: bool = MUON_CLASS.cautious_weight_decay,
    ) -> None:
        defaults = _group_defaults({
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype, "ns_batch_bytes": ns_batch_bytes, "ns_gram_aspect": ns_gram_aspect,
            "ns_precondition": ns_precondition, "normuon_beta2": normuon_beta2,
            "cautious_weight_decay": cautious_weight_decay,
        })
        #: Split the Newton-Schulz work across ranks: under DDP each rank orthogonalises a share of the
        #: matrices (results all-gathered); under FSDP2 each matrix is orthogonalised on one owner rank.
        self.split_ns = split_ns
        #: Where the Newton-Schulz work runs: the strategy, chosen at the first step (`StrategyChoice`).
        self._choice = StrategyChoice(process_group, device_mesh, exchange_round_bytes)
        self._given = GivenShapes()  # the shape each parameter was given as, checked at every step
        self._clear_records()
        super().__init__(params, defaults)

    def _clear_records(self) -> None:
        """No step taken yet: no exchange, no diagnostics."""
        #: Bytes this rank put into the last distributed step's exchanges, its share to itself included
        #: (0 when nothing was exchanged).
        self.last_exchange_bytes = 0
        self.clear_diagnostics()

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, refusing parameters with fewer than 2 dimensions (and bad layouts, blocks or update
        rule settings: `lightning_muon.optim.rules`)."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1], sum(len(g["params"]) for g in self.param_groups[:-1]), self._choice)
        except ValueError:
            self.param_groups.pop()  # refuse the whole group, as if it had never been added
            raise
        self._given.record(self.param_groups[-1]["params"])

    def __getstate__(self) -> dict[str, Any]:
        # torch's keeps defaults, state and param_groups: the settings of this optimizer travel too (a copy
        # chooses its own strategy at its first step; an explicit process group cannot be pickled).
        return {**super().__getstate__(), "split_ns": self.split_ns, "_choice": self._choice}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_given" not in self.__dict__:  # unpickled or copied: its tensors are checked at the first step
            self._given = GivenShapes()
        # A state dict saved by torch.optim.Muon has none of our extra keys: keep this optimizer's own.
        for group in self.param_groups:
            for key, default in _OWN_GROUP_KEYS.items():
                group.setdefault(key, self.defaults.get(key, default))
        if "diagnostics" not in self.__dict__:  # unpickled: no step taken yet
            self._clear_records()

    def effective_lr(self, param: Tensor) -> float:
        """The learning rate `param` really gets: its group's ``lr`` after `adjust_lr` (split into blocks by
        ``matrix_blocks``: its first block's)."""
        for group in self.param_groups:
            for p, lr in zip(group["params"], groups.group_effective_lrs(group), strict=True):
                if p is param:
                    return lr
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
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._given.check(self.param_groups, functools.partial(_param_refusal, self._choice))  # before any update
        diagnose, self._diagnose = self._diagnose, None
        every = [p for group in self.param_groups for p in group["params"]]
        stacks = any(layout in groups.STACKED for group in self.param_groups for layout in groups.layouts_of(group))
        strategy = self._choice.for_step(every, self.split_ns, stacks)
        _precision.settle(self.param_groups, self._choice.process_group)  # ns_dtype=None: by hardware, ranks agreed
        # The buckets carry each group's settings, resolved once (`_bucket.settings_of`), to every stage.
        diagnostics = strategy.run(strategy.buckets(self.param_groups, self.state, diagnose is not None), diagnose)
        self.last_exchange_bytes = strategy.exchanged_bytes
        if diagnose is not None:
            self.diagnostics = diagnostics
        return loss

    # ----------------------------------------------------------------- read-out

    @property
    def strategy(self) -> StrategyInfo | None:
        """Where the Newton-Schulz work of the last step ran (``None`` before the first step): this process alone,
        split over DDP ranks, or on FSDP2 / HSDP owner ranks, with the words of the rank-zero line that said it
        (`StrategyInfo`). Read-only; the same object until the optimizer chooses again."""
        return self._choice.info
