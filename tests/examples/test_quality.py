"""Quality regression: on the char_gpt example, Muon + AdamW must clearly beat AdamW alone at equal steps.

Both real configs (the shipped ``gpt_muon.yaml`` and the tuned baseline
``gpt_adamw.yaml``) are fitted through the real command
(`lightning_muon.commands.cli.main`, in process) for 100 steps at seed 0, on a
smaller model than the configs' (2 layers of width 64, 64-byte context, batches
of 16: about a tenth of the compute), everything else as the configs say, and the
final validation loss is read back from the CSV log. If Muon's lead falls under
0.2 nats, the mixin, the routing or the optimizer broke something
(benchmarks/quality.py measures the full picture at the configs' size).
Measured at this size, seeds 0-3: Muon + AdamW 2.505, 2.498, 2.494, 2.509 against
AdamW alone 2.845, 2.831, 2.843, 2.838: leads of 0.341, 0.333, 0.350, 0.329 nats
(at the configs' size the lead was 0.256).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_muon.commands.cli import main
from lightning_muon.commands.compare.runs import load_run

STEPS = 100
MARGIN = 0.2  # nats
#: The smaller model and batches (the same for both sides).
SMALL = ["--model.init_args.n_layer", "2", "--model.init_args.n_embd", "64", "--model.init_args.block_size", "64",
         "--data.init_args.block_size", "64", "--data.init_args.batch_size", "16"]


def final_val_loss(config: str, save_dir: Path) -> float:
    main([
        "fit", "--config", config,
        "--seed_everything", "0",
        "--trainer.max_steps", str(STEPS),
        "--trainer.val_check_interval", str(STEPS),
        "--trainer.check_val_every_n_epoch", "null",
        "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(save_dir),
        *SMALL,
    ])
    run = load_run(next(save_dir.iterdir()))
    assert run.val_steps == (STEPS,), f"expected one validation, after step {STEPS}: {run.val_steps}"
    return run.val_loss[-1]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_muon_beats_tuned_adamw_on_char_gpt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the shipped configs by name, from any directory
    muon = final_val_loss("gpt_muon.yaml", tmp_path / "muon")
    adamw = final_val_loss("gpt_adamw.yaml", tmp_path / "adamw")
    assert muon <= adamw - MARGIN, (
        f"after {STEPS} steps Muon + AdamW has val loss {muon:.4f}, AdamW alone {adamw:.4f}: Muon's lead "
        f"{adamw - muon:.4f} is under {MARGIN} nats (it was 0.341 when the mixin and routing worked)"
    )
