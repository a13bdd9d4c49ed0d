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
from lightning_muon.commands.lightning_cli import MuonCLI, instantiate
from lightning_muon.lightning.mixin import MuonMixin
from lightning_muon.routing import MUON, GraphRoles, Route, loss_in, trace_roles


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
    cli = instantiate(expand_configs(argv))
    model = cli.model
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 200  # whole cells when piped
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
    source = ""
    if model.muon_enabled:
        model.muon_roles, source = first_batch_roles(cli, model)
    routing = model.muon_routing()
    lrs = model.muon_effective_lrs()

    def effective_lr(route: Route) -> float | None:
        return lrs.get(route.name)

    print(routing.render(effective_lr, width=width), end="")
    if not model.muon_enabled:
        print("muon=None: the AdamW baseline, every parameter above trains with AdamW.")
        return
    print(source)
    if not any(r.optimizer == MUON for r in routing.routes):
        print("No parameter is routed to Muon.")
        return
    rules = set(model.muon_update_rules())
    print(f"Muon's update rule: {'; '.join(sorted(rules))}.")


def first_batch_roles(cli: MuonCLI, model: MuonMixin) -> tuple[GraphRoles | None, str]:
    """What the first training batch shows (as a fit's first batch would), from the config's data, and a line
    saying where the table's heads and input layers come from. ``training_step`` runs once, without backward or
    update, its logging dropped; without data (or if it fails) the roles stay the structural ones."""
    data = cli.datamodule if cli.datamodule is not None else model
    try:
        if cli.datamodule is not None:
            cli.datamodule.prepare_data()
            cli.datamodule.setup("fit")
        batch = next(iter(data.train_dataloader()))
        model.trainer = cli.trainer  # attached, not fitting: training_step runs as a plain forward
        model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]  # no loop to log to
        try:
            roles = trace_roles(model, batch, lambda b: loss_in(model.training_step(b, 0)))
        finally:
            del model.log
    except Exception as error:  # inspect still prints the structural routing
        return None, (f"Output heads and input layers: from names and structure (no training batch could be "
                      f"followed: {type(error).__name__}: {error}); a fit finds them from its first batch.")
    said = f" ({roles.note})" if roles.note else ""
    return roles, f"Output heads and input layers: from the first training batch, as a fit finds them{said}."
