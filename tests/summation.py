"""How far apart two fp32 sums of the same terms can be when only their order differs.

Gradients and losses of a data-parallel step are sums over examples: each device sums its own
examples inside its GEMMs and reductions, then a collective sums the devices' parts in an order
of its own (XLA:CPU within a process, gloo between processes, another device count on another
mesh). Any order of adding ``m`` fp32 terms ``t_i`` lands within ``gamma(m - 1) * sum |t_i|`` of
the exact sum (Higham, *Accuracy and Stability of Numerical Algorithms*, 4.2; recursive
summation with or without FMA, pairwise and blocked orders included), so two such sums are at
most twice that apart. The terms are the per-example contributions, computed one example at a
time; scaling by the powers of two of a mean over devices and examples is exact.
"""

from __future__ import annotations

import numpy as np

UNIT_ROUNDOFF = 2.0**-24  # fp32, round to nearest


def gamma(k: int) -> float:
    """``k u / (1 - k u)``: the relative error bound of ``k`` fp32 additions."""
    return k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)


def order_bound(terms) -> np.ndarray:
    """``terms [m, ...]`` -> the largest difference, per element, between two fp32 sums of the
    ``m`` terms in different orders."""
    terms = np.asarray(terms, np.float64)
    return 2 * gamma(terms.shape[0] - 1) * np.abs(terms).sum(0)


def assert_within_order_bound(a, b, terms, what: str) -> None:
    """``a`` and ``b`` (two sums of ``terms [m, ...]``) differ by at most ``order_bound``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    bound = order_bound(terms)
    excess = np.abs(a - b) - bound
    assert (excess <= 0).all(), (
        f"{what}: {int((excess > 0).sum())} elements differ by more than the summation-order bound "
        f"(worst |a - b| = {np.abs(a - b).max():.3g} against a bound of {bound.reshape(-1)[np.argmax(excess)]:.3g})"
    )
