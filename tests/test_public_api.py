"""The declared public surface, pinned: the names each public module exports (a change to them is a decision,
made here in the open), each with a docstring; and the library's logger, which gets no output of its own."""

from __future__ import annotations

import subprocess
import sys


def _fresh(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` run in a fresh interpreter (nothing imported or set up by the tests)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=180, check=True
    )


def test_importing_the_library_leaves_its_logger_with_one_null_handler():
    """Python's guidance for libraries: a `NullHandler` and nothing else; the application chooses the output."""
    result = _fresh(
        "import logging\n"
        "import lightning_muon, lightning_muon.optim, lightning_muon.lightning, lightning_muon.callbacks\n"
        "import lightning_muon.commands.cli\n"
        "from lightning_muon import MuonMixin, MuonMonitor\n"
        "logger = logging.getLogger('lightning_muon')\n"
        "print([type(h).__name__ for h in logger.handlers], logger.level, logger.propagate)\n"
    )
    assert result.stdout.strip() == "['NullHandler'] 0 True"


def test_the_command_prints_the_library_logger_at_info_on_stderr():
    """Run as the command (``main()`` reading ``sys.argv``), the ``lightning_muon`` logger's INFO lines reach
    stderr, as a distributed fit's line on which path the optimizer takes does."""
    result = _fresh(
        "import logging, sys\n"
        "from lightning_muon.commands.cli import main\n"
        "sys.argv = ['lightning-muon', 'configs']\n"
        "main()\n"
        "logging.getLogger('lightning_muon.optim').info('Muon: a line at INFO')\n"
        "logging.getLogger('lightning_muon').debug('Muon: a line at DEBUG')\n"
    )
    assert result.stderr.splitlines() == ["Muon: a line at INFO"], result.stderr
