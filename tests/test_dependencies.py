"""No Lightning spec the project states admits the compromised releases.

``lightning`` and ``pytorch-lightning`` 2.6.2 and 2.6.3 were published on 2026-04-30 with a credential stealer that
ran on ``import lightning`` (Lightning's advisory GHSA-w37p-236h-pfx3, Lightning-AI/pytorch-lightning#21691). Every
requirement in pyproject.toml naming either package (dependencies and every extra) must exclude them, and so must
every version spec the docs, configs and CI scripts write next to Lightning's name; the Lightning installed here must
satisfy the project's own spec.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LIGHTNING = ("lightning", "pytorch-lightning")
COMPROMISED = ("2.6.2", "2.6.3")
#: ``lightning>=2.5,!=2.6.2`` or ``Lightning >= 2.5`` in prose, a shell line or a comment: the name (either package,
#: any case, an extra allowed) directly followed by a version specifier list.
_OPERATOR = r"(?:===|[<>=!~]=|[<>])\s*[0-9][\w.*+!]*"
SPEC_IN_TEXT = re.compile(rf"(?i)(?<![\w-])((?:pytorch[-_])?lightning)(?:\[[^\]]*\])?\s*({_OPERATOR}"
                          rf"(?:\s*,\s*{_OPERATOR})*)")
#: Where the project writes install lines: docs, READMEs, configs' comments, CI scripts, code.
TEXT_SUFFIXES = {".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".py"}


def admitted(specifier: SpecifierSet) -> list[str]:
    """The compromised versions ``specifier`` lets in."""
    return [release for release in COMPROMISED if specifier.contains(release, prereleases=True)]


def project_requirements(pyproject: dict) -> list[tuple[str, Requirement]]:
    """Every requirement pyproject.toml states, with where: ``dependencies`` and ``[<extra>]`` for each extra."""
    project = pyproject["project"]
    found = [("dependencies", Requirement(line)) for line in project.get("dependencies", [])]
    for extra, lines in project.get("optional-dependencies", {}).items():
        found += [(f"[{extra}]", Requirement(line)) for line in lines]
    return found


def unsafe_requirements(pyproject: dict) -> list[str]:
    """The Lightning requirements in ``pyproject`` that admit a compromised release, as ``where: requirement``."""
    return [f"{where}: {requirement}" for where, requirement in project_requirements(pyproject)
            if canonicalize_name(requirement.name) in LIGHTNING and admitted(requirement.specifier)]


def unsafe_mentions(text: str) -> list[str]:
    """The Lightning version specs written in ``text`` that admit a compromised release."""
    return [match.group(0) for match in SPEC_IN_TEXT.finditer(text)
            if admitted(SpecifierSet(re.sub(r"\s+", "", match.group(2))))]


def text_files() -> list[Path]:
    """The project's own text files (hidden folders but ``.ci`` and this file left out)."""
    files = [path for path in ROOT.rglob("*") if path.is_file() and path.suffix in TEXT_SUFFIXES
             and not any(part.startswith(".") or part.endswith(".egg-info")  # pip's copy of an older install
                         for part in path.relative_to(ROOT).parts[:-1])
             and path != Path(__file__).resolve()]
    return files + sorted((ROOT / ".ci").glob("*"))


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_no_lightning_requirement_in_pyproject_admits_a_compromised_release():
    requirements = project_requirements(pyproject())
    named = {canonicalize_name(r.name) for where, r in requirements if where == "dependencies"}
    assert set(LIGHTNING) <= named  # both named: `lightning` requires `pytorch-lightning` without a version
    assert unsafe_requirements(pyproject()) == []


def test_a_spec_admitting_a_compromised_release_is_caught():
    unsafe = {"project": {"dependencies": ["torch>=2.9", "lightning>=2.5"],
                          "optional-dependencies": {"pl": ["pytorch_lightning>=2.5,!=2.6.2"],
                                                    "ok": ["pytorch-lightning>=2.5,!=2.6.2,!=2.6.3"],
                                                    "new": ["lightning>=2.6.4"], "old": ["lightning<2.6"]}}}
    assert unsafe_requirements(unsafe) == ["dependencies: lightning>=2.5", "[pl]: pytorch_lightning!=2.6.2,>=2.5"]
    text = ("Python 3.10, Lightning>=2.5; pip install 'pytorch-lightning==2.6.3'\nlightning[extra] >= 2.6, != 2.6.2\n"
            "Lightning>=2.5,!=2.6.2,!=2.6.3, lightning 2.6.6, Lightning 2.6 still calls, lightning_version>=2.6")
    assert unsafe_mentions(text) == ["Lightning>=2.5", "pytorch-lightning==2.6.3", "lightning[extra] >= 2.6, != 2.6.2"]


def test_no_install_line_or_version_spec_in_the_project_admits_a_compromised_release():
    files = text_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "install.md" in files and ROOT / ".ci" / "run" in files
    unsafe = {path.relative_to(ROOT).as_posix(): found for path in files
              if (found := unsafe_mentions(path.read_text(errors="replace")))}
    assert unsafe == {}
    # the README and the install page do state the spec (a reader sees the exclusion, not only pip)
    for page in ("README.md", "docs/install.md", "docs/index.md"):
        assert "lightning>=2.5,!=2.6.2,!=2.6.3" in (ROOT / page).read_text().lower(), page


@pytest.mark.parametrize("distribution", LIGHTNING)
def test_the_installed_lightning_satisfies_the_projects_spec(distribution):
    try:
        installed = version(distribution)
    except PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed")
    (requirement,) = [r for where, r in project_requirements(pyproject())
                      if where == "dependencies" and canonicalize_name(r.name) == distribution]
    assert installed not in COMPROMISED, f"{distribution} {installed} is a compromised release: see GHSA-w37p-236h-pfx3"
    assert requirement.specifier.contains(installed, prereleases=True), (distribution, installed, str(requirement))
