"""`MuonCLI`: LightningCLI with the settings MuonMixin models need, and how the command runs it."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.cli import LightningCLI

DESCRIPTION = (
    "Train LightningModules with Muon (hidden matrices) + AdamW (the rest). "
    "lightning-muon --help lists every subcommand (inspect, compare, configs, convert-checkpoint too)."
)


class MuonCLI(LightningCLI):
    """LightningCLI with the settings MuonMixin models need.

    Models and data modules are chosen by ``class_path`` (subclass mode);
    ``auto_configure_optimizers`` is off so no ``--optimizer`` can replace the
    mixin's ``configure_optimizers``; the saved ``config.yaml`` is overwritten
    on reruns into the same directory.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_kwargs", {"description": DESCRIPTION})
        super().__init__(*args, **kwargs)


def run(argv: Sequence[str], from_command_line: bool) -> None:
    """``fit``, ``validate``, ``test`` or ``predict`` through `MuonCLI`, with ``argv`` already expanded."""
    if from_command_line:
        # The command line itself becomes the expanded one: Lightning's DDP launcher re-runs sys.argv
        # for the other ranks, and LightningCLI reads it without a warning about explicit args.
        sys.argv = [sys.argv[0], *argv]
        MuonCLI()
    else:
        MuonCLI(args=list(argv))


def instantiate(argv: Sequence[str]) -> MuonCLI:
    """The CLI with its classes built and nothing run (``inspect``, ``compare``'s checks)."""
    saved, sys.argv = sys.argv, sys.argv[:1]  # the args are given explicitly: keep LightningCLI from warning
    try:
        return MuonCLI(args=list(argv), run=False)
    finally:
        sys.argv = saved
