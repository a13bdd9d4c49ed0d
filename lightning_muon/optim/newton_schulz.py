"""Newton-Schulz orthogonalisation and the diagnostics that judge it.

Pure, batched functions on stacks of matrices ``(..., m, n)``. Nothing here
knows about optimizers: `lightning_muon.Muon` and `lightning_muon.MuonMonitor`
both call these.

The iteration is the quintic one of Keller Jordan's Muon, the same maths as
``torch.optim.Muon``: scale each matrix by its Frobenius norm (so every
singular value is at most 1), then repeat ``X <- a X + (b A + c A^2) X`` with
``A = X X^T``. Each matrix is transposed first when it is tall, so that the
Gram matrix ``A`` is the small ``r x r`` one with ``r = min(m, n)``.

With the default coefficients the singular values do not converge to 1: they
land roughly in 0.68..1.13 after 5 steps, by design (a steeper slope at zero
orthogonalises small singular values faster). `orthogonality_error` measures
how far from orthogonal an update is.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_EPS",
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "ns_flops",
    "orthogonality_error",
    "singular_value_range",
    "zeropower_via_newtonschulz",
]

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_EPS = 1e-7


def zeropower_via_newtonschulz(
    G: Tensor,
    *,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximately orthogonalise every matrix of a stack ``G`` of shape ``(..., m, n)``.

    Returns a new tensor of ``G``'s shape in ``dtype`` (``G`` is never written).
    On a single 2D matrix in bfloat16 the operations are exactly those of
    ``torch.optim.Muon`` (bit-identical results); a stack runs the same
    iteration with batched matmuls.

    Args:
        G: one matrix ``(m, n)`` or a stack ``(..., m, n)``.
        ns_coefficients: ``(a, b, c)`` of the quintic ``a X + b A X + c A^2 X``.
        ns_steps: number of iterations (``0 <= ns_steps < 100``).
        eps: floor of the Frobenius norm used to normalise each matrix.
        dtype: compute dtype; ``torch.bfloat16`` (fast where the hardware has
            bf16 matmuls) or ``torch.float32``.
    """
    if G.ndim < 2:
        raise ValueError(f"expected a matrix or a stack of matrices (..., m, n), got shape {tuple(G.shape)}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be in [0, 100), got {ns_steps}")
    a, b, c = ns_coefficients
    tall = G.size(-2) > G.size(-1)
    # The 2D path normalises in place (as torch does), so it needs its own copy; the batched path's
    # normalisation makes a new tensor anyway.
    X = G.to(dtype, copy=G.ndim == 2)
    if tall:
        X = X.mT
    if X.ndim == 2:
        # Exactly torch.optim.Muon's sequence of kernels, so the 2D path is bit-identical.
        X.div_(X.norm().clamp(min=eps))
        for _ in range(ns_steps):
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    else:
        batch_shape = X.shape[:-2]
        X = X.reshape(-1, *X.shape[-2:])
        X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(ns_steps):
            A = torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
        X = X.reshape(*batch_shape, *X.shape[-2:])
    return X.mT if tall else X


def _short_side_gram(O: Tensor) -> Tensor:
    """``O O^T`` on the short side (``r x r``, ``r = min(m, n)``), in float32 or better."""
    work = O if O.dtype in (torch.float32, torch.float64) else O.float()
    if work.size(-2) > work.size(-1):
        work = work.mT
    return work @ work.mT


def orthogonality_error(O: Tensor) -> Tensor:
    """How far each matrix of ``O`` (``(..., m, n)``) is from having orthonormal short-side vectors.

    For each matrix, with ``r = min(m, n)`` and ``O`` oriented ``r x max(m, n)``:
    ``||O O^T - I_r||_F / sqrt(r)``. It is 0 for a semi-orthogonal matrix, and
    equals the RMS over the ``r`` singular values ``s`` of ``s^2 - 1``. Returns
    a tensor of shape ``O.shape[:-2]`` in float32 (float64 for float64 input).
    """
    if O.ndim < 2:
        raise ValueError(f"expected a matrix or a stack of matrices (..., m, n), got shape {tuple(O.shape)}")
    gram = _short_side_gram(O)
    r = gram.size(-1)
    eye = torch.eye(r, dtype=gram.dtype, device=gram.device)
    return torch.linalg.matrix_norm(gram - eye) / math.sqrt(r)


def singular_value_range(O: Tensor) -> tuple[Tensor, Tensor]:
    """The smallest and largest singular value of each matrix of ``O`` (exact, by SVD).

    Meant for small matrices and tests: it costs a full SVD in float64.
    Returns two tensors of shape ``O.shape[:-2]``.
    """
    s = torch.linalg.svdvals(O.double())
    return s.amin(dim=-1), s.amax(dim=-1)


def ns_flops(m: int, n: int, ns_steps: int = DEFAULT_NS_STEPS) -> int:
    """Multiply-add FLOPs (2 per MAC) of `zeropower_via_newtonschulz` on one ``m x n`` matrix.

    Per iteration, with ``r = min(m, n)`` and ``k = max(m, n)``: the Gram matrix
    ``X X^T`` (``2 r^2 k``), ``A A`` (``2 r^3``) and ``B X`` (``2 r^2 k``).
    """
    r, k = min(m, n), max(m, n)
    return ns_steps * (4 * r * r * k + 2 * r**3)
