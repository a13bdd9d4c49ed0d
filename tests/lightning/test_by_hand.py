"""Modules that optimize by hand, under MuonMixin, which owns the optimization step: refused with the fix before
any weight moves.

Through a real Trainer: a parent that sets ``automatic_optimization = False`` (a GAN) is refused when the module
is built; ``self.optimizers()``, ``manual_backward``, an optimizer's ``step`` or ``toggle_optimizer`` in
``training_step`` (decorated, through ``super()``, from a callback, on an optimizer kept aside) are refused at
their first call; a never-called helper that mentions ``manual_backward`` trains as without it.
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_muon import MuonMixin

from helpers import (
    MuonRegression,
    Regression,
    make_trainer,
    same,
    snapshot,
)


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
    before = snapshot(model)
    pattern = r"^training_step calls self\.optimizers\(\): StepsByHandModel optimizes by hand, but MuonMixin owns"
    with pytest.raises(MisconfigurationException, match=pattern):
        make_trainer(tmp_path, max_steps=2).fit(model)
    assert same(snapshot(model), before)


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
    assert same(snapshot(model), snapshot(reference))


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
    before = snapshot(model)
    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[callback] if callback else [])
    with pytest.raises(MisconfigurationException, match=rf"^{where}.*: Muon\w+ optimizes by hand, but MuonMixin owns"):
        trainer.fit(model)
    assert trainer.global_step == 0
    assert same(snapshot(model), before)


class TogglesParent(Regression):
    def training_step(self, batch, batch_idx):
        self.toggle_optimizer(self.trainer.optimizers[0])  # not self.optimizers(), refused first in training_step
        return self.loss(batch)


class TogglesModel(MuonMixin, TogglesParent):
    pass


def test_toggle_optimizer_raises(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"^toggle_optimizer switches off.*Muon and AdamW together"):
        make_trainer(tmp_path, max_steps=2).fit(TogglesModel())
