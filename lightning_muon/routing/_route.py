"""`Route`: one parameter's routing decision, where it goes, why, and which rule decided."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_muon.routing._vocabulary import Algorithm, Rule

__all__ = ["Route"]


@dataclass(frozen=True)
class Route:
    """One routing decision: where parameter ``name`` goes, why, and which rule decided."""

    name: str
    shape: tuple[int, ...]
    optimizer: Algorithm
    group: str
    #: Why, in words (for people: no code reads it).
    reason: str
    #: How Muon sees the tensor's matrices (``"flatten"``, ``"stack"``, ``"in_out"``, ``"stack_in_out"``: see
    #: `lightning_muon.Muon`).
    layout: str = "flatten"
    #: The rule that decided (`Rule`).
    rule: Rule = field(kw_only=True)
    #: A fused projection's row blocks, each orthogonalised and lr-scaled on its own (a Muon group's
    #: ``matrix_blocks``), or ``None``: one matrix.
    blocks: tuple[int, ...] | None = field(default=None, kw_only=True)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
