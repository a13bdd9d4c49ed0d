"""The Newton-Schulz dtype by hardware (``lightning_muon.optim._precision``): with no ``ns_dtype``, bf16 where the
device computes it natively and float32 where it would be emulated, both answers injected on any machine; an explicit
setting wins; decided and said once; a `MuonMixin` fit says it beside the routing table; DDP ranks agree."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_muon import Muon
from lightning_muon.optim import _precision, _update, groups

from helpers import EndProcessGroup, ForkedDDP, MuonRegression, make_trainer

SHAPES = [(24, 16), (16, 16), (16, 48)]
LOGGER = "lightning_muon"
FIT_LOGGER = "lightning.pytorch.utilities.rank_zero"


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def _train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


class NSDtypes:
    """The dtype every Newton-Schulz call of the optimizer computed in (a spy on the kernel ``_update`` calls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dtypes: list[torch.dtype] = []
        real = _update.zeropower_via_newtonschulz

        def spy(G: torch.Tensor, **kwargs):
            self.dtypes.append(kwargs["dtype"])
            return real(G, **kwargs)

        monkeypatch.setattr(_update, "zeropower_via_newtonschulz", spy)


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_no_setting_steps_exactly_as_the_hardwares_dtype_set_by_hand(native, expected, monkeypatch):
    spy = NSDtypes(monkeypatch)
    with _precision.assume(native):
        by_hardware, by_hand = _params(), _params()
        optimizer = Muon(by_hardware, lr=0.02, ns_gram_aspect=None)
        assert optimizer.param_groups[0]["ns_dtype"] is None  # kept as "by hardware", not resolved into the group
        _train(optimizer, by_hardware)
        assert spy.dtypes and set(spy.dtypes) == {expected}
        assert groups.ns_dtype(optimizer.param_groups[0]) == expected
        _train(Muon(by_hand, lr=0.02, ns_gram_aspect=None, ns_dtype=expected), by_hand)
    assert all(torch.equal(a, b) for a, b in zip(by_hardware, by_hand, strict=True))
    assert not torch.equal(by_hardware[0], _params()[0])  # it moved


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("explicit", [torch.bfloat16, torch.float32, "float32"])
def test_an_explicit_setting_always_wins(native, explicit, monkeypatch):
    spy = NSDtypes(monkeypatch)
    with _precision.assume(native):
        params = _params()
        _train(Muon(params, lr=0.02, ns_dtype=explicit), params, steps=1)
    assert set(spy.dtypes) == {getattr(torch, explicit) if isinstance(explicit, str) else explicit}


def test_decided_once_per_process_and_device_and_said_once_at_info(caplog):
    with _precision.assume(False), caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(2):  # two optimizers, two steps each
            params = _params()
            _train(Muon(params), params, steps=2)
        first = _precision.decide(torch.device("cpu"))
        assert _precision.decide(torch.device("cpu")) is first
    lines = [r.message for r in caplog.records if "Newton-Schulz in" in r.message]
    assert lines == ["Muon: Newton-Schulz in float32 on cpu: assumed emulated bf16 (pass ns_dtype to choose)."]
    assert [r.levelno for r in caplog.records if "Newton-Schulz in" in r.message] == [logging.INFO]


def test_torch_muons_groups_and_explicit_groups_decide_nothing(caplog):
    with _precision.assume(False), caplog.at_level(logging.INFO, logger=LOGGER):
        torch_groups = torch.optim.Muon(_params()).param_groups
        assert _precision.settle(torch_groups) is None and groups.ns_dtype(torch_groups[0]) == torch.bfloat16
        assert _precision.settle(Muon(_params(), ns_dtype="float32").param_groups) is None
        assert _precision.settle(Muon([{"params": [], "name": "empty"}]).param_groups) is None  # no device yet
    assert not caplog.records


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "native", "reason"),
    [
        (False, False, False, "has neither AVX512-BF16 nor AMX: bf16 matmuls would be emulated"),
        (True, False, True, "this CPU has AVX512-BF16"),
        (False, True, True, "this CPU has AMX"),
    ],
)
def test_the_cpu_is_native_with_avx512_bf16_or_amx(avx512_bf16, amx, native, reason, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    answer, why = _precision.native_bf16(torch.device("cpu"))
    assert answer is native and reason in why


@pytest.mark.parametrize(("capability", "native"), [((7, 0), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_is_native_from_compute_capability_8(capability, native, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    answer, why = _precision.native_bf16(torch.device("cuda", 0))
    assert answer is native and f"compute capability {capability[0]}.0" in why


@pytest.mark.parametrize(("native", "dtype"), [(True, "bfloat16"), (False, "float32")])
def test_a_mixin_fit_says_the_dtype_beside_the_routing_table_once(tmp_path, native, dtype, caplog, monkeypatch):
    spy = NSDtypes(monkeypatch)
    with _precision.assume(native), caplog.at_level(logging.INFO, logger=FIT_LOGGER):
        make_trainer(tmp_path, max_steps=3).fit(MuonRegression())  # the default Muon: no ns_dtype
    messages = [r.message for r in caplog.records]
    said = [i for i, m in enumerate(messages) if "Newton-Schulz in" in m]
    assert [messages[i] for i in said] == [
        f"Muon: Newton-Schulz in {dtype} on cpu: assumed {'native' if native else 'emulated'} bf16 "
        "(pass ns_dtype to choose)."
    ]
    assert "net.2.weight" in messages[said[0] - 1]  # right after the routing table
    assert len(spy.dtypes) == 3 and set(spy.dtypes) == {getattr(torch, dtype)}


class AssumeOnThisRank(L.Callback):
    """Each rank assumes its own answer (``native[rank]``) from ``setup`` (before the optimizers are built) to the
    end of the fit, and writes what its Muon chose to ``rank<r>.pt``."""

    def __init__(self, native: list[bool], directory: Path) -> None:
        self.native, self.directory, self.stack = native, directory, ExitStack()

    def setup(self, trainer, pl_module, stage):
        self.stack.enter_context(_precision.assume(self.native[trainer.global_rank]))

    def on_train_end(self, trainer, pl_module):
        muon = pl_module.optimizers()[0].optimizer
        chosen = _precision.decide(muon.param_groups[0]["params"][0].device)
        record = {"dtype": groups.ns_dtype(muon.param_groups[0]), "ranks": chosen.ranks, "reason": chosen.reason,
                  "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()}}
        torch.save(record, self.directory / f"rank{trainer.global_rank}.pt")
        self.stack.close()


@pytest.mark.distributed
@pytest.mark.parametrize(("native", "expected"), [([True, False], torch.float32), ([True, True], torch.bfloat16)])
def test_ddp_ranks_agree_on_the_dtype(tmp_path, native, expected):
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ForkedDDP(), max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[AssumeOnThisRank(native, tmp_path), EndProcessGroup()],
    )
    trainer.fit(MuonRegression())
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["dtype"] for r in ranks] == [expected, expected]
    assert [r["ranks"] for r in ranks] == [2, 2]
    if expected == torch.float32:  # rank 0 was native, and says why it computes in float32 anyway
        assert "another rank emulates bf16" in ranks[0]["reason"]
    assert all(torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]) for n in ranks[0]["params"])
