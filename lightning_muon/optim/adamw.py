"""`AdamW`: ``torch.optim.AdamW`` with cautious weight decay as an option, for the AdamW half of the pair.

Cautious weight decay (dion's ``cautious_wd``; Chen et al. 2025) decays an entry only where the step already
moves it toward zero: where the entry and its update have the same sign. AdamW's update of an entry is
``m_hat / (sqrt(v_hat) + eps)``, whose sign is its first moment's after this step, ``m.lerp(g, 1 - beta1)``: so
the decay is decided before torch's step, applied as torch applies it (``p * (1 - lr * weight_decay)``, where the
signs agree), and torch's step then runs with its weight decay off. Off (the default), this is
``torch.optim.AdamW`` itself, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_muon.optim.groups import lr_value

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` plus ``cautious_weight_decay`` (a param-group setting, default ``False``: then the
    optimizer, its groups and its state dicts are torch's AdamW's, key for key).

    Example:
        ```python
        import functools
        from lightning_muon import MuonMixin
        from lightning_muon.optim import AdamW

        # the pair's AdamW half with decay, decaying only where each step already shrinks the entry
        adamw = functools.partial(AdamW, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  cautious_weight_decay=True)
        # MuonMixin(adamw=adamw), or in YAML:
        # adamw: {class_path: lightning_muon.optim.AdamW, init_args: {...}}
        ```

    Args:
        params: parameters or param groups, as ``torch.optim.AdamW`` takes them.
        cautious_weight_decay: decay an entry only where it and its update have the same sign; the other
            arguments are ``torch.optim.AdamW``'s.

    Raises:
        ValueError: ``cautious_weight_decay`` not ``True`` or ``False``; with it on, ``maximize`` or a complex
            parameter (whose sign has no meaning).
    """

    def __init__(self, params: Any, *args: Any, cautious_weight_decay: bool = False, **kwargs: Any) -> None:
        if not isinstance(cautious_weight_decay, bool):
            raise ValueError(f"Invalid cautious_weight_decay: {cautious_weight_decay!r} (must be True or False)")
        self._cautious_default = cautious_weight_decay  # torch's __init__ adds the groups before defaults has it
        super().__init__(params, *args, **kwargs)
        if cautious_weight_decay:  # off, the groups and state dicts stay torch's, key for key
            self.defaults["cautious_weight_decay"] = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, with the group's ``cautious_weight_decay`` (the optimizer's unless the group sets it) checked;
        a group without it, where the optimizer's is off, stays without it (as torch's AdamW has it)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if getattr(self, "_cautious_default", self.defaults.get("cautious_weight_decay", False)):
            group.setdefault("cautious_weight_decay", True)
        problem = _cautious_refusal(group)
        if problem is not None:
            self.param_groups.pop()  # refuse the whole group, as if it had never been added
            raise problem

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step; cautious groups decay first, only where the step's update agrees in sign."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        cautious = [g for g in self.param_groups if g.get("cautious_weight_decay") and g["weight_decay"] != 0]
        decays = [group["weight_decay"] for group in cautious]
        for group in cautious:
            decay_cautiously(group, self.state)
            group["weight_decay"] = 0.0  # torch's step: no decay of its own
        try:
            super().step()
        finally:
            for group, decay in zip(cautious, decays, strict=True):
                group["weight_decay"] = decay
        return loss


def _cautious_refusal(group: dict[str, Any]) -> ValueError | None:
    """Why a param group cannot decay cautiously, or ``None``."""
    cautious = group.get("cautious_weight_decay", False)
    if not isinstance(cautious, bool):
        return ValueError(f"Invalid cautious_weight_decay: {cautious!r} (must be True or False)")
    if cautious and group["maximize"]:
        return ValueError("cautious_weight_decay does not support maximize=True: its update's sign is not the "
                          "first moment's; decay plainly (cautious_weight_decay=False) or minimise the negated loss")
    if cautious and any(torch.is_complex(p) for p in group["params"]):
        return ValueError("cautious_weight_decay does not support complex parameters (a complex entry has no sign); "
                          "put them in a param group with cautious_weight_decay=False")
    return None


def decay_cautiously(group: dict[str, Any], state: Any) -> None:
    """AdamW's decoupled decay ``p * (1 - lr * weight_decay)`` on the entries of a group's parameters (with a
    gradient) whose update this step will have the entry's sign: where ``p * m >= 0``, ``m`` the first moment
    after this step (zeros before the first step)."""
    beta1, factor = group["betas"][0], 1 - lr_value(group["lr"]) * group["weight_decay"]
    for p in group["params"]:
        if p.grad is None:
            continue
        moment: Tensor = state[p].get("exp_avg", torch.zeros_like(p))
        agrees = p * moment.lerp(p.grad, 1 - beta1) >= 0
        p.copy_(torch.where(agrees, p * factor, p))
