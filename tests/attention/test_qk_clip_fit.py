"""`QKClip` in real fits, naming no weight: transformers Llama (GQA) and litgpt under `MuonMixin`, GPT-2 and
``nn.MultiheadAttention`` under automatic optimization with AdamW (one with accumulation); the CSV has exactly
the documented keys, heads are clipped, and the captures are gone after the fit."""

from __future__ import annotations

import functools
import math

import lightning as L
import pytest
import qk_models
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import Muon, MuonMixin, QKClip
from lightning_muon.attention import QKClipper, find_attention

from helpers import make_trainer, read_metrics

BUILD = {"llama": lambda: qk_models.llama("sdpa"), "gpt2": qk_models.gpt2, "litgpt": qk_models.litgpt,
         "mha": qk_models.MHALM}
LAYERS = {
    "llama": ["model.model.layers.0.self_attn", "model.model.layers.1.self_attn"],
    "gpt2": ["model.transformer.h.0.attn", "model.transformer.h.1.attn"],
    "litgpt": ["model.transformer.h.0.attn", "model.transformer.h.1.attn"],
    "mha": ["model.blocks.0.self_attn", "model.blocks.1.self_attn"],
}


class TinyLM(L.LightningModule):
    def __init__(self, family: str = "llama") -> None:
        super().__init__()
        self.model = BUILD[family]()

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = qk_models.logits_of(self.model, ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class MuonTinyLM(MuonMixin, TinyLM):
    pass


def _data(batches: int) -> DataLoader:
    ids = torch.randint(qk_models.VOCAB, (4 * batches, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids), batch_size=4)


@pytest.mark.parametrize(("family", "muon", "accumulate"),
                         [("llama", True, 1), ("litgpt", True, 1), ("gpt2", False, 1), ("mha", False, 2)])
def test_qk_clip_fit_logs_exact_keys_and_clips(tmp_path, family, muon, accumulate):
    torch.manual_seed(0)
    model = MuonTinyLM(family=family) if muon else TinyLM(family)
    callback = QKClip(tau=1e-3)  # under every random-init logit: every head is clipped at every update
    trainer = make_trainer(tmp_path, csv_dir=tmp_path / "csv", max_steps=3, callbacks=[callback],
                           accumulate_grad_batches=accumulate)
    trainer.fit(model, train_dataloaders=_data(3 * accumulate))

    rows = [r for r in read_metrics(tmp_path / "csv") if r.get("attention/max_logit")]
    layer_keys = [f"attention/max_logit/{name}" for name in LAYERS[family]]
    expected = {"attention/max_logit", *layer_keys, "attention/clipped_heads"}
    keys = {k for r in read_metrics(tmp_path / "csv") for k, v in r.items() if v != ""}
    assert keys - {"step", "epoch", "train_loss"} - {k for k in keys if k.startswith(("lr-", "muon/"))} == expected
    assert [int(r["step"]) for r in rows] == [0, 1, 2]  # one row per update, at the update's logger step
    heads = sum(s.layout.num_heads for s in _sites(model))
    assert float(rows[0]["attention/clipped_heads"]) == heads  # random init: every head over 1e-3
    for r in rows:
        assert float(r["attention/clipped_heads"]) > 0
        assert float(r["attention/max_logit"]) == max(float(r[k]) for k in layer_keys) > 1e-3
        assert all(math.isfinite(float(r[k])) for k in expected)
    assert callback.clipper is None  # removed at the fit's end: the model runs uncaptured
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "get_interface" not in vars(ALL_ATTENTION_FUNCTIONS)


def _sites(model):
    return find_attention(model)


def test_the_clip_after_each_muon_update_keeps_growing_logits_down(tmp_path):
    """A Muon lr large enough to grow the logits: after 6 updates the unclipped model's max logit is over twice
    tau, the clipped one's (clipped after every update, then one more update) well under the unclipped one's."""

    def run(tau):
        torch.manual_seed(0)
        model = MuonTinyLM(family="llama", muon=functools.partial(Muon, lr=0.5))
        trainer = make_trainer(tmp_path, max_steps=6, callbacks=[QKClip(tau=tau)])
        trainer.fit(model, train_dataloaders=_data(6))
        ids = torch.randint(qk_models.VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), QKClipper(model, tau=None) as meter, meter.recording():
            qk_models.logits_of(model.model, ids)
            return max(float(t.max()) for t in meter.max_logits().values())

    unclipped, clipped = run(None), run(2.0)
    assert unclipped > 4.0 and clipped < unclipped / 2, (unclipped, clipped)


REFUSALS = [
    ({"tau": 0.0}, "tau must be a finite number > 0 or None"),
    ({"tau": float("nan")}, "tau must be a finite number > 0 or None"),
    ({"exclude": "layers.*"}, "exclude must be a list of name patterns"),
    ({"log_every_n_steps": 0}, "log_every_n_steps must be None or an int >= 1"),
]


@pytest.mark.parametrize(("kwargs", "message"), REFUSALS)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        QKClip(**kwargs)


class NotAttention(TinyLM):  # its name says attention; it holds none (not refused as one)
    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model = torch.nn.Sequential(torch.nn.Embedding(qk_models.VOCAB, 8), torch.nn.Linear(8, qk_models.VOCAB))


def test_a_model_without_attention_is_refused_at_fit_start(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1, callbacks=[QKClip()])
    with pytest.raises(MisconfigurationException, match="QKClip: found no attention module in NotAttention"):
        trainer.fit(NotAttention(), train_dataloaders=_data(1))


@pytest.mark.parametrize(("strategy", "warned"), [("ddp", False), ("ddp_subclass", True)])
def test_several_processes_under_a_strategy_other_than_ddp_itself_are_warned_about(strategy, warned):
    """DDP and ModelParallelStrategy (of either Lightning package) are the multi-process strategies QKClip is
    tested under; their subclasses (DeepSpeed's) are not."""
    import warnings
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    class Subclass(DDPStrategy):
        pass

    chosen = DDPStrategy() if strategy == "ddp" else Subclass()
    trainer = SimpleNamespace(world_size=2, strategy=chosen, log_every_n_steps=1, global_step=0)
    callback, module = QKClip(tau=100.0), TinyLM("mha")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.on_fit_start(trainer, module)
    callback.teardown(trainer, module, "fit")
    told = [str(w.message) for w in caught if "QKClip runs under" in str(w.message)]
    assert told == (["QKClip runs under Subclass: it is tested on one process, under DDP and under "
                     "ModelParallelStrategy (FSDP2, tensor parallelism, both)."] if warned else [])
