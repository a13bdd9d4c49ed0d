"""A parent's hyperparameters survive the mixin as the parent saved them (objects included), and a checkpoint of
a model built differently is refused for what it is, not as a routing difference.

Libraries keep objects in their hyperparameters (pytorch-forecasting's ``output_transformer``, a normalizer
object; gluonts' ``distr_output`` nested in ``model_kwargs``): their checkpoints need ``weights_only=False``
anyway, and a model rebuilt without them is a different model.
"""

from __future__ import annotations

import functools
import inspect

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import MuonMixin

from helpers import make_trainer


class Normalizer:
    """An object a library builds and keeps in its hyperparameters: the forward reads it."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Forecaster(L.LightningModule):
    def __init__(self, normalizer: Normalizer | None = None, model_kwargs: dict | None = None, hidden: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.normalizer = normalizer
        self.head_scale = (model_kwargs or {}).get("output", Normalizer(1.0))
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.normalizer(x) if self.normalizer is not None else x
        return self.head_scale(self.net(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class MuonForecaster(MuonMixin, Forecaster):
    pass


def fitted(tmp_path, model: L.LightningModule) -> str:
    trainer = make_trainer(tmp_path, max_steps=4)
    trainer.fit(model)
    path = str(tmp_path / "model.ckpt")
    trainer.save_checkpoint(path)
    return path


def test_objects_the_parent_saves_are_kept_and_the_checkpoint_loads_to_the_same_forward(tmp_path):
    model = MuonForecaster(normalizer=Normalizer(0.5), model_kwargs={"output": Normalizer(3.0)})
    assert isinstance(model.hparams["normalizer"], Normalizer)
    assert isinstance(model.hparams["model_kwargs"]["output"], Normalizer)  # nested, kept too
    assert model.hparams["muon"]["class_path"] == "lightning_muon.Muon"  # the mixin's own: plain data beside
    path = fitted(tmp_path, model)

    # The parent's own checkpoint needs weights_only=False for its objects; the mixin's needs no more than that.
    loaded = MuonForecaster.load_from_checkpoint(path, weights_only=False)
    assert loaded.normalizer.scale == 0.5 and loaded.head_scale.scale == 3.0
    x = torch.randn(5, 4)
    assert torch.equal(loaded(x), model(x))


def test_a_plain_parent_checkpoint_still_loads_with_weights_only(tmp_path):
    model = MuonForecaster(hidden=8)
    path = fitted(tmp_path, model)
    loaded = MuonForecaster.load_from_checkpoint(path, weights_only=True)
    x = torch.randn(5, 4)
    assert torch.equal(loaded(x), model(x))


def test_a_model_built_differently_is_not_refused_as_a_routing_difference(tmp_path):
    path = fitted(tmp_path, MuonForecaster(hidden=8))
    # load_from_checkpoint with another architecture: the state dict does not fit, and that is what is said.
    with pytest.raises(RuntimeError, match=r"size mismatch for net\.0\.weight"):
        MuonForecaster.load_from_checkpoint(path, hidden=16, weights_only=True)
    # A resumed fit of a model with other parameters: said for what it is, naming them.
    other = MuonForecaster(hidden=8)
    other.net.append(nn.Linear(1, 1))
    with pytest.raises(MisconfigurationException, match=r"built differently(.|\n)*net\.5\.weight: in this model, not "
                                                        r"in the checkpoint") as error:
        make_trainer(tmp_path / "resume", max_steps=8).fit(other, ckpt_path=path)
    assert "different routing" not in str(error.value)


class SavesNothing(Forecaster):
    """A parent that saves no hyperparameters (gluonts' DeepAR module): the mixin saves the plain ones."""

    def __init__(self, model_kwargs: dict, hidden: int = 16) -> None:
        super().__init__(model_kwargs=model_kwargs, hidden=hidden)
        self.hparams.clear()  # as if the parent's __init__ had not called save_hyperparameters


class MuonSavesNothing(MuonMixin, SavesNothing):
    pass


def test_an_argument_holding_an_object_is_left_out_whole_saying_where_when_the_parent_saves_nothing(tmp_path):
    """A dict with an object inside is not saved in part (a part would rebuild another model without a word):
    load_from_checkpoint then needs it passed again, as the parent's own checkpoint would."""
    kwargs = {"output": Normalizer(3.0), "note": "plain"}
    with pytest.warns(UserWarning, match=r"left \['model_kwargs'\] out of the saved hyperparameters.*"
                                         r"\(model_kwargs\.output\)"):
        model = MuonSavesNothing(model_kwargs=kwargs, hidden=8)
    assert "model_kwargs" not in model.hparams and model.hparams["hidden"] == 8
    path = fitted(tmp_path, model)
    with pytest.raises(TypeError, match="model_kwargs"):
        MuonSavesNothing.load_from_checkpoint(path, weights_only=True)
    with pytest.warns(UserWarning, match=r"left \['model_kwargs'\]"):  # built again with it: the same warning
        loaded = MuonSavesNothing.load_from_checkpoint(path, weights_only=True, model_kwargs=kwargs)
    x = torch.randn(5, 4)
    assert torch.equal(loaded(x), model(x))


def refusing_unknown_keywords(init):
    """A decorator in the manner of gluonts' ``@validated()``: a ``(*args, **kwargs)`` wrapper (all that
    Lightning's ``getfullargspec`` sees, so load_from_checkpoint passes every saved key) around a constructor
    that names its arguments and refuses any other."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        inspect.signature(init).bind(self, *args, **kwargs)  # TypeError on an unknown keyword
        init(self, *args, **kwargs)

    return wrapper


class Validated(Forecaster):
    @refusing_unknown_keywords
    def __init__(self, hidden: int = 16) -> None:
        super().__init__(hidden=hidden)
        self.hparams.clear()
        self.save_hyperparameters({"hidden": hidden})  # its own constructor's arguments alone


class MuonValidated(MuonMixin, Validated):
    pass


def test_settings_a_decorated_parent_cannot_take_come_back_from_the_record(tmp_path, caplog):
    """The mixin's settings stay out of the hyperparameters where the parent's load_from_checkpoint would pass
    them to a constructor that refuses them; the mixin's own load_from_checkpoint takes them from its record,
    except those passed to it (not the default), as Lightning does with hyperparameters."""
    muon = {"class_path": "lightning_muon.Muon", "init_args": {"lr": 0.05}}
    model = MuonValidated(hidden=8, muon=muon, gradient_clip_val=1.0, muon_params=["net.0.weight"])
    assert set(model.hparams) == {"hidden"}
    path = fitted(tmp_path, model)
    assert type(Validated.load_from_checkpoint(path, weights_only=True)) is Validated  # the parent's load works
    with caplog.at_level("INFO", logger="lightning_muon"):
        loaded = MuonValidated.load_from_checkpoint(path, weights_only=True)
    assert loaded._muon_config == model._muon_config
    assert "took its settings from the checkpoint's record" in caplog.text
    assert loaded.muon_routing().names("Muon") == model.muon_routing().names("Muon") == ["net.0.weight", "net.2.weight"]
    loaded = MuonValidated.load_from_checkpoint(path, weights_only=True, gradient_clip_val=0.5)
    assert loaded._muon_config.gradient_clip_val == 0.5  # passed: it stands
    assert loaded._muon_config.muon == model._muon_config.muon and loaded._muon_config.muon_params == ("net.0.weight",)


def test_settings_in_the_hyperparameters_are_not_overridden_by_the_record(tmp_path):
    """Where the hyperparameters hold the settings, load_from_checkpoint's arguments decide, as without a record."""
    model = MuonForecaster(hidden=8, gradient_clip_val=1.0)
    path = fitted(tmp_path, model)
    loaded = MuonForecaster.load_from_checkpoint(path, weights_only=False, gradient_clip_val=None)
    assert loaded._muon_config.gradient_clip_val is None
