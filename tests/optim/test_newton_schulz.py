"""Tests of `lightning_muon.optim.newton_schulz`: the Newton-Schulz iteration and the diagnostics that judge it.

Oracles: ``torch.optim._muon._zeropower_via_newtonschulz`` (bit-identical on 2D bf16),
a float64 re-implementation of the same iteration written here, and SVDs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_zeropower
from torch.utils.flop_counter import FlopCounterMode

from lightning_muon.optim.newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    ns_flops,
    orthogonality_error,
    singular_value_range,
    zeropower_via_newtonschulz,
)

SHAPES = {"tall": (48, 32), "wide": (32, 48), "square": (40, 40)}
RECTANGULAR = {"tall": (64, 32), "wide": (32, 64)}
CUBIC = (1.5, -0.5, 0.0)

#: A stack goes through bmm/baddbmm instead of mm/addmm, which may sum in another
#: order. In bf16 (8 significant bits) one rounding flip is one ulp of an entry
#: of |x| < 2, i.e. at most 2**-7 (the largest gap measured on CPU over 1200
#: random stacks); later iterations can amplify it a little, so allow 4 such ulps.
#: A real batching bug (e.g. normalising the whole stack by one norm) is off by O(1).
BATCH_ATOL_BF16 = 2**-5
#: Same in float32 (24 significant bits, entries < 2): a few ulps of 2**-22, rounded up.
BATCH_ATOL_FP32 = 1e-5
#: float32 NS against the float64 reference: relative Frobenius error measured at
#: ~1.1e-6 after 5 steps on 32x48 matrices (float32 eps is 1.2e-7); bf16 is at ~1e-2,
#: so this bound would also catch a silent bf16 computation.
FP32_REL_TOL = 1e-5


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _reference_ns(
    G: torch.Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """The iteration written out plainly in float64, for one matrix."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / max(torch.linalg.matrix_norm(X).item(), eps)
    a, b, c = ns_coefficients
    for _ in range(ns_steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def _svd_orthogonality_error(O: torch.Tensor) -> torch.Tensor:
    """sqrt(mean((s^2 - 1)^2)) over the singular values s of each matrix, in float64."""
    s = torch.linalg.svdvals(O.double())
    return (s.pow(2) - 1).pow(2).mean(dim=-1).sqrt()


def _well_conditioned(m: int, n: int, seed: int, low: float = 0.5, high: float = 1.0) -> torch.Tensor:
    """An m x n matrix with singular values spread evenly in [low, high]."""
    r = min(m, n)
    U, _ = torch.linalg.qr(_randn(m, r, seed=seed))
    V, _ = torch.linalg.qr(_randn(n, r, seed=seed + 1))
    return U @ torch.diag(torch.linspace(low, high, r)) @ V.T


# ----------------------------------------------------------------- the iteration


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize(
    ("coefficients", "steps", "eps"),
    [(DEFAULT_NS_COEFFICIENTS, 5, DEFAULT_EPS), (CUBIC, 7, 1e-3), ((3.0, -3.2, 1.2), 2, 1e-7)],
    ids=["default", "cubic", "custom"],
)
def test_2d_bf16_is_bit_identical_to_torch(shape, coefficients, steps, eps):
    G = _randn(*shape, seed=1)
    ours = zeropower_via_newtonschulz(G, ns_coefficients=coefficients, ns_steps=steps, eps=eps)
    theirs = torch_zeropower(G, coefficients, steps, eps)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert ours.shape == G.shape
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", [(2, 2), (3, 5), (5, 3)])
def test_eps_floors_the_norm_of_a_zero_matrix(shape):
    out = zeropower_via_newtonschulz(torch.zeros(shape))
    assert torch.equal(out, torch.zeros(shape, dtype=torch.bfloat16))
    assert torch.equal(out, torch_zeropower(torch.zeros(shape), DEFAULT_NS_COEFFICIENTS, 5, DEFAULT_EPS))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.bfloat16, BATCH_ATOL_BF16), (torch.float32, BATCH_ATOL_FP32)], ids=["bf16", "fp32"]
)
def test_stack_matches_each_matrix(shape, dtype, atol):
    # Scales six orders of magnitude apart: each matrix must be normalised by its own norm.
    scales = torch.tensor([1e-3, 1.0, 1e3, 0.5]).view(4, 1, 1)
    stack = _randn(4, *shape, seed=2) * scales
    out = zeropower_via_newtonschulz(stack, dtype=dtype)
    assert out.shape == stack.shape and out.dtype == dtype
    for k in range(4):
        one = zeropower_via_newtonschulz(stack[k], dtype=dtype)
        torch.testing.assert_close(out[k].float(), one.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_4d_batch_keeps_its_shape_and_matches_each_matrix(shape):
    stack = _randn(2, 3, *shape, seed=3)
    out = zeropower_via_newtonschulz(stack)
    assert out.shape == (2, 3, *shape)
    for i in range(2):
        for j in range(3):
            one = zeropower_via_newtonschulz(stack[i, j])
            torch.testing.assert_close(out[i, j].float(), one.float(), atol=BATCH_ATOL_BF16, rtol=0)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize(
    ("coefficients", "steps"),
    [(DEFAULT_NS_COEFFICIENTS, 5), (DEFAULT_NS_COEFFICIENTS, 1), (CUBIC, 10), (DEFAULT_NS_COEFFICIENTS, 0)],
    ids=["quintic-5", "quintic-1", "cubic-10", "zero-steps"],
)
def test_fp32_matches_float64_reference(shape, coefficients, steps):
    G = _randn(*shape, seed=4)
    ours = zeropower_via_newtonschulz(G, ns_coefficients=coefficients, ns_steps=steps, dtype=torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == G.shape
    ref = _reference_ns(G, coefficients, steps)
    rel = torch.linalg.matrix_norm(ours.double() - ref) / torch.linalg.matrix_norm(ref)
    assert rel < FP32_REL_TOL


def test_fp32_stack_matches_float64_reference():
    stack = _randn(3, 24, 40, seed=5)
    out = zeropower_via_newtonschulz(stack, dtype=torch.float32)
    for k in range(3):
        ref = _reference_ns(stack[k])
        assert torch.linalg.matrix_norm(out[k].double() - ref) / torch.linalg.matrix_norm(ref) < FP32_REL_TOL


@pytest.mark.parametrize(
    ("shape", "dtype", "out_dtype"),
    [
        ((48, 32), torch.float32, torch.bfloat16),
        ((32, 48), torch.float32, torch.float32),
        ((48, 32), torch.bfloat16, torch.bfloat16),  # same dtype in and out: a careless .to() would alias G
        ((32, 48), torch.bfloat16, torch.bfloat16),
        ((3, 48, 32), torch.float32, torch.float32),
        ((2, 3, 32, 48), torch.bfloat16, torch.bfloat16),
        ((2, 16, 24), torch.float64, torch.float64),
    ],
)
def test_input_is_never_modified(shape, dtype, out_dtype):
    G = _randn(*shape, seed=6).to(dtype)
    before = G.clone()
    out = zeropower_via_newtonschulz(G, dtype=out_dtype)
    assert torch.equal(G, before)
    assert out.data_ptr() != G.data_ptr()


# ----------------------------------------------------------- how orthogonal it is


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orthogonality_error_matches_svd_on_random_matrices(shape, dtype):
    O = _randn(*shape, seed=7, dtype=dtype) / math.sqrt(max(shape))
    err = orthogonality_error(O)
    assert err.shape == () and err.dtype == dtype
    torch.testing.assert_close(err.double(), _svd_orthogonality_error(O), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_orthogonality_error_matches_svd_on_ns_outputs(shape):
    O = zeropower_via_newtonschulz(_randn(*shape, seed=8))
    err = orthogonality_error(O)
    assert err.dtype == torch.float32  # bf16 input is measured in float32
    torch.testing.assert_close(err.double(), _svd_orthogonality_error(O), rtol=1e-5, atol=1e-6)


def test_orthogonality_error_of_a_stack_has_the_batch_shape():
    O = _randn(2, 3, 20, 12, seed=9)
    err = orthogonality_error(O)
    assert err.shape == (2, 3)
    torch.testing.assert_close(err.double(), _svd_orthogonality_error(O), rtol=1e-5, atol=1e-6)
    assert orthogonality_error(_randn(5, 12, 20, seed=9)).shape == (5,)


@pytest.mark.parametrize("orientation", ["tall", "wide"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float64, 1e-14)], ids=["fp32", "fp64"])
def test_orthogonality_error_is_zero_for_semi_orthogonal(orientation, dtype, tol):
    Q, _ = torch.linalg.qr(_randn(40, 16, seed=10, dtype=dtype))  # orthonormal columns
    O = Q if orientation == "tall" else Q.T  # wide: orthonormal rows
    assert orthogonality_error(O) < tol
    # and it notices a scaled one: s = 0.5 everywhere gives |0.25 - 1| = 0.75
    torch.testing.assert_close(orthogonality_error(0.5 * O).item(), 0.75, rtol=1e-6, atol=0)


def test_cubic_iteration_converges_to_orthogonal():
    G = _well_conditioned(48, 32, seed=11)
    O = zeropower_via_newtonschulz(G, ns_coefficients=CUBIC, ns_steps=30, dtype=torch.float32)
    # Measured ~1e-7; the cubic converges quadratically once every s is near 1.
    assert orthogonality_error(O) < 1e-4
    lo, hi = singular_value_range(O)
    assert 1 - 1e-4 < lo <= hi < 1 + 1e-4


@pytest.mark.parametrize("shape", RECTANGULAR.values(), ids=RECTANGULAR.keys())
def test_default_quintic_lands_in_its_band_not_at_one(shape):
    G = _randn(6, *shape, seed=12)
    O = zeropower_via_newtonschulz(G, dtype=torch.float32)
    lo, hi = singular_value_range(O)
    # Measured over seeds: min s ~0.68, max s 1.04..1.14; error 0.36..0.40.
    assert (lo > 0.65).all() and (hi < 1.2).all()
    err = orthogonality_error(O)
    assert ((err > 0.3) & (err < 0.45)).all()
    # bf16 computes the same thing, roughly.
    torch.testing.assert_close(orthogonality_error(zeropower_via_newtonschulz(G)), err, atol=0.02, rtol=0)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_one_step_is_clearly_worse_than_five(shape):
    G = _randn(*shape, seed=13)
    err1 = orthogonality_error(zeropower_via_newtonschulz(G, ns_steps=1, dtype=torch.float32))
    err5 = orthogonality_error(zeropower_via_newtonschulz(G, ns_steps=5, dtype=torch.float32))
    assert err1 > err5 + 0.2  # measured ~0.7-0.8 vs ~0.37


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40), (3, 20, 12), (2, 2, 12, 20)])
def test_singular_value_range_is_svd_min_and_max(shape):
    O = _randn(*shape, seed=14)
    lo, hi = singular_value_range(O)
    s = torch.linalg.svdvals(O.double())
    assert lo.shape == hi.shape == O.shape[:-2]
    torch.testing.assert_close(lo, s[..., -1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hi, s[..., 0], rtol=1e-12, atol=1e-12)
    assert (lo <= hi).all()


# --------------------------------------------------------------------- the cost


def test_ns_flops_by_hand():
    # m=4, n=6 -> r=4, k=6. Per step: X X^T 2*4*4*6 = 192, A A 2*4^3 = 128, B X 192.
    assert ns_flops(4, 6, ns_steps=5) == 5 * (192 + 128 + 192) == 2560
    assert ns_flops(6, 4, ns_steps=5) == 2560  # tall is transposed first
    assert ns_flops(4, 6) == 2560  # default is 5 steps
    assert ns_flops(4, 6, ns_steps=0) == 0
    assert ns_flops(4, 6, ns_steps=2) == 1024


@pytest.mark.parametrize(("m", "n", "steps"), [(4, 6, 5), (48, 32, 5), (40, 40, 3)])
def test_ns_flops_matches_torch_flop_counter(m, n, steps):
    with FlopCounterMode(display=False) as counter:
        zeropower_via_newtonschulz(_randn(m, n, seed=15), ns_steps=steps, dtype=torch.float32)
    assert counter.get_total_flops() == ns_flops(m, n, ns_steps=steps)


# ------------------------------------------------------------------- bad input

NS_ERRORS = [
    # (function, input shape, kwargs, error type, message pattern)
    (zeropower_via_newtonschulz, (5,), {}, ValueError, r"stack of matrices.*got shape \(5,\)"),
    (zeropower_via_newtonschulz, (), {}, ValueError, r"got shape \(\)"),
    (zeropower_via_newtonschulz, (4, 3), {"ns_steps": 100}, ValueError, r"ns_steps must be in \[0, 100\), got 100"),
    (zeropower_via_newtonschulz, (4, 3), {"ns_steps": -1}, ValueError, r"ns_steps must be in \[0, 100\), got -1"),
    (
        zeropower_via_newtonschulz,
        (4, 3),
        {"ns_coefficients": (1.0, 2.0)},
        ValueError,
        r"ns_coefficients must be three numbers \(a, b, c\), got \(1\.0, 2\.0\)",
    ),
    (orthogonality_error, (5,), {}, ValueError, r"stack of matrices.*got shape \(5,\)"),
]


@pytest.mark.parametrize(
    ("fn", "shape", "kwargs", "error", "pattern"),
    NS_ERRORS,
    ids=["1d", "0d", "steps-100", "steps-negative", "two-coefficients", "orthogonality-1d"],
)
def test_bad_input_is_refused(fn, shape, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        fn(torch.ones(shape), **kwargs)
