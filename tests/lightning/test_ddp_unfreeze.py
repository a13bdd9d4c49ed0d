"""A backbone unfrozen during a DDP fit (2 CPU ranks, gloo): do the ranks' replicas stay equal?

Lightning's ``BaseFinetuning.setup`` freezes the backbone in the ``setup`` hook (``Trainer._run`` ->
``call._call_setup_hook``), before ``strategy.setup`` wraps the module in ``DistributedDataParallel``; DDP hands
its reducer only the parameters that require a gradient when it is built. The backbone, made trainable at
``unfreeze_backbone_at_epoch``, then gets each rank's own gradient and no all-reduce: the ranks step it apart
(Lightning-AI/pytorch-lightning#20340). Each fit here gives the two ranks different batches (a DistributedSampler),
unfreezes the backbone at epoch 1 of 2 and compares every parameter across the ranks, bit for bit. The head, in
DDP's reducer from the start, is the control; the backbone must have moved after the unfreeze (else the equality
would say nothing).

Under `MuonMixin` the replicas stay equal: the mixin averages the gradients DDP does not reduce itself
(`lightning_muon.lightning._unsynced`), before clipping. Lightning's own automatic loop still shows the divergence:
that case is marked ``xfail(strict=True, raises=RanksDiverged)``, so another failure (a control, the setup) fails the
test, and an upstream fix makes it pass, which strict xfail reports.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from lightning_muon import MuonBackboneFinetuning, MuonMixin

from helpers import ADAMW, EndProcessGroup, ForkedDDP, muon_factory, sine_regression_loader, tiny_llama


class RanksDiverged(AssertionError):
    """The backbone's replicas differ between the ranks (what the xfail marks expect, and nothing else)."""


class WithBackbone(L.LightningModule):
    """``backbone`` (Linear 8->16, Tanh, Linear 16->16) and ``head`` (Linear 16->1), the same weights on every rank;
    32 sine-regression samples, 16 a rank in batches of 4 (4 updates an epoch, different batches on each rank): the
    2 ranks' batches together are one process's batch of 8."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
            self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.backbone(x))), y)

    def train_dataloader(self):
        return sine_regression_loader(self.trainer, samples=32, batch_size=self.batch_size)


class LlamaWithBackbone(L.LightningModule):
    """A tiny random-init transformers Llama: its ``LlamaModel`` (embedding, blocks, final norm) is the ``backbone``,
    its ``lm_head`` the ``head``; 32 sequences of 16 tokens, sharded as `sine_regression_loader` shards (rank r takes
    r, r + W, ...), so 2 ranks' batches of 4 are one process's batch of 8."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        lm = tiny_llama()
        self.backbone, self.head = lm.model, lm.lm_head

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.head(self.backbone(input_ids=tokens).last_hidden_state)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1))

    def train_dataloader(self):
        tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.TensorDataset(tokens)
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, sampler=sampler)


class MuonLlamaWithBackbone(MuonMixin, LlamaWithBackbone):
    """A third-party model under the mixin."""


class MuonWithBackbone(MuonMixin, WithBackbone):
    """Under the mixin's loop (``muon=None``: AdamW alone, the same loop)."""


class AutomaticWithBackbone(WithBackbone):
    """Lightning's automatic optimization, no mixin: one AdamW over what trains at the start (as Lightning's
    finetuning docs build it)."""

    def configure_optimizers(self):
        return ADAMW([p for p in self.parameters() if p.requires_grad])


class Unfreeze(BaseFinetuning):
    """The minimal ``BaseFinetuning``: the backbone frozen before training, unfrozen and added at epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(modules=pl_module.backbone, optimizer=optimizer)


class SaveRanks(L.Callback):
    """Each rank writes ``rank<r>.pt``: what DDP wrapped at ``on_fit_start`` (whether the module is a DDP replica,
    which parameters required a gradient then), its backbone after epoch 0, and its parameters at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.record: dict = {}

    def on_fit_start(self, trainer, pl_module):
        self.record["wrapped"] = isinstance(trainer.strategy.model, DistributedDataParallel)
        self.record["trainable_when_wrapped"] = [n for n, p in pl_module.named_parameters() if p.requires_grad]

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.record["backbone_after_epoch_0"] = _params(pl_module.backbone, "backbone.")

    def on_train_end(self, trainer, pl_module):
        self.record["final"] = _params(pl_module, "")
        self.record["global_step"] = trainer.global_step
        torch.save(self.record, self.directory / f"rank{trainer.global_rank}.pt")


def _params(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + n: p.detach().clone() for n, p in module.named_parameters()}


def fit_on_two_ranks(tmp_path: Path, model: L.LightningModule, finetuning: BaseFinetuning) -> list[dict]:
    """2 epochs on 2 ranks (the backbone unfrozen at epoch 1); each rank's record (`SaveRanks`)."""
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ForkedDDP(), max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[finetuning, SaveRanks(tmp_path), EndProcessGroup()],
    )
    trainer.fit(model)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def fit_in_one_process(model: L.LightningModule, finetuning: BaseFinetuning) -> dict[str, torch.Tensor]:
    """The same 2 epochs in one process (``model`` with batches of 8: both ranks' batches at once)."""
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[finetuning],
    )
    trainer.fit(model)
    return _params(model, "")


def finetuning_callback(kind: str) -> BaseFinetuning:
    if kind == "BackboneFinetuning":  # the mixin's pair takes the subclass with one backbone lr per optimizer
        return MuonBackboneFinetuning(unfreeze_backbone_at_epoch=1)
    return BackboneFinetuning(unfreeze_backbone_at_epoch=1) if kind == "PlainBackboneFinetuning" else Unfreeze()


DIVERGES = pytest.mark.xfail(
    strict=True, raises=RanksDiverged,
    reason="Lightning#20340: BaseFinetuning freezes in `setup`, before DDP wraps the module; the backbone unfrozen "
           "later is not in DDP's reducer, so its gradients are never all-reduced and the ranks' replicas diverge",
)

CASES = [
    pytest.param("muon", "BackboneFinetuning", id="mixin-muon-BackboneFinetuning"),
    pytest.param("muon", "BaseFinetuning", id="mixin-muon-BaseFinetuning"),
    pytest.param("adamw", "BackboneFinetuning", id="mixin-adamw-BackboneFinetuning"),
    # clipping by the global norm: every rank must clip by the same norm, so the late gradients are averaged first
    pytest.param("muon-clipped", "BackboneFinetuning", id="mixin-muon-clipped-BackboneFinetuning"),
    pytest.param("muon-llama", "BackboneFinetuning", id="mixin-muon-transformers-llama-BackboneFinetuning"),
    pytest.param("automatic", "PlainBackboneFinetuning", marks=DIVERGES, id="automatic-BackboneFinetuning"),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("optimization", "finetuning"), CASES)
def test_a_backbone_unfrozen_during_a_ddp_fit_stays_equal_on_every_rank(tmp_path, optimization, finetuning):
    def build(batch_size: int = 4) -> L.LightningModule:
        if optimization == "automatic":
            return AutomaticWithBackbone(batch_size=batch_size)
        if optimization == "muon-llama":
            return MuonLlamaWithBackbone(muon=muon_factory(), batch_size=batch_size)
        clip = {"gradient_clip_val": 1e-3} if optimization == "muon-clipped" else {}
        return MuonWithBackbone(muon=None if optimization == "adamw" else muon_factory(), batch_size=batch_size,
                                **clip)

    model = build()
    initial = _params(model, "")
    ranks = fit_on_two_ranks(tmp_path, model, finetuning_callback(finetuning))
    backbone = [n for n in initial if n.startswith("backbone.")]
    head = [n for n in initial if n.startswith("head.")]

    for r, record in enumerate(ranks):
        assert record["global_step"] == 8, f"rank {r}"
        # the mechanism: DDP wrapped the module while the backbone was frozen (setup ran before strategy.setup)
        assert record["wrapped"], f"rank {r}"
        assert sorted(record["trainable_when_wrapped"]) == sorted(head), f"rank {r}"
        # frozen through epoch 0, trained after the unfreeze: the comparison below is not vacuous
        assert all(torch.equal(record["backbone_after_epoch_0"][n], initial[n]) for n in backbone), f"rank {r}"
        assert all(not torch.equal(record["final"][n], initial[n]) for n in backbone), f"rank {r}"
        assert all(not torch.equal(record["final"][n], initial[n]) for n in head), f"rank {r}"

    rank0, rank1 = (record["final"] for record in ranks)
    # the control: the head was in DDP's reducer from the start
    for n in head:
        assert torch.equal(rank0[n], rank1[n]), f"{n} differs between the ranks"
    differ = {n: float((rank0[n] - rank1[n]).abs().max()) for n in backbone if not torch.equal(rank0[n], rank1[n])}
    if differ:
        moved = {n: float((rank0[n] - initial[n]).abs().max()) for n in differ}
        raise RanksDiverged(
            f"{len(differ)} of {len(backbone)} backbone tensors differ between the ranks; max |rank0 - rank1|: "
            f"{differ}; max |rank0 - initial| of the same: {moved}"
        )
    # and the replicas are what one process makes of both ranks' batches (the averaged gradients are DDP's)
    alone = fit_in_one_process(build(batch_size=8), finetuning_callback(finetuning))
    for n in initial:
        torch.testing.assert_close(rank0[n], alone[n], atol=1e-5, rtol=0, msg=f"{n}: 2 ranks against one process")
