"""Two gloo ranks measuring different batches clip by the same factors: the maxima are all-reduced, so both
replicas end bit-identical, equal to one process clipping with the larger of the two ranks' maxima; and the
same through a 2-process DDP Trainer fit with `QKClip`."""

from __future__ import annotations

import os

import lightning as L
import pytest
import qk_models
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import MuonMixin, QKClip
from lightning_muon.attention import QKClipper, qk_clip_

from helpers import RANKS_START_METHOD, EndProcessGroup, ForkedDDP, SaveEveryRank

TAU = 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return qk_models.OwnLM(layers=1)


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(qk_models.VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + rank))


def _rank(rank: int, world: int, port: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model()
        with QKClipper(model, tau=TAU) as clipper:
            with clipper.recording():
                model(_batch(rank))
            clipper.clip()
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_agree_on_the_factors(tmp_path):
    mp.start_processes(
        _rank, args=(2, os.environ["MASTER_PORT"], str(tmp_path)), nprocs=2, join=True, start_method=RANKS_START_METHOD
    )
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    model = _model()
    maxima = []
    for rank in range(2):
        with QKClipper(model, tau=None) as meter, meter.recording():
            model(_batch(rank))
            maxima.append(meter.max_logits()["blocks.0"].clone())
    assert not torch.equal(maxima[0], maxima[1])  # the ranks saw different logits
    assert (torch.maximum(*maxima) > TAU).any()
    qk_clip_(model.blocks[0].qk_layout(), torch.maximum(*maxima), TAU)
    for name, value in model.state_dict().items():
        assert torch.equal(states[0][name], states[1][name]), name
        assert torch.equal(states[0][name], value), name


class _OwnTinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = qk_models.OwnLM(layers=1)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def train_dataloader(self):
        ids = torch.randint(qk_models.VOCAB, (16, 9), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=4)  # Lightning's DistributedSampler: other batches per rank


class _MuonOwnTinyLM(MuonMixin, _OwnTinyLM):
    pass


@pytest.mark.slow
@pytest.mark.distributed
def test_qk_clip_under_ddp_keeps_the_replicas_identical(tmp_path):
    """Gradients are all-reduced, so only the clip could split the replicas: with every head clipped at every
    update from each rank's own batch, the ranks end bit-identical (the maxima are all-reduced)."""
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=ForkedDDP(),
        callbacks=[QKClip(tau=1e-3), SaveEveryRank(tmp_path), EndProcessGroup()],
    )
    trainer.fit(_MuonOwnTinyLM())
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert rank0["world"] == 2
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
