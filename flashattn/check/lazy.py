"""The lazy-attention exercise's checker (solutions/07): a learner's one-head backward.

``fn(q, k, v, bias, tau, do, scale) -> (dq, dk, dv, dbias, dtau)`` gets one head in float64
(q, k, v, do ``[L, D]``, bias ``[W+1]``, tau a 0-d tensor). The cases -- a window of 0, a window
longer than the sequence, tau positive and negative (sparse rows) -- run every head, and the
results go through the same table and diagnosis as the other checkers, with the classic lazy
mistakes as fingerprints (``fingerprints.lazy_variants``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .battery import Case
from .diagnose import ShapeError
from .fingerprints import lazy_variants
from .runner import run_battery


@dataclass(frozen=True)
class LazyCase(Case):
    W: int = 0
    taus: tuple = ()


def _lazy_case(L, D, W, taus) -> LazyCase:
    return LazyCase(f"L={L} W={W} tau={','.join(f'{t:g}' for t in taus)}", 1, len(taus), L, L, D, True,
                    W=W, taus=tuple(taus))


#: several heads with their own bias and tau each
LAZY_CASES = (
    _lazy_case(13, 8, 4, (0.3, -0.4, 1.5)),
    _lazy_case(9, 8, 0, (0.5, -0.2)),          # W = 0: only the main diagonal is biased
    _lazy_case(7, 8, 12, (0.0, -2.0)),         # W >= L; tau strongly negative: sparse rows
)

NAMES = ("dQ", "dK", "dV", "dBias", "dTau")


def _make(case: LazyCase, dtype, device, seed, with_do):
    from ..lazy.reference import lazy_backward_formulas, lazy_gradients_autograd

    g = torch.Generator().manual_seed(seed + 1000 * case.S_q + case.W)
    H, L, D = case.H, case.S_q, case.D
    q, k, v, do = (torch.randn(1, H, L, D, generator=g, dtype=torch.float64) for _ in range(4))
    bias = torch.randn(H, case.W + 1, generator=g, dtype=torch.float64)
    tau = torch.tensor(case.taus, dtype=torch.float64)
    scale = 1.0 / math.sqrt(D)
    ref = lazy_gradients_autograd(q, k, v, bias, tau, do, scale=scale)
    f = lazy_backward_formulas(q, k, v, bias, tau, do, scale=scale)
    return SimpleNamespace(q=q, k=k, v=v, do=do, bias=bias, tau=tau, scale=scale, ref=ref,
                           formulas={n: t[0] if t.dim() >= 3 and t.shape[0] == 1 else t for n, t in f.items()})


def lazy_backward(fn, *, seed: int = 0, raise_on_fail: bool = True, show: bool = True, verbose=None):
    """Check a one-head lazy-attention backward against autograd, head by head.

    ``fn(q, k, v, bias, tau, do, scale) -> (dq, dk, dv, dbias, dtau)`` with q, k, v, do
    ``[L, D]``, bias ``[W+1]``, tau a 0-d tensor, all float64. (``verbose`` is accepted for
    old notebooks and ignored: a pass prints one line.)
    """
    def run_case(case, x):
        per_head = []
        for h in range(case.H):
            got = fn(x.q[0, h], x.k[0, h], x.v[0, h], x.bias[h], x.tau[h], x.do[0, h], x.scale)
            if not isinstance(got, (tuple, list)) or len(got) != 5:
                raise ShapeError(f"fn must return a tuple (dq, dk, dv, dbias, dtau), got {type(got).__name__}")
            per_head.append([torch.as_tensor(t, dtype=torch.float64) for t in got])
        outs = {}
        for j, name in enumerate(NAMES):
            parts = [p[j] for p in per_head]
            shapes = {tuple(t.shape) for t in parts}
            if len(shapes) != 1:
                raise ShapeError(f"{name} has different shapes for different heads: {sorted(shapes)}")
            stacked = torch.stack(parts)
            outs[name] = stacked[None] if name in ("dQ", "dK", "dV") else stacked
        expected = {"dQ": x.ref["dQ"], "dK": x.ref["dK"], "dV": x.ref["dV"],
                    "dBias": x.ref["dBias"], "dTau": x.ref["dTau"]}
        return outs, expected, {}

    def variants(case, x):
        v = lazy_variants(x.formulas, x.q[0], x.k[0], x.v[0], x.bias, x.tau, x.do[0], x.scale)
        return {n: {t: (val[None] if t in ("dQ", "dK", "dV") else val) for t, val in outs.items()}
                for n, outs in v.items()}

    return run_battery("check.lazy_backward", fn, LAZY_CASES, run_case, kind="lazy",
                       dtype=torch.float64, seed=seed, with_do=True, raise_on_fail=raise_on_fail,
                       show=show, variants=variants, make=_make, tol=1e-8)
