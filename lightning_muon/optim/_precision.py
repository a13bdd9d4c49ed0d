"""The Newton-Schulz dtype of a Muon param group that leaves it to the hardware (``ns_dtype=None``, the default):
bfloat16 where the device computes bf16 matmuls natively, float32 where they would be emulated.

Decided once per process and device, from what the device says it can do, not from a timing:

- CUDA: bf16 from compute capability 8.0 on (Ampere and later; ROCm: ``torch.cuda.is_bf16_supported``), float32
  before (a V100 emulates bf16);
- CPU: bf16 where the CPU has AVX512-BF16 or AMX (torch's own queries, ``torch.cpu._is_avx512_bf16_supported`` and
  ``_is_amx_tile_supported``), float32 everywhere else: AVX2 and plain AVX512 CPUs convert every bf16 operand to
  float32 and back (a Muon step of GPT-2-small's matrices took 24x longer in bf16 than in float32 on an AVX2 CPU),
  and CPUs this module does not know (ARM among them) get float32, which is right at worst 2x slower, where an
  emulated bf16 is an order of magnitude slower;
- any other accelerator: bf16, ``torch.optim.Muon``'s choice.

A capability rather than a measurement because it is the same answer on every run and every machine of a kind (a
timing on a shared, busy machine can flip), costs nothing, and says why in words. The ranks of a distributed run
must use one dtype (their updates and the bytes they exchange depend on it): `settle` all-reduces "every rank is
native" once, so one rank without native bf16 makes every rank use float32.

An explicit ``ns_dtype`` always wins; `assume` injects the capability's answer (tests: both answers on any machine).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_muon.optim.norms import any_rank

_log = logging.getLogger("lightning_muon")

#: Whether a device computes bf16 matmuls natively, and why (in words): the capability reader (`native_bf16`),
#: replaced by `assume`.
Capability = Callable[[torch.device], tuple[bool, str]]


@dataclass(frozen=True)
class Precision:
    """The Newton-Schulz dtype chosen for one device (in this process, agreed across ranks where `ranks` > 1)."""

    #: ``torch.bfloat16`` or ``torch.float32``.
    dtype: torch.dtype
    #: The device it was chosen for (``"cpu"``, ``"cuda:0"``).
    device: str
    #: Why, in words ("this CPU has AVX512-BF16").
    reason: str
    #: How many ranks agreed on it (1: this process alone).
    ranks: int = 1

    def line(self) -> str:
        """What is logged and shown at fit start."""
        name = dtype_name(self.dtype)
        return f"Muon: Newton-Schulz in {name} on {self.device}: {self.reason} (pass ns_dtype to choose)."


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how param groups keep ``ns_dtype`` (distributed checkpoints
    cannot save a ``torch.dtype``)."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def dtype_named(name: str) -> torch.dtype | None:
    """``"bfloat16"`` or ``"torch.bfloat16"`` (as param groups, YAML and saved hyperparameters spell it) ->
    ``torch.bfloat16``; ``None`` where torch has no dtype of that name. The inverse of `dtype_name`."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bf16 matmuls natively, and why (see the module's docstring)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.version.hip:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
            return native, f"{name} {'computes' if native else 'emulates'} bf16"
        capability = torch.cuda.get_device_capability(device)
        native = capability >= (8, 0)
        return native, f"{name} (compute capability {'.'.join(map(str, capability))}) " + (
            "computes bf16 natively" if native else "emulates bf16 (native from 8.0 on)")
    if device.type == "cpu":
        for feature, query in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported")):
            if getattr(torch.cpu, query, lambda: False)():
                return True, f"this CPU has {feature}"
        return False, (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has neither AVX512-BF16 nor AMX: "
                       "bf16 matmuls would be emulated")
    return True, f"{device.type} takes torch.optim.Muon's bf16"


#: The capability reader in use (`native_bf16` unless `assume` replaced it).
_capability: Capability = native_bf16
#: The choice per device, once made (`decide`, `settle`).
_chosen: dict[str, Precision] = {}


def _key(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def decide(device: torch.device, *, log: bool = True) -> Precision:
    """The dtype for ``device`` in this process: chosen at the first call (said once at INFO on the
    ``lightning_muon`` logger, on rank zero, unless not ``log``), the same object after."""
    key = _key(device)
    if key not in _chosen:
        native, reason = _capability(device)
        _chosen[key] = _record(Precision(torch.bfloat16 if native else torch.float32, key, reason), log)
    return _chosen[key]


def settle(param_groups: Sequence[dict[str, Any]], process_group: dist.ProcessGroup | None = None,
           *, log: bool = True) -> Precision | None:
    """The dtype of the groups that leave it to the hardware (``None`` where every group names its own, or there is no
    parameter yet): `decide`'s for the first parameter's device, agreed over ``process_group`` (default: the default
    group) the first time it is asked with several ranks, by one all-reduce that every rank must take part in (as
    every rank takes part in a Muon step)."""
    device = next((p.device for group in param_groups for p in group["params"]), None)
    if device is None or all(group.get("ns_dtype", "") is not None for group in param_groups):
        return None
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
    chosen = decide(device, log=log and not several)
    if not several or chosen.ranks > 1:
        return chosen
    native, reason = chosen.dtype == torch.bfloat16, chosen.reason
    all_native = not any_rank([not native], device, process_group)[0]
    if native and not all_native:
        reason = f"{reason}, but another rank emulates bf16 and the ranks must agree"
    ranks = dist.get_world_size(process_group)
    agreed = Precision(torch.bfloat16 if all_native else torch.float32, chosen.device, reason, ranks)
    _chosen[chosen.device] = _record(agreed, log)
    return agreed


def _record(precision: Precision, log: bool) -> Precision:
    if log and not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        _log.info(precision.line())
    return precision


def ns_dtype_for(device: torch.device) -> torch.dtype:
    """The dtype a group that leaves it to the hardware computes in on ``device`` (`decide`)."""
    return decide(device).dtype


@contextlib.contextmanager
def assume(native: bool | None) -> Iterator[None]:
    """Within the block, every device computes bf16 natively (``True``) or emulates it (``False``; ``None``: ask the
    device), with nothing chosen yet; the choices made before come back after it."""
    global _capability
    before, saved = _capability, dict(_chosen)
    if native is not None:
        _capability = lambda device: (native, f"assumed {'native' if native else 'emulated'} bf16")  # noqa: E731
    _chosen.clear()
    try:
        yield
    finally:
        _capability = before
        _chosen.clear()
        _chosen.update(saved)
