"""The command's help: ``lightning-muon --help`` (and no argument) is our overview of every subcommand, one line each;
``inspect --help`` is inspect's own; ``fit --help`` and a bare ``--config FILE fit`` stay LightningCLI's."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_muon.commands.cli import COMMANDS, main

SUBCOMMANDS = ["fit", "validate", "test", "predict", "inspect", "compare", "configs", "convert-checkpoint"]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """No pytest arguments in ``sys.argv``, which LightningCLI would warn about next to explicit args."""
    monkeypatch.setattr(sys, "argv", ["lightning-muon"])


@pytest.fixture
def no_lightning_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    """lightning-sdk looks absent, so ``--help`` is ours alone wherever it is installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lightning_sdk" else real(name, *a)
    )


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``main(args)``'s exit status (0 when it returns), stdout and stderr."""
    try:
        main(args)
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else (0 if exit_info.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def assert_overview(text: str) -> None:
    """A usage line naming all eight subcommands, then each on a line of its own with a description."""
    lines = text.splitlines()
    assert lines[0].startswith("usage: lightning-muon "), lines[0]
    assert "{" + ",".join(SUBCOMMANDS) + "}" in lines[0], lines[0]
    for name in SUBCOMMANDS:
        described = [line for line in lines if re.fullmatch(rf"\s+{re.escape(name)}\s{{2,}}\S.{{20,}}", line)]
        assert len(described) == 1, (name, text)
    assert "lightning-muon SUBCOMMAND --help" in text


def test_the_eight_subcommands_are_the_dispatched_ones() -> None:
    assert list(COMMANDS) == SUBCOMMANDS


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_the_overview(flag: str, no_lightning_sdk: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main([flag], capsys)
    assert code == 0, err
    assert_overview(out)
    assert "lightning-sdk" not in out
    assert len(out.splitlines()) < 40


def test_no_argument_prints_the_overview_to_stderr_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main([], capsys)
    assert code == 2
    assert out == ""
    assert_overview(err)
    assert err.rstrip().splitlines()[-1].startswith("lightning-muon: error:")


def test_python_m_lightning_muon_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_muon", "--help"], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    assert_overview(result.stdout)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_inspect_help_is_inspects_own(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["inspect", flag], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("usage: lightning-muon inspect"), lines[0]
    assert "--config FILE" in lines[0]
    assert len(lines) < 60, len(lines)
    assert "routing" in out and "effective learning rate" in out  # what it does
    assert "--config" in out and "lightning-muon fit --help" in out  # its flag, and where fit's options are
    assert "--trainer.max_steps" not in out  # not fit's 446 lines


def test_inspect_help_wins_over_a_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["inspect", "--config", "gpt_muon.yaml", "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: lightning-muon inspect")


def test_inspect_without_arguments_shows_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["inspect"], capsys)
    assert code == 2
    assert err.startswith("usage: lightning-muon inspect")
    assert "--config FILE" in err.splitlines()[-1]
    assert len(err.splitlines()) < 5


def test_fit_help_stays_lightning_clis(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["fit", "--help"], capsys)
    assert code == 0, err
    assert "--trainer.max_steps" in out and "--ckpt_path" in out


def test_a_config_before_the_subcommand_still_goes_to_lightning_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "all.yaml"
    config.write_text(
        "fit:\n  model:\n    class_path: lightning.pytorch.demos.boring_classes.BoringModel\n"
        "  trainer:\n    max_steps: 7\n"
    )
    code, out, err = run_main(["--config", str(config), "fit", "--print_config"], capsys)
    assert code == 0, err
    assert "max_steps: 7" in out and "BoringModel" in out
