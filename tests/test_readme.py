"""The guides' code, run as written: the "Without the Trainer" loops (plain PyTorch and Fabric,
docs/guides/plain-pytorch.md), and every command of docs/guides/command.md."""

from __future__ import annotations

import re

import pytest
import torch

from helpers import DOCS, code_blocks

PAGES = {"Without the Trainer": "guides/plain-pytorch.md", "The command and the configs": "guides/command.md"}


def section(title: str) -> str:
    return (DOCS / PAGES[title]).read_text()


def python_blocks(title: str) -> list[str]:
    return code_blocks(PAGES[title])


def test_the_section_has_both_loops():
    blocks = python_blocks("Without the Trainer")
    assert len(blocks) == 2
    assert "fabric.setup(model, muon, adamw)" in blocks[1] and "Fabric" not in blocks[0]


@pytest.mark.parametrize("index", [0, 1], ids=["plain PyTorch", "Fabric"])
def test_a_loop_without_the_trainer_learns_and_prints_what_the_page_shows(index, capsys):
    torch.manual_seed(0)
    namespace: dict = {}
    block = python_blocks("Without the Trainer")[index]
    exec(compile(block, f"docs/guides/plain-pytorch.md block {index}", "exec"), namespace)
    assert namespace["loss"].item() < 0.5  # from about ln(16) = 2.77
    assert namespace["routing"].names("Muon") == ["2.weight", "4.weight"]
    (shown,) = re.findall(r"```text\n(.*?)```", section("Without the Trainer"), re.S)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == shown.splitlines()[0]  # the routing: exact
    number = re.compile(r"\d+\.\d+")
    assert [number.sub("N", line) for line in printed[1:]] == [number.sub("N", line) for line in shown.splitlines()[1:]]


def test_the_fabric_example_module_learns():
    from lightning_muon.examples import fabric_loop

    losses = fabric_loop.train(steps=60)
    assert losses[-1] < 0.5 * losses[0]


# ------------------------------------------------------------------ "The command and the configs", each command run

FAST = ["--trainer.fast_dev_run", "2", "--trainer.enable_progress_bar", "false"]


def readme_commands() -> list[tuple[list[str], str]]:
    """Each ``lightning-muon ...`` line of the section's bash block, as (argv without the program, its comment);
    a comment ``also: validate, test`` adds those subcommands with the same config."""
    (block,) = re.findall(r"```bash\n(.*?)```", section("The command and the configs"), re.S)
    commands = []
    for line in block.splitlines():
        code, _, comment = line.partition("#")
        argv = code.split()
        assert argv[0] == "lightning-muon", line
        commands.append((argv[1:], comment.strip()))
        also = re.search(r"also: ([a-z, ]+)", comment)
        for subcommand in also.group(1).split(", ") if also else []:
            commands.append(([subcommand.strip(), *argv[2:]], f"(also {subcommand})"))
    return commands


COMMANDS = readme_commands()


@pytest.mark.parametrize(
    ("argv", "comment"),
    [pytest.param(a, c, marks=[pytest.mark.slow] if a[0] == "compare" else []) for a, c in COMMANDS],
    ids=[" ".join(a) for a, _ in COMMANDS],
)
def test_each_readme_command_runs_as_written(argv, comment, tmp_path, monkeypatch, capsys):
    """With a tiny length override only: fast_dev_run for the LightningCLI subcommands, 2 steps for compare."""
    from lightning_muon.commands.cli import main

    monkeypatch.chdir(tmp_path)
    if argv[0] in ("fit", "validate", "test"):
        argv = [*argv, *FAST]
    elif argv[0] == "compare":
        argv = [*argv, "--max_steps", "2", "--trainer.limit_val_batches", "1", "--out", str(tmp_path / "compare")]
    main(argv)
    out = capsys.readouterr().out
    if argv[:2] == ["configs", "--copy"]:
        assert (tmp_path / argv[2]).is_file()
    elif argv[0] == "configs":
        assert "gpt_muon.yaml" in out
    elif argv[0] == "compare":
        assert (tmp_path / "compare" / "comparison.png").is_file()


def test_the_readme_names_every_shipped_config_and_command():
    from lightning_muon.commands.cli import COMMANDS as SUBCOMMANDS
    from lightning_muon.commands.config_files import shipped_configs

    text = section("The command and the configs")
    for config in shipped_configs():
        assert f"`{config.name}`" in text, config.name
    written = {a[0] for a, _ in COMMANDS}
    assert {"fit", "validate", "test", "inspect", "compare", "configs"} <= written
    assert written <= {c for c in SUBCOMMANDS if c}
