"""The QK-Clip guide (docs/guides/qk-clip.md) runs as written, and names the keys the callback logs."""

from __future__ import annotations

import torch

from lightning_muon.attention import QKClipper
from lightning_muon.attention.clipper import CLIPPED_HEADS_KEY, MAX_LOGIT_KEY

from helpers import DOCS, code_blocks


def test_the_adapter_example_runs_and_clips():
    blocks = code_blocks("guides/qk-clip.md")
    assert len(blocks) == 2
    exec(compile(blocks[0], "docs/guides/qk-clip.md block 0", "exec"), {})
    namespace: dict = {}
    exec(compile(blocks[1], "docs/guides/qk-clip.md block 1", "exec"), namespace)
    stats, model = namespace["stats"], namespace["model"]
    assert int(stats.clipped_heads.sum()) > 0 and stats.max_logit > 1.0
    with QKClipper(model, tau=None) as meter, meter.recording():
        torch.manual_seed(0)
        model(torch.randn(2, 16, 32) * 10)  # other inputs than the example's: near tau, not exactly under it
        assert max(float(t.max()) for t in meter.max_logits().values()) < stats.max_logit


def test_the_logged_keys_are_documented():
    text = (DOCS / "guides/qk-clip.md").read_text()
    for key in (MAX_LOGIT_KEY, f"{MAX_LOGIT_KEY}/<module name>", CLIPPED_HEADS_KEY):
        assert f"`{key}`" in text, key
