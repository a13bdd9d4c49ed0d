"""Settings per role (``group_settings``): each routing group's own lr, weight decay, betas, eps or momentum, through
`route_parameters`, `MuonMixin` (a real Trainer: the first batch's regroup, a scheduler, a resume) and
`MuonWithAdamW`; bad names refused before anything is built.
"""

from __future__ import annotations

import functools

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_muon import MuonMonitor, MuonWithAdamW, WarmupCosine, WeightDecaySchedule, route_parameters

from helpers import MuonRegression, make_trainer, raw_optimizers, read_metrics, snapshot

#: Every kind of setting, on both optimizers; ``input`` is the group the first batch makes (``net.0.weight`` reads
#: the batch), so the regroup must keep its settings.
SETTINGS = {
    "hidden": {"lr": 0.05, "momentum": 0.9},
    "input": {"lr": 0.003, "weight_decay": 0.1},
    "head": {"lr": 0.002, "betas": [0.8, 0.99]},
    "norms_and_biases": {"weight_decay": 0.0, "eps": 1e-6},
}
#: What each group holds after a fit: (lr, weight_decay, the setting that only its optimizer has).
EXPECTED = {
    "hidden": (0.05, 0.01, ("momentum", 0.9)),
    "input": (0.003, 0.1, ("betas", (0.9, 0.95))),
    "head": (0.002, 0.0, ("betas", (0.8, 0.99))),
    "norms_and_biases": (3e-4, 0.0, ("eps", 1e-6)),
}


def held(model) -> dict[str, tuple]:
    """Each group's (lr, weight_decay, its `EXPECTED` optimizer-only setting) as the fit's optimizers hold it."""
    return {g["name"]: (g["lr"], g["weight_decay"], (key, g[key]))
            for o in raw_optimizers(model) for g in o.param_groups for key in [EXPECTED[g["name"]][2][0]]}


def test_route_parameters_puts_each_group_s_settings_into_its_param_group():
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 16))
    routing = route_parameters(model, group_settings={"embeddings": {"lr": 0.01, "betas": (0.8, 0.9)}})
    groups = {g["name"]: g for g in routing.adamw_groups}
    assert (groups["embeddings"]["lr"], groups["embeddings"]["betas"]) == (0.01, (0.8, 0.9))
    assert "lr" not in groups["head"] and "lr" not in routing.muon_groups[0]
    adamw = torch.optim.AdamW(routing.adamw_groups, lr=3e-4)
    assert {g["name"]: g["lr"] for g in adamw.param_groups} == {
        "embeddings": 0.01, "head": 3e-4, "norms_and_biases": 3e-4}


def test_the_table_closes_with_each_group_s_settings_within_100_columns():
    routing = MuonRegression(group_settings=SETTINGS).muon_routing()
    table = routing.plain_table(width=100)
    assert table.splitlines()[-5:] == [
        "Settings per group (over the optimizer's own):",
        "  hidden: lr=0.05, momentum=0.9",
        "  input: lr=0.003, weight_decay=0.1",
        "  head: lr=0.002, betas=[0.8, 0.99]",
        "  norms_and_biases: weight_decay=0, eps=1e-06",
    ]
    assert max(len(line) for line in table.splitlines()) <= 100
    assert "Settings per group" not in MuonRegression().muon_routing().plain_table()


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        pytest.param({"embedding": {"lr": 0.01}}, r"names the group 'embedding', which is none of the routing's "
                     r"groups \['hidden', 'adapters', 'embeddings'", id="unknown-group"),
        pytest.param({"head": {"learning_rate": 0.01}}, r"group_settings\['head'\] sets \['learning_rate'\], which "
                     r"are none of the settings a group takes \['lr', 'weight_decay', 'betas', 'eps', 'momentum'\]",
                     id="unknown-key"),
        pytest.param({"head": {"lr": -1.0}}, r"group_settings\['head'\]\['lr'\] must be a finite number >= 0",
                     id="negative"),
        pytest.param({"head": {"betas": [0.9]}}, r"\['betas'\] must be two numbers in \[0, 1\)", id="betas"),
        pytest.param({"head": 0.01}, r"group_settings\['head'\] must map setting names", id="not-a-mapping"),
    ],
)
def test_bad_group_settings_are_refused_naming_them_and_the_valid_ones(settings, match):
    with pytest.raises(ValueError, match=match):
        route_parameters(nn.Linear(4, 4), group_settings=settings)
    with pytest.raises(ValueError, match=match):
        MuonRegression(group_settings=settings)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        pytest.param({"head": {"momentum": 0.9}}, r"group_settings\['head'\] sets \['momentum'\], which the `adamw` "
                     r"optimizer .* does not take \(its settings: \['betas', 'eps', 'lr', 'weight_decay'\]\)",
                     id="momentum-on-adamw"),
        pytest.param({"hidden": {"betas": [0.9, 0.9]}}, r"group_settings\['hidden'\] sets \['betas'\], which the "
                     r"`muon` optimizer", id="betas-on-muon"),
    ],
)
def test_a_setting_the_group_s_optimizer_does_not_take_is_refused(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        MuonRegression(group_settings=settings).muon_effective_lrs()
    with pytest.raises(ValueError, match=match):
        make_trainer(tmp_path, max_steps=1).fit(MuonRegression(group_settings=settings))


def test_the_mixin_trains_each_group_with_its_own_settings_through_the_first_batch_s_regroup(tmp_path):
    model = MuonRegression(group_settings=SETTINGS)
    lrs = model.muon_effective_lrs()
    before = {n: lrs[n] for n in ("net.4.weight", "net.4.bias", "net.0.bias")}
    assert before == {"net.4.weight": 0.002, "net.4.bias": 0.002, "net.0.bias": 3e-4}  # the head's bias is the head's
    make_trainer(tmp_path, max_steps=3).fit(model)
    assert held(model) == EXPECTED
    assert model.hparams["group_settings"] == SETTINGS


def test_muon_with_adamw_takes_group_settings_for_a_model():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = MuonWithAdamW(model, lr=0.02, adamw_lr=1e-3,
                              group_settings={"hidden": {"lr": 0.04}, "head": {"lr": 0.005, "weight_decay": 0.1}})
    lrs = {(g["algorithm"], g["name"]): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups}
    assert lrs[("muon", "hidden")] == (0.04, 0.01)
    assert lrs[("adamw", "head")] == (0.005, 0.1)
    assert lrs[("adamw", "norms_and_biases")] == (1e-3, 0.0)
    with pytest.raises(ValueError, match=r"sets \['momentum'\], which adamw does not take"):
        MuonWithAdamW(model, group_settings={"head": {"momentum": 0.9}})
    with pytest.raises(ValueError, match=r"group_settings are the routing's groups' settings: give the model"):
        MuonWithAdamW(list(optimizer.param_groups), group_settings={"head": {"lr": 0.1}})


SCHEDULE = functools.partial(WarmupCosine, warmup_steps=2, total_steps=10)


def test_a_scheduler_keeps_each_group_s_ratio_and_the_monitor_logs_each_group_s_lr(tmp_path):
    model = MuonRegression(group_settings=SETTINGS, lr_scheduler=SCHEDULE)
    trainer = make_trainer(tmp_path, max_steps=6, csv_dir=tmp_path, callbacks=[MuonMonitor(log_every_n_steps=1)])
    trainer.fit(model)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    factor = scheduler.factor(scheduler.last_epoch)
    assert 0.0 < factor < 1.0  # mid-cosine: a scheduler that reset a group to its base lr would show
    bases = {"hidden": 0.05, "input": 0.003, "head": 0.002, "norms_and_biases": 3e-4}
    assert {g["name"]: g["lr"] for o in raw_optimizers(model) for g in o.param_groups} == {
        name: base * factor for name, base in bases.items()}
    rows = [r for r in read_metrics(tmp_path) if r.get("lr-AdamW/head")]
    assert len(rows) == 6
    for row in rows:  # logged before the row's update: the scheduler's factor at that step
        for name, base in bases.items():
            key = f"lr-{'Muon' if name == 'hidden' else 'AdamW'}/{name}"
            assert float(row[key]) == pytest.approx(base * scheduler.factor(int(row["step"])), rel=1e-6), (key, row)


def test_weight_decay_following_the_lr_keeps_each_group_s_own_weight_decay(tmp_path):
    model = MuonRegression(group_settings=SETTINGS, lr_scheduler=SCHEDULE)
    trainer = make_trainer(tmp_path, max_steps=6, callbacks=[WeightDecaySchedule()])
    trainer.fit(model)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    factor = scheduler.factor(scheduler.last_epoch - 1)  # the last update's: the schedule moved on after it
    decays = {name: wd for name, (_, wd, _) in EXPECTED.items() if wd}
    moved = {g["name"]: g["weight_decay"] for o in raw_optimizers(model) for g in o.param_groups if g["weight_decay"]}
    assert moved == pytest.approx({name: wd * factor for name, wd in decays.items()}, rel=1e-12)


def test_a_resume_reproduces_the_uninterrupted_run_and_refuses_changed_settings(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    straight = MuonRegression(group_settings=SETTINGS, lr_scheduler=SCHEDULE)
    make_trainer(tmp_path / "straight", max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints]).fit(straight)
    resumed = MuonRegression(group_settings=SETTINGS, lr_scheduler=SCHEDULE)
    make_trainer(tmp_path / "resumed", max_epochs=2).fit(resumed, ckpt_path=tmp_path / "epoch=0.ckpt")
    expected, final = snapshot(straight), snapshot(resumed)
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    assert held(resumed) == held(straight)
    loaded = MuonRegression.load_from_checkpoint(tmp_path / "epoch=0.ckpt", weights_only=True)
    assert loaded.muon_routing().group_settings == SETTINGS  # plain hyperparameters

    changed = {**SETTINGS, "head": {"lr": 0.004}}
    with pytest.raises(MisconfigurationException, match=r"This checkpoint was trained with group_settings=\{'hidden'.*"
                       r"this fit gives group_settings=.*'head': \{'lr': 0.004\}.*Resume with the checkpoint's "
                       r"group_settings"):
        make_trainer(tmp_path / "changed", max_epochs=2).fit(MuonRegression(group_settings=changed),
                                                             ckpt_path=tmp_path / "epoch=0.ckpt")


def test_a_group_a_later_batch_adds_keeps_its_own_ratio_to_the_schedule(tmp_path):
    """``input`` first reached by the second batch joins AdamW late, after the schedule was built: it follows the
    first group's lr at its own ratio, as the fit that knew its roles from the start trains it."""
    from test_unreached import MuonModalities, groups

    settings = {"embeddings": {"lr": 0.01}, "input": {"lr": 0.003, "weight_decay": 0.2}}
    schedule = functools.partial(WarmupCosine, warmup_steps=2, total_steps=12)
    model = MuonModalities(group_settings=settings, lr_scheduler=schedule)
    make_trainer(tmp_path / "a", max_steps=9, csv_dir=tmp_path / "a", callbacks=[MuonMonitor()]).fit(model)
    adamw = raw_optimizers(model)[1]
    assert adamw.param_groups[-1]["name"] == "input"  # late
    rows = [row for row in read_metrics(tmp_path / "a") if row.get("lr-AdamW/input")]
    assert len(rows) >= 6
    for row in rows:
        assert float(row["lr-AdamW/input"]) == pytest.approx(float(row["lr-AdamW/embeddings"]) * 0.3, rel=1e-9)
    assert adamw.param_groups[-1]["weight_decay"] == 0.2

    reference = MuonModalities(group_settings=settings, lr_scheduler=schedule)
    reference.muon_roles = model.muon_roles  # input built from the start
    make_trainer(tmp_path / "b", max_steps=9).fit(reference)
    built = {g["name"]: (pytest.approx(g["lr"], rel=1e-9), g["weight_decay"])
             for g in raw_optimizers(reference)[1].param_groups}
    assert {g["name"]: (g["lr"], g["weight_decay"]) for g in adamw.param_groups} == built
    for name, value in snapshot(reference).items():
        torch.testing.assert_close(snapshot(model)[name], value, rtol=1e-5, atol=1e-6)
    assert groups(model)[1] != groups(reference)[1]  # the same groups in another order: the late one last


def test_a_group_a_later_batch_adds_without_a_schedule_trains_bit_for_bit_as_one_built_from_the_start(tmp_path):
    from test_unreached import MuonModalities

    settings = {"embeddings": {"lr": 0.01}, "input": {"lr": 0.003, "betas": [0.8, 0.9]}}
    model = MuonModalities(group_settings=settings)
    make_trainer(tmp_path / "a", max_steps=6).fit(model)
    late = raw_optimizers(model)[1].param_groups[-1]
    assert (late["name"], late["lr"], late["betas"]) == ("input", 0.003, (0.8, 0.9))
    reference = MuonModalities(group_settings=settings)
    reference.muon_roles = model.muon_roles
    make_trainer(tmp_path / "b", max_steps=6).fit(reference)
    expected = snapshot(reference)
    for name, value in snapshot(model).items():
        assert torch.equal(value, expected[name]), name
