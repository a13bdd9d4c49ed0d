"""Which `Strategy` a Muon steps with: chosen, said once, chosen again when its grounds change; the explicit
``process_group`` / ``device_mesh`` checked; and what the optimizer tells of its choice (`StrategyInfo`).

`choose_strategy` picks one of the strategies of `lightning_muon.optim._strategies` from the parameters and the
process group (the default one, or an explicit ``process_group`` / ``device_mesh`` given to `lightning_muon.Muon`).
A distributed run says which path it takes in one rank-zero line at its first step (the ``lightning_muon``
logger at INFO; a fallback is a warning); a single process says it only at DEBUG. `StrategyChoice` keeps
an optimizer's strategy and chooses again when what it was chosen from changes; `Muon.strategy` reads its
`StrategyInfo`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor

from lightning_muon.optim._collectives import World, replicated_world, sharded_world
from lightning_muon.optim._dtensor import is_dtensor, matrix_parts
from lightning_muon.optim._strategies import (
    EXCHANGE_ROUND_BYTES,
    DistributedStep,
    Kind,
    LocalStep,
    ReplicatedStep,
    ShardedStep,
    Strategy,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class StrategyInfo:
    """Where a `lightning_muon.Muon`'s Newton-Schulz work runs, as chosen at its first step (`Muon.strategy`).

    Read-only. The optimizer keeps the same object until it chooses again (when ``split_ns`` or, without an
    explicit ``process_group`` / ``device_mesh``, the default process group changes).
    """

    #: The path in one word: ``"local"`` (this process does all the work: a single process, ``split_ns=False``,
    #: or a fallback), ``"replicated"`` (DDP: the ranks split the matrices and all-gather the updates) or
    #: ``"sharded"`` (FSDP2 / HSDP / tensor parallelism / FSDP2 over tensor parallelism: each matrix is
    #: orthogonalised whole on one owner rank).
    kind: Kind
    #: The path in words, as the rank-zero line at the first step says it (without its ``"Muon: "``).
    description: str
    #: Whether the path is a fallback that repeats the Newton-Schulz work on every rank.
    fallback: bool
    #: How many ranks split the Newton-Schulz work (1: this process does all of it; HSDP: the ranks of each
    #: replica's shard group).
    ranks: int

    @classmethod
    def of(cls, strategy: Strategy) -> StrategyInfo:
        """What ``strategy`` tells of itself."""
        ranks = strategy.world.size if isinstance(strategy, DistributedStep) else 1
        return cls(strategy.kind, strategy.description, strategy.fallback, ranks)


_log = logging.getLogger("lightning_muon")


def choose_strategy(
    params: Sequence[Tensor],
    split_ns: bool,
    stacks: bool = False,
    *,
    process_group: dist.ProcessGroup | None = None,
    device_mesh: DeviceMesh | None = None,
    round_bytes: int = EXCHANGE_ROUND_BYTES,
) -> Strategy:
    """The strategy for these parameters (see `lightning_muon.optim._strategies`), said in one line on rank
    zero: at INFO where the work could be split (several ranks, or DTensor parameters), at DEBUG on a single
    process, and as a warning for a fallback that repeats the Newton-Schulz work on every rank.

    Replicated parameters split their work over ``process_group`` (default: the default group), DTensors over
    ``device_mesh`` (default: their own mesh). With ``stacks`` (some parameter holds a stack of matrices,
    sharded on its stack dim under FSDP2), every rank gathers the whole matrices instead of the owner exchange,
    which splits matrix rows. ``round_bytes``: the most bytes of one FSDP2 exchange buffer (`ShardedStep`).
    """
    strategy = _choose(params, split_ns, stacks, process_group, device_mesh, round_bytes)
    initialised = dist.is_available() and dist.is_initialized()
    if initialised and dist.get_rank() != 0:
        return strategy
    message = f"Muon: {strategy.description}."
    if strategy.fallback:
        warnings.warn(message, UserWarning, stacklevel=6)  # the caller of optimizer.step() (past torch's two wrappers)
    else:
        several = initialised and dist.get_world_size() > 1
        _log.log(logging.INFO if several or strategy.complete_state else logging.DEBUG, message)
    return strategy


def _choose(
    params: Sequence[Tensor],
    split_ns: bool,
    stacks: bool,
    process_group: dist.ProcessGroup | None,
    device_mesh: DeviceMesh | None,
    round_bytes: int,
) -> Strategy:
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    dtensors = any(is_dtensor(p) for p in params)
    if not split_ns:
        if not (several or dtensors):
            return LocalStep()
        whole = "gathers and orthogonalises every whole matrix" if dtensors else "orthogonalises every matrix"
        return LocalStep(f"every rank {whole} (split_ns=False)", complete_state=dtensors)
    if dtensors:
        stacked = "a parameter holds a stack of matrices (sharded on its stack dim)"
        sharded = stacked if stacks else sharded_world(params, device_mesh)
        if isinstance(sharded, World):
            columns = any(matrix_parts(p) is not None for p in params)
            return ShardedStep(sharded, round_bytes=round_bytes, columns=columns)
        whole = f"every rank gathers and orthogonalises every whole matrix (not split: {sharded})"
        return LocalStep(whole, fallback=several, complete_state=True)
    replicated = replicated_world(process_group) if params else None
    return ReplicatedStep(replicated) if replicated is not None else LocalStep()


class StrategyChoice:
    """The strategy an optimizer steps with, and what it was chosen from.

    Chosen at the first step (`for_step`), and again when ``split_ns`` changes or, without an explicit
    ``process_group`` or ``device_mesh``, when the default process group does: an optimizer stepped before
    ``init_process_group`` (or after a ``destroy_process_group``) takes the distributed path once there is one.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        device_mesh: DeviceMesh | None = None,
        round_bytes: int = EXCHANGE_ROUND_BYTES,
    ) -> None:
        _check_where(process_group, device_mesh, round_bytes)
        #: The process group replicated parameters split their work over (``None``: the default group).
        self.process_group = process_group
        #: The device mesh DTensor parameters must live on (``None``: the one they share).
        self.device_mesh = device_mesh
        #: The most bytes of one FSDP2 exchange buffer (`ShardedStep`).
        self.round_bytes = round_bytes
        #: The strategy of the last step (``None`` before the first).
        self.chosen: Strategy | None = None
        #: What `chosen` tells of itself (``None`` before the first step): one object per choice.
        self.info: StrategyInfo | None = None
        self._chosen_from: tuple[bool, object] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy chooses its own strategy (the chosen one holds process groups and buffers).
        return {**self.__dict__, "chosen": None, "info": None, "_chosen_from": None}

    def for_step(self, params: Sequence[Tensor], split_ns: bool, stacks: bool) -> Strategy:
        """The strategy of this step: the last one, unless what it was chosen from changed."""
        chosen_from = (split_ns, self._default_group())
        if self.chosen is None or self._chosen_from != chosen_from:
            self.chosen = choose_strategy(
                params, split_ns, stacks,
                process_group=self.process_group, device_mesh=self.device_mesh, round_bytes=self.round_bytes,
            )
            self.info = StrategyInfo.of(self.chosen)
            self._chosen_from = chosen_from
        return self.chosen

    def _default_group(self) -> object:
        """The default process group (``None`` before ``init_process_group``), where the choice depends on it."""
        if self.process_group is not None or self.device_mesh is not None or not dist.is_available():
            return None
        return dist.group.WORLD

    def refusal(self, param: Tensor) -> str | None:
        """Why ``param`` cannot step under the explicit process group or device mesh, or ``None``."""
        if self.process_group is not None and is_dtensor(param):
            return "it is a DTensor, whose work is split over its device mesh: pass device_mesh, not process_group."
        if self.device_mesh is None:
            return None
        if not is_dtensor(param):
            return "device_mesh is for DTensor parameters (FSDP2, HSDP): pass process_group for replicated ones."
        mesh = param.device_mesh  # type: ignore[attr-defined]
        return None if mesh == self.device_mesh else f"it lives on {mesh}, not on device_mesh {self.device_mesh}."


def _check_where(process_group: object, device_mesh: object, round_bytes: object) -> None:
    """Refuse an explicit process group or device mesh that cannot be one, and a bad round size, naming the value."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            f"Muon takes a process_group (replicated parameters) or a device_mesh (DTensors), not both: got "
            f"process_group={process_group!r} and device_mesh={device_mesh!r}"
        )
    if process_group is not None:
        _check_process_group(process_group)
    if device_mesh is not None:
        _check_device_mesh(device_mesh)
    if isinstance(round_bytes, bool) or not isinstance(round_bytes, int) or round_bytes < 1:
        raise ValueError(f"Invalid exchange_round_bytes: {round_bytes!r} (must be an int >= 1)")


def _check_process_group(group: object) -> None:
    if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"process_group={group!r} is torch.distributed's mark of a group this rank is not in: give the "
            "optimizer a group that this rank belongs to"
        )
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got {group!r}")


def _check_device_mesh(mesh: object) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got {mesh!r}")
    if mesh.ndim > 2:
        raise ValueError(f"device_mesh must be 1-D (FSDP2) or 2-D (HSDP; FSDP2 over tensor parallelism), got {mesh!r}")
