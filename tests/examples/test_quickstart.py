"""examples/quickstart.py (lightning_muon.examples.quickstart): the plain-PyTorch tour of routing and Muon."""

from __future__ import annotations

from lightning_muon.examples import quickstart


def test_quickstart_routes_trains_and_reports(capsys):
    quickstart.main(["--steps", "30"])
    out = capsys.readouterr().out
    assert "output head `6`" in out  # the classifier stays on AdamW
    assert "Muon: 3 tensors" in out
    muon_line = next(line for line in out.splitlines() if "Muon + AdamW :" in line)
    adamw_line = next(line for line in out.splitlines() if "AdamW alone  :" in line)
    accuracy = [float(line.rsplit("accuracy", 1)[1]) for line in (muon_line, adamw_line)]
    assert all(0.5 < a <= 1.0 for a in accuracy), out
    assert sum("  error " in line for line in out.splitlines()) == 3  # one diagnostics line per Muon matrix
