"""Finding attention modules and their q/k heads, and capturing the q and k each one actually uses.

Families, tried in this order on every module:

- a module with a ``qk_layout()`` method: the adapter (`layout.record_qk` in its forward gives q and k);
- ``torch.nn.MultiheadAttention`` (``in_proj_weight`` or separate ``q_proj_weight``/``k_proj_weight``): no RoPE,
  so q and k are recomputed exactly from the call's inputs in a forward pre-hook (two extra projections);
- litgpt ``CausalSelfAttention`` (fused ``qkv``: all query heads, then the key groups, then the value groups):
  the module's own ``scaled_dot_product_attention(q, k, v, mask)`` method is wrapped on the instance, so q and k
  arrive after QK-norm and RoPE, with litgpt's scale;
- transformers attention with ``q_proj``/``k_proj`` (Llama, Qwen2, Mistral, ... with GQA) and GPT-2's fused
  ``c_attn`` ``Conv1D`` (``in x out``): every transformers 5 attention calls its attention function through
  ``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` with the module, the post-RoPE q and k, the mask and its
  ``scaling``. While any transformers module is measured, that one lookup returns the function wrapped: the
  wrapper hands q and k to the module's recorder and calls the function unchanged. This catches eager, SDPA
  and flash alike, needs no copy of any model's RoPE or norm code, and is undone when the last meter is
  removed. A transformers attention that does not go through it is caught by the meter's check that every
  found module reported q and k. Flex attention (a BlockMask, not a mask tensor) is refused.

A module whose class name says attention (``...Attention``, ``...Attn``) that none of these recognise, and that
holds no recognised attention itself, is refused by name, with the adapter as the fix.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import Tensor, nn

from lightning_muon.attention.layout import RECORDERS, QKLayout, QKProjection, Recorder

__all__ = ["AttentionSite", "UnsupportedAttentionError", "find_attention"]

ADAPTER_HINT = (
    "give the module a qk_layout() method returning a lightning_muon.attention.QKLayout and call "
    "lightning_muon.attention.record_qk(self, q, k, scale=..., causal=...) in its forward (the QK-Clip guide, "
    "docs/guides/qk-clip.md, \"Your own attention\"), or leave it out with exclude=[<name pattern>]"
)


class UnsupportedAttentionError(ValueError):
    """An attention-like module whose query and key heads cannot be found or measured."""


@dataclass(frozen=True)
class AttentionSite:
    """One attention module found in a model: its name there, the module, its q/k layout and its family."""

    name: str
    module: nn.Module
    layout: QKLayout
    family: str

    def current_layout(self) -> QKLayout:
        """The layout found again from the module as it is now: inside a forward under FSDP2 its weights are the
        gathered ones (under FSDP2 over tensor parallelism, this rank's tensor-parallel shards), not the
        parameters the optimizer steps."""
        return _FAMILIES[self.family][0](self.name, self.module) or self.layout

    def capture(self, recorder: Recorder) -> Callable[[], None]:
        """Start handing this module's q and k to ``recorder``; returns the function that stops it."""
        if self.module in RECORDERS:
            raise RuntimeError(
                f"{self.name or 'the model'} ({type(self.module).__name__}) is measured already (another QKClipper "
                "or QKClip on the same model): remove() that one first"
            )
        RECORDERS[self.module] = recorder
        undo = _CAPTURES[self.family](self.module)

        def remove() -> None:
            undo()
            if RECORDERS.get(self.module) is recorder:
                del RECORDERS[self.module]

        return remove


# ------------------------------------------------------------------ masks


def keep_from_sdpa_mask(mask: Tensor | None) -> Tensor | None:
    """An SDPA-style mask (bool True = attend, or additive float with -inf / the dtype's min where masked) as a
    boolean keep-mask. Finite additive biases are not part of the logit ``q . k`` and are left out."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return mask != 0
    return mask > torch.finfo(mask.dtype).min / 2


def _keep_from_mha_mask(mask: Tensor | None) -> Tensor | None:
    """``nn.MultiheadAttention``'s masks: bool True = NOT allowed, or additive float."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return ~mask
    return mask > torch.finfo(mask.dtype).min / 2


# ------------------------------------------------------------------ transformers


_HF_STATE: dict[str, Any] = {"count": 0, "interface": None, "wrappers": {}}


def _measured(function: Callable[..., Any]) -> Callable[..., Any]:
    wrappers: dict[Any, Callable[..., Any]] = _HF_STATE["wrappers"]
    if function in wrappers:
        return wrappers[function]

    def attention(module: nn.Module, query: Tensor, key: Tensor, *args: Any, **kwargs: Any) -> Any:
        recorder = RECORDERS.get(module)
        if recorder is not None:
            mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
            scaling = kwargs.get("scaling")
            is_causal = kwargs.get("is_causal")
            if is_causal is None:
                is_causal = getattr(module, "is_causal", True)
            scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
            if mask is not None and mask.dim() == 2:
                # flash attention's (batch, S) padding mask (1 = attend); the kernel itself applies causality.
                keep = mask.bool()[:, None, None, :]
                recorder(query, key, scale, bool(is_causal) and query.shape[2] > 1, keep)
            else:
                # transformers' SDPA rule: no mask means causal for a causal module, with more than one query.
                causal = mask is None and bool(is_causal) and query.shape[2] > 1
                recorder(query, key, scale, causal, keep_from_sdpa_mask(mask))
        return function(module, query, key, *args, **kwargs)

    wrappers[function] = attention
    return attention


def _capture_transformers(module: nn.Module) -> Callable[[], None]:
    if _HF_STATE["count"] == 0:
        interface = sys.modules["transformers.modeling_utils"].ALL_ATTENTION_FUNCTIONS
        original = interface.get_interface

        def get_interface(attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
            return _measured(original(attn_implementation, default))

        interface.get_interface = get_interface
        _HF_STATE["interface"] = interface
    _HF_STATE["count"] += 1
    done = False

    def undo() -> None:
        nonlocal done
        if done:
            return
        done = True
        _HF_STATE["count"] -= 1
        if _HF_STATE["count"] == 0:
            interface = _HF_STATE["interface"]
            vars(interface).pop("get_interface", None)
            _HF_STATE["interface"] = None
            _HF_STATE["wrappers"].clear()

    return undo


def _from_transformers(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def _check_transformers_dispatch(name: str, module: nn.Module) -> None:
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if isinstance(implementation, str) and "flex" in implementation:
        raise UnsupportedAttentionError(
            f"{name} ({type(module).__name__}) runs flex attention, whose BlockMask cannot be read as a mask here; "
            "use attn_implementation='sdpa', 'eager' or a flash attention"
        )


def _transformers_layout(name: str, module: nn.Module) -> QKLayout | None:
    q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    if not (isinstance(q_proj, nn.Linear) and isinstance(k_proj, nn.Linear)):
        return None
    _check_transformers_dispatch(name, module)
    head_dim = getattr(module, "head_dim", None)
    config = getattr(module, "config", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        raise UnsupportedAttentionError(f"{name} ({type(module).__name__}) has q_proj/k_proj but no head_dim")
    heads = getattr(config, "num_attention_heads", None) or q_proj.out_features // head_dim
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if q_proj.out_features != heads * head_dim or k_proj.out_features != kv_heads * head_dim:
        raise UnsupportedAttentionError(
            f"{name} ({type(module).__name__}): q_proj has {q_proj.out_features} and k_proj {k_proj.out_features} "
            f"output features, not {heads} and {kv_heads} heads of {head_dim} (a gated or otherwise fused query?)"
        )
    qk_norm = any(getattr(module, n, None) is not None for n in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"))
    v_proj = getattr(module, "v_proj", None)
    has_value = isinstance(v_proj, nn.Linear) and v_proj.out_features == kv_heads * head_dim
    return QKLayout(
        query=QKProjection(q_proj.weight, q_proj.bias),
        key=QKProjection(k_proj.weight, k_proj.bias),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        qk_norm=qk_norm,
        value=QKProjection(v_proj.weight, v_proj.bias) if has_value else None,  # type: ignore[union-attr]
    )


def _gpt2_layout(name: str, module: nn.Module) -> QKLayout | None:
    c_attn = getattr(module, "c_attn", None)
    if c_attn is None or type(c_attn).__name__ != "Conv1D":
        return None
    _check_transformers_dispatch(name, module)
    config = getattr(module, "config", None)
    if getattr(module, "reorder_and_upcast_attn", False) and getattr(config, "_attn_implementation", None) == "eager":
        raise UnsupportedAttentionError(
            f"{name} ({type(module).__name__}): reorder_and_upcast_attn with eager attention bypasses transformers' "
            "attention function, so its q and k cannot be seen; use attn_implementation='sdpa'"
        )
    embed: int = getattr(module, "embed_dim")  # noqa: B009 (nn.Module attributes are typed Tensor | Module)
    heads: int = getattr(module, "num_heads")  # noqa: B009
    head_dim: int = getattr(module, "head_dim")  # noqa: B009
    if getattr(module, "is_cross_attention", False):
        q_attn: Any = getattr(module, "q_attn")  # noqa: B009
        query = QKProjection(q_attn.weight, q_attn.bias, 0, transposed=True)
        key = QKProjection(c_attn.weight, c_attn.bias, 0, transposed=True)
        value = QKProjection(c_attn.weight, c_attn.bias, embed, transposed=True)
    else:
        query = QKProjection(c_attn.weight, c_attn.bias, 0, transposed=True)
        key = QKProjection(c_attn.weight, c_attn.bias, embed, transposed=True)
        value = QKProjection(c_attn.weight, c_attn.bias, 2 * embed, transposed=True)
    return QKLayout(query=query, key=key, num_heads=heads, num_kv_heads=heads, head_dim=head_dim, value=value)


# ------------------------------------------------------------------ litgpt


def _litgpt_scale(module: nn.Module) -> float:
    config: Any = getattr(module, "config")  # noqa: B009
    return 1.0 / math.sqrt(config.attention_scores_scalar or config.head_size)


def _capture_litgpt(module: nn.Module) -> Callable[[], None]:
    original: Callable[..., Tensor] = getattr(module, "scaled_dot_product_attention")  # noqa: B009

    def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        recorder = RECORDERS.get(module)
        if recorder is not None:
            recorder(q, k, _litgpt_scale(module), mask is None, keep_from_sdpa_mask(mask))
        return original(q, k, v, mask)

    vars(module)["scaled_dot_product_attention"] = scaled_dot_product_attention  # on the instance only

    def undo() -> None:
        if vars(module).get("scaled_dot_product_attention") is scaled_dot_product_attention:
            del vars(module)["scaled_dot_product_attention"]

    return undo


def _litgpt_layout(name: str, module: nn.Module) -> QKLayout | None:
    qkv = getattr(module, "qkv", None)
    if not (type(module).__module__.startswith("litgpt.") and isinstance(qkv, nn.Linear)):
        return None
    config: Any = getattr(module, "config")  # noqa: B009
    heads, groups, head_dim = config.n_head, config.n_query_groups, config.head_size
    if qkv.out_features != (heads + 2 * groups) * head_dim or not callable(
        getattr(module, "scaled_dot_product_attention", None)
    ):
        raise UnsupportedAttentionError(
            f"{name} ({type(module).__name__}): qkv has {qkv.out_features} output features, not "
            f"({heads} + 2 x {groups}) x {head_dim} (q | k | v), or there is no scaled_dot_product_attention method"
        )
    return QKLayout(
        query=QKProjection(qkv.weight, qkv.bias, 0),
        key=QKProjection(qkv.weight, qkv.bias, heads * head_dim),
        num_heads=heads,
        num_kv_heads=groups,
        head_dim=head_dim,
        qk_norm=bool(config.norm_qk),
        value=QKProjection(qkv.weight, qkv.bias, (heads + groups) * head_dim),
    )


# ------------------------------------------------------------------ torch.nn.MultiheadAttention

_MHA_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _mha_qk(module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, ...]:
    """q ``(N, H, L, hd)`` and k ``(N, H, S, hd)`` exactly as the call computes them, and its keep-mask."""
    bound = _MHA_SIGNATURE.bind(module, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    query, key = a["query"], a["key"]
    if query.dim() == 2:  # unbatched (L, E)
        query, key = query.unsqueeze(1), key.unsqueeze(1)
    elif module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    layout = _mha_layout("", module)
    assert layout is not None
    heads, head_dim = layout.num_heads, layout.head_dim
    projected = []
    for proj, x in ((layout.query, query), (layout.key, key)):
        weight = proj.weight.narrow(0, proj.offset, heads * head_dim)
        bias = None if proj.bias is None else proj.bias.narrow(0, proj.bias_start, heads * head_dim)
        y = nn.functional.linear(x, weight, bias)  # (L, N, E)
        projected.append(y.unflatten(-1, (heads, head_dim)).permute(1, 2, 0, 3))  # (N, H, L, hd)
    q, k = projected
    keep = _keep_from_mha_mask(a["attn_mask"])
    if keep is not None and keep.dim() == 3:
        keep = keep.unflatten(0, (-1, heads))  # (N*H, L, S) -> (N, H, L, S)
    padding = _keep_from_mha_mask(a["key_padding_mask"])
    if padding is not None:
        padding = padding.reshape(-1, 1, 1, padding.shape[-1])
        keep = padding if keep is None else keep & padding
    return (q, k) if keep is None else (q, k, keep)


def _capture_mha(module: nn.Module) -> Callable[[], None]:
    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        recorder = RECORDERS.get(mod)
        if recorder is None:
            return
        with torch.no_grad():
            q, k, *keep = _mha_qk(mod, args, kwargs)  # type: ignore[arg-type]
        recorder(q, k, q.shape[-1] ** -0.5, False, keep[0] if keep else None)

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    return handle.remove


def _mha_layout(name: str, module: nn.Module) -> QKLayout | None:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    if module.bias_k is not None or module.add_zero_attn:
        raise UnsupportedAttentionError(
            f"{name} (MultiheadAttention): add_bias_kv / add_zero_attn add keys no projection makes, so the clip "
            "could not cap their logits"
        )
    embed, heads = module.embed_dim, module.num_heads
    bias = module.in_proj_bias
    if module._qkv_same_embed_dim:
        weight = module.in_proj_weight
        query, key = QKProjection(weight, bias, 0), QKProjection(weight, bias, embed)
        value = QKProjection(weight, bias, 2 * embed)
    else:
        query = QKProjection(module.q_proj_weight, bias, 0, bias_offset=0)
        key = QKProjection(module.k_proj_weight, bias, 0, bias_offset=embed)
        value = QKProjection(module.v_proj_weight, bias, 0, bias_offset=2 * embed)
    return QKLayout(query=query, key=key, num_heads=heads, num_kv_heads=heads, head_dim=module.head_dim, value=value)


# ------------------------------------------------------------------ finding them


def _adapter_layout(name: str, module: nn.Module) -> QKLayout | None:
    method = getattr(module, "qk_layout", None)
    if not callable(method):
        return None
    layout = method()
    if not isinstance(layout, QKLayout):
        raise UnsupportedAttentionError(
            f"{name} ({type(module).__name__}).qk_layout() returned {type(layout).__name__}, not a QKLayout"
        )
    return layout


def _no_capture(module: nn.Module) -> Callable[[], None]:
    return lambda: None


#: family -> (layout finder, capture installer); tried in this order.
_FAMILIES: dict[str, tuple[Callable[[str, nn.Module], QKLayout | None], Callable[[nn.Module], Callable[[], None]]]] = {
    "adapter": (_adapter_layout, _no_capture),
    "torch.nn.MultiheadAttention": (_mha_layout, _capture_mha),
    "litgpt": (_litgpt_layout, _capture_litgpt),
    "transformers": (_transformers_layout, _capture_transformers),
    "transformers GPT-2": (_gpt2_layout, _capture_transformers),
}
_CAPTURES = {family: capture for family, (_, capture) in _FAMILIES.items()}
_TRANSFORMERS_ONLY = {"transformers", "transformers GPT-2"}
_LOOKS_LIKE_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)


def _site_of(name: str, module: nn.Module) -> AttentionSite | None:
    for family, (find_layout, _) in _FAMILIES.items():
        if family in _TRANSFORMERS_ONLY and not _from_transformers(module):
            continue
        layout = find_layout(name or "the model", module)
        if layout is not None:
            layout.check(name or "the model")
            return AttentionSite(name, module, layout, family)
    return None


def _within(inner: str, outer: str) -> bool:
    """Whether module ``inner`` is ``outer`` or inside it (names as ``named_modules`` gives them; ``""`` the root)."""
    return not outer or inner == outer or inner.startswith(outer + ".")


def _excluded(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def _holds_projections(module: nn.Module) -> bool:
    """Matrices of its own or in leaf children (its projections), not only deeper in sub-blocks (a whole model
    whose class name happens to say attention)."""
    if any(p.dim() >= 2 for p in module.parameters(recurse=False)):
        return True
    return any(
        next(child.children(), None) is None and any(p.dim() >= 2 for p in child.parameters())
        for child in module.children()
    )


def find_attention(model: nn.Module, exclude: Iterable[str] = ()) -> list[AttentionSite]:
    """Every attention module of ``model`` with its q/k layout, in module order, without naming any weight.

    Args:
        model: any ``nn.Module`` (a LightningModule too).
        exclude: ``fnmatch`` patterns of module names to leave out (``"encoder.*"``).

    Raises:
        UnsupportedAttentionError: for a module that looks like attention (its class name says so, it holds
            projection matrices itself or in leaf children) but whose q and k cannot be found; the message
            names each and the adapter.
    """
    exclude = list(exclude)
    sites: list[AttentionSite] = []
    for name, module in model.named_modules():
        if _excluded(name, exclude) or any(_within(name, s.name) for s in sites):
            continue
        site = _site_of(name, module)
        if site is not None:
            sites.append(site)
    found = [s.name for s in sites]
    refused = [
        f"{name or 'the model'} ({type(module).__name__})"
        for name, module in model.named_modules()
        if _LOOKS_LIKE_ATTENTION.search(type(module).__name__)
        and not _excluded(name, exclude)
        and _holds_projections(module)
        and not any(_within(f, name) or _within(name, f) for f in found)
    ]
    if refused:
        raise UnsupportedAttentionError(
            f"cannot find the query and key heads of {', '.join(refused)}: {ADAPTER_HINT}"
        )
    return sites
