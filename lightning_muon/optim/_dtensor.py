"""Whether a tensor is a DTensor: the one fact about sharding that the maths, the plan and the exchanges share."""

from __future__ import annotations

from torch import Tensor


def is_dtensor(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded parameter under FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)
