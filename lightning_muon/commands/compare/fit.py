"""One fit of ``compare``: the arguments of ``lightning-muon fit`` it runs, and the subprocess that runs them.

`fit_arguments` adds a CSVLogger writing where ``compare`` reads, the `lightning_muon.WallClock` callback, frequent
validation and no checkpoints to a config (see `lightning_muon.commands.compare.run` for the whole list);
`fit_in_subprocess` runs ``python -m lightning_muon fit`` with them, so DDP configs work as they do on their own.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_muon.commands.config_files import merged_config

#: The callback ``compare`` adds to every fit.
CLOCK = "lightning_muon.WallClock"
#: The callback ``compare --target`` adds to every fit made once the target is known.
NEAR_TARGET = "lightning_muon.commands.compare.near_target.NearTargetValidation"


def val_check_interval(max_steps: int, points: int) -> int:
    """Validate every this many steps to get about ``points`` validations in ``max_steps``.

    A divisor of ``max_steps`` when one gives between half and twice
    ``points`` validations (so the last one is at the last step); else
    ``round(max_steps / points)``.
    """
    if max_steps < 1 or points < 1:
        raise ValueError(f"max_steps and points must be >= 1, got {max_steps} and {points}")
    ideal = max_steps / points
    divisors = [d for d in range(1, max_steps + 1) if max_steps % d == 0 and points / 2 <= max_steps / d <= 2 * points]
    if divisors:
        return min(divisors, key=lambda d: (abs(d - ideal), d))
    return max(1, round(ideal))


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value of ``--key value`` or ``--key=value`` among the overrides (the last one), else None."""
    value = None
    for i, arg in enumerate(overrides):
        if arg == f"--{key}" and i + 1 < len(overrides):
            value = overrides[i + 1]
        elif arg.startswith(f"--{key}="):
            value = arg.split("=", 1)[1]
    return value


def _callback_paths(config: dict[str, Any]) -> list[str]:
    """The class paths of the config's ``trainer.callbacks`` (a list, or a single callback)."""
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    if not isinstance(callbacks, list):
        callbacks = [callbacks]
    return [c.get("class_path", "") if isinstance(c, dict) else str(c) for c in callbacks]


def fit_arguments(
    config: str | os.PathLike,
    log_root: str | os.PathLike,
    name: str,
    overrides: Sequence[str] = (),
    max_steps: int | None = None,
    val_points: int = 12,
    target: float | None = None,
    resolution: float = 0.02,
) -> list[str]:
    """The arguments of ``lightning-muon fit`` for one run of ``compare`` (see the module docstring); with a
    ``target``, `NEAR_TARGET` validating densely near it, every ``resolution`` of the steps done."""
    merged = merged_config(config)
    callbacks = _callback_paths(merged)
    args = ["--config", str(config)]
    if max_steps is not None:
        args += ["--trainer.max_steps", str(max_steps)]
    args += list(overrides)
    steps = (max_steps or override_value(overrides, "trainer.max_steps")
             or (merged.get("trainer") or {}).get("max_steps"))
    steps = int(steps) if steps not in (None, "null") else -1
    if steps > 0 and override_value(overrides, "trainer.val_check_interval") is None:
        args += [
            "--trainer.val_check_interval", str(val_check_interval(steps, val_points)),
            "--trainer.check_val_every_n_epoch", "null",  # the interval counts steps across epochs
        ]
    has_checkpoint = any(p.endswith("ModelCheckpoint") for p in callbacks)
    if override_value(overrides, "trainer.enable_checkpointing") is None and not has_checkpoint:
        args += ["--trainer.enable_checkpointing", "false"]
    if not any(p.endswith("WallClock") for p in callbacks) and not any("WallClock" in a for a in overrides):
        args += [f"--trainer.callbacks+={CLOCK}"]
    if target is not None:  # its init_args follow it: they go to the callback added last
        args += [f"--trainer.callbacks+={NEAR_TARGET}", "--trainer.callbacks.target", repr(float(target)),
                 "--trainer.callbacks.resolution", repr(float(resolution))]
    args += [  # last: compare reads the logs from here
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.init_args.save_dir", str(log_root),
        "--trainer.logger.init_args.name=",
        "--trainer.logger.init_args.version", name,
    ]
    return args


def fit_in_subprocess(args: Sequence[str], output: str | os.PathLike | None = None,
                      env: Mapping[str, str] | None = None) -> int:
    """Run ``python -m lightning_muon fit ARGS`` (this Python, this working directory); its output goes to the
    terminal, or to the file ``output`` (stdout and stderr together, after a first line with the command). Returns
    the exit code."""
    command = [sys.executable, "-m", "lightning_muon", "fit", *args]
    if output is None:
        return subprocess.run(command, env=env).returncode
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w") as file:
        file.write("$ " + shlex.join(["lightning-muon", "fit", *args]) + "\n")
        file.flush()
        return subprocess.run(command, stdout=file, stderr=subprocess.STDOUT, env=env).returncode
