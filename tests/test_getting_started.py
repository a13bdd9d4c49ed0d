"""The getting-started page (docs/index.md) against real runs: its ten lines (the README's too) train, and print the
routing table, the warning, the first-batch line and the result line the page shows; the monitor's rows read back
as shown; "your own module" routes and trains as shown; "your own config"'s commands run as written. Runs are
shortened (a few updates, a small corpus): the numbers may differ from the page, the lines' shape may not."""

from __future__ import annotations

import functools
import re
import warnings

import pytest

from helpers import DOCS, code_blocks

ROOT = DOCS.parent
PAGE = "index.md"


def shape(line: str) -> re.Pattern[str]:
    """A shown line as a pattern: every number any number (``2.5654``, ``100``, ``0.0003``, ``1.377e-03``)."""
    return re.compile(re.sub(r"\\\d[\d.]*(?:e[-+]?\d+)?|\d[\d.]*(?:e[-+]?\d+)?", r"[\\d.]+(?:e[-+]?\\d+)?",
                             re.escape(line)))


def test_the_shape_of_a_line_takes_other_numbers_only():
    pattern = shape("MuonGPT: val_loss 2.5654 after 100 steps; in logs/version_0")
    assert pattern.fullmatch("MuonGPT: val_loss 3.1 after 4 steps; in logs/version_0")
    assert not pattern.fullmatch("MuonGPT: val_loss 3.1 after 4 steps; in logs/version_0 and more")
    assert not pattern.fullmatch("CharGPT: val_loss 3.1 after 4 steps; in logs/version_0")


def test_the_readme_shows_the_page_s_ten_lines_and_result_line():
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"```python\n(.*?)```", readme, re.S) == code_blocks(PAGE)[:1]
    result = code_blocks(PAGE, "text")[3].strip()
    assert f"`{result}`" in readme


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The ten lines and the monitor's read-back, run as written but for the length (4 updates, a validation
    every 2, a 200 kB corpus in a fresh cache) and the routing table in plain columns (as without rich), its
    reasons wrapped to fit the page's 100: what they print, log and warn."""
    import contextlib
    import io
    import logging
    import os

    import lightning as L

    from lightning_muon.examples import char_gpt
    from lightning_muon.routing._routing import Routing

    work = tmp_path_factory.mktemp("first_run")
    patch = pytest.MonkeyPatch()
    patch.chdir(work)
    trainer = L.Trainer
    patch.setattr(L, "Trainer", lambda **kwargs: trainer(**{
        **kwargs, "max_steps": 4, "val_check_interval": 2, "limit_val_batches": 2, "log_every_n_steps": 2,
        "enable_progress_bar": False}))
    patch.setattr(char_gpt, "StdlibTextDataModule", functools.partial(
        char_gpt.StdlibTextDataModule, max_bytes=200_000, cache_dir=str(work / "cache")))
    patch.setattr(Routing, "render", lambda self, effective_lr=None, width=140: self.plain_table(effective_lr, 100))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    # rank_zero_info logs to the logger of the Lightning package imported last (``lightning.pytorch`` or the
    # standalone ``pytorch_lightning``: each sets lightning_utilities' module-level one): listen on both.
    rank_zero_logs = [logging.getLogger(f"{package}.utilities.rank_zero") for package in ("lightning.pytorch",
                                                                                           "pytorch_lightning")]
    for log in rank_zero_logs:
        log.addHandler(handler)
    printed = io.StringIO()
    namespace: dict = {}
    try:
        with contextlib.redirect_stdout(printed), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            ten, read_back = code_blocks(PAGE)[:2]
            exec(compile(ten, "docs/index.md block 0", "exec"), namespace)
            exec(compile(read_back, "docs/index.md block 1", "exec"), namespace)
    finally:
        for log in rank_zero_logs:
            log.removeHandler(handler)
        patch.undo()
    assert os.path.isdir(work / "logs")
    return {"printed": printed.getvalue(), "logged": "\n".join(records),
            "warned": [str(w.message) for w in warned], "namespace": namespace}


def test_the_first_run_prints_the_routing_table_on_the_page(first_run):
    table = code_blocks(PAGE, "text")[0].rstrip("\n")
    logged = "\n".join(line.rstrip() for line in first_run["logged"].splitlines())
    assert table in logged


def test_the_first_run_warns_as_the_page_shows(first_run):
    (warning,) = [w for w in first_run["warned"] if "configure_optimizers is replaced" in w]
    assert " ".join(warning.split()) == " ".join(code_blocks(PAGE, "text")[1].split())  # wrapped on the page


def test_the_first_run_confirms_the_routing_and_ends_with_the_result_line(first_run):
    confirmed, result = (block.strip() for block in code_blocks(PAGE, "text")[2:4])
    assert any(shape(confirmed).fullmatch(line) for line in first_run["logged"].splitlines()), first_run["logged"]
    lines = first_run["printed"].splitlines()
    assert any(shape(result).fullmatch(line) for line in lines), lines
    assert first_run["namespace"]["trainer"].global_step == 4


def test_the_monitor_s_row_reads_back_as_shown(first_run):
    shown = code_blocks(PAGE, "text")[4].strip().splitlines()
    printed = [line for line in first_run["printed"].splitlines() if line.startswith(("lr-", "muon/"))]
    assert [line.split()[0] for line in printed] == [line.split()[0] for line in shown]
    assert all(shape(s).fullmatch(p) for s, p in zip(shown, printed)), printed
    # the lrs the page shows are the mixin's defaults, whatever the run
    assert [p for p in printed if p.startswith("lr-")] == [s for s in shown if s.startswith("lr-")]


def test_your_own_module_routes_and_trains_as_shown(monkeypatch, tmp_path, capsys):
    """As written, 100 updates of a small MLP (a few seconds)."""
    import torch

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    block = code_blocks(PAGE)[2]
    exec(compile(block, "docs/index.md block 2", "exec"), {"__name__": "own_module"})
    printed = capsys.readouterr().out.strip().splitlines()[-3:]
    shown = code_blocks(PAGE, "text")[5].strip().splitlines()
    assert printed[:2] == shown[:2]  # the routing: exact
    assert shape(shown[2]).fullmatch(printed[2])
    assert float(printed[2].split()[-1]) < 0.5  # from about 8 (the variance of a sum of 8 normals)


def own_config_commands() -> list[list[str]]:
    (block,) = code_blocks(PAGE, "bash")[1:]
    return [line.partition("#")[0].split()[1:] for line in block.strip().splitlines()]


@pytest.mark.parametrize("argv", own_config_commands(), ids=" ".join)
def test_your_own_config_s_commands_run_as_written(argv, monkeypatch, tmp_path):
    from lightning_muon.commands.cli import main

    monkeypatch.chdir(tmp_path)
    if argv[0] != "configs":
        main(["configs", "--copy", "existing_module_muon.yaml"])  # the block's first command, here too
    main([*argv, "--trainer.fast_dev_run", "2", "--trainer.enable_progress_bar", "false"] if argv[0] == "fit"
         else argv)
    assert (tmp_path / "existing_module_muon.yaml").is_file()


def test_the_page_has_the_blocks_these_tests_read():
    assert len(code_blocks(PAGE)) == 3 and len(code_blocks(PAGE, "text")) == 6
    assert (DOCS / PAGE).read_text().count("```bash\n") == 2
