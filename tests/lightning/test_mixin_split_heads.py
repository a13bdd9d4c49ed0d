"""``split_heads`` through `MuonMixin` and the command: a real fit splits the attention projections per head (the
same weights, bit for bit, as the same blocks given by hand with ``matrix_blocks``, and not the fused fit's), the
setting survives a checkpoint, a bad value is refused at construction, and ``--model.split_heads true`` reaches the
shipped GPT's routing and fits."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from lightning_muon import MuonMixin
from lightning_muon.commands.cli import main
from lightning_muon.commands.config_files import SHIPPED
from lightning_muon.commands.lightning_cli import MuonCLI

from helpers import TokenLM, make_trainer, raw_optimizers

transformers = pytest.importorskip("transformers")

ATTENTION = "model.model.layers.0.self_attn"
#: The blocks of a Llama of 4 query heads and 2 key-value heads of 8, by hand.
HEADS = {f"{ATTENTION}.q_proj.weight": [8] * 4, f"{ATTENTION}.k_proj.weight": [8] * 2,
         f"{ATTENTION}.v_proj.weight": [8] * 2}


class TinyLlama(TokenLM):
    """transformers' Llama (width 32, 1 layer, grouped-query attention: 4 query heads, 2 key-value heads)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
        with torch.random.fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            self.model = transformers.LlamaForCausalLM(config)


class MuonTinyLlama(MuonMixin, TinyLlama):
    pass


def fitted(tmp_path, **arguments):
    model = MuonTinyLlama(**arguments)
    trainer = make_trainer(tmp_path, max_steps=3)
    trainer.fit(model)
    return model, trainer


def blocks_held(model: L.LightningModule) -> dict[str, list[int]]:
    (muon, *_) = raw_optimizers(model)
    return {n: b for g in muon.param_groups
            for n, b in zip(g["param_names"], g.get("matrix_blocks", [None] * len(g["params"])), strict=True) if b}


def test_a_fit_splits_per_head_as_the_same_blocks_by_hand(tmp_path):
    model, trainer = fitted(tmp_path / "heads", split_heads=True)
    assert blocks_held(model) == HEADS
    by_hand, _ = fitted(tmp_path / "by_hand", matrix_blocks=HEADS)
    fused, _ = fitted(tmp_path / "fused")
    q = f"{ATTENTION}.q_proj.weight"
    assert torch.equal(model.get_parameter(q), by_hand.get_parameter(q))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), by_hand.parameters(), strict=True))
    assert not torch.equal(model.get_parameter(q), fused.get_parameter(q))  # the split changed the step
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    loaded = MuonTinyLlama.load_from_checkpoint(path, weights_only=True)
    assert loaded.hparams["split_heads"] is True
    routes = {r.name: r.blocks for r in loaded.muon_routing().routes if r.blocks}
    assert routes == {n: tuple(b) for n, b in HEADS.items()}


def test_a_bad_value_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"split_heads must be True or False, got 'yes'"):
        MuonTinyLlama(split_heads="yes")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_command_takes_it(tmp_path, monkeypatch, capsys):
    """``--model.split_heads true`` on the shipped GPT: its fused ``qkv`` (4 heads of 32) split by projection, then
    per head, in the routing ``inspect`` prints and in a fit."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_MUON_TEST_TMP", str(tmp_path))
    args = ["--config", str(SHIPPED / "gpt_muon.yaml"), "--model.split_heads", "true", "--trainer.logger=false"]
    cli = MuonCLI(args=args, run=False)
    routes = {r.name: r for r in cli.model.muon_routing().routes}
    assert routes["blocks.0.attn.qkv.weight"].blocks == (32,) * 12
    assert routes["blocks.0.attn.proj.weight"].blocks is None  # the output projection: heads are its columns
    main(["fit", "--config", "gpt_muon.yaml", "--model.split_heads", "true", "--trainer.fast_dev_run", "2",
          "--trainer.enable_progress_bar", "false"])
    assert "val_bpb" in capsys.readouterr().out
