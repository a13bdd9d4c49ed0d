"""What the first training batch changes in the routing of models nobody here wrote, and what following it costs.

For each model, a `MuonMixin` subclass trains 2 updates through a real Trainer (the libraries' own data pipelines;
gluonts' DeepAR through its estimator). The routing before (names and structure alone) and after (the first
batch's roles) is compared parameter by parameter. The cost: one forward of the first batch with the trace on,
against the same forward without it (median of 5 each; the trace runs once per fit, never on later steps).

    python benchmarks/first_batch.py            # prints the moves and the costs as markdown
    python benchmarks/first_batch.py --write    # also writes results/first_batch.md and its RESULTS.md section
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from parent_lr import deepar_estimator, series_frame
from torch import nn

from lightning_muon import MuonMixin
from lightning_muon.lightning._update_loop import loss_in
from lightning_muon.routing import Routing, route_parameters, trace_step

import _common
import _report

STEPS = 2


class FirstBatch(pl.Callback):
    """Keeps the first training batch (to time the trace on it afterwards)."""

    batch: Any = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.batch is None:
            self.batch = batch


def trainer(callback: pl.Callback, root: str) -> pl.Trainer:
    return pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                      default_root_dir=root)


def forecasting(parent_name: str, dataset_kwargs: dict, model_kwargs: dict) -> Callable[[], tuple]:
    def build() -> tuple:
        import pytorch_forecasting
        from pytorch_forecasting import TimeSeriesDataSet

        parent = getattr(pytorch_forecasting, parent_name)
        data = TimeSeriesDataSet(series_frame(), time_idx="time_idx", target="value", group_ids=["series"],
                                 max_encoder_length=24, max_prediction_length=6, time_varying_unknown_reals=["value"],
                                 **dataset_kwargs)
        model = type(f"Muon{parent_name}", (MuonMixin, parent), {}).from_dataset(data, **model_kwargs)
        seen = FirstBatch()
        with tempfile.TemporaryDirectory() as root:
            trainer(seen, root).fit(model, data.to_dataloader(train=True, batch_size=32, num_workers=0))
        return model, seen.batch
    return build


def deepar() -> tuple:
    from gluonts.dataset.common import ListDataset
    from gluonts.torch.model.deepar import DeepARLightningModule

    class MuonDeepAR(MuonMixin, DeepARLightningModule):
        pass

    rng = np.random.default_rng(0)
    start = pd.Period("2020-01-01", freq="h")
    data = ListDataset([{"start": start, "target": np.sin(np.arange(300) / 6 + i) + rng.normal(0, 0.1, 300)}
                        for i in range(8)], freq="h")
    seen = FirstBatch()
    with tempfile.TemporaryDirectory() as root:
        estimator = deepar_estimator(STEPS, seen, root)
        with mock.patch("gluonts.torch.model.deepar.estimator.DeepARLightningModule", MuonDeepAR):
            model = estimator.train_model(data).trained_net
    return model, seen.batch


class Stem13(pl.LightningModule):
    """A plain torch.nn CNN on 13-band images (torchgeo's Sentinel-2 shape, without torchgeo): stem, 2 convs, head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(13, 16, 3, padding=1)
        self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.fc(self.body(self.stem(x))), y)

    def train_dataloader(self):
        x, y = torch.randn(64, 13, 16, 16), torch.randint(0, 3, (64,))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def stem13() -> tuple:
    model = type("MuonStem13", (MuonMixin, Stem13), {})()
    seen = FirstBatch()
    with tempfile.TemporaryDirectory() as root:
        trainer(seen, root).fit(model)
    return model, seen.batch


def gpt2() -> tuple:
    from transformers import GPT2Config, GPT2LMHeadModel

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=64))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def train_dataloader(self):
            ids = torch.randint(0, 96, (32, 16))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)

    model = type("MuonLM", (MuonMixin, LM), {})()
    seen = FirstBatch()
    with tempfile.TemporaryDirectory() as root:
        trainer(seen, root).fit(model)
    return model, seen.batch


MODELS: dict[str, Callable[[], tuple]] = {
    "TemporalFusionTransformer (pytorch-forecasting)": forecasting(
        "TemporalFusionTransformer", {},
        {"hidden_size": 16, "attention_head_size": 2, "hidden_continuous_size": 8}),
    "NBeats (pytorch-forecasting)": forecasting(
        "NBeats", {"target_normalizer": None, "add_relative_time_idx": False, "add_target_scales": False,
                   "randomize_length": None}, {"widths": [32, 64], "backcast_loss_ratio": 0.1}),
    "DeepAR (gluonts)": deepar,
    "13-band CNN (torch.nn, torchgeo's input)": stem13,
    "GPT-2 (transformers)": gpt2,
}


def before_and_after(model: MuonMixin) -> tuple[Routing, Routing]:
    after = model.muon_routing()
    before = route_parameters(model, muon_params=model.hparams.get("muon_params", ()),
                              adamw_params=model.hparams.get("adamw_params", ()))
    return before, after


def forward_seconds(model: MuonMixin, batch: Any, trace: bool) -> float:
    """The median time of the parent's training_step forward on ``batch`` (no backward), with or without the
    trace."""
    step = super(MuonMixin, model).training_step
    times = []
    for _ in range(5):
        start = time.perf_counter()
        with torch.no_grad(), mock.patch.object(model, "log", lambda *a, **k: None):  # no fit: nothing to log to
            if trace:
                trace_step(model, batch, lambda: step(batch, 0), loss_in)
            else:
                step(batch, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    moves, costs = [], []
    for name, build in MODELS.items():
        pl.seed_everything(0)
        model, batch = build()
        before, after = before_and_after(model)
        changed = [(b, a) for b, a in zip(before.routes, after.routes, strict=True) if (b.optimizer, b.group) != (
            a.optimizer, a.group)]
        for b, a in changed:
            moves.append(f"| {name} | `{a.name}` | {'x'.join(map(str, a.shape))} | {b.optimizer} ({b.reason}) | "
                         f"{a.optimizer} ({a.reason}) |")
        if not changed:
            moves.append(f"| {name} | (none) | | | |")
        model.train()
        plain, with_trace = forward_seconds(model, batch, False), forward_seconds(model, batch, True)
        muon = len(after.names("Muon"))
        costs.append(f"| {name} | {len(after.routes)} | {muon} | {plain * 1000:.1f} | {with_trace * 1000:.1f} | "
                     f"{with_trace / plain:.2f}x |")
        print(f"{name}: {len(changed)} moved; forward {plain * 1000:.1f} ms, traced {with_trace * 1000:.1f} ms",
              flush=True)
    report = "\n".join([
        "# The first batch's routing", "",
        f"`python benchmarks/first_batch.py --write`; {_common.machine()}", "",
        "Parameters the first training batch moved (before: names and structure; after: the batch's roles):", "",
        "| model | parameter | shape | before | after |", "|---|---|---|---|---|", *moves, "",
        "The cost, once per fit: the first batch's forward (the parent's training_step, no backward) without and "
        "with the trace, median of 5:", "",
        "| model | parameters | on Muon after | forward ms | traced ms | ratio |", "|---|---|---|---|---|---|",
        *costs, "",
    ])
    print("\n" + report)
    if args.write:
        _report.write_markdown("first_batch", report)


if __name__ == "__main__":
    main()
