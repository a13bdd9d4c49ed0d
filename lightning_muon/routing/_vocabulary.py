"""The routing's vocabulary, one name per concept everywhere (code, table, logs, checkpoints): `Algorithm`, where
a parameter goes, `Group`, the param group it joins there, and `Rule`, which rule sent it there."""

from __future__ import annotations

from enum import Enum
from typing import Final

__all__ = ["ADAMW", "MUON", "Algorithm", "Group", "Rule"]


class _Named(str, Enum):
    """A ``str`` enum shown by its value, not ``Algorithm.MUON``, in f-strings and messages (``str, Enum``
    defaults to the member's name)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)


class Algorithm(_Named):
    """Muon or AdamW.

    A member is a ``str`` equal to its value, the name tables, logs and checkpoints show (``"Muon"``,
    ``"AdamW"``), so it finds and matches records saved under that name. `key` is the lower-case spelling a
    `lightning_muon.MuonWithAdamW` param group keeps under ``"algorithm"``. Saved data holds the plain strings
    (``str(member)``, ``member.key``), never the member: ``torch.load(weights_only=True)`` refuses classes it
    does not know.
    """

    MUON = "Muon"
    ADAMW = "AdamW"

    @property
    def key(self) -> str:
        """The lower-case spelling: a `lightning_muon.MuonWithAdamW` group's ``algorithm`` (``"muon"``)."""
        return self.value.lower()

    @classmethod
    def from_key(cls, key: str) -> Algorithm:
        """The member whose `key` is ``key``.

        Raises:
            ValueError: ``key`` is no member's `key`.
        """
        for algorithm in cls:
            if algorithm.key == key:
                return algorithm
        raise ValueError(f"{key!r} is none of {[a.key for a in cls]}")


class Rule(_Named):
    """Which rule decided a route (`lightning_muon.routing.route_parameters`), in the order of precedence: the
    first that applies decides. The value is what the routing table shows."""

    #: ``muon_params`` / ``adamw_params``, the user's glob patterns.
    PATTERN = "pattern"
    #: The module's type: ``nn.Embedding`` and ``nn.EmbeddingBag``, norm layers.
    MODULE_TYPE = "module type"
    #: A weight tied to an embedding.
    TIE = "tie"
    #: What a training batch showed (`lightning_muon.routing.GraphRoles`): output heads, input layers, tensors that
    #: are no matrix by their use.
    FIRST_BATCH = "first batch"
    #: The same, shown by the batch that first reached a parameter the first batch did not.
    LATER_BATCH = "later batch"
    #: The model's own word: transformers' ``get_output_embeddings()``, timm's ``get_classifier()``, PEFT's ``lora_B``.
    CONVENTION = "convention"
    #: A name: a head's (``lm_head``, ``classifier``), a token or position table's (``cls_token``).
    NAME = "name"
    #: The model's structure: its last Linear outside repeated blocks, a first conv on the raw input.
    STRUCTURE = "structure"
    #: The tensor's layout and number of dimensions.
    SHAPE = "shape"


class Group(_Named):
    """The param groups the routing makes (`lightning_muon.routing.Routing.groups`), in the order it returns them;
    the value is the group's ``name`` (what `MuonMonitor` logs as ``lr-<optimizer>/<name>``)."""

    #: Hidden matrices (Muon's only group; on AdamW with ``muon=None``).
    HIDDEN = "hidden"
    #: What an adapter method trains beside a frozen model and the routing puts on AdamW (PEFT's ``lora_B``).
    ADAPTERS = "adapters"
    #: Token and position tables, and weights tied to them.
    EMBEDDINGS = "embeddings"
    #: Input layers: the matrices that read the batch.
    INPUT = "input"
    #: Output heads: the matrices whose outputs reach the loss through no other matrix.
    HEAD = "head"
    #: Norm layers' weights and every bias.
    NORMS_AND_BIASES = "norms_and_biases"
    #: What no other group names (a kernel or a stack torch.optim.Muon cannot take, ...).
    OTHER = "other"


#: Muon's name as a plain ``str``, where a record is saved (a checkpoint's routing is keyed by it).
MUON: Final[str] = Algorithm.MUON.value
#: AdamW's name as a plain ``str``, where a record is saved (a checkpoint's routing is keyed by it).
ADAMW: Final[str] = Algorithm.ADAMW.value
