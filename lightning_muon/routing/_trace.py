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

The trace follows the batch itself, not the autograd graph: the batch does not require gradients, so it is not in
that graph, and the constants that are (RoPE tables, masks) would read as data there. The trace is observation
only: every call runs unchanged (compiled modules run eagerly during it), and the trace's own bookkeeping never
raises into the model (a failure there ends the trace, with no verdict). Its cost is one Python call per torch
call of one forward, once.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_muon.optim._dtensor import local_tensor

__all__ = ["MATRIX_OPS", "GraphRoles", "RoleTrace", "loss_in", "trace_roles", "trace_step"]

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


@dataclass(frozen=True)
class GraphRoles:
    """The roles one batch showed, by parameter name (plain data: saved in checkpoints as `to_dict`).

    ``heads`` and ``inputs`` are ``None`` where the batch gave no verdict (the loss was not followed, or no
    batch tensor reached a matrix op): those roles then come from the structural rules.

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

    def role(self, name: str) -> str | None:
        """``"head"``, ``"input"``, ``"hidden"`` (seen, neither), or ``None`` (the batch cannot tell)."""
        if self.heads is not None and name in self.heads:
            return "head"
        if self.inputs is not None and name in self.inputs:
            return "input"
        if name in self.seen and self.heads is not None:
            return "hidden"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "seen": sorted(self.seen),
            "heads": None if self.heads is None else sorted(self.heads),
            "inputs": None if self.inputs is None else sorted(self.inputs),
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphRoles:
        heads, inputs = data.get("heads"), data.get("inputs")
        return cls(
            seen=frozenset(data.get("seen", ())),
            heads=None if heads is None else frozenset(heads),
            inputs=None if inputs is None else frozenset(inputs),
            note=data.get("note", ""),
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
    #: Tensors computed from parameters alone -> the matrices among those parameters.
    _weights: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    #: Tensors from the batch.
    _from_batch: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    #: Tensors -> the matrices whose outputs reach them through no other matrix.
    _carried: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    _seen: set[str] = field(default_factory=set)
    _inputs: set[str] = field(default_factory=set)
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
        met in a call is looked up again then."""
        for prefix, mod in self.module.named_modules(remove_duplicate=False):
            for name, p in mod.named_parameters(recurse=False):
                if p not in self._param_names:
                    self._param_names[p] = f"{prefix}.{name}" if prefix else name
                    self._weights[p] = frozenset({self._param_names[p]}) if p.ndim >= 2 else frozenset()

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
        new = [t for t in inputs if t.is_leaf and (t.requires_grad or isinstance(t, nn.Parameter))
               and t not in self._param_names]
        if any(t not in self._strangers for t in new):
            self._know_parameters()
            for t in new:
                if t not in self._param_names:
                    self._strangers[t] = True
        weights = [self._weights[t] for t in inputs if t in self._weights]
        others = [t for t in inputs if t not in self._weights]
        applied: frozenset[str] = frozenset().union(*weights)
        carried: frozenset[str] = frozenset().union(*(self._carried.get(t, frozenset()) for t in others))
        any_batch = any(t in self._from_batch for t in others)
        # Masks, lengths and indices from the batch applied to an activation leave it an activation; the batch's
        # own values next to one (a concatenation) stay the batch.
        activations = any(t in self._carried and t not in self._from_batch for t in others)
        from_batch = any_batch and (not activations or name in _CONCATENATIONS)
        targets = self._targets(name, inputs, out)
        if name in MATRIX_OPS and applied and others:  # a matrix applied to an activation or to the batch
            self._seen |= applied
            if from_batch:
                self._inputs |= _input_side(name, applied)
                self._batch_reached_matrix = True
            self._mark(targets, carried=_output_side(name, applied))
        elif weights and not any_batch and not carried:  # computed from parameters (and constants) alone
            self._mark(targets, weights=applied)
        else:
            self._mark(targets, from_batch=from_batch, carried=carried)
        self._link_shards(targets)

    def _link_shards(self, tensors: list[Tensor]) -> None:
        """A DTensor and its local shard hold the same values: what is known of one holds for the other. Tensor
        parallelism wraps the batch into DTensors (``DTensor.from_local``) and unwraps outputs (``to_local``) in
        calls the mode does not see, only the views of the local tensor inside them."""
        for t in tensors:
            local = local_tensor(t)
            if local is None:
                continue
            for facts in (self._weights, self._from_batch, self._carried):
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

    def _mark(self, targets: list[Tensor], *, weights: frozenset[str] | None = None, from_batch: bool = False,
              carried: frozenset[str] = frozenset()) -> None:
        """Record what ``targets`` now hold: parameters alone (``weights``), or the batch and carried matrices."""
        for t in targets:
            self._weights.pop(t, None)
            self._from_batch.pop(t, None)
            self._carried.pop(t, None)
            if weights is not None:
                self._weights[t] = weights
            if from_batch:
                self._from_batch[t] = True
            if carried:
                self._carried[t] = carried

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
        return GraphRoles(seen=seen, heads=heads, inputs=inputs, note="; ".join(note))


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
