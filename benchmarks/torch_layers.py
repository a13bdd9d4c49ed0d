"""The routing's choices for torch's own layers, each side tuned, through ``lightning-muon compare``: depthwise
kernels of a depthwise-separable CNN orthogonalised per group (each channel's ``1 x k*k`` filter alone), flattened
across the channels as one ``C x k*k`` matrix (the routing before per-group kernels), or on AdamW; and an LSTM's
four gates orthogonalised per gate (``split_fused: true``) or fused (one ``4h x in`` matrix).

The models are `lightning_muon.examples.torch_layers`' (`SeparableCNN` on scikit-learn's digits, `CharLSTM` on the
standard library's bytes); each study is one run of the real command::

    lightning-muon compare STUDY_SIDE1.yaml STUDY_SIDE2.yaml ... --multipliers 0.5,1,2 --seeds 2 --baseline ...

and a best lr at an end of its grid is followed past it (`_tuned.extend_edges`), the report then written again
from all the runs (``compare --from-logs``).

    python benchmarks/torch_layers.py --write     # ~25 min on 2 cores (two studies at a time, one thread a fit)
    python benchmarks/torch_layers.py --studies lstm --steps 20 --seeds 1 --multipliers 1 --out /tmp/tl  # a trial
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _tuned
from third_party import IMAGES, TEXT, TRAINER

from lightning_muon.commands.compare.aggregate import edge_notes, spread

EX = "lightning_muon.examples.torch_layers"
#: The depthwise kernels of `SeparableCNN` (the first conv of each block).
DEPTHWISE = "blocks.*.0.weight"
#: Each study: its model, data and lrs, how many steps, and its sides (the first is the baseline), each with what it
#: is and what it sets on the model.
STUDIES: dict[str, dict[str, Any]] = {
    "depthwise": dict(
        what="`SeparableCNN` (MobileNet-style: a 3x3 stem, 4 depthwise-separable blocks of 32 then 64 channels, "
             "each a depthwise 3x3 conv and a pointwise 1x1 conv with BatchNorm) on scikit-learn's 8x8 digits, "
             "batch 64",
        model=f"{EX}.MuonSeparableCNN", args={"channels": 32, "blocks_per_stage": 2}, data=IMAGES, steps=150,
        muon_lr=0.02, rest_lr=0.003,
        sides={
            "flatten": ("depthwise kernels flattened across the channels (`matrix_blocks: {'blocks.*.0.weight': "
                        "null}`, the routing before per-group kernels)", {"matrix_blocks": {DEPTHWISE: None}}),
            "groups": ("depthwise kernels per group: each channel's 1x9 filter orthogonalised alone", {}),
            "adamw": ("depthwise kernels on AdamW (`adamw_params: ['blocks.*.0.weight']`)",
                      {"adamw_params": [DEPTHWISE]}),
        }),
    "lstm": dict(
        what="`CharLSTM` (byte embedding 64, a 2-layer `nn.LSTM` of hidden size 128, a Linear head) on the standard "
             "library's bytes, batch 32 x 64 bytes",
        model=f"{EX}.MuonCharLSTM", args={"n_embd": 64, "hidden_size": 128, "n_layer": 2},
        data={**TEXT, "init_args": {**TEXT["init_args"], "block_size": 64}}, steps=300,
        muon_lr=0.02, rest_lr=0.003,
        sides={
            "fused": ("the gates fused: each `weight_ih_l*` / `weight_hh_l*` one 512-row matrix (`matrix_blocks: "
                      "{'lstm.weight_*': null}`, the routing before gates were split)",
                      {"matrix_blocks": {"lstm.weight_*": None}}),
            "split": ("the gates split: i, f, g, o each orthogonalised alone (the routing's default)", {}),
        }),
}


def config(study: dict[str, Any], side: str, steps: int | None) -> dict[str, Any]:
    """One side's config: the study's model with Muon + AdamW and the side's settings."""
    opt = _tuned.optimizers(study["muon_lr"], study["rest_lr"], ns_dtype=None)
    return {"seed_everything": 0, "trainer": {**TRAINER, "max_steps": steps or study["steps"]}, "data": study["data"],
            "model": {"class_path": study["model"], "init_args": {**study["args"], **opt, **study["sides"][side][1]}}}


def run_study(name: str, out: Path, steps: int | None, seeds: int, multipliers: str, val_batches: int,
              threads: int | None, reuse: bool = False) -> list[str]:
    """Write the study's configs and run ``compare`` on them (then `_tuned.extend_edges`); returns the command
    line, as one run of it would be typed. With ``reuse``, a study whose every side is fitted in ``out`` already
    is only read back."""
    study = STUDIES[name]
    configs = [_tuned.write_config(out / "configs" / f"{name}_{side}.yaml", config(study, side, steps),
                                   f"{study['what']}; {what}; written by benchmarks/torch_layers.py")
               for side, (what, _) in study["sides"].items()]
    common = ["--val_points", "6", "--trainer.limit_val_batches", str(val_batches)]
    sweep = ["--multipliers", multipliers, "--seeds", str(seeds)]
    baseline = ["--baseline", configs[0].stem]
    line = ["lightning-muon", "compare", *map(_tuned.relative, configs), *sweep, *baseline, *common, "--out",
            _tuned.relative(out / name)]
    if reuse and all((out / name / "lightning_logs" / c.stem).is_dir() for c in configs):
        return line
    _tuned.compare(configs, out / name, [*sweep, *baseline, *common], threads)
    if _tuned.extend_edges(configs, out / name, seeds, common, threads, label=name):
        logs = out / name / "lightning_logs"
        _tuned.compare([], out / name, [*baseline, "--from-logs", *(str(logs / c.stem) for c in configs)], threads)
    return line


def study_rows(name: str, out: Path) -> tuple[list[list[str]], list[str]]:
    """One row per side of a study (the baseline first), and its edge notes; per-seed differences pair each seed
    with the baseline's same seed (the same initialisation and batches, each side at its own best lr)."""
    sides = STUDIES[name]["sides"]
    names = [f"{name}_{side}" for side in sides]
    _, results, runs = _tuned.tuned(out / name, names, names[0])
    base = results[0]
    rows = []
    for (what, _), result, side in zip(sides.values(), results, runs, strict=True):
        paired = result.curve.final - base.curve.final
        delta = "–" if result is base else f"{paired.mean():+.4f} ({', '.join(f'{d:+.4f}' for d in paired)})"
        lrs = ", ".join(f"{lr:g}" for lr in side.grid)
        rows.append([name, what, f"{result.lr:g} (of {lrs})", str(len(side.seeds)), spread(result.curve.final),
                     delta, f"{result.last_time:.0f} s" if result.last_time else "–"])
    return rows, [f"{name}: {note}" for note in edge_notes(runs)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--studies", nargs="+", choices=list(STUDIES), default=list(STUDIES))
    _tuned.add_study_options(parser, steps=None, multipliers_help="the lr sweep around Muon lr 0.02 (default 0.5,1,2)")
    parser.add_argument("--reuse", action="store_true",
                        help="read back the studies whose every side is fitted in --out already (fit the others)")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/torch_layers.md and its RESULTS.md section")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where the runs go (default: lightning_logs/torch_layers)")
    args = parser.parse_args(argv)
    out = Path(args.out or "lightning_logs/torch_layers").resolve()
    load_before = os.getloadavg()
    started = time.perf_counter()
    print(f"torch_layers: {len(args.studies)} studies, {args.jobs} at a time; output in {out}/<study>/", flush=True)

    def one(name: str) -> list[str]:
        line = run_study(name, out, args.steps or None, args.seeds, args.multipliers, args.val_batches, args.threads,
                         args.reuse)
        print(f"  {name}: done in {_tuned.seconds(out / name) / 60:.1f} min", flush=True)
        return line

    with ThreadPoolExecutor(args.jobs) as pool:
        commands = dict(zip(args.studies, pool.map(one, args.studies), strict=True))
    rows, notes = zip(*(study_rows(name, out) for name in args.studies), strict=True)
    header = ["study", "side", "best Muon lr (swept)", "seeds", "final val loss", "minus the first side's (per seed)",
              "train time"]
    table = _tuned.markdown_table(header, rows)
    elapsed = time.perf_counter() - started
    steps = {name: args.steps or STUDIES[name]["steps"] for name in args.studies}
    report = "\n".join([
        "# torch's layers: depthwise kernels per group, an LSTM's gates split, each side tuned", "",
        _tuned.run_line(args.threads, args.jobs, load_before, elapsed,
                        shared=" (other work shared the machine: train times are noisy)"), "",
        "Each model trained from scratch, "
        + ", ".join(f"{name} {count} steps a fit" for name, count in steps.items())
        + f"; each side's Muon lr swept x{{{args.multipliers}}} around 0.02 at seed 0 (a best lr at an end of the "
        f"grid followed by up to {_tuned.EXTEND} more past it), then seeds 0–{args.seeds - 1} at its best; AdamW "
        "(lr 0.003, betas 0.9, 0.95) on the stem, embeddings, norms, biases and heads (and, on the `adamw` side, the "
        "depthwise kernels). Final val loss is the last validation "
        f"({args.val_batches} batches at most), mean ± std (min–max) over the seeds; the differences pair each seed "
        "with the first side's same seed (the digits' seed also draws their validation split). Newton-Schulz in the "
        "library's default dtype.", "",
        *[f"- {name}: {STUDIES[name]['what']}" for name in args.studies], "",
        table, "",
        *[f"- {n}." for group in notes for n in group], "",
        "What the routing does with it (`docs/guides/routing.md`, torch's layers): depthwise kernels per group (the "
        "grouped convolutions' rule, no special case: no side was better beyond the seeds' spread), an LSTM's and a "
        "GRU's gates split by default.", "",
        "Each study's full report (sweep and seeds tables, verdicts, plot) is `comparison.md` in its directory, "
        "copied with its plot to `results/torch_layers/<study>/`, the configs to `results/torch_layers/configs/`. "
        "Produced by:", "", *_tuned.produced_by("torch_layers", argv, commands),
    ])
    _tuned.publish(out, "torch_layers", args.studies, report, args.write)


if __name__ == "__main__":
    main()
