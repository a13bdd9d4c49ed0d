"""`MuonWithAdamW`: one ``torch.optim.Optimizer`` holding Muon and AdamW, for frameworks that take one optimizer.

transformers' ``Trainer``, recipe configs (``_component_`` / ``class_path`` specs) and Lightning's automatic
optimization each take a single optimizer. This one holds both algorithms: every param group says its
``algorithm`` (``"muon"`` or ``"adamw"``) next to that algorithm's settings, and there is one ``state``, one
``state_dict`` / ``load_state_dict``, one ``zero_grad`` and one ``step(closure)``.

It is not a re-implementation: inside are a `lightning_muon.Muon` and a ``torch.optim.AdamW`` (torch's own
kernels, foreach / fused as torch chooses) that share this optimizer's param-group dicts and its ``state``
mapping. An lr scheduler writing ``group["lr"]`` reaches them; a step steps both, exactly as the pair
``Muon(routing.muon_groups)``, ``AdamW(routing.adamw_groups)`` would (bit for bit: tests/optim).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_muon.combined.state import ADAMW_KEY, ALGORITHMS, MUON_KEY, merge_state_dicts, split_state_dict
from lightning_muon.optim import Muon
from lightning_muon.optim.adamw import AdamW
from lightning_muon.optim.defaults import PAIRED_ADAMW, PAIRED_MUON
from lightning_muon.optim.groups import PARAM_NAMES
from lightning_muon.routing import Algorithm, Routing, check_settings_taken, route_parameters

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MuonWithAdamW"]

_NO_ALGORITHM = (
    "MuonWithAdamW needs to know which parameters are Muon's (hidden matrices) and which AdamW's (embeddings, "
    "the output head, norms, biases): give it the model itself (`MuonWithAdamW(model)` or "
    "`MuonWithAdamW.from_model(model)`, routed by lightning_muon.route_parameters), or param groups that each "
    "say {'algorithm': 'muon' | 'adamw'}. transformers' Trainer: `optimizer_cls_and_kwargs=(MuonWithAdamW, "
    "{'model': model, ...})` or `optimizers=(MuonWithAdamW.from_model(model), None)`."
)


class MuonWithAdamW(Optimizer):
    """Muon on the hidden matrices and AdamW on everything else, as one optimizer, for code that takes one
    (automatic optimization, transformers' ``Trainer(optimizers=...)``).

    Each param group carries ``algorithm``: ``"muon"`` groups take `lightning_muon.Muon`'s settings, ``"adamw"``
    groups ``torch.optim.AdamW``'s. A group's own values win over the constructor's; other keys (``name``,
    ``param_names``) are kept. The defaults are `lightning_muon.MuonMixin`'s, from one table
    (`lightning_muon.optim.defaults`). Inside, a `Muon` and a `lightning_muon.optim.AdamW` share this
    optimizer's param-group dicts and ``state`` (`muon` and `adamw` return them: ``opt.muon.effective_lr(p)``).

    Examples:
        ```python
        import torch
        from torch import nn
        from lightning_muon import MuonWithAdamW

        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        optimizer = MuonWithAdamW(model, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)
        x = torch.randn(32, 16)
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        optimizer.step()
        print(optimizer.routing.names("Muon"))  # ['0.weight', '2.weight']: the head (4) and biases on AdamW
        ```

    Args:
        params: the model (an ``nn.Module``, routed by `lightning_muon.route_parameters`), a `lightning_muon.Routing`,
            or param groups each with ``algorithm`` (their ``params`` tensors or ``(name, tensor)`` pairs); a bare
            list of parameters is refused (it does not say which are matrices).
        lr: Muon's learning rate (before the shape scaling of ``adjust_lr_fn``).
        weight_decay: Muon's decoupled weight decay, applied with the unscaled lr.
        momentum: Muon's momentum factor, in ``[0, 1)``.
        nesterov: Nesterov momentum for Muon.
        ns_coefficients: the Newton-Schulz ``(a, b, c)``, or ``"polar_express"``.
        eps: floor of the norm that scales each matrix before Newton-Schulz.
        ns_steps: Newton-Schulz iterations (at least 1).
        adjust_lr_fn: Muon's lr scaling by shape (`lightning_muon.adjust_lr`; ``None`` is ``"original"``).
        adamw_lr: AdamW's learning rate.
        adamw_betas: AdamW's ``betas``.
        adamw_eps: AdamW's ``eps``.
        adamw_weight_decay: AdamW's decoupled weight decay.
        adamw_amsgrad: AdamW's AMSGrad variant.
        adamw_cautious_weight_decay: AdamW decays an entry only where its update moves it toward zero.
        foreach: AdamW's ``foreach`` (torch's choice when ``None``).
        fused: AdamW's ``fused`` (torch's choice when ``None``).
        ns_dtype: Newton-Schulz's dtype; ``None``: bf16 where the device computes it natively, else float32.
        ns_batch_bytes: most bytes of one batched Newton-Schulz call (``0``: one matrix at a time, as torch's).
        ns_gram_aspect: matrices this many times longer than wide use Gram Newton-Schulz (``None``: never).
        ns_precondition: ``"aol"``: Turbo-Muon's AOL preconditioning before Newton-Schulz; ``None``: Frobenius.
        split_ns: under DDP, FSDP2 or tensor parallelism, split the Newton-Schulz work over the ranks.
        process_group: the group the DDP split runs over (default: the default group).
        device_mesh: the mesh of DTensor parameters, when it cannot be read from them.
        exchange_round_bytes: most bytes each rank sends in one round of the FSDP2 and TP exchanges.
        normuon_beta2: NorMuon's second-moment decay per neuron (``0.95`` turns it on); ``None``: plain Muon.
        cautious_weight_decay: Muon decays an entry only where its update moves it toward zero.
        muon_params: glob patterns of parameter names forced onto Muon (a model only).
        adamw_params: glob patterns of parameter names forced onto AdamW (a model only).
        split_fused: orthogonalise each block of a fused projection on its own, ``None``: equal q, k, v blocks
            only (the default; a model only; `route_parameters`).
        split_heads: orthogonalise each attention head of q, k and v on its own (a model only; `route_parameters`).
        matrix_blocks: glob pattern -> row-block sizes of those Muon matrices, ``None``: whole (a model only).
        group_settings: group name -> its own ``lr``/``weight_decay``/``betas``/``eps``/``momentum`` (a model only).

    Raises:
        ValueError: a bad setting (quoting it, as `Muon` and ``AdamW`` word it), a group without a valid
            ``algorithm``, a parameter in two groups, or a group Muon cannot take (a tensor under 2 dims).
    """

    #: The routing the groups came from (``None`` when built from explicit groups).
    routing: Routing | None

    def __init__(
        self,
        params: nn.Module | Routing | Iterable[dict[str, Any]],
        lr: float | Tensor = PAIRED_MUON.lr,
        weight_decay: float = PAIRED_MUON.weight_decay,
        momentum: float = PAIRED_MUON.momentum,
        nesterov: bool = PAIRED_MUON.nesterov,
        ns_coefficients: tuple[float, float, float] | str = PAIRED_MUON.ns_coefficients,
        eps: float = PAIRED_MUON.eps,
        ns_steps: int = PAIRED_MUON.ns_steps,
        adjust_lr_fn: str | None = PAIRED_MUON.adjust_lr_fn,
        *,
        adamw_lr: float | Tensor = PAIRED_ADAMW.lr,
        adamw_betas: tuple[float, float] = PAIRED_ADAMW.betas,
        adamw_eps: float = PAIRED_ADAMW.eps,
        adamw_weight_decay: float = PAIRED_ADAMW.weight_decay,
        adamw_amsgrad: bool = PAIRED_ADAMW.amsgrad,
        adamw_cautious_weight_decay: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        ns_dtype: torch.dtype | str | None = PAIRED_MUON.ns_dtype,
        ns_batch_bytes: int | None = PAIRED_MUON.ns_batch_bytes,
        ns_gram_aspect: float | None = PAIRED_MUON.ns_gram_aspect,
        ns_precondition: str | None = PAIRED_MUON.ns_precondition,
        split_ns: bool = PAIRED_MUON.split_ns,
        process_group: ProcessGroup | None = None,
        device_mesh: DeviceMesh | None = None,
        exchange_round_bytes: int = PAIRED_MUON.exchange_round_bytes,
        normuon_beta2: float | None = PAIRED_MUON.normuon_beta2,
        cautious_weight_decay: bool = PAIRED_MUON.cautious_weight_decay,
        muon_params: Sequence[str] = (),
        adamw_params: Sequence[str] = (),
        split_fused: bool | None = None,
        matrix_blocks: Mapping[str, Sequence[int] | None] | None = None,
        group_settings: Mapping[str, Mapping[str, Any]] | None = None,
        split_heads: bool = False,
    ) -> None:
        self._settings: dict[str, dict[str, Any]] = {
            MUON_KEY: {
                "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
                "ns_dtype": ns_dtype, "ns_batch_bytes": ns_batch_bytes, "ns_gram_aspect": ns_gram_aspect,
                "ns_precondition": ns_precondition, "split_ns": split_ns, "process_group": process_group,
                "device_mesh": device_mesh,
                "exchange_round_bytes": exchange_round_bytes, "normuon_beta2": normuon_beta2,
                "cautious_weight_decay": cautious_weight_decay,
            },
            ADAMW_KEY: {
                "lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps, "weight_decay": adamw_weight_decay,
                "amsgrad": adamw_amsgrad, "foreach": foreach, "fused": fused,
                "cautious_weight_decay": adamw_cautious_weight_decay,
            },
        }
        #: The inner optimizers, built from the first group of their algorithm.
        self._inner: dict[str, Optimizer] = {}
        routing_settings = {"muon_params": muon_params, "adamw_params": adamw_params, "split_fused": split_fused,
                            "matrix_blocks": matrix_blocks, "group_settings": group_settings,
                            "split_heads": split_heads}
        groups, self.routing = _groups(params, routing_settings)
        # ``defaults``: each algorithm's, as its inner optimizer has them once it is built (`add_param_group`).
        super().__init__(groups, {MUON_KEY: {}, ADAMW_KEY: {}})
        _check_settings(self._inner, self._settings, self.routing)

    @classmethod
    def from_model(
        cls, model: nn.Module, *, muon_params: Sequence[str] = (), adamw_params: Sequence[str] = (), **kwargs: Any
    ) -> MuonWithAdamW:
        """``MuonWithAdamW`` over ``model``'s trainable parameters, routed by `lightning_muon.route_parameters`
        (the same table and reasons; ``print(opt.routing)``): Muon groups first, then AdamW's, each named as
        its table says (``hidden``; ``embeddings``, ``head``, ...). ``kwargs`` are the constructor's."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"from_model takes an nn.Module, got {type(model).__name__}; use MuonWithAdamW(groups)")
        return cls(model, muon_params=muon_params, adamw_params=adamw_params, **kwargs)

    # ------------------------------------------------------------------ groups

    @property
    def muon(self) -> Muon | None:
        """The inner `lightning_muon.Muon` (``None`` without a Muon group): diagnostics, effective lrs."""
        inner = self._inner.get(MUON_KEY)
        return inner if isinstance(inner, Muon) else None

    @property
    def adamw(self) -> AdamW | None:
        """The inner ``torch.optim.AdamW`` (``None`` without an AdamW group)."""
        inner = self._inner.get(ADAMW_KEY)
        return inner if isinstance(inner, AdamW) else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group with ``algorithm`` ``"muon"`` or ``"adamw"``; that algorithm's defaults fill its settings."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        algorithm = param_group.get("algorithm")
        if algorithm not in ALGORITHMS:
            if "algorithm" in param_group:
                raise ValueError(f"Invalid algorithm: {algorithm!r} (must be one of {ALGORITHMS})")
            raise ValueError(f"param group {len(self.param_groups)} has no 'algorithm'. {_NO_ALGORITHM}")
        inner = self._inner.get(algorithm)
        if inner is None:
            inner = _build(algorithm, param_group, self._settings[algorithm])
            inner.state = self.state
        else:
            inner.add_param_group(param_group)
        assert inner.param_groups[-1] is param_group  # the same dict: schedulers' writes reach the inner one
        _refuse_shared(self.param_groups, param_group, inner)
        if algorithm not in self._inner:
            self._inner[algorithm] = inner
            self.defaults[algorithm] = dict(inner.defaults)
        self.param_groups.append(param_group)

    # ------------------------------------------------------------------- state

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_inner": self._inner, "_settings": self._settings, "routing": self.routing}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._relink()

    def _relink(self) -> None:
        """Point the inner optimizers at this optimizer's groups and state again (``load_state_dict`` and
        unpickling build new group dicts and a new state), through their own ``__setstate__`` (which fills
        in keys an older state dict lacks and casts AdamW's ``step``)."""
        for algorithm, inner in self._inner.items():
            groups = [g for g in self.param_groups if g["algorithm"] == algorithm]
            inner.__setstate__({"state": self.state, "param_groups": groups})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `MuonWithAdamW` state dict (`load_pair_state_dicts` takes a ``[Muon, AdamW]`` pair's).

        Raises:
            ValueError: the saved groups' algorithms differ from this optimizer's (or torch's own checks:
                group count, group sizes).
        """
        saved = [g.get("algorithm") for g in state_dict["param_groups"]]
        mine = [g["algorithm"] for g in self.param_groups]
        if len(saved) == len(mine) and saved != mine:
            raise ValueError(
                f"the state dict's param groups have algorithms {saved}, this optimizer's {mine}: "
                "it was saved by a MuonWithAdamW over other groups"
            )
        super().load_state_dict(state_dict)

    def pair_state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(muon_state_dict, adamw_state_dict)``: this state as the pair ``[Muon, AdamW]`` over the same
        groups would save it (`lightning_muon.MuonMixin`'s ``optimizer_states``): each algorithm's groups and
        their parameters' state, renumbered as that optimizer numbers them."""
        return split_state_dict(self.state_dict())

    def load_pair_state_dicts(self, muon_state_dict: dict[str, Any], adamw_state_dict: dict[str, Any]) -> None:
        """Load the states of a ``Muon`` and an ``AdamW`` over the same groups (each algorithm's groups in
        this optimizer's order), as `pair_state_dicts` gives them: the inverse of that."""
        algorithms = [g["algorithm"] for g in self.param_groups]
        self.load_state_dict(merge_state_dicts(muon_state_dict, adamw_state_dict, algorithms))

    # -------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of both algorithms; ``closure`` (evaluated once, with grad) re-evaluates the model and
        returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for algorithm in ALGORITHMS:
            inner = self._inner.get(algorithm)
            if inner is not None:
                inner.step()
        return loss


def _refuse_shared(param_groups: list[dict[str, Any]], group: dict[str, Any], inner: Optimizer) -> None:
    """A parameter of ``group`` already in a group of the other algorithm: undo the inner add and refuse."""
    others = {p for g in param_groups if g["algorithm"] != group["algorithm"] for p in g["params"]}
    shared = [i for i, p in enumerate(group["params"]) if p in others]
    if shared:
        inner.param_groups.pop()
        names = group.get(PARAM_NAMES)
        which = ", ".join(names[i] if names else f"params[{i}]" for i in shared[:5])
        raise ValueError(
            f"some parameters appear in both a Muon and an AdamW group ({which}); each parameter belongs to "
            "exactly one algorithm"
        )


def _groups(
    params: nn.Module | Routing | Iterable[dict[str, Any]], settings: dict[str, Any]
) -> tuple[list[dict[str, Any]], Routing | None]:
    """The param groups (each with ``algorithm``) and the routing they came from (``settings``: the routing's)."""
    muon_params, adamw_params = settings["muon_params"], settings["adamw_params"]
    if isinstance(params, nn.Module):
        routing = route_parameters(params, **settings)
    elif muon_params or adamw_params:
        raise ValueError(
            f"muon_params={list(muon_params)!r} / adamw_params={list(adamw_params)!r} are routing patterns: "
            "give the model itself (MuonWithAdamW.from_model(model, muon_params=...)), not groups or a Routing"
        )
    elif settings["group_settings"]:
        raise ValueError(
            "group_settings are the routing's groups' settings: give the model itself (MuonWithAdamW.from_model(model, "
            "group_settings=...)), or route_parameters(model, group_settings=...) and pass the Routing"
        )
    elif settings["split_fused"] or settings["matrix_blocks"] or settings["split_heads"]:
        raise ValueError(
            "split_fused / split_heads / matrix_blocks are routing settings: give the model itself "
            "(MuonWithAdamW.from_model(model, split_fused=True)), or route_parameters(model, split_fused=True)"
        )
    elif isinstance(params, Routing):
        routing = params
    else:
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not all(isinstance(g, dict) for g in groups):
            raise ValueError(f"got {type(groups[0]).__name__}s, not param groups. {_NO_ALGORITHM}")
        return [dict(g) for g in groups], None
    if not routing.routes:
        raise ValueError("optimizer got an empty parameter list (the model has no trainable parameter)")
    groups = [{**g, "algorithm": algorithm.key} for algorithm in Algorithm for g in routing.groups(algorithm)]
    return groups, routing


def _build(algorithm: str, group: dict[str, Any], settings: dict[str, Any]) -> Optimizer:
    """The inner optimizer of ``algorithm``, built over its first group (torch's constructors check the settings)."""
    if algorithm == MUON_KEY:
        return Muon([group], **settings)
    return AdamW([group], **settings)


def _check_settings(inner: dict[str, Optimizer], settings: dict[str, dict[str, Any]], routing: Routing | None) -> None:
    """Check each algorithm's settings: on its inner optimizer, the routing's group settings it must take (one it
    does not take would be ignored); without one (no group of it yet), its constructor's on a placeholder."""
    for algorithm in ALGORITHMS:
        if algorithm not in inner:
            _validation_only(algorithm, settings[algorithm])
        elif routing is not None:
            check_settings_taken(inner[algorithm], routing.group_settings, algorithm)


def _validation_only(algorithm: str, settings: dict[str, Any]) -> None:
    """Check the settings of an algorithm that has no group yet, as its constructor would (on a placeholder)."""
    placeholder = torch.zeros(2, 2, requires_grad=True)
    if algorithm == MUON_KEY:  # the process group and mesh are checked where they are used, with a parameter
        Muon([placeholder], **{k: v for k, v in settings.items() if k not in ("process_group", "device_mesh")})
    else:
        AdamW([placeholder], **settings)
