"""State dicts between `MuonWithAdamW` and the pair ``[Muon, AdamW]`` (what `lightning_muon.MuonMixin` saves).

Plain functions of ``torch.optim.Optimizer.state_dict()`` dicts: ``{"state": {index: {...}}, "param_groups":
[{..., "params": [index, ...]}]}``, where a parameter's index is its position over all groups in order. The
single optimizer's groups each say their ``algorithm``; a pair's groups do not (the optimizer says it). Moving
between the two renumbers the parameters and adds or drops that key; every other group key and every state
entry (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``) is kept as it is. The tensors are shared,
not copied, as in any ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_muon.routing import Algorithm

__all__ = ["ADAMW_KEY", "ALGORITHMS", "MUON_KEY", "merge_state_dicts", "split_state_dict"]

#: A `MuonWithAdamW` param group's ``algorithm``: the `lightning_muon.routing.Algorithm`'s lower-case key.
MUON_KEY = Algorithm.MUON.key
ADAMW_KEY = Algorithm.ADAMW.key
#: The values of a `MuonWithAdamW` param group's ``algorithm``.
ALGORITHMS = tuple(algorithm.key for algorithm in Algorithm)


def _renumbered(groups: list[dict[str, Any]], state: dict[Any, Any], start: int) -> tuple[list[dict], dict, int]:
    """``groups`` with their parameters numbered from ``start`` on (in order), and their state under the new
    numbers; the next free number."""
    new_groups, new_state, index = [], {}, start
    for group in groups:
        params = []
        for old in group["params"]:
            if old in state:
                new_state[index] = state[old]
            params.append(index)
            index += 1
        new_groups.append({**group, "params": params})
    return new_groups, new_state, index


def split_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(muon_state_dict, adamw_state_dict)`` from a `MuonWithAdamW` state dict.

    Each holds its algorithm's groups in their order, without the ``algorithm`` key, and loads into a
    `lightning_muon.Muon` / ``torch.optim.AdamW`` built over the same groups (``routing.muon_groups``,
    ``routing.adamw_groups`` for `MuonWithAdamW.from_model`).

    Raises:
        ValueError: a group whose ``algorithm`` is missing or not ``"muon"``/``"adamw"``.
    """
    by_algorithm: dict[str, list[dict[str, Any]]] = {MUON_KEY: [], ADAMW_KEY: []}
    for i, group in enumerate(state_dict["param_groups"]):
        algorithm = group.get("algorithm")
        if algorithm not in by_algorithm:
            raise ValueError(
                f"param group {i} of the state dict has algorithm {algorithm!r}, not one of {ALGORITHMS}: "
                "it was not saved by MuonWithAdamW"
            )
        by_algorithm[algorithm].append({k: v for k, v in group.items() if k != "algorithm"})
    out = []
    for algorithm in ALGORITHMS:
        groups, state, _ = _renumbered(by_algorithm[algorithm], state_dict["state"], 0)
        out.append({"state": state, "param_groups": groups})
    return out[0], out[1]


def merge_state_dicts(
    muon_state_dict: dict[str, Any], adamw_state_dict: dict[str, Any], algorithms: Sequence[str] | None = None
) -> dict[str, Any]:
    """One `MuonWithAdamW` state dict from a `lightning_muon.Muon` one and a ``torch.optim.AdamW`` one.

    Args:
        muon_state_dict: ``Muon.state_dict()`` (or ``torch.optim.Muon``'s), e.g. a Lightning checkpoint's
            ``checkpoint["optimizer_states"][0]`` from `lightning_muon.MuonMixin`.
        adamw_state_dict: ``AdamW.state_dict()`` (``optimizer_states[1]``).
        algorithms: the algorithm of each group of the single optimizer, in its order (each algorithm's groups
            keep their own order); default: the Muon groups, then the AdamW groups, as
            `MuonWithAdamW.from_model` builds them. `MuonWithAdamW.load_pair_state_dicts` passes its own.

    Raises:
        ValueError: ``algorithms`` names a value other than ``"muon"``/``"adamw"``, or does not have as many
            groups of each as the two state dicts.
    """
    sources = {MUON_KEY: list(muon_state_dict["param_groups"]), ADAMW_KEY: list(adamw_state_dict["param_groups"])}
    if algorithms is None:
        algorithms = [MUON_KEY] * len(sources[MUON_KEY]) + [ADAMW_KEY] * len(sources[ADAMW_KEY])
    wrong = [a for a in algorithms if a not in ALGORITHMS]
    counts = {a: list(algorithms).count(a) for a in ALGORITHMS}
    if wrong or any(counts[a] != len(sources[a]) for a in ALGORITHMS):
        raise ValueError(
            f"algorithms {list(algorithms)!r} must name 'muon' once per Muon group ({len(sources[MUON_KEY])}) and "
            f"'adamw' once per AdamW group ({len(sources[ADAMW_KEY])})"
        )
    states = {MUON_KEY: muon_state_dict["state"], ADAMW_KEY: adamw_state_dict["state"]}
    taken = dict.fromkeys(ALGORITHMS, 0)
    groups: list[dict[str, Any]] = []
    state: dict[int, Any] = {}
    index = 0
    for algorithm in algorithms:
        source = sources[algorithm][taken[algorithm]]
        taken[algorithm] += 1
        (group,), group_state, index = _renumbered([source], states[algorithm], index)
        groups.append({**group, "algorithm": algorithm})
        state.update(group_state)
    return {"state": state, "param_groups": groups}
