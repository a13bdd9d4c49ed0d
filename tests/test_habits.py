"""Every Lightning habit either works with MuonMixin or is refused clearly (issue 13).

Through a real Trainer on tiny CPU models, exact values: modules that optimize by hand are refused, schedulers
keep their interval/frequency/monitor contract, SWA on ``muon=None`` anneals as on a plain module, the
Trainer's clipping and accumulation flags (and ``GradientAccumulationScheduler``) equal the mixin's own
arguments bit for bit, ``lr_find`` is refused for the pair and reaches the next fit for ``muon=None``, and
``MuonMonitor`` beside ``LearningRateMonitor`` writes each lr key once.
"""

from __future__ import annotations

import functools
import logging
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    StochasticWeightAveraging,
)
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import MuonMixin, MuonMonitor

from helpers import make_trainer, read_metrics

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)


class Regression(L.LightningModule):
    """8 -> 16 -> 16 -> 1; 16 samples in batches of 4: 4 batches an epoch."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)


class MuonRegression(MuonMixin, Regression):
    pass


class PlainRegression(Regression):
    """The same network under automatic optimization, on the AdamW the mixin builds for ``muon=None``."""

    def __init__(self, scheduler=None) -> None:
        super().__init__()
        self.scheduler = scheduler

    def configure_optimizers(self):
        optimizer = ADAMW(self.parameters(), fused=True)
        if self.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler(optimizer)}


class LearningRates(Callback):
    """The first optimizer's first lr at every batch start (what that batch's update uses)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def params(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# ------------------------------------------------------------------ modules that optimize by hand


class GAN(L.LightningModule):
    """The Lightning docs' GAN shape: two optimizers, two losses, manual_backward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        fake = self.generator(batch[0])
        g_loss = -self.discriminator(fake).mean()
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        d_loss = self.discriminator(fake.detach()).mean()
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.discriminator.parameters())]


def test_a_gan_style_parent_is_defined_and_refused_when_built():
    class MuonGAN(MuonMixin, GAN):  # what a class merely contains refuses nothing
        pass

    with pytest.raises(MisconfigurationException) as error:
        MuonGAN()
    message = str(error.value)
    assert message.startswith("MuonGAN's parent sets automatic_optimization = False: MuonGAN optimizes by hand, but "
                              "MuonMixin owns the optimization step.")
    assert "lightning_muon.route_parameters(self.generator)" in message
    assert "Muon(routing.muon_groups) and torch.optim.AdamW(routing.adamw_groups)" in message


class ManualFlag(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class StepsByHand(Regression):
    """Steps the optimizer itself under automatic optimization's loss.backward()."""

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


class ManualFlagModel(MuonMixin, ManualFlag):
    pass


class StepsByHandModel(MuonMixin, StepsByHand):
    pass


def test_a_parent_that_sets_automatic_optimization_false_is_refused_when_built():
    with pytest.raises(MisconfigurationException, match=r"^ManualFlagModel's parent sets automatic_optimization = "
                                                         r"False: ManualFlagModel optimizes by hand"):
        ManualFlagModel()


def test_a_parent_that_calls_self_optimizers_is_refused_before_any_weight_moves(tmp_path):
    model = StepsByHandModel()
    before = params(model)
    pattern = r"^training_step calls self\.optimizers\(\): StepsByHandModel optimizes by hand, but MuonMixin owns"
    with pytest.raises(MisconfigurationException, match=pattern):
        make_trainer(tmp_path, max_steps=2).fit(model)
    assert same(params(model), before)


class DebugsGradients(Regression):
    """A helper that mentions manual_backward, never called."""

    def debug_gradients(self, loss):
        self.manual_backward(loss)
        return {n: p.grad for n, p in self.named_parameters()}


def test_a_parent_with_a_never_called_helper_that_mentions_manual_backward_trains_as_without_it(tmp_path):
    class MuonDebugsGradients(MuonMixin, DebugsGradients):
        pass

    model, reference = MuonDebugsGradients(), MuonRegression()
    make_trainer(tmp_path / "helper", max_steps=3).fit(model)
    make_trainer(tmp_path / "reference", max_steps=3).fit(reference)
    assert model.trainer.global_step == 3
    assert same(params(model), params(reference))


def passthrough(step):
    """An ordinary decorator."""

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        return step(self, *args, **kwargs)

    return wrapper


class DecoratedBackward(Regression):
    @passthrough
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.manual_backward(loss)
        return loss


class CallsBackward(Regression):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.manual_backward(loss)
        return loss


class SuperBackward(Regression):
    """``super().manual_backward`` from the parent goes around MuonMixin's (the mixin comes before it)."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        super().manual_backward(loss)
        return loss


class StepsKeptOptimizer(Regression):
    """Steps an optimizer it kept outside training_step, without calling self.optimizers() in it."""

    def on_train_start(self):
        self.kept = self.optimizers()[0]

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.kept.step()
        return loss


class StepsTrainerOptimizer(Regression):
    """Steps the Trainer's raw optimizer (AdamW) in training_step."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.trainer.optimizers[-1].step()
        return loss


class BareBackward(Regression):
    """``loss.backward()`` goes around Lightning altogether: its gradient would add to the loop's own."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        loss.backward()
        return loss


class BackwardInCallback(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.manual_backward(pl_module.loss(batch))


def with_mixin(parent):
    return lambda: type(f"Muon{parent.__name__}", (MuonMixin, parent), {})


def subclass_calling_the_parent_through_super():
    class MuonChain(MuonMixin, CallsBackward):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx)

    return MuonChain


def subclass_calling_super_manual_backward():
    class MuonSuperOfMixin(MuonMixin, Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            super().manual_backward(loss)  # the mixin's manual_backward
            return loss

    return MuonSuperOfMixin


OWN_BACKWARD = r"training_step runs a backward around MuonMixin \(super\(\)\.manual_backward\(\) or trainer\.strategy"


@pytest.mark.parametrize(
    ("build", "callback", "where"),
    [
        (with_mixin(DecoratedBackward), None, r"training_step calls manual_backward\(\)"),
        (subclass_calling_the_parent_through_super, None, r"training_step calls manual_backward\(\)"),
        (subclass_calling_super_manual_backward, None, r"training_step calls manual_backward\(\)"),
        (with_mixin(SuperBackward), None, OWN_BACKWARD),
        (with_mixin(Regression), BackwardInCallback(), r"a hook or callback outside training_step calls manual_back"),
        (with_mixin(StepsKeptOptimizer), None, r"training_step steps an optimizer itself \(opt\.step\(\)\)"),
        (with_mixin(StepsTrainerOptimizer), None, r"training_step steps an optimizer itself \(opt\.step\(\)\)"),
        (with_mixin(BareBackward), None, r"training_step runs a backward itself \(loss\.backward\(\)\)"),
    ],
    ids=["decorated", "super-chain", "super-of-mixin", "parent-super", "callback", "kept-optimizer", "raw-optimizer",
         "bare-backward"],
)
def test_a_backward_or_step_that_is_not_the_mixins_is_refused_at_its_first_call_before_any_weight_moves(
    tmp_path, build, callback, where
):
    model = build()()
    before = params(model)
    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[callback] if callback else [])
    with pytest.raises(MisconfigurationException, match=rf"^{where}.*: Muon\w+ optimizes by hand, but MuonMixin owns"):
        trainer.fit(model)
    assert trainer.global_step == 0
    assert same(params(model), before)


# ------------------------------------------------------------------------------ schedulers


def step_lr_every_epoch(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "interval": "epoch"}


def test_an_epoch_interval_scheduler_steps_once_per_epoch(tmp_path):
    lrs = LearningRates()
    model = MuonRegression(lr_scheduler=step_lr_every_epoch)
    trainer = make_trainer(tmp_path, max_epochs=3, callbacks=[lrs])
    trainer.fit(model)
    assert trainer.global_step == 12
    assert lrs.lrs == [0.02] * 4 + [0.01] * 4 + [0.005] * 4  # Muon's lr: halved at each epoch end, not each update
    assert [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs] == [3, 3]


def step_lr_every_second_batch(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "frequency": 2}


def test_a_step_scheduler_keeps_its_frequency_as_under_automatic_optimization(tmp_path):
    ours, theirs = LearningRates(), LearningRates()
    make_trainer(tmp_path, max_epochs=2, callbacks=[ours]).fit(
        MuonRegression(muon=None, adamw=ADAMW, lr_scheduler=step_lr_every_second_batch)
    )
    make_trainer(tmp_path, max_epochs=2, callbacks=[theirs]).fit(
        PlainRegression(lambda o: {**step_lr_every_second_batch(o), "interval": "step"})
    )
    assert ours.lrs == theirs.lrs == [0.01, 0.01, 0.005, 0.005, 0.0025, 0.0025, 0.00125, 0.00125]


class ConstantMetric(Regression):
    """Logs a metric that never improves: ReduceLROnPlateau(patience=0) halves the lr from the second epoch on."""

    def training_step(self, batch, batch_idx):
        self.log("flat", 1.0, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


class PlainConstantMetric(ConstantMetric, PlainRegression):
    pass


class MuonConstantMetric(MuonMixin, ConstantMetric):
    pass


def plateau(optimizer, monitor="flat", strict=True):
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    return {"scheduler": scheduler, "monitor": monitor, "strict": strict}


def test_reduce_lr_on_plateau_gets_its_metric_as_under_automatic_optimization(tmp_path):
    ours, theirs = LearningRates(), LearningRates()
    trainer = make_trainer(tmp_path, max_epochs=4, callbacks=[ours])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr scheduler dict contains the key")  # no "keys ignored"
        trainer.fit(MuonConstantMetric(muon=None, adamw=ADAMW, lr_scheduler=plateau))
    make_trainer(tmp_path, max_epochs=4, callbacks=[theirs]).fit(PlainConstantMetric(plateau))
    assert ours.lrs == theirs.lrs == [0.01] * 8 + [0.005] * 4 + [0.0025] * 4
    assert trainer.lr_scheduler_configs[0].monitor == "flat"


class StepMetric(Regression):
    def training_step(self, batch, batch_idx):
        self.log("flat_step", 1.0, on_step=True, on_epoch=False)
        return super().training_step(batch, batch_idx)


class PlainStepMetric(StepMetric, PlainRegression):
    pass


class MuonStepMetric(MuonMixin, StepMetric):
    pass


class UpdateLearningRates(Callback):
    """The lr each update uses, read where it steps."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def test_a_step_interval_plateau_scheduler_steps_each_update_as_under_automatic_optimization(tmp_path):
    ours, theirs = UpdateLearningRates(), UpdateLearningRates()
    per_step = functools.partial(plateau, monitor="flat_step")
    make_trainer(tmp_path, max_epochs=2, callbacks=[ours]).fit(
        MuonStepMetric(muon=None, adamw=ADAMW, lr_scheduler=lambda o: {**per_step(o), "interval": "step"})
    )
    make_trainer(tmp_path, max_epochs=2, callbacks=[theirs]).fit(
        PlainStepMetric(lambda o: {**per_step(o), "interval": "step"})
    )
    assert ours.lrs == theirs.lrs == [0.01, 0.01] + [0.01 / 2**k for k in range(1, 7)]


def test_a_plateau_scheduler_without_its_metric_fails_naming_it(tmp_path):
    model = MuonConstantMetric(muon=None, lr_scheduler=functools.partial(plateau, monitor="val_loss"))
    with pytest.raises(MisconfigurationException, match=r"ReduceLROnPlateau monitors 'val_loss', which was not "
                                                         r"logged\. Logged metrics: \['flat', 'train_loss'"):
        make_trainer(tmp_path, max_epochs=2).fit(model)


def test_a_plateau_scheduler_needs_a_monitor(tmp_path):
    model = MuonRegression(lr_scheduler=functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0))
    with pytest.raises(MisconfigurationException, match=r"ReduceLROnPlateau but names no metric to monitor: use "
                                                         r"lightning\.pytorch\.cli\.ReduceLROnPlateau"):
        make_trainer(tmp_path, max_epochs=1).fit(model)


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
    before = params(model)
    pattern = r"^StochasticWeightAveraging works with one optimizer and MuonMixin trains with two \(Muon and AdamW\)"
    with pytest.raises(MisconfigurationException, match=pattern + r"\. Use muon=None"):
        make_trainer(tmp_path, max_epochs=2, callbacks=[swa()]).fit(model)
    assert same(params(model), before)


# --------------------------------------------------------------------- Trainer flags


def fit(tmp_path, model, **trainer_kwargs) -> tuple[dict[str, torch.Tensor], L.Trainer]:
    trainer = make_trainer(tmp_path, max_epochs=2, **trainer_kwargs)
    trainer.fit(model)
    return params(model), trainer


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
    before = params(model)
    trainer = make_trainer(tmp_path, max_epochs=1, **trainer_kwargs)
    with pytest.raises(MisconfigurationException, match=pattern):
        trainer.fit(model)
    assert same(params(model), before)


def test_agreeing_values_in_both_places_are_fine(tmp_path):
    both, _ = fit(tmp_path, MuonRegression(accumulate_grad_batches=2, gradient_clip_val=0.05),
                  accumulate_grad_batches=2, gradient_clip_val=0.05)
    mixin, _ = fit(tmp_path, MuonRegression(accumulate_grad_batches=2, gradient_clip_val=0.05))
    assert same(both, mixin)


def test_trainer_flags_from_the_command_line(tmp_path):
    from lightning_muon.commands.lightning_cli import instantiate

    cli = instantiate(["--model", "test_habits.MuonRegression", "--trainer.logger=false", "--trainer.max_epochs=2",
                       "--trainer.gradient_clip_val=0.05", "--trainer.accumulate_grad_batches=2",
                       "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
                       f"--trainer.default_root_dir={tmp_path}"])
    cli.trainer.fit(cli.model)
    expected, _ = fit(tmp_path, MuonRegression(accumulate_grad_batches=2, gradient_clip_val=0.05))
    assert same(params(cli.model), expected)


# ------------------------------------------------------------------------------ lr_find


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


# --------------------------------------------------------------------- two lr monitors


def test_muon_monitor_beside_learning_rate_monitor_writes_each_lr_key_once(tmp_path, caplog):
    trainer = make_trainer(tmp_path, csv_dir=tmp_path, max_steps=6,
                           callbacks=[LearningRateMonitor(logging_interval="step"), MuonMonitor()])
    with caplog.at_level(logging.INFO):
        trainer.fit(MuonRegression())
    rows = read_metrics(tmp_path)
    keys = [k for k in rows[0] if k.startswith("lr-")]
    assert keys == ["lr-AdamW/head", "lr-AdamW/norms_and_biases", "lr-Muon/hidden"]
    for key in keys:
        steps = [r["step"] for r in rows if r[key]]
        assert steps == [str(s) for s in range(6)], key  # one value per step: no duplicate rows
    assert [r for r in rows if r.get("muon/effective_lr_max")]  # the monitor's own keys are still there
    told = [r.getMessage() for r in caplog.records if "LearningRateMonitor" in r.getMessage()]
    assert told == ["MuonMonitor: LearningRateMonitor logs the lr-* keys, so MuonMonitor leaves them out of its rows."]


# ---------------------------------------------------------------- the replaced configure_optimizers


class WithScheduler(Regression):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10)}


class MuonWithScheduler(MuonMixin, WithScheduler):
    pass


class OnlyAnOptimizer(Regression):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MuonOnlyAnOptimizer(MuonMixin, OnlyAnOptimizer):
    pass


def test_a_replaced_configure_optimizers_is_told_at_info_when_only_the_optimizer_differs(tmp_path, caplog):
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.filterwarnings("error", module="lightning_muon")
        make_trainer(tmp_path, max_epochs=2).fit(MuonOnlyAnOptimizer())
    told = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
    assert told == [
        "OnlyAnOptimizer.configure_optimizers is replaced by MuonMixin's: it would have built SGD(lr=0.1) on 6 "
        "tensors; MuonMixin trains with Muon(lr=0.02) on 2 tensors and AdamW(lr=0.0003) on 4 tensors."
    ]


def test_a_replaced_configure_optimizers_with_a_scheduler_is_a_warning_naming_it(tmp_path):
    with pytest.warns(UserWarning) as record:
        make_trainer(tmp_path, max_epochs=1).fit(MuonWithScheduler())
    told = [str(w.message) for w in record if "replaced" in str(w.message)]
    assert told == [
        "WithScheduler.configure_optimizers is replaced by MuonMixin's: it would have built SGD(lr=0.1) on 6 "
        "tensors; MuonMixin trains with Muon(lr=0.02) on 2 tensors and AdamW(lr=0.0003) on 4 tensors. Ignored: "
        "its scheduler (StepLR) will not run: pass lr_scheduler=... to the mixin."
    ]


def test_the_main_job_prints_no_warning_from_lightning_muon(tmp_path, caplog):
    """``lightning-muon fit --config gpt_muon.yaml``, shortened: its classes, callbacks and settings as shipped."""
    from pathlib import Path

    import lightning_muon
    from lightning_muon.commands.lightning_cli import instantiate

    package = Path(lightning_muon.__file__).parent
    candidates = (package / "configs" / "gpt_muon.yaml", package.parent / "configs" / "gpt_muon.yaml")
    config = next(p for p in candidates if p.exists())  # the packaged config, or where it was before
    cli = instantiate([
        "--config", str(config), "--trainer.max_steps=3", "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false", "--model.init_args.block_size=16",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.init_args.n_layer=1", "--model.init_args.n_embd=16",
        "--data.init_args.block_size=16", "--data.init_args.batch_size=4", "--data.init_args.max_bytes=60000",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
    ])
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    ours = [f"{w.filename}: {w.message}" for w in caught if f"{package.name}/" in w.filename.replace("\\", "/")]
    assert ours == []
    assert cli.trainer.global_step == 3
    assert any("GPT.configure_optimizers is replaced by MuonMixin's" in r.getMessage() for r in caplog.records)
