"""The Trainer's own optimization settings beside MuonMixin, through a real Trainer, bit for bit.

``gradient_clip_val`` / ``gradient_clip_algorithm`` and ``accumulate_grad_batches`` (and
``GradientAccumulationScheduler``) given to the Trainer equal the mixin's own arguments, from Python and from the
command line, and are refused naming both when the two disagree; ``StochasticWeightAveraging`` anneals on
``muon=None`` as on a plain module and is refused for the pair; ``lr_find`` is refused for the pair and its
suggestion reaches the next fit for ``muon=None``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    GradientAccumulationScheduler,
    StochasticWeightAveraging,
)
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from helpers import (
    ADAMW,
    LearningRates,
    MuonRegression,
    PlainRegression,
    make_trainer,
    same,
    snapshot,
)


def fit(tmp_path, model, **trainer_kwargs) -> tuple[dict[str, torch.Tensor], L.Trainer]:
    trainer = make_trainer(tmp_path, max_epochs=2, **trainer_kwargs)
    trainer.fit(model)
    return snapshot(model), trainer


@pytest.mark.parametrize("muon", ["default", None], ids=["pair", "muon=None"])
def test_trainer_gradient_clip_val_equals_the_mixins_bit_for_bit(tmp_path, muon):
    kwargs = {} if muon == "default" else {"muon": None}
    by_trainer, trainer = fit(tmp_path, MuonRegression(**kwargs), gradient_clip_val=0.05)
    by_mixin, _ = fit(tmp_path, MuonRegression(gradient_clip_val=0.05, **kwargs))
    unclipped, _ = fit(tmp_path, MuonRegression(**kwargs))
    assert same(by_trainer, by_mixin)
    assert not same(by_trainer, unclipped)
    assert trainer.gradient_clip_val == 0.05  # the Trainer reads as it was built after the fit


def test_clipping_by_value_clips_every_gradient_of_both_optimizers(tmp_path, monkeypatch):
    model, largest = MuonRegression(), []
    original = torch.nn.utils.clip_grad_value_

    def recording(parameters, clip_value, foreach=None):
        parameters = list(parameters)
        assert {id(p) for p in parameters} == {id(p) for p in model.parameters()}  # both optimizers' parameters
        original(parameters, clip_value, foreach=foreach)
        largest.append(max(float(p.grad.abs().max()) for p in parameters))

    monkeypatch.setattr(torch.nn.utils, "clip_grad_value_", recording)
    clipped, _ = fit(tmp_path, model, gradient_clip_val=1e-3, gradient_clip_algorithm="value")
    assert largest == [1e-3] * 8 or (len(largest) == 8 and max(largest) == pytest.approx(1e-3))
    monkeypatch.undo()
    by_norm, _ = fit(tmp_path, MuonRegression(), gradient_clip_val=1e-3)
    assert not same(clipped, by_norm)


def test_trainer_clipping_by_value_matches_automatic_optimization_on_the_baseline(tmp_path):
    ours, _ = fit(tmp_path, MuonRegression(muon=None, adamw=ADAMW), gradient_clip_val=1e-3,
                  gradient_clip_algorithm="value")
    theirs, _ = fit(tmp_path, PlainRegression(), gradient_clip_val=1e-3, gradient_clip_algorithm="value")
    assert same(ours, theirs)


def test_trainer_accumulate_grad_batches_equals_the_mixins_bit_for_bit(tmp_path):
    by_trainer, trainer = fit(tmp_path, MuonRegression(), accumulate_grad_batches=2)
    by_mixin, mixin_trainer = fit(tmp_path, MuonRegression(accumulate_grad_batches=2))
    single, _ = fit(tmp_path, MuonRegression())
    assert same(by_trainer, by_mixin) and not same(by_trainer, single)
    assert trainer.global_step == mixin_trainer.global_step == 4
    assert trainer.accumulate_grad_batches == 2  # given back as built


def test_a_gradient_accumulation_scheduler_equals_the_mixins_accumulation(tmp_path):
    by_callback, trainer = fit(tmp_path, MuonRegression(), callbacks=[GradientAccumulationScheduler({0: 2})])
    by_mixin, _ = fit(tmp_path, MuonRegression(accumulate_grad_batches=2))
    assert same(by_callback, by_mixin)
    assert trainer.global_step == 4
    assert any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks)  # given back


def test_a_gradient_accumulation_schedule_changes_at_its_epoch(tmp_path):
    _, trainer = fit(tmp_path, MuonRegression(), callbacks=[GradientAccumulationScheduler({1: 4})])
    assert trainer.global_step == 4 + 1  # epoch 0: 4 updates of 1 batch; epoch 1: one of 4


@pytest.mark.parametrize(
    ("model_kwargs", "trainer_kwargs", "pattern"),
    [
        ({"accumulate_grad_batches": 4}, {"accumulate_grad_batches": 2},
         r"Trainer\(accumulate_grad_batches=2\) and MuonMixin\(accumulate_grad_batches=4\) disagree"),
        ({"gradient_clip_val": 0.5}, {"gradient_clip_val": 1.0},
         r"Trainer\(gradient_clip_val=1\.0, gradient_clip_algorithm='norm'\) and MuonMixin\(gradient_clip_val=0\.5\)"),
        ({"gradient_clip_val": 0.5}, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"},
         r"gradient_clip_algorithm='value'\) and MuonMixin\(gradient_clip_val=0\.5\) \(a global norm\) disagree"),
        ({"accumulate_grad_batches": 2}, {"callbacks": [GradientAccumulationScheduler({0: 2})]},
         r"GradientAccumulationScheduler\(scheduling=\{0: 2\}\) and MuonMixin\(accumulate_grad_batches=2\) both"),
    ],
    ids=["accumulation", "clip-value", "clip-algorithm", "scheduler"],
)
def test_the_trainer_and_the_mixin_disagreeing_fails_before_training_naming_both(
    tmp_path, model_kwargs, trainer_kwargs, pattern
):
    model = MuonRegression(**model_kwargs)
    before = snapshot(model)
    trainer = make_trainer(tmp_path, max_epochs=1, **trainer_kwargs)
    with pytest.raises(MisconfigurationException, match=pattern):
        trainer.fit(model)
    assert same(snapshot(model), before)


def test_agreeing_values_in_both_places_are_fine(tmp_path):
    both, _ = fit(tmp_path, MuonRegression(accumulate_grad_batches=2, gradient_clip_val=0.05),
                  accumulate_grad_batches=2, gradient_clip_val=0.05)
    mixin, _ = fit(tmp_path, MuonRegression(accumulate_grad_batches=2, gradient_clip_val=0.05))
    assert same(both, mixin)


def test_trainer_flags_from_the_command_line(tmp_path):
    from lightning_muon.commands.lightning_cli import instantiate

    cli = instantiate(["--model", "helpers.MuonRegression", "--trainer.logger=false", "--trainer.max_epochs=2",
                       "--trainer.gradient_clip_val=0.05", "--trainer.accumulate_grad_batches=2",
                       "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
                       f"--trainer.default_root_dir={tmp_path}"])
    cli.trainer.fit(cli.model)
    expected, _ = fit(tmp_path, MuonRegression(accumulate_grad_batches=2, gradient_clip_val=0.05))
    assert same(snapshot(cli.model), expected)


# ------------------------------------------------------------------ StochasticWeightAveraging


def swa() -> StochasticWeightAveraging:
    return StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1, annealing_epochs=2)


def test_swa_on_the_adamw_baseline_anneals_as_on_a_plain_module(tmp_path):
    ours, theirs = LearningRates(), LearningRates()
    make_trainer(tmp_path, max_epochs=4, callbacks=[swa(), ours]).fit(MuonRegression(muon=None, adamw=ADAMW))
    make_trainer(tmp_path, max_epochs=4, callbacks=[swa(), theirs]).fit(PlainRegression())
    assert ours.lrs == theirs.lrs
    assert ours.lrs[:4] == [0.01] * 4 and ours.lrs[-1] == pytest.approx(1e-3)
    assert len(set(ours.lrs[4:8])) == 1 and 1e-3 < ours.lrs[4] < 0.01  # annealing, not at the SWA lr at once


def test_swa_with_the_pair_is_refused_before_training(tmp_path):
    model = MuonRegression()
    before = snapshot(model)
    pattern = r"^StochasticWeightAveraging works with one optimizer and MuonMixin trains with two \(Muon and AdamW\)"
    with pytest.raises(MisconfigurationException, match=pattern + r"\. Use muon=None.* WeightAveraging or "
                                                                   r"EMAWeightAveraging, which work with the pair"):
        make_trainer(tmp_path, max_epochs=2, callbacks=[swa()]).fit(model)
    assert same(snapshot(model), before)


# ------------------------------------------------------------------ lr_find


def test_lr_find_with_the_pair_is_refused_saying_what_to_do(tmp_path):
    model = MuonRegression()
    with pytest.raises(MisconfigurationException, match=r"lr_find \(LearningRateFinder\) sweeps the learning rate "
                                                         r"of one optimizer.*Run lr_find on the muon=None baseline"):
        Tuner(make_trainer(tmp_path, max_epochs=1)).lr_find(model, num_training=8)


def test_lr_find_on_the_baseline_reaches_the_next_fit(tmp_path):
    model = MuonRegression(muon=None, adamw=ADAMW)
    trainer = make_trainer(tmp_path, max_epochs=10)
    finder = Tuner(trainer).lr_find(model, num_training=20, early_stop_threshold=None)
    assert len(finder.results["loss"]) == 20 and all(torch.isfinite(torch.tensor(finder.results["loss"])))
    suggestion = finder.suggestion()
    assert suggestion is not None and suggestion != 1e-2
    assert model.hparams["adamw"]["init_args"]["lr"] == suggestion  # saved with the checkpoints too
    lrs = LearningRates()
    make_trainer(tmp_path, max_epochs=1, callbacks=[lrs]).fit(model)
    assert lrs.lrs == [suggestion] * 4
