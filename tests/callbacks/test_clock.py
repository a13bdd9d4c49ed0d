"""`WallClock` through a real Trainer and CSVLogger: elapsed and training time, samples and tokens at each
logging step, before each validation and at the end; and `count_tokens`, which counts a batch's tokens."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon.callbacks.clock import WallClock, count_tokens
from lightning_muon.commands.compare.runs import read_metrics


def test_count_tokens():
    assert count_tokens((torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 32, dtype=torch.long))) == 128
    assert count_tokens({"x": torch.zeros(4, 3, 8, 8), "y": torch.zeros(4, dtype=torch.long)}) is None
    assert count_tokens(torch.zeros(4, dtype=torch.long)) is None


def test_wall_clock_logs_time_and_samples(tmp_path):
    trainer = L.Trainer(
        max_steps=6, log_every_n_steps=2, val_check_interval=3, limit_val_batches=1, accelerator="cpu",
        logger=CSVLogger(tmp_path, name="", version="run"), callbacks=[WallClock()],
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    series = read_metrics(tmp_path / "run" / "metrics.csv")
    # every 2 steps (1, 3, 5), before each validation (2, 5) and at the end (5 again)
    assert [s for s, _ in series["time/samples"]] == [1, 2, 3, 5, 5]
    assert [v for _, v in series["time/samples"]] == [2.0, 3.0, 4.0, 6.0, 6.0]  # BoringModel: one sample a batch
    elapsed = [v for _, v in series["time/elapsed_s"]]
    train = [v for _, v in series["time/train_s"]]
    assert elapsed == sorted(elapsed) and train == sorted(train)
    assert all(t <= e for t, e in zip(train, elapsed)) and train[-1] < elapsed[-1]  # validation left out
    assert "time/tokens" not in series  # float inputs: no tokens


def test_wall_clock_needs_a_logger():
    trainer = L.Trainer(max_steps=1, logger=False, callbacks=[WallClock()], enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(MisconfigurationException, match="Cannot use WallClock with a Trainer that has no logger"):
        trainer.fit(BoringModel())
