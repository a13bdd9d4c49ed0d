"""Every exit of a fit gives back what the fit borrowed, the exception path included.

Lightning calls the module's ``teardown`` only when a fit ends normally: a fit that raises (a bug in
``training_step``, the mixin's own skip limit) or is interrupted (``KeyboardInterrupt``, Lightning's graceful
shutdown) runs the callbacks' ``on_exception`` instead. Whatever the fit took (the Trainer's clipping and
accumulation flags, its ``GradientAccumulationScheduler``, the strategy's ``load_checkpoint``, the module's fit
state, the hooks on the optimizers and parameters, an unfinished update's gradients) must be back after each, so
that a second fit on the same Trainer (a notebook's usual next step) clips and accumulates as asked: checked here
by the gradient norm each of its updates steps with, its number of updates, and its weights bit for bit against a
fresh Trainer's fit from the same weights, under both Lightning packages.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import types

import lightning.pytorch
import pytest
import pytorch_lightning
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import MuonMixin
from lightning_muon.optim.norms import total_norm

from helpers import finetuning_classes, same, snapshot

PACKAGES = [pytest.param(lightning.pytorch, id="lightning.pytorch"),
            pytest.param(pytorch_lightning, id="pytorch_lightning")]

#: The clip value: every update's gradient norm here is above it, so each update is clipped to it.
CLIP = 0.05
#: 4 batches an epoch, 2 epochs, 2 micro-batches per update: 4 updates a fit.
UPDATES = 4


@functools.cache
def module_class(pl: types.ModuleType) -> type:
    """A small regression module of package ``pl`` under MuonMixin whose ``training_step`` goes wrong as told:
    a non-finite loss for its next ``nan_batches`` batches; ``fault`` (an exception) raised at the fourth batch (the
    second micro-batch of the second update, so an unfinished update's gradients are on the parameters)."""

    class Sine(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with torch.random.fork_rng():
                torch.manual_seed(0)
                self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
            self.nan_batches = 0
            self.fault: BaseException | None = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if self.nan_batches:
                self.nan_batches -= 1
                return loss * float("nan")
            if self.fault is not None and batch_idx == 3:
                raise self.fault
            return loss

        def train_dataloader(self):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)

    return type("MuonSine", (MuonMixin, Sine), {})


@functools.cache
def recorder_class(pl: types.ModuleType) -> type:
    """A callback of package ``pl`` recording the global gradient norm each update steps with (after the clip)."""

    class StepNorms(pl.Callback):
        def __init__(self) -> None:
            self.norms: list[float] = []

        def on_train_start(self, trainer, pl_module):
            def record(optimizer, args, kwargs):
                self.norms.append(float(total_norm([p.grad for p in pl_module.parameters() if p.grad is not None])))

            trainer.optimizers[0].register_step_pre_hook(record)  # Muon's: both optimizers' gradients are clipped

    return StepNorms


def accumulation(pl: types.ModuleType, how: str) -> dict:
    return ({"accumulate_grad_batches": 2} if how == "trainer" else
            {"callbacks": [pl.callbacks.GradientAccumulationScheduler({0: 2})]})


def make_trainer(pl: types.ModuleType, root, how: str) -> object:
    asked = accumulation(pl, how)
    callbacks = [recorder_class(pl)(), *asked.pop("callbacks", [])]
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=root, gradient_clip_val=CLIP, callbacks=callbacks, **asked)


def fail(trainer, model, fault: str) -> None:
    """Fit ``model`` on ``trainer``, ending as ``fault`` says, and check that it ended so."""
    if fault == "raise":
        model.fault = ValueError("a bug in training_step")
        with pytest.raises(ValueError, match="a bug in training_step"):
            trainer.fit(model)
    elif fault == "skip limit":
        model.nan_batches = 1000
        with pytest.warns(UserWarning, match="skipped an update"), \
                pytest.raises(RuntimeError, match="2 updates in a row had non-finite gradients"):
            trainer.fit(model)
        model.nan_batches = 0
    else:
        model.fault = KeyboardInterrupt()
        previous = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT from then on: put it back
        try:
            with contextlib.suppress(SystemExit):  # Lightning 2.6 exits after its graceful shutdown
                trainer.fit(model)
        finally:
            signal.signal(signal.SIGINT, previous)
        assert trainer.interrupted
    model.fault = None


@pytest.mark.parametrize("pl", PACKAGES)
@pytest.mark.parametrize("how", ["trainer", "scheduler"], ids=["accumulate_grad_batches", "accumulation-scheduler"])
@pytest.mark.parametrize("fault", ["raise", "skip limit", "interrupt"])
def test_a_second_fit_after_a_fit_that_ended_by_an_exception_clips_and_accumulates_as_asked(tmp_path, pl, how, fault):
    model = module_class(pl)(max_consecutive_skips=2)
    trainer = make_trainer(pl, tmp_path, how)
    callbacks, flags = list(trainer.callbacks), (trainer.gradient_clip_val, trainer.accumulate_grad_batches)
    fail(trainer, model, fault)

    # Everything the fit took is back: the Trainer reads as it was built.
    assert trainer.callbacks == callbacks  # the accumulation scheduler back, the fit's own callback gone
    assert (trainer.gradient_clip_val, trainer.accumulate_grad_batches) == flags
    assert "load_checkpoint" not in vars(trainer.strategy)  # the class's own again
    assert model._muon_fit is None and model._muon_loop._hooks == []
    model.muon_roles = model.muon_roles  # refused during a fit only

    start, steps = snapshot(model), trainer.global_step
    norms = trainer.callbacks[0].norms
    norms.clear()
    trainer.fit(model)
    assert trainer.global_step - steps == len(norms) == UPDATES  # 2 micro-batches per update
    assert norms == pytest.approx([CLIP] * UPDATES, rel=1e-4)  # each update clipped to CLIP

    fresh = module_class(pl)(max_consecutive_skips=2)
    fresh.load_state_dict(start)
    fresh_trainer = make_trainer(pl, tmp_path / "fresh", how)
    fresh_trainer.fit(fresh)
    assert same(snapshot(model), snapshot(fresh))
    assert fresh_trainer.callbacks[0].norms == norms


def test_the_skipped_updates_in_a_row_are_counted_again_from_the_next_fit(tmp_path):
    """After a fit stopped by the skip limit, the next fit's first non-finite update is skipped with a warning,
    not taken as one more in a row."""
    model = module_class(lightning.pytorch)(max_consecutive_skips=2)
    trainer = make_trainer(lightning.pytorch, tmp_path, "trainer")
    fail(trainer, model, "skip limit")
    start, skipped = snapshot(model), model.muon_skipped_updates
    model.nan_batches = 2  # the first update of the next fit
    with pytest.warns(UserWarning, match="MuonMixin skipped an update"):
        trainer.fit(model)
    assert model.muon_skipped_updates == skipped + 1
    assert trainer.callbacks[0].norms == pytest.approx([CLIP] * (UPDATES - 1), rel=1e-4)
    assert not same(snapshot(model), start)


def test_a_compiled_module_gets_lightnings_compiled_step_back_however_the_fit_ends(tmp_path):
    """``trainer.fit(torch.compile(model))``: Lightning gives the module a compiled ``training_step``, which the fit
    takes off (it would compile the whole update) and gives back at its end, the exception path included."""
    from lightning.pytorch.utilities.compile import to_uncompiled

    torch._dynamo.reset()
    model = module_class(lightning.pytorch)()
    trainer = make_trainer(lightning.pytorch, tmp_path, "trainer")
    model.fault = ValueError("a bug in training_step")
    with pytest.raises(ValueError, match="a bug in training_step"):
        trainer.fit(torch.compile(model, backend="eager"))
    compiled_step = vars(model)["training_step"]  # Lightning's, back on the module
    model.fault = None
    trainer.callbacks[0].norms.clear()
    trainer.fit(model)  # still compiled: Lightning's record of the compiler stays on the module
    assert vars(model)["training_step"] is compiled_step
    assert trainer.callbacks[0].norms == pytest.approx([CLIP] * UPDATES, rel=1e-4)
    assert to_uncompiled(model)._compiler_ctx is None


def test_a_fit_refused_after_it_took_the_flags_gives_them_back(tmp_path):
    """The mixin's own refusals after the fit took the Trainer's flags (a plain BackboneFinetuning, refused in
    ``setup``) end the fit by an exception too: the Trainer reads as it was built."""
    model_class, _ = finetuning_classes(lightning.pytorch)
    trainer = make_trainer(lightning.pytorch, tmp_path, "scheduler")
    trainer.callbacks.append(lightning.pytorch.callbacks.BackboneFinetuning())
    callbacks = list(trainer.callbacks)
    with pytest.raises(MisconfigurationException, match="BackboneFinetuning keeps one backbone learning rate"):
        trainer.fit(model_class())
    assert trainer.callbacks == callbacks and trainer.gradient_clip_val == CLIP
    assert "load_checkpoint" not in vars(trainer.strategy)
