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

``convert-checkpoint`` turns an FSDP2 distributed checkpoint into one file that a
one-process or DDP fit resumes from (`lightning_muon.commands.convert`).
``lightning-muon --help`` (or no argument at all) prints the overview of all of
them (`overview`); ``lightning-muon SUBCOMMAND --help`` each one's options.

``lightning`` is the same command. The separate ``lightning-sdk`` package
installs a ``lightning`` command of its own for its cloud commands: given a
subcommand that is not ours, ours hands the call to it unchanged when it is
installed. ``lightning-muon`` is the unambiguous name.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from lightning_muon.commands.config_files import expand_configs

__all__ = ["main"]


class Subcommand(NamedTuple):
    """One subcommand of the command: what runs it, its line in `overview`, and which arguments it gets."""

    #: Runs it: ``run(argv, from_command_line)``.
    run: Callable[[list[str], bool], None]
    #: Its line in `overview`.
    summary: str
    #: Whether it gets the whole command line, its own name included (LightningCLI's four), or what follows it.
    whole_argv: bool = False


def _main_of(module: str) -> Callable[[list[str], bool], None]:
    """Run ``module``'s ``main(argv)``, importing it only then (``compare``'s matplotlib and friends, Lightning for
    ``inspect``, load only when that subcommand runs)."""

    def run(argv: list[str], from_command_line: bool) -> None:
        importlib.import_module(module).main(argv)

    return run


def _lightning_cli(argv: list[str], from_command_line: bool) -> None:
    from lightning_muon.commands import lightning_cli  # Lightning and jsonargparse only for LightningCLI's subcommands

    lightning_cli.run(expand_configs(argv), from_command_line)


#: Every subcommand, in the order `overview` lists them. No subcommand: ``--help``, ``-h`` and no argument at all
#: get `overview`, ``--version`` and ``-V`` `_version`; any other first argument starting with ``-`` (``--config
#: FILE fit``...) goes to LightningCLI as it is.
COMMANDS: dict[str, Subcommand] = {
    "fit": Subcommand(
        _lightning_cli,
        "train a model (LightningCLI's: any model and data module by class_path, from --config files)",
        whole_argv=True,
    ),
    "validate": Subcommand(
        _lightning_cli, "one evaluation epoch over the validation set (LightningCLI's)", whole_argv=True
    ),
    "test": Subcommand(_lightning_cli, "one evaluation epoch over the test set (LightningCLI's)", whole_argv=True),
    "predict": Subcommand(
        _lightning_cli, "run inference on the data and collect the predictions (LightningCLI's)", whole_argv=True
    ),
    "inspect": Subcommand(
        _main_of("lightning_muon.commands.inspect"),
        "a config's parameter routing and effective learning rates, without training",
    ),
    "compare": Subcommand(
        _main_of("lightning_muon.commands.compare"),
        "fit several configs, then plot and tabulate their validation loss by step and by time",
    ),
    "configs": Subcommand(
        _main_of("lightning_muon.commands.configs"),
        "the configs that ship with the package, one line each; --copy NAME to edit one",
    ),
    "convert-checkpoint": Subcommand(
        _main_of("lightning_muon.commands.convert"),
        "an FSDP2 distributed checkpoint as one file, for one process or DDP",
    ),
}


def overview() -> str:
    """The command's own help: a usage line naming every subcommand, one line on each, where to read more."""
    width = max(len(name) for name in COMMANDS) + 2
    lines = [
        f"usage: lightning-muon [-h] [-V] {{{','.join(COMMANDS)}}} ...",
        "",
        "Train LightningModules with Muon (hidden matrices) + AdamW (the rest).",
        "",
        "subcommands:",
        *(f"  {name:<{width}}{subcommand.summary}" for name, subcommand in COMMANDS.items()),
        "",
        "options:",
        f"  {'-h, --help':<{width}}this overview",
        f"  {'-V, --version':<{width}}the versions of lightning-muon and lightning",
        "",
        "lightning-muon SUBCOMMAND --help for its options. For example:",
        "  lightning-muon fit --config gpt_muon.yaml      # a shipped config by name (see lightning-muon configs)",
        "  lightning-muon inspect --config gpt_muon.yaml  # where each parameter goes, before training",
    ]
    return "\n".join(lines) + "\n"


def _hand_over_to_lightning_sdk(argv: list[str]) -> None:
    """Run lightning-sdk's ``lightning`` command with the same arguments."""
    entrypoint = importlib.import_module("lightning_sdk.cli.entrypoint")
    sys.argv = ["lightning", *argv]
    entrypoint.main_cli()


def _sdk_installed() -> bool:
    """Whether lightning-sdk (which installs a ``lightning`` command of its own) is importable."""
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


def _help() -> None:
    """``--help``: ours (`overview`), then lightning-sdk's when it is installed (its subcommands are handed over to
    it)."""
    print(overview(), end="", flush=True)
    if _sdk_installed():
        print("\nlightning-sdk is installed too: `lightning` hands it every other subcommand. Its help:\n", flush=True)
        _hand_over_to_lightning_sdk(["--help"])


def _log_to_stderr() -> None:
    """The command's output for the ``lightning_muon`` logger (the optimizer's line on which path a distributed run
    takes), the way ``lightning.pytorch`` sets up its own: INFO, printed to stderr unless the root logger already
    has a handler, in which case the records propagate to it."""
    logger = logging.getLogger("lightning_muon")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    printing = any(not isinstance(handler, logging.NullHandler) for handler in logger.handlers)
    if not logging.getLogger().hasHandlers() and not printing:
        logger.addHandler(logging.StreamHandler())
        logger.propagate = False


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``lightning``, ``lightning-muon`` and ``python -m lightning_muon``: with no ``args``, the
    command line (and the ``lightning_muon`` logger printed to stderr: `_log_to_stderr`)."""
    if args is None:
        _log_to_stderr()
    argv = list(sys.argv[1:] if args is None else args)
    command = argv[0] if argv else None
    if command is None:  # like argparse without its required subcommand: the overview, on stderr, and 2
        print(overview(), file=sys.stderr)
        print("lightning-muon: error: no subcommand given", file=sys.stderr)
        raise SystemExit(2)
    if argv in (["--version"], ["-V"]):
        _version()
    elif argv in (["--help"], ["-h"]):
        _help()
    elif command.startswith("-"):  # LightningCLI's own top-level options: --config FILE fit, --help fit...
        _lightning_cli(argv, args is None)
    elif command in COMMANDS:
        subcommand = COMMANDS[command]
        subcommand.run(argv if subcommand.whole_argv else argv[1:], args is None)
    elif _sdk_installed():
        _hand_over_to_lightning_sdk(argv)
    else:
        print(
            f"lightning-muon: unknown subcommand {command!r}. Choose from {', '.join(COMMANDS)}; "
            "for example: lightning-muon fit --config gpt_muon.yaml",
            file=sys.stderr,
        )
        raise SystemExit(2)
