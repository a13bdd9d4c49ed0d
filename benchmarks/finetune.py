"""Fine-tuning: does Muon lose on a model pretrained with AdamW? And where do LoRA's matrices belong?

The torchtune Muon pull request found AdamW better than Muon when fine-tuning an AdamW-pretrained model, and
Moonlight's paper reports the same for mismatched pretrain/fine-tune optimizers. This measures it here:

1. pretrain the shipped byte-level GPT (``gpt_adamw.yaml``: 4 layers, width 128, AdamW at its tuned lr) on the
   standard library's Python sources (``--pretrain-steps`` steps), through ``lightning-muon fit``;
2. fine-tune it on different text, the English of Python's own documentation (``pydoc_data/topics.py``, which the
   pretraining corpus does not hold), each side swept and seeded by ``lightning-muon compare``:

   - full fine-tuning (every weight trains): AdamW alone (``ft_adamw``); Muon + AdamW (``ft_muon``, Muon's own
     lr scale); Muon at AdamW's lr scale through ``adjust_lr_fn="match_rms_adamw"`` (``ft_muon_match``). The
     non-matrix parameters keep AdamW at the AdamW side's config lr, so these differ only in how the hidden
     matrices are updated;
   - LoRA (`lightning_muon.examples.lora.MuonLoraGPT`: the pretrained model frozen, rank-8 adapters on the block
     matrices, ``lora_A`` ``r x in`` and ``lora_B`` ``out x r``), placed by the mixin's routing settings: both on
     AdamW (``lora_adamw``, ``muon: null``), both on Muon (``lora_muon``), or split (``lora_a_muon``: ``lora_A``
     on Muon, ``lora_B`` on AdamW, the routing's default since this study; ``lora_b_muon``: the other way), each
     placed by explicit routing patterns (`PLACEMENT`). A split side sweeps its Muon lr with the AdamW half at
     ``lora_adamw``'s tuned lr, so the AdamW sides are fitted first.

The table holds every side against the tuned ``lora_adamw``; the verdicts put each LoRA side against it and each
full fine-tuning side against ``ft_adamw``.

    python benchmarks/finetune.py --write            # every side, 3 seeds
    python benchmarks/finetune.py --pretrain-steps 20 --steps 10 --seeds 1 --multipliers 1 --out /tmp/ft  # trial
    python benchmarks/finetune.py --sides lora_adamw,lora_muon --out /tmp/ft   # some sides only
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _tuned

from lightning_muon.commands.compare.aggregate import edge_notes, seeds_table, sweep_table, verdict

import _common
import _report

ADAMW_LR = 0.00075  # gpt_adamw.yaml's: the best AdamW lr of benchmarks/quality.py at 300 steps
MUON_LR = 0.02  # gpt_muon.yaml's
LORA_ADAMW_LR = 0.003  # the centre of lora_adamw's sweep (4x ADAMW_LR); gpt_lora_adamw.yaml holds its tuned 0.006
LORA_MUON_LR = 0.02  # the centre of the LoRA Muon sides' sweeps (gpt_muon.yaml's); gpt_lora_muon.yaml holds 0.01
LORA = {"lora_rank": 8, "lora_alpha": 16}  # gpt_lora_muon.yaml's
SIDES = {
    "lora_adamw": "LoRA, lora_A and lora_B on AdamW (muon: null)",
    "lora_muon": "LoRA, lora_A and lora_B on Muon (muon_params: ['*lora_A*', '*lora_B*'])",
    "lora_a_muon": "LoRA, lora_A on Muon, lora_B on AdamW at lora_adamw's tuned lr (the routing's default)",
    "lora_b_muon": "LoRA, lora_B on Muon, lora_A on AdamW at lora_adamw's tuned lr (muon_params: ['*lora_B*'], "
                   "adamw_params: ['*lora_A*'])",
    "ft_adamw": "full fine-tuning, AdamW alone",
    "ft_muon": "full fine-tuning, Muon + AdamW",
    "ft_muon_match": "full fine-tuning, Muon + AdamW, Muon at AdamW's lr scale (adjust_lr_fn=match_rms_adamw)",
}
#: Each side's AdamW-only baseline: a side's verdict is against it.
BASELINES = {name: "lora_adamw" if name.startswith("lora") else "ft_adamw" for name in SIDES}
#: The sides whose AdamW lr is ``lora_adamw``'s tuned one (their AdamW half), and the pattern that makes the half.
SPLIT = {"lora_a_muon", "lora_b_muon"}
#: Where each LoRA side puts the adapters, by routing patterns (explicit, whatever the routing's default).
PLACEMENT: dict[str, dict[str, list[str]]] = {
    "lora_muon": {"muon_params": ["*lora_A*", "*lora_B*"]},
    "lora_a_muon": {"muon_params": ["*lora_A*"], "adamw_params": ["*lora_B*"]},
    "lora_b_muon": {"muon_params": ["*lora_B*"], "adamw_params": ["*lora_A*"]},
}


def finetune_corpus() -> str:
    """The directory whose one ``.py`` file is the fine-tuning text: ``pydoc_data`` (``topics.py``, the language
    reference's English, as string literals)."""
    return str(Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data")


def pretrain(out: Path, steps: int, threads: int | None) -> tuple[Path, list[str]]:
    """Fit ``gpt_adamw.yaml`` for ``steps`` steps, keeping its last checkpoint; returns it and the command."""
    args = ["fit", "--config", "gpt_adamw.yaml", "--trainer.max_steps", str(steps),
            "--trainer.val_check_interval", str(steps), "--trainer.check_val_every_n_epoch", "null",
            "--trainer.limit_val_batches", "10",
            "--trainer.enable_progress_bar", "false", "--trainer.callbacks+=lightning_muon.WallClock",
            "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", "pretrain",
            "--trainer.logger.init_args.version", "0"]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "pretrain.out", "w") as log:
        code = subprocess.run([sys.executable, "-m", "lightning_muon", *args], stdout=log, stderr=subprocess.STDOUT,
                              env=env).returncode
    if code:
        raise RuntimeError(f"pretraining failed (exit {code}): see {out / 'pretrain.out'}")
    checkpoints = sorted((out / "pretrain").rglob("*.ckpt"))
    if not checkpoints:
        raise RuntimeError(f"pretraining wrote no checkpoint under {out / 'pretrain'}")
    return checkpoints[-1], ["lightning-muon", *args]


def validation_loss(checkpoint: Path, source_dir: str | None, batches: int) -> float:
    """The pretrained model's val loss on a corpus (``None``: the pretraining one), before any fine-tuning."""
    import lightning as L

    from lightning_muon.examples.char_gpt import GPT, StdlibTextDataModule

    model = GPT(init_from=str(checkpoint))
    data = StdlibTextDataModule(block_size=128, batch_size=32, seed=0, source_dir=source_dir)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=batches)
    (result,) = trainer.validate(model, datamodule=data, verbose=False)
    return float(result["val_loss"])


def side_config(name: str, checkpoint: Path, steps: int, lora_adamw_lr: float = LORA_ADAMW_LR) -> dict[str, Any]:
    """A fine-tuning side: the shipped GPT's trainer settings, the fine-tuning corpus, the pretrained weights; a
    LoRA side's model is `MuonLoraGPT` on them, its AdamW at ``lora_adamw_lr``."""
    model: dict[str, Any] = {"class_path": "lightning_muon.examples.char_gpt.CharGPT",
                             "init_args": {"n_layer": 4, "n_embd": 128, "init_from": str(checkpoint)}}
    if name == "ft_adamw":
        optimizers = _tuned.optimizers(None, ADAMW_LR)
    elif name == "ft_muon":
        optimizers = _tuned.optimizers(MUON_LR, ADAMW_LR)
    elif name == "ft_muon_match":
        optimizers = _tuned.optimizers(ADAMW_LR, ADAMW_LR, adjust_lr_fn="match_rms_adamw")
    else:
        model = {"class_path": "lightning_muon.examples.lora.MuonLoraGPT",
                 "init_args": {"init_from": str(checkpoint), **LORA}}
        optimizers = _tuned.optimizers(None if name == "lora_adamw" else LORA_MUON_LR, lora_adamw_lr)
        optimizers.update(PLACEMENT.get(name, {}))
    model["init_args"].update(optimizers)
    return {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": steps, "log_every_n_steps": 10,
                    "enable_model_summary": False, "enable_progress_bar": False},
        "data": {"class_path": "lightning_muon.examples.char_gpt.StdlibTextDataModule",
                 "init_args": {"block_size": 128, "batch_size": 32, "seed": 0, "source_dir": finetune_corpus()}},
        "model": model,
    }


def parse_sides(text: str) -> list[str]:
    """``--sides``: names of `SIDES` separated by commas, in `SIDES`' order; an unknown one is an error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIDES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown side(s) {', '.join(unknown) or '(none given)'}: choose from "
                                         f"{', '.join(SIDES)}")
    return [n for n in SIDES if n in names]


def fit_sides(names: Sequence[str], out: Path, checkpoint: Path, args: argparse.Namespace,
              lora_adamw_lr: float) -> list[list[str]]:
    """Write the sides' configs and tune them through ``lightning-muon compare`` into ``out/compare`` (a best lr
    at an end of its grid extended past it); returns the compare commands."""
    if not names:
        return []
    configs = [_tuned.write_config(out / "configs" / f"{name}.yaml",
                                   side_config(name, checkpoint, args.steps, lora_adamw_lr),
                                   f"Fine-tuning, {SIDES[name]}; written by benchmarks/finetune.py")
               for name in names]
    common = ["--val_points", "6", "--trainer.limit_val_batches", str(args.val_batches)]
    options = ["--multipliers", args.multipliers, "--seeds", str(args.seeds), *common]
    print(f"finetune: lightning-muon compare on {', '.join(names)} (output in {out}/compare/)", flush=True)
    commands = [_tuned.compare(configs, out / "compare", options, args.threads)]
    _tuned.extend_edges(configs, out / "compare", args.seeds, common, args.threads, label="finetune")
    return commands


def table_baseline(names: Sequence[str]) -> str:
    """The side the table is against: ``lora_adamw``, else ``ft_adamw``, else the first side run."""
    return next((b for b in ("lora_adamw", "ft_adamw") if b in names), names[0])


def verdicts(out: Path, names: Sequence[str]) -> list[str]:
    """Each side against its own baseline (`BASELINES`), where that baseline was run."""
    lines = []
    for baseline in dict.fromkeys(BASELINES[n] for n in names):
        members = [n for n in names if BASELINES[n] == baseline and n != baseline]
        if baseline in names and members:
            target, results, sides = _tuned.tuned(out, [baseline, *members], baseline)
            lines += verdict(target, results, sides)
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=600, help="AdamW pretraining steps (default 600)")
    parser.add_argument("--steps", type=int, default=150, help="fine-tuning steps of every fit (default 150)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds at each side's best lr (default 3)")
    parser.add_argument("--multipliers", default="0.25,0.5,1,2", help="the lr sweep around each side's lr")
    parser.add_argument("--sides", type=parse_sides, default=list(SIDES),
                        help=f"the sides to run, separated by commas (default: all of {','.join(SIDES)})")
    parser.add_argument("--val-batches", type=int, default=10, help="validation batches (default 10)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per fit (default: torch's)")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/finetune.md and RESULTS.md")
    parser.add_argument("--out", default=None, metavar="DIR", help="where the runs go (default: a lightning_logs dir)")
    args = parser.parse_args(argv)
    names: list[str] = args.sides
    out = Path(args.out or "lightning_logs/finetune").resolve()
    load_before = os.getloadavg()
    started = time.perf_counter()

    print(f"finetune: pretraining {args.pretrain_steps} steps with AdamW (output in {out}/pretrain.out)", flush=True)
    checkpoint, pretrain_command = pretrain(out, args.pretrain_steps, args.threads)
    pretrain_s = time.perf_counter() - started
    before = {"pretraining corpus": validation_loss(checkpoint, None, args.val_batches),
              "fine-tuning corpus": validation_loss(checkpoint, finetune_corpus(), args.val_batches)}
    print(f"  pretrained in {pretrain_s / 60:.1f} min; val loss before fine-tuning: "
          + ", ".join(f"{k} {v:.4f}" for k, v in before.items()), flush=True)

    # The AdamW-only sides first: a split LoRA side's AdamW half runs at lora_adamw's tuned lr.
    adamw_only = [n for n in names if n in ("lora_adamw", "ft_adamw")]
    compare_commands = fit_sides(adamw_only, out, checkpoint, args, LORA_ADAMW_LR)
    lora_adamw_lr = LORA_ADAMW_LR
    if "lora_adamw" in names:
        (lora_adamw,) = _tuned.read_sides(out / "compare", ["lora_adamw"])
        lora_adamw_lr = lora_adamw.best
    compare_commands += fit_sides([n for n in names if n not in adamw_only], out, checkpoint, args, lora_adamw_lr)
    baseline = table_baseline(names)
    compare_commands.append(_tuned.compare([], out / "compare", [
        "--from-logs", *(str(out / "compare" / "lightning_logs" / n) for n in names), "--baseline", baseline],
        args.threads))
    target, results, sides = _tuned.tuned(out / "compare", names, baseline)
    elapsed = time.perf_counter() - started

    split = [n for n in names if n in SPLIT]
    body = [
        f"Machine: {_common.machine(args.threads)} a fit; load average {' '.join(f'{x:.2f}' for x in load_before)} "
        f"before; {datetime.date.today()}. The whole run took {elapsed / 60:.1f} min (pretraining "
        f"{pretrain_s / 60:.1f} min).",
        "",
        f"Pretrained: the shipped byte-level GPT (4 layers, width 128), AdamW at lr {ADAMW_LR:g} for "
        f"{args.pretrain_steps} steps on the standard library's Python sources. Fine-tuned: {args.steps} steps on "
        "the English of Python's documentation (`pydoc_data/topics.py`, not in the pretraining corpus), each side's "
        f"lr swept x{{{args.multipliers}}} around its config's at seed 0 (a best lr at an end of the grid followed by "
        f"up to {_tuned.EXTEND} more past it, x2 or x1/2), then seeds 0–{args.seeds - 1} at its best. "
        f"Full fine-tuning: AdamW keeps the embeddings, norms and head at lr {ADAMW_LR:g} on the Muon sides. "
        f"LoRA: `lightning_muon.examples.lora.MuonLoraGPT`, rank {LORA['lora_rank']}, alpha {LORA['lora_alpha']}, "
        "on every block matrix (qkv, proj, fc), the pretrained weights frozen"
        + (f"; the split sides' AdamW half at lora_adamw's tuned lr {lora_adamw_lr:g}" if split else "")
        + ". Muon's Newton-Schulz runs in fp32.",
        "",
        "Val loss of the pretrained model before fine-tuning: "
        + "; ".join(f"{k} {v:.4f}" for k, v in before.items()) + ".",
        "",
        *[f"- {name}: {SIDES[name]}" for name in names],
        "",
        "### lr sweep (seed 0)",
        "",
        sweep_table(sides),
        "",
        *[f"- {note}." for note in edge_notes(sides)],
        "",
        f"![validation loss by step, by train time, and the lr sweeps]({'finetune' if args.write else 'compare'}"
        "/comparison.png)",
        "",
        f"### Each side at its best lr, against the tuned {baseline}",
        "",
        seeds_table(target, results),
        "",
        *(verdicts(out / "compare", names) or verdict(target, results, sides)),
        "",
        "The compare report and plot are `comparison.md` and `.png` in `--out`'s `compare/` (with `--write`: "
        "`results/finetune/`, the configs in `results/finetune/configs/`). Produced by:",
        "",
        "```bash",
        shlex.join(["python", "benchmarks/finetune.py", *(sys.argv[1:] if argv is None else argv)]),
        f"# pretraining: {shlex.join(pretrain_command)}",
        *(f"# fine-tuning: {shlex.join(command)}" for command in compare_commands),
        "```",
    ]
    report = "\n".join(["# Fine-tuning an AdamW-pretrained model: AdamW against Muon, full and LoRA, each tuned", "",
                        *body])
    print(report, flush=True)
    (out / "finetune.md").write_text(report + "\n")
    if args.write:
        keep = _report.RESULTS / "finetune"
        keep.mkdir(parents=True, exist_ok=True)
        for file in ("comparison.md", "comparison.png"):
            shutil.copy(out / "compare" / file, keep / file)
        shutil.copytree(out / "configs", keep / "configs", dirs_exist_ok=True)
        _report.write_markdown("finetune", report + "\n")
        print(f"Wrote {_report.RESULTS / 'finetune.md'} and its section of {_report.RESULTS_MD}")


if __name__ == "__main__":
    main()
