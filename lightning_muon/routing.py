"""Which parameter goes to Muon and which to AdamW, and why.

Muon is for the matrices of hidden layers. Everything else stays on AdamW:
embeddings (and any weight tied to one), the output head, norms, biases and
every tensor with fewer than two dimensions. `route_parameters` decides for
every trainable parameter, in this order of precedence:

1. user patterns (``muon_params`` / ``adamw_params``, globs on the full name);
2. module type: ``nn.Embedding``, ``nn.EmbeddingBag`` and norm layers -> AdamW;
3. weights tied to an embedding -> AdamW (once);
4. the output head -> AdamW, found from the module tree (`find_output_head`);
5. shape: 2 or more dimensions -> Muon (conv kernels flattened), else AdamW.

Frozen parameters go nowhere. The result holds ordinary param groups (with a
``name`` per group and the parameter names) and a table of every decision.
"""

from __future__ import annotations

import fnmatch
import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

__all__ = ["ADAMW", "MUON", "Route", "Routing", "find_output_head", "route_parameters"]

MUON = "Muon"
ADAMW = "AdamW"

#: Group names, in the order the groups are returned.
_GROUP_ORDER = {MUON: ("hidden",), ADAMW: ("embeddings", "head", "norms_and_biases", "other")}

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


@dataclass(frozen=True)
class Route:
    """One routing decision: where parameter ``name`` goes and why."""

    name: str
    shape: tuple[int, ...]
    optimizer: str  # MUON or ADAMW
    group: str
    reason: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Routing:
    """Every trainable parameter's route, and the param groups for the two optimizers."""

    routes: list[Route]
    params: dict[str, Tensor]

    def groups(self, optimizer: str) -> list[dict[str, Any]]:
        """Param groups for ``optimizer`` (`MUON` or `ADAMW`), non-empty, in a fixed order.

        Each group is ``{"name": ..., "params": [(param_name, tensor), ...]}``,
        which every ``torch.optim.Optimizer`` accepts (it keeps the names as
        ``param_names``).
        """
        groups = []
        for group in _GROUP_ORDER[optimizer]:
            named = [
                (r.name, self.params[r.name]) for r in self.routes if r.optimizer == optimizer and r.group == group
            ]
            if named:
                groups.append({"name": group, "params": named})
        return groups

    @property
    def muon_groups(self) -> list[dict[str, Any]]:
        return self.groups(MUON)

    @property
    def adamw_groups(self) -> list[dict[str, Any]]:
        return self.groups(ADAMW)

    def names(self, optimizer: str) -> list[str]:
        """The names of the parameters routed to ``optimizer``, in group order."""
        return [name for group in self.groups(optimizer) for name, _ in group["params"]]

    def rich_table(self, effective_lr: Callable[[Route], float | None] | None = None) -> Any:
        """A ``rich.table.Table``: parameter, shape, optimizer, group, reason (and effective lr)."""
        from rich.table import Table

        table = Table(title="lightning_muon routing", show_lines=False)
        for column in ("parameter", "shape", "optimizer", "group", "reason"):
            table.add_column(column)
        if effective_lr is not None:
            table.add_column("effective lr", justify="right")
        for r in self.routes:
            row = [r.name, "x".join(map(str, r.shape)) or "scalar", r.optimizer, r.group, r.reason]
            if effective_lr is not None:
                lr = effective_lr(r)
                row.append("" if lr is None else f"{lr:.3g}")
            table.add_row(*row)
        totals = "; ".join(
            f"{opt}: {sum(r.optimizer == opt for r in self.routes)} tensors, "
            f"{sum(r.numel for r in self.routes if r.optimizer == opt):,} parameters"
            for opt in (MUON, ADAMW)
        )
        table.caption = totals
        return table

    def render(self, effective_lr: Callable[[Route], float | None] | None = None, width: int = 140) -> str:
        """The table as plain text."""
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=width, no_color=True, force_terminal=False).print(self.rich_table(effective_lr))
        return buffer.getvalue()

    def __str__(self) -> str:
        return self.render()


def _is_norm(module: nn.Module) -> bool:
    """Norm layers by type: torch's own, and custom classes named ``...Norm`` (``RMSNorm``, ``LayerNorm``...)."""
    torch_norms = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)
    return isinstance(module, torch_norms) or re.search(r"Norm(\dd)?$", type(module).__name__) is not None


def _in_repeated_block(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether module ``name`` sits inside one of a stack of same-class blocks (``h.3.mlp.c_fc``).

    A stack is a ``ModuleList`` or ``Sequential`` holding several children of
    one (non-container) class: transformer blocks, residual stages.
    """
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    parts = name.split(".")
    for depth in range(1, len(parts)):
        block = modules[".".join(parts[:depth])]
        parent = modules[".".join(parts[: depth - 1])]
        stacked = isinstance(parent, containers) and not isinstance(block, containers)
        if stacked and sum(type(sibling) is type(block) for sibling in parent.children()) > 1:
            return True
    return False


def find_output_head(module: nn.Module) -> str | None:
    """The name of the module that produces the network's output, or None.

    The head is the last ``nn.Linear`` (in registration order) that is not
    inside a stack of repeated blocks; when the model has an embedding of
    ``V`` rows, a Linear with ``V`` outputs is preferred (the LM head, wherever
    it is registered). So in Lightning's demo ``Transformer`` the top-level
    ``decoder`` Linear is the head, and the ``transformer.decoder`` stack is not.
    """
    modules = dict(module.named_modules())
    linears = [
        name
        for name, m in modules.items()
        if name and isinstance(m, nn.Linear) and not _in_repeated_block(name, modules)
    ]
    vocab = {m.num_embeddings for m in modules.values() if isinstance(m, _EMBEDDINGS)}
    lm_heads = [name for name in linears if modules[name].out_features in vocab]
    candidates = lm_heads or linears
    return candidates[-1] if candidates else None


def _check_patterns(kind: str, patterns: Sequence[str], aliases: dict[str, list[str]]) -> None:
    if isinstance(patterns, str):
        raise ValueError(f"{kind} must be a list of glob patterns, got the string {patterns!r}; write [{patterns!r}]")
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(a, pattern) for names in aliases.values() for a in names):
            examples = ", ".join(list(aliases)[:6])
            raise ValueError(
                f"{kind} pattern {pattern!r} matches no trainable parameter. "
                f"Patterns are globs on full parameter names such as: {examples}"
            )


def route_parameters(
    module: nn.Module,
    *,
    muon_params: Sequence[str] = (),
    adamw_params: Sequence[str] = (),
    muon_nd: bool = True,
) -> Routing:
    """Decide Muon or AdamW for every trainable parameter of ``module``, with a reason.

    Args:
        module: the model.
        muon_params: glob patterns on full parameter names (``"blocks.*.attn.*.weight"``)
            forced to Muon; they must match matrices.
        adamw_params: glob patterns forced to AdamW.
        muon_nd: whether the Muon class accepts tensors with more than 2
            dimensions (``lightning_muon.Muon`` does, ``torch.optim.Muon`` does
            not: with ``False`` such tensors go to AdamW).

    Raises:
        ValueError: a pattern matches nothing, a parameter matches both kinds
            of pattern, or a tensor Muon cannot take is forced to Muon.
    """
    trainable: dict[str, Tensor] = {name: p for name, p in module.named_parameters() if p.requires_grad}
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((f"{mod_name}.{p_name}" if mod_name else p_name, mod))
    aliases = {name: [alias for alias, _ in owners[id(p)]] for name, p in trainable.items()}
    _check_patterns("muon_params", muon_params, aliases)
    _check_patterns("adamw_params", adamw_params, aliases)
    head = find_output_head(module)

    routes = []
    for name, p in trainable.items():
        shape = tuple(p.shape)

        def matched(patterns: Sequence[str], name: str = name) -> str | None:
            return next((pat for pat in patterns if any(fnmatch.fnmatchcase(a, pat) for a in aliases[name])), None)

        to_muon, to_adamw = matched(muon_params), matched(adamw_params)
        own_module = next(mod for alias, mod in owners[id(p)] if alias == name)
        embedding = next((alias for alias, mod in owners[id(p)] if isinstance(mod, _EMBEDDINGS)), None)
        head_alias = next((alias for alias, _ in owners[id(p)] if head and alias.rsplit(".", 1)[0] == head), None)

        if to_muon and to_adamw:
            raise ValueError(
                f"parameter `{name}` matches muon_params pattern {to_muon!r} and adamw_params pattern "
                f"{to_adamw!r}; make the patterns disjoint"
            )
        if to_muon:
            if p.ndim < 2 or (p.ndim > 2 and not muon_nd):
                need = "at least 2" if p.ndim < 2 else "exactly 2 (this Muon class is 2D-only)"
                raise ValueError(
                    f"muon_params pattern {to_muon!r} matches `{name}` of shape {shape}, but Muon needs "
                    f"{need} dimensions; narrow the pattern"
                )
            route = (MUON, "hidden", f"matches muon_params {to_muon!r}")
        elif to_adamw:
            group = "other" if p.ndim >= 2 else "norms_and_biases"
            group = "embeddings" if embedding else "head" if head_alias else group
            route = (ADAMW, group, f"matches adamw_params {to_adamw!r}")
        elif isinstance(own_module, _EMBEDDINGS):
            route = (ADAMW, "embeddings", f"{type(own_module).__name__} weight")
        elif _is_norm(own_module):
            route = (ADAMW, "norms_and_biases", f"norm layer ({type(own_module).__name__})")
        elif embedding:
            route = (ADAMW, "embeddings", f"tied to embedding `{embedding}`")
        elif head_alias:
            route = (ADAMW, "head", f"output head `{head}`")
        elif p.ndim == 2:
            route = (MUON, "hidden", "hidden matrix")
        elif p.ndim > 2 and muon_nd:
            route = (MUON, "hidden", f"{p.ndim}D kernel, orthogonalised as {shape[0]}x{math.prod(shape[1:])}")
        elif p.ndim > 2:
            route = (ADAMW, "other", f"{p.ndim}D tensor and the Muon class is 2D-only")
        else:
            what = "bias" if name.endswith("bias") else f"{p.ndim}D tensor"
            route = (ADAMW, "norms_and_biases", what)
        routes.append(Route(name, shape, *route))

    routed = [r.name for r in routes]
    if sorted(routed) != sorted(trainable) or len(set(routed)) != len(routed):  # a bug here, never the user's
        raise RuntimeError(f"lightning_muon routed {sorted(routed)} for the trainable parameters {sorted(trainable)}")
    return Routing(routes=routes, params=dict(trainable))
