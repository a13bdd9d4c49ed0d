"""What a module or parameter is for, read from the model itself: heads, the input layer, token tables,
stored orientation and stacks of matrices. `lightning_muon.routing` turns these into routes.

Conventions of the ecosystem come first (transformers' ``get_output_embeddings()``, timm's
``get_classifier()``, well-known module names), then structure. No library is imported: classes are
recognised by name (transformers' ``Conv1D``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_muon.routing._vocabulary import Rule

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

#: Last name components that mark a Linear as a model's output head.
HEAD_NAMES = frozenset({"lm_head", "head", "classifier", "score", "qa_outputs", "output", "logits", "seq_relationship"})
#: Containers named so hold a head: their last Linear (``classifier.out_proj``, ``classifier.1``). Not
#: ``output``, which transformers' BERT family also uses for a block's hidden projection.
HEAD_CONTAINER_NAMES = frozenset({"lm_head", "head", "classifier", "score"})

#: Bare parameters (not a layer's weight) that are embeddings: class/mask/register tokens, position tables.
_TABLE_NAME = re.compile(r"(token|tokens|embed|embeds|embedding|embeddings|emb|table)$|^pe$|pos(ition)?_?(emb|bias)")

#: Name components of attention blocks, whose output projection is never a head.
_ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)

#: A conv reading this many channels or fewer, before any other conv, reads the raw input (pixels, audio).
MAX_INPUT_CHANNELS = 4


def is_norm(module: nn.Module) -> bool:
    """Norm layers by type: torch's own, and custom classes named ``...Norm`` (``RMSNorm``, ``LayerNorm``...)."""
    torch_norms = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)
    return isinstance(module, torch_norms) or re.search(r"Norm(\dd)?$", type(module).__name__) is not None


def is_conv(module: nn.Module) -> bool:
    """torch's convolutions (``nn.Conv1d/2d/3d``, transposed and lazy ones): their kernels flatten."""
    return isinstance(module, nn.modules.conv._ConvNd)


def kernel_groups(module: nn.Module, param_name: str) -> int:
    """How many groups a convolution's kernel holds (its ``groups``: ResNeXt's 32, a depthwise conv's one per
    channel), 1 for any other parameter. A grouped kernel is a stack of its groups' matrices along dim 0, each
    ``shape[0] / groups x prod(shape[1:])``: a conv's ``out x in/groups x k...`` holds group ``j``'s output
    channels in rows ``j*out/groups`` on, a transposed conv's ``in x out/groups x k...`` group ``j``'s input
    channels (its operator maps them to the group's outputs: the same matrix, stored transposed)."""
    return module.groups if isinstance(module, nn.modules.conv._ConvNd) and param_name == "weight" else 1


def grouped_kernels(module: nn.Module) -> dict[str, int]:
    """The kernels of a model's grouped convolutions (``groups`` > 1), by parameter name, with their number of
    groups (`kernel_groups`)."""
    return {f"{name}.weight" if name else "weight": m.groups
            for name, m in module.named_modules() if is_conv(m) and m.groups > 1}


def stores_in_out(module: nn.Module, param_name: str) -> bool:
    """A weight stored ``in x out`` (transformers' ``Conv1D``, the GPT-2 family's Linear)."""
    return type(module).__name__ == "Conv1D" and param_name == "weight"


def stacks_in_out(module: nn.Module) -> bool:
    """An experts module whose stacks of matrices are stored ``E x in x out``, as its model says itself:
    transformers 5's ``use_experts_implementation`` sets ``is_transposed`` (GPT-OSS: ``x @ down_proj[e]``)."""
    return getattr(module, "is_transposed", None) is True


def stack_beside(module: nn.Module, param_name: str, param: Tensor) -> str | None:
    """The name of the stack of matrices in ``module`` that ``param`` holds one vector of per matrix (a per-expert
    bias or scale ``E x n`` beside experts ``E x n x k`` or ``E x k x n``, GPT-OSS's ``gate_up_proj_bias``), or
    ``None``. Where several stacks fit, the one whose name begins ``param_name`` (``down_proj`` for
    ``down_proj_bias``)."""
    if param.ndim < 2:
        return None
    stacks = [
        name for name, other in module.named_parameters(recurse=False)
        if other.ndim == param.ndim + 1 and other.shape[:-2] == param.shape[:-1] and param.shape[-1] in other.shape[-2:]
    ]
    return next((name for name in stacks if param_name.startswith(name)), stacks[0] if stacks else None)


#: Class names of mixture-of-experts routers (transformers' ``MixtralTopKRouter``, ``JetMoeTopKGating``, DeepSeek's
#: ``MoEGate``).
_ROUTER_CLASS = re.compile(r"(Router|Gating|MoEGate)$")


def _experts_count(name: str, child: nn.Module) -> int | None:
    """How many experts a module holds: the leading size of its stacks of matrices, or the length of a list named
    ``experts`` of several same-class modules (one expert each, as transformers' older MoE models)."""
    if is_conv(child):
        return None
    stacks = {p.shape[0] for p in child.parameters(recurse=False) if p.ndim >= 3 and 1 not in p.shape}
    if len(stacks) == 1:
        return stacks.pop()
    if isinstance(child, nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts":
        experts = list(child)
        if len(experts) > 1 and len({type(c) for c in experts}) == 1:
            return len(experts)
    return None


def routers(module: nn.Module) -> dict[str, tuple[Rule, int]]:
    """Mixture-of-experts routers and gates, by module name, with the rule that found each and its number of gate
    vectors: a module with a router's class name (`Rule.MODULE_TYPE`), or one beside the experts whose weight has
    a row per expert or a single row (a shared expert's gate, Qwen2-MoE's ``shared_expert_gate``:
    `Rule.STRUCTURE`). Its weight is one gate vector per expert, not a hidden layer's matrix."""
    found: dict[str, tuple[Rule, int]] = {}
    for name, m in module.named_modules():
        children = {f"{name}.{c}" if name else c: child for c, child in m.named_children()}
        counts = {n for c, child in children.items() if (n := _experts_count(c, child)) is not None}
        for child_name, child in children.items():
            weight = getattr(child, "weight", None)
            if not isinstance(weight, Tensor) or weight.ndim != 2 or is_conv(child) or isinstance(child, EMBEDDINGS):
                continue
            if _ROUTER_CLASS.search(type(child).__name__):
                found[child_name] = (Rule.MODULE_TYPE, weight.shape[0])
            elif counts and (weight.shape[0] in counts or weight.shape[0] == 1):  # a shared expert's gate: 1 row
                found.setdefault(child_name, (Rule.STRUCTURE, weight.shape[0]))
    return found


#: PEFT's adapter parameters that are no linear map's matrix, by the name PEFT gives them (a path segment), with
#: what they are: elementwise scales and magnitudes, rotation generators, selection logits, coefficients. PEFT's
#: matrices (``lora_A``, LoHa's ``hada_w*``, LoKr's ``lokr_w*``, ``miss_block``, DeLoRA's and GraLoRA's ``A``/``B``)
#: are not here: they go by their shape.
ADAPTER_COEFFICIENTS = {
    "lora_magnitude_vector": "DoRA's magnitude, a scale per output",
    "lora_E": "AdaLoRA's singular values",
    "ia3_l": "IA3's scaling vector",
    "boft_s": "BOFT's scale per output",
    "boft_R": "BOFT's rotation generators (skew blocks)",
    "oft_R": "OFT's rotation generators (packed skew blocks)",
    "oft_embedding_R": "OFT's rotation generators (packed skew blocks)",
    "vera_lambda_b": "VeRA's scaling vector",
    "vera_lambda_d": "VeRA's scaling vector",
    "pvera_lambda_b": "PVeRA's scaling vector",
    "pvera_lambda_d": "PVeRA's scaling vector",
    "randlora_lambda": "RandLoRA's diagonal scales",
    "randlora_gamma": "RandLoRA's diagonal scales",
    "hra_u": "HRA's Householder vectors",
    "vblora_logits_A": "VB-LoRA's selection logits",
    "vblora_logits_B": "VB-LoRA's selection logits",
    "vblora_vector_bank": "VB-LoRA's bank of sub-vectors",
    "c3a_kernel": "C3A's circular-convolution kernels",
    "fourierft_spectrum": "FourierFT's spectral coefficients",
    "waveft_spectrum": "WaveFT's wavelet coefficients",
    "shira_weight": "SHiRA's sparse entries",
    "delora_lambda": "DeLoRA's norm bound",
    "road_theta": "RoAd's rotation angles",
    "road_alpha": "RoAd's scales",
    "frod_lambda_l": "FRoD's scales",
    "frod_lambda_s_values": "FRoD's scales",
    "beft_bias": "BEFT's bias",
    "tinylora_v": "TinyLoRA's coefficients",
    "unilora_theta_d": "Uni-LoRA's coefficients",
}


def adapter_parameters(module: nn.Module) -> dict[str, str]:
    """PEFT's adapter parameters by full name, each with its adapter's name (``ia3_l``): every tuner layer lists
    the names of its own (``adapter_layer_names``), whatever the method."""
    found: dict[str, str] = {}
    for name, m in module.named_modules():
        segments = getattr(m, "adapter_layer_names", None)
        if not isinstance(segments, tuple | list):
            continue
        for segment in segments:
            held = getattr(m, segment, None)
            if isinstance(held, nn.Module):
                prefix = f"{name}.{segment}" if name else segment
                found.update((f"{prefix}.{p_name}", segment) for p_name, _ in held.named_parameters())
    return found


#: torch's recurrent layers whose ``weight_ih`` and ``weight_hh`` matrices stack several gates' matrices in their
#: rows, with those gates in torch's order (``nn.RNN``'s and ``nn.RNNCell``'s hold one matrix each: not fused).
RECURRENT_GATES: tuple[tuple[type[nn.Module], str, int], ...] = (
    (nn.LSTM, "LSTM gates i, f, g, o", 4), (nn.LSTMCell, "LSTM gates i, f, g, o", 4),
    (nn.GRU, "GRU gates r, z, n", 3), (nn.GRUCell, "GRU gates r, z, n", 3),
)
#: A recurrent layer's gate matrices: ``weight_ih_l0``, ``weight_hh_l1_reverse``, a cell's ``weight_ih`` (not a
#: projection's ``weight_hr_l0``, one matrix).
_GATE_WEIGHT = re.compile(r"^weight_(ih|hh)(_l\d+(_reverse)?)?$")


def fused_projections(module: nn.Module) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """The fused projections of a model, by parameter name: what their blocks are (``"q, k, v"``) and their sizes
    along the output dim (``None`` where the blocks are interleaved, not contiguous), found by module type and
    shape: ``nn.MultiheadAttention``'s ``in_proj_weight``, transformers' ``Conv1D`` ``c_attn`` of an attention of
    ``embed_dim`` (GPT-2), litgpt's ``qkv`` (unequal blocks under grouped-query attention), transformers 5's
    fused experts' ``gate_up_proj`` (``has_gate``; ``is_concatenated`` says contiguous or interleaved), and the
    gates of ``nn.LSTM``/``nn.GRU`` (and their cells) stacked in the rows of every ``weight_ih``/``weight_hh``
    (`RECURRENT_GATES`)."""
    found: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for name, m in module.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None:
            found[f"{prefix}in_proj_weight"] = ("q, k, v", (m.embed_dim,) * 3)
        gate_up = getattr(m, "gate_up_proj", None)
        if getattr(m, "has_gate", None) is True and isinstance(gate_up, Tensor) and gate_up.ndim >= 3:
            rows = gate_up.shape[-1] if stacks_in_out(m) else gate_up.shape[-2]
            contiguous = getattr(m, "is_concatenated", True) is True
            found[f"{prefix}gate_up_proj"] = ("gate, up", (rows // 2,) * 2 if contiguous else None)
        embed_dim, config = getattr(m, "embed_dim", None), getattr(m, "config", None)
        for child_name, child in m.named_children():
            weight = f"{prefix}{child_name}.weight"
            if type(child).__name__ == "Conv1D" and isinstance(embed_dim, int):
                out = getattr(child, "nf", None)
                if out == 3 * embed_dim:
                    found[weight] = ("q, k, v", (embed_dim,) * 3)
                elif out == 2 * embed_dim and getattr(m, "is_cross_attention", False):
                    found[weight] = ("k, v", (embed_dim,) * 2)
            if child_name == "qkv" and isinstance(child, nn.Linear) and config is not None:
                sizes = _litgpt_qkv(config)
                if sizes is not None and sum(sizes) == child.out_features:
                    found[weight] = ("q, k, v", sizes)
    return found | recurrent_gates(module)


def recurrent_gates(module: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The gate-stacked matrices of a model's ``nn.LSTM``/``nn.GRU`` layers and cells (`RECURRENT_GATES`), by
    parameter name: what their gates are (``"LSTM gates i, f, g, o"``) and their sizes along the rows (the hidden
    size each: ``4h x in`` holds i, f, g and o one under the other)."""
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, m in module.named_modules():
        gates = next(((what, count) for kind, what, count in RECURRENT_GATES if isinstance(m, kind)), None)
        if gates is None:
            continue
        what, count = gates
        for p_name, p in m.named_parameters(recurse=False):
            if _GATE_WEIGHT.match(p_name) and p.ndim == 2 and p.shape[0] % count == 0:
                found[f"{name}.{p_name}" if name else p_name] = (what, (p.shape[0] // count,) * count)
    return found


def _litgpt_qkv(config: object) -> tuple[int, int, int] | None:
    """litgpt's ``qkv`` blocks from its config: ``n_head`` query heads, ``n_query_groups`` key and value heads of
    ``head_size`` each, contiguous (``qkv.split((q, k, v))`` in its forward)."""
    heads, groups, size = (getattr(config, key, None) for key in ("n_head", "n_query_groups", "head_size"))
    if not all(isinstance(v, int) for v in (heads, groups, size)):
        return None
    return heads * size, groups * size, groups * size  # type: ignore[operator]


#: torch's parametrizations (``torch.nn.utils.parametrizations``) by class name, in words.
_PARAMETRIZATIONS = {"_WeightNorm": "weight norm", "_SpectralNorm": "spectral norm", "_Orthogonal": "orthogonal"}
#: The parameters torch's older hook-based reparametrizations register beside the tensor they make
#: (``torch.nn.utils.weight_norm``: ``weight_g``, ``weight_v``; ``torch.nn.utils.spectral_norm``: ``weight_orig``).
_HOOKED_PART = re.compile(r"^(?P<tensor>\w+?)_(?P<part>g|v|orig)$")


@dataclass(frozen=True)
class Parametrized:
    """A parameter that is not a layer's tensor but makes it through a parametrization: torch's
    ``parametrizations.weight.original0`` (weight norm's magnitude), ``original1`` (its direction), ``original``
    (spectral norm's, orthogonal's, any one-tensor parametrization's), or the older ``weight_g``, ``weight_v`` and
    ``weight_orig``. Its rules are its layer's: a weight-normed conv's direction is that conv's kernel."""

    #: The name of the layer (module) whose tensor it makes (``""``: the model itself).
    layer: str
    #: The name of that tensor in the layer (``weight``).
    tensor: str
    #: The parametrization, in words (``weight norm``; several: ``weight norm, then MyScale``).
    by: str
    #: What of the tensor it is: ``"magnitude"`` (weight norm's: one scale per output), ``"direction"`` (weight
    #: norm's), ``""`` (the tensor before the parametrization), or ``"original<i>"`` (one of several of a
    #: parametrization this package does not know).
    part: str

    @property
    def words(self) -> str:
        """What it is, for a reason: ``weight norm's direction of `conv.weight```."""
        what = {"magnitude": "magnitude", "direction": "direction", "": "original"}.get(self.part, self.part)
        return f"{self.by}'s {what} of `{self.qualified}`"

    @property
    def qualified(self) -> str:
        """The tensor it makes, by its full name (``conv.weight``)."""
        return f"{self.layer}.{self.tensor}" if self.layer else self.tensor


def class_name(module: nn.Module) -> str:
    """A module's class name, as its user wrote it: ``Conv1d`` for the ``ParametrizedConv1d`` torch makes of a
    parametrized ``Conv1d``."""
    cls = type(module)
    if cls.__name__.startswith("Parametrized") and isinstance(getattr(module, "parametrizations", None), nn.ModuleDict):
        return cls.__mro__[1].__name__
    return cls.__name__


def parametrized(module: nn.Module) -> dict[str, Parametrized]:
    """The parameters of ``module`` that make a layer's tensor through a parametrization (`Parametrized`), by
    full name: torch's ``register_parametrization`` (weight norm, spectral norm, orthogonal, any other) and the
    older hook-based ``torch.nn.utils.weight_norm`` and ``spectral_norm`` (`_hooked`)."""
    found: dict[str, Parametrized] = {}
    for name, m in module.named_modules():
        prefix = f"{name}." if name else ""
        lists = getattr(m, "parametrizations", None)
        if isinstance(lists, nn.ModuleDict):
            for tensor, chain in lists.items():
                kinds = [type(p).__name__ for p in chain] if isinstance(chain, nn.ModuleList) else []
                by = ", then ".join(_PARAMETRIZATIONS.get(k, k) for k in kinds) or "a parametrization"
                originals = [n for n, _ in chain.named_parameters(recurse=False) if n.startswith("original")]
                weight_norm = kinds[:1] == ["_WeightNorm"] and set(originals) == {"original0", "original1"}
                for original in originals:
                    if weight_norm:
                        part = "magnitude" if original == "original0" else "direction"
                    else:
                        part = "" if original == "original" else original
                    found[f"{prefix}parametrizations.{tensor}.{original}"] = Parametrized(name, tensor, by, part)
        found.update((f"{prefix}{n}", made) for n, made in _hooked(name, m).items())
    return found


def _hooked(name: str, m: nn.Module) -> dict[str, Parametrized]:
    """The parameters of module ``m`` (named ``name``) that torch's older hook-based weight norm or spectral norm
    registered, known by what they register: ``<t>_g`` and ``<t>_v`` (weight norm) or ``<t>_orig`` with buffers
    ``<t>_u`` and ``<t>_v`` (spectral norm), beside ``<t>``, the plain tensor they make, of the shape of ``<t>_v``
    or ``<t>_orig``."""
    own, buffers = dict(m.named_parameters(recurse=False)), dict(m.named_buffers(recurse=False))
    found: dict[str, Parametrized] = {}
    for param_name, p in own.items():
        match = _HOOKED_PART.match(param_name)
        if match is None:
            continue
        tensor, part = match["tensor"], match["part"]
        made = getattr(m, tensor, None)
        if not isinstance(made, Tensor) or isinstance(made, nn.Parameter) or tensor in buffers:
            continue
        v = own.get(f"{tensor}_v")
        if part in ("g", "v") and v is not None and f"{tensor}_g" in own and v.shape == made.shape:
            found[param_name] = Parametrized(name, tensor, "weight norm", "magnitude" if part == "g" else "direction")
        elif part == "orig" and p.shape == made.shape and {f"{tensor}_u", f"{tensor}_v"} <= set(buffers):
            found[param_name] = Parametrized(name, tensor, "spectral norm", "")
    return found


def is_table(param_name: str, param: Tensor) -> bool:
    """A bare parameter that is a token or a position table (``cls_token``, ``pos_embed``, ...): by its name
    (`is_table_name`), or one token's row with singleton leading dimensions (``1 x 1 x d``: a stack of several
    vectors, ``E x d x 1``, is not a table)."""
    token = param.ndim > 2 and 1 in param.shape[-2:] and all(size == 1 for size in param.shape[:-2])
    return is_table_name(param_name) or token


def is_table_name(param_name: str) -> bool:
    """A bare parameter's name that says it is a token or a position table (``cls_token``, ``pos_embed``)."""
    return _TABLE_NAME.search(param_name) is not None


def in_repeated_block(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether module ``name`` sits inside one of a stack of same-class blocks (``h.3.mlp.c_fc``).

    A stack is a ``ModuleList`` or ``Sequential`` holding several children of
    one (non-container) class: transformer blocks, residual stages.
    """
    parts = name.split(".")
    for depth in range(1, len(parts)):
        block = modules[".".join(parts[:depth])]
        parent = modules[".".join(parts[: depth - 1])]
        stacked = isinstance(parent, _CONTAINERS) and not isinstance(block, _CONTAINERS)
        if stacked and sum(type(sibling) is type(block) for sibling in parent.children()) > 1:
            return True
    return False


def _in_attention(name: str, modules: dict[str, nn.Module]) -> bool:
    parts = name.split(".")
    ancestors = [".".join(parts[:depth]) for depth in range(1, len(parts))]
    return any(
        isinstance(modules[a], nn.MultiheadAttention) or _ATTENTION_NAME.search(a.rsplit(".", 1)[-1]) for a in ancestors
    ) or bool(_ATTENTION_NAME.search(parts[-1]))


def _name_of(target: nn.Module, modules: dict[str, nn.Module]) -> str | None:
    return next((name for name, m in modules.items() if m is target and name), None)


def _conventional_heads(module: nn.Module, modules: dict[str, nn.Module]) -> dict[str, Rule]:
    """Heads the model names itself (``get_output_embeddings``, ``get_classifier``: `Rule.CONVENTION`) or by a
    head's name (`Rule.NAME`), with the rule that found each first."""
    heads: dict[str, Rule] = {}
    for getter in ("get_output_embeddings", "get_classifier"):
        try:
            found = getattr(module, getter)() if callable(getattr(module, getter, None)) else None
        except (NotImplementedError, AttributeError, TypeError):
            found = None
        name = _name_of(found, modules) if isinstance(found, nn.Module) else None
        if name is not None:
            heads.setdefault(name, Rule.CONVENTION)
    for name, m in modules.items():
        if not name or name.rsplit(".", 1)[-1] not in HEAD_NAMES or in_repeated_block(name, modules):
            continue
        if isinstance(m, nn.Linear):
            heads.setdefault(name, Rule.NAME)
        elif name.rsplit(".", 1)[-1] in HEAD_CONTAINER_NAMES and not isinstance(m, EMBEDDINGS) and not is_norm(m):
            inner = [f"{name}.{n}" for n, c in m.named_modules() if n and isinstance(c, nn.Linear)]
            inner = [n for n in inner if not _in_attention(n, modules)]
            if inner:
                heads.setdefault(inner[-1], Rule.NAME)
    return {h: rule for h, rule in heads.items() if not _in_attention(h, modules)}


def token_vocabulary(modules: dict[str, nn.Module]) -> int | None:
    """Rows of the token embedding: the largest embedding table that is not a position or type table."""
    sizes = [
        m.num_embeddings
        for name, m in modules.items()
        if isinstance(m, EMBEDDINGS) and not re.search(r"pos|type|segment", name.rsplit(".", 1)[-1])
    ]
    return max(sizes, default=None)


def find_output_heads(module: nn.Module) -> list[str]:
    """The names of the modules that produce the network's outputs (several for multi-task models).

    In order: what the model says itself (transformers' ``get_output_embeddings()``, timm's
    ``get_classifier()``) and modules with a head's name (`HEAD_NAMES`, outside repeated blocks); if
    none, the structural rule: the last ``nn.Linear`` (registration order) outside stacks of repeated
    blocks, preferring one with as many outputs as the token embedding has rows. A Linear inside an
    attention block is never a head.
    """
    return list(output_heads(module))


def output_heads(module: nn.Module) -> dict[str, Rule]:
    """`find_output_heads`, each with the rule that found it: `Rule.CONVENTION`, `Rule.NAME` or
    `Rule.STRUCTURE`."""
    modules = dict(module.named_modules())
    heads = _conventional_heads(module, modules)
    if heads:
        return heads
    linears = [
        name
        for name, m in modules.items()
        if name and isinstance(m, nn.Linear) and not in_repeated_block(name, modules)
    ]
    linears = [name for name in linears if not _in_attention(name, modules)]
    vocabulary = token_vocabulary(modules)
    lm_heads = [name for name in linears if vocabulary is not None and modules[name].out_features == vocabulary]
    candidates = lm_heads or linears
    return dict.fromkeys(candidates[-1:], Rule.STRUCTURE)


def find_input_layer(module: nn.Module) -> str | None:
    """The first convolution (registration order) when it reads the raw input: ``in_channels`` of at most
    `MAX_INPUT_CHANNELS` (a ResNet stem, a ViT patch embedding). ``None`` for models without one."""
    first = next(((name, m) for name, m in module.named_modules() if name and is_conv(m)), None)
    if first is None or first[1].in_channels > MAX_INPUT_CHANNELS:
        return None
    return first[0]
