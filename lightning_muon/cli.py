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
and by wall-clock time (`lightning_muon.compare`).

``lightning`` is the same command. The separate ``lightning-sdk`` package
installs a ``lightning`` command of its own for its cloud commands: given a
subcommand that is not ours, ours hands the call to it unchanged when it is
installed. ``lightning-muon`` is the unambiguous name.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI
from rich.console import Console

from lightning_muon.muon import adjust_lr
from lightning_muon.routing import MUON, Route

__all__ = ["MuonCLI", "main"]

SUBCOMMANDS = ("fit", "validate", "test", "predict", "inspect", "compare")

DESCRIPTION = (
    "Train LightningModules with Muon (hidden matrices) + AdamW (the rest). "
    "Subcommands: fit, validate, test, predict (LightningCLI's); inspect "
    "(print a config's parameter routing without training: lightning-muon inspect --config FILE); compare "
    "(fit several configs, then plot and tabulate their validation loss by step and by wall-clock time: "
    "lightning-muon compare CONFIG CONFIG [--out DIR]; see lightning-muon compare --help)."
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


def _effective_lr(model: Any) -> Any:
    """A function giving the lr each routed parameter will get, from the model's optimizer factories."""
    factories = getattr(model, "_muon_factories", None)
    if factories is None:
        return None
    probes: dict[str, float] = {}
    routing = model.muon_routing()
    muon_factory, adamw_factory = factories["muon"], factories["adamw"]
    if muon_factory is not None and routing.muon_groups:
        for group in muon_factory(routing.muon_groups).param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                probes[name] = adjust_lr(float(group["lr"]), group.get("adjust_lr_fn"), p.shape)
    adamw_groups = routing.adamw_groups if muon_factory is not None else routing.muon_groups + routing.adamw_groups
    for group in adamw_factory(adamw_groups).param_groups:
        for name in group["param_names"]:
            probes[name] = float(group["lr"])

    def lookup(route: Route) -> float | None:
        return probes.get(route.name)

    return lookup


def inspect_config(args: Sequence[str]) -> None:
    """``inspect``: instantiate the model from a config and print its routing with effective lrs."""
    argv, sys.argv = sys.argv, sys.argv[:1]  # the args are given explicitly: keep LightningCLI from warning
    try:
        cli = MuonCLI(args=list(args), run=False)
    finally:
        sys.argv = argv
    model = cli.model
    console = Console(width=None if sys.stdout.isatty() else 160)  # whole names when piped
    if not hasattr(model, "muon_routing"):
        console.print(f"{type(model).__name__} does not use MuonMixin: every parameter stays on its own optimizer.")
        return
    routing = model.muon_routing()
    console.print(routing.rich_table(_effective_lr(model)))
    muon_on = model._muon_factories["muon"] is not None
    if not muon_on:
        console.print("muon=None: the AdamW baseline, every parameter above trains with AdamW.")
    elif not any(r.optimizer == MUON for r in routing.routes):
        console.print("No parameter is routed to Muon.")


def _hand_over_to_lightning_sdk(argv: list[str]) -> None:
    """Run lightning-sdk's ``lightning`` command with the same arguments."""
    entrypoint = importlib.import_module("lightning_sdk.cli.entrypoint")
    sys.argv = ["lightning", *argv]
    entrypoint.main_cli()


_EXTENDS = re.compile(r"^#\s*extends:\s*(\S+)\s*$", re.MULTILINE)


def config_chain(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> list[Path]:
    """``path`` preceded by the files it extends (a ``# extends: base.yaml`` comment line, relative to it).

    LightningCLI merges repeated ``--config`` files key by key, so a config can
    hold only what differs from its base; the comment keeps the file plain YAML.
    """
    path = Path(path)
    if path.resolve() in _seen:
        raise ValueError(f"config {path} extends itself through {' -> '.join(map(str, _seen))}")
    try:
        text = path.read_text()
    except OSError:
        return [path]  # LightningCLI reports a missing file in its own words
    chain: list[Path] = []
    for base in _EXTENDS.findall(text):
        chain += config_chain(path.parent / base, (*_seen, path.resolve()))
    return chain + [path]


def _expand_configs(argv: list[str]) -> list[str]:
    """Every ``--config FILE`` (or ``-c FILE``, ``--config=FILE``) preceded by the configs it extends."""
    expanded: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in ("-c", "--config"):
            path = next(args, None)
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            expanded.append(arg)
            continue
        if path is None:
            expanded.append(arg)
        else:
            expanded += [f"--config={p}" for p in config_chain(path)]
    return expanded


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``lightning``, ``lightning-muon`` and ``python -m lightning_muon``."""
    argv = list(sys.argv[1:] if args is None else args)
    # Configs name classes by import path (examples.char_gpt.CharGPT): resolve them from the working
    # directory, as `python -m` would.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    command = argv[0] if argv else None
    if command == "inspect":
        inspect_config(_expand_configs(argv[1:]))
        return
    if command == "compare":
        from lightning_muon.compare import main as compare  # matplotlib and friends only when comparing

        compare(argv[1:])
        return
    if command is not None and not command.startswith("-") and command not in SUBCOMMANDS:
        if importlib.util.find_spec("lightning_sdk") is not None:
            _hand_over_to_lightning_sdk(argv)
            return
        Console(stderr=True).print(
            f"lightning-muon: unknown subcommand {command!r}. Choose from {', '.join(SUBCOMMANDS)}; "
            "for example: lightning-muon fit --config configs/gpt_muon.yaml"
        )
        raise SystemExit(2)
    expanded = _expand_configs(argv)
    if args is None:
        # The command line itself becomes the expanded one: Lightning's DDP launcher re-runs sys.argv
        # for the other ranks, and LightningCLI reads it without a warning about explicit args.
        sys.argv = [sys.argv[0], *expanded]
        MuonCLI()
    else:
        MuonCLI(args=expanded)
