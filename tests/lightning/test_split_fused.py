"""Fused projections split into their blocks through `MuonMixin` (``split_fused``, ``matrix_blocks``): the Muon
group holds each parameter's blocks, the settings survive a checkpoint, a bad value is refused at construction."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_muon import MuonMixin

from helpers import TokenLM, make_trainer, raw_optimizers

transformers = pytest.importorskip("transformers")


class TinyGPT2(TokenLM):
    """transformers' GPT-2 (width 32, 2 layers: ``c_attn`` is a fused q, k, v ``Conv1D`` stored 32 x 96)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.model = transformers.GPT2LMHeadModel(config)


class MuonTinyGPT2(MuonMixin, TinyGPT2):
    pass


def blocks_held(model: L.LightningModule) -> dict[str, list[int] | None]:
    (muon, *_) = raw_optimizers(model)
    return {n: b for g in muon.param_groups
            for n, b in zip(g["param_names"], g.get("matrix_blocks", [None] * len(g["params"])), strict=True)}


@pytest.mark.parametrize(
    ("arguments", "attn_blocks"),
    [
        pytest.param({}, [32, 32, 32], id="default-split"),
        pytest.param({"split_fused": False}, None, id="fused"),
        pytest.param({"split_fused": True}, [32, 32, 32], id="split_fused"),
        pytest.param({"split_fused": True, "matrix_blocks": {"model.transformer.h.0.attn.c_attn.weight": None}},
                     [32, 32, 32], id="one-kept-whole"),
    ],
)
def test_the_mixin_passes_the_block_layout_to_muon_and_keeps_it_in_checkpoints(tmp_path, arguments, attn_blocks):
    model = MuonTinyGPT2(**arguments)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(model)
    held = blocks_held(model)
    assert held.get("model.transformer.h.1.attn.c_attn.weight") == attn_blocks
    kept_whole = "matrix_blocks" in arguments
    assert held.get("model.transformer.h.0.attn.c_attn.weight") == (None if kept_whole else attn_blocks)
    assert all(b is None for n, b in held.items() if "c_attn" not in n)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    loaded = MuonTinyGPT2.load_from_checkpoint(path, weights_only=True)
    assert loaded.muon_routing().groups("Muon")[0].get("matrix_blocks") == model.muon_routing().groups("Muon")[0].get(
        "matrix_blocks")


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        pytest.param({"split_fused": "yes"},
                     r"split_fused must be True, False or None \(the default: equal q, k, v blocks split\), got 'yes'",
                     id="split_fused"),
        pytest.param({"matrix_blocks": [32, 32, 32]}, r"matrix_blocks must map glob patterns", id="not-a-mapping"),
    ],
)
def test_bad_block_settings_are_refused_at_construction(arguments, error):
    with pytest.raises(ValueError, match=error):
        MuonTinyGPT2(**arguments)


def test_a_checkpoint_saved_fused_resumes_split_by_default_and_says_so(tmp_path):
    """0.1 routed fused q, k, v whole; its checkpoints resume under today's default split, with one warning naming
    each parameter whose blocks changed, and then step as a fit that was split from the start would (the momentum
    buffer is the whole parameter's either way); ``split_fused=False`` resumes as saved, silently."""
    import warnings

    old = MuonTinyGPT2(split_fused=False)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(old)
    path = tmp_path / "fused.ckpt"
    trainer.save_checkpoint(path)
    resumed, reference = MuonTinyGPT2(), MuonTinyGPT2(split_fused=False)
    torch.manual_seed(0)  # the same dropout in both resumed fits
    with pytest.warns(UserWarning, match="saved with another matrix structure") as caught:
        make_trainer(tmp_path, max_steps=3).fit(resumed, ckpt_path=path)
    (said,) = [str(w.message) for w in caught if "matrix structure" in str(w.message)]
    for layer in (0, 1):
        assert f"model.transformer.h.{layer}.attn.c_attn.weight (blocks None -> [32, 32, 32])" in said
    assert blocks_held(resumed)["model.transformer.h.0.attn.c_attn.weight"] == [32, 32, 32]
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        make_trainer(tmp_path, max_steps=3).fit(reference, ckpt_path=path)
    assert not [w for w in quiet if "matrix structure" in str(w.message)]
    assert blocks_held(reference)["model.transformer.h.0.attn.c_attn.weight"] is None
    # the third update differs only where the blocks do: c_attn's weights
    changed = {n for n, p in resumed.named_parameters() if not torch.equal(p, reference.get_parameter(n))}
    assert changed == {f"model.transformer.h.{layer}.attn.c_attn.weight" for layer in (0, 1)}
