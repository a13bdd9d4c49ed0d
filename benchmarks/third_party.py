"""Quality on models nobody here wrote: Muon + AdamW against AdamW alone, each tuned, through ``lightning-muon
compare --sweep --seeds``; then Gram Newton-Schulz on/off and Polar Express against the default coefficients.

The models are other libraries' (`lightning_muon.examples.third_party`), built from small configs with random
init and trained from scratch: transformers' Llama and GPT-2 and litgpt's GPT on the standard library's bytes,
transformers' ResNet on scikit-learn's 8x8 digits. For each, this writes two configs (Muon + AdamW, and AdamW
alone) and runs the real command on them::

    lightning-muon compare MODEL_muon.yaml MODEL_adamw.yaml --multipliers 0.5,1,2 --seeds 2 --val_points 6 ...

A side whose best lr is at an end of its grid gets up to ``_tuned.EXTEND`` more lrs past it (``compare --lrs SIDE=LR``
into the same logs), and the model's report is written again from all its runs (``compare --from-logs``).

Then, at the GPT-2 Muon side's best lr and the same seeds, three bf16 Newton-Schulz variants (the table's runs use
fp32 Newton-Schulz, see ``_tuned.MUON_ARGS``): the library's default (Gram Newton-Schulz for matrices at least
3:1, here ``c_attn`` 128x384 and the MLP's 128x512 / 512x128), Gram off (``ns_gram_aspect: null``), and Polar
Express coefficients (``ns_coefficients: polar_express``).

    python benchmarks/third_party.py --write            # ~40 min on 2 cores (two fits at a time, one thread each)
    python benchmarks/third_party.py --models llama --steps 20 --out /tmp/tp   # a small trial
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _tuned
import numpy as np

from lightning_muon.commands.compare.aggregate import edge_notes, spread

import _common

RESULTS = _common.ROOT / "benchmarks" / "results"
LM = "lightning_muon.examples.third_party.MuonThirdPartyLM"
DIGITS = "lightning_muon.examples.third_party.MuonThirdPartyDigits"
TEXT = {"class_path": "lightning_muon.examples.char_gpt.StdlibTextDataModule",
        "init_args": {"block_size": 128, "batch_size": 32, "seed": 0}}
IMAGES = {"class_path": "lightning_muon.examples.digits_cnn.DigitsDataModule",
          "init_args": {"batch_size": 64, "seed": 0}}

#: Each model: what it is, its model class and arguments, its data, the lrs the configs hold (the sweep's
#: centres): Muon's (with AdamW's on the rest), and the AdamW-only side's; and its seeds, where not ``--seeds``.
MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(what="transformers `LlamaForCausalLM` (GQA, SwiGLU, RoPE), 2 layers, width 128",
                  model=LM, args={"family": "llama", "n_layer": 2, "n_embd": 128}, data=TEXT,
                  muon_lr=0.02, rest_lr=0.003, adamw_lr=0.0015),
    "gpt2": dict(what="transformers `GPT2LMHeadModel` (Conv1D weights in x out, tied head), 2 layers, width 128",
                 model=LM, args={"family": "gpt2", "n_layer": 2, "n_embd": 128}, data=TEXT,
                 muon_lr=0.02, rest_lr=0.003, adamw_lr=0.0015),
    "litgpt": dict(what="litgpt `GPT` (Llama-style: RMSNorm, SwiGLU, RoPE, GQA), 2 layers, width 128",
                   model=LM, args={"family": "litgpt", "n_layer": 2, "n_embd": 128}, data=TEXT,
                   muon_lr=0.02, rest_lr=0.003, adamw_lr=0.0015),
    "resnet": dict(what="transformers `ResNetForImageClassification` (basic blocks, 32/64 channels) on 8x8 digits "
                        "(each seed also draws the 20% validation split)",
                   model=DIGITS, args={}, data=IMAGES, muon_lr=0.02, rest_lr=0.003, adamw_lr=0.003,
                   seeds=5),  # seconds a fit, and the data seed also draws the validation split: more seeds
}
#: The bf16 Newton-Schulz variants run on GPT-2 at its Muon side's best lr.
VARIANTS = {
    "bf16_gram": ("bf16, Gram NS for 3:1 and longer (the library's default)", {"ns_dtype": "bfloat16"}),
    "bf16_standard": ("bf16, Gram NS off", {"ns_dtype": "bfloat16", "ns_gram_aspect": None}),
    "bf16_polar": ("bf16, Gram NS, Polar Express coefficients",
                   {"ns_dtype": "bfloat16", "ns_coefficients": "polar_express"}),
}
TRAINER = {"accelerator": "cpu", "devices": 1, "log_every_n_steps": 10, "enable_model_summary": False,
           "enable_progress_bar": False}


def config(spec: dict[str, Any], muon: bool, steps: int, **muon_args: Any) -> dict[str, Any]:
    """One side's config: ``spec``'s model with Muon + AdamW (or AdamW alone), data and trainer."""
    opt = _tuned.optimizers(spec["muon_lr"], spec["rest_lr"], **muon_args) if muon else \
        _tuned.optimizers(None, spec["adamw_lr"])
    return {"seed_everything": 0, "trainer": {**TRAINER, "max_steps": steps},
            "data": spec["data"], "model": {"class_path": spec["model"], "init_args": {**spec["args"], **opt}}}


def run_model(name: str, out: Path, steps: int, seeds: int, multipliers: str, val_batches: int,
              threads: int | None, extend: bool = True, reuse: bool = False) -> list[str]:
    """Write the model's two configs and run ``compare`` on them (then `_tuned.extend_edges`); returns the first
    command line. ``reuse``: a model whose compare finished in ``out`` before is not fitted again."""
    spec = MODELS[name]
    seeds = spec.get("seeds", seeds)
    configs = [
        _tuned.write_config(out / "configs" / f"{name}_{side}.yaml", config(spec, side == "muon", steps),
                            f"{spec['what']}; written by benchmarks/third_party.py")
        for side in ("muon", "adamw")
    ]
    common = ["--val_points", "6", "--trainer.limit_val_batches", str(val_batches)]
    options = ["--multipliers", multipliers, "--seeds", str(seeds), *common]
    if reuse and (out / name / "seconds").is_file():  # a finished compare of an earlier run of this script
        command = ["lightning-muon", "compare", *map(_tuned.relative, configs), *options, "--out",
                   _tuned.relative(out / name)]
    else:
        command = _tuned.compare(configs, out / name, options, threads)
    if extend and _tuned.extend_edges(configs, out / name, seeds, common, threads, label=name):
        # the model's comparison.md and .png again, from all its runs (the extensions' compare wrote over them)
        _tuned.compare([], out / name, ["--from-logs", *(str(out / name / "lightning_logs" / c.stem)
                                                          for c in configs)], threads)
    return command


def run_variants(out: Path, steps: int, seeds: int, val_batches: int, threads: int | None,
                 best_lr: float) -> list[str]:
    """The bf16 Newton-Schulz variants of GPT-2's Muon config, each at ``best_lr`` over ``seeds`` seeds."""
    spec = dict(MODELS["gpt2"], muon_lr=best_lr)
    configs = [_tuned.write_config(out / "configs" / f"gpt2_{key}.yaml", config(spec, True, steps, **args),
                                   f"GPT-2, {what}; written by benchmarks/third_party.py")
               for key, (what, args) in VARIANTS.items()]
    options = ["--seeds", str(seeds), "--val_points", "6", "--trainer.limit_val_batches", str(val_batches),
               *[a for key in VARIANTS for a in ("--lrs", f"gpt2_{key}={best_lr:g}")]]
    return _tuned.compare(configs, out / "gpt2_variants", options, threads)


def model_row(name: str, out: Path) -> tuple[list[str], list[str]]:
    """The summary row of one model, and its edge notes."""
    _, (muon, adamw), sides = _tuned.tuned(out / name, [f"{name}_muon", f"{name}_adamw"], f"{name}_adamw")
    paired = muon.curve.final <= adamw.curve.final
    steps = "not reached" if muon.steps_to is None else f"{muon.steps_to} of {adamw.last_step} " \
        f"({muon.steps_to / adamw.last_step:.2f}x)"
    time_to = "–" if muon.time_to is None or adamw.last_time is None else \
        f"{muon.time_to:.0f} of {adamw.last_time:.0f} s ({muon.time_to / adamw.last_time:.2f}x)"
    row = [name, f"{muon.lr:g}", f"{adamw.lr:g}", spread(muon.curve.final), spread(adamw.curve.final), steps,
           time_to, f"{int(paired.sum())} of {len(paired)}"]
    return row, [f"{name}: {note}" for note in edge_notes(sides)]


def variants_table(out: Path, reference: Path) -> tuple[str, float]:
    """Final val loss per seed of each bf16 variant, with GPT-2's fp32 Muon runs (the table's) beside them; and
    the Muon lr the variants ran at."""
    names = [f"gpt2_{key}" for key in VARIANTS]
    sides = _tuned.read_sides(out / "gpt2_variants", names)
    fp32 = _tuned.read_sides(reference, ["gpt2_muon"])[0]
    finals = {"fp32 (the table's runs)": np.array([r.val_loss[-1] for r in fp32.seeds])}
    finals |= {VARIANTS[n.removeprefix("gpt2_")][0]: np.array([r.val_loss[-1] for r in s.seeds])
               for n, s in zip(names, sides, strict=True)}
    standard = finals[VARIANTS["bf16_standard"][0]]
    lines = ["| Newton-Schulz | final val loss per seed | mean ± std | mean minus Gram-off's |", "|---|---|---:|---:|"]
    for label, values in finals.items():
        delta = "–" if values is standard else f"{values.mean() - standard.mean():+.4f}"
        lines.append(f"| {label} | {', '.join(f'{v:.4f}' for v in values)} | {spread(values)} | {delta} |")
    return "\n".join(lines), sides[0].best


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    _tuned.add_study_options(parser, steps=150, multipliers_help="the lr sweep around each config's lr")
    parser.add_argument("--no-extend", action="store_true",
                        help=f"leave a best lr at the end of its grid (default: up to {_tuned.EXTEND} lrs past it)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the models whose compare finished in --out before (and the variants')")
    parser.add_argument("--no-variants", action="store_true", help="skip GPT-2's bf16 Newton-Schulz variants")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/third_party.md and its RESULTS.md section")
    parser.add_argument("--out", default=None, metavar="DIR", help="where the runs go (default: a lightning_logs dir)")
    args = parser.parse_args(argv)
    out = Path(args.out or "lightning_logs/third_party").resolve()
    load_before = os.getloadavg()
    started = time.perf_counter()
    print(f"third_party: {len(args.models)} models, {args.jobs} compare commands at a time; output in {out}/<model>/",
          flush=True)

    def one(name: str) -> list[str]:
        line = run_model(name, out, args.steps, args.seeds, args.multipliers, args.val_batches, args.threads,
                         extend=not args.no_extend, reuse=args.reuse)
        print(f"  {name}: done in {_tuned.seconds(out / name) / 60:.1f} min", flush=True)
        return line

    with ThreadPoolExecutor(args.jobs) as pool:
        commands = dict(zip(args.models, pool.map(one, args.models), strict=True))

    rows, notes = zip(*(model_row(name, out) for name in args.models), strict=True)
    header = ["model", "Muon lr", "AdamW lr", "final val loss, Muon + AdamW", "final val loss, AdamW",
              "Muon's steps to AdamW's final", "its train time to it", "seeds Muon ≤ AdamW"]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(r) + " |" for r in rows])
    variants, variants_lr = "", 0.0
    if not args.no_variants and "gpt2" in args.models:
        _, (muon, _), _ = _tuned.tuned(out / "gpt2", ["gpt2_muon", "gpt2_adamw"], "gpt2_adamw")
        if not (args.reuse and (out / "gpt2_variants" / "seconds").is_file()):
            commands["gpt2 Newton-Schulz variants"] = run_variants(out, args.steps, args.seeds, args.val_batches,
                                                                   args.threads, muon.lr)
        variants, variants_lr = variants_table(out, out / "gpt2")
    elapsed = time.perf_counter() - started
    body = [
        f"Machine: {_common.machine(args.threads)} a fit, {args.jobs} compare commands at a time; load average "
        f"{' '.join(f'{x:.2f}' for x in load_before)} before; {datetime.date.today()}. The whole run took "
        f"{elapsed / 60:.1f} min; each model's compare commands took "
        + ", ".join(f"{n} {_tuned.seconds(out / n) / 60:.1f} min" for n in args.models) + ".",
        "",
        f"Each model trained from scratch, {args.steps} steps a fit; each side's lr swept x{{{args.multipliers}}} "
        f"around its config's at seed 0, then seeds 0–{args.seeds - 1} at its best ("
        + "".join(f"{n}: {MODELS[n]['seeds']} seeds; " for n in args.models if "seeds" in MODELS[n])
        + f"a best lr at an end of the grid is "
        f"followed by up to {_tuned.EXTEND} more past it, x2 or x1/2, through `compare --lrs SIDE=LR`, before the "
        "seeds); Muon + AdamW sweeps the Muon "
        "lr (AdamW on the embeddings, norms and heads at the config's). Final val loss is the last validation "
        f"({args.val_batches} fixed batches), mean ± std over the seeds; \"steps to\" is the first validation of the "
        "Muon side's mean curve at or below AdamW's mean final val loss (validations every 1/6 of the run). "
        "Muon's Newton-Schulz runs in fp32 (bf16 is emulated on this CPU).",
        "",
        *[f"- {name}: {MODELS[name]['what']}" for name in args.models],
        "",
        table,
        "",
        *[f"- {n}." for group in notes for n in group],
        "",
    ]
    if variants:
        body += [f"### GPT-2: bf16 Newton-Schulz variants at Muon lr {variants_lr:g} (the Muon side's best), the "
                 "same seeds", "", variants, ""]
    body += ["Each model's full report (sweep and seeds tables, verdict, plot) is `comparison.md` in its output "
             "directory, copied with its plot to `results/third_party/<model>/`, and the configs to "
             "`results/third_party/configs/`. Produced by:", "", *_tuned.produced_by("third_party", argv, commands)]
    report = "\n".join(["# Quality on third-party models: Muon + AdamW against AdamW alone, each tuned", "", *body])
    _tuned.publish(out, "third_party", [*args.models, *(["gpt2_variants"] if variants else [])], report, args.write)


if __name__ == "__main__":
    main()
