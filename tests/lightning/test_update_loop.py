"""MuonMixin's update loop through a real Trainer: one update per batch or accumulation window, and what it does
with gradients it cannot use.

``max_steps`` counts updates; accumulation takes N batches per update (equal to one batch N times larger, and
an epoch's last partial window still steps); clipping takes one global norm over both optimizers; every shape of
``training_step`` makes exactly one update per batch and a ``None`` loss none; non-finite gradients skip both
optimizers (in 32-true, and under 16-mixed's GradScaler) and stop the fit after ``max_consecutive_skips``;
finite gradients whose norm overflows are clipped, not skipped; an update that makes weights non-finite stops the
fit; ``muon=None`` is exactly plain fused AdamW.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_muon import Muon, MuonMixin

from helpers import (
    ADAMW_NAMES,
    MUON_NAMES,
    MuonRegression,
    PlainRegression,
    Recorder,
    Regression,
    make_trainer,
    raw_optimizers,
    read_metrics,
    sine_regression_loader,
    snapshot,
)


def state_snapshot(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    return {
        id(p): {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for p, s in optimizer.state.items()
    }


def states_equal(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        if a[key].keys() != b[key].keys():
            return False
        for k, v in a[key].items():
            w = b[key][k]
            if isinstance(v, torch.Tensor):
                if not torch.equal(v, w):
                    return False
            elif v != w:
                return False
    return True


class StepRecorder(Callback):
    """Parameters (and optionally optimizer states) before and after every training batch."""

    def __init__(self, with_states: bool = False) -> None:
        self.with_states = with_states
        self.before: list[dict[str, torch.Tensor]] = []
        self.after: list[dict[str, torch.Tensor]] = []
        self.states_before: list[list[dict]] = []
        self.states_after: list[list[dict]] = []
        self.grads_none_after: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(snapshot(pl_module))
        if self.with_states:
            self.states_before.append([state_snapshot(o) for o in raw_optimizers(pl_module)])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(snapshot(pl_module))
        self.grads_none_after.append(all(p.grad is None for p in pl_module.parameters()))
        if self.with_states:
            self.states_after.append([state_snapshot(o) for o in raw_optimizers(pl_module)])

    def changed(self, step: int) -> set[str]:
        return {n for n, p in self.before[step].items() if not torch.equal(p, self.after[step][n])}


@pytest.fixture
def muon_steps(monkeypatch):
    """Counts calls of Muon.step (the raw optimizer's step, which the mixin calls once per update)."""
    calls = []
    real = Muon.step

    def step(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Muon, "step", step)
    return calls


# ------------------------------------------------------------------ updates, accumulation, clipping


def test_max_steps_counts_updates_not_optimizer_steps(tmp_path):
    model = MuonRegression()
    recorder = Recorder()
    fit = make_trainer(tmp_path, csv_dir=tmp_path, max_steps=10, callbacks=[recorder])
    fit.fit(model)
    assert fit.global_step == 10
    assert recorder.batches == 10
    _, adamw = (o.optimizer for o in model.optimizers())
    assert all(s["step"].item() == 10 for s in adamw.state.values())


def test_accumulation_takes_n_batches_per_update_and_names_checkpoints_by_updates(tmp_path):
    model = MuonRegression(batch_size=2, samples=64, accumulate_grad_batches=4)  # 32 batches an epoch
    recorder = Recorder()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    fit = make_trainer(tmp_path, csv_dir=tmp_path, max_steps=10, callbacks=[recorder, checkpoints],
                       enable_checkpointing=True)
    fit.fit(model)
    assert fit.global_step == 10
    assert recorder.batches == 40
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt"]
    rows = read_metrics(tmp_path)
    steps = sorted({int(r["step"]) for r in rows if r.get("train_loss")})
    assert steps == list(range(10))  # logger steps are updates, one per 4 batches
    # The trainer is reusable afterwards: manual optimization's own check sees accumulate_grad_batches == 1 again.
    assert fit.accumulate_grad_batches == 1


def test_accumulating_four_micro_batches_of_two_equals_one_batch_of_eight(tmp_path):
    muon = functools.partial(Muon, lr=0.02, momentum=0.95, weight_decay=0.01, ns_dtype=torch.float32)
    torch.manual_seed(0)
    big = MuonRegression(batch_size=8, samples=64, muon=muon)
    torch.manual_seed(0)
    small = MuonRegression(batch_size=2, samples=64, muon=muon, accumulate_grad_batches=4)
    make_trainer(tmp_path / "big", max_steps=6).fit(big)
    make_trainer(tmp_path / "small", max_steps=6).fit(small)
    # Same gradients up to float32 summation order; fp32 Newton-Schulz keeps it that tight.
    for (name, a), b in zip(big.named_parameters(), small.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_last_partial_group_of_an_epoch_still_steps(tmp_path):
    model = MuonRegression(batch_size=8, samples=40, accumulate_grad_batches=2)  # 5 batches: 2 + 1 updates
    fit = make_trainer(tmp_path, max_epochs=2)
    fit.fit(model)
    assert fit.global_step == 6


class GradientsAtStep(Callback):
    """Records the gradients each raw optimizer sees when it steps (after the mixin's clipping)."""

    def __init__(self) -> None:
        self.before_clip: list[dict[str, torch.Tensor]] = []
        self.at_step: list[dict[str, torch.Tensor]] = []

    def on_fit_start(self, trainer, pl_module):
        names = {id(p): n for n, p in pl_module.named_parameters()}
        for lightning_optimizer in pl_module.optimizers():
            optimizer = lightning_optimizer.optimizer
            original = optimizer.step

            def step(*args, _original=original, _optimizer=optimizer, **kwargs):
                grads = {names[id(p)]: p.grad.clone() for g in _optimizer.param_groups for p in g["params"]}
                self.at_step.append(grads)
                return _original(*args, **kwargs)

            optimizer.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.before_clip.append({names[id(p)]: p.grad.clone() for g in optimizer.param_groups for p in g["params"]})


def test_clipping_clips_the_global_norm_over_both_optimizers_once(tmp_path):
    clip = 1e-3
    model = MuonRegression(gradient_clip_val=clip)
    spy = GradientsAtStep()
    make_trainer(tmp_path, max_steps=3, callbacks=[spy]).fit(model)
    assert len(spy.at_step) == 6  # two optimizers, three updates
    for update in range(3):
        before = {**spy.before_clip[2 * update], **spy.before_clip[2 * update + 1]}
        after = {**spy.at_step[2 * update], **spy.at_step[2 * update + 1]}
        assert set(before) == {n for n, _ in model.named_parameters()}
        norm_before = torch.linalg.vector_norm(torch.stack([g.norm() for g in before.values()]))
        norm_after = torch.linalg.vector_norm(torch.stack([g.norm() for g in after.values()]))
        assert norm_before > 10 * clip
        torch.testing.assert_close(norm_after, torch.tensor(clip), rtol=1e-4, atol=0)
        # One coefficient for every gradient of both optimizers: clipped globally, once.
        for name in before:
            torch.testing.assert_close(after[name], before[name] * (clip / norm_before), rtol=1e-4, atol=1e-12)


# ------------------------------------------------------------------ training_step signatures, None returns


class NoBatchIdxParent(Regression):
    def training_step(self, batch):
        return self.loss(batch)


class DictParent(Regression):
    def training_step(self, batch, batch_idx):
        return {"loss": self.loss(batch), "batch_idx": batch_idx}


class NoBatchIdx(MuonMixin, NoBatchIdxParent):
    pass


class WithBatchIdx(MuonMixin, Regression):
    pass


class ReturnsDict(MuonMixin, DictParent):
    pass


class OwnStep(MuonMixin, Regression):
    def training_step(self, batch, batch_idx):
        return self.loss(batch) * 2.0


class CallsSuper(OwnStep):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 0.0


class CallsMixinSuper(MuonMixin, Regression):  # its own step wrapping the parent's through the mixin's
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("cls", [NoBatchIdx, WithBatchIdx, ReturnsDict, OwnStep, CallsSuper, CallsMixinSuper])
def test_every_training_step_shape_makes_exactly_one_update_per_batch(tmp_path, cls, muon_steps):
    model = cls()
    calls = []
    model.net.register_forward_hook(lambda *_: calls.append(1))
    before = snapshot(model)
    trainer = make_trainer(tmp_path, max_steps=4)
    trainer.fit(model)
    assert trainer.global_step == 4
    assert len(calls) == 4  # one forward per batch: the parent's step ran once per batch
    assert len(muon_steps) == 4 and all(o is raw_optimizers(model)[0] for o in muon_steps)
    after = snapshot(model)
    for name in MUON_NAMES + ADAMW_NAMES:
        assert not torch.equal(before[name], after[name]), name


class NoneOnOdd(Regression):
    def __init__(self, none_batches: tuple[int, ...] = (1, 3, 5), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.none_batches = none_batches

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.none_batches else self.loss(batch)


class NoneModel(MuonMixin, NoneOnOdd):
    pass


def test_none_batches_get_no_backward_and_no_update(tmp_path, muon_steps):
    model = NoneModel(samples=32)  # 8 batches an epoch, of which the fit takes 6
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path, max_epochs=1, limit_train_batches=6, callbacks=[recorder])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert sum("training_step returned None" in str(w.message) for w in rec) == 1  # once, not per batch
    assert trainer.global_step == 3 == len(muon_steps)  # one update per batch that returned a loss
    everything = set(MUON_NAMES + ADAMW_NAMES)
    assert [recorder.changed(i) == everything for i in range(6)] == [True, False] * 3
    assert all(recorder.grads_none_after)  # no backward left gradients behind on the None batches


def test_none_for_a_whole_accumulation_window_makes_no_update(tmp_path, muon_steps):
    model = NoneModel(none_batches=(2, 3), accumulate_grad_batches=2, samples=32)
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path, max_epochs=1, limit_train_batches=6, callbacks=[recorder])
    with pytest.warns(UserWarning, match="training_step returned None"):
        trainer.fit(model)
    # windows (0, 1), (2, 3), (4, 5): the all-None window neither updates nor counts as a step
    assert trainer.global_step == 2 == len(muon_steps)
    assert [bool(recorder.changed(i)) for i in range(6)] == [False, True, False, False, False, True]


class ValidatesWithTrainingStep(Regression):
    """A common pattern: validation reuses training_step."""

    def validation_step(self, batch, batch_idx):
        loss = self.training_step(batch, batch_idx)
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self):
        return sine_regression_loader(self.trainer, samples=8, batch_size=4)


class ValidatesWithTrainingStepModel(MuonMixin, ValidatesWithTrainingStep):
    pass


def test_validation_step_calling_training_step_does_not_backward_or_update(tmp_path, muon_steps):
    model = ValidatesWithTrainingStepModel()
    trainer = make_trainer(tmp_path, max_steps=4, val_check_interval=2)
    trainer.fit(model)
    assert trainer.global_step == 4 == len(muon_steps)
    assert "val_loss" in trainer.callback_metrics


# ------------------------------------------------------------------ 16-mixed with a real CPU GradScaler


class InfOnStep(Regression):
    """`Regression` whose chosen batch produces an inf gradient in ONE Muon matrix only (a grad hook)."""

    inf_batch = 2

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._poison = False
        self.net[2].weight.register_hook(lambda g: torch.full_like(g, math.inf) if self._poison else g)

    def training_step(self, batch, batch_idx):
        self._poison = batch_idx == self.inf_batch
        return super().training_step(batch, batch_idx)


class AmpInfModel(MuonMixin, InfOnStep):
    pass


def test_16_mixed_cpu_scaler_one_update_same_scale_and_overflow_skips_both(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    updates, unscales = [], []
    real_update, real_unscale = scaler.update, scaler.unscale_

    def update(*args, **kwargs):
        updates.append(scaler.get_scale())
        return real_update(*args, **kwargs)

    def unscale_(optimizer):
        unscales.append((optimizer, scaler.get_scale()))
        return real_unscale(optimizer)

    scaler.update, scaler.unscale_ = update, unscale_
    model = AmpInfModel(max_consecutive_skips=1)  # a skip that counted toward it would stop the fit at once
    dtypes = []
    model.net[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    recorder = StepRecorder()
    trainer = make_trainer(
        tmp_path,
        max_steps=6,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        callbacks=[recorder],
    )
    assert trainer.precision_plugin.scaler is scaler
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.fit(model)
    # An fp16 overflow is the scaler's business: no "skipped" warning, no count toward max_consecutive_skips
    # (the fit ran to its end under max_consecutive_skips=1).
    assert not [w for w in rec if "skipped an update" in str(w.message)]

    assert trainer.global_step == 6
    assert dtypes == [torch.float16] * 6  # really fp16 autocast, not a silent bf16
    assert len(updates) == 6 == trainer.global_step  # one scaler update per update, not per optimizer
    muon, adamw = raw_optimizers(model)
    assert [o for o, _ in unscales] == [muon, adamw] * 6  # each optimizer unscaled once per update
    per_update = [(unscales[2 * i][1], unscales[2 * i + 1][1]) for i in range(6)]
    assert all(a == b for a, b in per_update)  # both optimizers unscaled with the same scale
    # The scale only changed at the injected overflow: halved once (growth_interval 2000 is never reached).
    assert [a for a, _ in per_update] == [1024.0] * 3 + [512.0] * 3
    assert scaler.get_scale() == 512.0

    # The overflow was in one Muon matrix only, yet BOTH optimizers skipped: nothing moved on batch 2.
    assert recorder.changed(2) == set()
    assert model.muon_skipped_updates == 1
    everything = set(MUON_NAMES + ADAMW_NAMES)
    for step in (0, 1, 3, 4, 5):  # and every other update moved every parameter, including right after
        assert recorder.changed(step) == everything, step
    for p in model.parameters():
        assert torch.isfinite(p).all()


class NaNLoss(MuonRegression):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * float("nan")


def test_16_mixed_with_every_update_skipped_by_the_scaler_stops_instead_of_completing(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu")  # the default initial scale, 2**16
    model = NaNLoss()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(tmp_path, max_steps=200, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    with pytest.warns(UserWarning, match=r"GradScaler skipped 5 updates in a row"):  # noqa: SIM117
        with pytest.raises(RuntimeError, match=r"skipped the last 17 updates and its scale fell to 0\.5.*the loss "
                                               r"itself is NaN"):
            trainer.fit(model)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # nothing moved, and it says so


# ------------------------------------------------------------------ non-finite gradients and weights outside AMP


class NanLoss(Regression):
    """`Regression` whose loss is NaN on the batches in ``nan_batches`` (all batches when it is None)."""

    def __init__(self, nan_batches: tuple[int, ...] | None = (2,), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nan_batches = nan_batches

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.nan_batches is None or batch_idx in self.nan_batches:
            loss = loss * float("nan")
        return loss


class NanModel(MuonMixin, NanLoss):
    pass


def test_nan_gradient_32_true_skips_both_optimizers_warns_and_logs(tmp_path):
    model = NanModel(nan_batches=(2,))
    recorder = StepRecorder(with_states=True)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = make_trainer(tmp_path, max_steps=5, callbacks=[recorder], logger=logger, log_every_n_steps=1)
    skip_message = r"MuonMixin skipped an update: non-finite gradients in .*net\.2\.weight"
    with pytest.warns(UserWarning, match=skip_message) as rec:
        trainer.fit(model)
    skip_warnings = [w for w in rec if "MuonMixin skipped an update" in str(w.message)]
    assert len(skip_warnings) == 1
    message = str(skip_warnings[0].message)
    for name in MUON_NAMES + ADAMW_NAMES:  # every parameter got a NaN gradient and is named
        assert name in message

    assert trainer.global_step == 5  # the skipped update still counts as a step
    assert model.muon_skipped_updates == 1
    trainer.save_checkpoint(tmp_path / "end.ckpt")  # the loop's counts, as a resume would restore them
    record = torch.load(tmp_path / "end.ckpt", weights_only=True)["lightning_muon"]
    assert record["skipped_updates"] == 1 and record["consecutive_skips"] == 0  # reset by the next good update
    # Batch 2: not one weight moved, bitwise, and neither optimizer's state changed.
    assert recorder.changed(2) == set()
    muon_before, adamw_before = recorder.states_before[2]
    muon_after, adamw_after = recorder.states_after[2]
    assert (len(muon_before), len(adamw_before)) == (len(MUON_NAMES), len(ADAMW_NAMES))  # states exist (two updates)
    assert all("momentum_buffer" in s for s in muon_before.values())
    assert all("exp_avg" in s and "exp_avg_sq" in s for s in adamw_before.values())
    assert states_equal(muon_before, muon_after)
    assert states_equal(adamw_before, adamw_after)
    # The other updates moved every parameter and changed both states; no weight ever went non-finite.
    for step in (0, 1, 3, 4):
        assert recorder.changed(step) == set(MUON_NAMES + ADAMW_NAMES), step
    assert not states_equal(recorder.states_before[3][0], recorder.states_after[3][0])
    assert not states_equal(recorder.states_before[3][1], recorder.states_after[3][1])
    assert all(torch.isfinite(p).all() for p in model.parameters())

    rows = read_metrics(logger.log_dir)
    skipped = [(int(r["step"]), float(r["muon/skipped_steps"])) for r in rows if r.get("muon/skipped_steps")]
    # A cumulative count: first logged at the skipped step (logger step 2); Lightning re-reports the last value
    # of a step metric on later steps of the epoch, which for a running count is still right.
    assert skipped[0] == (2, 1.0)
    assert all(value == 1.0 for _, value in skipped)
    assert min(step for step, _ in skipped) == 2  # nothing logged before the skip


def test_nan_every_step_stops_after_max_consecutive_skips(tmp_path):
    model = NanModel(nan_batches=None, max_consecutive_skips=3)
    initial = snapshot(model)
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path, max_steps=10, callbacks=[recorder])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=r"3 updates in a row had non-finite gradients \(in .*net\.0\.weight"):
            trainer.fit(model)
    assert sum("MuonMixin skipped an update" in str(w.message) for w in rec) == 2  # updates 1 and 2 warned
    assert model.muon_skipped_updates == 3
    assert len(recorder.before) == 3  # the third batch raised
    final = snapshot(model)
    assert all(torch.equal(initial[n], final[n]) for n in initial)  # no weight ever changed
    for step in range(len(recorder.after)):
        assert recorder.changed(step) == set()


class HugeGradParent(Regression):
    """Batch 1 gives one Muon matrix a huge but FINITE gradient."""

    def __init__(self, value: float = 1e20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.value = value
        self._poison = False
        self.net[2].weight.register_hook(lambda g: torch.full_like(g, self.value) if self._poison else g)

    def training_step(self, batch, batch_idx):
        self._poison = batch_idx == 1
        return super().training_step(batch, batch_idx)


class HugeGradModel(MuonMixin, HugeGradParent):
    pass


@pytest.mark.parametrize(("precision", "value"), [("16-true", 3000.0), ("32-true", 1e20)])
def test_finite_gradients_with_an_overflowing_norm_are_clipped_not_skipped(tmp_path, precision, value):
    # 32x32 hidden matrices: 3000 in each entry of one is a norm of 96000, past fp16's 65504.
    model = HugeGradModel(value=value, widths=(32, 32), gradient_clip_val=1.0)
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path, max_steps=3, precision=precision, callbacks=[recorder])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert not [w for w in rec if "skipped an update" in str(w.message)]
    assert model.muon_skipped_updates == 0
    assert "net.2.weight" in recorder.changed(1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_weights_made_non_finite_by_an_update_stop_the_fit_naming_them(tmp_path):
    """Finite gradients, an AdamW lr of 1e38: the first update makes the AdamW weights inf."""
    model = MuonRegression(adamw=functools.partial(torch.optim.AdamW, lr=1e38))
    with pytest.raises(RuntimeError, match=r"turned weights non-finite, from finite gradients: net\.0\.weight "
                                           r"\(AdamW, lr 1e\+38\).*lower it"):
        make_trainer(tmp_path, max_steps=3).fit(model)
    assert model.trainer.global_step == 1  # stopped in the update that made them, not steps later


# ------------------------------------------------------------------ muon=None: the AdamW baseline


def test_muon_none_is_exactly_plain_fused_adamw(tmp_path):
    baseline = MuonRegression(muon=None)
    make_trainer(tmp_path / "mixin", max_steps=6).fit(baseline)
    (optimizer,) = raw_optimizers(baseline)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["fused"] is True
    assert optimizer.defaults["lr"] == 3e-4 and optimizer.defaults["betas"] == (0.9, 0.95)
    assert optimizer.defaults["weight_decay"] == 0.0
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(held) == len(set(map(id, held))) == 6
    assert set(map(id, held)) == set(map(id, baseline.parameters()))
    assert all(optimizer.state[p]["step"] == 6 for p in held)

    plain = PlainRegression(lr=3e-4)  # the mixin's default AdamW, under automatic optimization
    trainer = make_trainer(tmp_path / "plain", max_steps=6)
    trainer.fit(plain)
    assert trainer.global_step == 6
    ours, theirs = snapshot(baseline), snapshot(plain)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert not torch.equal(ours["net.2.weight"], snapshot(Regression())["net.2.weight"])  # it trained
