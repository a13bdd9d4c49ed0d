"""Run by tests/test_distributed.py in a subprocess: Lightning's ModelParallelStrategy re-launches this
script for rank 1. Trains the test network fully sharded (FSDP2) on 2 CPU processes and saves every
rank's gathered parameters to the directory given as the first argument."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed import MuonNet, SaveEveryRank, muon_factory  # noqa: E402


class ShardedNet(MuonNet):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in [*self.net, self.sometimes]:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


if __name__ == "__main__":
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    L.seed_everything(0)
    model = ShardedNet(batch_size=4, muon=muon_factory(), muon_params=["sometimes.weight"], adamw_params=["net.8.*"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveEveryRank(out)],
    )
    trainer.fit(model)
