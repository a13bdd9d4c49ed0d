"""The hyperparameters a `MuonMixin` module saves: what its parent saves, exactly as the parent saves it, and the
mixin's own settings beside it as plain data, so a mixin checkpoint loads wherever the parent's does."""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_muon.lightning import _compat
from lightning_muon.lightning._config import MuonConfig, plain_data

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

_log = logging.getLogger("lightning_muon")



def save_hyperparameters(module: LightningModule, config: MuonConfig, mixin: type, args: tuple = ()) -> None:
    """Called from the mixin's ``__init__`` after the parent's: what the parent saved, exactly as it saved it
    (objects included: its checkpoints load as they would without the mixin; positional arguments under the
    names of the parent's parameters, as its own ``save_hyperparameters()`` names them), with the mixin's own
    settings beside it as plain data. When the parent saved nothing, the constructor's arguments, those forwarded
    to the parent included (``args``, the positional ones, by the name the parent's signature gives them), where
    they are plain data (or LightningCLI's config, when it built the model)."""
    saved_by_parent = dict(module.hparams)
    dropped: list[str] = []
    if not saved_by_parent:  # the parent chose nothing (if it did, its `ignore=` choices stand)
        module.save_hyperparameters()  # Lightning reads the __init__ frames above this one (keywords only here)
        given = {**_named_positional(_parent_class(module, mixin), module, args), **module.hparams}
        saved_by_parent, dropped = plain_data(given)
    if dropped:
        left_out = sorted({path.split(".")[0] for path in dropped})
        rank_zero_warn(
            f"MuonMixin left {left_out} out of the saved hyperparameters: the parent saves none itself, and "
            f"they hold what is not plain data ({', '.join(sorted(dropped))}), so load_from_checkpoint needs "
            "them passed again, as without the mixin. Call self.save_hyperparameters() in the parent to keep "
            "them in its checkpoints."
        )
    # LightningCLI's config already has the mixin's settings, in its own form.
    own = {} if _compat.cli_class_path(saved_by_parent) is not None else config.to_hparams()
    parent = _parent_class(module, mixin)
    if own and parent is not None and _refuses_what_lightning_passes(parent):
        saved_by_parent = {k: v for k, v in saved_by_parent.items() if k not in own}
        own = {}
        _log.info(
            "MuonMixin keeps its own settings in its checkpoint record, not in the saved hyperparameters: "
            "%s.__init__ is wrapped (by a decorator) to take any keyword, so %s.load_from_checkpoint would pass "
            "them to the constructor it wraps, which refuses them. %s.load_from_checkpoint restores them.",
            parent.__name__, parent.__name__, type(module).__name__,
        )
    module.hparams.clear()  # save_hyperparameters(dict) updates: start from the chosen set alone
    module.save_hyperparameters({**saved_by_parent, **own})


def _named_positional(parent: type | None, module: LightningModule, args: tuple) -> dict[str, Any]:
    """``args`` (the positional arguments the mixin passed on to ``parent``'s constructor) by the names of the
    parameters they bind to, as Lightning's ``save_hyperparameters()`` names them in the parent's own frame; those
    a ``*args`` parameter takes have no name and are left out, as Lightning leaves them out."""
    if not args or parent is None:
        return {}
    try:
        bound = inspect.signature(parent.__init__).bind_partial(module, *args)  # type: ignore[misc]
    except (TypeError, ValueError):  # no signature, or one the call did not meet (the parent took it anyway)
        return {}
    parameters = inspect.signature(parent.__init__).parameters  # type: ignore[misc]
    return {
        name: value for name, value in list(bound.arguments.items())[1:]
        if parameters[name].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


def _parent_class(module: LightningModule, mixin: type) -> type | None:
    """The class after ``mixin`` in ``module``'s MRO: the one whose ``load_from_checkpoint`` serves the model."""
    mro = type(module).__mro__
    index = mro.index(mixin) if mixin in mro else None
    return mro[index + 1] if index is not None and index + 1 < len(mro) else None


def _refuses_what_lightning_passes(parent: type) -> bool:
    """Whether ``parent.load_from_checkpoint`` would fail on keys its constructor does not name: Lightning passes
    every saved hyperparameter when ``getfullargspec`` (which does not follow ``__wrapped__``) sees ``**kwargs``,
    and filters them by name otherwise. A decorator's ``(*args, **kwargs)`` wrapper (gluonts' ``@validated()``)
    around a constructor without ``**kwargs`` takes them all and refuses them."""
    init = parent.__init__  # type: ignore[misc]
    try:
        passes_all = inspect.getfullargspec(init).varkw is not None
        parameters = inspect.signature(init).parameters.values()
    except (TypeError, ValueError):
        return False
    return passes_all and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def settings_from_checkpoint(
    checkpoint: dict[str, Any], saved: dict[str, Any], config: MuonConfig, mixin: type
) -> MuonConfig:
    """The config a module built by ``load_from_checkpoint`` should hold: ``config`` (what it was built with),
    with the settings of the checkpoint's record (``saved``) put back where the hyperparameters left them out
    (a parent whose ``__init__`` a decorator wraps, see `save_hyperparameters`) and the module was built with
    the default. A setting passed to ``load_from_checkpoint`` (not the default) stands, as for hyperparameters."""
    recorded = saved.get("settings")
    hparams = checkpoint.get("hyper_parameters") or {}
    if not isinstance(recorded, dict) or "muon" in hparams or _compat.cli_class_path(hparams) is not None:
        return config  # the hyperparameters rebuilt the settings already (or an older record has none)
    current, default = config.to_hparams(), _defaults(mixin).to_hparams()
    restored = {
        name: value for name, value in recorded.items()
        if name in current and current[name] == default[name] and value != current[name]
    }
    if not restored:
        return config
    _log.info("MuonMixin took its settings from the checkpoint's record: %s", restored)
    return MuonConfig.from_arguments(**{**current, **restored})


def _defaults(mixin: type) -> MuonConfig:
    """The config of a mixin built without arguments: its constructor's keyword-only defaults."""
    parameters = inspect.signature(mixin.__init__).parameters.values()  # type: ignore[misc]
    return MuonConfig.from_arguments(**{p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY})
