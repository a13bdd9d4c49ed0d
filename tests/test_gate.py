"""The gate: a failing test fails the test command, also after a distributed test has run in the same process.

A distributed test's one-process half used to register ``os._exit(0)`` at interpreter exit inside the pytest
process itself (``helpers.EndProcessGroup``), so ``1 failed, 2 passed`` exited 0 and CI could not stop a
regression. The pytest step of ``.ci/run`` is run as written, and ``.ci/run`` runs the README's test command.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A distributed test whose one-process fit runs inside the pytest process (where the exit override was).
DISTRIBUTED_TEST = "tests/test_distributed.py::test_two_ranks_with_half_batches_equal_one_process[split]"


def readme_test_command() -> str:
    """The README's test command: the line after ``# the tests`` in its first bash block."""
    lines = (ROOT / "README.md").read_text().splitlines()
    return next(lines[i + 1] for i, line in enumerate(lines) if line.startswith("# the tests"))


def ci_command() -> str:
    """The command ``.ci/run`` runs: its last line."""
    return (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]


def pytest_step(command: str) -> list[str]:
    """The pytest part of a ``a && b && python -m pytest ...`` chain, as argv."""
    (step,) = [part for part in command.split("&&") if re.search(r"\bpytest\b", part)]
    argv = shlex.split(step)
    assert argv[:3] == ["python", "-m", "pytest"], step
    return [sys.executable, *argv[1:]]


def test_ci_runs_the_readme_test_command():
    assert ci_command() == readme_test_command()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failing_test_after_a_distributed_one_fails_the_ci_command(tmp_path):
    failing = tmp_path / "test_deliberately_failing.py"
    failing.write_text("def test_fails():\n    assert False, 'deliberately'\n")
    command = pytest_step(ci_command())
    result = subprocess.run(
        [*command, "-p", "no:cacheprovider", DISTRIBUTED_TEST, str(failing)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\b1 failed, 1 passed\b", summary), result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 1, f"exit status {result.returncode} with {summary!r}"
