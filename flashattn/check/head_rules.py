"""The diagnoses of grouped-query attention's head bookkeeping: a grid with a program per query
head where one per K/V head belongs (or too few programs), and a head index that maps query heads
to the wrong K/V heads -- named with the map the outputs show. Tried after the batch and
head-dim mistakes, before the strides (stage "a pattern that pins the cause" of
:mod:`flashattn.check.checkers`)."""
from __future__ import annotations

from typing import Optional

import torch

from .engine import PINNED, mistake
from .evidence import exactly as _exactly


def _values_right(ctx) -> bool:
    """Every head's values right in every failing case: only memory (reads or writes past the
    end, a guard touched) failed."""
    return bool(ctx.failing) and all(bool(t.heads_ok.all()) and t.unwritten == 0
                                     for r in ctx.failing for t in r.tensors.values())


@mistake("gqa_grid", PINNED, "the grid has a program per query head where one per K/V head belongs",
         "With GQA a dK/dV program owns one K/V head and loops over the query heads of its group: "
         "the grid's second axis is B * H_kv. Programs for heads that do not exist read and write "
         "past the end of the tensors (the values themselves came out right).")
def _gqa_grid(ctx):
    if _exactly(ctx, "gqa") and _values_right(ctx):
        past = [r for r in ctx.failing if r.oob_reads or any(t.guard_touched for t in r.tensors.values())]
        if past:
            return f"{ctx.case_pattern()}; every value right, but memory past the end read or written in {ctx.names_of(past)}"
    return None


def _unwritten_heads(t) -> Optional[list]:
    """The (b, h) heads of output ``t`` that were never written at all (every element still NaN,
    the poison counted) while every other head is right; None if that is not the picture."""
    a = t.actual
    if a is None or a.dim() != 4 or not t.unwritten:
        return None
    dead = ~torch.isfinite(a).flatten(2).any(-1)                       # [B, H]: no element written
    if not bool(dead.any()) or not bool((dead | t.heads_ok).all()):
        return None
    return [int(i) for i in torch.nonzero(dead.flatten()).flatten()]


@mistake("grid_heads", PINNED, "the grid has too few programs along its (batch, head) axis",
         "Whole heads were never written, and only under GQA: the grid's second axis counts the "
         "K/V heads (B * H_kv) where this kernel has one program per query head (B * H). The "
         "programs that exist compute their heads right; the heads of the missing programs keep the "
         "poison.")
def _grid_heads(ctx):
    if not _exactly(ctx, "gqa"):
        return None
    seen = []
    for r in ctx.failing:
        for t in r.bad():
            dead = _unwritten_heads(t)
            if dead is None:
                return None
            B, H = t.actual.shape[:2]
            first = B * r.case.heads_kv
            if dead != list(range(first, B * H)):
                return None
            seen.append((r, t, first, B * H))
    r, t, first, total = seen[0]
    return (f"in '{r.case.name}' the (batch, head) pairs {first}-{total - 1} of {t.name} were never written "
            f"and pairs 0-{first - 1} are right: {first} = B * H_kv programs ran where B * H = {total} belong; "
            f"{ctx.case_pattern()}")


@mistake("group_factor", PINNED, "dK and dV are off by the group's size: averaged over the group, not summed",
         "A K/V head serves GROUP_SIZE query heads, and its gradient is the *sum* of their "
         "contributions: dK = sum over g of dS_g^T Q_g * scale, dV = sum of P_g^T dO_g. Dividing by "
         "GROUP_SIZE (an average) or adding each twice scales them by a constant; with one query head "
         "per K/V head (H_kv = H) the two agree, which is why those cases pass.")
def _group_factor(ctx):
    if not _exactly(ctx, "gqa"):
        return None
    seen = []
    for r in ctx.failing:
        for t in r.bad():
            ratio, names = r.structure.get(t.name, {}).get("factor", (None, []))
            if not ({"GROUP_SIZE", "1/GROUP_SIZE"} & set(names)) or t.name not in ("dK", "dV"):
                return None
            seen.append(f"{t.name} = {ratio:.3g} x the right one in '{r.case.name}' (GROUP_SIZE "
                        f"{r.case.H // r.case.heads_kv})")
    return f"{'; '.join(seen[:2])}; {ctx.case_pattern()}" if seen else None


@mistake("gqa", PINNED, "a head index is wrong under grouped-query attention",
         "With GQA, query head h reads K/V head h // GROUP_SIZE (h_kv); Q, dO, LSE, delta and dQ "
         "belong to the query head h, K, V, dK and dV to h_kv. A dK/dV program loops over the query "
         "heads of its group (h = h_kv * GROUP_SIZE + g) and adds up all their contributions.")
def _gqa(ctx):
    if ctx.failing and set.intersection(*(set(r.fingerprints) for r in ctx.failing)):
        return None                                       # a fingerprint rule names it exactly
    if not _exactly(ctx, "gqa"):
        return None
    evidence = f"{ctx.case_pattern()}; {ctx.tensor_pattern()}"
    own = _kv_read_with_h(ctx)
    if own:
        return f"{own}; {evidence}", ("K and V are offset with the query head h, where their own head "
                                      "h_kv = h // GROUP_SIZE belongs: K, V (and dK, dV) have H_kv heads, "
                                      "Q, dO, LSE, delta and dQ have H. Query heads h >= H_kv then read "
                                      "past the last K/V head.")
    for r in ctx.failing:      # dK/dV summed another set of query heads: the map is in the evidence
        for name in ("dK", "dV"):
            sets = r.structure.get(name, {}).get("head_sets")
            if sets:
                return evidence, _head_sets_idea(r.case, name, sets)
    return evidence


def _kv_read_with_h(ctx) -> Optional[str]:
    """Evidence that dQ's query head h read K/V head h: every head whose K/V head was found
    read head h itself, and no K/V head was found for exactly the heads h >= H_kv."""
    seen = []
    for r in ctx.failing:
        f = r.structure.get("dQ", {})
        m = f.get("kv_heads") or f.get("kv_heads_partial")
        if not m:
            return None
        for (b, h), kv in m.items():
            if (kv is None) != (h >= r.case.heads_kv) or (kv is not None and kv != h):
                return None
        seen.append(r)
    r = seen[0]
    G = r.case.H // r.case.heads_kv
    return (f"in '{r.case.name}' dQ of query head h equals what K/V head h gives for h < H_kv = {r.case.heads_kv}, "
            f"where h // {G} belongs; heads {r.case.heads_kv}-{r.case.H - 1} match no K/V head (their K/V lies "
            f"past the tensor's last head)")


def _head_sets_idea(case, name: str, sets: dict) -> str:
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
