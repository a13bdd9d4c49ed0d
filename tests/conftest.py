"""Shared test setup."""

from __future__ import annotations

import multiprocessing
import socket

import pytest


@pytest.fixture(autouse=True)
def _fresh_master_port(monkeypatch):
    """A free port for each test's process group.

    Lightning stores the port it picks in ``os.environ["MASTER_PORT"]`` and reuses it for every later
    DDP run in the same process, where the previous run's socket may still be closing: flaky aborts.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


def pytest_configure(config):
    """The fork server the tests start their own ranks from (`helpers.RANKS_START_METHOD`) imports these once;
    each rank forked from it starts without importing them again."""
    multiprocessing.set_forkserver_preload(["torch", "lightning", "lightning_muon", "helpers", "fsdp2_run", "tp_run"])
