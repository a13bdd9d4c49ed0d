"""The first training batch corrects the routing before the first update (`lightning_muon.lightning._first_batch`):
through a real Trainer, the corrected fit equals a fit built with that routing from the start (schedulers
included), the monitor logs the new groups, checkpoints keep the roles, and every rank must agree."""

from __future__ import annotations

import functools
import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.multiprocessing.spawn import ProcessRaisedException

from lightning_muon import MuonMixin, MuonMonitor, WarmupCosine

from helpers import (
    EndProcessGroup,
    ForkedDDP,
    make_trainer,
    muon_factory,
    raw_optimizers,
    read_metrics,
    same,
    snapshot,
)


class ParallelHeads(L.LightningModule):
    """Two raw variables, each through its own Linear(1, 8); a hidden layer; two parallel Linear(16, 1) heads in a
    ModuleList (the structural rules see "repeated blocks" and take neither for a head)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.scale = nn.ModuleList([nn.Linear(1, 8) for _ in range(2)])
            self.hidden = nn.Linear(16, 16)
            self.heads = nn.ModuleList([nn.Linear(16, 1) for _ in range(2)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.cat([s(x[:, i : i + 1]) for i, s in enumerate(self.scale)], -1)
        h = torch.tanh(self.hidden(torch.tanh(h)))
        out = torch.cat([head(h) for head in self.heads], -1)
        loss = nn.functional.mse_loss(out, y)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 2, generator=g)
        data = torch.utils.data.TensorDataset(x, torch.stack([x.sum(1).sin(), x.prod(1)], 1))
        return torch.utils.data.DataLoader(data, batch_size=8)


class MuonParallelHeads(MuonMixin, ParallelHeads):
    pass


SCHEDULE = functools.partial(WarmupCosine, warmup_steps=2)
#: What the first batch shows: every Linear(1, 8) reads the batch, both Linear(16, 1) feed the loss.
GROUPS = [
    [("hidden", ["hidden.weight"])],
    [("input", ["scale.0.weight", "scale.1.weight"]),
     ("head", ["heads.0.weight", "heads.0.bias", "heads.1.weight", "heads.1.bias"]),
     ("norms_and_biases", ["scale.0.bias", "scale.1.bias", "hidden.bias"])],
]


def groups(model) -> list[list[tuple[str, list[str]]]]:
    return [[(g["name"], list(g["param_names"])) for g in o.param_groups] for o in raw_optimizers(model)]


def test_structural_rules_miss_the_heads_and_inputs_the_batch_shows():
    names = {r.name: (r.optimizer, r.group) for r in MuonParallelHeads().muon_routing().routes}
    assert names["heads.0.weight"] == names["scale.0.weight"] == ("Muon", "hidden")


def test_a_corrected_fit_equals_one_built_with_that_routing_from_the_start(tmp_path, caplog):
    model = MuonParallelHeads(lr_scheduler=SCHEDULE)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        make_trainer(tmp_path / "a", max_steps=6, csv_dir=tmp_path / "a", callbacks=[MuonMonitor()]).fit(model)
    assert groups(model) == GROUPS
    moved = [r.message for r in caplog.records if "first training batch moved" in r.message]
    assert len(moved) == 1 and "moved 4 parameter(s) before the first update" in moved[0]
    assert "  heads.0.weight: AdamW (output head: feeds the loss through no other matrix (first batch))" in moved[0]
    # the monitor's keys are the corrected groups', from the first logged step on
    first = read_metrics(tmp_path / "a")[0]
    keys = {"lr-Muon/hidden", "lr-AdamW/input", "lr-AdamW/head", "lr-AdamW/norms_and_biases"}
    assert {k for k in first if k.startswith("lr-") and first[k]} == keys

    reference = MuonParallelHeads(lr_scheduler=SCHEDULE)
    reference.muon_roles = model.muon_roles  # the roles known before configure_optimizers
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        make_trainer(tmp_path / "b", max_steps=6, csv_dir=tmp_path / "b", callbacks=[MuonMonitor()]).fit(reference)
    assert not [r for r in caplog.records if "first training batch" in r.message]  # nothing left to follow
    assert groups(reference) == GROUPS
    assert same(snapshot(model), snapshot(reference))
    # the rebuilt schedulers warmed up and decayed as the ones built from the start did
    lrs = [[row[k] for k in sorted(keys)] for row in read_metrics(tmp_path / "a") if row["lr-Muon/hidden"]]
    assert len(lrs) == 6 and lrs == [
        [row[k] for k in sorted(keys)] for row in read_metrics(tmp_path / "b") if row["lr-Muon/hidden"]]
    assert len({row[0] for row in lrs}) > 2  # the lr changes over the 6 updates


def two_epochs(root, model, ckpt_path=None):
    """Two epochs of 4 updates, a checkpoint at the end of each (``root/epoch=0.ckpt``, ...)."""
    checkpoints = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    make_trainer(root, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints]).fit(model, ckpt_path=ckpt_path)
    return snapshot(model)


def test_the_roles_live_in_checkpoints_and_a_resume_keeps_them(tmp_path, caplog):
    model = MuonParallelHeads()
    straight = two_epochs(tmp_path / "straight", model)
    checkpoint = torch.load(tmp_path / "straight" / "epoch=0.ckpt", weights_only=True)
    assert checkpoint["lightning_muon"]["roles"]["heads"] == ["heads.0.weight", "heads.1.weight"]

    loaded = MuonParallelHeads.load_from_checkpoint(tmp_path / "straight" / "epoch=0.ckpt", weights_only=True)
    assert loaded.muon_routing().routes == model.muon_routing().routes

    resumed = MuonParallelHeads()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        final = two_epochs(tmp_path / "resumed", resumed, ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert not [r for r in caplog.records if "first training batch" in r.message]
    assert groups(resumed) == GROUPS
    assert same(final, straight)


def test_a_checkpoint_from_before_the_roles_resumes_with_the_routing_it_was_saved_with(tmp_path):
    # The user's patterns decide every role, so the structural routing is the trained one, as in checkpoints
    # saved before the first batch was followed (no "roles" entry).
    patterns = {"adamw_params": ["scale.*", "heads.*"]}
    straight = two_epochs(tmp_path / "straight", MuonParallelHeads(**patterns))
    checkpoint = torch.load(tmp_path / "straight" / "epoch=0.ckpt", weights_only=True)
    del checkpoint["lightning_muon"]["roles"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    final = two_epochs(tmp_path / "resumed", MuonParallelHeads(**patterns), ckpt_path=tmp_path / "old.ckpt")
    assert same(final, straight)


def test_every_matrix_leaving_muon_leaves_it_empty_not_broken(tmp_path):
    class OnlyEnds(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.last = nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 1)])

        def training_step(self, batch, batch_idx):
            return self.last[0](torch.tanh(self.first(batch[0]))).square().mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), batch_size=4)

    model = type("MuonOnlyEnds", (MuonMixin, OnlyEnds), {})()
    before = snapshot(model)
    make_trainer(tmp_path, max_steps=2).fit(model)
    muon, _ = raw_optimizers(model)
    assert muon.param_groups == []
    after = snapshot(model)
    assert all(not torch.equal(before[n], after[n]) for n in before)  # AdamW trained all of them


# ------------------------------------------------------------------ ranks


class InputOnRankZero(MuonMixin, ParallelHeads):
    """On rank 0 an extra Linear reads the batch and ``hidden`` maps it straight to the loss (an output head there);
    on rank 1 ``extra`` is never used (it takes the role rank 0 saw: ranks combine what they reached) and ``hidden``
    is the hidden layer it is."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.extra = nn.Linear(2, 16)

    def training_step(self, batch, batch_idx):
        loss = super(MuonMixin, self).training_step(batch, batch_idx)
        if self.global_rank == 0:  # an input layer here (another matrix lies between it and the loss)
            loss = loss + self.hidden(self.extra(batch[0])).square().mean() * 0
        return loss


@pytest.mark.distributed
def test_ranks_whose_batches_show_different_roles_are_refused_on_every_rank(tmp_path):
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[EndProcessGroup()],
        strategy=ForkedDDP(find_unused_parameters=True),
    )
    with pytest.raises(ProcessRaisedException, match="showed different roles") as raised:
        trainer.fit(InputOnRankZero(muon=muon_factory()))
    assert "  hidden.weight: head on rank 0, hidden on rank 1\n" in str(raised.value)
    assert "extra.weight" not in str(raised.value)
    assert "muon_params=[...]) or adamw_params=[...]" in str(raised.value)



def test_roles_are_set_before_a_fit_not_during_one(tmp_path):
    class SetsRoles(L.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.muon_roles = None

    with pytest.raises(RuntimeError, match="muon_roles is set before a fit, not during one"):
        make_trainer(tmp_path, max_steps=1, callbacks=[SetsRoles()]).fit(MuonParallelHeads())


# ------------------------------------------------------------------ the trace cannot break a fit


def test_a_compiled_model_trains_bit_for_bit_like_eager_with_the_same_roles(tmp_path, caplog):
    """``trainer.fit(torch.compile(model))``: the parent's step is compiled, the update and the first batch's
    trace are not (the trace used to die in the compiled region: "attempted to set_stance")."""
    torch._dynamo.reset()
    eager, compiled = MuonParallelHeads(lr_scheduler=SCHEDULE), MuonParallelHeads(lr_scheduler=SCHEDULE)
    make_trainer(tmp_path / "eager", max_steps=4).fit(eager)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        make_trainer(tmp_path / "compiled", max_steps=4).fit(torch.compile(compiled, backend="eager"))
    assert [r.message for r in caplog.records if "first training batch moved 4 parameter(s)" in r.message]
    assert compiled.muon_roles == eager.muon_roles and groups(compiled) == groups(eager) == GROUPS
    assert same(snapshot(compiled), snapshot(eager))


def test_a_loss_the_trace_cannot_follow_trains_on_the_structural_routing_saying_why_once(tmp_path, caplog):
    from lightning_muon.routing import GraphRoles, _trace

    def broken(*args, **kwargs):
        raise KeyError("bookkeeping")

    model = MuonParallelHeads()
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(
            logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        patch.setattr(_trace.RoleTrace, "_follow", broken)
        make_trainer(tmp_path / "a", max_steps=4).fit(model)
    said = [r.message for r in caplog.records if "first training batch" in r.message]
    assert len(said) == 1 and "could not be followed (the trace failed at" in said[0]
    assert "stay as names and structure decided them" in said[0]
    assert model.muon_roles is not None and model.muon_roles.heads is None  # decided: not followed again
    reference = MuonParallelHeads()
    reference.muon_roles = GraphRoles()  # the structural routing from the start
    make_trainer(tmp_path / "b", max_steps=4).fit(reference)
    assert groups(model) == groups(reference) != GROUPS
    assert same(snapshot(model), snapshot(reference))


def test_the_trace_follows_activation_checkpointing_and_autocast():
    from torch.utils.checkpoint import checkpoint

    from lightning_muon import trace_roles

    model = ParallelHeads()
    model.log = lambda *args, **kwargs: None  # no Trainer to log to
    batch = next(iter(model.train_dataloader()))
    plain = trace_roles(model, batch, lambda b: model.training_step(b, 0))

    class Checkpointed(ParallelHeads):
        def training_step(self, batch, batch_idx):
            return checkpoint(super().training_step, batch, batch_idx, use_reentrant=False)

    checkpointed = Checkpointed()
    checkpointed.log = model.log
    assert trace_roles(checkpointed, batch, lambda b: checkpointed.training_step(b, 0)) == plain
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert trace_roles(model, batch, lambda b: model.training_step(b, 0)) == plain
    assert plain.heads == {"heads.0.weight", "heads.1.weight"}


def test_a_checkpoint_naming_the_roles_graph_resumes_with_them(tmp_path):
    """Records written before the key was ``"roles"`` say ``"graph"``."""
    straight = two_epochs(tmp_path / "straight", MuonParallelHeads())
    checkpoint = torch.load(tmp_path / "straight" / "epoch=0.ckpt", weights_only=True)
    checkpoint["lightning_muon"]["graph"] = checkpoint["lightning_muon"].pop("roles")
    del checkpoint["lightning_muon"]["shapes"]  # nor did they record shapes
    torch.save(checkpoint, tmp_path / "old.ckpt")
    resumed = MuonParallelHeads()
    final = two_epochs(tmp_path / "resumed", resumed, ckpt_path=tmp_path / "old.ckpt")
    assert groups(resumed) == GROUPS
    assert same(final, straight)


class FreezeOneAtTrainStart(L.Callback):
    """Freezes a trainable matrix after the optimizers are built and before the first batch: the wrong place."""

    def on_train_start(self, trainer, pl_module):
        pl_module.hidden.weight.requires_grad_(False)


def test_a_parameter_frozen_between_the_optimizers_and_the_first_batch_is_named(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[FreezeOneAtTrainStart()])
    with pytest.raises(L.pytorch.utilities.exceptions.MisconfigurationException) as error:
        trainer.fit(MuonParallelHeads())
    assert "in an optimizer but now frozen: ['hidden.weight']" in str(error.value)
    assert "unfreeze_and_add_param_group" in str(error.value)
