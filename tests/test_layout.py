"""The package's structure, checked: imports run one way (no circle, nothing upward), Lightning's private
API is used only in ``lightning/_compat.py``, optim/, routing/ and combined/ import no Lightning, and ruff caps
complexity.

``python tests/test_layout.py`` prints the import graph between the package's modules.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import lightning
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_muon"
#: Where each package's sources live in the checkout: the examples are the top-level ``examples/``, installed as
#: ``lightning_muon.examples`` (pyproject.toml's ``package-dir``).
SOURCES = {"lightning_muon": PACKAGE, "lightning_muon.examples": ROOT / "examples"}

#: Layers, bottom to top: a module may import only from its own layer or lower ones.
LAYERS = {
    "lightning_muon.optim": 0,
    "lightning_muon.routing": 0,
    "lightning_muon.attention": 0,  # QK-Clip in plain PyTorch (it reads optim's DTensor check)
    "lightning_muon.combined": 1,  # MuonWithAdamW: routes a model, delegates to Muon and torch's AdamW
    "lightning_muon.lightning": 2,
    "lightning_muon.callbacks": 3,
    "lightning_muon.commands": 4,
    "lightning_muon": 5,  # the public API (__init__) and __main__
    "lightning_muon.examples": 6,  # models and data for the shipped configs: they import the public API
}
#: The layers that import no Lightning: plain-PyTorch users (and transformers' Trainer) import them.
TORCH_ONLY = ("lightning_muon.optim", "lightning_muon.routing", "lightning_muon.combined", "lightning_muon.attention")
COMPAT = "lightning_muon.lightning._compat"
#: The one module that reads torch's private DTensor API.
DTENSOR = "lightning_muon.optim._dtensor"
#: The private modules any subpackage may import: Lightning's private API (`COMPAT`) and torch's private DTensor API
#: (`DTENSOR`) (timm's ``_helpers.py`` is the model; norms and rank agreement are public: ``optim/norms.py``).
FENCED = {COMPAT, DTENSOR}
#: torch's private DTensor names (attributes, functions, classes), and FSDP1's mark on what it flattened, that only
#: `DTENSOR` may use.
TORCH_PRIVATE_DTENSOR = ("_StridedShard", "_compute_local_shape_and_global_offset", "_local_tensor", "_spec",
                         "_fsdp_flattened")


def source_files() -> dict[str, Path]:
    """Module name -> source file, for the package and its examples."""
    files = {}
    for package, directory in SOURCES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            files[".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    return files


def modules() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in source_files().items()}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports inside ``if TYPE_CHECKING:`` blocks (no import at run time)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at run time (function-level imports included); with
    ``type_checking``, those it imports for its annotations too (``if TYPE_CHECKING:`` blocks)."""
    trees = modules()
    graph: dict[str, set[str]] = {name: set() for name in trees}
    for name, tree in trees.items():
        skip = set() if type_checking else _type_checking_only(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import submodule` depends on the submodule, `from pkg import name` on pkg.
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in trees else node.module
                           for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in trees and t != name)
    return graph


def layer(module: str) -> int:
    """The layer of the longest prefix in `LAYERS` that ``module`` falls under."""
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def test_the_import_graph_has_no_circle_type_checking_imports_included():
    graph = import_graph(type_checking=True)
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in visiting:
            cycle = [*visiting[visiting.index(module) :], module]
            raise AssertionError("import circle: " + " -> ".join(cycle))
        if module in done:
            return
        visiting.append(module)
        for target in sorted(graph[module]):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert "lightning_muon.optim._update" in graph["lightning_muon.optim._strategies"]  # the graph is real
    assert "lightning_muon.examples.text_data" in graph["lightning_muon.examples.char_gpt"]  # examples included
    assert "lightning_muon.lightning._config" in graph["lightning_muon.lightning._pair"]  # TYPE_CHECKING


def test_every_class_is_under_250_lines():
    """A class a newcomer reads in one sitting (`MuonMixin` is the one that keeps growing)."""
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and (node.end_lineno or node.lineno) - node.lineno + 1 >= 250
    ]
    assert not long, "\n".join(long)


def test_no_module_imports_upward():
    examples = ("lightning_muon.optim.muon", "lightning_muon.combined.muon_with_adamw", "lightning_muon.commands.cli",
                "lightning_muon")
    assert [layer(m) for m in examples] == [0, 1, 4, 5]
    upward = [
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, targets in import_graph().items()
        for target in targets
        if layer(target) > layer(module)
    ]
    assert not upward, "\n".join(upward)


@cache
def lightning_private_names() -> frozenset[str]:
    """Every ``_name`` (not dunder) that Lightning's own source defines: functions, classes, attributes."""
    names: set[str] = set()
    pattern = re.compile(r"(?:def |class |self\.|\b)(_[a-z][a-z0-9_]*)\b")
    for path in Path(lightning.__file__).parent.rglob("*.py"):
        names.update(pattern.findall(path.read_text(errors="replace")))
    return frozenset(names)


@cache
def own_names() -> frozenset[str]:
    """Every name the package itself defines: modules, functions, classes, attributes it assigns."""
    names = {p.stem for p in source_files().values()}
    for tree in modules().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "setdefault"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):  # self.__dict__.setdefault("_name", ...)
                names.add(str(node.args[0].value))
    return frozenset(names)


def private_lightning_uses(name: str, tree: ast.Module) -> list[str]:
    """Lightning-private names a module uses: imported from lightning, or read as an attribute or a string
    key (``"_class_path"``) that Lightning's source defines and this package does not. torch's private names that
    Lightning reads too (FSDP1's ``"_fsdp_flattened"``) are torch's: `TORCH_PRIVATE_DTENSOR` keeps them in one
    module."""
    private = lightning_private_names() - own_names() - set(TORCH_PRIVATE_DTENSOR)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
            found += [f"{name}:{node.lineno} imports {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"{name}:{node.lineno} uses .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
            found.append(f"{name}:{node.lineno} uses {node.value!r}")
    return found


def test_lightning_private_api_is_used_only_in_compat():
    uses = {name: private_lightning_uses(name, tree) for name, tree in modules().items()}
    assert uses[COMPAT], "the check finds nothing even in _compat.py: it is broken"
    elsewhere = [use for name, found in uses.items() if name != COMPAT for use in found]
    assert not elsewhere, "\n".join(elsewhere)


def subpackage(module: str) -> str:
    """``lightning_muon.optim._dtensor`` -> ``lightning_muon.optim``; the top level for itself."""
    return ".".join(module.split(".")[:2])


def test_no_subpackage_imports_another_ones_private_module_but_the_fenced_ones():
    graph = import_graph(type_checking=True)
    assert DTENSOR in graph["lightning_muon.attention.clip"]  # a fenced import the check sees
    reach_ins = [
        f"{module} imports {target}"
        for module, targets in graph.items() for target in targets
        if any(part.startswith("_") and not part.startswith("__") for part in target.split(".")[2:])
        and subpackage(module) != subpackage(target) and target not in FENCED
    ]
    assert not reach_ins, "\n".join(reach_ins)


def test_torch_private_dtensor_api_is_used_only_in_one_module():
    uses = {
        name: [f"{name}:{node.lineno} uses {word}" for node in ast.walk(tree) for word in TORCH_PRIVATE_DTENSOR
               if (isinstance(node, ast.Attribute) and node.attr == word)
               or (isinstance(node, ast.Constant) and node.value == word)
               or (isinstance(node, ast.ImportFrom) and any(a.name == word for a in node.names))
               or (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed.tensor._"))]
        for name, tree in modules().items()
    }
    assert uses[DTENSOR], "the check finds nothing even in optim/_dtensor.py: it is broken"
    elsewhere = [use for name, found in uses.items() if name != DTENSOR for use in found]
    assert not elsewhere, "\n".join(elsewhere)


def test_ruff_limits_function_complexity_as_lightning_does():
    """Size is measured by ruff's C901 at Lightning's limit of 10 (``ruff check .`` in CI), not by class length."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "C901" in ruff["select"]
    assert ruff["mccabe"]["max-complexity"] == 10
    assert not any("C901" in ignored for path, ignored in ruff["per-file-ignores"].items() if "lightning_muon" in path)


#: Packages the optimizer, the routing and `MuonWithAdamW` never import: plain-PyTorch users do not pay for them.
HEAVY = ("lightning", "pytorch_lightning", "lightning_utilities", "jsonargparse", "torchmetrics")


def test_optim_routing_and_combined_import_no_lightning():
    """Statically (every import statement, function-level ones too) and at run time, in a fresh interpreter."""
    checked = [name for name in modules() if name.startswith(tuple(p + "." for p in TORCH_ONLY)) or name in TORCH_ONLY]
    assert "lightning_muon.combined.muon_with_adamw" in checked and "lightning_muon.optim.muon" in checked
    for name, tree in modules().items():
        if name not in checked:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                targets = [node.module or ""]
            else:
                continue
            assert not [t for t in targets if t.split(".")[0] in HEAVY], f"{name}:{node.lineno} imports {targets}"
    code = (
        "import sys\n"
        "import lightning_muon.optim, lightning_muon.routing, lightning_muon.combined, lightning_muon.attention\n"
        "from lightning_muon import Muon, MuonWithAdamW, route_parameters, orthogonality_error\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_the_public_api_is_the_top_level():
    import lightning_muon

    assert sorted(lightning_muon.__all__) == [
        "GraphRoles", "MomentumSchedule", "Muon", "MuonBackboneFinetuning", "MuonMixin", "MuonMonitor",
        "MuonWithAdamW", "ParamDiagnostics", "QKClip", "Routing", "WallClock", "WarmupCosine", "WeightDecaySchedule",
        "adjust_lr", "muon_subclass", "orthogonality_error", "route_parameters", "trace_roles",
        "zeropower_via_newtonschulz",
    ]
    for name in lightning_muon.__all__:
        assert getattr(lightning_muon, name).__module__.startswith("lightning_muon."), name


if __name__ == "__main__":
    for module, targets in sorted(import_graph().items()):
        print(f"{module} [layer {layer(module)}] -> {', '.join(sorted(targets)) or '(nothing of ours)'}")
