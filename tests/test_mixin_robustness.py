"""MuonMixin robustness through a real Trainer: AMP, non-finite gradients, resume, refusals, odd parents."""

from __future__ import annotations

import functools
import math
import re
import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import Muon, MuonMixin, WarmupCosine

from helpers import make_trainer, read_metrics

MUON_NAMES = ["net.0.weight", "net.2.weight"]
ADAMW_NAMES = ["net.4.weight", "net.4.bias", "net.0.bias", "net.2.bias"]
N_SAMPLES, BATCH = 64, 8  # 8 batches per epoch


def regression_data(n: int = N_SAMPLES, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Parent(L.LightningModule):
    """A small deterministic regression MLP: two hidden matrices for Muon, the head and biases for AdamW."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def train_dataloader(self):
        return DataLoader(regression_data(), batch_size=BATCH, shuffle=False)


class Model(MuonMixin, Parent):
    pass


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


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


def raw_optimizers(model: L.LightningModule) -> list[torch.optim.Optimizer]:
    opts = model.optimizers()
    opts = opts if isinstance(opts, list) else [opts]
    return [o.optimizer for o in opts]


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


# ------------------------------------------------------------------ 1. 16-mixed with a real CPU GradScaler


class InfOnStep(Parent):
    """Parent whose chosen batch produces an inf gradient in ONE Muon matrix only (a grad hook)."""

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
    model = AmpInfModel()
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
    # An fp16 overflow is the scaler's business: no "skipped" warning, no count toward max_consecutive_skips.
    assert not [w for w in rec if "skipped an update" in str(w.message)]
    assert model._muon_loop.consecutive_skips == 0

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


# ------------------------------------------------------------------ 2. non-finite gradients outside AMP


class NanLoss(Parent):
    """Parent whose loss is NaN on the batches in ``nan_batches`` (all batches when it is None)."""

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
    assert model._muon_loop.consecutive_skips == 0  # reset by the next good update
    # Batch 2: not one weight moved, bitwise, and neither optimizer's state changed.
    assert recorder.changed(2) == set()
    muon_before, adamw_before = recorder.states_before[2]
    muon_after, adamw_after = recorder.states_after[2]
    assert len(muon_before) == 2 and len(adamw_before) == 4  # states exist (two updates before)
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


# ------------------------------------------------------------------ 3./4. checkpoints: exact resume, routing refusal

SCHEDULE = functools.partial(WarmupCosine, warmup_steps=2)


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory):
    """Two epochs straight, saving a checkpoint at the end of each epoch (both with the same total_steps)."""
    root = tmp_path_factory.mktemp("resume")
    model = Model(lr_scheduler=SCHEDULE)
    checkpoints = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = make_trainer(root, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints])
    trainer.fit(model)
    assert trainer.global_step == 16
    lrs = [g["lr"] for o in raw_optimizers(model) for g in o.param_groups]
    return {"params": snapshot(model), "lrs": lrs, "ckpt": root / "epoch=0.ckpt", "model": model}


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, two_epoch_run):
    path = two_epoch_run["ckpt"]
    checkpoint = torch.load(path, weights_only=True)  # hyperparameters and states are plain data
    assert checkpoint["global_step"] == 8 and checkpoint["epoch"] == 0
    assert len(checkpoint["optimizer_states"]) == 2
    assert len(checkpoint["lr_schedulers"]) == 2
    assert all(s["total_steps"] == 16 and s["last_epoch"] == 8 for s in checkpoint["lr_schedulers"])
    assert checkpoint["lightning_muon"]["routing"] == {"Muon": MUON_NAMES, "AdamW": ADAMW_NAMES}
    assert checkpoint["lightning_muon"]["skipped_updates"] == 0
    muon_state, adamw_state = checkpoint["optimizer_states"]
    assert [g["name"] for g in muon_state["param_groups"]] == ["hidden"]
    assert [n for g in muon_state["param_groups"] for n in g["param_names"]] == MUON_NAMES
    assert [n for g in adamw_state["param_groups"] for n in g["param_names"]] == ADAMW_NAMES
    hparams = checkpoint["hyper_parameters"]
    assert hparams["lr_scheduler"] == {
        "class_path": "lightning_muon.WarmupCosine",
        "init_args": {"warmup_steps": 2},
    }
    assert hparams["muon"]["class_path"] == "lightning_muon.Muon"
    assert hparams["adamw"]["class_path"] == "torch.optim.AdamW"

    resumed = Model(lr_scheduler=SCHEDULE)
    trainer = make_trainer(tmp_path, max_epochs=2)
    trainer.fit(resumed, ckpt_path=path)
    assert trainer.global_step == 16
    final = snapshot(resumed)
    expected = two_epoch_run["params"]
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    assert [g["lr"] for o in raw_optimizers(resumed) for g in o.param_groups] == two_epoch_run["lrs"]

    # Control: the same weights without the optimizer and scheduler states end elsewhere, so the
    # equality above really depends on both states being restored.
    fresh = Model(lr_scheduler=SCHEDULE)
    fresh.load_state_dict(checkpoint["state_dict"])
    make_trainer(tmp_path / "fresh", max_epochs=1).fit(fresh)
    assert not torch.equal(snapshot(fresh)["net.2.weight"], expected["net.2.weight"])


def test_load_from_checkpoint_rebuilds_the_same_configuration(two_epoch_run):
    loaded = Model.load_from_checkpoint(two_epoch_run["ckpt"], weights_only=True)
    original = two_epoch_run["model"]
    assert loaded._muon_config == original._muon_config
    assert isinstance(loaded._muon_config.lr_scheduler_factory, functools.partial)
    assert loaded._muon_config.lr_scheduler_factory.func is WarmupCosine
    assert loaded._muon_config.lr_scheduler_factory.keywords == {"warmup_steps": 2}
    assert loaded._muon_config.muon_factory.func is Muon
    assert loaded._muon_config.muon_factory.keywords == {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}


def test_resume_with_different_routing_is_refused(tmp_path, two_epoch_run):
    model = Model(lr_scheduler=SCHEDULE, adamw_params=["net.2.weight"])
    assert model.muon_routing().names("AdamW").count("net.2.weight") == 1
    trainer = make_trainer(tmp_path, max_epochs=2)
    with pytest.raises(MisconfigurationException, match="different routing") as error:
        trainer.fit(model, ckpt_path=two_epoch_run["ckpt"])
    message = str(error.value)
    assert "net.2.weight: was on Muon, not now" in message
    assert "net.2.weight: now on AdamW, was not" in message
    assert "net.0.weight" not in message  # only the differences are listed


# ------------------------------------------------------------------ 5. class order


def test_mixin_after_the_parent_fails_at_class_definition_with_the_fix():
    with pytest.raises(TypeError, match="MuonMixin must come first") as error:

        class Bad(Parent, MuonMixin):
            pass

    message = str(error.value)
    assert "Parent defines training_step" in message
    assert "class Bad(MuonMixin, Parent):" in message


def test_subclass_defining_configure_optimizers_fails_at_class_definition():
    with pytest.raises(TypeError, match=r"Bad defines configure_optimizers.*muon=\.\.\., adamw=\.\.\."):

        class Bad(MuonMixin, Parent):
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(TypeError, match="BadChild defines configure_optimizers"):  # further down, too

        class BadChild(Model):
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)


# ------------------------------------------------------------------ 6. training_step signatures and nesting


class NoBatchIdxParent(Parent):
    def training_step(self, batch):
        return self.loss(batch)


class DictParent(Parent):
    def training_step(self, batch, batch_idx):
        return {"loss": self.loss(batch), "batch_idx": batch_idx}


class NoBatchIdx(MuonMixin, NoBatchIdxParent):
    pass


class WithBatchIdx(MuonMixin, Parent):
    pass


class ReturnsDict(MuonMixin, DictParent):
    pass


class OwnStep(MuonMixin, Parent):
    def training_step(self, batch, batch_idx):
        return self.loss(batch) * 2.0


class CallsSuper(OwnStep):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 0.0


class CallsMixinSuper(MuonMixin, Parent):  # its own step wrapping the parent's through the mixin's
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)


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


# ------------------------------------------------------------------ 7. None returns


class NoneOnOdd(Parent):
    def __init__(self, none_batches: tuple[int, ...] = (1, 3, 5), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.none_batches = none_batches

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.none_batches else self.loss(batch)


class NoneModel(MuonMixin, NoneOnOdd):
    pass


def test_none_batches_get_no_backward_and_no_update(tmp_path, muon_steps):
    model = NoneModel()
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
    model = NoneModel(none_batches=(2, 3), accumulate_grad_batches=2)
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path, max_epochs=1, limit_train_batches=6, callbacks=[recorder])
    with pytest.warns(UserWarning, match="training_step returned None"):
        trainer.fit(model)
    # windows (0, 1), (2, 3), (4, 5): the all-None window neither updates nor counts as a step
    assert trainer.global_step == 2 == len(muon_steps)
    assert [bool(recorder.changed(i)) for i in range(6)] == [False, True, False, False, False, True]


# ------------------------------------------------------------------ 8. muon=None: the AdamW baseline


class PlainAdamW(Parent):
    """The same parent under Lightning's automatic optimization with the mixin's default AdamW."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)


def test_muon_none_is_exactly_plain_fused_adamw(tmp_path):
    baseline = Model(muon=None)
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

    plain = PlainAdamW()
    trainer = make_trainer(tmp_path / "plain", max_steps=6)
    trainer.fit(plain)
    assert trainer.global_step == 6
    ours, theirs = snapshot(baseline), snapshot(plain)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert not torch.equal(ours["net.2.weight"], snapshot(Parent())["net.2.weight"])  # it trained


# ------------------------------------------------------------------ 9. loud checks at fit start


def test_fsdp1_is_refused_at_fit_start():
    # FSDPStrategy needs a GPU to run at all, so the check is called as Lightning calls it, with the strategy set.
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy

    model = Model()
    model.trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(MisconfigurationException, match=r"strategy='fsdp'.*ModelParallelStrategy"):
        model.on_fit_start()
    model.trainer = SimpleNamespace(
        strategy=SingleDeviceStrategy(torch.device("cpu")), lr_scheduler_configs=[], optimizers=[]
    )
    model.on_fit_start()  # the same check passes on a supported strategy


def test_configure_optimizers_replaced_on_the_instance_is_refused(tmp_path):
    model = Model()
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # what CLI --optimizer does
    before = snapshot(model)
    with pytest.raises(MisconfigurationException, match=r"configure_optimizers was replaced.*--model\.muon"):
        make_trainer(tmp_path, max_steps=2).fit(model)
    assert all(torch.equal(p, before[n]) for n, p in snapshot(model).items())


class ClipsItself(Parent):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        raise AssertionError("never called")


class StepsItself(Parent):
    def optimizer_step(self, *args, **kwargs):
        raise AssertionError("never called")


class ClipsItselfModel(MuonMixin, ClipsItself):
    pass


class StepsItselfModel(MuonMixin, StepsItself):
    pass


@pytest.mark.parametrize(
    ("cls", "hook"),
    [(ClipsItselfModel, "ClipsItself.configure_gradient_clipping"), (StepsItselfModel, "StepsItself.optimizer_step")],
)
def test_parent_hooks_that_never_run_are_named_in_a_warning(tmp_path, cls, hook):
    trainer = make_trainer(tmp_path, max_steps=2)
    with pytest.warns(UserWarning, match=re.escape(hook) + " will never be called") as rec:
        trainer.fit(cls())
    assert sum("will never be called" in str(w.message) for w in rec) == 1
    assert trainer.global_step == 2


class OwnHookModel(MuonMixin, Parent):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        raise AssertionError("never called")


def test_uncalled_hook_on_the_subclass_itself_is_warned_about_too(tmp_path):
    with pytest.warns(UserWarning, match="configure_gradient_clipping will never be called"):
        make_trainer(tmp_path, max_steps=1).fit(OwnHookModel())


class TogglesParent(Parent):
    def training_step(self, batch, batch_idx):
        self.toggle_optimizer(self.trainer.optimizers[0])  # not self.optimizers(), refused first in training_step
        return self.loss(batch)


class TogglesModel(MuonMixin, TogglesParent):
    pass


def test_toggle_optimizer_raises(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"^toggle_optimizer switches off.*Muon and AdamW together"):
        make_trainer(tmp_path, max_steps=2).fit(TogglesModel())


# ------------------------------------------------------------------ 10. constructor errors


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"accumulate_grad_batches": 0}, ValueError, r"accumulate_grad_batches must be an int >= 1, got 0"),
        ({"accumulate_grad_batches": 1.5}, ValueError, r"accumulate_grad_batches must be an int >= 1, got 1\.5"),
        ({"accumulate_grad_batches": True}, ValueError, r"accumulate_grad_batches must be an int >= 1, got True"),
        ({"gradient_clip_val": 0}, ValueError, r"gradient_clip_val must be > 0 or None, got 0"),
        ({"gradient_clip_val": -1}, ValueError, r"gradient_clip_val must be > 0 or None, got -1"),
        ({"gradient_clip_val": float("nan")}, ValueError, r"gradient_clip_val must be > 0 or None, got nan"),
        ({"max_consecutive_skips": 0}, ValueError, r"max_consecutive_skips must be >= 1, got 0"),
        ({"adamw": None}, ValueError, r"adamw must be an optimizer factory"),
        ({"muon": {"class_path": "no.such.Class"}}, ValueError, r"cannot import 'no\.such\.Class'"),
        ({"muon": {"init_args": {"lr": 0.1}}}, ValueError, r"expected an optimizer/scheduler factory or a spec"),
    ],
)
def test_constructor_rejects_bad_configuration(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        Model(**kwargs)


# ------------------------------------------------------------------ bugs found while writing these tests


def test_a_string_pattern_gets_the_helpful_error(tmp_path):
    with pytest.raises(ValueError, match=r"must be a list of glob patterns, got the string 'net\.4\.weight'"):
        model = Model(adamw_params="net.4.weight")
        make_trainer(tmp_path, max_steps=1).fit(model)


class LinearParent(Parent):
    """Nothing for Muon: the only Linear is the output head."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 1))


class LinearModel(MuonMixin, LinearParent):
    pass


def test_model_without_hidden_matrices_trains_on_adamw_alone(tmp_path):
    model = LinearModel()
    trainer = make_trainer(tmp_path, max_steps=3)
    with pytest.warns(UserWarning, match="no parameter was routed to Muon"):
        trainer.fit(model)
    assert trainer.global_step == 3


def test_resuming_a_muon_checkpoint_into_the_adamw_baseline_is_refused_clearly(tmp_path, two_epoch_run):
    model = Model(muon=None, lr_scheduler=SCHEDULE)
    with pytest.raises(MisconfigurationException, match=r"different routing(.|\n)*net\.0\.weight: was on Muon"):
        make_trainer(tmp_path, max_epochs=2).fit(model, ckpt_path=two_epoch_run["ckpt"])


class ValidatesWithTrainingStep(Parent):
    """A common pattern: validation reuses training_step."""

    def validation_step(self, batch, batch_idx):
        loss = self.training_step(batch, batch_idx)
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self):
        return DataLoader(regression_data(16, seed=1), batch_size=BATCH)


class ValidatesWithTrainingStepModel(MuonMixin, ValidatesWithTrainingStep):
    pass


def test_validation_step_calling_training_step_does_not_backward_or_update(tmp_path, muon_steps):
    model = ValidatesWithTrainingStepModel()
    trainer = make_trainer(tmp_path, max_steps=4, val_check_interval=2)
    trainer.fit(model)
    assert trainer.global_step == 4 == len(muon_steps)
    assert "val_loss" in trainer.callback_metrics


class HugeGradParent(Parent):
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
    model = HugeGradModel(value=value, gradient_clip_val=1.0)
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path, max_steps=3, precision=precision, callbacks=[recorder])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert not [w for w in rec if "skipped an update" in str(w.message)]
    assert model.muon_skipped_updates == 0
    assert "net.2.weight" in recorder.changed(1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
