"""Facts about the *structure* of a wrong output, whatever edit made it wrong.

The fingerprints compare an output with known wrong formulas one by one. These facts hold for
whole classes of mistakes instead, so an edit nobody listed still gets named by what it did:

* ``zero``: the output is exactly 0 (every element, or every element of some heads) -- nothing
  was ever accumulated into it, or the freshly zeroed accumulator was stored;
* ``equals``: it equals (to rounding) another output, another output's right value, or an
  input -- a variable or pointer mixed up;
* ``factor``: it is the right answer times a constant, and which constant (scale, sqrt(D), 2,
  the GQA group size, ...);
* ``first_rows``: only the first block of rows (keys) is right -- the loop or the offsets of
  the later blocks;
* ``kv_heads``: (dQ) each query head's values are those of another K/V head -- the head index;
* ``group``: (dK, dV under GQA) the sum over only some query heads of each group.

:func:`facts` measures them for one failing case; mistakes of :mod:`flashattn.check.mistakes`
(``pinned``, ``memory``, ``outputs``, ``numbers``, ``fallback``) read them.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..verify import per_head_relative_error
from .battery import BLOCKS
from .checkers import AUTOGRAD, BACKWARD, DKDV, DQ

_INPUT_LABELS = {"q": "Q", "k": "K", "v": "V", "do": "dO", "o": "O"}


def _close(a: torch.Tensor, e: torch.Tensor, tol: float) -> bool:
    if a is None or e is None or a.shape != e.shape or not bool(torch.isfinite(a).all()):
        return False
    e = e.to("cpu", torch.float64)
    if float(e.abs().max()) == 0.0:
        return float(a.abs().max()) == 0.0
    a3, e3 = (a, e) if a.dim() >= 3 else (a.reshape(1, 1, -1), e.reshape(1, 1, -1))
    return float(per_head_relative_error(a3, e3).max()) <= max(tol, 1e-6) * 10


def factor_names(case, ratio: float) -> list:
    """The constants ``ratio`` equals (to 1%), named: '-1', 'scale', '1/sqrt(D)', '2', ..."""
    s, D, G = case.scale_value, case.D, max(1, case.H // max(1, case.heads_kv))
    named = [("-1", -1.0), ("2", 2.0), ("1/2", 0.5), ("scale", s), ("1/scale", 1 / s), ("scale^2", s * s),
             ("sqrt(D)", math.sqrt(D)), ("1/sqrt(D)", 1 / math.sqrt(D)), ("D", float(D)), ("1/D", 1.0 / D),
             ("sqrt(D) * scale", math.sqrt(D) * s), ("1 / (sqrt(D) * scale)", 1 / (math.sqrt(D) * s))]
    if G > 1:
        named += [("GROUP_SIZE", float(G)), ("1/GROUP_SIZE", 1.0 / G)]
    # a mean where a sum belongs (or the reverse): a factor of one of the lengths
    for length in dict.fromkeys(n for n in (getattr(case, "S_q", 0), getattr(case, "S_k", 0)) if n and n > 2):
        label = "S_q" if length == case.S_q else "S_k"
        named += [(label, float(length)), (f"1/{label}", 1.0 / length)]
    return [n for n, v in named if abs(ratio / v - 1.0) < 1e-2]


def _zero_heads(a: torch.Tensor, e: torch.Tensor) -> list:
    """Flat (batch, head) indices where ``a`` is all 0 and the reference is not."""
    if a.dim() != 4:
        return []
    az = a.flatten(2).abs().amax(-1).flatten() == 0
    ez = e.to(torch.float64).flatten(2).abs().amax(-1).flatten() > 0
    return [int(i) for i in torch.nonzero(az & ez).flatten()]


def _first_rows(t) -> int:
    """The block b such that rows (keys) below b are right and some at or past b are wrong, 0 if
    none (the largest such block, so 'the first 64' wins over 'the first 32' when both hold)."""
    rows = t.row_err
    if rows.dim() != 1 or rows.numel() < 2:
        return 0
    bad = rows > t.tol
    for b in sorted(BLOCKS, reverse=True):
        if b < rows.numel() and not bool(bad[:b].any()) and bool(bad[b:].any()):
            return b
    return 0


def _kv_head_map(case, x, actual: torch.Tensor, tol: float):
    """[(b, h) -> K/V head m] such that query head h's dQ equals the dQ computed with K/V head m
    (None where no head fits), for a dQ that reads K and V by head index."""
    ref, s = x.ref, case.scale_value
    q = x.q.to(torch.float64)
    k, v = x.k.to(torch.float64), x.v.to(torch.float64)
    visible = torch.isfinite(ref.S)
    out = {}
    for b in range(case.B):
        for h in range(case.H):
            found = None
            for m in range(case.heads_kv):
                S = q[b, h] @ k[b, m].T * s
                P = torch.where(visible[b, h], torch.exp(S - ref.LSE[b, h][:, None]), 0.0)
                dS = P * (ref.dO[b, h] @ v[b, m].T - ref.delta[b, h][:, None])
                if _close(actual[b, h][None, None], (dS @ k[b, m] * s)[None, None], tol):
                    found = m
                    break
            out[(b, h)] = found
    return out


def _group_subsets(case, x, name: str, actual: torch.Tensor, tol: float):
    """Under GQA: for each (b, h_kv), the subset of its group's query heads whose contributions
    add up to ``actual`` (dK or dV), or None."""
    ref, s = x.ref, case.scale_value
    H, Hk = case.H, case.heads_kv
    G = H // Hk
    if name == "dK":
        parts = ref.dS.transpose(-1, -2) @ x.q.to(torch.float64) * s
    else:
        parts = ref.P.transpose(-1, -2) @ ref.dO
    out = {}
    for b in range(case.B):
        for hk in range(Hk):
            found = None
            for n in range(G + 1):
                for sub in itertools.combinations(range(G), n):
                    total = sum((parts[b, hk * G + g] for g in sub), torch.zeros_like(parts[b, 0]))
                    if _close(actual[b, hk][None, None], total[None, None], tol):
                        found = sub
                        break
                if found is not None:
                    break
            out[(b, hk)] = found
    return out


def _head_sets(case, x, name: str, actual: torch.Tensor, tol: float):
    """Under GQA, when no subset of the right group fits: for each (b, h_kv), the GROUP_SIZE
    query heads -- from any group, one head possibly several times -- whose contributions add up
    to ``actual``, or None."""
    ref, s = x.ref, case.scale_value
    G = case.H // case.heads_kv
    q, k, v = (t.to(torch.float64) for t in (x.q, x.k, x.v))
    visible = torch.isfinite(ref.S)

    def part(b, h, hk):   # query head h's share of K/V head hk's dK or dV, read with that head's K, V
        P = torch.where(visible[b, h], torch.exp(q[b, h] @ k[b, hk].T * s - ref.LSE[b, h][:, None]), 0.0)
        if name == "dV":
            return P.T @ ref.dO[b, h]
        dS = P * (ref.dO[b, h] @ v[b, hk].T - ref.delta[b, h][:, None])
        return dS.T @ q[b, h] * s

    out = {}
    for b in range(case.B):
        for hk in range(case.heads_kv):
            parts = [part(b, h, hk) for h in range(case.H)]
            out[(b, hk)] = next((sub for sub in itertools.combinations_with_replacement(range(case.H), G)
                                 if _close(actual[b, hk][None, None], sum(parts[h] for h in sub)[None, None], tol)),
                                None)
    return out


def facts(case, x, tensors: dict, expected: dict, tol: float, checker) -> dict:
    """output name -> {fact: value} for every wrong output of one case (see the module doc)."""
    out = {}
    inputs = {n: getattr(x, n, None) for n in _INPUT_LABELS}
    backward = checker in (BACKWARD, DQ, AUTOGRAD) and getattr(x, "ref", None) is not None \
        and getattr(x.ref, "dS", None) is not None
    for name, t in tensors.items():
        if t.ok or t.actual is None:
            continue
        if not t.finite:
            # NaN in some heads (read past the last K/V head): which K/V head do the others read?
            if backward and name == "dQ" and case.heads_kv != case.H:
                m = _kv_head_map(case, x, t.actual, tol)
                if any(v is not None for v in m.values()):
                    out[name] = {"kv_heads_partial": m}
            continue
        a, e = t.actual, expected[name].detach().to("cpu", torch.float64)
        f = {}
        if float(a.abs().max()) == 0.0 and float(e.abs().max()) > 0.0:
            f["zero"] = True
        else:
            zh = _zero_heads(a, e)
            if zh:
                f["zero_heads"] = zh
            equals = []
            for other, u in tensors.items():
                if other == name or u.actual is None:
                    continue
                if _close(a, u.actual, tol) and float(a.abs().max()) > 0:
                    equals.append(f"your {other}")
                elif _close(a, expected[other].detach().to("cpu", torch.float64), tol):
                    equals.append(f"the right {other}")
            for n, inp in inputs.items():
                if isinstance(inp, torch.Tensor) and _close(a, inp.detach().to("cpu", torch.float64), tol):
                    equals.append(_INPUT_LABELS[n])
            if equals:
                f["equals"] = equals
            if math.isfinite(t.ratio) and t.ratio_resid < 1e-2 and abs(t.ratio - 1) > 2e-2:
                f["factor"] = (t.ratio, factor_names(case, t.ratio))
            b = _first_rows(t)
            if b:
                f["first_rows"] = b
        if backward and name == "dQ" and "zero" not in f and not bool(t.heads_ok.all()):
            m = _kv_head_map(case, x, a, tol)
            if all(v is not None for v in m.values()):
                f["kv_heads"] = m
            elif any(v is not None for v in m.values()):
                f["kv_heads_partial"] = m       # some heads read a K/V head that does not exist
        if backward or checker is DKDV:
            if name in ("dK", "dV") and case.heads_kv != case.H and getattr(x.ref, "dS", None) is not None:
                g = _group_subsets(case, x, name, a, tol)
                if all(v is not None for v in g.values()):
                    f["group"] = g
                else:
                    hs = _head_sets(case, x, name, a, tol)
                    if all(v is not None for v in hs.values()):
                        f["head_sets"] = hs
        if f:
            out[name] = f
    return out


def head_sets_idea(case, name: str, sets: dict) -> str:
    """The query heads each K/V head's ``name`` added up, against its group, and the formula
    that fits."""
    Hk, G = case.heads_kv, case.H // case.heads_kv
    got = [sets[(0, hk)] for hk in range(Hk)]
    right = [tuple(hk * G + g for g in range(G)) for hk in range(Hk)]
    formulas = [(text, f) for text, f in (("g * H_kv + h_kv", lambda hk, g: g * Hk + hk),
                                          ("g * GROUP_SIZE + h_kv", lambda hk, g: g * G + hk),
                                          ("h_kv + g", lambda hk, g: hk + g),
                                          ("h_kv for every g (the K/V head's own index)", lambda hk, g: hk))
                if all(tuple(sorted(f(hk, g) for g in range(G))) == got[hk] for hk in range(Hk))]
    fits = f" That is the map h = {' (or here, the same) '.join(t for t, _ in formulas)}." if formulas else ""
    show = lambda ss: ", ".join(f"K/V head {hk}: query heads {list(s)}" for hk, s in enumerate(ss))  # noqa: E731
    return (f"Your {name} of each K/V head is the sum over another set of query heads ({show(got)}; "
            f"in '{case.name}', batch 0) than its group ({show(right)}).{fits} The group of K/V head "
            f"h_kv is the GROUP_SIZE consecutive query heads h = h_kv * GROUP_SIZE + g, g = 0 ... "
            f"GROUP_SIZE - 1, the inverse of h_kv = h // GROUP_SIZE.")
