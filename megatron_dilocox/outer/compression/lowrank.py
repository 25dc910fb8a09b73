"""PowerSGD pieces: orthonormalization, reconstruction, warm-start factors, adaptive rank.

One round for a matrix ``M`` (m x n) of every cluster k, with a warm-start ``Q`` (n x r) that is
identical on all ranks::

    P_k = M_k Q                 local matmul      -> exchange, P = sum_k P_k (cluster order)
    P^  = orthonormalize(P)     shared, bit-identical on every rank
    Q_k = M_k^T P^              local matmul      -> exchange, Q = sum_k Q_k (cluster order)
    M^  = P^ (Q / C)^T          shared, bit-identical: the mean projected onto span(P^)

The next round starts from ``orthonormalize(Q / C)``. Rank r <= min(m, n); an M of rank <= r is
reproduced exactly (up to fp32 rounding) because span(M Q) = span(M) for a generic Q.

**Why the shared steps agree bit for bit, on any device.** Only the local matmuls may use BLAS
(their result is sent as bytes, and every rank decodes the same bytes). Every step whose output
must match across ranks is built from elementwise IEEE-754 operations, each exactly rounded
(add, sub, mul, true division by a tensor, sqrt), applied in an order fixed by this code:
dot products are pairwise tree sums (:func:`tree_sum`), ``P^ Q^T`` is accumulated one rank-1
term at a time (:func:`reconstruct`), random starts come from integer draws of a seeded CPU
generator. BLAS (and LAPACK QR) results depend on blocking, thread count and instruction set,
so ``torch.linalg.qr`` would agree only between identical machines; this does not need that.
"""
from __future__ import annotations

import hashlib

import torch


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` by pairwise halving: a fixed order of exactly rounded adds."""
    x = x.movedim(dim, 0)
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        head = x[:half] + x[half: 2 * half]
        x = torch.cat([head, x[2 * half:]]) if x.shape[0] % 2 else head
    return x[0]


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning those of ``p`` (..., m, r), deterministically.

    Classical Gram-Schmidt applied twice per column ("twice is enough" for orthogonality to
    working precision), in fp64, from tree-sum dot products. A column that is exactly dependent
    (zero after projection) comes out zero, which drops it from the projection; NaN/inf inputs
    give NaN outputs.

    Returns:
        Same shape and dtype as ``p``.
    """
    a = p.double()
    cols: list[torch.Tensor] = []
    for j in range(a.shape[-1]):
        v = a[..., j]
        for _ in range(2 if cols else 0):
            basis = torch.stack(cols, dim=-1)  # (..., m, j)
            coef = tree_sum(basis * v.unsqueeze(-1), dim=-2)  # (..., j)
            v = v - tree_sum(basis * coef.unsqueeze(-2), dim=-1)
        norm = torch.sqrt(tree_sum(v * v, dim=-1)).unsqueeze(-1)
        # Division by a tensor (not a Python scalar) is true IEEE division on every device.
        cols.append(torch.where(norm == 0, torch.zeros_like(v), v / norm))
    if not cols:
        return p.clone()
    return torch.stack(cols, dim=-1).to(p.dtype)


def reconstruct(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = p @ q.T`` for p (m, r), q (n, r), summing the r rank-1 terms in order.

    Each term is one exactly rounded multiply and one add (separate kernels, so no fused
    multiply-add can change the rounding): identical bits on every device. On the CPU the rows
    go in chunks of about 1 MiB so the running sum stays in cache.
    """
    m, n = out.shape
    if p.shape[1] == 0:
        return out.zero_()
    rows = m if out.is_cuda else max(1, (1 << 18) // max(n, 1))
    qt = q.T.contiguous()
    term = torch.empty(min(rows, m), n, dtype=out.dtype, device=out.device)
    for start in range(0, m, rows):
        o, pc = out[start: start + rows], p[start: start + rows]
        t = term[: o.shape[0]]
        torch.mul(pc[:, :1], qt[0], out=o)
        for j in range(1, p.shape[1]):
            torch.mul(pc[:, j: j + 1], qt[j], out=t)
            o.add_(t)
    return out


def column_energy(q: torch.Tensor) -> list[float]:
    """Squared column norms of ``q`` (n, r), deterministically (fp64 tree sums)."""
    qd = q.double()
    return tree_sum(qd * qd, dim=0).tolist()


def random_columns(n: int, k: int, *key: int) -> torch.Tensor:
    """(n, k) fp64 uniform integers from a CPU generator seeded by ``key``: same on every rank."""
    seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(seed >> 1)
    return torch.randint(-(2 ** 20), 2 ** 20 + 1, (n, k), generator=g, dtype=torch.int64).double()


def choose_rank(energies: list[float], current: int, min_rank: int, max_rank: int,
                energy: float, outside: float) -> tuple[int, list[int], float]:
    """Adaptive rank of one matrix for the next round, from this round's shared spectrum.

    ``energies`` are the squared norms of the reduced ``Q`` columns: the energy of the mean
    pseudo-gradient along each direction of ``P^`` (its squared singular values once the warm
    -started power iteration has converged). The window of ``current`` directions cannot see
    energy beyond it, so ``outside`` remembers, as a ratio to the window's energy, what the last
    shrink dropped; the total is ``sum(energies) * (1 + outside)`` (at ``max_rank`` the window
    is the whole universe and ``outside`` is 0). Rule:

    * keep the smallest k whose top-k energy is ``>= energy * total``, not below ``min_rank``;
    * if even the whole window falls short (only after a shrink, when the spectrum flattened),
      grow by one, assuming the next direction carries as much as the window's weakest.

    A shrink records what it dropped in ``outside``, so the smaller window is judged against
    the same total and the rank does not keep shrinking (or oscillate) on an unchanged spectrum.
    ``outside`` is only updated on a change of rank: a spectrum that flattens later is noticed
    once the kept window itself falls short.

    Args:
        energies: per-column energies of the current window (python floats, shared).
        current: the rank this round ran at (``len(energies)``).
        min_rank, max_rank: bounds (``min_rank <= max_rank``).
        energy: fraction of the energy to keep, in (0, 1].
        outside: energy beyond the window as a ratio to the window's, from the last decision.

    Returns:
        ``(rank, keep, outside)``: the next rank, the columns of this round's Q to warm-start
        it from (strongest first; fewer than ``rank`` when growing), the new ``outside``.
    """
    order = sorted(range(len(energies)), key=lambda j: (-energies[j], j))
    e = [energies[j] for j in order]
    kept = sum(e)
    if current >= max_rank:
        outside = 0.0
    total = kept * (1.0 + outside)
    if not total > 0:  # zero or non-finite spectrum: nothing to learn from
        return current, order, outside
    prefix, k = 0.0, None
    for i, v in enumerate(e, 1):
        prefix += v
        if prefix >= energy * total:
            k = i
            break
    if k is None:
        if current >= max_rank:
            return current, order, 0.0
        guess = e[-1]
        return current + 1, order, max(total - kept - guess, 0.0) / (kept + guess)
    new = max(k, min_rank)
    if new >= current:
        return current, order, outside
    keep_energy = sum(e[:new])
    return new, order[:new], (total - keep_energy) / keep_energy
