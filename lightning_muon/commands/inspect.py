"""``lightning-muon inspect --config FILE``: a config's parameter routing and effective lrs, without training."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence

from lightning_muon.commands.config_files import expand_configs
from lightning_muon.commands.lightning_cli import instantiate
from lightning_muon.lightning.mixin import MuonMixin
from lightning_muon.routing import MUON, Route


def main(args: Sequence[str]) -> None:
    """Instantiate the model from a config and print its routing with each parameter's effective lr."""
    model = instantiate(expand_configs(list(args))).model
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
    if not model.muon_enabled:
        print("muon=None: the AdamW baseline, every parameter above trains with AdamW.")
    elif not any(r.optimizer == MUON for r in routing.routes):
        print("No parameter is routed to Muon.")
