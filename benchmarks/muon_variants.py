"""The update-rule options against plain Muon on models other libraries wrote, each side tuned: NorMuon and
cautious weight decay on transformers' Llama, NorMuon and the fused ``gate_up_proj`` split per block on
transformers' Qwen3-MoE, the fused projections split per block on GPT-2 (``c_attn``: q, k, v) and litgpt
(``qkv``: unequal blocks under grouped-query attention). The shipped GPT's comparison is
``results/muon_variants/`` (one ``lightning-muon compare`` command, in its report). Issue 48's studies, run with
``--studies``: AOL Newton-Schulz at 4 steps on the shipped GPT (``gpt_aol``, ``--name aol_trained``), and its fused
``qkv`` split per projection and per head by hand (``gpt_heads``; GPT-2's ``c_attn``: ``gpt2_heads``; transformers'
Llama, 4 query heads and 2 key/value heads, by ``split_heads``: ``llama_heads``; ``--name heads_trained``).
``--tabulate`` reports runs fitted apart (the same fits, two at a time).

Each model's sides are configs this writes (the model from `lightning_muon.examples.third_party`, the Muon
settings of the shipped configs, the library's default Newton-Schulz dtype); each study is one run of the real
command::

    lightning-muon compare MODEL_muon.yaml MODEL_normuon.yaml ... --multipliers 0.5,1,2 --seeds 2 --baseline MODEL_muon

and a best lr at an end of its grid is followed past it (`_tuned.extend_edges`), the report then written again
from all the runs (``compare --from-logs``).

    python benchmarks/muon_variants.py --write     # ~1 h on 2 cores (two studies at a time, one thread a fit)
    python benchmarks/muon_variants.py --studies gpt2 --steps 20 --seeds 1 --multipliers 1 --out /tmp/mv  # a trial
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _tuned
from third_party import MODELS, TEXT, TRAINER

from lightning_muon.commands.compare.aggregate import edge_notes, spread

MOE = dict(what="transformers `Qwen3MoeForCausalLM` (8 SwiGLU experts of width 128, top 2, fused `gate_up_proj` "
                "stacks; no load-balancing loss), 2 layers, width 128",
           model=MODELS["llama"]["model"], args={"family": "qwen3_moe", "n_layer": 2, "n_embd": 128}, data=TEXT,
           muon_lr=0.02, rest_lr=0.003)
#: The shipped GPT (``configs/gpt_muon.yaml``'s model and Muon settings). Its attention is the example's own module,
#: whose fused ``qkv`` the routing finds through its ``qk_layout()``; the sides give the blocks by hand, as
#: ``configs/gpt_muon_split.yaml`` does: ``projections`` are its ``qkv``'s row blocks one a projection, ``heads``
#: one a head (q's 4 heads, then k's, then v's: 12 of 32 rows).
GPT = dict(what="the shipped GPT (`configs/gpt_muon.yaml`: `CharGPT`, fused `qkv`), 4 layers, width 128, 4 heads",
           model="lightning_muon.examples.char_gpt.CharGPT", args={"n_layer": 4, "n_embd": 128}, data=TEXT,
           muon_lr=0.02, rest_lr=0.003, projections={"*.qkv.weight": [128] * 3}, heads={"*.qkv.weight": [32] * 12})
#: GPT-2's ``c_attn`` (``Conv1D``, ``in x out``: the blocks are along its 384 output columns) one block a head.
GPT2 = dict(MODELS["gpt2"], heads={"*.c_attn.weight": [32] * 12})


def blocks(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """An option setting the study's model's ``matrix_blocks`` to its spec's ``key`` entry (blocks by hand)."""
    return lambda spec: {"model": {"matrix_blocks": spec[key]}}


#: Each option: what it is, and what it sets: on the Muon optimizer (``muon``) or on the model (``model``); or a
#: function of the study's model giving them.
OPTIONS: dict[str, tuple[str, dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "muon": ("plain Muon (the baseline; fused projections whole, `split_fused: false`)", {}),
    "normuon": ("NorMuon, `normuon_beta2: 0.95`", {"muon": {"normuon_beta2": 0.95}}),
    "cautious": ("cautious weight decay, `cautious_weight_decay: true`", {"muon": {"cautious_weight_decay": True}}),
    "split": ("fused projections split per block, `split_fused: true`", {"model": {"split_fused": True}}),
    # The routing sends a router (a stack of gate vectors, one an expert) to AdamW: this side asks what Muon does.
    "routers": ("the routers on Muon, `muon_params: ['*.mlp.gate.weight']`",
                {"model": {"muon_params": ["*.mlp.gate.weight"]}}),
    "projections": ("fused q, k, v split per projection, `matrix_blocks` (3 blocks of 128)", blocks("projections")),
    "heads": ("fused q, k, v split one block a head, `matrix_blocks` (12 blocks of 32)", blocks("heads")),
    "split_heads": ("attention heads one block each, `split_heads: true`", {"model": {"split_heads": True}}),
    "aol4": ("AOL Newton-Schulz, 4 steps, `ns_steps: 4, ns_precondition: aol`",
             {"muon": {"ns_steps": 4, "ns_precondition": "aol"}}),
    "aol4_turbo": ("AOL, 4 steps, Turbo-Muon's coefficients, `ns_coefficients: turbo_muon`",
                   {"muon": {"ns_steps": 4, "ns_precondition": "aol", "ns_coefficients": "turbo_muon"}}),
}
#: Each study: its model and the options its sides take (the first is the baseline).
STUDIES: dict[str, dict[str, Any]] = {
    "llama": dict(spec=MODELS["llama"], options=["muon", "normuon", "cautious"]),
    "qwen3_moe": dict(spec=MOE, options=["muon", "normuon", "split", "routers"]),
    "gpt2": dict(spec=MODELS["gpt2"], options=["muon", "split"]),
    "litgpt": dict(spec=MODELS["litgpt"], options=["muon", "split"]),
    "gpt_aol": dict(spec=GPT, options=["muon", "aol4", "aol4_turbo"]),
    "gpt_heads": dict(spec=GPT, options=["muon", "projections", "heads"]),
    "gpt2_heads": dict(spec=GPT2, options=["muon", "split", "heads"]),
    "llama_heads": dict(spec=MODELS["llama"], options=["muon", "split_heads"]),
}
#: Each report's title, by its name (``--name``).
TITLES = {"muon_variants_models": "Update-rule options on third-party models: each against plain Muon, each side tuned",
          "aol_trained": "AOL Newton-Schulz at 4 steps on the shipped GPT: against the default 5, each side tuned",
          "heads_trained": "Attention heads orthogonalised alone: per head against per projection and fused, each "
                           "side tuned"}
#: The studies ``--studies`` runs when not given (the later ones run with ``--studies NAME ...``).
DEFAULT_STUDIES = ["llama", "qwen3_moe", "gpt2", "litgpt"]


def config(spec: dict[str, Any], option: str, steps: int) -> dict[str, Any]:
    """One side's config: ``spec``'s model with Muon + AdamW and the ``option``'s settings."""
    given = OPTIONS[option][1]
    sets = given(spec) if callable(given) else given
    opt = _tuned.optimizers(spec["muon_lr"], spec["rest_lr"], ns_dtype=None, **sets.get("muon", {}))
    # split_fused false: every side routes fused projections as 0.1's default did, whole unless the side splits
    # them (the studies were measured so; the default now splits equal q, k, v blocks, as the "split" sides do)
    routing = {"split_fused": False, **sets.get("model", {})}
    return {"seed_everything": 0, "trainer": {**TRAINER, "max_steps": steps}, "data": spec["data"],
            "model": {"class_path": spec["model"], "init_args": {**spec["args"], **opt, **routing}}}


def run_study(name: str, out: Path, steps: int, seeds: int, multipliers: str, val_batches: int,
              threads: int | None, reuse: bool = False, tabulate: bool = False) -> list[str]:
    """Write the study's configs and run ``compare`` on them (then `_tuned.extend_edges`); returns the command
    line (as one run of it, also where ``reuse`` kept the sides already fitted in ``out``: only the others fit;
    ``tabulate`` fits nothing, every side's runs already there)."""
    study = STUDIES[name]
    configs = [_tuned.write_config(out / "configs" / f"{name}_{option}.yaml", config(study["spec"], option, steps),
                                   f"{study['spec']['what']}; {OPTIONS[option][0]}; written by "
                                   "benchmarks/muon_variants.py")
               for option in study["options"]]
    common = ["--val_points", "6", "--trainer.limit_val_batches", str(val_batches)]
    sweep = ["--multipliers", multipliers, "--seeds", str(seeds)]
    baseline = ["--baseline", configs[0].stem]
    logs = out / name / "lightning_logs"
    todo = [] if tabulate else [c for c in configs if not (reuse and (logs / c.stem).is_dir())]
    if todo:  # the baseline named only where it is among the sides fitted (else it is a kept one)
        _tuned.compare(todo, out / name, [*sweep, *(baseline if todo[0] == configs[0] else []), *common], threads)
    if tabulate or _tuned.extend_edges(configs, out / name, seeds, common, threads, label=name) or todo != configs:
        _tuned.compare([], out / name, [*baseline, "--from-logs", *(str(logs / c.stem) for c in configs)], threads)
    # as one run of the command would be typed
    return ["lightning-muon", "compare", *map(_tuned.relative, configs), *sweep, *baseline, *common, "--out",
            _tuned.relative(out / name)]


def study_rows(name: str, out: Path) -> tuple[list[list[str]], list[str]]:
    """One row per side of a study (the baseline first), and its edge notes. The per-seed differences pair each
    seed with the baseline's same seed (the same initialisation and batches, each side at its own best lr)."""
    names = [f"{name}_{option}" for option in STUDIES[name]["options"]]
    _, results, sides = _tuned.tuned(out / name, names, names[0])
    base = results[0]
    rows = []
    for option, result, side in zip(STUDIES[name]["options"], results, sides, strict=True):
        paired = result.curve.final - base.curve.final
        delta = "–" if result is base else f"{paired.mean():+.4f} ({', '.join(f'{d:+.4f}' for d in paired)})"
        time_ratio = "–" if result is base or base.last_time is None or result.last_time is None else \
            f"{result.last_time / base.last_time:.2f}x"
        lrs = ", ".join(f"{lr:g}" for lr in side.grid)
        rows.append([name, OPTIONS[option][0], f"{result.lr:g} (of {lrs})", str(len(side.seeds)),
                     spread(result.curve.final), delta, f"{result.last_time:.0f} s" if result.last_time else "–",
                     time_ratio])
    return rows, [f"{name}: {note}" for note in edge_notes(sides)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--studies", nargs="+", choices=list(STUDIES), default=DEFAULT_STUDIES)
    _tuned.add_study_options(parser, steps=300, multipliers_help="the lr sweep around Muon lr 0.02 (default 0.5,1,2)")
    parser.add_argument("--tabulate", action="store_true",
                        help="fit nothing: tabulate the runs already in --out (fits run apart, side by side)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the sides already fitted in --out (fit only the others, then tabulate all)")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/NAME.md and its RESULTS.md section")
    parser.add_argument("--name", default="muon_variants_models",
                        help="the report's name (default muon_variants_models; the AOL and per-head studies: "
                             "aol_trained, heads_trained)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where the runs go (default: lightning_logs/muon_variants)")
    args = parser.parse_args(argv)
    out = Path(args.out or "lightning_logs/muon_variants").resolve()
    load_before = os.getloadavg()
    started = time.perf_counter()
    print(f"muon_variants: {len(args.studies)} studies, {args.jobs} at a time; output in {out}/<study>/", flush=True)

    def one(name: str) -> list[str]:
        line = run_study(name, out, args.steps, args.seeds, args.multipliers, args.val_batches, args.threads,
                         reuse=args.reuse, tabulate=args.tabulate)
        print(f"  {name}: done in {_tuned.seconds(out / name) / 60:.1f} min", flush=True)
        return line

    with ThreadPoolExecutor(args.jobs) as pool:
        commands = dict(zip(args.studies, pool.map(one, args.studies), strict=True))
    rows, notes = zip(*(study_rows(name, out) for name in args.studies), strict=True)
    header = ["model", "option", "best Muon lr (swept)", "seeds", "final val loss", "minus plain Muon's (per seed)",
              "train time", "train time / plain Muon's"]
    table = _tuned.markdown_table(header, rows)
    elapsed = time.perf_counter() - started
    report = "\n".join([
        f"# {TITLES.get(args.name, 'Update-rule options: each against plain Muon, each side tuned')}", "",
        _tuned.run_line(args.threads, args.jobs, load_before, elapsed), "",
        f"Each model trained from scratch on the standard library's bytes, {args.steps} steps a fit (batch 32 x 128 "
        f"bytes); each side's Muon lr swept x{{{args.multipliers}}} around 0.02 at seed 0 (a best lr at an end of the "
        f"grid followed by up to {_tuned.EXTEND} more past it), then seeds 0–{args.seeds - 1} at its best; AdamW "
        "(lr 0.003) on the embeddings, norms, routers and heads. Final val loss is the last validation "
        f"({args.val_batches} fixed batches), mean ± std (min–max) over the seeds. Train time leaves validation out "
        "(the mean over the seeds at the best lr; noisy when other work shares the machine). Newton-Schulz in the "
        "library's default dtype (bf16 on this CPU, which has AVX512-BF16).", "",
        *[f"- {name}: {STUDIES[name]['spec']['what']}" for name in args.studies], "",
        table, "",
        *[f"- {n}." for group in notes for n in group], "",
        "Each study's full report (sweep and seeds tables, verdicts, plot) is `comparison.md` in its directory, "
        f"copied with its plot to `results/{args.name}/<model>/`, the configs to "
        f"`results/{args.name}/configs/`. Produced by:", "", *_tuned.produced_by("muon_variants", argv, commands),
    ])
    _tuned.publish(out, args.name, args.studies, report, args.write)


if __name__ == "__main__":
    main()
