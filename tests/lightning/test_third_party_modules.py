"""LightningModules that other libraries ship, with MuonMixin mixed in, trained through their own entry points
on small synthetic data (no downloads): pytorch-forecasting's TemporalFusionTransformer, gluonts' DeepAR and
neuralforecast's NHITS (through `muon_subclass`, as neuralforecast saves a model by its class name).

Each trains, and its checkpoint loads back to the same model the way that library loads it: pytorch-forecasting
keeps objects (its ``GroupNormalizer``) in the hyperparameters and loads with ``weights_only=False``; gluonts'
estimator restores its best checkpoint into the module it built, with ``weights_only=True``.
"""

from __future__ import annotations

import warnings
from unittest import mock

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import pytest
import torch

from lightning_muon import MuonMixin

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def quiet_trainer(root, **kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root, **kwargs)


def test_temporal_fusion_transformer_trains_and_its_checkpoint_gives_the_same_forecast(tmp_path):
    from pytorch_forecasting import TemporalFusionTransformer, TimeSeriesDataSet
    from pytorch_forecasting.data import GroupNormalizer

    class MuonTFT(MuonMixin, TemporalFusionTransformer):
        pass

    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"series": np.repeat(np.arange(4), 60).astype(str), "time_idx": np.tile(np.arange(60), 4)})
    frame["value"] = np.sin(frame.time_idx / 5.0) + rng.normal(0, 0.1, len(frame)) + frame.series.astype(int)
    data = TimeSeriesDataSet(
        frame, time_idx="time_idx", target="value", group_ids=["series"], max_encoder_length=12,
        max_prediction_length=4, time_varying_unknown_reals=["value"],
        target_normalizer=GroupNormalizer(groups=["series"]),
    )
    pl.seed_everything(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MuonTFT.from_dataset(data, hidden_size=8, attention_head_size=1, hidden_continuous_size=4)
    routing = model.muon_routing()
    assert {"output_layer.weight", "output_layer.bias"} <= set(routing.names("AdamW"))  # the output head
    assert len(routing.names("Muon")) == 34
    assert isinstance(model.hparams["output_transformer"], GroupNormalizer)  # the library's object, kept

    trainer = quiet_trainer(tmp_path, max_steps=4)
    trainer.fit(model, data.to_dataloader(train=True, batch_size=16, num_workers=0))
    assert trainer.global_step == 4
    # The first batch found the prescaler reading the raw value (Linear(1, 4)): an input layer, not a hidden matrix.
    routes = {r.name: r for r in model.muon_routing().routes}
    assert (routes["prescalers.value.weight"].group, routes["prescalers.value.weight"].reason) == (
        "input", "input layer: reads the batch through no other matrix (first batch)")
    assert routes["output_layer.weight"].reason == "output head: feeds the loss through no other matrix (first batch)"
    assert len(model.muon_routing().names("Muon")) == 33
    trainer.save_checkpoint(tmp_path / "tft.ckpt")
    loaded = MuonTFT.load_from_checkpoint(tmp_path / "tft.ckpt", weights_only=False)  # as the library loads it
    assert loaded.muon_routing().routes == model.muon_routing().routes
    batch, _ = next(iter(data.to_dataloader(train=False, batch_size=8, num_workers=0)))
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(batch)["prediction"], model(batch)["prediction"])


@pytest.mark.slow
def test_deepar_trains_through_the_gluonts_estimator_and_restores_its_best_checkpoint(tmp_path):
    from gluonts.dataset.common import ListDataset
    from gluonts.torch.distributions import NormalOutput
    from gluonts.torch.model.deepar import DeepAREstimator, DeepARLightningModule

    class MuonDeepAR(MuonMixin, DeepARLightningModule):
        pass

    rng = np.random.default_rng(0)
    start = pd.Period("2020-01-01", freq="h")
    data = ListDataset(
        [{"start": start, "target": np.sin(np.arange(200) / 6) + rng.normal(0, 0.1, 200)} for _ in range(4)], freq="h"
    )
    estimator = DeepAREstimator(
        freq="h", prediction_length=4, context_length=12, hidden_size=8, num_layers=1, batch_size=8,
        num_batches_per_epoch=4, distr_output=NormalOutput(),
        trainer_kwargs=dict(max_epochs=2, accelerator="cpu", enable_progress_bar=False, logger=False,
                            enable_model_summary=False, default_root_dir=tmp_path),
    )
    pl.seed_everything(0)
    # The estimator builds its module by this name: the mixed-in one in its place (what a subclass would return).
    with mock.patch("gluonts.torch.model.deepar.estimator.DeepARLightningModule", MuonDeepAR):
        trained = estimator.train_model(data)  # restores the best checkpoint with torch.load(weights_only=True)
    assert isinstance(trained.trained_net, MuonDeepAR) and trained.trainer.global_step == 8
    # Every distribution-argument projection (Linear(8, 1) each, side by side) is a head; the LSTM's input-side
    # matrix reads the lags, an input layer; its recurrent matrix stays on Muon.
    routes = {r.name: (r.optimizer, r.group) for r in trained.trained_net.muon_routing().routes}
    assert [routes[f"model.param_proj.proj.{i}.weight"] for i in range(2)] == [("AdamW", "head")] * 2
    assert routes["model.rnn.weight_ih_l0"] == ("AdamW", "input")
    assert routes["model.rnn.weight_hh_l0"] == ("Muon", "hidden")
    assert "model_kwargs" not in trained.trained_net.hparams  # it holds NormalOutput(): left out whole, with a warning
    # DeepARLightningModule.__init__ is @validated(): a (*args, **kwargs) wrapper that refuses unknown keywords, so
    # the mixin's own settings stay out (the parent's load_from_checkpoint would pass them to it).
    assert set(trained.trained_net.hparams) == {"lr", "weight_decay", "patience"}
    forecast = next(iter(trained.predictor.predict(data)))
    assert forecast.mean.shape == (4,) and np.isfinite(forecast.mean).all()

    # The checkpoint gluonts' ModelCheckpoint wrote loads wherever gluonts' own does. gluonts 0.17's module saves
    # no hyperparameters (its estimator restores the weights into the module it built), so its own checkpoint
    # needs model_kwargs passed to load_from_checkpoint: the mixin's fails without them as the parent's does ...
    path = trained.trainer.checkpoint_callback.best_model_path
    for loader in (MuonDeepAR, DeepARLightningModule):
        with pytest.raises(Exception, match=r"model_kwargs\n  field required"):
            loader.load_from_checkpoint(path)
    # ... and loads with them, into the mixin class and into the parent, to the same weights and output.
    model_kwargs = trained.trained_net.__init_args__["model_kwargs"]
    inputs = trained.trained_net.inputs.zeros()
    outputs = []
    for loader in (MuonDeepAR, DeepARLightningModule):
        loaded = loader.load_from_checkpoint(path, model_kwargs=model_kwargs).eval()
        assert type(loaded) is loader
        assert loaded.state_dict().keys() == trained.trained_net.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                     trained.trained_net.state_dict().values()))
        torch.manual_seed(0)  # DeepAR's forward draws sample paths
        with torch.no_grad():
            outputs.append(loaded(**inputs))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.slow
def test_nhits_under_muon_subclass_saves_and_loads_through_neuralforecast(tmp_path):
    """neuralforecast saves a model by its class name (or its ``__base__``'s): `muon_subclass` is NHITS by name,
    so ``NeuralForecast.save``/``load`` round-trip it (the load gives neuralforecast's plain NHITS, the same
    forecast) and ``muon_subclass(NHITS).load`` gives the Muon class back."""
    neuralforecast = pytest.importorskip("neuralforecast")
    from neuralforecast.models import NHITS

    from lightning_muon import muon_subclass

    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"unique_id": np.repeat(["a", "b"], 60),
                          "ds": np.tile(pd.date_range("2020-01-01", periods=60, freq="D"), 2)})
    frame["y"] = np.sin(np.arange(120) / 5) + rng.normal(0, 0.1, 120)
    MuonNHITS = muon_subclass(NHITS)
    model = MuonNHITS(h=4, input_size=12, max_steps=3, batch_size=2, windows_batch_size=8, accelerator="cpu",
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=str(tmp_path))
    forecaster = neuralforecast.NeuralForecast(models=[model], freq="D")
    forecaster.fit(frame)
    assert isinstance(forecaster.models[0], MuonNHITS)
    assert forecaster.models[0].muon_roles is not None  # trained under the mixin: its first batch was traced
    before = forecaster.predict()
    forecaster.save(str(tmp_path / "saved"), overwrite=True)

    loaded = neuralforecast.NeuralForecast.load(str(tmp_path / "saved"))
    assert type(loaded.models[0]) is NHITS  # neuralforecast's own class, for serving
    after = loaded.predict()
    pd.testing.assert_frame_equal(after, before)

    (file,) = (tmp_path / "saved").glob("NHITS_*.safetensors")
    muon = MuonNHITS.load(str(file))
    assert type(muon) is MuonNHITS
    assert all(torch.equal(a, b) for a, b in zip(muon.state_dict().values(),
                                                 forecaster.models[0].state_dict().values()))
