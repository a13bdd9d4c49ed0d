"""What one step works on: the `Bucket` (same-shape matrices of one param group, orthogonalised in one Newton-Schulz
call) with its group's `GroupSettings` (resolved once a step), and what a step reports of each matrix
(`ParamDiagnostics`).

The ground that the update rules (`lightning_muon.optim.rules`), the update maths (``_update``), the plan and the
strategies stand on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch import Tensor

from lightning_muon.optim._collectives import ExchangeLayout
from lightning_muon.optim._dtensor import is_dtensor, matrix_parts
from lightning_muon.optim.groups import (
    batch_cap,
    blocks_of,
    group_effective_lr,
    layouts_of,
    ns_dtype,
    ns_settings,
    on_exact_path,
    uses_gram,
)
from lightning_muon.optim.newton_schulz import ns_flops

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["NO_STATES", "Bucket", "Chooser", "GroupSettings", "ParamDiagnostics", "settings_of"]

#: Which parameters a step diagnoses (`Muon.record_diagnostics`).
Chooser = Callable[[Tensor], bool]

#: A bucket without update-rule state (plain Muon).
NO_STATES: Mapping[str, Sequence[Tensor]] = MappingProxyType({})


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


class GroupSettings(NamedTuple):
    """What a step reads of a param group, resolved once a step (by settings_of, after the ranks agreed on the
    Newton-Schulz dtype) and handed down with each of the group's buckets: no stage goes back to the group for it."""

    #: The group itself (for what a step reads of it only where it is used: ``lr``, ``momentum``, the rules' keys).
    group: dict[str, Any]
    #: The Newton-Schulz dtype (`lightning_muon.optim.groups.ns_dtype`: the hardware's where the group leaves it).
    ns_dtype: torch.dtype
    #: The Newton-Schulz kernels' keyword arguments (`lightning_muon.optim.groups.ns_settings`).
    ns_kwargs: dict[str, Any]
    #: The group steps exactly as ``torch.optim.Muon`` (`lightning_muon.optim.groups.on_exact_path`).
    exact: bool
    #: Each parameter's matrix layout and row blocks (`lightning_muon.optim.groups.layouts_of`, ``blocks_of``).
    layouts: list[str]
    blocks: list[list[int] | None]

    def uses_gram(self, shape: tuple[int, int]) -> bool:
        """Whether the group's ``m x n`` matrices go through Gram Newton-Schulz (`groups.uses_gram`)."""
        return uses_gram(self.group, shape)

    def batch_cap(self, device: torch.device) -> int:
        """The most bytes of one batched Newton-Schulz call on ``device`` (`groups.batch_cap`)."""
        return batch_cap(self.group, device)


def settings_of(group: dict[str, Any]) -> GroupSettings:
    """A param group's `GroupSettings` (its Newton-Schulz dtype decided by hardware where it leaves it: resolve them
    after `lightning_muon.optim._precision.settle`)."""
    return GroupSettings(group, ns_dtype(group), ns_settings(group), on_exact_path(group), layouts_of(group),
                         blocks_of(group))


class Bucket(NamedTuple):
    """Same-shape matrices of one param group, orthogonalised in one (batched) Newton-Schulz call.

    A parameter split into blocks (a param group's ``matrix_blocks``) is here as its blocks, each a parameter of its
    own: ``params``, ``grads``, ``bufs`` and ``states`` hold views of the whole tensors.
    """

    #: The param group (its settings: ``lr``, ``momentum``, the update rules' keys, ...).
    group: dict[str, Any]
    params: list[Tensor]
    grads: list[Tensor]
    #: The momentum buffers (the optimizer state's ``momentum_buffer``).
    bufs: list[Tensor]
    names: list[str]
    #: The ``(m, n)`` shape of every matrix Newton-Schulz sees in the bucket.
    shape: tuple[int, int]
    #: How the parameters hold their matrices (`LAYOUTS`), the same for the whole bucket.
    layout: str = "flatten"
    #: Matrices in each parameter (the stack size for the stacked layouts, else 1).
    per_param: int = 1
    #: The update rules' state (`lightning_muon.optim.rules.UpdateRule.state_keys`): by state key, one tensor per
    #: parameter of the bucket (as the optimizer state holds it, or a block's view of it); empty for plain Muon.
    states: Mapping[str, Sequence[Tensor]] = NO_STATES
    #: The group's settings as the step resolved them; ``None``: resolved when read (`settings`).
    resolved: GroupSettings | None = None
    #: Where the bucket holds blocks of DTensor parameters, stepped on whole copies gathered on every rank:
    #: ``(DTensor, its whole copy)`` of each tensor the step changes, each rank's shard of the copy written back into
    #: the DTensor after the step; empty otherwise.
    gathered: tuple[tuple[Tensor, Tensor], ...] = ()
    #: The row blocks of the bucket's one DTensor parameter (its ``matrix_blocks`` entry), stepped whole on an owner
    #: rank that splits it (the sharded strategy's); ``None``: the bucket's matrices are what Newton-Schulz sees.
    blocks: tuple[int, ...] | None = None

    @property
    def settings(self) -> GroupSettings:
        """The group's settings for this step (`resolved`, or resolved now for a bucket built without them)."""
        return settings_of(self.group) if self.resolved is None else self.resolved

    @property
    def effective_lr(self) -> float:
        """The shape-adjusted learning rate of the bucket's matrices (from the whole matrix shape, also
        when the bucket holds this rank's shards)."""
        return group_effective_lr(self.group, self.shape, self.layout)

    @property
    def flops(self) -> int:
        """Newton-Schulz FLOPs of the whole bucket (what owner assignment balances)."""
        settings = self.settings
        gram = settings.uses_gram(self.shape)
        flops = ns_flops(*self.shape, self.group["ns_steps"], gram=gram, dtype=settings.ns_dtype)
        return flops * len(self.params) * self.per_param

    @property
    def exchange_layout(self) -> ExchangeLayout:
        """What a distributed exchange needs to know of the bucket: one 2D block per parameter (its matrices one
        under the other), in the group's Newton-Schulz dtype, and how the ranks' shards cut each block where
        some are not plain row shards (tensor parallelism, 2-D)."""
        m, n = self.shape
        cuts = tuple(matrix_parts(p) for p in self.params)
        layout = ExchangeLayout(len(self.params), (m * self.per_param, n), self.settings.ns_dtype)
        return layout if all(cut is None for cut in cuts) else layout._replace(cuts=cuts)

    def local(self) -> Bucket:
        """The bucket on this rank's shards (views: in-place updates reach the DTensors); a rule's state that is a
        plain tensor (NorMuon's moments: whole on every rank, one value per neuron) stays as it is."""
        return self._replace(
            params=_locals(self.params),
            grads=_locals(self.grads),
            bufs=_locals(self.bufs),
            states={key: _locals(tensors) for key, tensors in self.states.items()},
        )

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
            states={key: [tensors[i] for i in indices] for key, tensors in self.states.items()},
        )


def _locals(tensors: Sequence[Tensor]) -> list[Tensor]:
    """This rank's part of each tensor: a DTensor's local tensor, a plain tensor itself."""
    return [cast("DTensor", t).to_local() if is_dtensor(t) else t for t in tensors]
