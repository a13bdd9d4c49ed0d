"""The documentation site (``mkdocs.yml``, ``docs/``): it builds with no warning (a broken link or
cross-reference, a missing page, a docstring mkdocstrings cannot read fails), its API reference covers the declared
public surface, and every Markdown table in it and in the README renders as a table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_muon
import lightning_muon.attention
import lightning_muon.optim.groups

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_the_site_builds_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "optimizers" / "index.html").is_file()


def documented() -> set[str]:
    """The objects the API pages render (``::: dotted.path`` lines), by their last name; a whole module's
    page renders every name in its ``__all__``."""
    names: set[str] = set()
    for page in (DOCS / "api").glob("*.md"):
        for path in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.MULTILINE):
            module = {"lightning_muon.attention": lightning_muon.attention,
                      "lightning_muon.optim.groups": lightning_muon.optim.groups}.get(path)
            names |= set(module.__all__) if module is not None else {path.rsplit(".", 1)[-1]}
    return names


@pytest.mark.parametrize("tier", [lightning_muon, lightning_muon.attention, lightning_muon.optim.groups],
                         ids=lambda m: m.__name__)
def test_the_api_reference_covers_every_public_name(tier):
    missing = sorted(set(tier.__all__) - documented())
    assert not missing, f"{tier.__name__} names with no place in docs/api/: {missing}"


def glued_to_a_table(text: str) -> list[str]:
    """Lines of text directly under a Markdown table (outside code blocks): a renderer reads them as more rows."""
    glued, fenced, previous = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and previous.startswith("|") and line.strip() and not line.startswith("|"):
            glued.append(line)
        previous = "" if fenced else line
    return glued


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))], ids=lambda p: p.name)
def test_every_table_stands_alone(page):
    assert glued_to_a_table(page.read_text()) == []


def test_text_glued_under_a_table_is_caught():
    assert glued_to_a_table("| a | b |\n|---|---|\n| 1 | 2 |\nglued\n") == ["glued"]
    assert glued_to_a_table("| a | b |\n|---|---|\n| 1 | 2 |\n\napart\n") == []


#: The pages whose Python blocks the tests run, and how many each has: the guides' in the tests that read them
#: (tests/test_readme.py, tests/optim/test_one_optimizer_readme.py, tests/attention/test_qk_readme.py), the
#: ten-line example of the README and the getting-started page here.
RUN_BY_TESTS = {"guides/plain-pytorch.md": 2, "guides/one-optimizer.md": 3, "guides/qk-clip.md": 2, "index.md": 1}


def test_every_python_block_is_run_by_a_test():
    pages = {page.relative_to(DOCS).as_posix(): page.read_text() for page in DOCS.rglob("*.md")}
    counts = {name: text.count("```python\n") for name, text in pages.items() if "```python\n" in text}
    assert counts == RUN_BY_TESTS
    assert python_blocks((ROOT / "README.md").read_text()) == python_blocks(pages["index.md"])


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_ten_line_example_trains(monkeypatch, tmp_path):
    """The README's (and the getting-started page's) ten lines, shortened to 2 updates, with a module and data
    of the tests' standing in for ``MyExistingModule`` and ``dm``."""
    import lightning as L

    from helpers import Regression, sine_regression_loader

    class MyExistingModule(Regression):
        def __init__(self, hidden: int = 16) -> None:
            super().__init__(widths=(hidden, hidden))

    class SineData(L.LightningDataModule):
        def train_dataloader(self):
            return sine_regression_loader(self.trainer, samples=16, batch_size=4)

    trainer = L.Trainer
    monkeypatch.setattr(L, "Trainer", lambda **kwargs: trainer(
        **{**kwargs, "max_steps": 2, "default_root_dir": str(tmp_path), "enable_progress_bar": False}))
    (block,) = python_blocks((DOCS / "index.md").read_text())
    namespace = {"MyExistingModule": MyExistingModule, "dm": SineData()}
    exec(compile(block, "docs/index.md", "exec"), namespace)
    assert namespace["trainer"].global_step == 2 and namespace["model"].muon_routing().names("Muon")


def test_the_readme_names_pages_that_exist():
    """The README is the newcomer's first screen: each capability a paragraph and its page's path (paths, not
    links: relative links break on a package index page, tests/test_packaging.py)."""
    text = (ROOT / "README.md").read_text()
    pages = re.findall(r"`(docs/[\w/-]+\.md)`", text)
    assert {"docs/guides/mixin.md", "docs/guides/fine-tuning.md", "docs/guides/distributed.md",
            "docs/troubleshooting.md", "docs/benchmarks.md"} <= set(pages)
    assert [page for page in pages if not (ROOT / page).is_file()] == []
    assert len(text.splitlines()) <= 200
