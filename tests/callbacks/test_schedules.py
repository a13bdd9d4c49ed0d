"""MomentumSchedule and WeightDecaySchedule through a real Trainer: the exact value of every update (with gradient
accumulation), weight decay following WarmupCosine, the MuonMonitor keys, MuonWithAdamW and a plain optimizer
under automatic optimization, and a resume that ends bit for bit where the uninterrupted fit ends."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon import MomentumSchedule, MuonMonitor, MuonWithAdamW, WarmupCosine, WeightDecaySchedule

from helpers import (
    MuonRegression,
    Regression,
    epoch_checkpoints,
    make_trainer,
    read_metrics,
    same,
    snapshot,
)

#: The mixin's AdamW with weight decay (its default has none), so the weight-decay schedule has AdamW groups to move.
ADAMW_DECAYING = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


class Settings(L.Callback):
    """Every optimizer's groups' momentum (or betas), weight decay, lr and initial lr, as each step uses them
    (after the schedules, which come before it among the callbacks)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, list[dict]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        raw = getattr(optimizer, "optimizer", optimizer)
        index = [getattr(o, "optimizer", o) for o in trainer.optimizers].index(raw)
        keys = ("momentum", "weight_decay", "lr", "initial_lr", "algorithm")
        self.steps.append((trainer.global_step, index, [{k: g[k] for k in keys if k in g} for g in raw.param_groups]))


def mixin_fit(tmp_path, callbacks, max_steps=8, **kwargs) -> tuple[Settings, L.Trainer, MuonRegression]:
    settings = Settings()
    # 4 updates an epoch
    model = MuonRegression(batch_size=2, accumulate_grad_batches=2, adamw=ADAMW_DECAYING, **kwargs)
    trainer = make_trainer(tmp_path, csv_dir=tmp_path, max_steps=max_steps, callbacks=[*callbacks, settings])
    trainer.fit(model)
    return settings, trainer, model


def muon_momenta(settings: Settings) -> list[float]:
    return [groups[0]["momentum"] for _, index, groups in settings.steps if index == 0]


def test_momentum_warms_up_and_cools_down_once_per_update_under_accumulation(tmp_path):
    schedule = MomentumSchedule(start=0.85, warmup_steps=4, end=0.5, cooldown_steps=2)
    settings, _, _ = mixin_fit(tmp_path, [schedule])
    assert [step for step, index, _ in settings.steps if index == 0] == list(range(8))  # once per update
    warmup = [0.85 + (0.95 - 0.85) * k / 4 for k in range(4)]
    assert muon_momenta(settings) == [*warmup, 0.95, 0.95, 0.95 + (0.5 - 0.95) / 2, 0.5]
    # AdamW's groups have no momentum: untouched (betas as configured)
    assert all("momentum" not in g for _, index, groups in settings.steps if index == 1 for g in groups)


def test_momentum_groups_keep_their_ratio():
    schedule = MomentumSchedule(start=0.5, warmup_steps=2)
    schedule.bases = [[{"momentum": 0.9}, {"momentum": 0.45}]]
    first = {"momentum": 0.9}
    assert schedule.value(0, first, schedule.bases[0][0]) == 0.5
    assert schedule.value(0, first, schedule.bases[0][1]) == 0.5 * 0.45 / 0.9
    assert schedule.value(2, first, schedule.bases[0][1]) == 0.45


def test_weight_decay_follows_warmup_cosine_per_group(tmp_path):
    schedule = functools.partial(WarmupCosine, warmup_steps=3)
    configured, _, _ = mixin_fit(tmp_path / "a", [], lr_scheduler=schedule)
    settings, _, _ = mixin_fit(tmp_path / "b", [WeightDecaySchedule()], lr_scheduler=schedule)
    assert len(settings.steps) == len(configured.steps) == 16  # 8 updates, each of the pair
    for (_, _, groups), (_, _, fixed) in zip(settings.steps, configured.steps, strict=True):
        for group, base in zip(groups, fixed, strict=True):
            assert group["weight_decay"] == base["weight_decay"] * group["lr"] / group["initial_lr"]
    muon = [groups[0]["weight_decay"] for _, index, groups in settings.steps if index == 0]
    # from a third of Muon's configured 0.01 (the warm-up's first lr) up to all of it, then down the cosine
    # (exact per group above)
    assert muon[0] == pytest.approx(0.01 / 3) and muon[3] == 0.01 and muon[-1] < muon[4] < muon[3]
    adamw = {g["weight_decay"] for _, index, groups in settings.steps if index == 1 for g in groups}
    assert len(adamw) > 2, "AdamW's decaying groups must move too"


def test_weight_decay_of_one_optimizer_only(tmp_path):
    schedule = functools.partial(WarmupCosine, warmup_steps=3)
    baseline, _, _ = mixin_fit(tmp_path / "a", [], lr_scheduler=schedule)
    settings, _, _ = mixin_fit(tmp_path / "b", [WeightDecaySchedule(optimizers=["muon"])], lr_scheduler=schedule)
    adamw = [[g["weight_decay"] for g in groups] for _, index, groups in settings.steps if index == 1]
    assert adamw == [[g["weight_decay"] for g in groups] for _, index, groups in baseline.steps if index == 1]
    muon = [groups[0]["weight_decay"] for _, index, groups in settings.steps if index == 0]
    assert len(set(muon)) > 1


def test_monitor_logs_what_the_schedules_move(tmp_path):
    schedules = [MomentumSchedule(start=0.85, warmup_steps=4), WeightDecaySchedule(optimizers=["muon"])]
    monitor = MuonMonitor(log_every_n_steps=2, orthogonality=False)
    settings, trainer, _ = mixin_fit(tmp_path, [*schedules, monitor], lr_scheduler=WarmupCosine)
    rows = read_metrics(tmp_path)
    momentum = [k for k in rows[0] if k.startswith("momentum-")]
    decay = [k for k in rows[0] if k.startswith("weight_decay-")]
    muon_group = trainer.optimizers[0].param_groups[0]["name"]
    assert momentum == [f"momentum-Muon/{muon_group}"] and decay == [f"weight_decay-Muon/{muon_group}"]
    logged = {int(r["step"]): float(r[momentum[0]]) for r in rows if r[momentum[0]]}
    used = dict(enumerate(muon_momenta(settings)))
    assert logged == {step: used[step] for step in (1, 3, 5, 7)}
    decays = {int(r["step"]): float(r[decay[0]]) for r in rows if r[decay[0]]}
    used_decay = {s: groups[0]["weight_decay"] for s, index, groups in settings.steps if index == 0}
    assert decays == {step: used_decay[step] for step in (1, 3, 5, 7)}


def test_monitor_logs_no_schedule_keys_without_a_schedule(tmp_path):
    mixin_fit(tmp_path, [MuonMonitor(log_every_n_steps=2, orthogonality=False)], max_steps=4)
    assert not [k for k in read_metrics(tmp_path)[0] if k.startswith(("momentum-", "weight_decay-"))]


def test_a_resumed_fit_ends_bit_for_bit_where_the_uninterrupted_one_ends(tmp_path):
    """Two epochs of 4 updates (2 micro-batches each) straight, and the second again from the first's checkpoint,
    whose optimizer groups hold update 3's scheduled momentum and weight decay, not the configured ones."""
    def callbacks():
        return [MomentumSchedule(start=0.8, warmup_steps=5, end=0.6, cooldown_steps=2), WeightDecaySchedule()]

    def model():
        return MuonRegression(batch_size=2, accumulate_grad_batches=2, adamw=ADAMW_DECAYING,
                              lr_scheduler=functools.partial(WarmupCosine, warmup_steps=2))

    whole = model()
    make_trainer(tmp_path, max_epochs=2, enable_checkpointing=True,
                 callbacks=[*callbacks(), epoch_checkpoints(tmp_path)]).fit(whole)
    checkpoint = torch.load(tmp_path / "epoch0.ckpt", weights_only=True)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["momentum"] == 0.8 + (0.95 - 0.8) * 3 / 5
    settings, resumed = Settings(), model()
    make_trainer(tmp_path / "resumed", max_epochs=2, callbacks=[*callbacks(), settings]).fit(
        resumed, ckpt_path=tmp_path / "epoch0.ckpt")
    assert [step for step, index, _ in settings.steps if index == 0] == [4, 5, 6, 7]
    assert muon_momenta(settings) == [0.8 + (0.95 - 0.8) * 4 / 5, 0.95, 0.95 + (0.6 - 0.95) / 2, 0.6]
    assert same(snapshot(resumed), snapshot(whole))


class Combined(Regression):
    """MuonWithAdamW under automatic optimization: the hidden matrix on Muon, the rest on AdamW."""

    def configure_optimizers(self):
        hidden = self.net[2].weight
        rest = [p for p in self.parameters() if p is not hidden]
        return MuonWithAdamW([{"params": [hidden], "algorithm": "muon", "name": "hidden"},
                              {"params": rest, "algorithm": "adamw", "weight_decay": 0.1, "name": "rest"}])


def test_muon_with_adamw_under_automatic_optimization(tmp_path):
    settings = Settings()
    schedules = [MomentumSchedule(start=0.85, warmup_steps=2), WeightDecaySchedule(optimizers=["adamw"])]
    make_trainer(tmp_path, max_steps=4, callbacks=[*schedules, settings]).fit(Combined())
    assert [groups[0]["momentum"] for *_, groups in settings.steps] == [0.85, 0.85 + (0.95 - 0.85) / 2, 0.95, 0.95]
    assert [groups[0]["weight_decay"] for *_, groups in settings.steps] == [0.01] * 4  # Muon's: not selected
    assert [groups[1]["weight_decay"] for *_, groups in settings.steps] == [0.1] * 4  # constant lr
    assert "momentum" not in settings.steps[0][2][1]


class PlainAdamW(Regression):
    """One torch.optim.AdamW with weight decay under automatic optimization, its lr halved, thirded, ... per update."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.2)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 / (k + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_a_plain_optimizer_under_automatic_optimization(tmp_path):
    settings = Settings()
    make_trainer(tmp_path, max_steps=3, callbacks=[WeightDecaySchedule(), settings]).fit(PlainAdamW())
    assert [s[2][0]["weight_decay"] for s in settings.steps] == [0.2 * (0.01 * (1 / (k + 1))) / 0.01 for k in range(3)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cooldown_steps": 3}, r"cooldown_steps=3 needs the momentum to end at: give end=\.\.\."),
        ({"start": 1.0}, r"start must be in \[0, 1\), got 1\.0"),
        ({"warmup_steps": -1}, r"warmup_steps must be an int >= 0 \(updates\) or a float in \(0, 1\] \(a fraction "
                               r"of the fit's updates\), got -1"),
        ({"end": 0.5, "cooldown_steps": 1.5}, r"cooldown_steps must be an int >= 0 \(updates\) or a float in \(0, 1\]"),
        ({"warmup_steps": 0.0}, r"warmup_steps must be an int >= 0 \(updates\) or a float in \(0, 1\]"),
    ],
)
def test_momentum_schedule_refuses_bad_arguments(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        MomentumSchedule(**kwargs)


def test_a_warmup_and_cooldown_that_overlap_are_refused_before_training(tmp_path):
    schedule = MomentumSchedule(warmup_steps=3, end=0.5, cooldown_steps=2)
    with pytest.raises(MisconfigurationException, match=r"overlap in a fit of 4 updates"):
        mixin_fit(tmp_path, [schedule], max_steps=4)


def test_weight_decay_schedule_refuses_a_bare_name():
    with pytest.raises(MisconfigurationException, match=r"optimizers must be a list of names"):
        WeightDecaySchedule(optimizers="muon")  # type: ignore[arg-type]


def test_a_total_steps_shorter_than_the_fit_is_warned_about(tmp_path):
    """A config's ``total_steps`` left behind when ``max_steps`` grew: the cooldown would end mid-fit."""
    schedule = MomentumSchedule(warmup_steps=1, end=0.5, cooldown_steps=1, total_steps=4)
    with pytest.warns(UserWarning, match=r"total_steps=4 is shorter than this fit's 8 updates: the cooldown ends at "
                                         r"update 4 and the momentum stays at end=0\.5 after it"):
        settings, _, _ = mixin_fit(tmp_path, [schedule], max_steps=8)
    assert muon_momenta(settings) == [0.85, 0.95, 0.95, 0.5, 0.5, 0.5, 0.5, 0.5]  # as it warned


def test_a_total_steps_as_long_as_the_fit_is_not_warned_about(tmp_path, recwarn):
    mixin_fit(tmp_path, [MomentumSchedule(warmup_steps=1, end=0.5, cooldown_steps=1, total_steps=8)], max_steps=8)
    assert not [w for w in recwarn if "MomentumSchedule" in str(w.message)]


def test_fractions_of_the_fit_follow_its_length(tmp_path):
    """``warmup_steps=0.25, cooldown_steps=0.25`` of an 8-update fit are 2 updates each: the same momenta, update by
    update, as the ints; in a 4-update fit 1 each (the recipe config's shape at any ``max_steps``)."""
    as_ints, _, _ = mixin_fit(tmp_path / "ints", [MomentumSchedule(warmup_steps=2, end=0.5, cooldown_steps=2)])
    fractions = MomentumSchedule(warmup_steps=0.25, end=0.5, cooldown_steps=0.25)
    as_fractions, _, _ = mixin_fit(tmp_path / "fractions", [fractions])
    assert muon_momenta(as_fractions) == muon_momenta(as_ints)
    halfway_up, halfway_down = 0.85 + (0.95 - 0.85) / 2, 0.95 + (0.5 - 0.95) / 2
    assert muon_momenta(as_ints) == [0.85, halfway_up, 0.95, 0.95, 0.95, 0.95, halfway_down, 0.5]
    shorter, _, _ = mixin_fit(tmp_path / "short", [MomentumSchedule(warmup_steps=0.25, end=0.5, cooldown_steps=0.25)],
                              max_steps=4)
    assert muon_momenta(shorter) == [0.85, 0.95, 0.95, 0.5]


def test_a_fraction_needs_a_fit_with_an_end(tmp_path):
    schedule = MomentumSchedule(warmup_steps=0.1)
    model = MuonRegression(batch_size=2)
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=-1, callbacks=[schedule])
    with pytest.raises(MisconfigurationException, match=r"a cooldown or a fraction of the fit needs the fit's length"):
        trainer.fit(model)


def test_a_warmup_of_updates_runs_in_a_fit_with_no_end(tmp_path):
    """``max_steps=-1, max_epochs=-1`` (stopped by a callback here): a warm-up counted in updates needs no length."""

    class StopAfter(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.global_step >= 3

    settings = Settings()
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=-1,
                           callbacks=[MomentumSchedule(start=0.85, warmup_steps=2), settings, StopAfter()])
    trainer.fit(MuonRegression(batch_size=2))
    assert muon_momenta(settings)[:3] == [0.85, 0.85 + (0.95 - 0.85) / 2, 0.95]
