"""CHANGELOG.md and CITATION.cff against pyproject.toml: the version users read is the version that installs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def version() -> str:
    """``[project]``'s version in pyproject.toml (read by pattern: ``tomllib`` is Python 3.11+)."""
    return re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def test_the_changelog_s_latest_release_is_the_package_s_version():
    releases = re.findall(r"^## (\d+\.\d+\.\d+) - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == version()


def test_the_citation_file_is_valid_yaml_with_the_package_s_version():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and str(citation["version"]) == version()
    assert citation["title"] and citation["authors"] and citation["message"]
