"""The declared public surface, pinned: the names each public module exports (a change to them is a decision,
made here in the open), each with a docstring; and the library's logger, which gets no output of its own."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
import textwrap
import types
from functools import cache
from pathlib import Path

import pytest

import lightning_muon

PACKAGE = Path(lightning_muon.__file__).parent

#: The public names of every public module, sorted: the tiers that ``lightning_muon/__init__.py`` names (the top
#: level, ``attention``, ``optim.groups``, ``optim.rules``) and every subpackage's ``__all__``. Changing a name here
#: is changing the API: do it on purpose.
PUBLIC = {
    "lightning_muon": [
        "GraphRoles", "MomentumSchedule", "Muon", "MuonBackboneFinetuning", "MuonMixin", "MuonMonitor",
        "MuonWithAdamW", "ParamDiagnostics", "QKClip", "Routing", "WallClock", "WarmupCosine", "WeightDecaySchedule",
        "adjust_lr", "muon_subclass", "orthogonality_error", "route_parameters", "trace_roles",
        "zeropower_via_newtonschulz",
    ],
    "lightning_muon.attention": [
        "AttentionSite", "QKClipStats", "QKClipper", "QKLayout", "QKProjection", "UnsupportedAttentionError",
        "clip_factors", "find_attention", "max_attention_logits", "qk_clip_", "record_qk",
    ],
    "lightning_muon.optim.groups": [
        "ADJUST_LR_FNS", "DEFAULT_BATCH_BYTES", "DEFAULT_BATCH_BYTES_ACCELERATOR", "LAYOUTS", "MATRIX_BLOCKS",
        "MATRIX_LAYOUTS", "NAME", "NORMUON_EPS", "PARAM_NAMES", "SECOND_MOMENT", "STACKED", "STORED_IN_OUT",
        "adjust_lr", "batch_cap", "block_dim", "blocks_cover", "blocks_of",
        "describe_param", "dtype_name", "fan_shape", "group_effective_lr", "group_effective_lrs", "is_count",
        "layouts_of", "lr_value", "matrices_in", "matrix_shape", "ns_dtype", "ns_dtype_line", "ns_settings",
        "on_exact_path", "param_name", "row_moment_shape", "split_blocks", "update_rule", "uses_gram",
    ],
    "lightning_muon.optim.norms": ["any_rank", "by_mesh", "clip_value_", "clip_with_norm_", "is_finite", "total_norm"],
    "lightning_muon.optim.rules": [
        "Bucket", "CautiousWeightDecay", "NorMuon", "UpdateRule", "register_rule", "rules_for",
    ],
    "lightning_muon.optim": [
        "AdamW", "Muon", "ParamDiagnostics", "StrategyInfo", "WarmupCosine", "adjust_lr", "groups",
        "orthogonality_error", "preview_update", "zeropower_via_newtonschulz",
    ],
    "lightning_muon.routing": [
        "ADAMW", "Algorithm", "GraphRoles", "Group", "MUON", "Route", "Routing", "Rule", "SETTING_KEYS",
        "check_group_settings", "check_pattern_list", "check_settings_taken", "find_output_heads", "loss_in",
        "route_parameters", "trace_roles", "trace_step",
    ],
    "lightning_muon.combined": ["MuonWithAdamW", "merge_state_dicts", "split_state_dict"],
    "lightning_muon.lightning": ["MuonBackboneFinetuning", "MuonMixin", "SKIPPED_STEPS_KEY", "consolidate",
                                 "muon_subclass"],
    "lightning_muon.callbacks": ["MomentumSchedule", "MuonMonitor", "QKClip", "WallClock", "WeightDecaySchedule"],
    "lightning_muon.commands": ["main"],
    "lightning_muon.commands.compare": ["main"],
}

#: Exported constants without a ``#:`` comment, in a module whose owner is to add one (then drop it here).
UNDOCUMENTED: set[tuple[str, str]] = set()


def test_every_public_module_exports_the_names_pinned_here():
    exported = {name: sorted(importlib.import_module(name).__all__) for name in PUBLIC}
    assert exported == PUBLIC


def test_dir_of_the_package_lists_its_declared_surface_once():
    """Not its own imports (``importlib``, ``logging``, ``Any``) or helpers, and a name loaded on first use once."""
    assert lightning_muon.WarmupCosine is not None  # loaded: now in the module's globals too
    assert dir(lightning_muon) == sorted(lightning_muon.__all__)


def test_every_subpackage_declares_its_public_names():
    """A new subpackage is public or internal on purpose: in `PUBLIC` (with an ``__all__``), or named ``_...``.
    (``examples`` is where the installed wheel puts the top-level ``examples/``: example models and data.)"""
    subpackages = {
        f"lightning_muon.{info.name}" for info in pkgutil.iter_modules([str(PACKAGE)])
        if info.ispkg and not info.name.startswith("_") and info.name != "examples"
    }
    assert subpackages == {name for name in PUBLIC if name.count(".") == 1}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_what_a_public_module_defines_is_exported_or_named_as_internal(module):
    """Every function, class and module-level variable a public module defines itself is in its ``__all__`` or
    starts with ``_``."""
    tree = ast.parse(Path(importlib.import_module(module).__file__).read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
    assert sorted(n for n in defined if not n.startswith("_") and n not in PUBLIC[module]) == []


@cache
def commented_constants() -> frozenset[str]:
    """The module-level variables of the package that a ``#:`` comment right above documents."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.parse("\n".join(lines)).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if targets and node.lineno > 1 and lines[node.lineno - 2].lstrip().startswith("#:"):
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return frozenset(names)


def documented(value: object, name: str) -> bool:
    """Whether an exported ``value`` has a docstring of its own: a module's, a class's own (not one that
    ``dataclass`` or ``NamedTuple`` wrote), a function's; a constant's ``#:`` comment."""
    if isinstance(value, types.ModuleType):
        return bool(value.__doc__)
    if inspect.isclass(value):
        definition = ast.parse(textwrap.dedent(inspect.getsource(value))).body[0]
        return bool(ast.get_docstring(definition))
    if callable(value):
        return bool(inspect.getdoc(value))
    return name in commented_constants()


def test_every_exported_name_has_a_docstring():
    missing = {(module, name) for module, names in PUBLIC.items() for name in names
               if not documented(getattr(importlib.import_module(module), name), name)}
    assert missing == UNDOCUMENTED


def _fresh(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` run in a fresh interpreter (nothing imported or set up by the tests)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=180, check=True
    )


def test_importing_the_library_leaves_its_logger_with_one_null_handler():
    """Python's guidance for libraries: a `NullHandler` and nothing else; the application chooses the output."""
    result = _fresh(
        "import logging\n"
        "import lightning_muon, lightning_muon.optim, lightning_muon.lightning, lightning_muon.callbacks\n"
        "import lightning_muon.commands.cli\n"
        "from lightning_muon import MuonMixin, MuonMonitor\n"
        "logger = logging.getLogger('lightning_muon')\n"
        "print([type(h).__name__ for h in logger.handlers], logger.level, logger.propagate)\n"
    )
    assert result.stdout.strip() == "['NullHandler'] 0 True"


def test_the_command_prints_the_library_logger_at_info_on_stderr():
    """Run as the command (``main()`` reading ``sys.argv``), the ``lightning_muon`` logger's INFO lines reach
    stderr, as a distributed fit's line on which path the optimizer takes does."""
    result = _fresh(
        "import logging, sys\n"
        "from lightning_muon.commands.cli import main\n"
        "sys.argv = ['lightning-muon', 'configs']\n"
        "main()\n"
        "logging.getLogger('lightning_muon.optim').info('Muon: a line at INFO')\n"
        "logging.getLogger('lightning_muon').debug('Muon: a line at DEBUG')\n"
    )
    assert result.stderr.splitlines() == ["Muon: a line at INFO"], result.stderr
