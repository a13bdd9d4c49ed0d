"""QK-Clip on the weights: after the clip the next forward's per-head max logit is at or under tau (the largest of
each key group at tau), heads under tau keep every bit of their weights, on fused, transposed and GQA layouts."""

from __future__ import annotations

import pytest
import qk_models
import torch
from torch import nn

from lightning_muon.attention import QKClipper, QKLayout, QKProjection, clip_factors, qk_clip_

IDS = torch.randint(qk_models.VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))

#: One attention layer each: the clip of a layer changes the inputs of the layers after it, so "the next forward
#: is capped" holds exactly for the layer whose inputs the clip leaves alone (the first).
FAMILIES = {
    "llama-gqa": lambda: qk_models.llama("sdpa", layers=1),
    "llama-bias": lambda: qk_models.llama("eager", heads=4, kv_heads=4, bias=True, layers=1),
    "qwen2-mqa": lambda: qk_models.qwen2("sdpa", layers=1),
    "gpt2": lambda: qk_models.gpt2("sdpa", layers=1),
    "litgpt": lambda: qk_models.litgpt(layers=1),
    "mha": lambda: qk_models.MHALM(layers=1),
    "adapter": lambda: qk_models.OwnLM(layers=1),
}


def _grown(model: nn.Module) -> nn.Module:
    """Large q/k weights, so the logits spread over tens to hundreds."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0)
            elif p.dim() == 1 and p.numel() > 1:
                p.normal_(0, 0.5)  # biases (norm weights too: still fine for the clip)
    return model.train()


def _measure(clipper: QKClipper, model: nn.Module) -> dict[str, torch.Tensor]:
    with clipper.recording():
        qk_models.logits_of(model, IDS)
    found = {k: v.clone() for k, v in clipper.max_logits().items()}
    clipper.reset()
    return found


def _head_rows(proj: QKProjection, head: int, head_dim: int) -> list[torch.Tensor]:
    start = proj.offset + head * head_dim
    rows = [proj.weight.narrow(proj.out_dim, start, head_dim).clone()]
    if proj.bias is not None:
        rows.append(proj.bias.narrow(0, proj.bias_start + head * head_dim, head_dim).clone())
    return rows


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_clip_caps_the_next_forward_and_leaves_unclipped_heads_alone(family):
    model = _grown(FAMILIES[family]())
    with QKClipper(model, tau=None) as meter:
        before = _measure(meter, model)
    tau = float(torch.cat(list(before.values())).median())  # about half the heads over it
    with QKClipper(model, tau=tau) as clipper:
        sites = {s.name: s for s in clipper.sites}
        kept = {}  # query heads under tau (and key heads whose whole group is) -> their rows now
        for name, s in before.items():
            layout = sites[name].layout
            for h in range(layout.num_heads):
                if s[h] <= tau:
                    kept[(name, "q", h)] = _head_rows(layout.query, h, layout.head_dim)
            for g in range(layout.num_kv_heads):
                if (s.view(layout.num_kv_heads, -1)[g] <= tau).all():
                    kept[(name, "k", g)] = _head_rows(layout.key, g, layout.head_dim)
        with clipper.recording():
            qk_models.logits_of(model, IDS)
        stats = clipper.clip()
        after = _measure(clipper, model)

    over = sum(int((s > tau).sum()) for s in before.values())
    assert 0 < over < sum(s.numel() for s in before.values())
    assert int(stats.clipped_heads.sum()) == over
    assert stats.max_logit == pytest.approx(max(float(s.max()) for s in before.values()), rel=1e-6)
    for name, s in before.items():
        layout = sites[name].layout
        assert (after[name] <= tau * (1 + 1e-5)).all(), (name, after[name], tau)
        groups, new = s.view(layout.num_kv_heads, -1), after[name].view(layout.num_kv_heads, -1)
        for g in range(layout.num_kv_heads):
            if (groups[g] > tau).any():  # the group's largest head lands on tau
                top = int(groups[g].argmax())
                assert new[g, top] == pytest.approx(tau, rel=1e-4)
            else:  # a group wholly under tau: its logits unchanged
                torch.testing.assert_close(new[g], groups[g], rtol=0, atol=0)
    for (name, kind, index), rows in kept.items():
        layout = sites[name].layout
        proj = layout.query if kind == "q" else layout.key
        for old, now in zip(rows, _head_rows(proj, index, layout.head_dim)):
            assert torch.equal(old, now), (name, kind, index)  # bit for bit


def test_gqa_factors_shared_key_by_the_group_max_no_factor_above_one():
    layout = QKLayout(
        query=QKProjection(torch.ones(8, 4)), key=QKProjection(torch.ones(4, 4)),
        num_heads=4, num_kv_heads=2, head_dim=2,
    )
    s = torch.tensor([400.0, 50.0, 200.0, 100.0])  # group 0: one head over tau; group 1: one over, one at tau
    query, key = clip_factors(layout, s, tau=100.0)
    torch.testing.assert_close(query, torch.tensor([0.5, 1.0, 0.5**0.5, 1.0]))
    torch.testing.assert_close(key, torch.tensor([0.5, 0.5**0.5]))
    final = s * query * key.repeat_interleave(2)
    assert (final <= 100.0 + 1e-4).all() and final[0] == pytest.approx(100.0) and final[2] == pytest.approx(100.0)


def test_transposed_and_fused_layouts_scale_the_right_columns():
    weight = torch.arange(1.0, 1.0 + 4 * 12).view(4, 12)  # Conv1D-style in x out: q | k | v of 2 heads of 2
    bias = torch.arange(1.0, 13.0)
    layout = QKLayout(
        query=QKProjection(weight, bias, 0, transposed=True), key=QKProjection(weight, bias, 4, transposed=True),
        num_heads=2, num_kv_heads=2, head_dim=2,
    )
    original_w, original_b = weight.clone(), bias.clone()
    clipped = qk_clip_(layout, torch.tensor([400.0, 10.0]), tau=100.0)
    assert int(clipped) == 1
    factor = torch.ones(12)
    factor[0:2] = factor[4:6] = 0.5  # head 0 of q and of k: sqrt(100 / 400)
    assert torch.equal(weight, original_w * factor) and torch.equal(bias, original_b * factor)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -float("inf")])
def test_non_finite_maxima_clip_nothing(bad):
    weight = torch.randn(4, 4)
    layout = QKLayout(query=QKProjection(weight), key=QKProjection(weight, offset=2), num_heads=1,
                      num_kv_heads=1, head_dim=2)
    original = weight.clone()
    assert int(qk_clip_(layout, torch.tensor([bad]), tau=1.0)) == 0
    assert torch.equal(weight, original)


@pytest.mark.parametrize("tau", [0, -1.0, float("inf"), True, "100"])
def test_bad_tau_is_refused(tau):
    with pytest.raises(ValueError, match="tau must be a finite number > 0 or None"):
        QKClipper(qk_models.OwnLM(), tau=tau)
