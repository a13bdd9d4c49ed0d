"""Run by tests/test_distributed.py on 2 ranks (`helpers.run_ranks`), or as a script (``python tests/fsdp2_run.py
OUT``: Lightning's ModelParallelStrategy re-launches it for rank 1). Trains the test network fully sharded (FSDP2)
on 2 CPU processes and saves every rank's gathered parameters to ``out``, and how many gradient reduce-scatters
FSDP2 ran; optionally accumulates gradients, resumes from, or saves, a distributed checkpoint.

``helpers`` imports without a ``sys.path`` edit: running a script puts its own directory first on ``sys.path``,
and the tests' directory is on it under pytest."""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from helpers import EndProcessGroup, MuonNet, SaveEveryRank, epoch_checkpoints, muon_factory

#: ``--blocks``: on 2 ranks ``net.4`` (16 rows, 8 a rank) has a block across the shard boundary, ``net.6`` (24 rows)
#: equal blocks (one stack), the middle one across it.
BLOCKS = {"net.4.weight": [6, 10], "net.6.weight": [8, 8, 8]}


class ShardedNet(MuonNet):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in [*self.net, self.sometimes]:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


def count_reduce_scatters() -> list[int]:
    """Count FSDP2's gradient reductions (one per sharded module per synced backward)."""
    calls = [0]
    reduce = _fsdp_param_group.foreach_reduce

    def counted(*args, **kwargs):
        calls[0] += 1
        return reduce(*args, **kwargs)

    _fsdp_param_group.foreach_reduce = counted
    return calls


def main(argv: list[str] | None = None) -> None:
    """Train as the arguments say (the command line's without ``argv``); see the module's docstring."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--save", type=Path, default=None, help="keep every epoch's checkpoint in this directory")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--first-layer-on-muon", action="store_true")
    parser.add_argument("--normuon", action="store_true", help="NorMuon (normuon_beta2=0.95) on the Muon half")
    parser.add_argument("--blocks", action="store_true", help=f"split two matrices into row blocks: {BLOCKS}")
    args = parser.parse_args(argv)
    syncs = count_reduce_scatters()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    # `sometimes` is a Muon matrix that never gets a gradient here: torch.distributed.checkpoint restores a state for
    # every parameter, and Muon gives it a (zero) momentum buffer for that. `net.0` reads the batch (an input layer,
    # AdamW's), unless --first-layer-on-muon keeps it on Muon for the work split's four shapes.
    model = ShardedNet(
        batch_size=args.batch_size,
        muon=muon_factory(**({"normuon_beta2": 0.95} if args.normuon else {})),
        muon_params=["sometimes.weight", *(["net.0.weight"] if args.first_layer_on_muon else [])],
        adamw_params=["net.8.*"],
        accumulate_grad_batches=args.accumulate,
        matrix_blocks=BLOCKS if args.blocks else None,
    )
    callbacks = [SaveEveryRank(args.out), EndProcessGroup()] + ([epoch_checkpoints(args.save)] if args.save else [])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=args.save is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=args.ckpt)
    torch.save(syncs[0], args.out / f"syncs{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
