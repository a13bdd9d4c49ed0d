"""The parent's learning rate against the mixin's own, on LightningModules other libraries ship.

``MuonMixin(parent_lr=True)`` trains with the learning rate and weight decay of the parent's
``configure_optimizers`` (AdamW at them, Muon at them with ``adjust_lr_fn="match_rms_adamw"``); without it, the
mixin's defaults (Muon 0.02, AdamW 3e-4). Three forecasting modules on synthetic series, each trained
``--steps`` updates per setting and seed through its library's own data pipeline (pytorch-forecasting's
TemporalFusionTransformer and N-BEATS, gluonts' DeepAR through its estimator); the figure is the mean training
loss of the last 20 updates (lower is better; DeepAR's is a negative log-likelihood).

    python benchmarks/parent_lr.py              # 150 updates, seeds 0 and 1: prints a markdown table
"""

from __future__ import annotations

import argparse
import functools
import logging
import tempfile
import warnings
from unittest import mock

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch

from lightning_muon import Muon, MuonMixin

import _common

STEPS = 150


class Losses(pl.Callback):
    """The training loss of every update."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.values.append(float(loss))


def factories(setting: str, lr: float, wd: float) -> dict:
    """The mixin's arguments for a setting: its defaults, or what ``parent_lr=True`` builds from (lr, wd)."""
    if setting == "defaults":
        return {}
    return {"muon": functools.partial(Muon, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw"),
            "adamw": functools.partial(torch.optim.AdamW, lr=lr, weight_decay=wd)}


def trainer(losses: Losses) -> pl.Trainer:
    return pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[losses])


def first_optimizer(module: pl.LightningModule) -> torch.optim.Optimizer:
    built = module.configure_optimizers()
    if isinstance(built, tuple):
        return built[0][0]
    return built["optimizer"] if isinstance(built, dict) else built


def series_frame() -> pd.DataFrame:
    """8 noisy sines of different phase and amplitude, 120 steps each."""
    rng = np.random.default_rng(0)
    n, length = 8, 120
    frame = pd.DataFrame({"series": np.repeat(np.arange(n), length).astype(str),
                          "time_idx": np.tile(np.arange(length), n)})
    index = frame.series.astype(int)
    frame["value"] = np.sin(frame.time_idx / 5.0 + index) * (1 + index / 4) + rng.normal(0, 0.1, len(frame))
    return frame


def fit_forecasting(parent_class: type, dataset_kwargs: dict, model_kwargs: dict, setting: str, seed: int):
    from pytorch_forecasting import TimeSeriesDataSet

    data = TimeSeriesDataSet(series_frame(), time_idx="time_idx", target="value", group_ids=["series"],
                             max_encoder_length=24, max_prediction_length=6, time_varying_unknown_reals=["value"],
                             **dataset_kwargs)
    muon_class = type(f"Muon{parent_class.__name__}", (MuonMixin, parent_class), {})
    pl.seed_everything(seed)
    optimizer = first_optimizer(parent_class.from_dataset(data, **model_kwargs))
    lr, wd = optimizer.defaults["lr"], optimizer.defaults.get("weight_decay", 0.0)
    pl.seed_everything(seed)
    model = muon_class.from_dataset(data, **model_kwargs, **factories(setting, lr, wd))
    losses = Losses()
    trainer(losses).fit(model, data.to_dataloader(train=True, batch_size=32, num_workers=0))
    return losses.values, (type(optimizer).__name__, lr, wd)


def tft(setting: str, seed: int):
    from pytorch_forecasting import TemporalFusionTransformer
    from pytorch_forecasting.data import GroupNormalizer

    return fit_forecasting(
        TemporalFusionTransformer, {"target_normalizer": GroupNormalizer(groups=["series"])},
        {"hidden_size": 16, "attention_head_size": 2, "hidden_continuous_size": 8}, setting, seed,
    )


def nbeats(setting: str, seed: int):
    from pytorch_forecasting import NBeats

    return fit_forecasting(
        NBeats, {"target_normalizer": None, "add_relative_time_idx": False, "add_target_scales": False,
                 "randomize_length": None},
        {"widths": [32, 64], "backcast_loss_ratio": 0.1}, setting, seed,
    )


def deepar_estimator(steps: int, callback: object, root: str):
    """gluonts' ``DeepAREstimator`` as these benchmarks train it: a small 2-layer DeepAR, one epoch of ``steps``
    batches on the CPU, quiet, with ``callback`` on its Trainer."""
    from gluonts.torch.model.deepar import DeepAREstimator

    return DeepAREstimator(
        freq="h", prediction_length=6, context_length=24, hidden_size=32, num_layers=2, batch_size=32,
        num_batches_per_epoch=steps,
        trainer_kwargs=dict(max_epochs=1, accelerator="cpu", enable_progress_bar=False, logger=False,
                            enable_model_summary=False, callbacks=[callback], default_root_dir=root),
    )


def deepar(setting: str, seed: int):
    from gluonts.dataset.common import ListDataset
    from gluonts.torch.model.deepar import DeepARLightningModule

    rng = np.random.default_rng(0)
    start = pd.Period("2020-01-01", freq="h")
    data = ListDataset([{"start": start, "target": (1 + i / 4) * np.sin(np.arange(300) / 6 + i)
                         + rng.normal(0, 0.1, 300)} for i in range(8)], freq="h")
    losses = Losses()
    lr, wd = 1e-3, 1e-8  # DeepARLightningModule's Adam defaults
    extra = factories(setting, lr, wd)

    class MuonDeepAR(MuonMixin, DeepARLightningModule):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs, **extra)

    with tempfile.TemporaryDirectory() as root:
        estimator = deepar_estimator(STEPS, losses, root)
        pl.seed_everything(seed)
        with mock.patch("gluonts.torch.model.deepar.estimator.DeepARLightningModule", MuonDeepAR):
            estimator.train_model(data)
    return losses.values, ("Adam", lr, wd)


def main(argv: list[str] | None = None) -> None:
    global STEPS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    STEPS = args.steps
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows = []
    for name, fn in (("TFT (pytorch-forecasting)", tft), ("N-BEATS (pytorch-forecasting)", nbeats),
                     ("DeepAR (gluonts)", deepar)):
        for seed in range(args.seeds):
            losses = {}
            for setting in ("defaults", "parent lr"):
                values, parent = fn(setting, seed)
                losses[setting] = float(np.mean(values[-20:]))
            optimizer, lr, wd = parent
            better = min(losses, key=losses.__getitem__)
            rows.append(f"| {name} | {seed} | {optimizer}(lr={lr:g}, weight_decay={wd:g}) | {losses['defaults']:.4f} | "
                        f"{losses['parent lr']:.4f} | {better} |")
            print(rows[-1], flush=True)
    print(f"\n`python benchmarks/parent_lr.py --steps {STEPS} --seeds {args.seeds}`; {_common.machine()}\n")
    print("| module | seed | the parent's optimizer | the mixin's lrs | parent_lr=True | lower |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
