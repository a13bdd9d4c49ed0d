"""What a Muon param group's settings mean: matrix shapes and layouts, the effective lr, the Newton-Schulz dtype
and path, and how a parameter is named in messages.

Plain functions of a param group dict (``optimizer.param_groups[i]``), so they read ``torch.optim.Muon``'s
groups too (its groups lack ``lightning_muon.Muon``'s extra keys: the defaults apply). The optimizer, its
update maths, `lightning_muon.MuonMonitor` and the Lightning config all read groups through this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_muon.optim import _precision, _registry
from lightning_muon.optim._precision import dtype_name

__all__ = [
    "ADJUST_LR_FNS",
    "DEFAULT_BATCH_BYTES",
    "DEFAULT_BATCH_BYTES_ACCELERATOR",
    "LAYOUTS",
    "MATRIX_BLOCKS",
    "MATRIX_LAYOUTS",
    "NAME",
    "NORMUON_EPS",
    "PARAM_NAMES",
    "SECOND_MOMENT",
    "STACKED",
    "STORED_IN_OUT",
    "adjust_lr",
    "batch_cap",
    "block_dim",
    "blocks_cover",
    "blocks_of",
    "describe_param",
    "dtype_name",
    "fan_shape",
    "group_effective_lr",
    "group_effective_lrs",
    "is_count",
    "layouts_of",
    "lr_value",
    "matrices_in",
    "matrix_shape",
    "ns_dtype",
    "ns_dtype_line",
    "ns_settings",
    "on_exact_path",
    "param_name",
    "row_moment_shape",
    "split_blocks",
    "update_rule",
    "uses_gram",
]

#: The keys of a Muon param group beside its settings, the contract between `lightning_muon.route_parameters` (which
#: writes them), the optimizers and the pair (which read them): the group's name (``lr-Muon/<name>`` in the logs),
#: its parameters' names (torch's ``param_names``, from ``(name, tensor)`` pairs), their matrix layouts (`LAYOUTS`,
#: one per parameter) and their row blocks (``None`` or sizes, one per parameter: `split_blocks`).
NAME = "name"
#: See `NAME`.
PARAM_NAMES = "param_names"
#: See `NAME`.
MATRIX_LAYOUTS = "matrix_layouts"
#: See `NAME`.
MATRIX_BLOCKS = "matrix_blocks"

#: Accepted values of ``adjust_lr_fn`` (``None`` means ``"original"``).
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral", "none")

#: How a parameter's tensor holds its matrices (a param group's ``matrix_layouts``, one per parameter):
#: ``"flatten"`` (the default: a 2D weight, or a conv kernel seen as ``shape[0] x prod(shape[1:])``),
#: ``"stack"`` (a batch of matrices over the leading dims, e.g. MoE experts ``E x out x in``: each
#: orthogonalised on its own), ``"in_out"`` (a 2D weight stored ``in x out``, as transformers' ``Conv1D``:
#: Newton-Schulz does not care, the lr's shape scaling does) and ``"stack_in_out"`` (a stack whose matrices are
#: stored ``in x out``, as GPT-OSS's experts ``E x in x out``: each orthogonalised on its own, the lr from its real
#: ``out x in``).
LAYOUTS = ("flatten", "stack", "in_out", "stack_in_out")
#: A param group's ``matrix_blocks`` (one entry per parameter, ``None`` or a list of sizes) splits a fused
#: projection (GPT-2's ``c_attn``, ``nn.MultiheadAttention``'s ``in_proj_weight``, litgpt's ``qkv``, a fused MoE
#: ``gate_up_proj``, an LSTM's gates) or a grouped convolution's kernel (its groups, along dim 0) into row blocks
#: along its output dim (`block_dim`): each block is orthogonalised and lr-scaled as a separate parameter would be
#: (`split_blocks`).

#: The layouts that hold a batch of matrices over the leading dims.
STACKED = ("stack", "stack_in_out")
#: The layouts whose matrices are stored ``in x out`` (the lr's shape scaling reads them transposed).
STORED_IN_OUT = ("in_out", "stack_in_out")

#: The optimizer-state key of NorMuon's per-neuron second moment (`row_moment_shape`), beside ``momentum_buffer``
#: (`lightning_muon.optim.rules.NorMuon`).
SECOND_MOMENT = "normuon_second_moment"
#: Added to ``sqrt(v)`` before NorMuon divides a row by it (and the floor of the norm it rescales by), as dion.
NORMUON_EPS = 1e-8

#: The default most bytes of one batched Newton-Schulz call (``ns_batch_bytes=None``) by device type: CPU
#: matmuls reach their peak on one matrix of about 1 MiB in bf16, while small matrices gain from batching
#: (``benchmarks/optimizer_step.py``); accelerators gain at every size (`DEFAULT_BATCH_BYTES_ACCELERATOR`).
DEFAULT_BATCH_BYTES = {"cpu": 1 << 20}
#: The same default on every other device type (accelerators): 256 MiB.
DEFAULT_BATCH_BYTES_ACCELERATOR = 1 << 28


def is_count(value: object, minimum: int = 1) -> bool:
    """Whether ``value`` is an int of at least ``minimum`` (a bool is not a count): steps, bytes, batches."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def matrix_shape(shape: torch.Size | tuple[int, ...], layout: str = "flatten") -> tuple[int, int]:
    """The ``(rows, cols)`` of each matrix Newton-Schulz works on: ``(shape[0], prod(shape[1:]))``, or the
    last two dims for the stacked layouts (`STACKED`)."""
    if layout in STACKED:
        return shape[-2], shape[-1]
    return shape[0], math.prod(shape[1:])


def row_moment_shape(shape: torch.Size | tuple[int, ...], layout: str = "flatten") -> tuple[int, ...]:
    """The shape of NorMuon's second moment of a parameter: one value per neuron (output row) of each of its
    matrices, shaped to broadcast against the matrix: ``(m, 1)``; ``(1, n)`` for ``"in_out"`` (stored
    ``in x out``: a neuron is a column); ``(*stack, m, 1)`` for ``"stack"``, ``(*stack, 1, n)`` for
    ``"stack_in_out"``. Its neuron dim is `block_dim`'s, so a fused projection's blocks split it too."""
    m, n = matrix_shape(shape, layout)
    if layout == "stack":
        return (*shape[:-2], m, 1)
    if layout == "stack_in_out":  # stored E x in x out: a neuron is a column of each stored matrix
        return (*shape[:-2], 1, n)
    return (1, n) if layout == "in_out" else (m, 1)


def update_rule(group: dict[str, Any]) -> str:
    """A param group's update rule in words: ``"Muon"``, or ``"NorMuon (normuon_beta2=0.95)"``, with
    ``", cautious weight decay"`` where it is on, and a rule of your own where the group selects it
    (`lightning_muon.optim.rules`; ``torch.optim.Muon``'s groups: ``"Muon"``)."""
    return _registry.words(group)


def fan_shape(shape: torch.Size | tuple[int, ...], layout: str = "flatten") -> tuple[int, int]:
    """``(fan_out, fan_in)`` of each matrix, what the lr's shape scaling reads (`adjust_lr`)."""
    rows, cols = matrix_shape(shape, layout)
    return (cols, rows) if layout in STORED_IN_OUT else (rows, cols)


def matrices_in(shape: torch.Size | tuple[int, ...], layout: str = "flatten") -> int:
    """How many matrices a parameter of this shape holds (more than one only for the stacked layouts)."""
    return math.prod(shape[:-2]) if layout in STACKED else 1


def layouts_of(group: dict[str, Any]) -> list[str]:
    """The layout of each parameter of a param group (``"flatten"`` where the group names none)."""
    return group.get(MATRIX_LAYOUTS) or ["flatten"] * len(group["params"])


def block_dim(layout: str) -> int:
    """The dim of a parameter that holds its matrices' output rows (``out`` of ``out x in``), the dim a fused
    projection's blocks split (a param group's ``matrix_blocks``): 0, or 1 for ``"in_out"``, -2 for ``"stack"``,
    -1 for ``"stack_in_out"``."""
    return {"in_out": 1, "stack": -2, "stack_in_out": -1}.get(layout, 0)


def blocks_cover(shape: torch.Size | tuple[int, ...], layout: str, sizes: Any) -> bool:
    """Whether ``sizes`` (a ``matrix_blocks`` entry) are positive block sizes that add up to the output rows (dim
    `block_dim`) of a parameter of this shape and layout: the check before a split, for `lightning_muon.Muon` and
    `lightning_muon.route_parameters` alike."""
    return not isinstance(sizes, str) and all(is_count(s) for s in sizes) and sum(sizes) == shape[block_dim(layout)]


def blocks_of(group: dict[str, Any]) -> list[list[int] | None]:
    """The row blocks of each parameter of a param group (its ``matrix_blocks``; ``None``: one matrix, fused)."""
    return group.get(MATRIX_BLOCKS) or [None] * len(group["params"])


def split_blocks(tensor: Tensor, layout: str, sizes: Sequence[int] | None) -> list[Tensor]:
    """Views of a fused projection's blocks (``sizes`` output rows each, along `block_dim`), each a matrix (or a
    stack of them) of its own; ``[tensor]`` itself without blocks. In-place changes to a view reach the tensor."""
    return [tensor] if sizes is None else list(torch.split(tensor, list(sizes), dim=block_dim(layout)))


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size | tuple[int, ...]) -> float:
    """The learning rate one parameter really gets, from its flattened shape ``A x B``.

    - ``None`` or ``"original"`` (Keller Jordan): ``lr * sqrt(max(1, A / B))``
    - ``"match_rms_adamw"`` (Moonshot): ``lr * 0.2 * sqrt(max(A, B))``
    - ``"spectral"``: ``lr * sqrt(A / B)``
    - ``"none"``: ``lr``

    ``A, B = shape[0], prod(shape[1:])``; for a 2D parameter that is its shape,
    as in ``torch.optim.Muon``. Weight decay always uses the unadjusted ``lr``.

    Args:
        lr: the param group's learning rate.
        adjust_lr_fn: the rule (above).
        shape: the parameter's shape (``out x in``, or a conv kernel's, flattened to ``out x in*kh*kw``).

    Examples:
        ```python
        from lightning_muon import adjust_lr

        print(adjust_lr(0.02, None, (3072, 768)))  # 0.04: a 4:1 matrix gets sqrt(4) = 2 times the lr
        print(f"{adjust_lr(0.02, 'match_rms_adamw', (768, 768)):.4f}")  # 0.1109: 0.2 sqrt(768) times
        ```
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
    """The effective lr of every parameter of a param group, in order; of a parameter split into blocks
    (``matrix_blocks``), its first block's (each block's lr scale reads its own shape)."""
    lrs = []
    for p, layout, sizes in zip(group["params"], layouts_of(group), blocks_of(group), strict=True):
        shape = list(p.shape)
        if sizes:
            shape[block_dim(layout)] = sizes[0]
        lrs.append(group_effective_lr(group, tuple(shape), layout))
    return lrs


def ns_dtype(group: dict[str, Any]) -> torch.dtype:
    """A group's Newton-Schulz dtype: stored by name (a torch.dtype from older state dicts works too); ``None``
    (`lightning_muon.Muon`'s default) leaves it to the hardware of the group's device (bf16 where native, else
    float32: ``lightning_muon.optim._precision``); bf16 for groups without one (``torch.optim.Muon``'s)."""
    dtype = group.get("ns_dtype", "bfloat16")
    if dtype is None:
        params = group["params"]
        return _precision.ns_dtype_for(params[0].device if params else torch.device("cpu"))
    if isinstance(dtype, torch.dtype):
        return dtype
    named = _precision.dtype_named(dtype)
    assert named is not None, f"ns_dtype {dtype!r} names no torch dtype"  # Muon keeps valid names only
    return named


def ns_dtype_line(optimizer: torch.optim.Optimizer | None) -> str | None:
    """The line that says which Newton-Schulz dtype the hardware chose for ``optimizer``'s groups that leave it to
    the hardware (``ns_dtype=None``), and why, for a caller to show once; ``None`` where every group names its
    dtype, or there is no optimizer. Every rank must call it: under several ranks it may all-reduce, so that they
    agree."""
    if optimizer is None:
        return None
    process_group = getattr(getattr(optimizer, "_choice", None), "process_group", None)  # a Muon's explicit group
    precision = _precision.settle(optimizer.param_groups, process_group, log=False)
    return None if precision is None else precision.line()


def ns_settings(group: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `lightning_muon.optim.newton_schulz.zeropower_via_newtonschulz` (and of its
    Gram variant) for a param group."""
    return {
        "ns_coefficients": group["ns_coefficients"],
        "ns_steps": group["ns_steps"],
        "eps": group["eps"],
        "dtype": ns_dtype(group),
        "ns_precondition": group.get("ns_precondition"),
    }


def on_exact_path(group: dict[str, Any]) -> bool:
    """Whether a group steps exactly as ``torch.optim.Muon`` (``ns_batch_bytes == 0``: one matrix at a time,
    torch's kernels, no Gram iteration, no merged calls)."""
    return group.get("ns_batch_bytes") == 0


def uses_gram(group: dict[str, Any], shape: tuple[int, int]) -> bool:
    """Whether a group orthogonalises ``m x n`` matrices by Gram Newton-Schulz: its long side is at least
    ``ns_gram_aspect`` times its short side (``None``: never), and the group is not `on_exact_path`."""
    aspect = group.get("ns_gram_aspect")
    if aspect is None or on_exact_path(group):
        return False
    m, n = shape
    return max(m, n) >= aspect * min(m, n)


def batch_cap(group: dict[str, Any], device: torch.device) -> int:
    """The most bytes of one batched Newton-Schulz call for a group's matrices on ``device``."""
    cap = group["ns_batch_bytes"]
    return DEFAULT_BATCH_BYTES.get(device.type, DEFAULT_BATCH_BYTES_ACCELERATOR) if cap is None else cap


def describe_param(group: dict[str, Any], i: int, index: int) -> str:
    """``parameter `name` (index 3)`` for messages (``i``: the position in the group, ``index``: in the
    optimizer); the index alone when the group has no names."""
    names = group.get(PARAM_NAMES)
    return f"parameter `{names[i]}` (index {index})" if names else f"parameter {index}"


def param_name(group: dict[str, Any], i: int, index: int) -> str:
    """The name diagnostics give a parameter: its ``param_names`` entry, else ``<group name>.<index>``."""
    names = group.get(PARAM_NAMES)
    return names[i] if names else f"{group.get(NAME, 'params')}.{index}"
