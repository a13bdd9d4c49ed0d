"""Lightning's weight averaging (``EMAWeightAveraging``, ``WeightAveraging``) with the Muon and AdamW pair, through a
real Trainer.

The callbacks average the weights after each update: they read ``trainer.global_step`` at every batch end, which
the mixin advances once per update (not once per optimizer, not once per micro-batch). So the averaged weights are
the hand-computed average of the weights after each update, with gradient accumulation too; validation runs on the
average; and a fit resumed from a checkpoint ends with the uninterrupted fit's averaged (and current) weights, bit
for bit.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging

from helpers import MuonRegression, epoch_checkpoints, make_trainer, snapshot

DECAY = 0.9  # far from 1, so that every update's weights weigh in the average


class AfterEachUpdate(L.Callback):
    """The model's weights after each update (at the batch end where ``global_step`` advanced), and its weights
    when each validation starts."""

    def __init__(self) -> None:
        self.updates: list[dict[str, torch.Tensor]] = []
        self.validated: list[dict[str, torch.Tensor]] = []
        self._seen = 0

    def on_train_start(self, trainer, pl_module):
        self._seen = trainer.global_step  # a resumed fit's first update is the one after the checkpoint's

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > self._seen:
            self._seen = trainer.global_step
            self.updates.append(snapshot(pl_module))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            self.validated.append(snapshot(pl_module))


class Validated(MuonRegression):
    """`MuonRegression` with a validation set (its training samples), so that the callbacks swap the average in."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def val_dataloader(self):
        return self.train_dataloader()


def ema(updates: list[dict[str, torch.Tensor]], decay: float = DECAY) -> dict[str, torch.Tensor]:
    """``torch.optim.swa_utils.get_ema_avg_fn``'s average by hand: the first update's weights, then
    ``decay * average + (1 - decay) * weights`` at each later update."""
    average = dict(updates[0])
    for weights in updates[1:]:
        average = {n: decay * average[n] + (1 - decay) * weights[n] for n in average}
    return average


def mean(updates: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The plain average of the weights after each update (``WeightAveraging``'s default, as SWA averages)."""
    return {n: torch.stack([weights[n] for weights in updates]).mean(dim=0) for n in updates[0]}


def averaged(callback: WeightAveraging) -> dict[str, torch.Tensor]:
    assert callback._average_model is not None
    return snapshot(callback._average_model.module)


@pytest.mark.parametrize("accumulate", [1, 3], ids=["each-batch", "accumulate-3"])
def test_ema_of_the_pair_is_the_hand_computed_ema_of_the_weights_after_each_update(tmp_path, accumulate):
    """16 batches an epoch: 16 updates, or 6 with 3 micro-batches each (the last group of an epoch is partial)."""
    model = MuonRegression(samples=64, accumulate_grad_batches=accumulate)
    callback, record = EMAWeightAveraging(decay=DECAY), AfterEachUpdate()
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[callback, record])
    trainer.fit(model)
    assert trainer.global_step == len(record.updates) == (16 if accumulate == 1 else 6)
    assert callback._average_model is not None and int(callback._average_model.n_averaged) == trainer.global_step
    expected = ema(record.updates)
    for name, value in averaged(callback).items():
        assert torch.equal(value, expected[name]), name
    # The fit ends on the average (the callback copies it in), and it is not the last update's weights.
    assert snapshot(model).keys() == expected.keys()
    assert all(torch.equal(value, expected[name]) for name, value in snapshot(model).items())
    assert not torch.equal(expected["net.2.weight"], record.updates[-1]["net.2.weight"])


def test_weight_averaging_of_the_pair_is_the_mean_of_the_weights_after_each_update(tmp_path):
    model = MuonRegression(samples=32, accumulate_grad_batches=2)
    callback, record = WeightAveraging(), AfterEachUpdate()
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[callback, record])
    trainer.fit(model)
    assert trainer.global_step == len(record.updates) == 8
    expected = mean(record.updates)
    for name, value in averaged(callback).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_validation_runs_on_the_average_and_training_goes_on_from_the_current_weights(tmp_path):
    """Validation every 2 updates sees the EMA of the updates so far; the training weights come back after it."""
    model = Validated(samples=32)
    callback, record = EMAWeightAveraging(decay=DECAY), AfterEachUpdate()
    make_trainer(tmp_path, max_epochs=1, val_check_interval=2, callbacks=[callback, record]).fit(model)
    assert len(record.updates) == 8 and len(record.validated) == 4
    for k, seen in enumerate(record.validated):
        expected = ema(record.updates[: 2 * (k + 1)])
        assert all(torch.equal(seen[n], expected[n]) for n in expected), k
    # Control for the swap back: the straight fit without validation makes the same updates.
    plain = AfterEachUpdate()
    make_trainer(tmp_path / "plain", max_epochs=1, callbacks=[EMAWeightAveraging(decay=DECAY), plain]).fit(
        MuonRegression(samples=32))
    for ours, theirs in zip(record.updates, plain.updates, strict=True):
        assert all(torch.equal(ours[n], theirs[n]) for n in ours)


@pytest.mark.parametrize("make_callback", [lambda: EMAWeightAveraging(decay=DECAY), WeightAveraging],
                         ids=["EMAWeightAveraging", "WeightAveraging"])
def test_a_resumed_fit_ends_with_the_uninterrupted_fits_average(tmp_path, make_callback):
    """Two epochs of 4 updates (2 micro-batches each) straight, and the second epoch again from the first one's
    checkpoint: the same averaged weights, the same current weights, the same number of updates averaged."""
    straight_callback, straight = make_callback(), AfterEachUpdate()
    make_trainer(tmp_path / "straight", max_epochs=2, enable_checkpointing=True,
                 callbacks=[straight_callback, straight, epoch_checkpoints(tmp_path)]).fit(
        MuonRegression(samples=32, accumulate_grad_batches=2))
    checkpoint = torch.load(tmp_path / "epoch0.ckpt", weights_only=True)
    # The checkpoint holds the average as its weights and the training weights beside them.
    assert torch.equal(checkpoint["current_model_state"]["net.2.weight"], straight.updates[3]["net.2.weight"])
    assert not torch.equal(checkpoint["state_dict"]["net.2.weight"], straight.updates[3]["net.2.weight"])

    resumed_callback, resumed = make_callback(), AfterEachUpdate()
    trainer = make_trainer(tmp_path / "resumed", max_epochs=2, callbacks=[resumed_callback, resumed])
    trainer.fit(MuonRegression(samples=32, accumulate_grad_batches=2), ckpt_path=tmp_path / "epoch0.ckpt")
    assert trainer.global_step == 8 and len(resumed.updates) == 4
    for ours, theirs in zip(resumed.updates, straight.updates[4:], strict=True):  # resumed from the training weights
        assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert resumed_callback._average_model is not None and straight_callback._average_model is not None
    assert int(resumed_callback._average_model.n_averaged) == int(straight_callback._average_model.n_averaged) == 8
    expected = averaged(straight_callback)
    assert all(torch.equal(value, expected[name]) for name, value in averaged(resumed_callback).items())
