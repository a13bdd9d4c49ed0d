"""Recipes beyond one lr: each part of a training recipe added to Muon's defaults, measured as steps to tuned
AdamW's final val loss (and final val loss), on the shipped GPT (``configs/gpt_muon.yaml``) and a transformers
Llama from scratch (the one ``muon_variants.py`` trains).

Each side is one config this writes: AdamW alone (the reference, its lr swept), Muon's defaults, and the defaults
plus one part: the momentum schedule (`MomentumSchedule`: 0.85 to 0.95 over the first 10% of the updates, back to
0.85 over the last 10%, as the modded-nanogpt speedrun does), weight decay following the lr (`WeightDecaySchedule`
under a `WarmupCosine` lr schedule), an EMA of the weights (Lightning's `EMAWeightAveraging`; validation runs on
the averaged weights), per-role AdamW lrs (`group_settings`), NorMuon; and the recipe, the momentum schedule and the
EMA together (`configs/gpt_muon_recipe.yaml`). The shipped GPT's fused ``qkv`` is orthogonalised whole in every side
(``split_fused: false``, 0.1's routing, which the study was measured with). Every side runs through the real command:
first the reference::

    lightning-muon compare MODEL_adamw.yaml --multipliers 0.5,1,2 --seeds 2

(its best lr followed past an end of its grid, `_tuned.extend_edges`), whose mean final val loss at its best lr is
the target; then each other side, its Muon lr swept the same way::

    lightning-muon compare MODEL_SIDE.yaml --multipliers 0.5,1,2 --seeds 2 --target LOSS

(``--target``: its fits validate densely near the target, resolving the steps to within 2%), and last one report
of all the sides from their logs (``compare --from-logs ... --baseline MODEL_defaults --target LOSS``).

    python benchmarks/recipes.py --write     # ~3 h of fits on 2 cores (two compare commands at a time)
    python benchmarks/recipes.py --models llama --sides adamw defaults --steps 20 --seeds 1 --multipliers 1 \
        --out /tmp/rc  # a trial
    python benchmarks/recipes.py --no-fit --write  # tabulate each model's sides fitted so far, fitting nothing
"""

from __future__ import annotations

import argparse
import copy
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _tuned
import numpy as np
import yaml
from third_party import MODELS, TRAINER

from lightning_muon.commands.compare.aggregate import edge_notes, mean_final, outcomes, spread

import _common

SCHEDULES = "lightning_muon.callbacks.schedules"
#: The per-role side's AdamW lrs over the factory's (embeddings up, the head down, as the speedrun's labels do).
ROLE_LRS = {"embeddings": 10 / 3, "head": 2 / 3}
#: The EMA side's decay (an average over about the last 1 / (1 - decay) updates).
EMA_DECAY = 0.95


def parts(steps: int, adamw_lr: float) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each side but the reference: what it is, and what it adds to the defaults' config (``callbacks``: appended
    to the trainer's; ``model``: the model's init args; ``muon``: the Muon factory's)."""
    tenth = max(1, steps // 10)
    roles = {role: {"lr": float(f"{adamw_lr * factor:.3g}")} for role, factor in ROLE_LRS.items()}
    sides: dict[str, tuple[str, dict[str, Any]]] = {
        "defaults": ("Muon's defaults (the shipped config)", {}),
        "momentum": (f"+ momentum schedule (0.85 to 0.95 over {tenth} updates, back to 0.85 over the last {tenth})",
                     {"callbacks": [{"class_path": f"{SCHEDULES}.MomentumSchedule", "init_args": {
                         "start": 0.85, "warmup_steps": tenth, "end": 0.85, "cooldown_steps": tenth}}]}),
        "wd_lr": (f"+ lr schedule (WarmupCosine, {tenth} warmup updates) with weight decay following it",
                  {"model": {"lr_scheduler": {"class_path": "lightning_muon.WarmupCosine",
                                              "init_args": {"warmup_steps": tenth}}},
                   "callbacks": [{"class_path": f"{SCHEDULES}.WeightDecaySchedule"}]}),
        "ema": (f"+ EMA of the weights (EMAWeightAveraging, decay {EMA_DECAY}; validated on the average)",
                {"callbacks": [{"class_path": "lightning.pytorch.callbacks.EMAWeightAveraging",
                                "init_args": {"decay": EMA_DECAY}}]}),
        "roles": ("+ per-role AdamW lrs (" + ", ".join(f"{r} {s['lr']:g}" for r, s in roles.items()) + ")",
                  {"model": {"group_settings": roles}}),
        "normuon": ("+ NorMuon (`normuon_beta2: 0.95`)", {"muon": {"normuon_beta2": 0.95}}),
    }
    # the recipe: the parts that helped beyond the seeds' spread on both models, together
    sides["recipe"] = ("+ momentum schedule and EMA together (the recipe, `configs/gpt_muon_recipe.yaml`)",
                       {"callbacks": sides["momentum"][1]["callbacks"] + sides["ema"][1]["callbacks"]})
    return sides


def shipped_gpt(steps: int, muon: bool) -> dict[str, Any]:
    """``configs/gpt_muon.yaml`` (or, AdamW alone, with ``gpt_adamw.yaml``'s lr), ``steps`` updates a fit, its fused
    ``qkv`` orthogonalised whole (``split_fused: false``) as 0.1's default did, which the study measured."""
    config = yaml.safe_load((_common.ROOT / "configs" / "gpt_muon.yaml").read_text())
    config["trainer"].update(max_steps=steps, enable_progress_bar=False)
    config["model"]["init_args"]["split_fused"] = False
    if not muon:
        adamw = yaml.safe_load((_common.ROOT / "configs" / "gpt_adamw.yaml").read_text())["model"]["init_args"]
        config["model"]["init_args"]["muon"] = None
        config["model"]["init_args"]["adamw"]["init_args"].update(adamw["adamw"]["init_args"])
    return config


def llama(steps: int, muon: bool) -> dict[str, Any]:
    """``muon_variants.py``'s Llama (2 layers, width 128; AdamW alone at its config's lr 0.0015)."""
    spec = MODELS["llama"]
    opt = _tuned.optimizers(spec["muon_lr"], spec["rest_lr"], ns_dtype=None) if muon else \
        _tuned.optimizers(None, spec["adamw_lr"])
    return {"seed_everything": 0, "trainer": {**TRAINER, "max_steps": steps, "callbacks": []}, "data": spec["data"],
            "model": {"class_path": spec["model"], "init_args": {**spec["args"], **opt}}}


#: Each model: what it is, and its config (Muon's defaults, or AdamW alone) for a number of steps.
MODELS_HERE = {
    "gpt": ("the shipped GPT (`configs/gpt_muon.yaml`: `CharGPT`, 4 layers, width 128)", shipped_gpt),
    "llama": (f"{MODELS['llama']['what']} (`muon_variants.py`'s)", llama),
}
SIDES = ["adamw", "defaults", "momentum", "wd_lr", "roles", "normuon", "ema", "recipe"]


def config(model: str, side: str, steps: int) -> tuple[dict[str, Any], str]:
    """One side's config, and what the side is."""
    base = MODELS_HERE[model][1](steps, muon=side != "adamw")
    if side == "adamw":
        return base, "AdamW alone (the reference: its final val loss is the target)"
    init = base["model"]["init_args"]
    what, sets = parts(steps, init["adamw"]["init_args"]["lr"])[side]
    config = copy.deepcopy(base)
    config["trainer"]["callbacks"] = [*config["trainer"].get("callbacks", []), *sets.get("callbacks", [])]
    config["model"]["init_args"].update(sets.get("model", {}))
    config["model"]["init_args"]["muon"]["init_args"].update(sets.get("muon", {}))
    return config, what


class Plan:
    """The sides to fit, in order, each waiting for its model's target (the reference's mean final val loss at
    its best lr, known once the reference is fitted)."""

    def __init__(self, tasks: Sequence[tuple[str, str]]) -> None:
        self.tasks = list(tasks)
        self.targets: dict[str, float] = {}
        self.ready = threading.Condition()

    def next(self) -> tuple[str, str] | None:
        """The first side whose target is known (or a reference), waiting while none is; ``None``: done."""
        with self.ready:
            while self.tasks:
                for task in self.tasks:
                    if task[1] == "adamw" or task[0] in self.targets:
                        self.tasks.remove(task)
                        return task
                self.ready.wait(30)
            return None

    def set_target(self, model: str, target: float) -> None:
        with self.ready:
            self.targets[model] = target
            self.ready.notify_all()


def fit_side(model: str, side: str, out: Path, args: argparse.Namespace, target: float | None) -> list[str]:
    """Write one side's config and fit it through ``compare`` (swept, then its seeds; its best lr followed past
    an end of the grid); returns the command line."""
    settings, what = config(model, side, args.steps)
    path = _tuned.write_config(out / "configs" / f"{model}_{side}.yaml", settings,
                               f"{MODELS_HERE[model][0]}; {what}; written by benchmarks/recipes.py")
    common = ["--val_points", "6", "--trainer.limit_val_batches", str(args.val_batches),
              *(["--target", f"{target:.6g}"] if target is not None else [])]
    sweep = ["--multipliers", args.multipliers, "--seeds", str(args.seeds)]
    into = out / model
    if not args.no_fit and not (args.reuse and (into / "lightning_logs" / path.stem).is_dir()):
        _tuned.compare([path], into, [*sweep, *common], args.threads)
        _tuned.extend_edges([path], into, args.seeds, common, args.threads, label=model)
    return ["lightning-muon", "compare", _tuned.relative(path), *sweep, *common, "--out", _tuned.relative(into)]


def fitted(out: Path, model: str, side: str) -> bool:
    """Whether ``model``'s ``side`` has fits in ``out``."""
    return (out / model / "lightning_logs" / f"{model}_{side}").is_dir()


def run(out: Path, args: argparse.Namespace) -> tuple[dict[str, float], dict[tuple[str, str], list[str]]]:
    """Fit every side (``args.jobs`` compare commands at a time, the references first); returns each model's
    target and each side's command line."""
    plan = Plan([(m, s) for m, s in
                 [(m, s) for s in ("adamw", "defaults", "momentum") if s in args.sides for m in args.models]
                 + [(m, s) for m in args.models[::-1] for s in args.sides if s not in ("adamw", "defaults", "momentum")]
                 if not args.no_fit or fitted(out, m, s)])
    lines: dict[tuple[str, str], list[str]] = {}

    def worker() -> None:
        while (task := plan.next()) is not None:
            model, side = task
            lines[task] = fit_side(model, side, out, args, plan.targets.get(model))
            print(f"  {model}_{side}: done ({_tuned.seconds(out / model) / 60:.1f} min of fits in {model})",
                  flush=True)
            if side == "adamw":
                (reference,) = _tuned.read_sides(out / model, [f"{model}_adamw"])
                plan.set_target(model, mean_final(reference))

    with ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(worker) for _ in range(args.jobs)]:
            future.result()
    return plan.targets, lines


def model_rows(model: str, sides: Sequence[str], out: Path, target: float, updates: int
               ) -> tuple[list[list[str]], list[str]]:
    """One row per side (the reference, the defaults, then the parts), and the edge notes. Each part's effect pairs
    each seed with the defaults' same seed (the same initialisation and batches, each side at its own best lr), over
    the seeds both have."""
    names = [f"{model}_{side}" for side in sides]
    runs = _tuned.read_sides(out / model, names)
    _, results = outcomes(runs, baseline=names.index(f"{model}_defaults"), target=target)
    base = results[names.index(f"{model}_defaults")]
    base_steps = np.array([np.nan if c is None else c.step for c in base.steps.crossings])
    rows = []
    for side, result, run_ in zip(sides, results, runs, strict=True):
        steps = np.array([np.nan if c is None else c.step for c in result.steps.crossings])
        if result is base or side == "adamw":
            effect = "–"
        else:
            both = min(len(steps), len(base_steps))
            loss, paired = (result.curve.final - base.curve.final)[:both], (steps - base_steps)[:both]
            effect = (f"{np.nanmean(paired):+.0f} steps ({', '.join(f'{d:+.0f}' for d in paired)}); "
                      f"{loss.mean():+.4f} ({', '.join(f'{d:+.4f}' for d in loss)})")
        lrs = ", ".join(f"{lr:g}" for lr in run_.grid)
        rows.append([model, config(model, side, updates)[1] if side != "defaults" else "Muon's defaults",
                     f"{result.lr:g} (of {lrs})", str(len(run_.seeds)), result.steps.text(),
                     spread(result.curve.final), effect])
    return rows, [f"{model}: {note}" for note in edge_notes(runs)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS_HERE), default=list(MODELS_HERE))
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=SIDES)
    _tuned.add_study_options(parser, steps=300, multipliers_help="each side's lr sweep (default 0.5,1,2)")
    parser.add_argument("--reuse", action="store_true", help="keep the sides already fitted in --out")
    parser.add_argument("--no-fit", action="store_true",
                        help="fit nothing: tabulate each model's sides already fitted in --out")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/recipes.md and its RESULTS.md section")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where the runs go (default: lightning_logs/recipes)")
    args = parser.parse_args(argv)
    if not {"adamw", "defaults"} <= set(args.sides):
        parser.error("--sides needs adamw (the target) and defaults (what each part is measured against)")
    out = Path(args.out or "lightning_logs/recipes").resolve()
    load_before = os.getloadavg()
    started = time.perf_counter()
    print(f"recipes: {args.models} x {args.sides}, {args.jobs} compare commands at a time; output in {out}/<model>/",
          flush=True)
    targets, lines = run(out, args)
    sides = {m: [s for s in args.sides if (m, s) in lines] for m in args.models}
    for model in args.models:  # one report of all the model's sides
        logs = out / model / "lightning_logs"
        _tuned.compare([], out / model, ["--baseline", f"{model}_defaults", "--target", f"{targets[model]:.6g}",
                                         "--from-logs", *(str(logs / f"{model}_{s}") for s in sides[model])])
    rows, notes = zip(*(model_rows(m, sides[m], out, targets[m], args.steps) for m in args.models), strict=True)
    header = ["model", "side", "best lr (swept)", "seeds", "steps to target", "final val loss",
              "minus the defaults' (per seed): steps; final val loss"]
    table = _tuned.markdown_table(header, rows)
    elapsed = time.perf_counter() - started
    report = "\n".join([
        "# Recipes beyond one lr: steps to tuned AdamW's loss, each part added to Muon's defaults", "",
        _tuned.run_line(args.threads, args.jobs, load_before, elapsed) + " The compare commands into each model's "
        "directory took " + ", ".join(f"{m} {_tuned.seconds(out / m) / 60:.0f} min" for m in args.models)
        + " in all (with `--reuse`, those of the earlier runs too).", "",
        f"Each model trained from scratch on the standard library's bytes, {args.steps} steps a fit; each side's lr "
        f"(Muon's; the reference's AdamW lr) swept x{{{args.multipliers}}} its config's at seed 0 (a best lr at an "
        f"end of the grid followed by up to {_tuned.EXTEND} more past it), then seeds 0–{args.seeds - 1} at its "
        "best. The target is the reference's (AdamW alone, tuned) mean final val loss: "
        + ", ".join(f"{m} {targets[m]:.4f}" for m in args.models)
        + ". Steps to target: each seed's first validation at or below it (fits validate densely near it: within "
        f"2% of the steps), mean ± std (min–max); final val loss over {args.val_batches} fixed batches, mean ± std "
        "(min–max). The last column pairs each seed with the defaults' same seed.", "",
        *[f"- {m}: {MODELS_HERE[m][0]}" for m in args.models], "",
        table, "",
        *[f"- {n}." for group in notes for n in group], "",
        "Each model's full report (sweep and seeds tables, steps to target, plot) is `comparison.md` in its "
        "directory, copied with its plot to `results/recipes/<model>/`, the configs to `results/recipes/configs/`. "
        "Produced by:", "", *_tuned.produced_by("recipes", argv, {f"{m}_{s}": c for (m, s), c in lines.items()}),
    ])
    _tuned.publish(out, "recipes", args.models, report, args.write)


if __name__ == "__main__":
    main()
