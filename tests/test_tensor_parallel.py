"""Tensor parallelism under `MuonMixin` (Lightning's ``ModelParallelStrategy`` with ``parallelize_module``):
Lightning's tutorial plan makes the attention and feed-forward projections DTensors and leaves the embedding,
norms and head plain tensors. The mixin's global gradient norm, its clipping (by norm and by value), its
non-finite check and the weight health check run over that mix (`lightning_muon.optim._norms`): two ranks
train as one process does (they used to die in ``aten._foreach_norm``: "got mixed torch.Tensor and DTensor")."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

#: As the FSDP2 tests: a shard-wise Newton-Schulz would be hundreds of times off it.
TOLERANCE = 1e-4


def run(out: Path, devices: int, *args: str) -> list[dict]:
    """Run tests/tp_run.py (its own free port: a port just closed may still be taken)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "tp_run.py"), str(out), "--devices", str(devices), *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, "MASTER_PORT": str(port)},
    )
    assert result.returncode == 0, f"{out.name}: {result.stderr[-3000:]}"
    return [torch.load(out / f"rank{r}.pt") for r in range(devices)]


@pytest.mark.distributed
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_the_tutorial_plan_with_clipping_trains_as_one_process(tmp_path, algorithm):
    clip = ["--clip", "0.5" if algorithm == "norm" else "0.01", "--clip-algorithm", algorithm]
    (single,) = run(tmp_path / "one", 1, *clip)
    rank0, rank1 = run(tmp_path / "tp", 2, *clip)
    assert rank0["world"] == 2
    for name, p in single["params"].items():
        assert torch.equal(rank0["params"][name], rank1["params"][name]), name
        torch.testing.assert_close(rank0["params"][name], p, atol=TOLERANCE, rtol=0, msg=name)
