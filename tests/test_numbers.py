"""One source for every number: each benchmark figure the README and the docs quote is checked against the file in
``benchmarks/results/`` it was measured in (every number of the quote is a number of that file, rounded as
quoted), and figures that went stale stay gone."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

#: (page, the figure as the page quotes it, the results file it comes from).
FIGURES = [
    ("README.md", "1.718 ± 0.004 (Muon + AdamW) vs 2.258 ± 0.006", "quality.md"),
    ("README.md", "Muon reaches AdamW's final loss in 0.42x the steps", "quality.md"),
    ("README.md", "transformers Llama 1.690 vs 2.070, GPT-2 1.953 vs 2.417", "third_party.md"),
    ("README.md", "litgpt\n  1.749 vs 1.913", "third_party.md"),
    ("README.md", "full 1.075 (Muon + AdamW) vs 1.207 (AdamW)", "finetune.md"),
    ("README.md", "LoRA 1.272 (`lora_A` on Muon, `lora_B` on AdamW) vs 1.300 (AdamW)", "finetune.md"),
    ("README.md", "0.73x the time of `torch.optim.Muon`", "optimizer_step.md"),
    ("README.md", "the Newton-Schulz work per rank 0.49x (DDP, 2 ranks)", "distributed.md"),
    ("README.md", "0.50 of one process's FLOPs under TP(2) and\n  0.25 under dp=2 x tp=2", "distributed_tp.md"),
    # The main job is the lr 0.02, seed 0 fit of gpt_muon there (bf16 Newton-Schulz); val_bpb is val_loss / ln 2.
    ("README.md", "CharGPT: val_loss 1.7089", "muon_variants/comparison.md"),
    ("docs/benchmarks.md", "1.718 ± 0.004 (Muon + AdamW) vs 2.258 ± 0.006", "quality.md"),
    ("docs/benchmarks.md", "val loss 1.714 (Muon + AdamW) vs 2.251", "quality.md"),
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
    ("docs/guides/routing.md", "1.6348 ± 0.0002 against 1.6574 ± 0.0010", "muon_variants_models.md"),
    ("docs/guides/routing.md", "1.4867 ± 0.0182 against 1.4901 ± 0.0135", "muon_variants_models.md"),
    ("docs/benchmarks.md", "GPT-2 -0.0226 (-0.0220, -0.0232), litgpt's GQA qkv -0.0001, Qwen3-MoE's `gate_up_proj` "
     "+0.0102; NorMuon Llama -0.0065 (-0.0041, -0.0089), Qwen3-MoE +0.0027", "muon_variants_models.md"),
    ("docs/guides/worth-it.md", "Muon reached AdamW's final val loss 2.2508 after step 104 and\nby step 106 (1.9%)",
     "compare_target/comparison.md"),
]
#: Figures that were quoted after their results file changed: on no page again.
STALE = ["1.004x", "val_loss 1.7197"]  # the main job's line with fp32 Newton-Schulz (bf16 is the default here now)


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


@pytest.mark.parametrize("stale", STALE)
def test_a_stale_figure_is_on_no_page(stale):
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert [page.name for page in pages if stale in page.read_text()] == []
