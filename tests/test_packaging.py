"""What ships: the wheel holds the package, its examples, its configs and ``py.typed``; installed in a fresh venv
and run from an empty directory, the shipped configs work by name.

The wheel is installed with ``--no-deps`` into a fresh venv that sees nothing else; a ``.pth`` file then appends
the site-packages directories of the interpreter running the tests (torch and Lightning are not installed again).
That works whether the tests run in the system interpreter, in a plain venv or in a ``--system-site-packages``
one (``venv``'s own ``system_site_packages`` would give the base interpreter's packages, not an outer venv's).
A ``.pth`` line only appends a directory, so the ``.pth`` files there (an editable install of this project) are
not run, and the venv's own copy comes first on ``sys.path``; the test checks ``lightning_muon`` comes from it.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from test_dependencies import LIGHTNING, admitted

from lightning_muon.commands.config_files import SHIPPED, shipped_configs

ROOT = Path(__file__).resolve().parents[1]
#: A few seconds of the main job: 5 updates on a 200 kB corpus, one short validation.
SHORT_FIT = ["--trainer.max_steps", "5", "--trainer.val_check_interval", "5", "--trainer.limit_val_batches", "2",
             "--trainer.enable_progress_bar", "false", "--data.init_args.max_bytes", "200000",
             "--data.init_args.cache_dir", "cache"]


def source_copy(target: Path) -> Path:
    """What the build reads (pyproject, README, LICENSE, the package, the top-level configs and examples), copied:
    the build's own ``build/`` and ``*.egg-info`` then land outside the working tree."""
    target.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, target / name)
    for name in ("lightning_muon", "configs", "examples"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def build_wheel(tmp_path: Path) -> Path:
    src = source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    subprocess.run(  # the installed setuptools: no download of a build environment
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (wheel,) = dist.glob("lightning_muon-*.whl")
    return wheel


def expected_files() -> set[str]:
    """The wheel's files: the package as it is, the top-level examples/ and configs/ inside it."""
    files = {f"lightning_muon/{p.relative_to(ROOT / 'lightning_muon').as_posix()}"
             for p in (ROOT / "lightning_muon").rglob("*.py") if "__pycache__" not in p.parts}
    files |= {f"lightning_muon/examples/{p.relative_to(ROOT / 'examples').as_posix()}"
              for p in (ROOT / "examples").rglob("*.py") if "__pycache__" not in p.parts}
    files |= {f"lightning_muon/configs/{p.name}" for p in shipped_configs()}
    return files | {"lightning_muon/py.typed"}


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def outer_site_packages() -> list[str]:
    """The site-packages directories this interpreter reads: its venv's and, for a ``--system-site-packages``
    venv, the base interpreter's too."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def see_outer_packages(python: Path, cwd: Path, env: dict[str, str]) -> None:
    """Append this interpreter's site-packages to the venv of ``python`` (after the wheel is installed, so pip
    there never sees an outer copy of this project)."""
    inner = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd, env).stdout
    (Path(inner.strip()) / "outer_site_packages.pth").write_text("\n".join(outer_site_packages()) + "\n")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_the_package_examples_configs_and_license(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = email.parser.Parser().parsestr(
            archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        )
    package_files = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert package_files == expected_files()  # nothing missing, no tests/ or benchmarks/, no stray files
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    requires = metadata.get_all("Requires-Dist")
    # what lightning.pytorch.cli itself checks, below the 5.0 that removes what Lightning 2.6 calls
    assert "jsonargparse[signatures]<5,>=4.27.7" in requires
    # rich only as an extra: installed, it switches every Lightning project's progress bar to RichProgressBar
    assert [r for r in requires if r.startswith("rich") and "extra ==" not in r] == []
    # what pip reads keeps Lightning's compromised releases out (tests/test_dependencies.py: GHSA-w37p-236h-pfx3)
    lightning = [Requirement(r) for r in requires if canonicalize_name(Requirement(r).name) in LIGHTNING]
    assert sorted(canonicalize_name(r.name) for r in lightning) == sorted(LIGHTNING)
    assert [str(r) for r in lightning if admitted(r.specifier)] == []
    description = metadata.get_payload()
    # The README links its pages relatively, which a Git host resolves; a package index page cannot until
    # [project.urls] names where the repository lives (then these become absolute). Any other relative link fails.
    relative = [link for link in re.findall(r"\]\(([^)]+)\)", description) if not link.startswith(("http", "#"))]
    assert [link for link in relative if not link.startswith("docs/") and link != "CONTRIBUTING.md"] == []


@pytest.mark.slow
def test_the_installed_wheel_runs_the_shipped_configs_from_an_empty_directory(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    work = tmp_path / "empty"
    work.mkdir()
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], work, env)
    see_outer_packages(python, work, env)

    where = run([str(python), "-c", "import lightning_muon; print(lightning_muon.__file__)"], work, env).stdout
    assert Path(where.strip()).is_relative_to(env_dir), f"lightning_muon imported from {where}, not the wheel"
    shipped = Path(where.strip()).parent / "configs"
    command = str(bin_dir / "lightning-muon")

    listing = run([command, "configs"], work, env).stdout
    for config in shipped_configs():
        assert config.name in listing
    assert str(shipped) in listing

    inspected = run([command, "inspect", "--config", "gpt_muon.yaml"], work, env)
    assert "lm_head.weight" in inspected.stdout and "Muon: 16 tensors" in inspected.stdout
    assert f"gpt_muon.yaml is the shipped config {shipped / 'gpt_muon.yaml'}" in inspected.stderr

    fitted = run([command, "fit", "--config", "gpt_muon.yaml", *SHORT_FIT], work, env)
    assert re.search(r"CharGPT: val_loss [\d.]+, val_bpb [\d.]+ after 5 steps", fitted.stdout), fitted.stdout[-2000:]
    assert (work / "lightning_logs" / "gpt_muon" / "version_0" / "metrics.csv").is_file()

    fabric = run([str(python), "-m", "lightning_muon.examples.fabric_loop", "--steps", "30"], work, env).stdout
    assert "Fabric, Muon + AdamW: training loss" in fabric

    run([command, "configs", "--copy", "gpt_adamw.yaml"], work, env)  # a copy to edit, extending the shipped base
    assert (work / "gpt_adamw.yaml").read_text() == (SHIPPED / "gpt_adamw.yaml").read_text()
    assert sorted(p.name for p in work.iterdir()) == ["cache", "gpt_adamw.yaml", "lightning_logs"]


# ------------------------------------------------------------------ installing us changes nothing else; rich optional


def test_importing_lightning_muon_leaves_other_trainers_progress_bar_alone():
    code = (
        "import lightning as L\n"
        "def bar():\n"
        "    t = L.Trainer(logger=False, enable_checkpointing=False, accelerator='cpu')\n"
        "    return type(t.progress_bar_callback).__name__, type(t.callbacks[0]).__name__\n"
        "before = bar()\n"
        "import lightning_muon, lightning_muon.commands.cli, lightning_muon.commands.compare\n"
        "import lightning_muon.examples.char_gpt, lightning_muon.examples.fabric_loop\n"
        "print(before, bar())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, after = result.stdout.strip().rsplit(") (", 1)
    assert before + ")" == "(" + after, result.stdout


def test_without_rich_the_routing_table_is_plain_text(monkeypatch):
    from torch import nn

    from lightning_muon import route_parameters

    routing = route_parameters(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    monkeypatch.setitem(sys.modules, "rich.console", None)  # `from rich.console import ...` raises ImportError
    text = routing.render(lambda route: 0.02)
    lines = text.splitlines()
    assert lines[0] == "lightning_muon routing"
    assert lines[1].split() == ["parameter", "shape", "optimizer", "group", "reason", "rule", "effective", "lr"]
    assert lines[-2] == "Output heads and input layers: from names and structure (no training batch seen)."
    assert any(line.startswith("2.weight") and " Muon " in line and line.endswith("0.02") for line in lines)
    assert lines[-1].startswith("Muon: 2 tensors")
    assert "│" not in text


def test_without_rich_inspect_and_compare_print_plain_text(monkeypatch, tmp_path, capsys):
    # Lightning's own rich progress bar imports rich.console when rich is installed: import it first, so the
    # test does not depend on whether an earlier test did (what is tested is our printing without rich).
    import lightning.pytorch.callbacks.progress.rich_progress  # noqa: F401

    from lightning_muon.commands.cli import main
    from lightning_muon.commands.compare.report import Row
    from lightning_muon.commands.compare.run import _Console

    monkeypatch.setitem(sys.modules, "rich.console", None)
    monkeypatch.setitem(sys.modules, "rich.table", None)
    monkeypatch.chdir(tmp_path)
    main(["inspect", "--config", "gpt_muon.yaml"])
    out = capsys.readouterr().out
    assert re.search(r"^blocks\.0\.attn\.qkv\.weight +384x128 +Muon +hidden .* 0\.02$", out, re.M), out
    console = _Console()
    assert console.rich is None
    console.table([Row("a", True, 10, 1.5, 2.1, 10, 20.0, 30.0, 40.0, 100.0, "tokens/s")], target=1.5)
    assert capsys.readouterr().out.startswith("| run")
