"""The ``lightning`` / ``lightning-muon`` command: LightningCLI for MuonMixin models, plus ``inspect``.

    lightning-muon fit --config gpt_muon.yaml
    lightning-muon inspect --config gpt_muon.yaml     # the routing table, no training
    lightning-muon compare gpt_muon.yaml gpt_adamw.yaml   # fit both, plot and tabulate
    lightning-muon configs                            # the shipped configs; --copy NAME to edit one

Subcommands ``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI's
(any LightningModule and LightningDataModule by ``class_path``; ``--optimizer``
is not offered, since it would silently replace the mixin's pair).
``inspect`` instantiates the model from the same config and prints the
routing: parameter, shape, optimizer, reason and effective learning rate.
``compare`` fits several configs and compares their validation loss by step
and by wall-clock time (`lightning_muon.commands.compare`). ``configs`` lists
the configs that ship with the package; ``--config NAME`` takes one of them by
name from any directory when no file ``NAME`` exists there
(`lightning_muon.commands.config_files`).

``lightning`` is the same command. The separate ``lightning-sdk`` package
installs a ``lightning`` command of its own for its cloud commands: given a
subcommand that is not ours, ours hands the call to it unchanged when it is
installed. ``lightning-muon`` is the unambiguous name.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

from lightning_muon.commands import lightning_cli
from lightning_muon.commands.config_files import expand_configs

__all__ = ["main"]


def _inspect(argv: list[str], from_command_line: bool) -> None:
    from lightning_muon.commands.inspect import main as inspect

    inspect(argv)


def _compare(argv: list[str], from_command_line: bool) -> None:
    from lightning_muon.commands.compare import main as compare  # matplotlib and friends only when comparing

    compare(argv)


def _configs(argv: list[str], from_command_line: bool) -> None:
    from lightning_muon.commands.configs import main as configs

    configs(argv)


def _lightning_cli(argv: list[str], from_command_line: bool) -> None:
    lightning_cli.run(expand_configs(argv), from_command_line)


def _convert(argv: list[str], from_command_line: bool) -> None:
    from lightning_muon.commands.convert import main as convert

    convert(argv)


#: Every subcommand and what runs it (the rest of the command line is its argv). ``None``: no subcommand
#: (``--help``, ``--config``...), which LightningCLI answers.
COMMANDS: dict[str | None, Callable[[list[str], bool], None]] = {
    "fit": _lightning_cli,
    "validate": _lightning_cli,
    "test": _lightning_cli,
    "predict": _lightning_cli,
    "inspect": _inspect,
    "compare": _compare,
    "configs": _configs,
    "convert-checkpoint": _convert,
}


def _hand_over_to_lightning_sdk(argv: list[str]) -> None:
    """Run lightning-sdk's ``lightning`` command with the same arguments."""
    entrypoint = importlib.import_module("lightning_sdk.cli.entrypoint")
    sys.argv = ["lightning", *argv]
    entrypoint.main_cli()


def _sdk_installed() -> bool:
    return importlib.util.find_spec("lightning_sdk") is not None


def _version() -> None:
    """``--version``: ours, then lightning-sdk's when it is installed (both answer to ``lightning``)."""
    import importlib.metadata

    import lightning

    try:
        ours = importlib.metadata.version("lightning-muon")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        ours = "unknown"
    print(f"lightning-muon {ours} (lightning {lightning.__version__})", flush=True)
    if _sdk_installed():
        print("lightning-sdk:", flush=True)
        _hand_over_to_lightning_sdk(["--version"])


def _help(argv: list[str], from_command_line: bool) -> None:
    """``--help``: ours, then lightning-sdk's when it is installed (its subcommands are handed over to it)."""
    try:
        _lightning_cli(argv, from_command_line)
    except SystemExit as exit_info:
        if exit_info.code not in (0, None) or not _sdk_installed():
            raise
    sys.stdout.flush()
    print("\nlightning-sdk is installed too: `lightning` hands it every other subcommand. Its help:\n", flush=True)
    _hand_over_to_lightning_sdk(["--help"])


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``lightning``, ``lightning-muon`` and ``python -m lightning_muon``."""
    argv = list(sys.argv[1:] if args is None else args)
    command = argv[0] if argv else None
    if argv in (["--version"], ["-V"]):
        _version()
    elif argv in (["--help"], ["-h"]):
        _help(argv, args is None)
    elif command is None or command.startswith("-"):
        _lightning_cli(argv, args is None)
    elif command in ("inspect", "compare", "configs", "convert-checkpoint"):
        COMMANDS[command](argv[1:], args is None)
    elif command in COMMANDS:
        COMMANDS[command](argv, args is None)
    elif _sdk_installed():
        _hand_over_to_lightning_sdk(argv)
    else:
        print(
            f"lightning-muon: unknown subcommand {command!r}. Choose from {', '.join(c for c in COMMANDS if c)}; "
            "for example: lightning-muon fit --config gpt_muon.yaml",
            file=sys.stderr,
        )
        raise SystemExit(2)
