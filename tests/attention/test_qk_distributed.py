"""Two gloo ranks measuring different batches clip by the same factors: the maxima are all-reduced, so both
replicas end bit-identical, equal to one process clipping with the larger of the two ranks' maxima."""

from __future__ import annotations

import os

import pytest
import qk_models
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_muon.attention import QKClipper, qk_clip_

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
    mp.spawn(_rank, args=(2, os.environ["MASTER_PORT"], str(tmp_path)), nprocs=2, join=True)
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
