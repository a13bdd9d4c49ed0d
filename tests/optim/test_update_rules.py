"""The update rules beside plain Muon: NorMuon (``normuon_beta2``) and cautious weight decay.

NorMuon is checked against a reference written from the paper's Algorithm 1 (Li et al. 2025, arXiv
2510.05491) in float32, and against dion's NorMuon maths (``dion/normuon.py``, ``dion/muon.py``: momentum,
``_normuon_normalization_core``, ``muon_update_post_orthogonalize``), reimplemented here from reading its
source, within bf16 tolerance. Newton-Schulz itself is tested elsewhere (test_newton_schulz.py); both
references call ours, so what is compared is the rule around it.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_muon import Muon, MuonWithAdamW
from lightning_muon.optim import AdamW, _update, groups
from lightning_muon.optim.newton_schulz import gram_newton_schulz, zeropower_via_newtonschulz

from helpers import RANKS_START_METHOD

LR, WD, MOMENTUM, BETA2 = 0.02, 0.1, 0.95, 0.9
STEPS = 6
NS = {"ns_coefficients": (3.4445, -4.7750, 2.0315), "ns_steps": 5, "eps": 1e-7}
POLAR = {**NS, "ns_coefficients": "polar_express"}
SECOND_MOMENT = "normuon_second_moment"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grads(shape: Sequence[int], steps: int = STEPS, seed: int = 1) -> list[torch.Tensor]:
    g = _gen(seed)
    return [torch.randn(*shape, generator=g) for _ in range(steps)]


def _orthogonalise_fp32(matrix: torch.Tensor, ns: dict, gram: bool = False) -> torch.Tensor:
    iterate = gram_newton_schulz if gram else zeropower_via_newtonschulz
    return iterate(matrix, **ns, dtype=torch.float32)


def _paper_reference(
    w: torch.Tensor,
    grads: list[torch.Tensor],
    matrices: Callable[[torch.Tensor], list[torch.Tensor]],
    *,
    neuron_dim: int = 0,
    ns: dict = NS,
    gram: bool = False,
) -> torch.Tensor:
    """Algorithm 1 of the NorMuon paper, one matrix and one neuron at a time, in float32, with Muon's
    momentum and lr rule around it (nesterov, ``adjust_lr_fn=None``). ``matrices`` views a tensor as its
    matrices (``m x n`` views that write through); ``neuron_dim``: 0 when a neuron is a row, 1 a column."""
    w = w.clone()
    buf = torch.zeros_like(w)
    v = None
    for g in grads:
        buf = MOMENTUM * buf + (1 - MOMENTUM) * g
        update = (1 - MOMENTUM) * g + MOMENTUM * buf
        w.mul_(1 - LR * WD)
        orthogonals = [_orthogonalise_fp32(u, ns, gram) for u in matrices(update)]
        if v is None:
            v = [torch.zeros(o.shape[neuron_dim]) for o in orthogonals]
        for k, (o, target) in enumerate(zip(orthogonals, matrices(w), strict=True)):
            o = o if neuron_dim == 0 else o.T
            normalized = torch.empty_like(o)
            for i in range(o.shape[0]):  # each neuron: its running mean square, then divide by its root
                v[k][i] = BETA2 * v[k][i] + (1 - BETA2) * o[i].pow(2).mean()
                normalized[i] = o[i] / (v[k][i].sqrt() + 1e-8)
            normalized *= o.norm() / normalized.norm()  # back to the Frobenius norm the update had
            normalized = normalized if neuron_dim == 0 else normalized.T
            m, n = target.shape if neuron_dim == 0 else target.T.shape
            target.sub_(LR * math.sqrt(max(1, m / n)) * normalized)
    return w


def _muon_steps(w: torch.Tensor, grads: list[torch.Tensor], layout: str = "flatten", **kwargs) -> tuple:
    p = w.clone().requires_grad_()
    opt = Muon([{"params": [p], "matrix_layouts": [layout]}], lr=LR, weight_decay=WD, momentum=MOMENTUM, **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


FP32 = {"normuon_beta2": BETA2, "ns_dtype": torch.float32}


# --------------------------------------------------------------- the paper's Algorithm 1


@pytest.mark.parametrize(
    ("shape", "layout", "neuron_dim", "matrices"),
    [
        ((12, 20), "flatten", 0, lambda t: [t]),  # wide
        ((20, 12), "flatten", 0, lambda t: [t]),  # tall
        ((6, 3, 2, 2), "flatten", 0, lambda t: [t.view(6, 12)]),  # conv kernel: out x in*kh*kw
        ((3, 8, 5), "stack", 0, lambda t: list(t.unbind(0))),  # experts: each matrix its own rows
        ((10, 6), "in_out", 1, lambda t: [t]),  # stored in x out: a neuron is a column
    ],
    ids=["wide", "tall", "conv", "stack", "in_out"],
)
def test_normuon_follows_the_papers_algorithm(shape, layout, neuron_dim, matrices):
    w = torch.randn(*shape, generator=_gen(0))
    grads = _grads(shape)
    ours, opt = _muon_steps(w, grads, layout, **FP32)
    expected = _paper_reference(w, grads, matrices, neuron_dim=neuron_dim)
    torch.testing.assert_close(ours, expected, rtol=0, atol=2e-6)
    plain, _ = _muon_steps(w, grads, layout, ns_dtype=torch.float32)
    assert (ours - plain).abs().max() > 1e-3  # the normalization moved the weights: a real difference
    (p,) = opt.param_groups[0]["params"]
    assert opt.state[p][SECOND_MOMENT].dtype == torch.float32
    assert opt.state[p][SECOND_MOMENT].shape == groups.row_moment_shape(shape, layout)


@pytest.mark.parametrize(
    ("ns", "shape", "gram", "kwargs"),
    [
        (POLAR, (12, 20), False, {"ns_coefficients": "polar_express"}),
        (NS, (8, 32), True, {"ns_gram_aspect": 3.0}),  # 4:1, so Gram Newton-Schulz
        (POLAR, (32, 8), True, {"ns_coefficients": "polar_express", "ns_gram_aspect": 3.0}),
    ],
    ids=["polar-express", "gram", "gram-polar-express"],
)
def test_normuon_with_polar_express_and_gram_newton_schulz(ns, shape, gram, kwargs):
    w = torch.randn(*shape, generator=_gen(0))
    grads = _grads(shape)
    ours, _ = _muon_steps(w, grads, **FP32, **kwargs)
    torch.testing.assert_close(ours, _paper_reference(w, grads, lambda t: [t], ns=ns, gram=gram), rtol=0, atol=2e-6)


def test_same_shape_matrices_batched_together_each_keep_their_own_rows():
    """Five matrices in one batched Newton-Schulz call (three wide, two tall twins) step as five alone."""
    shapes = [(12, 20)] * 3 + [(20, 12)] * 2
    ws = [torch.randn(*s, generator=_gen(k)) for k, s in enumerate(shapes)]
    grads = [_grads(s, seed=10 + k) for k, s in enumerate(shapes)]
    ps = [w.clone().requires_grad_() for w in ws]
    opt = Muon(ps, lr=LR, weight_decay=WD, momentum=MOMENTUM, **FP32)
    for step in range(STEPS):
        for p, g in zip(ps, grads, strict=True):
            p.grad = g[step].clone()
        opt.step()
    for p, w, g in zip(ps, ws, grads, strict=True):
        torch.testing.assert_close(p.detach(), _paper_reference(w, g, lambda t: [t]), rtol=0, atol=2e-6)


# ---------------------------------------------------------------------------- dion


def _dion_reference(w: torch.Tensor, grads: list[torch.Tensor], cautious: bool) -> torch.Tensor:
    """dion's NorMuon step as its source reads (flatten=False, adjust_lr="spectral_norm", nesterov): momentum
    ``M <- mu M + G``, ``U = mu M + G`` in bf16, Newton-Schulz (ours, bf16), the variance buffer in the
    parameter's dtype, the update cast to it, ``V.lerp(mean(U^2, -1), 1 - beta2)``, ``U / (sqrt(V) + 1e-8)``
    rescaled to ``||U||_F / max(||U_new||_F, 1e-8)``; then weight decay (cautious: only where ``sign(X*U) >=
    0``) with the base lr and the step with ``lr * sqrt(fan_out / fan_in)``."""
    x = w.clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w[..., 0:1])
    for g in grads:
        m = m * MOMENTUM + g
        u = (m * MOMENTUM + g).to(torch.bfloat16)
        u = zeropower_via_newtonschulz(u, **NS, dtype=torch.bfloat16).to(v.dtype)
        norm_u = u.norm(p=2, dim=(-2, -1), keepdim=True)
        v = torch.lerp(v, (u * u).mean(dim=-1, keepdim=True), 1 - BETA2)
        u = u / (v.sqrt() + 1e-8)
        u = u * (norm_u / u.norm(p=2, dim=(-2, -1), keepdim=True).clamp(min=1e-8))
        if cautious:
            mask = torch.minimum(torch.sign(x * u) + 1, torch.ones(()))
            x = x - x * mask * (LR * WD)
        else:
            x = x * (1 - LR * WD)
        x = x - u * (LR * math.sqrt(x.shape[-2] / x.shape[-1]))
    return x


#: Tall matrices: their orthogonalised rows differ in norm, so the normalization matters (a wide one's rows are
#: about orthonormal, and NorMuon changes it only by Newton-Schulz's inexactness).
DION_SHAPES = [(24, 16), (32, 12)]


@pytest.mark.parametrize("shape", DION_SHAPES, ids=str)
def test_normuon_matches_dions_maths_within_bf16(shape):
    w = torch.randn(*shape, generator=_gen(0))
    grads = _grads(shape)
    ours, _ = _muon_steps(w, grads, normuon_beta2=BETA2, adjust_lr_fn="spectral")
    dion = _dion_reference(w, grads, cautious=False)
    # bf16 Newton-Schulz on differently scaled inputs (dion's momentum is ours / (1 - mu)) rounds differently:
    # measured 6.7e-4 and 9.8e-4 after 6 steps; plain Muon is 8.7e-3 and 1.1e-2 away.
    torch.testing.assert_close(ours, dion, rtol=0, atol=1.5e-3)
    plain, _ = _muon_steps(w, grads, adjust_lr_fn="spectral")
    assert (plain - dion).abs().max() > 5e-3


@pytest.mark.parametrize("shape", DION_SHAPES, ids=str)
def test_cautious_weight_decay_matches_dions_within_bf16(shape):
    """Where bf16 rounding flips the sign of ``p * update`` near zero, one side decays an entry the other
    does not (``lr * weight_decay * |p|``, ~2e-3): measured on 1.8% and 3.9% of the entries, where plain decay
    is off on 66%."""
    w = torch.randn(*shape, generator=_gen(0))
    grads = _grads(shape)
    dion = _dion_reference(w, grads, cautious=True)

    def off(**kwargs) -> float:
        ours, _ = _muon_steps(w, grads, normuon_beta2=BETA2, adjust_lr_fn="spectral", **kwargs)
        return ((ours - dion).abs() > 1.5e-3).float().mean().item()

    assert off(cautious_weight_decay=True) < 0.1
    assert off() > 0.5


# --------------------------------------------------------------------- state and resume


def _saved_and_loaded(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_normuon_state_is_saved_and_a_resumed_run_equals_the_uninterrupted_one():
    shape = (12, 20)
    w = torch.randn(*shape, generator=_gen(0))
    grads = _grads(shape, steps=6)
    whole, _ = _muon_steps(w, grads, **FP32)
    first, opt = _muon_steps(w, grads[:3], **FP32)
    saved = _saved_and_loaded(opt.state_dict())
    assert set(saved["state"][0]) == {"momentum_buffer", SECOND_MOMENT}
    assert saved["param_groups"][0]["normuon_beta2"] == BETA2
    p = first.clone().requires_grad_()
    resumed = Muon([p], lr=LR, weight_decay=WD, momentum=MOMENTUM, ns_dtype=torch.float32)  # plain until loaded
    resumed.load_state_dict(saved)
    for g in grads[3:]:
        p.grad = g.clone()
        resumed.step()
    assert torch.equal(p.detach(), whole)


def test_plain_muon_keeps_no_second_moment_and_a_torch_state_dict_loads_as_plain_muon():
    p = torch.randn(8, 12, generator=_gen(0)).requires_grad_()
    q = p.detach().clone().requires_grad_()
    theirs = torch.optim.Muon([q], lr=LR)
    q.grad = torch.ones_like(q)
    theirs.step()
    ours = Muon([p], lr=LR)
    ours.load_state_dict(theirs.state_dict())
    group = ours.param_groups[0]
    assert group["normuon_beta2"] is None and group["cautious_weight_decay"] is False
    p.grad = torch.ones_like(p)
    ours.step()
    assert set(ours.state[p]) == {"momentum_buffer"}


def test_muon_with_adamw_carries_normuon_and_its_state_through_the_pair_state_dicts():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))
    tokens = torch.arange(10)

    def train(opt: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            model(tokens).square().mean().backward()
            opt.step()

    one = MuonWithAdamW(model, normuon_beta2=BETA2, cautious_weight_decay=True, ns_dtype=torch.float32)
    assert all(g["normuon_beta2"] == BETA2 and g["cautious_weight_decay"] for g in one.muon.param_groups)
    train(one, 2)
    muon_sd, adamw_sd = (_saved_and_loaded(sd) for sd in one.pair_state_dicts())  # live dicts share tensors
    (hidden,) = [p for g in one.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    assert SECOND_MOMENT in one.state[hidden]
    assert any(SECOND_MOMENT in s for s in muon_sd["state"].values())
    before = [p.detach().clone() for p in model.parameters()]
    train(one, 1)
    after_one = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, b in zip(model.parameters(), before, strict=True):
            p.copy_(b)
    again = MuonWithAdamW(model, ns_dtype=torch.float32)  # plain settings until the states are loaded
    again.load_pair_state_dicts(muon_sd, adamw_sd)
    train(again, 1)
    assert all(torch.equal(p.detach(), a) for p, a in zip(model.parameters(), after_one, strict=True))


# ------------------------------------------------------------------- cautious weight decay


def test_cautious_weight_decay_on_a_hand_computed_update():
    """``apply`` with a given update: entries where weight and update agree in sign (the step already moves
    them toward zero) decay, the others do not."""
    p = torch.tensor([[2.0, -2.0], [3.0, -3.0]])
    update = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])  # p * update: [[2, -2], [-3, 3]]
    group = {"lr": 0.1, "weight_decay": 0.5, "adjust_lr_fn": "none", "cautious_weight_decay": True}
    bucket = _update.Bucket(group, [p], [torch.zeros(2, 2)], [torch.zeros(2, 2)], [""], (2, 2))
    _update.apply(bucket, [update])
    # decay 0.1 * 0.5 = 0.05 of the entry where it agrees: 2 -> 1.9, -3 -> -2.85; then minus 0.1 * update
    assert torch.equal(p, torch.tensor([[1.8, -2.1], [3.1, -2.75]]))


def test_cautious_weight_decay_in_a_step_spares_the_entries_the_gradient_grows():
    """On a 1 x n matrix the first update is a positive multiple of the gradient (Newton-Schulz of a row is
    its direction), so the entries that decay are those where ``p * g >= 0``: the two runs differ by exactly
    ``lr * weight_decay * p`` on the others."""
    w = torch.tensor([[1.0, -2.0, 3.0, -4.0]])
    g = torch.tensor([[0.5, 0.5, -0.5, -0.5]])  # agrees with w in sign at entries 0 and 3
    cautious, _ = _muon_steps(w, [g], cautious_weight_decay=True, ns_dtype=torch.float32)
    plain, _ = _muon_steps(w, [g], ns_dtype=torch.float32)
    spared = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(cautious - plain, LR * WD * w * spared, rtol=0, atol=1e-7)


def test_cautious_adamw_on_a_hand_computed_step():
    """The AdamW half: an entry decays only where its update (the sign of the first moment after this step) has
    its sign, as torch's AdamW decays it; the step itself is torch's."""
    w = torch.tensor([[2.0, -2.0], [3.0, -3.0]])
    g = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])  # the update's sign: agrees with w at (0, 0) and (1, 1)
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    AdamW([p], lr=0.1, weight_decay=0.5, cautious_weight_decay=True).step()
    decayed = torch.nn.Parameter(torch.tensor([[2.0 * (1 - 0.05), -2.0], [3.0, -3.0 * (1 - 0.05)]]))
    decayed.grad = g.clone()
    torch.optim.AdamW([decayed], lr=0.1, weight_decay=0.0).step()
    assert torch.equal(p.detach(), decayed.detach())


def test_cautious_adamw_off_is_torchs_adamw_bit_for_bit_and_on_differs():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(6, 5, generator=generator)
    grads = [torch.randn(6, 5, generator=generator) for _ in range(STEPS)]

    def run(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> torch.Tensor:
        p = torch.nn.Parameter(start.clone())
        optimizer = make([p])
        for g in grads:
            p.grad = g.clone()
            optimizer.step()
        return p.detach()

    settings = {"lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.1}
    torchs = run(lambda ps: torch.optim.AdamW(ps, **settings))
    assert torch.equal(run(lambda ps: AdamW(ps, **settings)), torchs)
    cautious = run(lambda ps: AdamW(ps, **settings, cautious_weight_decay=True))
    assert not torch.equal(cautious, torchs)
    # decaying less: every entry ends at least as far from zero as under full decay, some farther
    assert bool((cautious.abs() >= torchs.abs() - 1e-6).all()) and bool((cautious.abs() > torchs.abs()).any())


def test_cautious_adamw_keeps_its_setting_in_state_dicts_and_refuses_what_it_cannot_do():
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = AdamW([p], weight_decay=0.1, cautious_weight_decay=True)
    fresh = AdamW([torch.nn.Parameter(torch.zeros(3))])
    fresh.load_state_dict(optimizer.state_dict())
    assert fresh.param_groups[0]["cautious_weight_decay"] is True
    with pytest.raises(ValueError, match=r"Invalid cautious_weight_decay: 'yes' \(must be True or False\)"):
        AdamW([p], cautious_weight_decay="yes")
    with pytest.raises(ValueError, match="cautious_weight_decay does not support maximize=True"):
        AdamW([p], cautious_weight_decay=True, maximize=True)
    with pytest.raises(ValueError, match=r"cautious_weight_decay does not support complex parameters \(a complex"):
        AdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))], cautious_weight_decay=True)


def test_muon_with_adamw_takes_cautious_decay_on_each_half():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))
    both = MuonWithAdamW(model, cautious_weight_decay=True, adamw_weight_decay=0.1, adamw_cautious_weight_decay=True)
    assert type(both.adamw) is AdamW
    assert [g["cautious_weight_decay"] for g in both.param_groups] == [True] * len(both.param_groups)
    plain = MuonWithAdamW(model).adamw.param_groups[0]  # off: torch's AdamW's groups, key for key
    torchs = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0]
    assert plain.keys() == torchs.keys() | {"algorithm", "name", "param_names"}


def test_off_by_default_and_the_paired_defaults_stay_plain_muon():
    opt = Muon([torch.zeros(4, 3, requires_grad=True)])
    assert opt.defaults["normuon_beta2"] is None and opt.defaults["cautious_weight_decay"] is False


NEW_SETTING_ERRORS = [
    ({"normuon_beta2": 1.0}, r"Invalid normuon_beta2: 1\.0 \(must be None \(plain Muon\) or a number in \[0, 1\)"),
    ({"normuon_beta2": -0.1}, r"Invalid normuon_beta2: -0\.1"),
    ({"normuon_beta2": "0.95"}, r"Invalid normuon_beta2: '0\.95'"),
    ({"normuon_beta2": True}, r"Invalid normuon_beta2: True"),
    ({"cautious_weight_decay": "yes"}, r"Invalid cautious_weight_decay: 'yes' \(must be True or False\)"),
]


@pytest.mark.parametrize(("kwargs", "pattern"), NEW_SETTING_ERRORS, ids=[str(k) for k, _ in NEW_SETTING_ERRORS])
def test_bad_settings_are_refused_by_muon_and_muon_with_adamw(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Muon([torch.zeros(4, 3, requires_grad=True)], **kwargs)
    with pytest.raises(ValueError, match=pattern):
        MuonWithAdamW(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4)), **kwargs)


# --------------------------------------------------------------------------- distributed


DDP_SHAPES = [(12, 20), (20, 12), (12, 20), (3, 8, 5), (6, 3, 2, 2)]
DDP_LAYOUTS = ["flatten", "flatten", "flatten", "stack", "flatten"]


def _ddp_steps(split: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank (or one process) steps the same parameters on the same gradients (DDP's averaged ones)."""
    ps = [torch.randn(*s, generator=_gen(k)).requires_grad_() for k, s in enumerate(DDP_SHAPES)]
    opt = Muon([{"params": ps, "matrix_layouts": DDP_LAYOUTS}], lr=LR, weight_decay=WD, normuon_beta2=BETA2,
               cautious_weight_decay=True, ns_dtype=torch.float32, split_ns=split)
    for step in range(STEPS):
        for k, p in enumerate(ps):
            p.grad = torch.randn(*p.shape, generator=_gen(100 * step + k))
        opt.step()
    assert (opt.strategy.kind == "replicated") == split
    return [p.detach() for p in ps], [opt.state[p][SECOND_MOMENT] for p in ps]


def _ddp_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.save(_ddp_steps(split=True), os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    os._exit(0)  # no interpreter teardown: see tests/test_distributed.py (torch 2.13 + gloo abort at exit)


@pytest.mark.slow
@pytest.mark.distributed
def test_normuon_split_over_two_ddp_ranks_equals_one_process(tmp_path):
    """Each rank orthogonalises its share; every rank normalises every update from the gathered ones, so the
    weights and every second moment are the same on both ranks and as on one process."""
    mp.start_processes(_ddp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method=RANKS_START_METHOD)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for a, b in zip([*ranks[0][0], *ranks[0][1]], [*ranks[1][0], *ranks[1][1]], strict=True):
        assert torch.equal(a, b)  # the ranks agree exactly, second moments included
    alone = _ddp_steps(split=False)
    # One process merges a tall bucket with its wide twin into one batched call, the split path does not: the
    # matmuls may round differently (fp32).
    for got, expected in zip([*ranks[0][0], *ranks[0][1]], [*alone[0], *alone[1]], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
