"""``benchmarks/device_check.py`` at its short size on the CPU, every line of it: the correctness checks pass, the
step tables and the results file (device, versions, date) are written (here to a temporary folder)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
MODULES = ("device_check", "optimizer_step", "qk_clip", "_common", "_report")


@pytest.fixture
def device_check(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import device_check

    import _report

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    monkeypatch.setattr(_report, "RESULTS_MD", tmp_path / "RESULTS.md")
    yield device_check
    for name in MODULES:
        sys.modules.pop(name, None)


def test_a_failing_check_is_marked_and_fails_the_run(device_check):
    checks = [device_check.Check("within", 0.5, 1.0), device_check.Check("over", 2.0, 1.0)]
    assert [c.ok for c in checks] == [True, False]
    assert "NO" in device_check._report.as_text(device_check.checks_table(checks))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_short_device_check_passes_on_the_cpu_and_writes_its_results(device_check, tmp_path):
    assert device_check.main(["--device", "cpu", "--size", "short", "--write"]) == 0
    text = (tmp_path / "device_check_cpu.md").read_text()
    assert text.startswith("# Device check (cpu (this CPU")
    assert "python benchmarks/device_check.py --device cpu --size short --write" in text
    assert "torch 2." in text and "lightning 2." in text and "Newton-Schulz in" in text
    correctness = text[text.index("correctness"):text.index("optimizer step on cpu")]
    assert correctness.count(" yes ") == 8 and " NO " not in correctness
    steps = text[text.index("optimizer step on cpu"):]
    for row in ("ours (bf16) ", "torch.optim.Muon", "torch.optim.AdamW", "compiled)", "x the NS limit"):
        assert row in steps, row  # (rich wraps long labels within their column)
    assert "<!-- device_check_cpu:start -->" in (tmp_path / "RESULTS.md").read_text()
