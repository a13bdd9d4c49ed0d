"""What one training batch shows about a model's matrices: which are its output heads and which its input layers,
read from the computation itself rather than from names (`trace_roles`, `GraphRoles`).

While the batch's forward runs, a ``TorchFunctionMode`` sees every torch call and follows two things through it:

- **from the batch**: a tensor of the batch, or one computed from it through no learnable matrix (a mask,
  length or index from the batch applied to an activation leaves it an activation: only a concatenation puts the
  batch's values beside one);
- **carried matrices**: the learnable matrices whose outputs reach a tensor through no other learnable matrix.

A call is a *matrix op* when it applies a learnable matrix as a linear map (`MATRIX_OPS`: linear, matmul, conv,
embedding, the recurrent layers, attention's in-projection); the matrix is a parameter of two or more dimensions
(trainable or frozen: a frozen embedding, backbone or base model is a layer like any other, and frozen parameters
are routed nowhere), or a tensor computed from parameters alone (``W.t()``, a weight-normalised ``W``,
``W * mask``). At a matrix op, the matrices it applies are *input layers* when another of its inputs is from the
batch; its output carries just those matrices and is not from the batch. Every other call passes both on (its
outputs are from the batch if an input is, and carry the union of its inputs' matrices). The *output heads* are
the matrices the loss carries: all of them, parallel heads included.

Under tensor parallelism the batch and the activations pass in and out of DTensors in calls the mode does not see
(``DTensor.from_local``, ``to_local``): a DTensor and its local shard are taken to hold the same thing, so the trace
follows a model whose every parameter is a DTensor as it follows the plain one.

It also sees how each parameter is used: as a matrix (the weight operand of a matmul, linear or convolution,
directly or through a parametrization: ``W.t()``, weight norm's direction), or only added, multiplied
elementwise, indexed, concatenated beside activations, fed to a layer as its input, or broadcast to scale a
matrix (weight norm's magnitude). A parameter used only so is no linear map, whatever its name or shape
(`GraphRoles.elementwise`); one that meets a call the trace does not know gets no such verdict.

Which trainable parameters the batch reached at all is read from the loss's autograd graph (the parameters it
will give a gradient); the others are `GraphRoles.unreached`: their roles come from names and structure until a
later batch reaches them (`GraphRoles.merge`).

The trace follows the batch itself, not the autograd graph: the batch does not require gradients, so it is not in
that graph, and the constants that are (RoPE tables, masks) would read as data there. The trace is observation
only: every call runs unchanged (compiled modules run eagerly during it), and the trace's own bookkeeping never
raises into the model (a failure there ends the trace, with no verdict). Its cost is one Python call per torch
call of one forward, once.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_muon.optim._dtensor import local_tensor

__all__ = ["MATRIX_OPS", "USES", "GraphRoles", "RoleTrace", "loss_in", "trace_roles", "trace_step"]

#: The recurrent layers' calls: all their matrices in one call.
_RECURRENT = frozenset(
    {"lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"}
)

#: The torch calls that apply a matrix argument as a linear map (by ``__name__``).
MATRIX_OPS = _RECURRENT | frozenset({
    "linear", "bilinear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm",
    "mv", "addmv", "einsum", "tensordot", "_grouped_mm",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution",
    "embedding", "embedding_bag", "multi_head_attention_forward",
})


#: What a batch did with a parameter it used, but not as a matrix, in words (`GraphRoles.elementwise`).
USES = {
    "adds": "adds it to activations",
    "multiplies": "multiplies activations by it elementwise",
    "indexes": "indexes it",
    "concatenates": "concatenates it with activations",
    "feeds": "feeds it to a layer as its input",
    "scales": "scales a matrix by it (broadcast)",
}
#: Uses that make a parameter a table (token or position rows), not a scale.
TABLE_USES = frozenset({"adds", "indexes", "concatenates", "feeds"})


@dataclass(frozen=True)
class GraphRoles:
    """The roles the batches showed, by parameter name (plain data: saved in checkpoints as `to_dict`).

    ``heads`` and ``inputs`` are ``None`` where the batch gave no verdict (the loss was not followed, or no
    batch tensor reached a matrix op): those roles then come from the structural rules. A parameter in
    ``unreached`` has no role yet, whatever the sets say: no batch has reached it.

    Examples:
        `lightning_muon.trace_roles` makes one; `lightning_muon.route_parameters` reads it (``graph=``):

        ```python
        import torch
        from torch import nn
        from lightning_muon import trace_roles

        model = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        batch = torch.randn(16, 1), torch.randn(16, 2)
        roles = trace_roles(model, batch, lambda b: nn.functional.mse_loss(model(b[0]), b[1]))
        print(sorted(roles.inputs), sorted(roles.heads))  # ['0.weight'] ['4.weight']
        print(roles.role("2.weight"))  # hidden
        ```
    """

    #: Matrices applied by a matrix op during the forward.
    seen: frozenset[str] = frozenset()
    #: Matrices whose outputs reach the loss through no other learnable matrix.
    heads: frozenset[str] | None = None
    #: Matrices applied to the batch through no other learnable matrix.
    inputs: frozenset[str] | None = None
    #: Why there is no verdict (``""`` when there is one).
    note: str = ""
    #: Parameters the batch used, never as a matrix: what it did with each (keys of the trace's uses table, in order).
    elementwise: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)
    #: Trainable parameters the loss did not depend on (no batch has reached them yet); ``None``: not known
    #: (every parameter is taken as reached).
    unreached: frozenset[str] | None = None
    #: Parameters that a later batch reached first, not the first one (`merge`).
    late: frozenset[str] = frozenset()

    def role(self, name: str) -> str | None:
        """``"head"``, ``"input"``, ``"hidden"`` (seen, neither), ``"elementwise"`` (used, never as a matrix), or
        ``None`` (the batches cannot tell, or have not reached it)."""
        if self.unreached is not None and name in self.unreached:
            return None
        if self.heads is not None and name in self.heads:
            return "head"
        if self.inputs is not None and name in self.inputs:
            return "input"
        if name in self.seen and self.heads is not None:
            return "hidden"
        if name in self.elementwise:
            return "elementwise"
        return None

    def reached(self, names: frozenset[str] | set[str]) -> GraphRoles:
        """These roles with ``names`` taken as reached, with no verdict of their own: their roles stay the ones
        names and structure give (parameters that trained by a path the batches could not show)."""
        if self.unreached is None or not self.unreached & names:
            return self
        return replace(self, unreached=self.unreached - names)

    def merge(self, later: GraphRoles) -> GraphRoles:
        """These roles with what ``later``, a later batch's, showed of the parameters these had not reached and it
        did (they are `late`); the others keep theirs (their optimizers hold them already)."""
        if self.unreached is None or later.unreached is None or later.heads is None:
            return self
        newly = self.unreached - later.unreached
        if not newly:
            return self
        inputs = None if self.inputs is None and later.inputs is None else (
            (self.inputs or frozenset()) | ((later.inputs or frozenset()) & newly))
        return replace(
            self,
            seen=self.seen | (later.seen & newly),
            heads=(self.heads or frozenset()) | (later.heads & newly),
            inputs=inputs,
            elementwise={**self.elementwise, **{n: u for n, u in later.elementwise.items() if n in newly}},
            unreached=self.unreached - newly,
            late=self.late | newly,
        )

    @classmethod
    def combined(cls, per_rank: Sequence[GraphRoles]) -> tuple[GraphRoles, list[str]]:
        """The roles several ranks' batches of one step showed together, with the parameters two ranks that reached
        them saw in different roles (sorted). A parameter one rank did not reach takes the role the ranks that did
        saw; one no rank reached stays unreached. Where a rank has no verdict (its trace failed, its loss was not
        followed), each rank keeps its own (the first's is returned)."""
        if len(per_rank) == 1 or any(r.unreached is None or r.heads is None for r in per_rank):
            return per_rank[0], []
        unreached = frozenset.intersection(*(r.unreached for r in per_rank if r.unreached is not None))

        def known(r: GraphRoles, names: frozenset[str] | None) -> frozenset[str]:
            return (names or frozenset()) - (r.unreached or frozenset())

        names = frozenset().union(*(r.seen | (r.heads or frozenset()) | (r.inputs or frozenset()) | set(r.elementwise)
                                    for r in per_rank))
        conflicts = sorted(n for n in names if len({r.role(n) for r in per_rank} - {None}) > 1)
        elementwise: dict[str, tuple[str, ...]] = {}
        for r in per_rank:
            elementwise.update((n, u) for n, u in r.elementwise.items() if n not in (r.unreached or frozenset()))
        inputs = [known(r, r.inputs) for r in per_rank if r.inputs is not None]
        combined = cls(
            seen=frozenset().union(*(known(r, r.seen) for r in per_rank)),
            heads=frozenset().union(*(known(r, r.heads) for r in per_rank)),
            inputs=frozenset().union(*inputs) if inputs else None,
            note="; ".join(dict.fromkeys(r.note for r in per_rank if r.note)),
            elementwise=elementwise,
            unreached=unreached,
            late=frozenset().union(*(r.late for r in per_rank)),
        )
        return combined, conflicts

    def to_dict(self) -> dict[str, Any]:
        return {
            "seen": sorted(self.seen),
            "heads": None if self.heads is None else sorted(self.heads),
            "inputs": None if self.inputs is None else sorted(self.inputs),
            "note": self.note,
            "elementwise": {n: list(u) for n, u in sorted(self.elementwise.items())},
            "unreached": None if self.unreached is None else sorted(self.unreached),
            "late": sorted(self.late),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphRoles:
        heads, inputs, unreached = data.get("heads"), data.get("inputs"), data.get("unreached")
        return cls(
            seen=frozenset(data.get("seen", ())),
            heads=None if heads is None else frozenset(heads),
            inputs=None if inputs is None else frozenset(inputs),
            note=data.get("note", ""),
            elementwise={n: tuple(u) for n, u in data.get("elementwise", {}).items()},
            unreached=None if unreached is None else frozenset(unreached),
            late=frozenset(data.get("late", ())),
        )


def _tensors(value: Any, attributes: bool = False, depth: int = 0) -> Iterator[Tensor]:
    """Every tensor in a nest of tuples, lists and dicts (what torch calls take); with ``attributes``, also in
    objects holding tensors as attributes (a training batch: dataclasses, batch classes), 8 levels deep at most."""
    if isinstance(value, Tensor):
        yield value
    elif depth > 8:
        return
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item, attributes, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, attributes, depth + 1)
    elif attributes and hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
        for item in vars(value).values():
            yield from _tensors(item, attributes, depth + 1)


#: Recurrent layers apply all their matrices in one call; these read the call's input (the rest, its state).
_RNN_INPUT = re.compile(r"weight_ih(_l0)?(_reverse)?$")
#: Attention's in-projections read its input; its out-projection gives its output.
_ATTENTION_INPUT = re.compile(r"(in_proj_weight|[qkv]_proj_weight)$")


def _input_side(op: str, applied: frozenset[str]) -> frozenset[str]:
    """The matrices of a matrix op that read its input (all but recurrent state and attention's output)."""
    if op in _RECURRENT:
        return frozenset(n for n in applied if _RNN_INPUT.search(n))
    if op == "multi_head_attention_forward":
        return frozenset(n for n in applied if _ATTENTION_INPUT.search(n))
    return applied


def _output_side(op: str, applied: frozenset[str]) -> frozenset[str]:
    """The matrices of a matrix op whose output is the op's output (attention: only the out-projection)."""
    if op == "multi_head_attention_forward":
        return frozenset(n for n in applied if not _ATTENTION_INPUT.search(n)) or applied
    return applied


#: Calls whose output holds each input's values side by side.
_CONCATENATIONS = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack"})

_IN_PLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"})

#: Matrix ops that look rows of their matrix up rather than apply it (the use ``"indexes"``).
_LOOKUPS = frozenset({"embedding", "embedding_bag"})
#: Calls that select parts of their first argument by an index (a parameter selected by an activation, such as an
#: expert's matrix chosen by a router, stays the parameter).
_SELECTIONS = frozenset({"__getitem__", "index_select", "gather", "take", "take_along_dim", "narrow", "select"})
#: Calls that combine a parameter with activations without applying it as a matrix, with the word for each.
_USE_OF = {
    **dict.fromkeys(("add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__",
                     "sub_", "rsub", "subtract", "lerp"), "adds"),
    **dict.fromkeys(("mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply", "div", "__truediv__",
                     "__rtruediv__", "__itruediv__", "div_", "true_divide", "divide", "addcmul", "addcdiv", "where",
                     "maximum", "minimum"), "multiplies"),
    **dict.fromkeys(_SELECTIONS | _LOOKUPS, "indexes"),
    **dict.fromkeys(_CONCATENATIONS | {"__setitem__"}, "concatenates"),
}
#: The argument a layer's matrix op reads its input from (the rest being its matrices), by op.
_LAYER_INPUT = {
    **dict.fromkeys(("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                     "conv_transpose3d", "convolution"), ("input",)),
    "bilinear": ("input1", "input2"),
}


def _layer_inputs(op: str, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors a layer's matrix op reads as its input (``linear``'s ``input``), not as its matrix."""
    names = _LAYER_INPUT.get(op, ())
    found = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]
    return [t for t in found if isinstance(t, Tensor)]


@dataclass
class RoleTrace(TorchFunctionMode):
    """The mode that follows a forward (see the module's docstring). Enter it around the forward that produces
    the loss, then call `roles` with that loss.

    Args:
        module: the model whose trainable parameters are the matrices to find.
        batch: the training batch (any nest of tensors).
    """

    module: nn.Module
    batch: Any
    _param_names: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    #: Leaf tensors that require gradients but are no parameter of the module (looked up once).
    _strangers: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    #: Tensors computed from parameters and buffers alone -> the matrices among those parameters.
    _weights: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    #: The same tensors -> the matrices whose values they hold whole (not broadcast: weight norm's direction is,
    #: its magnitude is not).
    _whole: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    #: Tensors from the batch.
    _from_batch: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    #: Tensors -> the matrices whose outputs reach them through no other matrix.
    _carried: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    _seen: set[str] = field(default_factory=set)
    _inputs: set[str] = field(default_factory=set)
    #: Parameters used as a matrix; used otherwise (with how); used in calls the trace does not know.
    _as_matrix: set[str] = field(default_factory=set)
    _uses: dict[str, set[str]] = field(default_factory=dict)
    _unknown_uses: set[str] = field(default_factory=set)
    #: Every parameter a call took.
    _met: set[str] = field(default_factory=set)
    _batch_reached_matrix: bool = False
    _failure: str = ""

    def __post_init__(self) -> None:
        super().__init__()
        self._know_parameters()
        for t in _tensors(self.batch, attributes=True):
            self._from_batch[t] = True

    def _know_parameters(self) -> None:
        """Know every parameter the module holds now by its name, frozen ones too: a frozen embedding, backbone or
        base model is a layer like any other, so a head or input layer is found through it, never because of it.
        FSDP2 swaps the registered (sharded) parameters for unsharded ones while a module runs: a parameter first
        met in a call is looked up again then. Buffers are known as constants of the model: what is computed from
        parameters and buffers alone (spectral norm's power iteration, orthogonal's base) is a parameter's."""
        for prefix, mod in self.module.named_modules(remove_duplicate=False):
            for name, p in mod.named_parameters(recurse=False):
                if p not in self._param_names:
                    self._param_names[p] = f"{prefix}.{name}" if prefix else name
                    self._weights[p] = frozenset({self._param_names[p]}) if p.ndim >= 2 else frozenset()
                    self._whole[p] = self._weights[p]
            for b in mod.buffers(recurse=False):
                if b not in self._weights and b not in self._from_batch:
                    self._weights[b] = self._whole[b] = frozenset()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._failure:
            try:
                self._follow(getattr(func, "__name__", ""), args, kwargs, out)
            except Exception as error:  # the trace must never break the model's forward
                self._failure = f"the trace failed at {getattr(func, '__name__', func)!r}: {error!r}"
        return out

    def _follow(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = list(_tensors((args, kwargs)))
        if not inputs:
            return
        self._link_shards(inputs)
        self._meet(inputs)
        weights = [t for t in inputs if t in self._weights]
        others = [t for t in inputs if t not in self._weights]
        applied: frozenset[str] = frozenset().union(*(self._weights[t] for t in weights))
        carried: frozenset[str] = frozenset().union(*(self._carried.get(t, frozenset()) for t in others))
        any_batch = any(t in self._from_batch for t in others)
        # Masks, lengths and indices from the batch applied to an activation leave it an activation; the batch's
        # own values next to one (a concatenation) stay the batch.
        activations = any(t in self._carried and t not in self._from_batch for t in others)
        from_batch = any_batch and (not activations or name in _CONCATENATIONS)
        targets = self._targets(name, inputs, out)
        if name in MATRIX_OPS and applied:
            self._matrix_op(name, args, kwargs, weights, bool(others), from_batch, targets)
        elif weights and not any_batch and not carried:  # computed from parameters (and constants) alone
            for t in targets:
                whole = frozenset().union(*(self._whole[w] for w in weights if w.numel() >= t.numel()))
                self._mark([t], weights=applied, whole=whole)
        elif name in _SELECTIONS and inputs[0] in self._weights and not any_batch:
            # a parameter's part chosen by an activation (an expert's matrix by its router): still the parameter
            self._mark(targets, weights=self._weights[inputs[0]], whole=self._whole[inputs[0]])
        else:
            if applied:  # parameters combined with activations or the batch, not as a matrix
                use = _USE_OF.get(name)
                if use is None:
                    self._unknown_uses |= applied
                else:
                    self._use(applied, use)
            self._mark(targets, from_batch=from_batch, carried=carried)
        self._link_shards(targets)

    def _meet(self, inputs: list[Tensor]) -> None:
        """Know the parameters among a call's ``inputs`` (looking up new ones again: FSDP2's unsharded copies)."""
        new = [t for t in inputs if t.is_leaf and (t.requires_grad or isinstance(t, nn.Parameter))
               and t not in self._param_names]
        if any(t not in self._strangers for t in new):
            self._know_parameters()
            for t in new:
                if t not in self._param_names:
                    self._strangers[t] = True
        self._met.update(n for t in inputs if (n := self._param_names.get(t)) is not None)

    def _matrix_op(self, name: str, args: tuple, kwargs: dict, weights: list[Tensor], on_data: bool,
                   from_batch: bool, targets: list[Tensor]) -> None:
        """A matrix op that takes parameters (``weights``): applied to an activation, the batch or a fresh tensor
        (``on_data``), or a product of parameters and buffers (spectral norm's sigma, orthogonal's base @ Q,
        ``A @ B``)."""
        matrices = self._note_matrix_use(name, args, kwargs, weights)
        if not on_data:
            applied = frozenset().union(*(self._weights[t] for t in weights))
            self._mark(targets, weights=applied, whole=matrices)
            return
        applied = matrices or frozenset().union(*(self._weights[t] for t in weights))
        self._seen |= applied
        if from_batch:
            self._inputs |= _input_side(name, applied)
            self._batch_reached_matrix = True
        self._mark(targets, carried=_output_side(name, applied))

    def _note_matrix_use(self, name: str, args: tuple, kwargs: dict, weights: list[Tensor]) -> frozenset[str]:
        """Record how a matrix op uses the parameters it takes, and return the matrices it applies: those whose
        values its matrix operands hold whole (not those broadcast over one, which scale it, nor a parameter fed
        to a layer as its input)."""
        fed = {id(t) for t in _layer_inputs(name, args, kwargs)}
        operands = [w for w in weights if id(w) not in fed]
        matrices = frozenset().union(*(self._whole[w] for w in operands))
        self._use(frozenset().union(*(self._weights[w] for w in weights if id(w) in fed)), "feeds")
        if name in _LOOKUPS:
            self._use(frozenset().union(*(self._weights[w] for w in operands)), "indexes")
            return matrices
        self._as_matrix |= matrices
        self._use(frozenset().union(*(self._weights[w] - self._whole[w] for w in operands)), "scales")
        return matrices

    def _use(self, names: frozenset[str], use: str) -> None:
        for n in names:
            self._uses.setdefault(n, set()).add(use)

    def _link_shards(self, tensors: list[Tensor]) -> None:
        """A DTensor and its local shard hold the same values: what is known of one holds for the other. Tensor
        parallelism wraps the batch into DTensors (``DTensor.from_local``) and unwraps outputs (``to_local``) in
        calls the mode does not see, only the views of the local tensor inside them."""
        for t in tensors:
            local = local_tensor(t)
            if local is None:
                continue
            for facts in (self._weights, self._whole, self._from_batch, self._carried):
                if t in facts and local not in facts:
                    facts[local] = facts[t]
                elif local in facts and t not in facts:
                    facts[t] = facts[local]

    def _targets(self, name: str, inputs: list[Tensor], out: Any) -> list[Tensor]:
        """The tensors a call wrote: its outputs, and its first input when it writes in place."""
        targets = list(_tensors(out))
        if (name in _IN_PLACE or (name.endswith("_") and not name.startswith("_"))) and inputs[0] not in targets:
            targets.append(inputs[0])  # x[...] = y, x += y, x.copy_(y): x now holds what y held too
        return [t for t in targets if t not in self._param_names]

    def _mark(self, targets: list[Tensor], *, weights: frozenset[str] | None = None,
              whole: frozenset[str] = frozenset(), from_batch: bool = False,
              carried: frozenset[str] = frozenset()) -> None:
        """Record what ``targets`` now hold: parameters alone (``weights``, of which ``whole`` unbroadcast), or the
        batch and carried matrices."""
        for t in targets:
            self._weights.pop(t, None)
            self._whole.pop(t, None)
            self._from_batch.pop(t, None)
            self._carried.pop(t, None)
            if weights is not None:
                self._weights[t] = weights
                self._whole[t] = whole & weights
            if from_batch:
                self._from_batch[t] = True
            if carried:
                self._carried[t] = carried

    def _reached(self, loss: Tensor) -> frozenset[str] | None:
        """The parameters the loss depends on (those it will give a gradient), from its autograd graph; ``None``
        where it has none. Behind a reentrant activation checkpoint (whose graph hides its parameters), every
        parameter a call took."""
        if loss.grad_fn is None:
            return None
        found: set[str] = set()
        hidden = False
        stack: list[Any] = [loss.grad_fn]
        visited: set[Any] = set()
        while stack:
            node = stack.pop()
            if node is None or node in visited:
                continue
            visited.add(node)
            variable = getattr(node, "variable", None)
            if isinstance(variable, Tensor):
                if (name := self._param_names.get(variable)) is not None:
                    found.add(name)
            elif type(node).__name__ == "CheckpointFunctionBackward":
                hidden = True
            stack.extend(f for f, _ in node.next_functions)
        return frozenset(found | self._met if hidden else found)

    def roles(self, loss: Tensor | None) -> GraphRoles:
        """The roles this trace saw, with ``loss`` the forward's loss (``None``: no head verdict)."""
        seen = frozenset(self._seen)
        if self._failure:
            return GraphRoles(note=self._failure)
        heads = None
        note = []
        if loss is not None and loss in self._carried:
            heads = frozenset(self._carried[loss])
        else:
            note.append("the loss could not be followed to the matrices that produce it")
        inputs = frozenset(self._inputs) if self._batch_reached_matrix else None
        if inputs is None:
            note.append("no tensor of the batch reached a matrix")
        elementwise = {n: tuple(u for u in USES if u in uses) for n, uses in self._uses.items()
                       if n not in self._as_matrix and n not in self._unknown_uses}
        unreached = None
        try:
            reached = self._reached(loss) if heads is not None and loss is not None else None
        except Exception:  # a graph node the walk cannot read: what the batch reached is not known
            reached = None
        if reached is not None:
            unreached = frozenset(n for n, p in self.module.named_parameters() if p.requires_grad) - reached
        return GraphRoles(seen=seen, heads=heads, inputs=inputs, note="; ".join(note), elementwise=elementwise,
                          unreached=unreached)


@contextlib.contextmanager
def _tracing(module: nn.Module, batch: Any) -> Iterator[RoleTrace | str]:
    """Follow the forward run inside this block; or, where it cannot be followed, yield why (inside a compiled
    region, a ``TorchFunctionMode`` and compiler stances are not for user code). Entering it never raises."""
    if torch.compiler.is_compiling():
        yield "the step ran inside a compiled region, where it cannot be followed"
        return
    stance = contextlib.ExitStack()
    try:
        trace = RoleTrace(module=module, batch=batch)
        # Compiled modules run eagerly while traced: compiling under the trace would recompile them for it, up to
        # dynamo's limit, after which they would stay eager for the rest of training.
        stance.enter_context(torch.compiler.set_stance("force_eager"))
    except Exception as error:  # the trace must never break the step it follows
        stance.close()
        yield f"the trace could not start: {error!r}"
        return
    with stance, trace:
        yield trace


def trace_step(module: nn.Module, batch: Any, step: Callable[[], Any],
               loss_of: Callable[[Any], Tensor | None]) -> tuple[Any, GraphRoles]:
    """Run ``step()`` once, following its forward, and return its output with the roles it showed (``loss_of``
    takes the loss out of the output). Errors of ``step`` itself are the caller's; the trace adds none: where it
    cannot follow the step, the roles hold no verdict and their ``note`` says why."""
    with _tracing(module, batch) as trace:
        output = step()
    if isinstance(trace, str):
        return output, GraphRoles(note=trace)
    try:
        return output, trace.roles(loss_of(output))
    except Exception as error:
        return output, GraphRoles(note=f"the trace failed on the step's output: {error!r}")


def loss_in(output: Any) -> Tensor | None:
    """The loss a ``training_step`` returned (a tensor, or a dict's ``"loss"``); ``None`` if it holds none. The one
    reading of a step's output: the update loop, the first-batch trace and ``lightning-muon inspect`` use it."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def trace_roles(module: nn.Module, batch: Any, loss_of: Callable[[Any], Any]) -> GraphRoles:
    """The roles of ``module``'s matrices from one forward: ``loss_of(batch)`` computes the loss (a tensor).

    A pure step: the forward runs once, unchanged, and nothing of ``module`` is modified. Where the forward cannot
    be followed, the roles hold no verdict (their ``note`` says why) and routing keeps its structural rules.

    Args:
        module: the model whose parameters are routed.
        batch: one training batch, as the loss function takes it.
        loss_of: ``batch -> loss``, calling ``module`` (the forward that is followed).

    Examples:
        The input layer (``Linear(1, 64)``, as square-ish as any hidden one could be) and the head are found from
        the computation, whatever their names:

        ```python
        import torch
        from torch import nn
        from lightning_muon import route_parameters, trace_roles

        model = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        batch = torch.randn(16, 1), torch.randn(16, 2)
        roles = trace_roles(model, batch, lambda b: nn.functional.mse_loss(model(b[0]), b[1]))
        routing = route_parameters(model, graph=roles)
        print(routing.names("Muon"))  # ['2.weight']
        ```
    """
    _, roles = trace_step(module, batch, lambda: loss_of(batch), loss_in)
    return roles
