"""Newton-Schulz orthogonalisation and the diagnostics that judge it.

Pure, batched functions on stacks of matrices ``(..., m, n)``. Nothing here
knows about optimizers: `lightning_muon.Muon` and `lightning_muon.MuonMonitor`
both call these.

The iteration is the quintic one of Keller Jordan's Muon, the same maths as
``torch.optim.Muon``: scale each matrix by its Frobenius norm (so every
singular value is at most 1), then repeat ``X <- a X + (b A + c A^2) X`` with
``A = X X^T``. Each matrix is transposed first when it is tall, so that the
Gram matrix ``A`` is the small ``r x r`` one with ``r = min(m, n)``.

Two variants of the same maths:

- ``ns_coefficients="polar_express"``: a different ``(a, b, c)`` at every
  iteration, the schedule of Amsel et al. 2025 ("The Polar Express", Algorithm
  1, with its 1.01 safety factor), which lands the singular values much closer
  to 1 in the same 5 steps (`POLAR_EXPRESS_COEFFICIENTS`); ``"turbo_muon"``: the schedule Turbo-Muon pairs
  with AOL preconditioning (`TURBO_MUON_COEFFICIENTS`).
- ``ns_precondition="aol"``: Turbo-Muon's AOL preconditioning (Boissin et al. 2025, arXiv:2512.04632) in
  place of the Frobenius normalisation: with ``A = X X^T`` (the Gram matrix the first iteration needs anyway),
  each row ``i`` of the wide ``X`` is scaled by ``1 / sqrt(sum_j |A_ij|)`` (``X <- D X``, which bounds the
  spectral norm by 1 and brings the small singular values nearer to 1 than the Frobenius norm does), and the
  first iteration reuses ``D A D`` as its Gram matrix: no extra matrix product (`aol_scale`). The paper
  runs it with its own coefficients (``ns_coefficients="turbo_muon"``) for 4 steps instead of 5.
- `gram_newton_schulz`: for a rectangular ``r x k`` matrix (``k`` several times
  ``r``), iterate on the ``r x r`` Gram matrix alone and multiply by the long
  side only at the end: ``4 r^2 k + 16 r^3`` MACs instead of
  ``10 r^2 k + 5 r^3`` for 5 steps (`ns_flops`).

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
    "GRAM_RESTART",
    "NS_COEFFICIENT_SCHEDULES",
    "NS_PRECONDITIONERS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "TURBO_MUON_COEFFICIENTS",
    "aol_scale",
    "coefficient_schedule",
    "gram_newton_schulz",
    "ns_flops",
    "orthogonality_error",
    "singular_value_range",
    "zeropower_via_newtonschulz",
]

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_EPS = 1e-7

Coefficients = tuple[float, float, float]

#: The Polar Express schedule for degree 5 (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932, Algorithm 1):
#: each iteration's minimax-optimal ``(a, b, c)``, the first seven divided by the paper's safety factor
#: (``a / 1.01, b / 1.01^3, c / 1.01^5``); iterations past the end repeat the last one.
_POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_POLAR_EXPRESS_SAFETY = 1.01
POLAR_EXPRESS_COEFFICIENTS: tuple[Coefficients, ...] = tuple(
    (a / _POLAR_EXPRESS_SAFETY, b / _POLAR_EXPRESS_SAFETY**3, c / _POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + _POLAR_EXPRESS_RAW[-1:]

#: Turbo-Muon's schedule (Boissin et al. 2025, arXiv:2512.04632): the five ``(a, b, c)`` its reference code runs
#: after AOL preconditioning (github.com/thib-s/flash-newton-schulz, ``NS_ours``; the same five as dion's
#: Newton-Schulz). That code runs the *last* ``ns_steps`` of them (4 by default: it drops the most aggressive
#: first one, which AOL's better start makes unneeded); `coefficient_schedule` does the same, and repeats the
#: last one past five steps.
TURBO_MUON_COEFFICIENTS: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

#: Named per-iteration schedules ``ns_coefficients`` accepts: ``name -> (coefficients, norm factor)``; the
#: Frobenius norm that scales the input is multiplied by the factor (the paper's safety margin: every
#: singular value starts at most ``1 / 1.01``).
NS_COEFFICIENT_SCHEDULES: dict[str, tuple[tuple[Coefficients, ...], float]] = {
    "polar_express": (POLAR_EXPRESS_COEFFICIENTS, _POLAR_EXPRESS_SAFETY),
    "turbo_muon": (TURBO_MUON_COEFFICIENTS, 1.0),
}
#: The schedules run from their end: ``n <= len`` steps take the last ``n`` (Turbo-Muon's reference code).
_FROM_END = frozenset({"turbo_muon"})

#: What ``ns_precondition`` accepts besides ``None`` (the Frobenius normalisation): ``"aol"`` (`aol_scale`).
NS_PRECONDITIONERS: tuple[str, ...] = ("aol",)

#: `gram_newton_schulz` in a 16-bit dtype re-forms ``X`` from the accumulated product before this iteration
#: (0-based). Without it the product ``Q`` grows to ~500x on small singular values (``a^5``) and its bf16
#: rounding swamps them: measured on spectra decaying to 1e-4, orthogonality errors of 28 to 2909 instead of
#: 0.6; with it, the distance to the float64 iteration is that of the standard bf16 path (tests).
GRAM_RESTART = 2


def coefficient_schedule(
    ns_coefficients: Coefficients | str, ns_steps: int
) -> tuple[list[Coefficients], float]:
    """The ``(a, b, c)`` of each of ``ns_steps`` iterations and the factor on the normalising norm.

    ``ns_coefficients`` is one ``(a, b, c)`` for every iteration (factor 1) or the name of a schedule in
    `NS_COEFFICIENT_SCHEDULES` (``"polar_express"``; ``"turbo_muon"``, whose first ``ns_steps`` are the last
    of its five, `TURBO_MUON_COEFFICIENTS`).
    """
    if isinstance(ns_coefficients, str):
        if ns_coefficients not in NS_COEFFICIENT_SCHEDULES:
            raise ValueError(
                f"ns_coefficients must be three numbers (a, b, c) or one of {sorted(NS_COEFFICIENT_SCHEDULES)}, "
                f"got {ns_coefficients!r}"
            )
        schedule, factor = NS_COEFFICIENT_SCHEDULES[ns_coefficients]
        if ns_coefficients in _FROM_END and ns_steps <= len(schedule):
            return list(schedule[len(schedule) - ns_steps:]), factor
        return [schedule[min(i, len(schedule) - 1)] for i in range(ns_steps)], factor
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}")
    a, b, c = ns_coefficients
    return [(a, b, c)] * ns_steps, 1.0


def _gram_restart(dtype: torch.dtype, ns_steps: int) -> int:
    """`GRAM_RESTART` for 16-bit dtypes; no restart (``ns_steps``) for float32 and wider."""
    return GRAM_RESTART if dtype.itemsize < 4 else ns_steps


def _check_input(G: Tensor, ns_steps: int, ns_precondition: str | None = None) -> None:
    if G.ndim < 2:
        raise ValueError(f"expected a matrix or a stack of matrices (..., m, n), got shape {tuple(G.shape)}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be in [0, 100), got {ns_steps}")
    if ns_precondition is not None and ns_precondition not in NS_PRECONDITIONERS:
        raise ValueError(f"ns_precondition must be None or one of {NS_PRECONDITIONERS}, got {ns_precondition!r}")


def aol_scale(X: Tensor, A: Tensor, *, factor: float = 1.0, eps: float = DEFAULT_EPS) -> tuple[Tensor, Tensor]:
    """AOL preconditioning of a stack of wide matrices ``X`` (``(k, r, n)``, ``r <= n``) given their Gram matrices
    ``A = X X^T`` (``(k, r, r)``): returns ``(D X, D A D)`` with ``D = diag(s) / factor``,
    ``s_i = 1 / sqrt(max(sum_j |A_ij|, eps))``.

    Each row of ``X`` is scaled by one over the square root of its Gram row's absolute sum (Turbo-Muon, Boissin
    et al. 2025, arXiv:2512.04632; the almost-orthogonal layers' rescaling of Prach and Lampert 2022). Every
    singular value of ``D X`` is then at most ``1 / factor`` (Schur's test on ``D A D``: each of its absolute row
    sums is at most 1), and ``D A D`` is its Gram matrix, so the first iteration needs no product of its own.
    The scale is computed in float32 (or ``A``'s dtype where wider) and applied in ``X``'s dtype; a zero row
    stays zero.
    """
    accumulate = torch.promote_types(A.dtype, torch.float32)
    s = A.abs().sum(dim=-1, dtype=accumulate).clamp(min=eps).rsqrt().div(factor).to(X.dtype)
    return X * s.unsqueeze(-1), A * s.unsqueeze(-1) * s.unsqueeze(-2)


def zeropower_via_newtonschulz(
    G: Tensor,
    *,
    ns_coefficients: Coefficients | str = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
    ns_precondition: str | None = None,
) -> Tensor:
    """Approximately orthogonalise every matrix of a stack ``G`` of shape ``(..., m, n)``.

    For ``G = U S V^T`` (its singular value decomposition) the exact answer is ``U V^T``, the nearest
    semi-orthogonal matrix to ``G``: the same singular vectors, every singular value 1. The iteration gets near it
    with matrix products only. Each matrix is taken short side first (transposed when ``m > n``), so that with
    ``r = min(m, n)`` the iterate ``X`` is ``r x max(m, n)``; it is scaled by its Frobenius norm (every singular
    value at most 1), then each of ``ns_steps`` steps computes the ``r x r`` Gram matrix ``A = X X^T`` and

    ```text
    X <- a X + (b A + c A^2) X   =   a X + b (X X^T) X + c (X X^T)^2 X
    ```

    which maps every singular value ``s`` of ``X`` to ``a s + b s^3 + c s^5`` and keeps the singular vectors.
    With the default coefficients 5 steps leave the singular values in about 0.68..1.13, not at 1 (see the
    module's docstring); `orthogonality_error` measures how far.

    Returns a new tensor of ``G``'s shape in ``dtype`` (``G`` is never written).
    On a single 2D matrix in bfloat16 the operations are exactly those of
    ``torch.optim.Muon`` (bit-identical results); a stack runs the same
    iteration with batched matmuls.

    Examples:
        ```python
        import torch
        from lightning_muon import orthogonality_error, zeropower_via_newtonschulz

        torch.manual_seed(0)
        G = torch.randn(64, 256)
        O = zeropower_via_newtonschulz(G, dtype=torch.float32)
        s = torch.linalg.svdvals(O)
        print(f"{s.min():.2f}..{s.max():.2f}, error {orthogonality_error(O):.2f}")  # 0.68..1.13, error 0.38
        ```

    Args:
        G: one matrix ``(m, n)`` or a stack ``(..., m, n)``.
        ns_coefficients: ``(a, b, c)`` of the step ``X <- a X + (b A + c A^2) X`` above, or
            ``"polar_express"`` (one ``(a, b, c)`` per step, Amsel et al. 2025), or ``"turbo_muon"`` (Turbo-Muon's
            five, of which ``n`` steps run the last ``n``).
        ns_steps: number of iterations (``0 <= ns_steps < 100``).
        eps: floor of the Frobenius norm used to normalise each matrix.
        dtype: compute dtype; ``torch.bfloat16`` (fast where the hardware has
            bf16 matmuls) or ``torch.float32``.
        ns_precondition: ``None``: scale by the Frobenius norm. ``"aol"``: Turbo-Muon's AOL scaling instead
            (each row of the wide matrix by one over the square root of its Gram row's absolute sum), its Gram
            matrix reused by the first step (the same matrix products as ``None``); a lone matrix then runs the
            batched kernels (never ``torch.optim.Muon``'s bits). Boissin et al. 2025 pair it with
            ``ns_coefficients="turbo_muon"`` and 4 steps.
    """
    _check_input(G, ns_steps, ns_precondition)
    schedule, factor = coefficient_schedule(ns_coefficients, ns_steps)
    tall = G.size(-2) > G.size(-1)
    # The 2D path normalises in place (as torch does), so it needs its own copy; the batched path's
    # normalisation makes a new tensor anyway.
    X = G.to(dtype, copy=G.ndim == 2 and ns_precondition is None)
    if tall:
        X = X.mT
    if ns_precondition is not None:
        X = _aol_iteration(X.reshape(-1, *X.shape[-2:]), schedule, factor, eps).reshape(X.shape)
    elif X.ndim == 2:
        # Exactly torch.optim.Muon's sequence of kernels, so the 2D path is bit-identical.
        X.div_((X.norm() * factor).clamp(min=eps))  # factor 1.0: exact, the same bits as torch
        for a, b, c in schedule:
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    else:
        batch_shape = X.shape[:-2]
        X = X.reshape(-1, *X.shape[-2:])
        X = X / (X.norm(dim=(-2, -1), keepdim=True) * factor).clamp(min=eps)
        for a, b, c in schedule:
            A = torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
        X = X.reshape(*batch_shape, *X.shape[-2:])
    return X.mT if tall else X


def _aol_iteration(X: Tensor, schedule: list[Coefficients], factor: float, eps: float) -> Tensor:
    """The standard iteration on a wide stack ``(k, r, n)`` after `aol_scale`, the first step on its Gram."""
    A = torch.bmm(X, X.mT)
    X, A = aol_scale(X, A, factor=factor, eps=eps)
    for i, (a, b, c) in enumerate(schedule):
        if i > 0:
            A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def gram_newton_schulz(
    G: Tensor,
    *,
    ns_coefficients: Coefficients | str = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
    restart: int | None = None,
    ns_precondition: str | None = None,
) -> Tensor:
    """The iteration of `zeropower_via_newtonschulz`, run on the short side's Gram matrix.

    With ``X`` oriented ``r x k`` (``r <= k``), every iterate is ``Q X`` for an ``r x r`` polynomial ``Q``
    in ``R = X X^T``: one step with ``P = a I + b R + c R^2`` maps ``Q -> P Q`` and ``R -> P R P``. So only
    ``r x r`` products run inside the loop; ``X`` is touched to form ``R`` and by the final ``Q X``.
    Cheaper when ``k`` is a few times ``r`` (see `ns_flops`); on a square matrix it costs more.

    The result equals the standard iteration's up to rounding (float32: to ~1e-4 relative; bf16: as far from
    the float64 iteration as the standard bf16 path, see the tests). ``restart``: before this iteration
    (0-based) ``X`` is re-formed as ``Q X`` and ``R`` recomputed, so ``Q`` never accumulates more than a few
    iterations' growth; default `GRAM_RESTART` for 16-bit dtypes, none for float32 and wider. Returns a new
    tensor of ``G``'s shape in ``dtype``; arguments as `zeropower_via_newtonschulz` (with
    ``ns_precondition="aol"`` the Gram matrix ``R`` is formed from the unscaled ``X`` and scaled with it,
    `aol_scale`).
    """
    _check_input(G, ns_steps, ns_precondition)
    schedule, factor = coefficient_schedule(ns_coefficients, ns_steps)
    if restart is None:
        restart = _gram_restart(dtype, ns_steps)
    tall = G.size(-2) > G.size(-1)
    X = G.to(dtype)
    if tall:
        X = X.mT
    batch_shape = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])
    if ns_precondition is not None:
        X, R = aol_scale(X, torch.bmm(X, X.mT), factor=factor, eps=eps)
    else:
        X = X / (X.norm(dim=(-2, -1), keepdim=True) * factor).clamp(min=eps)
        R = torch.bmm(X, X.mT)
    Q: Tensor | None = None
    for i, (a, b, c) in enumerate(schedule):
        if i == restart and Q is not None:
            X, Q = torch.bmm(Q, X), None
            R = torch.bmm(X, X.mT)
        P = torch.baddbmm(R, R, R, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else torch.bmm(P, Q)
        if i + 1 < len(schedule) and i + 1 != restart:
            R = torch.bmm(P, torch.bmm(R, P))
    if Q is not None:
        X = torch.bmm(Q, X)
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

    Args:
        O: one matrix ``(m, n)`` or a stack ``(..., m, n)``, such as an orthogonalised update.

    Examples:
        ```python
        import torch
        from lightning_muon import orthogonality_error

        print(orthogonality_error(torch.eye(4)).item())  # 0.0
        print(f"{orthogonality_error(2 * torch.eye(4)):.1f}")  # 3.0: every s^2 - 1 is 3
        ```
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


def ns_flops(
    m: int, n: int, ns_steps: int = DEFAULT_NS_STEPS, gram: bool = False, dtype: torch.dtype = torch.bfloat16
) -> int:
    """Multiply-add FLOPs (2 per MAC) of `zeropower_via_newtonschulz` on one ``m x n`` matrix (of
    `gram_newton_schulz` with ``gram``, in ``dtype``: its default restart depends on it).

    Per iteration, with ``r = min(m, n)`` and ``k = max(m, n)``: the Gram matrix
    ``X X^T`` (``2 r^2 k``), ``A A`` (``2 r^3``) and ``B X`` (``2 r^2 k``). Gram: ``R`` and the final
    ``Q X`` (``2 r^2 k`` each, twice more at a restart), and per iteration ``R R``, ``P Q`` (not on the
    first or a restart iteration) and ``P R P`` (not before the last or a restart iteration), ``2 r^3`` each.
    """
    r, k = min(m, n), max(m, n)
    if not gram:
        return ns_steps * (4 * r * r * k + 2 * r**3)
    restart = _gram_restart(dtype, ns_steps)
    long_side, short_side = 1, 0  # products with X, r x r products
    for i in range(ns_steps):
        if i == restart and i > 0:
            long_side += 2
        short_side += 1 + (i > 0 and i != restart) + 2 * (i + 1 < ns_steps and i + 1 != restart)
    long_side += ns_steps > 0
    return 2 * (long_side * r * r * k + short_side * r**3)
