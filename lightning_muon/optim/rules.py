"""The update rules: what a Muon step does with each matrix's orthogonalised update before it moves the weights.

Plain Muon is momentum, Newton-Schulz, weight decay, then the step (`lightning_muon.Muon`'s docstring):

```text
O <- NewtonSchulz(momentum(g))
p <- p * (1 - lr * weight_decay)
p <- p - adjust_lr(lr, p.shape) * O
```

A rule changes the update ``O`` between the first and the last line (`NorMuon`: each neuron's row divided by its
running RMS), or the decay (`CautiousWeightDecay`: only where ``p * O >= 0``), or both. One class each, here, and a
param group selects a rule by the rule's key (`UpdateRule.key`): ``normuon_beta2`` turns NorMuon on and is its
setting, ``cautious_weight_decay`` cautious decay. The group's value is the rule's setting, so param groups stay plain
data (state dicts and distributed checkpoints save them); a rule's state lives in the optimizer state under its own
keys (`UpdateRule.state_keys`), beside ``momentum_buffer``, and is saved and resumed with it.

A group's rules run in the order they were registered (NorMuon, then cautious decay, then the user's own). The
distribution strategies call their hooks and name none: on one process and under DDP a rule sees whole updates
(`UpdateRule.update`); under FSDP2 and tensor parallelism each matrix is orthogonalised whole on one owner rank,
which computes what the rule needs of the whole matrix (`UpdateRule.statistics`), one all-reduce shares it, and every
rank changes its own shards with it (`UpdateRule.update_shards`).

A rule of your own is one subclass and `register_rule`; the optimizer guide shows one (docs/guides/optimizer.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_muon.optim import _registry
from lightning_muon.optim._bucket import Bucket
from lightning_muon.optim._dtensor import local_slices
from lightning_muon.optim.groups import (
    MATRIX_BLOCKS,
    MATRIX_LAYOUTS,
    NAME,
    NORMUON_EPS,
    PARAM_NAMES,
    SECOND_MOMENT,
    STORED_IN_OUT,
    row_moment_shape,
)

__all__ = ["Bucket", "CautiousWeightDecay", "NorMuon", "UpdateRule", "register_rule", "rules_for"]

#: The param-group keys of `lightning_muon.Muon` itself (a rule cannot take one of them as its key).
_MUON_KEYS = frozenset({
    "params", "lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn",
    "ns_dtype", "ns_batch_bytes", "ns_gram_aspect", "ns_precondition", NAME, PARAM_NAMES, MATRIX_LAYOUTS, MATRIX_BLOCKS,
    "algorithm",
})


class UpdateRule:
    """One update rule: its group key and setting, its state, its maths on whole updates and on shards.

    Every hook has a default that changes nothing, so a subclass overrides what its rule does:

    - `update`: the rule's maths on the bucket's whole orthogonalised updates (one process, DDP, and the fallback
      that gathers sharded matrices whole on every rank);
    - `statistics_shapes` and `statistics`: what a rank holding only shards needs of the whole matrix (a norm, a
      row's mean square), computed by the matrix's owner rank under FSDP2 and tensor parallelism; none by default;
    - `update_shards`: the rule's maths on this rank's shards, with those statistics; by default `update` on the
      shards, right for a rule that reads each entry alone;
    - `decay`: the rule's weight decay in place of the plain one (at most one rule of a group decays).

    A rule holds no tensors itself: its setting is the group's value (``bucket.group[rule.key]``), its state is the
    optimizer's (``bucket.states[key]``, created by `new_state`).
    """

    #: The param-group key that turns the rule on (any value but ``None`` and ``False``) and holds its setting.
    key: ClassVar[str]
    #: What a valid setting is, for the refusal of an invalid one (``Invalid <key>: <value> (<must>)``).
    must: ClassVar[str] = "any value; None turns the rule off"
    #: The keys of the rule's per-parameter state in the optimizer state (beside ``momentum_buffer``).
    state_keys: ClassVar[tuple[str, ...]] = ()
    #: The rule names the update in words in place of ``"Muon"`` (a variant: ``"NorMuon (normuon_beta2=0.95)"``),
    #: rather than following it (``"Muon, cautious weight decay"``).
    names_the_rule: ClassVar[bool] = False

    def valid(self, value: Any) -> bool:
        """Whether ``value`` is a setting the rule takes (`must` says what it must be)."""
        return True

    def selects(self, group: dict[str, Any]) -> bool:
        """Whether a param group uses the rule: its key is set, to anything but ``None`` or ``False``."""
        value = group.get(self.key)
        return value is not None and value is not False

    def describe(self, value: Any) -> str:
        """The rule in words with its setting, as the routing table and ``lightning-muon inspect`` say it."""
        return f"{type(self).__name__} ({self.key}={value!r})"

    def new_state(self, param: Tensor, layout: str) -> dict[str, Tensor]:
        """The rule's state of a parameter before its first step, by state key (`state_keys`).

        A parameter split into blocks (``matrix_blocks``) keeps one state tensor whole; each block sees its part,
        cut along the parameter's output dim (`lightning_muon.optim.groups.block_dim`). So a state tensor is shaped
        like the parameter (a DTensor parameter's then sharded like it), or holds one value per output row along
        that dim (a plain tensor, every rank keeping all of it, as NorMuon's ``row_moment_shape``)."""
        return {}

    def update(self, bucket: Bucket, updates: list[Tensor]) -> list[Tensor]:
        """The rule's updates from the whole orthogonalised ones: one per parameter of ``bucket``, each its
        ``bucket.per_param`` matrices of ``bucket.shape`` (as ``(m, n)`` or ``(per_param, m, n)``: reshape to what
        you need), in the Newton-Schulz dtype; return as many elements per parameter, in any float dtype."""
        return updates

    def statistics_shapes(self, bucket: Bucket) -> list[tuple[tuple[int, ...], ...]]:
        """The shapes of what `statistics` returns, per parameter of ``bucket`` (every rank knows them before any
        owner has computed them); ``[]`` (the default): the rule needs nothing of the whole matrix."""
        return []

    def statistics(self, bucket: Bucket, updates: list[Tensor]) -> list[tuple[Tensor, ...]]:
        """What a rank holding shards of ``bucket``'s matrices needs of the whole ones, computed by their owner from
        the whole orthogonalised updates (each ``(per_param, m, n)``): per parameter, float32 tensors shaped as
        `statistics_shapes` says. Read the rule's state, do not change it: every rank changes its own in
        `update_shards`."""
        return []

    def update_shards(self, bucket: Bucket, shards: list[Tensor], statistics: Sequence[tuple[Tensor, ...]],
                      params: Sequence[Tensor]) -> list[Tensor]:
        """The rule's updates of this rank's shards (``shards``, one per parameter, shaped like its local tensor)
        from the owners' `statistics` (empty tuples where the rule has none). ``bucket`` is this rank's (its
        params, buffers and DTensor states local; plain-tensor states whole); ``params`` the DTensor parameters
        themselves, for where each shard lies (each shard's slices of the whole tensor)."""
        return self.update(bucket, shards)

    def decay(self, params: list[Tensor], updates: list[Tensor], coefficient: float) -> bool:
        """Decay ``params`` in place by ``coefficient`` (``lr * weight_decay``, not 0) knowing their ``updates``
        (shaped as the params), in place of the plain ``p * (1 - coefficient)``; ``False`` (the default): the
        rule does not decay, the plain decay applies."""
        return False

    @property
    def decays(self) -> bool:
        """Whether the rule has a decay of its own (overrides `decay`)."""
        return type(self).decay is not UpdateRule.decay


def register_rule(rule: type[UpdateRule]) -> type[UpdateRule]:
    """Make a rule selectable by its key in any `lightning_muon.Muon` param group (a class decorator too).

    Registering the same class again does nothing; a key that another rule or Muon itself uses is refused.
    """
    key = getattr(rule, "key", None)
    if not isinstance(key, str) or not key:
        raise ValueError(f"an update rule needs a param-group key: give {rule.__name__} a `key` class attribute")
    if key in _MUON_KEYS:
        raise ValueError(f"{rule.__name__}'s key {key!r} is a setting of Muon itself; give the rule a key of its own")
    registered = _registry.RULES.get(key)
    if registered is not None and type(registered) is not rule:
        raise ValueError(f"{rule.__name__}'s key {key!r} is {type(registered).__name__}'s already; give it another")
    if registered is None:
        _registry.RULES[key] = rule()
    return rule


def rules_for(group: dict[str, Any]) -> list[UpdateRule]:
    """The rules a param group selects, in the order they run (the order they were registered)."""
    return [rule for rule in _registry.selected(group) if isinstance(rule, UpdateRule)]


# ------------------------------------------------------------------------------------------- NorMuon


class NorMuon(UpdateRule):
    """NorMuon (Li et al. 2025, arXiv 2510.05491, as microsoft/dion's): each neuron's update divided by its running
    RMS, the matrix rescaled to the norm it had.

    For each neuron (output row of ``O``; a column for a weight stored ``in x out``; each matrix of a stack its own
    rows), in float32: ``v <- v.lerp(mean(O_row**2), 1 - normuon_beta2)`` (state ``normuon_second_moment``,
    `lightning_muon.optim.groups.row_moment_shape`), ``O_row <- O_row / (sqrt(v) + 1e-8)``, then ``O`` rescaled to
    the Frobenius norm it had. Sharded, the owner computes each row's mean square and each matrix's rescale from
    the whole matrix, and every rank advances every ``v`` alike (a plain tensor, whole on every rank) and divides
    its own rows: the same bits as one process.
    """

    key = "normuon_beta2"
    must = "must be None (plain Muon) or a number in [0, 1) (NorMuon; 0.95 is dion's and the paper's)"
    state_keys = (SECOND_MOMENT,)
    names_the_rule = True

    def valid(self, value: Any) -> bool:
        return value is None or (isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value < 1.0)

    def describe(self, value: Any) -> str:
        return f"NorMuon (normuon_beta2={value:g})"

    def new_state(self, param: Tensor, layout: str) -> dict[str, Tensor]:
        """float32 zeros, one per neuron (`row_moment_shape`), a plain tensor of the whole parameter's neurons also
        when it is a DTensor (every rank keeps them all, and every rank advances them alike)."""
        moment = torch.zeros(row_moment_shape(param.shape, layout), dtype=torch.float32, device=param.device)
        return {SECOND_MOMENT: moment}

    def update(self, bucket: Bucket, updates: list[Tensor]) -> list[Tensor]:
        normalized, _, _ = _normuon(bucket, updates, in_place=True)
        return [u.reshape(o.shape) for u, o in zip(normalized.unbind(0), updates, strict=True)]

    def statistics_shapes(self, bucket: Bucket) -> list[tuple[tuple[int, ...], ...]]:
        """Per parameter: each neuron's mean square (shaped as its second moment) and each matrix's rescale
        (``(*stack, 1, 1)``, or ``(1, 1)``)."""
        return [(tuple(v.shape), (*v.shape[:-2], 1, 1)) for v in bucket.states[SECOND_MOMENT]]

    def statistics(self, bucket: Bucket, updates: list[Tensor]) -> list[tuple[Tensor, ...]]:
        _, mean_square, rescale = _normuon(bucket, updates, in_place=False)
        moments = list(bucket.states[SECOND_MOMENT])
        return [(s.reshape(v.shape), r.reshape(*v.shape[:-2], 1, 1))
                for s, r, v in zip(mean_square.unbind(0), rescale.unbind(0), moments, strict=True)]

    def update_shards(self, bucket: Bucket, shards: list[Tensor], statistics: Sequence[tuple[Tensor, ...]],
                      params: Sequence[Tensor]) -> list[Tensor]:
        """Every rank advances every moment alike, then divides its rows by theirs and rescales them, element by
        element as `update` does on one process. Results in float32."""
        results = []
        beta2 = bucket.group[self.key]
        for shard, moment, (mean_square, rescale), param in zip(shards, bucket.states[SECOND_MOMENT], statistics,
                                                                params, strict=True):
            moment.lerp_(mean_square, 1 - beta2)
            rows, scale = _moment_slices(param, bucket.layout)
            local = shard.float().reshape(_matrix_view(param.to_local().shape, bucket.layout))  # type: ignore[attr-defined]
            normalized = local / (moment[rows].sqrt() + NORMUON_EPS)
            normalized *= rescale[scale]
            results.append(normalized.reshape(shard.shape))
        return results


def _normuon(bucket: Bucket, orthogonal: list[Tensor], in_place: bool) -> tuple[Tensor, Tensor, Tensor]:
    """NorMuon's maths on a bucket's whole updates: the normalised updates ``(updates, per_param, m, n)``, the
    neurons' mean squares and the matrices' rescales; the moments advanced in place where ``in_place``."""
    m, n = bucket.shape
    per, dim = (bucket.per_param, m, n), (-2 if bucket.layout in STORED_IN_OUT else -1)
    olds = list(bucket.states[SECOND_MOMENT])
    updates = torch.stack([o.reshape(per) for o in orthogonal]).float()
    moments = torch.stack([v.reshape(bucket.per_param, *v.shape[-2:]) for v in olds]).float()
    norms = torch.linalg.vector_norm(updates, dim=(-2, -1), keepdim=True)
    mean_square = updates.square().mean(dim=dim, keepdim=True)
    moments.lerp_(mean_square, 1 - bucket.group[NorMuon.key])
    normalized = updates / (moments.sqrt() + NORMUON_EPS)
    rescale = norms / torch.linalg.vector_norm(normalized, dim=(-2, -1), keepdim=True).clamp_min(NORMUON_EPS)
    normalized *= rescale
    if in_place:
        torch._foreach_copy_(olds, [v.reshape(old.shape) for v, old in zip(moments, olds, strict=True)])
    return normalized, mean_square, rescale


def _matrix_view(shape: torch.Size, layout: str) -> tuple[int, ...]:
    """A (local) parameter's shape as its second moment broadcasts against it: ``(rows, rest)`` for ``"flatten"``
    (a conv kernel's matrix), the shape itself for the other layouts."""
    return (shape[0], math.prod(shape[1:])) if layout == "flatten" else tuple(shape)


def _moment_slices(param: Tensor, layout: str) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
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


# ------------------------------------------------------------------------------- cautious weight decay


class CautiousWeightDecay(UpdateRule):
    """Cautious weight decay (dion's ``cautious_wd``, Chen et al. 2025): an entry decays only where it and its
    update have the same sign (``p * update >= 0``: the step already moves it toward zero), with the base lr."""

    key = "cautious_weight_decay"
    must = "must be True or False"

    def valid(self, value: Any) -> bool:
        return isinstance(value, bool)

    def describe(self, value: Any) -> str:
        return "cautious weight decay"

    def decay(self, params: list[Tensor], updates: list[Tensor], coefficient: float) -> bool:
        decays = [p * (p * u >= 0) for p, u in zip(params, updates, strict=True)]
        torch._foreach_add_(params, decays, alpha=-coefficient)
        return True


register_rule(NorMuon)
register_rule(CautiousWeightDecay)
