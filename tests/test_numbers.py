"""One source for every number: each benchmark figure the README and the docs quote is checked against the file in
``benchmarks/results/`` it was measured in (every number of the quote is a number of that file, rounded as
quoted), every default a page states is the code's or the shipped config's (read from them), and statements that
went stale stay gone."""

from __future__ import annotations

import inspect
import math
import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PACKAGE = ROOT / "lightning_muon"

#: (page, the figure as the page quotes it, the results file it comes from).
FIGURES = [
    ("README.md", "1.685 ± 0.010 (Muon + AdamW) vs 2.258 ± 0.006", "quality.md"),
    ("README.md", "Muon reaches AdamW's final loss in 0.33x the steps", "quality.md"),
    ("README.md", "transformers Llama 1.691 vs 2.070, GPT-2 1.895 vs 2.417", "third_party.md"),
    ("README.md", "litgpt\n  1.750 vs 1.913", "third_party.md"),
    ("docs/guides/worth-it.md", "| 1.895 ± 0.022 | 2.417 ± 0.004 | 0.33x | 0.36x |", "third_party.md"),
    ("docs/guides/worth-it.md", "final val loss was 1.8910 ± 0.0007,\noff 1.8877 ± 0.0052", "third_party.md"),
    ("docs/benchmarks.md", "GPT-2 bf16 Newton-Schulz: Gram on 1.891, off 1.888, Polar Express 1.891, fp32 1.895",
     "third_party.md"),
    ("README.md", "full 1.075 (Muon + AdamW) vs 1.207 (AdamW)", "finetune.md"),
    ("README.md", "LoRA 1.272 (`lora_A` on Muon, `lora_B` on AdamW) vs 1.300 (AdamW)", "finetune.md"),
    ("README.md", "0.73x the time of `torch.optim.Muon`", "optimizer_step.md"),
    ("README.md", "the Newton-Schulz work per rank 0.49x (DDP, 2 ranks)", "distributed.md"),
    ("README.md", "0.50 of one process's FLOPs under TP(2) and\n  0.25 under dp=2 x tp=2", "distributed_tp.md"),
    # The main job as shipped (bf16 Newton-Schulz, the fused qkv split by default); val_bpb is val_loss / ln 2.
    ("README.md", "CharGPT: val_loss 1.6746, val_bpb 2.4159", "main_job.md"),
    ("docs/guides/worth-it.md", "(1.6746 against 1.7074", "main_job.md"),
    ("docs/benchmarks.md", "momentum schedule -0.0406; -0.0414, EMA -0.0762; -0.0644, both together -0.0889; -0.0754",
     "recipes.md"),
    ("docs/benchmarks.md", "NorMuon -0.0246; -0.0099", "recipes.md"),
    ("docs/benchmarks.md", "-0.0097; -0.0276, weight decay following a cosine lr +0.0349; +0.0121", "recipes.md"),
    ("docs/benchmarks.md", "1.5820 ± 0.0056 against 1.6756 ± 0.0027", "recipe_config/comparison.md"),
    ("docs/benchmarks.md", "1.6746 split\nagainst 1.7074 whole", "main_job.md"),
    ("docs/benchmarks.md", "1.685 ± 0.010 (Muon + AdamW) vs 2.258 ± 0.006", "quality.md"),
    ("docs/benchmarks.md", "1.685 ± 0.010 vs 2.258 ± 0.006 (Muon's best lr 0.04, 1.6740 at seed 0 against 1.6746",
     "quality.md"),
    ("docs/benchmarks.md", "digits_cnn test accuracy 0.996 vs 0.981", "quality.md"),
    ("docs/benchmarks.md", "val loss 1.714 (Muon + AdamW) vs 2.251", "compare/comparison.md"),
    ("docs/benchmarks.md", "1.722 ± 0.003 vs 2.256 ± 0.008", "compare_sweep/comparison.md"),
    ("docs/benchmarks.md", "1.035x the other steps", "monitor_overhead.md"),
    ("docs/guides/monitoring.md", "a logging step costs 1.035x", "monitor_overhead.md"),
    ("docs/benchmarks.md", "NorMuon 2.168 ± 0.007 vs Muon 2.218 ± 0.004", "update_rules/comparison.md"),
    ("docs/guides/optimizer.md", "2.1676 ± 0.0066", "update_rules/comparison.md"),
    ("docs/guides/optimizer.md", "2.2183 ± 0.0036", "update_rules/comparison.md"),
    ("docs/guides/optimizer.md", "2.2180 ± 0.0023", "update_rules/comparison.md"),
    ("docs/benchmarks.md", "q, k, v 1.6737 ± 0.0008, NorMuon 1.6904 ± 0.0082, Muon (fused qkv) 1.7126 ± 0.0053",
     "muon_variants/comparison.md"),
    ("docs/guides/routing.md", "1.6737 ± 0.0008 against 1.7126 ± 0.0053", "muon_variants/comparison.md"),
    ("docs/guides/optimizer.md", "NorMuon ended at 1.6904 ± 0.0082 against Muon's 1.7126 ± 0.0053",
     "muon_variants/comparison.md"),
    ("docs/guides/optimizer.md", "1.00 / 1.00 (0.53x / 0.74x `torch.optim.Muon`)", "optimizer_step_update_rules.md"),
    ("docs/guides/optimizer.md", "| 1.07 / 1.05 |", "optimizer_step_update_rules.md"),
    ("docs/guides/optimizer.md", "| 1.04 / 1.04 |", "optimizer_step_update_rules.md"),
    ("docs/benchmarks.md", "NorMuon 1.07 / 1.05, cautious 1.04 / 1.04, qkv split 1.17 / 1.13",
     "optimizer_step_update_rules.md"),
    ("docs/guides/optimizer.md", "| 1.4966 ± 0.0137 | -0.0065 (-0.0041, -0.0089) |", "muon_variants_models.md"),
    ("docs/guides/optimizer.md", "| 1.5076 ± 0.0173 | +0.0045 (+0.0044, +0.0046) |", "muon_variants_models.md"),
    ("docs/guides/optimizer.md", "| 1.4928 ± 0.0080 | +0.0027 (+0.0066, -0.0013) |", "muon_variants_models.md"),
    ("docs/guides/optimizer.md", "| 768x256, noise 0.3 | 0.129/0.306 | 0.190/0.318 | 0.175/0.318 | 0.026/0.140 | "
     "0.016/0.032 | 0.015/0.032 |", "aol.md"),
    ("docs/guides/optimizer.md", "| 768x256, noise 0.1 | 0.255/0.628 | 0.165/0.318 | 0.130/0.318 | 0.109/0.333 | "
     "0.062/0.145 | 0.017/0.044 |", "aol.md"),
    ("docs/guides/optimizer.md", "| 768x256, noise 0.03 | 0.714/0.886 | 0.245/0.615 | 0.447/0.749 | 0.507/0.785 | "
     "0.233/0.610 | 0.091/0.213 |", "aol.md"),
    ("docs/guides/optimizer.md", "| GPT 512x128 | 0.180/0.986 | 0.179/0.951 | 0.164/0.975 | 0.067/0.979 | "
     "0.036/0.950 | 0.023/0.912 |", "aol.md"),
    ("docs/guides/optimizer.md", "(0.067 against 0.179)", "aol.md"),
    ("docs/guides/optimizer.md", "(0.507 against 0.245)", "aol.md"),
    ("docs/guides/optimizer.md", "| default, 5 steps | 1.6192 ± 0.0256 |", "aol_trained.md"),
    ("docs/guides/optimizer.md", "| AOL, 4 steps | 1.6308 ± 0.0048 | +0.0116 (+0.0264, -0.0031) |", "aol_trained.md"),
    ("docs/guides/optimizer.md", "| AOL + turbo, 4 steps | 1.6332 ± 0.0180 | +0.0140 (+0.0194, +0.0086) |",
     "aol_trained.md"),
    ("docs/guides/optimizer.md", "(1.6011 to 1.6373)", "aol_trained.md"),
    ("docs/guides/optimizer.md", "The step it saves is 0.92x plain Muon's step", "optimizer_step_aol_blocks.md"),
    ("docs/guides/optimizer.md", "(0.94x with Turbo-Muon's coefficients", "optimizer_step_aol_blocks.md"),
    ("docs/guides/optimizer.md", "934.96 against 1098.04 GFLOP", "optimizer_step_aol_blocks.md"),
    ("docs/benchmarks.md", "default 5 steps 1.6192 ± 0.0256, AOL 4 steps 1.6308 ± 0.0048, AOL with Turbo-Muon's "
     "coefficients 1.6332 ± 0.0180", "aol_trained.md"),
    ("docs/benchmarks.md", "0.92x / 0.94x plain Muon's, qkv split per head 0.85x, per projection 1.07x",
     "optimizer_step_aol_blocks.md"),
    ("docs/guides/routing.md", "per head 1.5875 ± 0.0053, per projection 1.5833 ± 0.0065, fused 1.6192 ± 0.0256",
     "heads_trained.md"),
    ("docs/benchmarks.md", "per projection -0.0359 (-0.0223, -0.0494), per head -0.0317 (-0.0173, -0.0461)",
     "heads_trained.md"),
    ("docs/guides/routing.md", "per head 1.6578 ± 0.0095, one seed below fused and one above (-0.0061, +0.0074), "
     "per projection (`split_fused=True`) 1.6464 ± 0.0029, fused 1.6571 ± 0.0001", "heads_trained.md"),
    ("docs/benchmarks.md", "per projection -0.0107 (-0.0087, -0.0126), per head +0.0006 (-0.0061, +0.0074)",
     "heads_trained.md"),
    ("docs/guides/routing.md", "per head 1.4947 ± 0.0098 against 1.5028 ± 0.0130,\nbelow on both seeds "
     "(-0.0058, -0.0104)", "heads_trained.md"),
    ("docs/benchmarks.md", "`split_heads: true`, best lr 0.01 for both): -0.0081 (-0.0058, -0.0104)",
     "heads_trained.md"),
    ("docs/guides/routing.md", "1.6348 ± 0.0002 against 1.6574 ± 0.0010", "muon_variants_models.md"),
    ("docs/guides/routing.md", "1.4867 ± 0.0182 against 1.4901 ± 0.0135", "muon_variants_models.md"),
    ("docs/benchmarks.md", "GPT-2 -0.0226 (-0.0220, -0.0232), litgpt's GQA qkv -0.0001, Qwen3-MoE's `gate_up_proj` "
     "+0.0102; NorMuon Llama -0.0065 (-0.0041, -0.0089), Qwen3-MoE +0.0027", "muon_variants_models.md"),
    ("docs/guides/routing.md", "per group 0.0834 ± 0.0043, one `C x 9` matrix across the channels (the routing "
     "before) 0.0840 ± 0.0372, on AdamW 0.0910 ± 0.0290", "torch_layers.md"),
    ("docs/guides/routing.md", "split per gate 1.6169 ± 0.0129 against fused 1.6380 ± 0.0018, lower on both seeds "
     "(-0.0290, -0.0133)", "torch_layers.md"),
    ("docs/benchmarks.md", "94 s wall at a load average of 0.8-1.4", "device_check_cpu.md"),
    ("docs/explanations/how-muon-works.md", "(0.0001 to 0.6080 after the scaling)", "newton_schulz_spectrum.md"),
    ("docs/explanations/how-muon-works.md", "lie in the band 0.68..1.13", "newton_schulz_spectrum.md"),
    ("docs/explanations/how-muon-works.md", "lifts it only to 0.0493 (0.1029 in bf16)", "newton_schulz_spectrum.md"),
    ("docs/explanations/how-muon-works.md", "It is 0.362 for this\n  update and 0.383 for a Gaussian",
     "newton_schulz_spectrum.md"),
    ("docs/explanations/how-muon-works.md", "127 of 128 in the band, error 0.192", "newton_schulz_spectrum.md"),
    ("docs/explanations/how-muon-works.md", "differs from float32's by 0.0277", "newton_schulz_spectrum.md"),
    ("docs/explanations/how-muon-works.md",
     "(Gram off) ended at 1.8877 ± 0.0052 and float32 at 1.8945 ± 0.0220", "third_party.md"),
    ("docs/explanations/how-muon-works.md", "Polar Express in bf16 at\n  1.8906 ± 0.0126", "third_party.md"),
    ("docs/guides/worth-it.md", "Muon reached AdamW's final val loss 2.2508 after step 104 and\nby step 106 (1.9%)",
     "compare_target/comparison.md"),
    ("docs/guides/worth-it.md", "| 105 ± 0 | 1.6192 ± 0.0256 |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 104 ± 1 | 1.5786 ± 0.0152 | -0.0406 (-0.0332, -0.0479) |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 166 ± 5 | 1.5028 ± 0.0130 |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 176 ± 33 | 1.4614 ± 0.0173 | -0.0414 (-0.0444, -0.0383) |", "recipes.md"),
    ("docs/guides/worth-it.md", "(the target: 2.2012) | 0.00075 | 300 | 2.2012 ± 0.0128", "recipes.md"),
    ("docs/guides/worth-it.md", "(the target: 1.7123) | 0.0015 | 300 | 1.7123 ± 0.0137", "recipes.md"),
    ("configs/gpt_muon_recipe.yaml", "1.5303 ± 0.0116 against the defaults' 1.6192 ± 0.0256", "recipes.md"),
    ("configs/gpt_muon_recipe.yaml", "(-0.0790, -0.0988)", "recipes.md"),
    ("configs/gpt_muon_recipe.yaml", "-0.0754 (-0.0730, -0.0779)", "recipes.md"),
    ("configs/gpt_muon_recipe.yaml", "1.5820 ± 0.0056 against gpt_muon.yaml's 1.6756 ± 0.0027",
     "recipe_config/comparison.md"),
    ("docs/guides/worth-it.md", "1.5820 ± 0.0056 against `gpt_muon.yaml`'s 1.6756 ± 0.0027",
     "recipe_config/comparison.md"),
    ("configs/gpt_muon_recipe.yaml", "(momentum -0.0406 and -0.0414, EMA -0.0762 and -0.0644)", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.04 | 104 ± 0 | 1.6541 ± 0.0033 | +0.0349 (+0.0507, +0.0191) |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.02 | 102 ± 0 | 1.6095 ± 0.0017 | -0.0097 (+0.0096, -0.0290) |", "recipes.md"),
    ("docs/guides/worth-it.md", "beyond the spread (+0.0349 (+0.0507, +0.0191), at its best lr 0.04", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.02 | 100 ± 0 | 1.5946 ± 0.0083 | -0.0246 (-0.0124, -0.0369) |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.02 | 110 ± 0 | 1.5430 ± 0.0127 | -0.0762 (-0.0671, -0.0854) |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.02 | 111 ± 1 | 1.5303 ± 0.0116 | -0.0889 (-0.0790, -0.0988) |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.02 | 158 ± 6 | 1.5149 ± 0.0061 | +0.0121 (+0.0257, -0.0014) |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.01 | 150 ± 0 | 1.4751 ± 0.0020 | -0.0276 (-0.0198, -0.0355) |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.01 | 179 ± 30 | 1.4929 ± 0.0142 | -0.0099 (-0.0108, -0.0091) |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.01 | 160 ± 1 | 1.4384 ± 0.0080 | -0.0644 (-0.0608, -0.0680) |", "recipes.md"),
    ("docs/guides/worth-it.md", "| 0.01 | 158 ± 2 | 1.4274 ± 0.0096 | -0.0754 (-0.0730, -0.0779) |", "recipes.md"),
    ("docs/guides/worth-it.md", "-0.0889 on the GPT, -0.0754 on Llama", "recipes.md"),
    ("docs/guides/worth-it.md", "(-0.0246 against a spread of 0.0256 on the GPT, -0.0099 against 0.0130", "recipes.md"),
]
#: Statements that were true once, or never, and were quoted after the code, the config or the results file changed:
#: (the words, matched across line breaks on every page, the README and the docstrings, why they are wrong). Add the
#: old wording here when a default or a result changes.
STALE = [
    ("1.004x", "the monitor's overhead before monitor_overhead.md was measured again (1.035x)"),
    ("1.718 ± 0.004", "quality.py's headline with the fused qkv (0.1's routing), measured again split: 1.685 ± 0.010"),
    ("GPT-2 1.953 vs 2.417", "third_party.md with GPT-2's c_attn fused (0.1's routing), measured again split: 1.895"),
    ("val_loss 1.7197", "the main job's line with fp32 Newton-Schulz; bf16 is the default where it is native"),
    ("val_loss 1.7089", "the main job's line with the fused qkv whole (0.1's routing); split by default since 0.2"),
    ("By default it stays one matrix", "a fused q, k, v of equal blocks is split by default since 0.2"),
    ("ns_dtype: float32", "no shipped config sets ns_dtype: the hardware decides (configs/gpt_muon.yaml)"),
    ("orthogonalises in bf16 by default", "ns_dtype=None: bf16 where native, float32 where emulated"),
    ("bf16, the default of all of them", "lightning_muon.Muon's default dtype follows the hardware"),
    ("33 min wall", "device_check_cpu.md's run on a loaded machine, measured again at 94 s"),
    ("none has been made yet", "the fused-projection split was measured (muon_variants/comparison.md)"),
    ("no measurement has shown the split", "the same, in route_parameters' docstring (the API page)"),
    ("a few times `1e-3`", "Keller Jordan's AdamW lr is 3e-4 (his muon.py, tests/test_migration.py)"),
    ("torch's and most projects' AdamW", "torch's AdamW default lr is 1e-3, not the mixin's 3e-4"),
    ("given to the model instead of the Trainer", "the Trainer's clipping and accumulation flags work (mixin.md)"),
    ("no GPU has been lent to this project", "the development set-up's words, not the user's"),
    ("the issue allows", "the development set-up's words, not the user's"),
]


def numbers(text: str) -> list[str]:
    """The decimal numbers of a quote (``1.718``, ``0.42``), not counts such as ``300`` or ``2`` in ``TP(2)``."""
    return re.findall(r"(?<![\w.])\d+\.\d+", text)


def measured(quoted: str, text: str) -> bool:
    """Whether a number of ``text`` rounds to ``quoted`` (at its decimals, half up or half even)."""
    places = Decimal(1).scaleb(-len(quoted.split(".")[1]))
    for found in re.findall(r"\d+\.\d+", text):
        value = Decimal(found)
        if any(value.quantize(places, rounding=mode) == Decimal(quoted) for mode in (ROUND_HALF_UP, ROUND_HALF_EVEN)):
            return True
    return False


def spaced(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize(("page", "figure", "source"), FIGURES, ids=lambda value: str(value)[:40])
def test_a_quoted_figure_is_on_its_page_and_in_its_results_file(page, figure, source):
    assert spaced(figure) in spaced((ROOT / page).read_text()), f"{page} no longer quotes {figure!r}"
    results = (RESULTS / source).read_text()
    assert numbers(figure), figure
    assert [n for n in numbers(figure) if not measured(n, results)] == [], f"not in {source}"


def test_a_number_not_in_the_file_is_caught():
    assert measured("1.718", "| muon | 1.7181 ± 0.0036 |") and measured("0.004", "1.7181 ± 0.0036")
    assert not measured("1.004", "ratio 1.035") and not measured("1.72", "1.7140")


@pytest.mark.parametrize(("stale", "why"), STALE, ids=[stale for stale, _ in STALE])
def test_a_stale_statement_is_on_no_page(stale, why):
    """Nor in the package's sources, whose docstrings are the API pages."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(PACKAGE.rglob("*.py"))]
    assert [page.name for page in pages if spaced(stale) in spaced(page.read_text())] == [], why


# ------------------------------------------------------------------ the defaults the pages state, read from the code


def spelled(value: Any) -> str:
    """A default as the pages write it: ``0.0003`` as ``3e-4``, ``1e-08`` as ``1e-8``, ``0.95`` as ``0.95``, ``3.0`` as
    ``3``, ``[0.9, 0.95]`` as ``(0.9, 0.95)``, ``None`` as ``None``."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(spelled(v) for v in value) + ")"
    if isinstance(value, float) and 0 < abs(value) < 1e-2:
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class Defaults:
    """One object's defaults, each attribute spelled as the pages write it (`spelled`), for ``str.format``."""

    def __init__(self, values: dict[str, Any]):
        self.values = values

    def __getattr__(self, name: str) -> str:
        return spelled(self.__dict__["values"][name])


def keyword_defaults(function: Any) -> dict[str, Any]:
    return {name: parameter.default for name, parameter in inspect.signature(function).parameters.items()
            if parameter.default is not inspect.Parameter.empty}


def mib(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB"


def code_defaults() -> dict[str, Any]:
    """What the code and the shipped configs say, by the names the `DEFAULTS` templates use."""
    import lightning as L
    import torch

    from lightning_muon import Muon, MuonMixin, MuonWithAdamW
    from lightning_muon.optim import groups

    mixin = keyword_defaults(MuonMixin.__init__)
    config = yaml.safe_load((ROOT / "configs" / "gpt_muon.yaml").read_text())["model"]["init_args"]
    return {
        "Muon": Defaults(keyword_defaults(Muon.__init__)),
        "torch_Muon": Defaults(keyword_defaults(torch.optim.Muon.__init__)),
        "torch_AdamW": Defaults(keyword_defaults(torch.optim.AdamW.__init__)),
        "MuonWithAdamW": Defaults(keyword_defaults(MuonWithAdamW.__init__)),
        "mixin": Defaults(mixin),
        "mixin_muon": Defaults(mixin["muon"]["init_args"]),
        "mixin_adamw": Defaults(mixin["adamw"]["init_args"]),
        "config_muon": Defaults(config["muon"]["init_args"]),
        "config_adamw": Defaults(config["adamw"]["init_args"]),
        "trainer": Defaults({"log_every_n_steps": L.Trainer(logger=False, enable_checkpointing=False,
                                                          enable_progress_bar=False).log_every_n_steps}),
        "batch_bytes": Defaults({"cpu": mib(groups.DEFAULT_BATCH_BYTES["cpu"]),
                                 "accelerator": mib(groups.DEFAULT_BATCH_BYTES_ACCELERATOR)}),
    }


#: (page, a sentence that states a default, with the default as a ``{object.argument}`` field filled in from the code
#: by `code_defaults`): a default that changes in the code, or on the page alone, fails here. The same sentence twice
#: where it speaks for two objects (the mixin and ``MuonWithAdamW``; ``lightning_muon.Muon`` and torch's).
DEFAULTS = [
    ("docs/index.md", "the lrs are the mixin's defaults, Muon {mixin_muon.lr} and AdamW {mixin_adamw.lr}"),
    ("docs/index.md", "every `log_every_n_steps` ({trainer.log_every_n_steps} by default)"),
    ("docs/troubleshooting.md", "Muon's lr ({mixin_muon.lr} by default)"),
    ("docs/troubleshooting.md", "Muon: {mixin_muon.lr} (the default, with"),
    ("docs/troubleshooting.md",
     "the mixin's default is {mixin_adamw.lr}, Keller Jordan's (torch's AdamW default is {torch_AdamW.lr})"),
    ("docs/troubleshooting.md", "the shipped configs, tuned on small models, use {config_adamw.lr}"),
    ("docs/troubleshooting.md", "`max_consecutive_skips` of them in a row (default {mixin.max_consecutive_skips})"),
    ("docs/guides/optimizer.md", "at Keller Jordan's settings (lr {mixin_muon.lr}, weight decay "
     "{mixin_muon.weight_decay}, momentum {mixin_muon.momentum})"),
    ("docs/guides/optimizer.md", "at Keller Jordan's settings (lr {MuonWithAdamW.lr}, weight decay "
     "{MuonWithAdamW.weight_decay}, momentum {MuonWithAdamW.momentum})"),
    ("docs/guides/optimizer.md", "it starts from torch's defaults (lr {Muon.lr}, weight decay {Muon.weight_decay})"),
    ("docs/guides/optimizer.md",
     "it starts from torch's defaults (lr {torch_Muon.lr}, weight decay {torch_Muon.weight_decay})"),
    ("docs/guides/optimizer.md",
     "(`ns_batch_bytes`, default {batch_bytes.cpu} on CPU, {batch_bytes.accelerator} on accelerators;"),
    ("docs/guides/optimizer.md", "| `{Muon.adjust_lr_fn}` or `\"original\"` (the default) |"),
    ("docs/guides/optimizer.md", "with no `ns_dtype` (the default, `{Muon.ns_dtype}`)"),
    ("docs/guides/optimizer.md", "at least `ns_gram_aspect={Muon.ns_gram_aspect}` times longer than wide"),
    ("docs/guides/optimizer.md", "the pair's AdamW weight decay is {mixin_adamw.weight_decay} by default"),
    ("docs/guides/optimizer.md", "the pair's AdamW weight decay is {MuonWithAdamW.adamw_weight_decay} by default"),
    ("docs/guides/one-optimizer.md",
     "The defaults are the mixin's (Muon `lr={MuonWithAdamW.lr}`, AdamW `adamw_lr={MuonWithAdamW.adamw_lr}`)"),
    ("docs/guides/one-optimizer.md",
     "The defaults are the mixin's (Muon `lr={mixin_muon.lr}`, AdamW `adamw_lr={mixin_adamw.lr}`)"),
    ("docs/guides/migration.md", "Muon's weight decay is {MuonWithAdamW.weight_decay} (his 0) and AdamW's `eps` is "
     "torch's {MuonWithAdamW.adamw_eps} (his 1e-10)"),
    ("docs/guides/migration.md", "AdamW's `eps` is torch's {torch_AdamW.eps}"),
    ("docs/guides/worth-it.md", "Muon `lr={mixin_muon.lr}, momentum={mixin_muon.momentum}` (Nesterov) on the hidden "
     "matrices, AdamW at `lr={mixin_adamw.lr}, betas={mixin_adamw.betas}` on the rest"),
    ("docs/guides/worth-it.md", "(Nesterov) on the hidden matrices, AdamW at `lr={MuonWithAdamW.adamw_lr}, "
     "betas={MuonWithAdamW.adamw_betas}` on the rest"),
    ("docs/guides/worth-it.md", "below torch's AdamW default of `{torch_AdamW.lr}`"),
    ("docs/guides/worth-it.md", "the shipped configs use `{config_adamw.lr}` for AdamW"),
    ("docs/guides/distributed.md", "With `split_ns={Muon.split_ns}` (the default)"),
]


@pytest.mark.parametrize(("page", "template"), DEFAULTS, ids=lambda value: str(value)[:50])
def test_a_stated_default_is_the_code_s(page, template):
    sentence = template.format(**code_defaults())
    assert spaced(sentence) in spaced((ROOT / page).read_text()), f"{page} does not say {sentence!r}"


def test_a_default_is_spelled_as_the_pages_write_it():
    assert [spelled(v) for v in (3e-4, 1e-8, 1e-3, 0.003, 0.02, 0.95, 0.1, 0.0, 3.0, [0.9, 0.95], None, True, 5)] == [
        "3e-4", "1e-8", "1e-3", "3e-3", "0.02", "0.95", "0.1", "0", "3", "(0.9, 0.95)", "None", "True", "5"]
    stale = ("docs/guides/optimizer.md", DEFAULTS[9][1].replace("{Muon.lr}", "0.02"))
    assert spaced(stale[1].format(**code_defaults())) not in spaced((ROOT / stale[0]).read_text())


def test_the_options_said_off_by_default_are_off():
    """The optimizer guide: NorMuon and cautious weight decay "are off by default"; the routing guide: a fused
    projection's equal q, k, v blocks are split by default (``split_fused=None``); the shipped configs set no
    ``ns_dtype`` (the hardware decides)."""
    from lightning_muon import Muon, MuonMixin, MuonWithAdamW, route_parameters

    assert "Both are off by default" in (ROOT / "docs/guides/optimizer.md").read_text()
    for function in (Muon.__init__, MuonWithAdamW.__init__):
        assert keyword_defaults(function)["normuon_beta2"] is None
        assert keyword_defaults(function)["cautious_weight_decay"] is False
    said = "By default (`split_fused=None`) a fused q, k, v of equal blocks is split"
    assert said in spaced((ROOT / "docs/guides/routing.md").read_text())
    for function in (MuonMixin.__init__, MuonWithAdamW.__init__, route_parameters):
        assert keyword_defaults(function)["split_fused"] is None
    routing_page = spaced((ROOT / "docs/guides/routing.md").read_text())
    assert "`split_heads=True` (off by default: measured no better than a split per projection)" in routing_page
    for function in (MuonMixin.__init__, MuonWithAdamW.__init__, route_parameters):
        assert keyword_defaults(function)["split_heads"] is False
    configs = {path.name: yaml.safe_load(path.read_text()) for path in (ROOT / "configs").glob("*.yaml")}
    assert [name for name, config in configs.items() if "'ns_dtype'" in repr(config)] == []


def lr_scaling_rows(page: str) -> dict[str, str]:
    """An lr-scaling table's rows: each ``adjust_lr_fn`` value the first column names -> the scale formula."""
    rows = {}
    for line in (ROOT / page).read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        spans = [re.match(r"`?([^`]*)", cell).group(1) for cell in cells[1:]]  # a cell's first code span
        formula = next((span for span in spans if "sqrt" in span or span == "1"), None)
        if formula is None:
            continue
        for name in re.findall(r'adjust_lr_fn=?"?(\w+)"|`"(\w+)"`|`(None)`', line):
            rows["".join(name)] = formula
    return rows


@pytest.mark.parametrize("page", ["docs/guides/optimizer.md", "docs/guides/migration.md",
                                  "docs/explanations/how-muon-works.md"])
def test_the_lr_scaling_tables_are_adjust_lr(page):
    """Each row of a page's lr-scaling table, evaluated at several shapes, is what `adjust_lr` computes."""
    from lightning_muon import adjust_lr

    rows = lr_scaling_rows(page)
    assert {"original", "match_rms_adamw", "spectral", "none"} <= set(rows), rows
    for name, formula in rows.items():
        python = re.sub(r"(\d) (sqrt)", r"\1 * \2", formula)
        for shape in [(64, 16), (16, 64), (32, 32), (768, 3072)]:
            expected = eval(python, {"sqrt": math.sqrt, "max": max, "A": shape[0], "B": shape[1]})
            assert adjust_lr(1.0, None if name == "None" else name, shape) == pytest.approx(expected), (name, shape)


def test_the_ns_dtype_rule_the_optimizer_guide_states(monkeypatch):
    """The rule as the guide words it: CUDA from compute capability 8.0 on, CPUs with AVX512-BF16 or AMX, float32
    elsewhere; and the INFO line it quotes for an AVX2 CPU is the line the code writes."""
    import torch

    from lightning_muon.optim import _precision

    page = spaced((ROOT / "docs/guides/optimizer.md").read_text())
    assert "(CUDA compute capability 8.0 or later; the CPU's AVX512-BF16 or AMX" in page
    assert "bf16 where native, float32 otherwise" in page
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    for capability, native in [((7, 0), False), ((8, 0), True), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert _precision.native_bf16(torch.device("cuda", 0))[0] is native, capability
    for amx, avx512_bf16, native in [(True, False, True), (False, True, True), (False, False, False)]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        assert _precision.native_bf16(torch.device("cpu"))[0] is native
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    native, reason = _precision.native_bf16(torch.device("cpu"))
    line = _precision.Precision(torch.bfloat16 if native else torch.float32, "cpu", reason).line()
    assert f"```text\n{line}\n```" in (ROOT / "docs/guides/optimizer.md").read_text()
