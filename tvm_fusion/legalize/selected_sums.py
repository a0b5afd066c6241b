"""Sums of a few terms with literal coefficients, one per case of some index expressions, as TE.

Why: the Winograd and Strassen legalizations write small linear transforms (matrix entries that
are mostly 0 and ±1) as one expression per case, selected by the block's iteration indices; once
the schedule unrolls those loops the selection folds to one case, and no multiply by 0 or 1 is
ever computed.
"""

from __future__ import annotations

import functools

from tvm import tirx


def weighted_sum(terms, dtype):
    """Σ coef · value over the terms with a non-zero coefficient (±1 without a multiply)."""
    total = None
    for coef, value in terms:
        if coef == 0:
            continue
        if coef == 1:
            term = value
        elif coef == -1:
            term = -value
        else:
            term = value * tirx.const(float(coef), dtype)
        total = term if total is None else total + term
    return tirx.const(0.0, dtype) if total is None else total


def select_case(index_vars, cases: dict):
    """``cases[(i, j)]`` for the (constant) values of the index expressions, as a Select chain
    that folds to one case once the indices are constants (unrolled loops)."""
    keys = list(cases)
    expr = cases[keys[-1]]
    for key in reversed(keys[:-1]):
        cond = functools.reduce(tirx.all, [v == k for v, k in zip(index_vars, key)])
        expr = tirx.Select(cond, cases[key], expr)
    return expr


def selected_sums(index_vars, keys, terms, dtype):
    """``Σ terms(*key)`` for the key the index expressions equal: every transform stage is one
    weighted sum per case (matrix entry), chosen by :func:`select_case`."""
    return select_case(index_vars, {key: weighted_sum(terms(*key), dtype) for key in keys})
