"""A separate lr schedule for each optimizer (``muon_lr_scheduler``, ``adamw_lr_scheduler``) through a real Trainer
and a CSVLogger, exact values: each optimizer's groups follow their own schedule, by hand, once per update (with
gradient accumulation too), keeping each group's lr ratio; an optimizer's own schedule replaces the shared one for
it; a resume mid-schedule ends bit for bit where the uninterrupted fit ends; a resume whose schedules come from
other arguments than the checkpoint's is refused."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon import MuonMonitor, WarmupCosine

from helpers import MuonRegression, epoch_checkpoints, make_trainer, read_metrics, same, snapshot

#: Muon: 2 updates of warmup, then a cosine to 0 over the fit's 8 updates.
MUON_SCHEDULE = functools.partial(WarmupCosine, warmup_steps=2)
#: AdamW: halved every 3 updates.
ADAMW_SCHEDULE = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
#: The head's own AdamW lr, so AdamW has two base lrs whose ratio the schedule keeps.
HEAD = {"head": {"lr": 1e-3}}


def muon_lr(k: int) -> float:
    """Muon's lr on update ``k`` (0-based) of 8, by hand: 0.02 warmed up over 2 updates, then the cosine."""
    return 0.02 * ((k + 1) / 2 if k < 2 else 0.5 * (1 + math.cos(math.pi * ((k - 2) / 6))))


def adamw_lr(base: float, k: int) -> float:
    """AdamW's lr on update ``k``, by hand: ``base`` halved every 3 updates."""
    return base * 0.5 ** (k // 3)


def logged_lrs(directory) -> dict[str, dict[int, float]]:
    """Every ``lr-*`` key the monitor wrote, by step."""
    rows = read_metrics(directory)
    keys = [k for k in rows[0] if k.startswith("lr-")]
    return {k: {int(r["step"]): float(r[k]) for r in rows if r[k]} for k in keys}


def fit(tmp_path, accumulate: int = 2, callbacks=(), **kwargs) -> tuple:
    """8 updates (2 epochs of 4) of `MuonRegression` with the monitor logging every update."""
    model = MuonRegression(batch_size=4 // accumulate, accumulate_grad_batches=accumulate, group_settings=HEAD,
                           **kwargs)
    monitor = MuonMonitor(log_every_n_steps=1, orthogonality=False)
    trainer = make_trainer(tmp_path, csv_dir=tmp_path, max_steps=8, callbacks=[monitor, *callbacks])
    trainer.fit(model)
    return trainer, model


@pytest.mark.parametrize("accumulate", [1, 2])
def test_each_optimizer_follows_its_own_schedule_once_per_update(tmp_path, accumulate):
    trainer, _ = fit(tmp_path, accumulate, muon_lr_scheduler=MUON_SCHEDULE, adamw_lr_scheduler=ADAMW_SCHEDULE)
    assert trainer.global_step == 8
    assert [type(c.scheduler) for c in trainer.lr_scheduler_configs] == [WarmupCosine, torch.optim.lr_scheduler.StepLR]
    assert [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs] == [8, 8]  # per update, not per batch
    steps = range(8)
    assert logged_lrs(tmp_path) == {
        "lr-Muon/hidden": {k: muon_lr(k) for k in steps},
        "lr-AdamW/head": {k: adamw_lr(1e-3, k) for k in steps},
        "lr-AdamW/input": {k: adamw_lr(3e-4, k) for k in steps},
        "lr-AdamW/norms_and_biases": {k: adamw_lr(3e-4, k) for k in steps},
    }


def test_an_optimizers_own_schedule_replaces_the_shared_one_for_it(tmp_path):
    trainer, _ = fit(tmp_path / "a", lr_scheduler=ADAMW_SCHEDULE, muon_lr_scheduler=MUON_SCHEDULE)
    lrs = logged_lrs(tmp_path / "a")
    assert lrs["lr-Muon/hidden"] == {k: muon_lr(k) for k in range(8)}
    assert lrs["lr-AdamW/input"] == {k: adamw_lr(3e-4, k) for k in range(8)}  # the shared one
    # Only AdamW scheduled: Muon keeps its lr, one scheduler config.
    trainer, _ = fit(tmp_path / "b", adamw_lr_scheduler=ADAMW_SCHEDULE)
    assert [type(c.scheduler) for c in trainer.lr_scheduler_configs] == [torch.optim.lr_scheduler.StepLR]
    lrs = logged_lrs(tmp_path / "b")
    assert lrs["lr-Muon/hidden"] == dict.fromkeys(range(8), 0.02)
    assert lrs["lr-AdamW/head"] == {k: adamw_lr(1e-3, k) for k in range(8)}
    # The AdamW baseline (muon=None) has no Muon to schedule: Muon's own schedule is not used, AdamW's is.
    trainer, _ = fit(tmp_path / "c", muon=None, muon_lr_scheduler=MUON_SCHEDULE)
    assert trainer.lr_scheduler_configs == []
    trainer, _ = fit(tmp_path / "d", muon=None, muon_lr_scheduler=MUON_SCHEDULE, adamw_lr_scheduler=ADAMW_SCHEDULE)
    assert [type(c.scheduler) for c in trainer.lr_scheduler_configs] == [torch.optim.lr_scheduler.StepLR]
    assert logged_lrs(tmp_path / "d")["lr-AdamW/head"] == {k: adamw_lr(1e-3, k) for k in range(8)}


def test_a_resume_mid_schedule_ends_bit_for_bit_where_the_uninterrupted_fit_ends(tmp_path):
    arguments = {"muon_lr_scheduler": MUON_SCHEDULE, "adamw_lr_scheduler": ADAMW_SCHEDULE}
    model = MuonRegression(batch_size=2, accumulate_grad_batches=2, group_settings=HEAD, **arguments)
    # max_epochs, not max_steps: Lightning itself (plain automatic optimization too) resumes an epoch-end
    # checkpoint into a max_steps fit with one batch more in epoch 0.
    make_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[epoch_checkpoints(tmp_path)]).fit(
        model)
    checkpoint = torch.load(tmp_path / "epoch0.ckpt", weights_only=True)
    assert [s["last_epoch"] for s in checkpoint["lr_schedulers"]] == [4, 4]  # mid-schedule: 4 updates of 8
    resumed = MuonRegression(batch_size=2, accumulate_grad_batches=2, group_settings=HEAD, **arguments)
    monitor = MuonMonitor(log_every_n_steps=1, orthogonality=False)
    trainer = make_trainer(tmp_path / "resumed", csv_dir=tmp_path / "resumed", max_epochs=2, callbacks=[monitor])
    trainer.fit(resumed, ckpt_path=tmp_path / "epoch0.ckpt")
    assert same(snapshot(resumed), snapshot(model))
    lrs = logged_lrs(tmp_path / "resumed")
    assert lrs["lr-Muon/hidden"] == {k: muon_lr(k) for k in range(4, 8)}
    assert lrs["lr-AdamW/head"] == {k: adamw_lr(1e-3, k) for k in range(4, 8)}
    assert [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs] == [8, 8]


@pytest.mark.parametrize(("saved", "resumed", "words"), [
    ({"lr_scheduler": MUON_SCHEDULE}, {"muon_lr_scheduler": MUON_SCHEDULE, "adamw_lr_scheduler": MUON_SCHEDULE},
     "it was trained with Muon by lr_scheduler, AdamW by lr_scheduler; this fit gives Muon by muon_lr_scheduler, "
     "AdamW by adamw_lr_scheduler"),
    ({"muon_lr_scheduler": MUON_SCHEDULE}, {"adamw_lr_scheduler": MUON_SCHEDULE},
     "it was trained with Muon by muon_lr_scheduler, AdamW by none (a constant lr); this fit gives Muon by none "
     "(a constant lr), AdamW by adamw_lr_scheduler"),
], ids=["shared to own", "Muon's to AdamW's"])
def test_a_resume_whose_schedules_come_from_other_arguments_is_refused(tmp_path, saved, resumed, words):
    make_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[epoch_checkpoints(tmp_path)]).fit(
        MuonRegression(**saved))
    with pytest.raises(MisconfigurationException, match="lr schedules came from other arguments") as refused:
        make_trainer(tmp_path, max_epochs=2).fit(MuonRegression(**resumed), ckpt_path=tmp_path / "epoch0.ckpt")
    assert words in str(refused.value) and "Resume with the checkpoint's arguments" in str(refused.value)
    # The fix the message gives: the checkpoint's arguments.
    trainer = make_trainer(tmp_path, max_epochs=2)
    trainer.fit(MuonRegression(**saved), ckpt_path=tmp_path / "epoch0.ckpt")
    assert trainer.global_step == 8
