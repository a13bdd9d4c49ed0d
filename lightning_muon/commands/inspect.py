"""``lightning-muon inspect --config FILE``: a config's parameter routing and effective lrs, without training.

Its arguments are ``fit``'s (the configs and any ``--key value`` override; no
``--ckpt_path``), parsed by the same `MuonCLI`; ``--help`` is its own (`parser`),
which names them rather than listing every one of ``fit``'s.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence

from lightning_muon.commands.config_files import expand_configs
from lightning_muon.commands.lightning_cli import instantiate
from lightning_muon.lightning.mixin import MuonMixin
from lightning_muon.routing import MUON, Route


def parser() -> argparse.ArgumentParser:
    """``inspect``'s help and usage (the arguments themselves go to `MuonCLI`, as ``fit``'s do)."""
    inspect = argparse.ArgumentParser(
        prog="lightning-muon inspect",
        usage="%(prog)s [-h] [--config FILE ...] [--KEY VALUE ...]",
        description="Build the model a config describes, as fit would, and print its parameter routing without "
        "training: each parameter's shape, the optimizer it goes to (Muon or AdamW), why, and its effective "
        "learning rate.",
        epilog="It accepts every fit option except --ckpt_path (--trainer.*, --model.*, --data.*, --seed_everything, "
        "--print_config), each overriding the configs as it does for fit: lightning-muon fit --help lists them, "
        "lightning-muon fit --model.help CLASS a model's. Example: lightning-muon inspect --config gpt_muon.yaml "
        "--model.n_layer 8",
    )
    inspect.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        action="append",
        help="a LightningCLI config file, or a shipped config by name (lightning-muon configs lists them); "
        "several are merged in order",
    )
    return inspect


def main(args: Sequence[str]) -> None:
    """Instantiate the model from a config and print its routing with each parameter's effective lr."""
    argv = list(args)
    if "-h" in argv or "--help" in argv:
        parser().print_help()
        raise SystemExit(0)
    if not argv:
        parser().error("give the config to inspect: --config FILE")
    model = instantiate(expand_configs(argv)).model
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 160  # whole names when piped
    if not isinstance(model, MuonMixin):
        print(f"{type(model).__name__} does not use MuonMixin: every parameter stays on its own optimizer.")
        return
    if not any(p.requires_grad for p in model.parameters()):
        # Layers built in configure_model (as Lightning builds them, before the optimizers).
        model.configure_model()
    if not any(p.requires_grad for p in model.parameters()):
        name = type(model).__name__
        print(f"{name} has no trainable parameter, even after configure_model(): nothing to route.")
        return
    routing = model.muon_routing()
    lrs = model.muon_effective_lrs()

    def effective_lr(route: Route) -> float | None:
        return lrs.get(route.name)

    print(routing.render(effective_lr, width=width), end="")
    if model.muon_enabled and model.muon_roles is None:
        print("Output heads and input layers above come from names and structure: a fit corrects them from its "
              "first training batch, before the first update (its INFO line lists every move).")
    if not model.muon_enabled:
        print("muon=None: the AdamW baseline, every parameter above trains with AdamW.")
    elif not any(r.optimizer == MUON for r in routing.routes):
        print("No parameter is routed to Muon.")
