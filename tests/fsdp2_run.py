"""Run by tests/test_distributed.py on 2 ranks (`helpers.run_ranks`), or as a script (``python tests/fsdp2_run.py
OUT``: Lightning's ModelParallelStrategy re-launches it for rank 1). Trains the test network fully sharded (FSDP2)
on 2 CPU processes and saves every rank's gathered parameters to ``out``, and how many gradient reduce-scatters
FSDP2 ran; optionally accumulates gradients, resumes from, or saves, a distributed checkpoint. With ``--heads`` the
network is the shipped GPT (`HeadsGPT`, ``split_heads=True``) instead, and ``--devices 1`` trains it on one process;
every rank saves the blocks its Muon's param groups hold, rank zero the lines (the routing table) the fit said.

``helpers`` imports without a ``sys.path`` edit: running a script puts its own directory first on ``sys.path``,
and the tests' directory is on it under pytest."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_muon import MuonMixin
from lightning_muon.examples.char_gpt import GPT

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


class HeadsGPT(MuonMixin, GPT):
    """The shipped GPT (`lightning_muon.examples.char_gpt.CharGPT`'s model, FSDP2 by its own ``configure_model``:
    each block, then the whole) at a tiny size, with ``split_heads=True``: each block's fused ``qkv`` (3 x 24 rows)
    split by projection, then into its 3 heads of 8 rows; the 2 ranks' shards of 36 rows meet inside a head (the
    second key head, rows 32-39).
    Built from seed 0 whatever the global seed; on 32 windows of random bytes, read in order, each of 2 ranks every
    other one (`sine_regression_loader`'s sharding): 2 ranks x ``batch_size`` see one process's batch of twice
    that."""

    def __init__(self, batch_size: int = 4, **settings) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            super().__init__(n_layer=2, n_head=3, n_embd=24, block_size=16, split_heads=True, **settings)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        data = torch.randint(0, 256, (32, 17), generator=torch.Generator().manual_seed(0))
        windows = TensorDataset(data[:, :-1], data[:, 1:])
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(windows, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
        return DataLoader(windows, batch_size=self.batch_size, sampler=sampler)


class KeepLines(logging.Handler):
    """The INFO lines lightning_muon's fit says on rank zero (`rank_zero_info`: the routing table among them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


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
    parser.add_argument("--heads", action="store_true", help="the shipped GPT with split_heads (`HeadsGPT`)")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    syncs = count_reduce_scatters()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    # `sometimes` is a Muon matrix that never gets a gradient here: torch.distributed.checkpoint restores a state for
    # every parameter, and Muon gives it a (zero) momentum buffer for that. `net.0` reads the batch (an input layer,
    # AdamW's), unless --first-layer-on-muon keeps it on Muon for the work split's four shapes.
    muon = muon_factory(**({"normuon_beta2": 0.95} if args.normuon else {}))
    if args.heads:
        model: MuonMixin = HeadsGPT(batch_size=args.batch_size, muon=muon, accumulate_grad_batches=args.accumulate)
    else:
        model = ShardedNet(
            batch_size=args.batch_size,
            muon=muon,
            muon_params=["sometimes.weight", *(["net.0.weight"] if args.first_layer_on_muon else [])],
            adamw_params=["net.8.*"],
            accumulate_grad_batches=args.accumulate,
            matrix_blocks=BLOCKS if args.blocks else None,
        )
    callbacks = [SaveEveryRank(args.out), EndProcessGroup()] + ([epoch_checkpoints(args.save)] if args.save else [])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if args.devices > 1 else "auto",
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=args.save is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    said, log = KeepLines(), logging.getLogger("lightning.pytorch.utilities.rank_zero")  # `rank_zero_info`'s
    log.addHandler(said)
    try:
        trainer.fit(model, ckpt_path=args.ckpt)
    finally:
        log.removeHandler(said)
    torch.save(syncs[0], args.out / f"syncs{trainer.global_rank}.pt")
    blocks = {n: b for g in trainer.optimizers[0].param_groups
              for n, b in zip(g["param_names"], g.get("matrix_blocks") or [None] * len(g["params"])) if b}
    torch.save(blocks, args.out / f"blocks{trainer.global_rank}.pt")
    if trainer.global_rank == 0:
        (args.out / "said.txt").write_text("\n".join(said.lines))


if __name__ == "__main__":
    main()
