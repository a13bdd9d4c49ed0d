"""The ``lightning`` / ``lightning-muon`` command: LightningCLI for MuonMixin models, plus ``inspect``.

    lightning-muon fit --config configs/gpt_muon.yaml
    lightning-muon inspect --config configs/gpt_muon.yaml     # the routing table, no training
    lightning-muon compare configs/gpt_muon.yaml configs/gpt_adamw.yaml   # fit both, plot and tabulate

Subcommands ``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI's
(any LightningModule and LightningDataModule by ``class_path``; ``--optimizer``
is not offered, since it would silently replace the mixin's pair).
``inspect`` instantiates the model from the same config and prints the
routing: parameter, shape, optimizer, reason and effective learning rate.
``compare`` fits several configs and compares their validation loss by step
and by wall-clock time (`lightning_muon.commands.compare`).

``lightning`` is the same command. The separate ``lightning-sdk`` package
installs a ``lightning`` command of its own for its cloud commands: given a
subcommand that is not ours, ours hands the call to it unchanged when it is
installed. ``lightning-muon`` is the unambiguous name.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from lightning_muon.commands import lightning_cli
from lightning_muon.commands.config_files import expand_configs

__all__ = ["main"]


def _inspect(argv: list[str], from_command_line: bool) -> None:
    from lightning_muon.commands.inspect import main as inspect

    inspect(argv)


def _compare(argv: list[str], from_command_line: bool) -> None:
    from lightning_muon.commands.compare import main as compare  # matplotlib and friends only when comparing

    compare(argv)


def _lightning_cli(argv: list[str], from_command_line: bool) -> None:
    lightning_cli.run(expand_configs(argv), from_command_line)


#: Every subcommand and what runs it (the rest of the command line is its argv). ``None``: no subcommand
#: (``--help``, ``--config``...), which LightningCLI answers.
COMMANDS: dict[str | None, Callable[[list[str], bool], None]] = {
    "fit": _lightning_cli,
    "validate": _lightning_cli,
    "test": _lightning_cli,
    "predict": _lightning_cli,
    "inspect": _inspect,
    "compare": _compare,
}


def _hand_over_to_lightning_sdk(argv: list[str]) -> None:
    """Run lightning-sdk's ``lightning`` command with the same arguments."""
    entrypoint = importlib.import_module("lightning_sdk.cli.entrypoint")
    sys.argv = ["lightning", *argv]
    entrypoint.main_cli()


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``lightning``, ``lightning-muon`` and ``python -m lightning_muon``."""
    argv = list(sys.argv[1:] if args is None else args)
    # Configs name classes by import path (examples.char_gpt.CharGPT): resolve them from the working
    # directory, as `python -m` would.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    command = argv[0] if argv else None
    if command is None or command.startswith("-"):
        _lightning_cli(argv, args is None)
    elif command in ("inspect", "compare"):
        COMMANDS[command](argv[1:], args is None)
    elif command in COMMANDS:
        COMMANDS[command](argv, args is None)
    elif importlib.util.find_spec("lightning_sdk") is not None:
        _hand_over_to_lightning_sdk(argv)
    else:
        Console(stderr=True).print(
            f"lightning-muon: unknown subcommand {command!r}. Choose from {', '.join(c for c in COMMANDS if c)}; "
            "for example: lightning-muon fit --config configs/gpt_muon.yaml"
        )
        raise SystemExit(2)
