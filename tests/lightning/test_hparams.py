"""MuonMixin's constructor: every setting is checked when the module is built (a table of bad values and the
error each gives), and what it saves as hyperparameters is plain data (a non-plain argument is left out with a
warning, and so is a factory that cannot be saved as a loadable spec).
"""

from __future__ import annotations

import json

import pytest
from torch import nn

from lightning_muon import Muon, MuonMixin

from helpers import (
    MuonRegression,
    Regression,
)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"accumulate_grad_batches": 0}, ValueError, r"accumulate_grad_batches must be an int >= 1, got 0"),
        ({"accumulate_grad_batches": 1.5}, ValueError, r"accumulate_grad_batches must be an int >= 1, got 1\.5"),
        ({"accumulate_grad_batches": True}, ValueError, r"accumulate_grad_batches must be an int >= 1, got True"),
        ({"gradient_clip_val": 0}, ValueError, r"gradient_clip_val must be > 0 or None, got 0"),
        ({"gradient_clip_val": -1}, ValueError, r"gradient_clip_val must be > 0 or None, got -1"),
        ({"gradient_clip_val": float("nan")}, ValueError, r"gradient_clip_val must be > 0 or None, got nan"),
        ({"max_consecutive_skips": 0}, ValueError, r"max_consecutive_skips must be >= 1, got 0"),
        ({"adamw": None}, ValueError, r"adamw must be an optimizer factory"),
        ({"muon": {"class_path": "no.such.Class"}}, ValueError, r"cannot import 'no\.such\.Class'"),
        ({"muon": {"init_args": {"lr": 0.1}}}, ValueError, r"expected an optimizer/scheduler factory or a spec"),
    ],
)
def test_constructor_rejects_bad_configuration(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        MuonRegression(**kwargs)


def test_hyperparameters_are_plain_data(tmp_path):
    model = MuonRegression()
    assert model.hparams["muon"] == {
        "class_path": "lightning_muon.Muon",
        "init_args": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01},
    }
    json.dumps(dict(model.hparams))  # nothing but plain data


def test_non_plain_constructor_arguments_are_left_out_of_hparams_with_a_warning():
    class WithBackbone(Regression):
        def __init__(self, backbone: nn.Module | None = None, **kwargs) -> None:
            super().__init__(**kwargs)
            self.backbone = backbone

    class MuonWithBackbone(MuonMixin, WithBackbone):
        pass

    with pytest.warns(UserWarning, match=r"left \['backbone'\] out of the saved hyperparameters"):
        model = MuonWithBackbone(backbone=nn.Linear(2, 2), batch_size=4)
    assert "backbone" not in model.hparams and model.hparams["batch_size"] == 4


def test_a_factory_that_cannot_be_saved_as_a_spec_is_warned_about():
    with pytest.warns(UserWarning, match=r"`muon` \(.*<lambda>\) cannot be saved as a loadable spec"):
        MuonRegression(muon=lambda params: Muon(params, lr=0.02))
