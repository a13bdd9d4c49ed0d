"""The decision: `route_parameters` and the rules it applies, in their order of precedence (the package's
docstring lists them). Each rule gives a `Decision`; the layout rule's `Kind` of the tensor is what later rules
go by, the reason is for people only."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from lightning_muon.optim import groups
from lightning_muon.optim._dtensor import fsdp1_wrapped
from lightning_muon.routing import _roles
from lightning_muon.routing._heads import HeadBlocks, fused_attention, head_blocks
from lightning_muon.routing._route import Route
from lightning_muon.routing._routing import Routing
from lightning_muon.routing._settings import check_group_settings
from lightning_muon.routing._trace import TABLE_USES, USES, GraphRoles
from lightning_muon.routing._vocabulary import Algorithm, Rule

__all__ = ["Decision", "Kind", "check_pattern_list", "route_parameters"]


def check_pattern_list(kind: str, patterns: Sequence[str]) -> None:
    """Refuse a string where a list of glob patterns belongs (``muon_params="blocks.*"`` would iterate its
    characters).

    Raises:
        ValueError: ``patterns`` is a string; the message names ``kind`` and the fix.
    """
    if isinstance(patterns, str):
        raise ValueError(f"{kind} must be a list of glob patterns, got the string {patterns!r}; write [{patterns!r}]")


def _check_patterns(kind: str, patterns: Sequence[str], aliases: dict[str, list[str]]) -> None:
    """Refuse a string (`check_pattern_list`) and a pattern that matches no parameter under any of its names."""
    check_pattern_list(kind, patterns)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(a, pattern) for names in aliases.values() for a in names):
            examples = ", ".join(list(aliases)[:6])
            raise ValueError(
                f"{kind} pattern {pattern!r} matches no trainable parameter. "
                f"Patterns are globs on full parameter names such as: {examples}"
            )


class Kind(Enum):
    """What a tensor is, by its layout and shape: what the rules after the layout rule go by."""

    #: A tensor under 2 dimensions named ``...bias``.
    BIAS = "bias"
    #: Any other tensor under 2 dimensions (norm weights, scales, scalars).
    VECTOR = "vector"
    #: A stack of vectors, whatever its number of dimensions: one bias or scale per matrix of a stack beside it (a
    #: per-expert bias ``E x out``), a stack whose matrices have a side of 1, a router's gate vector per expert.
    VECTORS = "stack of vectors"
    #: An adapter's parameter that is no linear map's matrix, whatever its shape: an elementwise scale or magnitude
    #: (DoRA, IA3, VeRA), rotation generators (OFT, BOFT), selection logits (VB-LoRA), coefficients.
    COEFFICIENTS = "adapter coefficients"
    #: A bare token or position table (``cls_token``, ``pos_embed``).
    TABLE = "table"
    #: An elementwise scale of a layer's matrix, one per output (weight norm's magnitude): it goes where its
    #: layer's bias goes.
    SCALE = "scale"
    #: A convolution's kernel, seen as ``shape[0] x prod(shape[1:])``.
    KERNEL = "kernel"
    #: A 2D weight (``out x in``, or ``in x out`` as transformers' ``Conv1D``).
    MATRIX = "matrix"
    #: A stack of matrices over the leading dimensions (MoE experts ``E x out x in``, or ``E x in x out``).
    STACK = "stack"


@dataclass(frozen=True)
class Decision:
    """Where one parameter goes and why, before it has a name and shape (`Route`)."""

    optimizer: Algorithm
    group: str
    #: Why, for people only: no rule reads it.
    reason: str
    #: The rule that decided.
    rule: Rule
    #: What the tensor is (the layout rule's verdict, kept by every rule that overrules it): rules read this.
    kind: Kind
    #: How Muon sees the tensor's matrices (``"flatten"``, ``"stack"``, ``"in_out"``, ``"stack_in_out"``).
    layout: str = "flatten"

    def overruled(self, optimizer: Algorithm, group: str, reason: str, rule: Rule, layout: str = "flatten") -> Decision:
        """The same tensor (its `kind` kept) decided by ``rule`` instead."""
        return replace(self, optimizer=optimizer, group=group, reason=reason, rule=rule, layout=layout)

    def route(self, name: str, shape: tuple[int, ...]) -> Route:
        """This decision as parameter ``name``'s `Route`."""
        return Route(name, shape, self.optimizer, self.group, self.reason, self.layout, rule=self.rule)


_TWO_D_ONLY = "{}D tensor and the Muon class is 2D-only"
#: How the table marks a parameter no training batch has reached yet (its route is names' and structure's).
NOT_REACHED = "not reached by a batch yet"

#: A model FSDP1 has flattened (``where``: its wrappers' or flattened parameters' names).
FSDP1_MODEL_REFUSED = (
    "route_parameters got a model that FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) has flattened: "
    "{where}. FSDP1 hands the optimizer flat 1-D shards instead of the weight matrices (one flat tensor per wrapped "
    "module; with use_orig_params=True each parameter becomes a 1-D view of this rank's shard, (0,) where the rank "
    "holds none), so no tensor would be routed as a matrix and Muon would not train. Shard with FSDP2 instead: "
    "torch.distributed.fsdp.fully_shard (in Lightning, strategy=ModelParallelStrategy() with fully_shard in "
    "configure_model), whose parameters keep their shapes (DTensors)."
)


@dataclass(frozen=True)
class _Context:
    """What the model as a whole says about one parameter, beyond its own module: the layout rule reads it."""

    #: The router it is the weight of, with the rule that found it and its number of experts (`_roles.routers`).
    router: tuple[Rule, int] | None = None
    #: PEFT's name of the adapter it belongs to (``ia3_l``), or None (`_roles.adapter_parameters`).
    adapter: str | None = None
    #: The parametrization it makes its layer's tensor through (`_roles.parametrized`), or None.
    made: _roles.Parametrized | None = None


def _layout_route(name: str, p: Tensor, module: nn.Module, param_name: str, muon_nd: bool,
                  context: _Context = _Context()) -> Decision:
    """The `Decision` for a parameter that no user pattern, module type, tie or head decided: by its shape and
    its module's kind (a conv kernel, a weight stored in x out, a stack of matrices or of vectors, a router, an
    adapter's coefficients, a bare table)."""
    decision = _by_shape(name, p, module, param_name, muon_nd, context)
    if context.adapter is not None and decision.optimizer is Algorithm.ADAMW:  # a vector of an adapter
        return replace(decision, group="adapters")
    return decision


def _by_shape(name: str, p: Tensor, module: nn.Module, param_name: str, muon_nd: bool, context: _Context) -> Decision:
    return _not_a_matrix(name, p, module, param_name, context) or _matrices(p, module, param_name, muon_nd)


def _not_a_matrix(name: str, p: Tensor, module: nn.Module, param_name: str, context: _Context) -> Decision | None:
    """The `Decision` for a tensor that holds no matrix, whatever its number of dimensions: an adapter's
    coefficients, a vector, a router's or a stack's vectors, a table; None for matrices."""
    shape = tuple(p.shape)
    dims = "x".join(map(str, shape))
    own_weight = param_name == "weight" and not isinstance(module, nn.ParameterList | nn.ParameterDict)
    if context.adapter in _roles.ADAPTER_COEFFICIENTS:
        reason = f"not a matrix: {_roles.ADAPTER_COEFFICIENTS[context.adapter]} ({dims})"
        return Decision(Algorithm.ADAMW, "adapters", reason, Rule.CONVENTION, Kind.COEFFICIENTS)
    if context.made is not None and context.made.part == "magnitude":
        reason = f"not a matrix: {context.made.words} ({dims}), a scale per output"
        return Decision(Algorithm.ADAMW, "norms_and_biases", reason, Rule.MODULE_TYPE, Kind.SCALE)
    if p.ndim < 2:
        recurrent = isinstance(module, nn.RNNBase | nn.RNNCellBase) and param_name.startswith("bias_")  # bias_ih_l0
        if name.endswith("bias") or recurrent:
            return Decision(Algorithm.ADAMW, "norms_and_biases", "bias", Rule.SHAPE, Kind.BIAS)
        return Decision(Algorithm.ADAMW, "norms_and_biases", f"{p.ndim}D tensor", Rule.SHAPE, Kind.VECTOR)
    if context.router is not None and own_weight:
        rule, gates = context.router
        reason = (f"router: a stack of vectors, one gate vector per expert ({gates} experts)" if gates > 1
                  else "gate beside the experts: a vector (1 row)")
        return Decision(Algorithm.ADAMW, "norms_and_biases", reason, rule, Kind.VECTORS)
    if not own_weight and not _roles.is_conv(module) and _roles.is_table(param_name, p):
        rule = Rule.NAME if _roles.is_table_name(param_name) else Rule.SHAPE
        return Decision(Algorithm.ADAMW, "embeddings", f"token or position table ({dims})", rule, Kind.TABLE)
    stack = _roles.stack_beside(module, param_name, p)
    if stack is not None:
        what = "bias" if name.endswith("bias") else "vector"
        reason = f"stack of vectors ({dims}): one {what} per matrix of `{stack}`"
        return Decision(Algorithm.ADAMW, "norms_and_biases", reason, Rule.STRUCTURE, Kind.VECTORS)
    if p.ndim > 2 and 1 in shape[-2:] and not _roles.is_conv(module):
        reason = f"stack of vectors ({dims}): its matrices have a side of 1"
        return Decision(Algorithm.ADAMW, "norms_and_biases", reason, Rule.SHAPE, Kind.VECTORS)
    return None


def _matrices(p: Tensor, module: nn.Module, param_name: str, muon_nd: bool) -> Decision:
    """The `Decision` for a tensor of matrices: a conv kernel, a matrix (stored in x out or not), a stack."""
    shape = tuple(p.shape)
    if _roles.is_conv(module) and param_name == "weight":
        if not muon_nd:
            return Decision(Algorithm.ADAMW, "other", _TWO_D_ONLY.format(p.ndim), Rule.SHAPE, Kind.KERNEL)
        groups = _roles.kernel_groups(module, param_name)
        if groups > 1:  # each group's matrix alone: `_with_blocks` gives its blocks and says so
            depthwise = " depthwise" if module.in_channels == module.out_channels == groups else ""
            return Decision(Algorithm.MUON, "hidden", f"{p.ndim}D{depthwise} kernel of {groups} groups", Rule.SHAPE,
                            Kind.KERNEL)
        reason = f"{p.ndim}D kernel, orthogonalised as {shape[0]}x{math.prod(shape[1:])}"
        return Decision(Algorithm.MUON, "hidden", reason, Rule.SHAPE, Kind.KERNEL)
    if p.ndim == 2 and _roles.stores_in_out(module, param_name):
        if not muon_nd:  # torch.optim.Muon scales the lr from the stored shape
            reason = "hidden matrix stored in x out (torch.optim.Muon scales its lr as stored)"
            return Decision(Algorithm.MUON, "hidden", reason, Rule.SHAPE, Kind.MATRIX)
        reason = f"hidden matrix stored in x out ({shape[1]}x{shape[0]} out x in)"
        return Decision(Algorithm.MUON, "hidden", reason, Rule.SHAPE, Kind.MATRIX, "in_out")
    if p.ndim == 2:
        return Decision(Algorithm.MUON, "hidden", "hidden matrix", Rule.SHAPE, Kind.MATRIX)
    if not muon_nd:
        return Decision(Algorithm.ADAMW, "other", _TWO_D_ONLY.format(p.ndim), Rule.SHAPE, Kind.STACK)
    count = math.prod(shape[:-2])
    if _roles.stacks_in_out(module):
        reason = (f"{count} stacked matrices stored in x out ({shape[-1]}x{shape[-2]} out x in, the experts' "
                  "is_transposed), each orthogonalised")
        return Decision(Algorithm.MUON, "hidden", reason, Rule.CONVENTION, Kind.STACK, "stack_in_out")
    reason = f"{count} stacked matrices {shape[-2]}x{shape[-1]}, each orthogonalised"
    return Decision(Algorithm.MUON, "hidden", reason, Rule.SHAPE, Kind.STACK, "stack")


@dataclass(frozen=True)
class _Role:
    """What a parameter's modules say about it: its own module, and the roles that decide before its shape."""

    module: nn.Module
    #: The name under which it is an embedding's weight (tied), or None.
    embedding: str | None
    #: The output head module it belongs to, or None.
    head: str | None
    #: Whether it is the input layer's weight.
    is_input: bool
    #: What the training batches showed: ``"head"``, ``"input"``, ``"hidden"``, ``"elementwise"`` or ``None``
    #: (not seen, not reached).
    graph: str | None = None
    #: The rule that found the output head `head` (`Rule.CONVENTION`, `Rule.NAME` or `Rule.STRUCTURE`).
    head_rule: Rule = Rule.STRUCTURE
    #: What the batches did with it where it is no matrix by its use (`GraphRoles.elementwise`).
    uses: tuple[str, ...] = ()
    #: Whether a batch after the first showed its role (the first did not reach it).
    late: bool = False

    @property
    def batch_rule(self) -> Rule:
        """The rule that a batch's verdict on it is: `Rule.FIRST_BATCH`, or `Rule.LATER_BATCH`."""
        return Rule.LATER_BATCH if self.late else Rule.FIRST_BATCH

    @property
    def batch(self) -> str:
        """Which batch showed its role, in words."""
        return "later batch" if self.late else "first batch"


def _module_of(alias: str) -> str:
    return alias.rsplit(".", 1)[0] if "." in alias else ""


def _role(name: str, owners: list[tuple[str, nn.Module]], heads: dict[str, Rule], input_layer: str | None,
          graph: GraphRoles | None, made: _roles.Parametrized | None, layers: dict[str, nn.Module],
          matrix_of: dict[str, str]) -> _Role:
    """The `_Role` of parameter ``name``, owned (under every alias of a tied weight) by ``owners``; a parameter
    ``made`` through a parametrization has its layer's (``layers`` by name)."""
    if made is not None:  # its layer's tensor: the layer's module, and the layer as where it sits
        own_module, places = layers[made.layer], [made.qualified]
    else:
        own_module, places = next(mod for alias, mod in owners if alias == name), [alias for alias, _ in owners]
    head = next((_module_of(place) for place in places if _module_of(place) in heads), None)
    magnitude = made is not None and made.part == "magnitude"
    own_place = places[0] if made is not None else name
    layer_matrix = _layer_matrix(name, made, matrix_of)  # a bias's or a magnitude's: its role is its layer's
    graph_role = None
    if graph is not None:
        layer_role = graph.role(layer_matrix) if layer_matrix is not None else None
        graph_role = layer_role if magnitude else graph.role(name) or layer_role
        graph_role = None if graph_role == "elementwise" and layer_matrix is not None else graph_role
    return _Role(
        module=own_module,
        embedding=next((alias for alias, mod in owners if isinstance(mod, _roles.EMBEDDINGS)), None),
        head=head,
        is_input=not magnitude and own_place.rsplit(".", 1)[-1] == "weight" and input_layer is not None
        and _module_of(own_place) == input_layer,
        graph=graph_role,
        head_rule=Rule.STRUCTURE if head is None else heads[head],
        uses=tuple(graph.elementwise.get(name, ())) if graph is not None else (),
        late=graph is not None and (layer_matrix if magnitude else name) in graph.late,
    )


def _layer_matrix(name: str, made: _roles.Parametrized | None, matrix_of: dict[str, str]) -> str | None:
    """The parameter whose role a bias's or weight norm's magnitude's is: its layer's matrix (the ``weight``
    beside the bias, the direction beside the magnitude); ``None`` for other parameters."""
    if made is not None:
        return matrix_of.get(made.qualified) if made.part == "magnitude" else None
    module, _, leaf = name.rpartition(".")
    if leaf != "bias":
        return None
    weight = f"{module}.weight" if module else "weight"
    return matrix_of.get(weight, weight)


def _matched(patterns: Sequence[str], aliases: Sequence[str]) -> str | None:
    """The first pattern that matches any of a parameter's names."""
    return next((pat for pat in patterns if any(fnmatch.fnmatchcase(a, pat) for a in aliases)), None)


def _pattern_route(name: str, p: Tensor, role: _Role, by_layout: Decision, to_muon: str | None,
                   to_adamw: str | None, muon_nd: bool) -> Decision:
    """Precedence 1: a user pattern decides (both matching, or a tensor Muon cannot take, is an error)."""
    if to_muon and to_adamw:
        raise ValueError(
            f"parameter `{name}` matches muon_params pattern {to_muon!r} and adamw_params pattern "
            f"{to_adamw!r}; make the patterns disjoint"
        )
    if to_muon:
        if p.ndim < 2 or (p.ndim > 2 and not muon_nd):
            need = "at least 2" if p.ndim < 2 else "exactly 2 (this Muon class is 2D-only)"
            raise ValueError(
                f"muon_params pattern {to_muon!r} matches `{name}` of shape {tuple(p.shape)}, but Muon needs "
                f"{need} dimensions; narrow the pattern"
            )
        layout = by_layout.layout
        if by_layout.optimizer is not Algorithm.MUON:  # a table forced onto Muon: a matrix, or a stack of them
            layout = "stack" if p.ndim > 2 else "flatten"
        return by_layout.overruled(Algorithm.MUON, "hidden", f"matches muon_params {to_muon!r}", Rule.PATTERN, layout)
    group = "other" if p.ndim >= 2 else "norms_and_biases"
    group = "embeddings" if role.embedding else "head" if role.head else "input" if role.is_input else group
    return by_layout.overruled(Algorithm.ADAMW, group, f"matches adamw_params {to_adamw!r}", Rule.PATTERN)


def _role_route(role: _Role, by_layout: Decision) -> Decision | None:
    """Precedence 2-6: module type, a tie to an embedding, what the first batch showed (for matrices), the
    output head, the input layer; None if no role decides."""
    module = role.module
    if isinstance(module, _roles.EMBEDDINGS):
        return by_layout.overruled(Algorithm.ADAMW, "embeddings", f"{_roles.class_name(module)} weight",
                                   Rule.MODULE_TYPE)
    if _roles.is_norm(module):
        reason = f"norm layer ({_roles.class_name(module)})"
        return by_layout.overruled(Algorithm.ADAMW, "norms_and_biases", reason, Rule.MODULE_TYPE)
    if role.embedding:
        return by_layout.overruled(Algorithm.ADAMW, "embeddings", f"tied to embedding `{role.embedding}`", Rule.TIE)
    if role.graph is not None and by_layout.optimizer is Algorithm.MUON:  # a matrix: the batch decides (not tables)
        return _graph_route(role, by_layout)
    if role.graph is not None and by_layout.kind in (Kind.BIAS, Kind.SCALE):  # where its layer's weight goes
        if role.graph != "head":
            return by_layout
        what = "bias" if by_layout.kind is Kind.BIAS else "magnitude"
        return by_layout.overruled(Algorithm.ADAMW, "head", f"output head's {what} ({role.batch})", role.batch_rule)
    if role.head:
        return by_layout.overruled(Algorithm.ADAMW, "head", f"output head `{role.head}`", role.head_rule)
    if role.is_input:
        channels = getattr(module, "in_channels", "?")
        plural = "" if channels == 1 else "s"
        reason = f"input layer ({_roles.class_name(module)} on {channels} input channel{plural})"
        return by_layout.overruled(Algorithm.ADAMW, "input", reason, Rule.STRUCTURE)
    return None


#: PEFT's name for LoRA's ``B`` matrices (``out x r``, of Linear and conv layers), a path segment.
LORA_B = "lora_B"


def _adapter_route(aliases: Sequence[str], decision: Decision) -> Decision:
    """Precedence 7 (after the roles, before the shape alone decides): a LoRA ``B`` matrix that would go to Muon
    as a hidden matrix goes to AdamW, its ``A`` stays on Muon: measured on the shipped LoRA recipe
    (``benchmarks/finetune.py``: A on Muon and B on AdamW, each side at its tuned lr, 3 seeds, ended lower than
    both on Muon, both on AdamW, or B on Muon). PEFT's own word: the parameter's path holds ``lora_B``."""
    if decision.optimizer is not Algorithm.MUON or not any(LORA_B in a.split(".") for a in aliases):
        return decision
    reason = "LoRA's B (out x r): AdamW's, A stays on Muon (measured, benchmarks/finetune.py)"
    return decision.overruled(Algorithm.ADAMW, "adapters", reason, Rule.CONVENTION)


def _graph_route(role: _Role, by_layout: Decision) -> Decision:
    """A matrix's route from what the training batches showed (`GraphRoles`)."""
    if role.graph == "head":
        reason = f"output head: feeds the loss through no other matrix ({role.batch})"
        return by_layout.overruled(Algorithm.ADAMW, "head", reason, role.batch_rule)
    if role.graph == "input":
        reason = f"input layer: reads the batch through no other matrix ({role.batch})"
        return by_layout.overruled(Algorithm.ADAMW, "input", reason, role.batch_rule)
    if role.graph == "elementwise":  # used, never as a matrix: a table or a scale, whatever its name or shape
        table = bool(set(role.uses) & TABLE_USES)
        what = "a table" if table else "a scale"
        how = " and ".join(USES[u] for u in role.uses)
        dims = by_layout.reason if by_layout.kind is not Kind.MATRIX else "hidden matrix"
        reason = f"not a matrix, {what}: the {role.batch} only {how} (not the {dims} its shape suggests)"
        return by_layout.overruled(Algorithm.ADAMW, "embeddings" if table else "norms_and_biases", reason,
                                   role.batch_rule)
    overruled = "output head" if role.head else "input layer" if role.is_input else None
    if overruled:  # the structural rules guessed a role the computation does not have
        reason = f"{by_layout.reason}; not the {overruled} its name or place suggests ({role.batch})"
        return replace(by_layout, reason=reason, rule=role.batch_rule)
    return by_layout


def _fsdp1_found(wrappers: list[str], flattened: list[str]) -> str:
    """``wrapped by FSDP1 at the model itself and '3'; flattened parameters '0.weight', ...``, three of each."""
    def some(names: list[str]) -> str:
        shown = ", ".join(repr(n) if n else "the model itself" for n in names[:3])
        return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    found = [f"wrapped at {some(wrappers)}"] if wrappers else []
    return "; ".join(found + ([f"flattened parameters {some(flattened)}"] if flattened else []))


def route_parameters(
    module: nn.Module,
    *,
    muon_params: Sequence[str] = (),
    adamw_params: Sequence[str] = (),
    muon_nd: bool = True,
    graph: GraphRoles | None = None,
    split_fused: bool | None = None,
    matrix_blocks: Mapping[str, Sequence[int] | None] | None = None,
    group_settings: Mapping[str, Mapping[str, Any]] | None = None,
    split_heads: bool = False,
) -> Routing:
    """Decide Muon or AdamW for every trainable parameter of ``module``, with a reason and the rule that decided.

    Args:
        module: the model.
        muon_params: glob patterns on full parameter names (``"blocks.*.attn.*.weight"``)
            forced to Muon; they must match matrices.
        adamw_params: glob patterns forced to AdamW.
        muon_nd: whether the Muon class accepts tensors with more than 2
            dimensions (``lightning_muon.Muon`` does, ``torch.optim.Muon`` does
            not: with ``False`` such tensors go to AdamW).
        graph: what a training batch showed (`trace_roles`): output heads, input layers and hidden
            matrices, found from the computation. It decides for matrices after user patterns, module
            type and ties; the name and structure rules decide what it did not see.
        split_fused: ``True``: orthogonalise the blocks of every fused projection found (below) on their own;
            ``False``: each one whole; ``None`` (the default): split attention projections whose blocks are equal
            (q, k and v of one width), keep grouped-query attention's unequal ones and MoE experts' gate and up
            whole, and everything whole where ``muon_nd=False``. Recurrent layers' gates are split whatever it says.
        matrix_blocks: glob patterns on full parameter names -> the row-block sizes of those Muon parameters along
            their output dim (``{"*.c_attn.weight": [768, 768, 768]}``), or ``None`` to keep a found one fused;
            the first matching pattern decides, over ``split_fused`` and ``split_heads``.
        group_settings: group name -> that group's own settings (keys ``lr``, ``weight_decay``, ``betas``,
            ``eps``, ``momentum``), put into its param group (`Routing.groups`), where torch's optimizers take them
            over their defaults: ``{"embeddings": {"lr": 0.01, "weight_decay": 0.0}, "head": {"lr": 0.002}}``.
        split_heads: orthogonalise each attention head of the q, k and v projections on its own (Kimi K3's
            and torchtitan's per-head Muon): q by its heads, k and v by their key-value heads (grouped-query
            attention), a fused qkv first by projection (it implies ``split_fused`` there). The heads are read from
            the model (transformers' and litgpt's configs, ``nn.MultiheadAttention``, a ``qk_layout()`` method),
            never guessed. The output projection stays whole: its heads are its input columns, not its rows. Off by
            default (measured no better than a split per projection); on sharded parameters as on one process.

    Fused projections (``nn.MultiheadAttention``'s ``in_proj_weight``, GPT-2's ``c_attn``, litgpt's ``qkv``,
    transformers' fused MoE ``gate_up_proj``, an attention whose ``qk_layout()`` puts q, k and v in one weight)
    are found by module type and shape and named in the reason. A split one has each block orthogonalised and
    lr-scaled as a separate layer's would be (the Muon group's ``matrix_blocks``). By default the equal q, k, v
    blocks are split: measured better than fused beyond the seeds' spread on the shipped GPT and GPT-2
    (docs/guides/routing.md); ``split_fused=False`` keeps them whole, as 0.1 did. The gates
    ``nn.LSTM`` and ``nn.GRU`` (and their cells) stack in the rows of every ``weight_ih``/``weight_hh`` are split
    by default, measured better than fused (``benchmarks/torch_layers.py``;
    kept whole under ``torch.optim.Muon``, ``muon_nd=False``, which cannot split).

    A grouped convolution's kernel (``groups`` > 1, depthwise ones too) is its groups' matrices stacked along dim 0
    (``out/groups x in/groups*k...`` each; a transposed conv's ``in/groups x out/groups*k...``): each group is
    orthogonalised and lr-scaled alone, as a separate convolution's would be, always (a ``matrix_blocks`` pattern
    mapping it to ``None`` keeps it one matrix).

    PEFT LoRA's adapters: ``lora_A`` (``r x in``) is a hidden matrix, on Muon; ``lora_B`` (``out x r``) goes to
    AdamW (group ``adapters``), where it trained better in the measured recipe (``benchmarks/finetune.py``).
    ``muon_params=["*lora_B*"]`` puts it on Muon, ``adamw_params=["*lora_A*"]`` (or ``muon=None`` in the mixin)
    both on AdamW.

    Examples:
        ```python
        from torch import nn
        from lightning_muon import route_parameters

        model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 64), nn.LayerNorm(64),
                              nn.Linear(64, 256))
        routing = route_parameters(model)
        print(routing.names("Muon"))  # ['1.weight']: the embedding, the norm and the head go to AdamW
        groups = routing.groups("Muon")  # param groups for lightning_muon.Muon ("AdamW": torch's AdamW)
        ```

    Raises:
        ValueError: a pattern matches nothing, a parameter matches both kinds
            of pattern, a tensor Muon cannot take is forced to Muon, ``group_settings`` names an unknown group or
            setting, or ``matrix_blocks`` sets blocks that do not
            fit a parameter (or any with a Muon class that cannot split them, ``muon_nd=False``), or FSDP1
            (``FullyShardedDataParallel``) has flattened the model's parameters (FSDP2's ``fully_shard`` is the
            sharding Muon supports).
    """
    settings = check_group_settings(group_settings)
    trainable: dict[str, Tensor] = {name: p for name, p in module.named_parameters() if p.requires_grad}
    lazy = [name for name, p in trainable.items() if is_lazy(p)]
    if lazy:
        raise ValueError(
            f"{', '.join(lazy[:5])}{' and more' if len(lazy) > 5 else ''} are not initialised yet (lazy modules such "
            "as nn.LazyLinear), so their shapes, and with them their optimizer, are unknown. Run one forward pass "
            "with an example batch before the optimizers are built, e.g. at the end of the module's __init__: "
            "`self(torch.zeros(1, in_features))`."
        )
    wrappers, flattened = fsdp1_wrapped(module)
    if wrappers or flattened:
        raise ValueError(FSDP1_MODEL_REFUSED.format(where=_fsdp1_found(wrappers, flattened)))
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((f"{mod_name}.{p_name}" if mod_name else p_name, mod))
    aliases = {name: [alias for alias, _ in owners[id(p)]] for name, p in trainable.items()}
    _check_patterns("muon_params", muon_params, aliases)
    _check_patterns("adamw_params", adamw_params, aliases)
    _check_patterns("matrix_blocks", list(matrix_blocks or {}), aliases)
    heads = _roles.output_heads(module)
    input_layer = _roles.find_input_layer(module)
    routers = _roles.routers(module)
    adapters = _roles.adapter_parameters(module)
    parametrized = _roles.parametrized(module)
    layers = dict(module.named_modules()) if parametrized else {}
    # a parametrized tensor (``conv.weight``) -> the parameter that is its matrix (weight norm's direction)
    matrix_of = {made.qualified: alias for alias, made in parametrized.items() if made.part != "magnitude"}

    routes = []
    for name, p in trainable.items():
        made = next((parametrized[a] for a in aliases[name] if a in parametrized), None)
        role = _role(name, owners[id(p)], heads, input_layer, graph, made, layers, matrix_of)
        to_muon, to_adamw = (_matched(patterns, aliases[name]) for patterns in (muon_params, adamw_params))
        router = next((routers[_module_of(a)] for a in aliases[name] if _module_of(a) in routers), None)
        context = _Context(router=router, adapter=next((adapters[a] for a in aliases[name] if a in adapters), None),
                           made=made)
        tensor = made.tensor if made is not None else name.rsplit(".", 1)[-1]
        by_layout = _layout_route(name, p, role.module, tensor, muon_nd, context)
        if to_muon or to_adamw:
            decision = _pattern_route(name, p, role, by_layout, to_muon, to_adamw, muon_nd)
        else:
            decision = _adapter_route(aliases[name], _role_route(role, by_layout) or by_layout)
        if made is not None and made.words not in decision.reason:
            decision = replace(decision, reason=f"{decision.reason}; {made.words}")
        if graph is not None and graph.unreached is not None and name in graph.unreached:
            decision = replace(decision, reason=f"{decision.reason}; {NOT_REACHED}")
        routes.append(decision.route(name, tuple(p.shape)))

    per_head = _heads_of(module, trainable, aliases, dict(matrix_blocks or {})) if split_heads else {}
    fused = fused_attention(module) | _roles.fused_projections(module)
    found = _Found(fused, _roles.recurrent_gates(module), _roles.grouped_kernels(module), per_head)
    routes = _with_blocks(routes, trainable, aliases, found, split_fused, dict(matrix_blocks or {}), muon_nd)
    routed = [r.name for r in routes]
    if sorted(routed) != sorted(trainable) or len(set(routed)) != len(routed):  # a bug here, never the user's
        raise RuntimeError(f"lightning_muon routed {sorted(routed)} for the trainable parameters {sorted(trainable)}")
    return Routing(routes=routes, params=dict(trainable), roles_from=_roles_from(graph), group_settings=settings)


@dataclass(frozen=True)
class _Found:
    """The tensors of a model that hold several matrices along their rows, by parameter name."""

    #: Fused projections: what their blocks are and their sizes (`_roles.fused_projections`).
    fused: dict[str, tuple[str, tuple[int, ...] | None]]
    #: The fused projections split by default: recurrent layers' gates (`_roles.recurrent_gates`: what they are,
    #: their sizes), measured better split (``benchmarks/torch_layers.py``).
    gates: dict[str, tuple[str, tuple[int, ...]]]
    #: Grouped convolutions' kernels: their number of groups (`_roles.grouped_kernels`).
    grouped: dict[str, int]
    #: Attention projections' per-head blocks, with ``split_heads`` (`head_blocks`); empty without it.
    heads: dict[str, HeadBlocks]


def _heads_of(module: nn.Module, params: dict[str, Tensor], aliases: dict[str, list[str]],
              patterns: dict[str, Sequence[int] | None]) -> dict[str, HeadBlocks]:
    """`head_blocks` of ``module``'s trainable ``params``, reading no heads in a module whose trainable matrices
    ``matrix_blocks`` patterns all decide (the user's blocks stand there, heads readable or not), or that has
    matrices but none trainable (nothing to split)."""
    decided = {alias for name, p in params.items() if p.dim() >= 2 and _matched(list(patterns), aliases[name])
               for alias in aliases[name]}
    given: list[str] = []
    for mod_name, mod in module.named_modules():
        if not mod_name or any(mod_name.startswith(f"{g}.") for g in given):
            continue
        matrices = [(f"{mod_name}.{n}", p.requires_grad) for n, p in mod.named_parameters() if p.dim() >= 2]
        if matrices and {n for n, trained in matrices if trained} <= decided:
            given.append(mod_name)
    return head_blocks(module, params, given)


def _with_blocks(routes: list[Route], params: dict[str, Tensor], aliases: dict[str, list[str]], found: _Found,
                 split_fused: bool | None, patterns: dict[str, Sequence[int] | None], muon_nd: bool) -> list[Route]:
    """``routes`` with their row blocks: a grouped convolution's kernel split into its groups (always: each group
    is a layer's operator of its own), a recurrent layer's gates split (by default, where the Muon class can), any
    other fused projection's blocks named in the reason and split where ``split_fused`` says so; a
    ``matrix_blocks`` pattern decides over all; ``split_heads``' per-head blocks over the fused projections'."""
    done = []
    for r in routes:
        fused = next((found.fused[a] for a in aliases[r.name] if a in found.fused), None)
        gates = next((found.gates[a] for a in aliases[r.name] if a in found.gates), None)
        groups = next((found.grouped[a] for a in aliases[r.name] if a in found.grouped), None)
        heads = found.heads.get(r.name)
        pattern = _matched(list(patterns), aliases[r.name])
        if r.optimizer is not Algorithm.MUON:
            if pattern is not None and patterns[pattern] is not None:
                raise ValueError(f"matrix_blocks pattern {pattern!r} matches `{r.name}`, which goes to AdamW "
                                 f"({r.reason}); blocks are Muon's: narrow the pattern")
            done.append(r)
            continue
        shape = tuple(params[r.name].shape)
        if pattern is not None:
            given = patterns[pattern]
            sizes = None if given is None else tuple(given)
        else:
            sizes = _found_sizes(shape, groups, heads, fused, gates, split_fused, muon_nd)
        if sizes is not None:
            origin = f"matrix_blocks pattern {pattern!r}" if pattern else "split_heads" if heads else "split_fused"
            _check_blocks(r, params[r.name], sizes, origin, muon_nd)
        if groups is not None:
            reason = _groups_reason(r.reason, shape, groups, sizes, pattern)
        elif heads is not None and (pattern is None or (fused is None and sizes is None)):
            kept = f"orthogonalised whole (matrix_blocks {pattern!r})"
            reason = f"{r.reason}; {heads.words if pattern is None else kept}"
        elif gates is not None and pattern is None:
            reason = _gates_reason(r.reason, gates, sizes)
        else:
            reason = _blocks_reason(r.reason, fused, sizes, pattern, muon_nd)
        done.append(replace(r, reason=reason, blocks=sizes))
    return done


def _found_sizes(shape: tuple[int, ...], groups: int | None, heads: HeadBlocks | None,
                 fused: tuple[str, tuple[int, ...] | None] | None, gates: tuple[str, tuple[int, ...]] | None,
                 split_fused: bool | None, muon_nd: bool) -> tuple[int, ...] | None:
    """The blocks no pattern gave: a grouped kernel's groups, else the heads (``split_heads``), else a fused
    projection's blocks where ``split_fused`` (or, for recurrent gates, the Muon class) says so."""
    if groups is not None:
        return (shape[0] // groups,) * groups
    if heads is not None:
        return heads.sizes
    if fused is None or fused[1] is None:
        return None
    if gates is not None:
        return fused[1] if muon_nd or split_fused else None
    return fused[1] if split_fused or (split_fused is None and muon_nd and _split_by_default(*fused)) else None


def _split_by_default(what: str, sizes: tuple[int, ...] | None) -> bool:
    """Whether ``route_parameters(split_fused=None)`` (the default) splits a fused projection of ``what``
    (``"q, k, v"``) into blocks of ``sizes``: attention projections of equal blocks (q, k and v of one width:
    measured better split on the shipped GPT and GPT-2, docs/guides/routing.md), not grouped-query attention's
    unequal ones (measured no better) nor MoE experts' gate and up (no better)."""
    return set(what.split(", ")) <= {"q", "k", "v"} and sizes is not None and len(set(sizes)) == 1


def _check_blocks(r: Route, p: Tensor, sizes: tuple[int, ...], origin: str, muon_nd: bool) -> None:
    """Refuse blocks that do not cover a parameter's output rows, and blocks for a Muon class that cannot split
    (``origin``: what asked for them)."""
    if not muon_nd:
        raise ValueError(f"{origin} splits `{r.name}` into blocks, which torch.optim.Muon cannot do (it would "
                         "orthogonalise the fused matrix): use lightning_muon.Muon, or drop the blocks")
    if not groups.blocks_cover(p.shape, r.layout, sizes):
        rows = p.shape[groups.block_dim(r.layout)]
        raise ValueError(f"{origin} gives `{r.name}` of shape {tuple(p.shape)} the blocks {list(sizes)}, which do not "
                         f"add up to its {rows} output rows; give positive sizes that do")


def _blocks_reason(reason: str, found: tuple[str, tuple[int, ...] | None] | None, sizes: tuple[int, ...] | None,
                   pattern: str | None, muon_nd: bool = True) -> str:
    """The reason, with what is fused and whether its blocks are orthogonalised on their own."""
    if sizes is not None:
        what = f"fused {found[0]}" if found else "blocks"
        via = f" (matrix_blocks {pattern!r})" if pattern else ""
        return f"{reason}; {what} {'+'.join(map(str, sizes))}: each block orthogonalised{via}"
    if found is None:
        return reason
    what, found_sizes = found
    if found_sizes is None:
        return f"{reason}; fused {what}, interleaved: orthogonalised whole"
    off = (f"matrix_blocks {pattern!r}" if pattern else "split_fused=True splits it" if muon_nd
           else "torch.optim.Muon cannot split")
    return f"{reason}; fused {what} {'+'.join(map(str, found_sizes))}, orthogonalised whole ({off})"


def _gates_reason(reason: str, gates: tuple[str, tuple[int, ...]], sizes: tuple[int, ...] | None) -> str:
    """The reason of a recurrent layer's gate-stacked matrix on Muon that no pattern decided: split per gate (the
    measured default), or whole where the Muon class cannot split (``torch.optim.Muon``)."""
    what, gate_sizes = gates[0], "+".join(map(str, gates[1]))
    if sizes is None:
        return f"{reason}; fused {what} {gate_sizes}, orthogonalised whole (torch.optim.Muon cannot split)"
    return f"{reason}; fused {what} {gate_sizes}: each gate orthogonalised alone (measured, benchmarks/torch_layers.py)"


def _groups_reason(reason: str, shape: tuple[int, ...], groups: int, sizes: tuple[int, ...] | None,
                   pattern: str | None) -> str:
    """The reason of a grouped convolution's kernel on Muon, with how its groups are orthogonalised."""
    cols = math.prod(shape[1:])
    if sizes == (shape[0] // groups,) * groups:
        return f"{reason}; each group orthogonalised alone as {shape[0] // groups}x{cols}"
    if sizes is None:
        return f"{reason}; orthogonalised whole as {shape[0]}x{cols}, across its groups (matrix_blocks {pattern!r})"
    return _blocks_reason(reason, None, sizes, pattern)


def _roles_from(graph: GraphRoles | None) -> str:
    """Where the output heads and input layers of a routing with ``graph`` came from, for the table."""
    if graph is None:
        return "names and structure (no training batch seen)"
    if graph.heads is None and graph.inputs is None:
        return f"names and structure (the training batch could not be followed: {graph.note})"
    said = "the first batch's computation" + (" and later batches'" if graph.late else "")
    said += f" ({graph.note})" if graph.note else ""
    if graph.unreached:
        count = len(graph.unreached)
        said += (f"; {count} parameter{'' if count == 1 else 's'} no batch has reached yet (\"{NOT_REACHED}\"): "
                 "from names and structure until one does")
    return said
