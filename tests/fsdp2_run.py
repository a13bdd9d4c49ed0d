"""Run by tests/test_distributed.py in a subprocess: Lightning's ModelParallelStrategy re-launches this
script for rank 1. Trains the test network fully sharded (FSDP2) on 2 CPU processes and saves every
rank's gathered parameters to ``out``; optionally resumes from, or saves, a distributed checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed import MuonNet, SaveCheckpointAtEnd, SaveEveryRank, muon_factory  # noqa: E402


class ShardedNet(MuonNet):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in [*self.net, self.sometimes]:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--save", type=Path, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    if args.save or args.ckpt:
        # torch.distributed.checkpoint restores optimizer state for every parameter it could have;
        # `sometimes` is never used here, so it is frozen rather than left without state.
        model = ShardedNet(batch_size=4, muon=muon_factory(), adamw_params=["net.8.*"])
        model.sometimes.weight.requires_grad_(False)
    else:
        model = ShardedNet(batch_size=4, muon=muon_factory(), muon_params=["sometimes.weight"], adamw_params=["net.8.*"])
    callbacks = [SaveEveryRank(args.out)] + ([SaveCheckpointAtEnd(args.save)] if args.save else [])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=args.ckpt)
