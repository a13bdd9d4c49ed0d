"""Tests of the Newton-Schulz variants: the Polar Express schedule and Gram Newton-Schulz.

Oracles: the float64 iteration written out here, and exact SVDs (the iteration applies one scalar polynomial
composition to every singular value, so ``U f(S) V^T`` is what it must return).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_muon.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    coefficient_schedule,
    gram_newton_schulz,
    ns_flops,
    orthogonality_error,
    singular_value_range,
    zeropower_via_newtonschulz,
)

#: Long side several times the short one, both orientations, a lone matrix and a stack.
RECTANGULAR = {"wide-4": (32, 128), "tall-4": (128, 32), "wide-9": (16, 144), "stack-tall-6": (3, 96, 16)}
COEFFICIENTS = {"jordan": DEFAULT_NS_COEFFICIENTS, "polar_express": "polar_express"}


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _decaying(m: int, n: int, seed: int, smallest: float) -> torch.Tensor:
    """An m x n matrix with singular values spread log-evenly from 1 down to ``smallest`` (a momentum's
    spectrum falls off like this; it is where 16-bit Gram Newton-Schulz breaks without its restart)."""
    r = min(m, n)
    U, _ = torch.linalg.qr(_randn(m, r, seed=seed))
    V, _ = torch.linalg.qr(_randn(n, r, seed=seed + 1))
    return U @ torch.diag(torch.logspace(0, torch.log10(torch.tensor(smallest)).item(), r)) @ V.T


def _reference(G: torch.Tensor, coefficients: tuple | str, steps: int = 5) -> torch.Tensor:
    """The iteration in float64 on each matrix, written plainly."""
    schedule, factor = coefficient_schedule(coefficients, steps)
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) * factor)
    for a, b, c in schedule:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def _svd_oracle(G: torch.Tensor, coefficients: tuple | str, steps: int = 5) -> torch.Tensor:
    """``U f(S) V^T``: the scalar polynomials applied to the normalised singular values (exact SVD)."""
    schedule, factor = coefficient_schedule(coefficients, steps)
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    s = S / (S.pow(2).sum(dim=-1, keepdim=True).sqrt() * factor)
    for a, b, c in schedule:
        s = a * s + b * s**3 + c * s**5
    return U @ torch.diag_embed(s) @ Vh


def _relative(A: torch.Tensor, B: torch.Tensor) -> float:
    return (torch.linalg.matrix_norm(A.double() - B.double()) / torch.linalg.matrix_norm(B.double())).max().item()


# ------------------------------------------------------------------ Polar Express


def test_polar_express_schedule_is_the_papers_with_its_safety_factor():
    schedule, factor = coefficient_schedule("polar_express", 10)
    assert factor == 1.01
    # Amsel et al. 2025, Algorithm 1: the first polynomial is (8.287..., -23.595..., 17.300...) / (1.01, 1.01^3, 1.01^5)
    first = (8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3, 17.300387312530933 / 1.01**5)
    assert schedule[0] == pytest.approx(first)
    assert schedule[:8] == list(POLAR_EXPRESS_COEFFICIENTS)
    assert schedule[7:] == [(1.875, -1.25, 0.375)] * 3  # the last one repeats, unscaled
    # one (a, b, c) means the same at every step, no margin
    assert coefficient_schedule((1.0, 2.0, 3.0), 2) == ([(1.0, 2.0, 3.0)] * 2, 1.0)


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40), (3, 20, 12)])
def test_polar_express_equals_the_svd_oracle_and_the_float64_iteration(shape):
    G = _randn(*shape, seed=1)
    O = zeropower_via_newtonschulz(G, ns_coefficients="polar_express", dtype=torch.float32)
    # float32 against float64: measured ~1e-6 relative (the float32 path of the standard coefficients too)
    assert _relative(O, _reference(G, "polar_express")) < 1e-5
    assert _relative(O, _svd_oracle(G, "polar_express")) < 1e-5


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (128, 512)])
def test_polar_express_lands_closer_to_orthogonal_than_jordan_in_five_steps(shape):
    G = _randn(6, *shape, seed=2)
    jordan = zeropower_via_newtonschulz(G, dtype=torch.float32)
    polar = zeropower_via_newtonschulz(G, ns_coefficients="polar_express", dtype=torch.float32)
    lo, hi = singular_value_range(polar)
    # measured over seeds: s in 0.870..1.124 (Jordan's 0.682..1.134), error 0.14..0.19 (Jordan's 0.36..0.40)
    assert (lo > 0.85).all() and (hi < 1.13).all()
    assert (orthogonality_error(polar) < 0.21).all()
    assert (orthogonality_error(polar) < orthogonality_error(jordan) - 0.15).all()
    # and bf16 computes the same thing, roughly
    bf16 = zeropower_via_newtonschulz(G, ns_coefficients="polar_express")
    torch.testing.assert_close(orthogonality_error(bf16), orthogonality_error(polar), atol=0.03, rtol=0)


def test_an_unknown_schedule_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"\['polar_express', 'turbo_muon'\], got 'polar'"):
        zeropower_via_newtonschulz(torch.ones(4, 3), ns_coefficients="polar")


# --------------------------------------------------------------------- Gram NS


@pytest.mark.parametrize("coefficients", COEFFICIENTS.values(), ids=COEFFICIENTS.keys())
@pytest.mark.parametrize("shape", RECTANGULAR.values(), ids=RECTANGULAR.keys())
def test_gram_in_float64_is_the_iteration(shape, coefficients):
    G = _randn(*shape, seed=3).double()
    O = gram_newton_schulz(G, ns_coefficients=coefficients, dtype=torch.float64)
    assert O.shape == G.shape and O.dtype == torch.float64
    # the same polynomial in another order of products: float64 rounding only (measured ~1e-14)
    assert _relative(O, _reference(G, coefficients)) < 1e-10
    assert _relative(O, _svd_oracle(G, coefficients)) < 1e-10


@pytest.mark.parametrize("restart", [None, 1, 2, 3])
@pytest.mark.parametrize("steps", [1, 2, 5, 7])
def test_gram_restarts_and_step_counts_do_not_change_the_result(steps, restart):
    G = _randn(24, 96, seed=4).double()
    O = gram_newton_schulz(G, ns_steps=steps, dtype=torch.float64, restart=restart)
    assert _relative(O, _reference(G, DEFAULT_NS_COEFFICIENTS, steps)) < 1e-10


@pytest.mark.parametrize("coefficients", COEFFICIENTS.values(), ids=COEFFICIENTS.keys())
@pytest.mark.parametrize("shape", RECTANGULAR.values(), ids=RECTANGULAR.keys())
def test_gram_in_float32_matches_the_svd_oracle(shape, coefficients):
    G = _randn(*shape, seed=5)
    O = gram_newton_schulz(G, ns_coefficients=coefficients, dtype=torch.float32)
    # measured 1e-5..1e-4 on spectra down to 1e-4: float32 needs no restart
    assert _relative(O, _svd_oracle(G, coefficients)) < 1e-3
    decaying = _decaying(32, 128, seed=6, smallest=1e-4)
    assert _relative(gram_newton_schulz(decaying, ns_coefficients=coefficients, dtype=torch.float32),
                     _svd_oracle(decaying, coefficients)) < 1e-3


@pytest.mark.parametrize("coefficients", COEFFICIENTS.values(), ids=COEFFICIENTS.keys())
@pytest.mark.parametrize("smallest", [None, 1e-2, 1e-4, 1e-6], ids=["gaussian", "1e-2", "1e-4", "1e-6"])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (32, 288)], ids=["wide-4", "tall-4", "wide-9"])
def test_gram_in_bf16_is_as_close_to_the_iteration_as_the_standard_bf16_path(shape, smallest, coefficients):
    m, n = shape
    G = _randn(m, n, seed=7) if smallest is None else _decaying(m, n, seed=7, smallest=smallest)
    exact = _reference(G, coefficients)
    standard = _relative(zeropower_via_newtonschulz(G, ns_coefficients=coefficients), exact)
    gram = gram_newton_schulz(G, ns_coefficients=coefficients)
    # measured: gram 0.02..0.41, standard 0.014..0.40, gram / standard 1.0..2.4 (bf16 rounding, no drift)
    assert _relative(gram, exact) < 2 * standard + 0.02
    # and what Muon needs of it: the update is as far from orthogonal as the iteration leaves it (measured:
    # gram's error at most 0.031 further from the float64 one than the standard bf16 path's)
    target = orthogonality_error(exact).item()
    standard_error = orthogonality_error(zeropower_via_newtonschulz(G, ns_coefficients=coefficients)).item()
    assert abs(orthogonality_error(gram).item() - target) < abs(standard_error - target) + 0.05


def test_bf16_gram_without_its_restart_breaks_on_a_decaying_spectrum():
    # The reason for GRAM_RESTART: the accumulated product grows ~a^k on small singular values and its bf16
    # rounding swamps them (measured: orthogonality error 28 to 2909 instead of ~0.6).
    G = _decaying(16, 144, seed=8, smallest=1e-4)
    unsafe = gram_newton_schulz(G, restart=5)
    safe = gram_newton_schulz(G)
    assert orthogonality_error(unsafe) > 2
    assert orthogonality_error(safe) < 0.8


def test_gram_reads_its_input_without_writing_it():
    G = _randn(16, 64, seed=9)
    before = G.clone()
    gram_newton_schulz(G, dtype=torch.float32)
    assert torch.equal(G, before)


@pytest.mark.parametrize(("m", "n", "steps", "dtype"), [(16, 64, 5, torch.bfloat16), (64, 16, 5, torch.float32),
                                                        (16, 64, 2, torch.bfloat16), (16, 64, 1, torch.float32)])
def test_gram_ns_flops_match_the_torch_flop_counter(m, n, steps, dtype):
    with FlopCounterMode(display=False) as counter:
        gram_newton_schulz(_randn(m, n, seed=10), ns_steps=steps, dtype=dtype)
    assert counter.get_total_flops() == ns_flops(m, n, steps, gram=True, dtype=dtype)
    # and at 4:1 it is the cheaper one: 4 r^2 k + 16 r^3 MACs against 10 r^2 k + 5 r^3 (bf16, 5 steps)
    if steps == 5 and dtype == torch.bfloat16:
        assert ns_flops(m, n, gram=True) < 0.75 * ns_flops(m, n)
