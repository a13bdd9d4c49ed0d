"""`muon_subclass`: ``class Parent(MuonMixin, Parent)`` under the parent's own name, for libraries that look a
model up by ``type(model).__name__`` or ``type(model).__base__.__name__`` (neuralforecast's save; its round trip
is in test_third_party_modules.py). One class per parent, pickled by reference in any process, and its Lightning
checkpoint loads into itself and into the parent.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_muon import MuonMixin, muon_subclass

from helpers import Regression, make_trainer


def test_the_class_has_the_parents_name_and_is_built_once():
    cls = muon_subclass(Regression)
    assert cls.__name__ == "Regression" and cls.__bases__ == (MuonMixin, Regression)
    assert cls.__base__ is MuonMixin  # what a library reading __base__ sees: so the class's own name must do
    assert muon_subclass(Regression) is cls
    assert issubclass(cls, L.LightningModule) and isinstance(cls(), Regression)
    assert cls.__module__ == "lightning_muon.lightning._named"
    assert cls.__qualname__ == "Regression@helpers"
    with pytest.raises(TypeError, match="already has MuonMixin"):
        muon_subclass(cls)
    with pytest.raises(TypeError, match="takes a LightningModule class"):
        muon_subclass(Regression())  # type: ignore[arg-type]


def test_the_class_and_its_instances_pickle_by_reference(tmp_path):
    cls = muon_subclass(Regression)
    model = cls(widths=(8, 12), muon=None)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):  # torch.save writes protocol 2
        assert pickle.loads(pickle.dumps(cls, protocol=protocol)) is cls
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded) is cls and not loaded.muon_enabled
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    # Another process finds the class from the pickle's reference alone (it never called muon_subclass).
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[2]); "
        "m = torch.load(sys.argv[1], weights_only=False); "
        "print(type(m).__name__, type(m).__mro__[1].__name__, m.muon_enabled)"
    )
    tests = str(Path(__file__).parents[1])
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt"), tests],
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["Regression", "MuonMixin", "False"]


def test_a_parent_defined_in_a_function_pickles_as_little_as_the_parent_does():
    class Local(Regression):
        pass

    cls = muon_subclass(Local)
    assert cls.__qualname__ == Local.__qualname__ and cls.__name__ == "Local"
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(cls)


def test_its_checkpoint_loads_into_itself_and_into_the_parent(tmp_path):
    cls = muon_subclass(Regression)
    model = cls(widths=(8, 12), seed=3)
    trainer = make_trainer(tmp_path, max_steps=3)
    trainer.fit(model)
    assert trainer.global_step == 3
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    x = torch.randn(5, 8)
    for loader in (cls, Regression):
        loaded = loader.load_from_checkpoint(path, weights_only=True)
        assert type(loaded) is loader
        assert torch.equal(loaded.net(x), model.net(x))
