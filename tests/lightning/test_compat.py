"""Each wrapper of ``lightning_muon/lightning/_compat.py`` against the installed Lightning.

These are the package's only uses of Lightning's private API. A Lightning
release that renames or changes one of them fails here, naming the wrapper to
update, instead of training wrongly somewhere else.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, Callback, GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.core import optimizer as core_optimizer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.trainer import call
from torch import nn

from lightning_muon.commands.lightning_cli import instantiate
from lightning_muon.lightning import _compat

from helpers import MuonRegression

FIX = "Lightning {} changed this private API: update lightning_muon/lightning/_compat.py ({})"


@pytest.mark.parametrize(
    ("owner", "name", "wrapper"),
    [
        (_TrainingEpochLoop, "_should_accumulate", "ends_update"),
        (_TrainingEpochLoop, "_batches_that_stepped", "logger_step"),
        (LightningOptimizer, "_on_before_step", "one_optimizer_step"),
        (LightningOptimizer, "_on_after_step", "one_optimizer_step"),
        (call, "_call_callback_hooks", "call_on_before_optimizer_step"),
        (call, "_call_lightning_module_hook", "call_on_before_optimizer_step"),
        (_TrainingEpochLoop, "_num_ready_batches_reached", "ends_epoch"),
        (LearningRateFinder, "_update_attr", "lr_finder_updates_attr"),
        (core_optimizer, "_configure_optimizers", "optimizers_and_schedulers"),
        (BaseFinetuning, "_internal_optimizer_metadata", "store_finetuning_groups"),
        (BaseFinetuning, "_apply_mapping_to_param_groups", "store_finetuning_groups"),
    ],
)
def test_the_private_names_exist(owner, name, wrapper):
    present = hasattr(owner, name) or name in owner.__init__.__code__.co_names
    assert present, FIX.format(L.__version__, f"{wrapper}: {owner.__name__}.{name} is gone")


def test_the_checked_lightning_release_is_installed():
    major_minor = ".".join(L.__version__.split(".")[:2])
    assert major_minor in _compat.CHECKED_LIGHTNING, FIX.format(
        L.__version__, "check every wrapper against this release, then add it to CHECKED_LIGHTNING"
    )


#: 10 samples in batches of 2: 5 batches an epoch.
FIVE_BATCHES = {"samples": 10, "batch_size": 2}


class Record(Callback):
    """What each wrapper says at every training batch, and how often the optimizer hooks run."""

    def __init__(self) -> None:
        self.ends_update: list[bool] = []
        self.ends_epoch: list[bool] = []
        self.logger_steps: list[int] = []
        self.every: list[int] = []
        self.before_optimizer_step: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.ends_update.append(_compat.ends_update(trainer))
        self.ends_epoch.append(_compat.ends_epoch(trainer))
        self.logger_steps.append(_compat.logger_step(trainer))
        self.every.append(_compat.log_every_n_steps(trainer))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before_optimizer_step.append(type(optimizer).__name__)


def test_the_wrappers_drive_a_real_fit():
    """5 batches, 2 per update: updates end at batches 2, 4 and 5 (the epoch's last, partial group)."""
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, log_every_n_steps=3, callbacks=[record],
    )
    trainer.fit(MuonRegression(**FIVE_BATCHES, accumulate_grad_batches=2))
    assert record.ends_update == [False, True, False, True, True], FIX.format(L.__version__, "ends_update")
    assert record.ends_epoch == [False, False, False, False, True], FIX.format(L.__version__, "ends_epoch")
    assert record.logger_steps == [0, 0, 1, 1, 2], FIX.format(L.__version__, "logger_step")
    assert record.every == [3] * 5, FIX.format(L.__version__, "log_every_n_steps")
    # one_optimizer_step: two optimizers step per update, global_step counts updates.
    assert trainer.global_step == 3, FIX.format(L.__version__, "one_optimizer_step")
    # call_on_before_optimizer_step: the callback hook once per optimizer per update.
    assert record.before_optimizer_step == ["Muon", "AdamW"] * 3, FIX.format(
        L.__version__, "call_on_before_optimizer_step"
    )
    # set_accumulate_grad_batches: the loop counted 2 micro-batches per update; teardown put 1 back.
    assert trainer.accumulate_grad_batches == 1, FIX.format(L.__version__, "set_accumulate_grad_batches")


def test_cli_class_path_is_what_lightning_cli_stores(tmp_path):
    cli = instantiate(["--model", "helpers.MuonRegression", "--trainer.logger=false",
                       f"--trainer.default_root_dir={tmp_path}"])
    assert _compat.cli_class_path(cli.model.hparams) == "helpers.MuonRegression", FIX.format(
        L.__version__, "cli_class_path"
    )
    assert _compat.cli_class_path(MuonRegression().hparams) is None


def test_the_trainer_flags_are_taken_before_lightning_checks_them(tmp_path):
    """take_trainer_flags runs from configure_callbacks, which Trainer._run calls just before the check that
    refuses these flags (and GradientAccumulationScheduler) under manual optimization."""
    schedule = GradientAccumulationScheduler({0: 2})
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, gradient_clip_val=0.5, gradient_clip_algorithm="value", callbacks=[schedule],
    )
    trainer.fit(MuonRegression(**FIVE_BATCHES))  # Lightning would say "not supported for manual optimization"
    assert trainer.global_step == 3, FIX.format(L.__version__, "take_trainer_flags")
    # restore_trainer_flags: the Trainer reads as it was built.
    assert (trainer.gradient_clip_val, trainer.gradient_clip_algorithm) == (0.5, "value")
    assert schedule in trainer.callbacks and trainer.accumulate_grad_batches == 1


def test_lr_finder_updates_attr_reads_the_callbacks_setting():
    assert _compat.lr_finder_updates_attr(LearningRateFinder(update_attr=True))
    assert not _compat.lr_finder_updates_attr(LearningRateFinder(update_attr=False))


def test_optimizers_and_schedulers_reads_configure_optimizers_as_lightning_does():
    params = [nn.Parameter(torch.zeros(2))]
    sgd = torch.optim.SGD(params, lr=0.1)
    step = torch.optim.lr_scheduler.StepLR(sgd, 1)
    assert _compat.optimizers_and_schedulers(sgd) == ([sgd], [])
    assert _compat.optimizers_and_schedulers(([sgd], [step])) == ([sgd], [step])
    assert _compat.optimizers_and_schedulers({"optimizer": sgd, "lr_scheduler": {"scheduler": step}}) == ([sgd], [step])


def test_attached_trainer_is_the_fitting_trainer_and_none_outside_a_fit():
    model = MuonRegression()
    assert _compat.attached_trainer(model) is None, FIX.format(L.__version__, "attached_trainer")
    seen = []

    class See(Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(_compat.attached_trainer(pl_module) is trainer)

    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[See()])
    trainer.fit(model)
    assert seen == [True], FIX.format(L.__version__, "attached_trainer")


def test_validate_after_this_batch_decides_each_validation_of_a_fit():
    """Told from on_train_batch_end, the loop validates after exactly the batches asked for, whatever its
    val_check_interval (every 3 batches here); validates_by_batches says the loop counts batches."""
    asked, validated, by_batches = {2, 3, 7}, [], []

    class Validated(MuonRegression):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.loss(batch))

        def val_dataloader(self):
            return self.train_dataloader()

    class Steer(Callback):
        def on_train_start(self, trainer, pl_module):
            by_batches.append(_compat.validates_by_batches(trainer))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _compat.validate_after_this_batch(trainer, trainer.global_step in asked)

        def on_validation_end(self, trainer, pl_module):
            validated.append(trainer.global_step)

    trainer = L.Trainer(accelerator="cpu", max_steps=8, val_check_interval=3, check_val_every_n_epoch=None,
                        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[Steer()])
    trainer.fit(Validated())
    assert validated == [2, 3, 7], FIX.format(L.__version__, "validate_after_this_batch")
    assert by_batches == [True], FIX.format(L.__version__, "validates_by_batches")
