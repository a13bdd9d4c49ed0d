"""What MuonMixin checks when a fit starts, through a real Trainer, before any weight moves.

Refused: Muon settings that cannot train, FSDP1 and DeepSpeed (before the strategy flattens anything), a module
with every parameter frozen, a string where a list of patterns belongs, a ``configure_optimizers`` replaced on the
instance (what the CLI's ``--optimizer`` does).
Said: a parent's hooks that will never run (a warning, once), a module with nothing for Muon (trains on AdamW
alone), and the parent's ``configure_optimizers`` the mixin's replaces (at INFO when only the optimizer differs,
a warning naming what else is lost when it had a scheduler).
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import warnings
from types import ModuleType, SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_muon import Muon, MuonMixin, WarmupCosine

from helpers import (
    MuonRegression,
    Regression,
    make_trainer,
    same,
    snapshot,
)


@pytest.mark.parametrize(
    ("muon", "pattern"),
    [
        ({"momentum": 1.0}, r"Invalid momentum value: 1\.0 \(must be in \[0, 1\)"),
        ({"momentum": 1.5}, r"Invalid momentum value: 1\.5 \(must be in \[0, 1\)"),
        ({"ns_steps": 0}, r"Invalid ns_steps: 0 \(must be an int in \[1, 100\)"),
    ],
    ids=["momentum-1", "momentum-1.5", "ns_steps-0"],
)
def test_settings_that_cannot_train_are_refused_before_the_first_update(tmp_path, muon, pattern):
    model = MuonRegression(muon=functools.partial(Muon, lr=0.02, **muon))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"could not build the `muon` optimizer .*" + pattern):
        make_trainer(tmp_path, max_steps=4).fit(model)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


#: The fit-start refusals of the strategies that flatten parameters.
FSDP1_REFUSED = r"MuonMixin cannot run under strategy='fsdp' \(FSDP1\): .*Use FSDP2: strategy=ModelParallelStrategy\(\)"
DEEPSPEED_REFUSED = (r"MuonMixin cannot run under DeepSpeed \(DeepSpeedStrategy\): the mixin trains a pair of "
                     r"optimizers, Muon .* and AdamW .*ZeRO stages flatten .*use FSDP2: "
                     r"strategy=ModelParallelStrategy\(\) .* DeepSpeed's own Muon")


def _not_built(strategy_class: type) -> object:
    """An instance of ``strategy_class`` whose constructor did not run (DeepSpeedStrategy's imports DeepSpeed)."""
    return strategy_class.__new__(strategy_class)


@pytest.mark.parametrize(("strategy", "refused"), [
    pytest.param(lambda: FSDPStrategy(), FSDP1_REFUSED, id="fsdp1"),
    pytest.param(lambda: _not_built(DeepSpeedStrategy), DEEPSPEED_REFUSED, id="deepspeed"),
])
def test_strategies_that_flatten_parameters_are_refused_as_the_fit_starts(strategy, refused):
    # FSDPStrategy needs a GPU to run, DeepSpeedStrategy DeepSpeed to be built: the check is called where Lightning
    # calls it, the first hook of a fit (configure_callbacks), before the strategy flattens anything
    model = MuonRegression()
    model.trainer = SimpleNamespace(strategy=strategy(), state=SimpleNamespace(fn="fit"))
    with pytest.raises(MisconfigurationException, match=refused):
        model.configure_callbacks()
    assert model._muon_fit is None  # nothing taken from the Trainer
    model.trainer = SimpleNamespace(
        strategy=SingleDeviceStrategy(torch.device("cpu")), lr_scheduler_configs=[], optimizers=[]
    )
    model.on_fit_start()  # the fit's other checks pass on a supported strategy


def test_deepspeed_is_refused_by_a_real_fit_before_deepspeed_or_its_cuda_checks_run(tmp_path, monkeypatch):
    # DeepSpeed stays out of the tests: its strategy's constructor only sets DeepSpeed's log level, so a stand-in
    # module takes that call; the fit is refused at its first hook, before the strategy's setup_environment (whose
    # "only supported on CUDA GPUs" would be the error without the check) and before anything of DeepSpeed runs
    from lightning.pytorch.strategies import deepspeed

    stand_in = ModuleType("deepspeed")
    stand_in.utils = SimpleNamespace(logging=SimpleNamespace(logger=logging.getLogger("deepspeed-stand-in")))
    monkeypatch.setitem(sys.modules, "deepspeed", stand_in)
    monkeypatch.setattr(deepspeed, "_DEEPSPEED_AVAILABLE", True)
    monkeypatch.setattr(deepspeed, "_DEEPSPEED_GREATER_EQUAL_0_16", True)
    model = MuonRegression()
    before = snapshot(model)
    trainer = make_trainer(tmp_path, max_steps=2, strategy=DeepSpeedStrategy(stage=2), gradient_clip_val=0.5)
    with pytest.raises(MisconfigurationException, match=DEEPSPEED_REFUSED):
        trainer.fit(model)
    assert trainer.gradient_clip_val == 0.5  # nothing borrowed from the Trainer
    assert same(snapshot(model), before)


def test_a_model_with_every_parameter_frozen_says_so(tmp_path):
    model = MuonRegression()
    model.requires_grad_(False)
    frozen = r"MuonRegression has no trainable parameter: every parameter has requires_grad=False"
    with pytest.raises(MisconfigurationException, match=frozen):
        make_trainer(tmp_path, max_steps=2).fit(model)


def test_a_string_pattern_gets_the_helpful_error(tmp_path):
    with pytest.raises(ValueError, match=r"must be a list of glob patterns, got the string 'net\.4\.weight'"):
        model = MuonRegression(adamw_params="net.4.weight")
        make_trainer(tmp_path, max_steps=1).fit(model)


class LinearParent(Regression):
    """Nothing for Muon: the only Linear is the output head."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 1))


class LinearModel(MuonMixin, LinearParent):
    pass


def test_model_without_hidden_matrices_trains_on_adamw_alone(tmp_path):
    model = LinearModel()
    trainer = make_trainer(tmp_path, max_steps=3)
    with pytest.warns(UserWarning, match="no parameter was routed to Muon"):
        trainer.fit(model)
    assert trainer.global_step == 3


class ClipsItself(Regression):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        raise AssertionError("never called")


class StepsItself(Regression):
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


class OwnHookModel(MuonMixin, Regression):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        raise AssertionError("never called")


def test_uncalled_hook_on_the_subclass_itself_is_warned_about_too(tmp_path):
    with pytest.warns(UserWarning, match="configure_gradient_clipping will never be called"):
        make_trainer(tmp_path, max_steps=1).fit(OwnHookModel())


# ------------------------------------------------------------------ the parent's configure_optimizers


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


REPLACED = ("OnlyAnOptimizer.configure_optimizers is replaced by MuonMixin's: it would have built SGD(lr=0.1) on 6 "
            "tensors; ")


@pytest.mark.parametrize(
    ("arguments", "told"),
    [
        # parent_lr=True: the parent's lr is the one trained at, only the optimizer choice differs.
        ({"parent_lr": True},
         REPLACED + "MuonMixin trains with Muon(lr=0.1) on 2 tensors and AdamW(lr=0.1) on 4 tensors."),
        # lrs given to the mixin (here AdamW's): the parent's lr gives way to them, which is said, not warned.
        ({"adamw": functools.partial(torch.optim.AdamW, lr=1e-3)},
         REPLACED + "MuonMixin trains with Muon(lr=0.02) on 2 tensors and AdamW(lr=0.001) on 4 tensors. Its lr (0.1) "
         "gives way to the lrs given to the mixin."),
        # a warmup's first lr is not the lr given (it said Muon(lr=0.002) under WarmupCosine's 0.1 start)
        ({"adamw": functools.partial(torch.optim.AdamW, lr=1e-3),
          "lr_scheduler": functools.partial(WarmupCosine, warmup_steps=4, total_steps=8)},
         REPLACED + "MuonMixin trains with Muon(lr=0.02) on 2 tensors and AdamW(lr=0.001) on 4 tensors. Its lr (0.1) "
         "gives way to the lrs given to the mixin."),
    ],
    ids=["parent_lr", "lrs-given", "lrs-given-with-warmup"],
)
def test_a_replaced_configure_optimizers_is_told_once_at_info_when_the_lrs_trained_at_are_chosen(
    arguments, told, tmp_path, caplog
):
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.filterwarnings("error", module="lightning_muon")
        make_trainer(tmp_path, max_epochs=2).fit(MuonOnlyAnOptimizer(**arguments))
    assert [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()] == [told]


LR_IGNORED = ("its lr (0.1) is not used: give the lrs to train at (muon=..., adamw=...), or parent_lr=True to train "
              "at the parent's lr and weight decay (AdamW at them, Muon at them with adjust_lr_fn='match_rms_adamw')")


def test_a_replaced_configure_optimizers_whose_lr_is_not_used_is_a_warning_saying_where_to_change_it(tmp_path):
    with pytest.warns(UserWarning) as record:
        make_trainer(tmp_path, max_epochs=1).fit(MuonOnlyAnOptimizer())
    told = [str(w.message) for w in record if "replaced" in str(w.message)]
    assert told == [
        "OnlyAnOptimizer.configure_optimizers is replaced by MuonMixin's: it would have built SGD(lr=0.1) on 6 "
        f"tensors; MuonMixin trains with Muon(lr=0.02) on 2 tensors and AdamW(lr=0.0003) on 4 tensors. Ignored: "
        f"{LR_IGNORED}."
    ]


def test_a_replaced_configure_optimizers_with_a_scheduler_is_a_warning_naming_it(tmp_path):
    with pytest.warns(UserWarning) as record:
        make_trainer(tmp_path, max_epochs=1).fit(MuonWithScheduler())
    told = [str(w.message) for w in record if "replaced" in str(w.message)]
    assert told == [
        "WithScheduler.configure_optimizers is replaced by MuonMixin's: it would have built SGD(lr=0.1) on 6 "
        "tensors; MuonMixin trains with Muon(lr=0.02) on 2 tensors and AdamW(lr=0.0003) on 4 tensors. Ignored: "
        f"{LR_IGNORED}; its scheduler (StepLR) will not run: pass lr_scheduler=... to the mixin."
    ]


def test_configure_optimizers_replaced_on_the_instance_is_refused(tmp_path):
    model = MuonRegression()
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # what CLI --optimizer does
    before = snapshot(model)
    with pytest.raises(MisconfigurationException, match=r"configure_optimizers was replaced.*--model\.muon"):
        make_trainer(tmp_path, max_steps=2).fit(model)
    assert all(torch.equal(p, before[n]) for n, p in snapshot(model).items())
