"""Step time through a real Trainer: the mixin's manual loop against Lightning's automatic optimization.

Three runs of the same model and data, in one process:

- ``automatic AdamW``: a plain LightningModule whose ``configure_optimizers``
  returns fused AdamW (Lightning's automatic optimization);
- ``MuonMixin, muon=None``: the same AdamW through the mixin's manual loop, so
  only the loop differs (the overhead of the loop itself);
- ``MuonMixin, Muon + AdamW``: the default pair.

The model is Lightning's demo ``Transformer`` (2 layers, width 200) on
byte-level text from Python's standard library (offline). Each run takes
``--steps`` updates; the median wall time of a training batch (from
``on_train_batch_start`` to ``on_train_batch_end``) after ``--warmup`` steps is
reported, and the runs are repeated ``--rounds`` times in turn.

    python benchmarks/overhead.py
"""

from __future__ import annotations

import argparse
import datetime
import io
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos import LightningTransformer
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, Dataset

from lightning_muon import MuonMixin

RESULTS = Path(__file__).parent / "results" / "overhead.md"


class StdlibText(Dataset):
    """Byte windows of the standard library's ``json``, ``argparse`` and ``inspect`` sources."""

    def __init__(self, length: int = 64) -> None:
        import argparse as a
        import inspect as i
        import json as j

        data = b"".join(Path(m.__file__).read_bytes() for m in (j, a, i))
        tokens = torch.tensor(list(data), dtype=torch.long)
        count = (len(tokens) - 1) // length
        self.x = tokens[: count * length].view(count, length)
        self.y = tokens[1 : count * length + 1].view(count, length)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Automatic(LightningTransformer):
    def __init__(self) -> None:
        super().__init__(vocab_size=256)

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self):
        return DataLoader(StdlibText(), batch_size=16, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)


class WithMixin(MuonMixin, Automatic):
    pass


class BatchTimer(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)


def run(make: callable, steps: int, warmup: int) -> list[float]:
    torch.manual_seed(0)
    model = make()
    timer = BatchTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model)
    return timer.times[warmup:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    runs = {
        "automatic AdamW (plain LightningModule)": Automatic,
        "MuonMixin, muon=None (same AdamW, manual loop)": lambda: WithMixin(muon=None),
        "MuonMixin, Muon + AdamW": WithMixin,
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, make in runs.items():
            times[name] += run(make, args.steps, args.warmup)

    baseline = statistics.median(times["automatic AdamW (plain LightningModule)"])
    table = Table(title="training step through Trainer (median)")
    for column in ("run", "step ms", "ratio to automatic AdamW"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, t in times.items():
        median = statistics.median(t)
        table.add_row(name, f"{1e3 * median:.1f}", f"{median / baseline:.3f}")
    console = Console()
    console.print(table)
    machine = f"{torch.get_num_threads()} threads, torch {torch.__version__}, lightning {L.__version__}"
    console.print(machine)
    if not args.no_write:
        buffer = io.StringIO()
        Console(file=buffer, width=120, no_color=True, force_terminal=False).print(table)
        command = " ".join(["python benchmarks/overhead.py"] + (argv if argv is not None else sys.argv[1:]))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            f"# Manual-loop overhead\n\n`{command}` on {datetime.date.today()}: {machine}; "
            f"{args.rounds} rounds x {args.steps - args.warmup} timed steps per run.\n\n```\n{buffer.getvalue()}```\n"
        )
        console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
