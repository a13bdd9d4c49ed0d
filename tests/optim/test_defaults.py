"""One table of defaults (`lightning_muon.optim.defaults`): `Muon` keeps ``torch.optim.Muon``'s, and both ways in
(`MuonMixin`'s default factories, `MuonWithAdamW`'s signature) start the pair from the same settings."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from lightning_muon import Muon, MuonWithAdamW
from lightning_muon.lightning._config import DEFAULT_ADAMW, DEFAULT_MUON
from lightning_muon.optim.defaults import MUON_CLASS, PAIRED_ADAMW, PAIRED_MUON


def defaults_of(cls: type) -> dict:
    return {n: p.default for n, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}


def test_muon_keeps_torch_muons_defaults():
    ours, torch_muon = defaults_of(Muon), defaults_of(torch.optim.Muon)
    assert {k: ours[k] for k in torch_muon} == torch_muon
    assert {k: ours[k] for k in dataclasses.asdict(MUON_CLASS)} == dataclasses.asdict(MUON_CLASS)


def test_both_ways_in_start_the_pair_alike():
    combined = defaults_of(MuonWithAdamW)
    assert {k: combined[k] for k in dataclasses.asdict(PAIRED_MUON)} == dataclasses.asdict(PAIRED_MUON)
    assert {k: combined[f"adamw_{k}"] for k in dataclasses.asdict(PAIRED_ADAMW)} == dataclasses.asdict(PAIRED_ADAMW)
    assert DEFAULT_MUON["init_args"] == {k: combined[k] for k in ("lr", "momentum", "weight_decay")}
    adamw = DEFAULT_ADAMW["init_args"]
    assert (adamw["lr"], tuple(adamw["betas"]), adamw["weight_decay"]) == (
        combined["adamw_lr"], combined["adamw_betas"], combined["adamw_weight_decay"])
