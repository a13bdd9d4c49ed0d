"""Run by tests/test_tensor_parallel.py on several ranks (`helpers.run_ranks`), or as a script (Lightning's
ModelParallelStrategy re-launches it for the other ranks): the shipped example
`lightning_muon.examples.parallel_gpt.ParallelGPT` (attention + SwiGLU blocks) at a tiny size under `MuonMixin`,
tensor parallel with the plan of Lightning's tensor-parallel tutorial (the attention and feed-forward projections
parallelised, the embedding, norms and head left plain tensors), and with ``--data-parallel 2`` FSDP2 over the other
mesh dimension (Lightning's 2-D example), both by the example's own ``configure_model``; with ``--devices 1`` the
same model in one process. Saves every rank's gathered parameters, first-batch roles, groups and the blocks its
optimizers hold to ``out``; optionally keeps every epoch's checkpoint or resumes from one, monitors, QK-Clips, or
splits the attention projections per head (``--split-heads``).

``helpers`` imports without a ``sys.path`` edit: running a script puts its own directory first on ``sys.path``,
and the tests' directory is on it under pytest."""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_muon import Muon, MuonMixin, MuonMonitor, MuonWithAdamW, QKClip
from lightning_muon.examples.parallel_gpt import ParallelGPT
from lightning_muon.optim._dtensor import is_dtensor

from helpers import EndProcessGroup, epoch_checkpoints, muon_factory

VOCAB, DIM, HEADS, HIDDEN, SEQ = 64, 32, 4, 64, 16
#: ``--blocks``: ``w1`` (64 rows, colwise: row shards) in two unequal blocks across the shard boundaries, ``wo``
#: (rowwise: column shards; and row shards in 2-D) in four equal ones, one a head.
BLOCKS = {"*.w1.weight": [24, 40], "*.wo.weight": [8, 8, 8, 8]}


class TinyLM(ParallelGPT):
    """The shipped example model (its blocks, Lightning's tutorial plan and 2-D FSDP2 in ``configure_model``) at a
    tiny size, on tokens of its own; built from seed 0 whatever the global seed."""

    def __init__(self) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            super().__init__(n_layer=2, n_head=HEADS, n_embd=DIM, hidden=HIDDEN, block_size=SEQ, vocab_size=VOCAB)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1])  # through forward: FSDP2's root module gathers its parameters there
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def train_dataloader(self):
        """Batches of 8; under data parallelism each of the D ranks takes every D-th sample (batches of 8 / D), so
        the ranks' batches together are one process's."""
        tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(0))
        ranks, rank = 1, 0
        if self._device_mesh is not None:
            ranks, rank = self.device_mesh["data_parallel"].size(), self.device_mesh["data_parallel"].get_local_rank()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[rank::ranks]), batch_size=8 // ranks)


class MuonTinyLM(MuonMixin, TinyLM):
    pass


class OneOptimizerTinyLM(TinyLM):
    """The same model under Lightning's own (automatic) loop, with `MuonWithAdamW` as its one optimizer, built
    after ``configure_model`` from the parallelised parameters."""

    def configure_optimizers(self):
        return MuonWithAdamW(self, lr=0.02, weight_decay=0.01, ns_dtype=torch.float32)


def every_parameter_a_dtensor(model: ParallelGPT, tp_mesh) -> None:
    """After the tutorial plan, the rest of the model on the tensor-parallel mesh too, so that every parameter is
    a DTensor: the embeddings ``RowwiseParallel`` and the head ``ColwiseParallel`` (their outputs replicated), the
    norms' weights replicated DTensors (their inputs and outputs plain tensors, as around them)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import parallelize_module

    replicated = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(model, tp_mesh, {"embedding": replicated, "wpe": replicated,
                                        "lm_head": ColwiseParallel(output_layouts=Replicate())})
    norms = [model.norm, *(n for block in model.blocks for n in (block.norm1, block.norm2))]
    for norm in norms:
        distribute_module(
            norm, tp_mesh,
            input_fn=lambda _, inputs, mesh: tuple(DTensor.from_local(t, mesh, [Replicate()]) for t in inputs),
            output_fn=lambda _, output, mesh: output.to_local(),
        )


class AllDTensorLM(TinyLM):
    """`TinyLM` with every parameter a DTensor under tensor parallelism (`every_parameter_a_dtensor`)."""

    def configure_model(self) -> None:
        if self.device_mesh is None or any(is_dtensor(p) for p in self.parameters()):
            return
        super().configure_model()
        every_parameter_a_dtensor(self, self.device_mesh["tensor_parallel"])


class MuonAllDTensorLM(MuonMixin, AllDTensorLM):
    pass


class OneOptimizerAllDTensorLM(AllDTensorLM, OneOptimizerTinyLM):
    pass


class SaveRank(L.Callback):
    """Each rank writes its gathered parameters, the roles its first training batch showed and the groups its
    optimizers hold, and what its Muon's strategy counted in the last step: where the work ran, the
    Newton-Schulz FLOPs this rank ran, the bytes it sent, and the elements of the Muon matrices (whole) (`Muon`
    or `MuonWithAdamW`'s); ``None`` for the roles without the mixin."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        params = {n: (p.full_tensor() if is_dtensor(p) else p).detach().clone()
                  for n, p in pl_module.named_parameters()}
        torch.save({"params": params, "world": trainer.world_size}, self.directory / f"rank{trainer.global_rank}.pt")
        groups = [[(g["name"], list(g["param_names"])) for g in o.param_groups] for o in trainer.optimizers]
        blocks = {n: b for o in trainer.optimizers for g in o.param_groups
                  for n, b in zip(g["param_names"], g.get("matrix_blocks") or [None] * len(g["params"])) if b}
        roles = strategy = None
        if isinstance(pl_module, MuonMixin):
            roles = pl_module.muon_roles.to_dict()
        muons = [o.muon if isinstance(o, MuonWithAdamW) else o for o in trainer.optimizers]
        for muon in [m for m in muons if isinstance(m, Muon)]:
            chosen = muon._choice.chosen  # private: the per-step counters are no public API
            strategy = {
                "kind": muon.strategy.kind, "fallback": muon.strategy.fallback, "ranks": muon.strategy.ranks,
                "ns_flops": chosen.ns_flops, "sent": chosen.exchanged_bytes,
                "numel": sum(p.numel() for g in muon.param_groups for p in g["params"]),
            }
        state = {"roles": roles, "groups": groups, "strategy": strategy, "blocks": blocks}
        torch.save(state, self.directory / f"roles{trainer.global_rank}.pt")


def main(argv: list[str] | None = None) -> None:
    """Train as the arguments say (the command line's without ``argv``); see the module's docstring."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--clip-algorithm", default="norm")
    parser.add_argument("--one-optimizer", action="store_true", help="MuonWithAdamW under Lightning's own loop")
    parser.add_argument("--all-dtensor", action="store_true", help="every parameter a DTensor under TP")
    parser.add_argument("--save", default=None, help="keep every epoch's checkpoint in this directory")
    parser.add_argument("--ckpt", default=None, help="resume from this checkpoint")
    parser.add_argument("--monitor", action="store_true", help="MuonMonitor every step, into out/metrics.csv")
    parser.add_argument("--normuon", action="store_true", help="NorMuon (normuon_beta2=0.95) on the mixin's Muon")
    parser.add_argument("--blocks", action="store_true", help=f"the mixin's Muon matrices split as {BLOCKS}")
    parser.add_argument("--split-heads", action="store_true", help="the mixin's split_heads=True")
    parser.add_argument("--qk-clip", type=float, default=None, metavar="TAU", help="QKClip(tau) after every update")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    dp = args.data_parallel
    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=args.devices // dp) \
        if args.devices > 1 else "auto"
    callbacks = [SaveRank(args.out), EndProcessGroup()] + ([epoch_checkpoints(Path(args.save))] if args.save else [])
    callbacks += [MuonMonitor(log_every_n_steps=1)] if args.monitor else []
    callbacks += [QKClip(tau=args.qk_clip, log_every_n_steps=1)] if args.qk_clip else []
    logger = CSVLogger(args.out, name="", version="") if args.monitor else False
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
        max_epochs=args.max_epochs, logger=logger, log_every_n_steps=1, enable_checkpointing=args.save is not None,
        enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, gradient_clip_val=args.clip,
        gradient_clip_algorithm=args.clip_algorithm,
        use_distributed_sampler=False,  # the dataloader shards the data-parallel dimension itself
    )
    muon = muon_factory(**({"normuon_beta2": 0.95} if args.normuon else {}))
    if args.all_dtensor:
        model = OneOptimizerAllDTensorLM() if args.one_optimizer else MuonAllDTensorLM(muon=muon)
    else:
        blocks = {"matrix_blocks": BLOCKS} if args.blocks else {}
        blocks |= {"split_heads": True} if args.split_heads else {}
        model = OneOptimizerTinyLM() if args.one_optimizer else MuonTinyLM(muon=muon, **blocks)
    trainer.fit(model, ckpt_path=args.ckpt)


if __name__ == "__main__":
    main()
