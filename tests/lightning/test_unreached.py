"""Branches the first batch did not reach (`FitState.follows`, `OptimizerPair.place`): a module whose tasks alternate
by batch is routed by the batch that first reaches each task's parameters, before their first update, exactly as
a fit that knew every role from the start; a group an optimizer lacked is added and follows its schedule through a
checkpoint; what stays unreached is named once after `UNREACHED_UPDATES`; and under DDP the ranks agree."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_muon import MuonMixin, MuonMonitor, WarmupCosine
from lightning_muon.lightning import _first_batch

from helpers import EndProcessGroup, ForkedDDP, make_trainer, muon_factory, raw_optimizers, read_metrics, same, snapshot

INFO = "lightning.pytorch.utilities.rank_zero"


class Tasks(L.LightningModule):
    """Task A (even batches): a classification head on the trunk. Task B (odd): ``aux`` (64x64, hidden) then
    ``head_reg`` (3x64), the regression head, registered last but one: the structural rules take ``aux``, the last
    Linear, for the head, and ``head_reg`` for a hidden matrix. ``task`` picks each batch's task from its index and the
    rank (``"rank"``: the two ranks train different tasks at each step)."""

    def __init__(self, task: str = "batch") -> None:
        super().__init__()
        self.task = task
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.trunk = nn.Linear(8, 64)
            self.cls = nn.Linear(64, 5)
            self.head_reg = nn.Linear(64, 3)
            self.aux = nn.Linear(64, 64)

    def training_step(self, batch, batch_idx):
        x, y, r = batch
        h = torch.tanh(self.trunk(x))
        if (batch_idx + (self.global_rank if self.task == "rank" else 0)) % 2 == 0:
            return F.cross_entropy(self.cls(h), y)
        return F.mse_loss(self.head_reg(torch.tanh(self.aux(h))), r)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 5, (64,), generator=g),
                                              torch.randn(64, 3, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


class MuonTasks(MuonMixin, Tasks):
    pass


def groups(model) -> list[list[tuple[str, list[str]]]]:
    return [[(g["name"], list(g["param_names"])) for g in o.param_groups] for o in raw_optimizers(model)]


#: Where every tensor belongs once both tasks are seen: head_reg an output head, aux hidden.
PLACED = [
    [("hidden", ["aux.weight"])],
    [("input", ["trunk.weight"]), ("head", ["cls.weight", "cls.bias", "head_reg.weight", "head_reg.bias"]),
     ("norms_and_biases", ["trunk.bias", "aux.bias"])],
]
SCHEDULE = {"lr_scheduler": {"class_path": "lightning_muon.WarmupCosine", "init_args": {"warmup_steps": 2}}}


def traced_batches(monkeypatch) -> list[int]:
    """Counts the batches the fit follows (one entry each)."""
    from lightning_muon.lightning import _fit

    traced: list[int] = []
    trace = _fit.trace_step
    monkeypatch.setattr(_fit, "trace_step", lambda *a: traced.append(1) or trace(*a))
    return traced


def test_the_batch_that_first_reaches_a_branch_places_it_as_a_fit_that_knew_it_from_the_start(
        tmp_path, caplog, monkeypatch):
    model = MuonTasks(**SCHEDULE)
    traced = traced_batches(monkeypatch)
    with caplog.at_level(logging.INFO, logger=INFO):
        make_trainer(tmp_path / "a", max_steps=6).fit(model)
    assert len(traced) == 2  # the first batch and the one that reached the rest: none once all are reached
    assert groups(model) == PLACED
    said = [r.message for r in caplog.records if "no batch had reached" in r.message]
    assert len(said) == 1 and said[0].startswith(
        "MuonMixin: the training batch of update 2 reached 4 parameter(s) no batch had reached, and placed them")
    assert ("  head_reg.weight: AdamW/head (output head: feeds the loss through no other matrix (later batch)), "
            "moved from Muon/hidden") in said[0]
    assert "  aux.weight: Muon/hidden (hidden matrix; not the output head its name or place suggests (later " \
           "batch)), moved from AdamW/head" in said[0]
    first = next(r.message for r in caplog.records if "first training batch" in r.message)
    assert "It did not reach 4 parameter(s) (head_reg.weight, head_reg.bias, aux.weight, aux.bias)" in first
    assert model.muon_roles.unreached == frozenset()
    table = model.muon_routing().render(width=250)
    assert "later batch" in table and "not reached" not in table

    reference = MuonTasks(**SCHEDULE)
    reference.muon_roles = model.muon_roles  # every role known before the optimizers are built
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=INFO):
        make_trainer(tmp_path / "b", max_steps=6).fit(reference)
    assert not [r for r in caplog.records if "batch" in r.message and "MuonMixin" in r.message]
    assert groups(reference) == PLACED
    assert same(snapshot(model), snapshot(reference))


class Modalities(L.LightningModule):
    """Tokens on even batches (an embedding: no AdamW group "input"), 4 continuous features on odd ones through
    their own Linear (an input layer: the group the first batch's AdamW lacks), one trunk and head."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.tokens = nn.Embedding(10, 16)
            self.features = nn.Linear(4, 16)
            self.trunk = nn.Linear(16, 16)
            self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        h = self.tokens(ids).mean(1) if batch_idx % 2 == 0 else self.features(x)
        return F.mse_loss(self.head(torch.tanh(self.trunk(torch.tanh(h)))), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randint(0, 10, (48, 3), generator=g),
                                              torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


class MuonModalities(MuonMixin, Modalities):
    pass


def test_a_group_the_optimizer_lacked_is_added_follows_the_schedule_and_resumes(tmp_path):
    model = MuonModalities(**SCHEDULE)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    make_trainer(tmp_path / "a", max_epochs=2, csv_dir=tmp_path / "a", enable_checkpointing=True,
                 callbacks=[MuonMonitor(), checkpoints]).fit(model)
    adamw = raw_optimizers(model)[1]
    assert [g["name"] for g in adamw.param_groups] == ["embeddings", "head", "norms_and_biases", "input"]
    assert adamw.param_groups[-1]["param_names"] == ["features.weight"]
    assert model.muon_routing().routes[1].reason == "input layer: reads the batch through no other matrix (later batch)"
    # the late group took the first group's lr at every scheduled step (warmup, then cosine), as a built one would
    rows = [row for row in read_metrics(tmp_path / "a") if row.get("lr-AdamW/input")]
    assert len(rows) >= 10 and all(row["lr-AdamW/input"] == row["lr-AdamW/embeddings"] for row in rows)
    assert len({row["lr-AdamW/input"] for row in rows}) > 3

    reference = MuonModalities(**SCHEDULE)
    reference.muon_roles = model.muon_roles
    make_trainer(tmp_path / "b", max_epochs=2).fit(reference)
    assert same(snapshot(model), snapshot(reference))  # the group's place in the optimizer changes nothing

    resumed = MuonModalities(**SCHEDULE)
    make_trainer(tmp_path / "c", max_epochs=2).fit(resumed, ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt")
    assert groups(resumed) == groups(model)
    assert same(snapshot(resumed), snapshot(model))


class Unused(MuonTasks):
    """Task B never comes: its parameters stay unreached."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, 0)


def test_what_stays_unreached_is_named_once_and_then_no_batch_is_followed(tmp_path, monkeypatch, recwarn):
    traced = traced_batches(monkeypatch)
    monkeypatch.setattr(_first_batch, "UNREACHED_UPDATES", 3)
    model = Unused()
    make_trainer(tmp_path, max_steps=7).fit(model)
    assert len(traced) == 3  # the batches of the first 3 updates, then no more
    said = [str(w.message) for w in recwarn if "no training batch reached" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(
        "MuonMixin: no training batch reached 4 parameter(s) in 3 updates (they got no gradient)")
    assert "  head_reg.weight: Muon/hidden (hidden matrix; not reached by a batch yet)" in said[0]
    assert "  aux.weight: AdamW/head (output head `aux`; not reached by a batch yet)" in said[0]


def test_parameters_decided_by_a_pattern_are_not_waited_for(tmp_path, monkeypatch):
    traced = traced_batches(monkeypatch)
    model = Unused(adamw_params=["head_reg.*", "aux.*"])
    make_trainer(tmp_path, max_steps=3).fit(model)
    assert len(traced) == 1


# ------------------------------------------------------------------ ranks


class SaveGroups(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        torch.save({"groups": groups(pl_module), "params": snapshot(pl_module)},
                   self.directory / f"rank{trainer.global_rank}.pt")


@pytest.mark.distributed
@pytest.mark.parametrize("task", ["batch", "rank"])
def test_ranks_agree_on_what_their_batches_reached(tmp_path, task):
    """``batch``: both ranks reach task B's branch at the second update; ``rank``: rank 1 reaches it at the first,
    rank 0 does not: each rank takes the role the other's batch showed."""
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveGroups(tmp_path), EndProcessGroup()],
        strategy=ForkedDDP(find_unused_parameters=True),
    )
    trainer.fit(MuonTasks(task=task, muon=muon_factory()))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["groups"] == ranks[1]["groups"] == PLACED
    assert same(ranks[0]["params"], ranks[1]["params"])


def test_the_schedule_reaches_groups_added_late(tmp_path):
    """WarmupCosine built for the groups before the late one: stepping it leaves the late group at the same lr."""
    model = MuonModalities(lr_scheduler=lambda o: WarmupCosine(o, warmup_steps=1, total_steps=4))
    make_trainer(tmp_path, max_steps=4).fit(model)
    adamw = raw_optimizers(model)[1]
    assert adamw.param_groups[-1]["name"] == "input"
    assert {g["lr"] for g in adamw.param_groups} == {adamw.param_groups[0]["lr"]}


class EndsAndBranch(L.LightningModule):
    """The first batch shows both matrices it reaches to be the input layer and the head, so Muon keeps no group of
    its own; ``branch``, reached on odd batches only, is a hidden matrix: Muon's empty group is kept for it."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.first, self.last = nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 1)])
            self.branch = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        h = torch.tanh(self.first(batch[0]))
        if batch_idx % 2:
            h = torch.tanh(self.branch(h))
        return self.last[0](h).square().mean()

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(16, 3, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=4)


def test_an_optimizer_the_first_batch_empties_keeps_a_group_for_what_later_batches_reach(tmp_path):
    model = type("MuonEndsAndBranch", (MuonMixin, EndsAndBranch), {})(**SCHEDULE)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    make_trainer(tmp_path / "a", max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints]).fit(model)
    muon, adamw = raw_optimizers(model)
    assert [(g["name"], g["param_names"]) for g in muon.param_groups] == [("hidden", ["branch.weight"])]
    # on its schedule, as its optimizer's first group (the lr left its start)
    scheduled = adamw.param_groups[0]["lr"] / adamw.defaults["lr"]
    assert muon.param_groups[0]["lr"] == pytest.approx(muon.defaults["lr"] * scheduled, rel=1e-12)
    assert scheduled < 0.9

    resumed = type("MuonEndsAndBranch", (MuonMixin, EndsAndBranch), {})(**SCHEDULE)
    make_trainer(tmp_path / "b", max_epochs=2).fit(resumed, ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt")
    assert groups(resumed) == groups(model)
    assert same(snapshot(resumed), snapshot(model))
