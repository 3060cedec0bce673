"""Diagnoses from the *structure* of the outputs (:mod:`flashattn.check.structure`), whatever
edit made them wrong: an output never stored, exactly zero, equal to another tensor, a constant
multiple of the right one, right only in its first block, reading another K/V head; NaN only
under the causal mask (+inf scores); a grid sized by the other length.

These mistakes name a class of mistake, so they must not take a case from one that names the
mistake itself: each sits in the checkers' order (checkers.py) where everything more specific
has been tried.
"""
from __future__ import annotations

import math

import torch

from .battery import BLOCKS
from .engine import FALLBACK, MEMORY, NUMBERS, OUTPUTS, PINNED, mistake
from .evidence import ranges

def _facts(r, name: str) -> dict:
    return r.structure.get(name, {})


def _heads_text(case, idx) -> str:
    return ", ".join(f"({i // case.H},{i % case.H})" for i in idx[:8]) + (", ..." if len(idx) > 8 else "")


# --------------------------------------------------------------------------------------
# memory: an output never stored at all
# --------------------------------------------------------------------------------------
@mistake("never_stored", MEMORY, "an output is never written at all: its store is missing or goes elsewhere",
         "Not one element of this output was written, in any case: the kernel has no store for it, "
         "or the store goes through another output's pointer (DV where DK belongs: the other output "
         "then keeps whichever store came last), or the launcher writes into a tensor of its own "
         "instead of the one it was given. Each output is stored once, through its own pointer with "
         "its own strides.")
def _never_stored(ctx):
    names = [n for n in ctx.names
             if all(r.tensors[n].actual is not None and r.tensors[n].unwritten == r.tensors[n].actual.numel()
                    for r in ctx.ran if n in r.tensors)]
    if not names or not ctx.ran:
        return None
    holders = sorted({o for r in ctx.failing for o, f in r.structure.items()
                      for label in f.get("equals", ()) if label in (f"the right {n}" for n in names)})
    extra = f"; {', '.join(holders)} holds the right {' and '.join(names)} instead" if holders else ""
    return (f"{' and '.join(names)} never written, in any element, in all {len(ctx.ran)} cases that ran{extra}; "
            f"{ctx.tensor_pattern()}")


# --------------------------------------------------------------------------------------
# the head index
# --------------------------------------------------------------------------------------
@mistake("kv_head", PINNED, "query heads read the wrong K/V head: the K/V head index is wrong",
         "Query head h belongs to K/V head h // GROUP_SIZE (GROUP_SIZE = H / H_kv; without GQA, "
         "the same h): K, V (and in a dK/dV program, dK and dV) are offset with that head, Q, dO, LSE, "
         "delta and dQ with h. Your dQ of each query head equals what another K/V head gives "
         "(the map is in the evidence).")
def _kv_head(ctx):
    hits, others = [], []
    for r in ctx.failing:
        m = _facts(r, "dQ").get("kv_heads")
        G = r.case.H // r.case.heads_kv
        # the right map found means dQ is close to right, head by head: not a head index (rounding?)
        wrong_map = m and any(k != right_kv for (_, h), k in m.items() for right_kv in [h // G])
        (hits if wrong_map else others).append((r, m))
    # a head index past H_kv reads past the end of K and V: those cases show no map (a GPU
    # records no loads, but the NaN-origin search names K or V)
    if not hits or any(not _reads_past_kv(r) and not r.wild for r, _ in others):
        return None
    r, m = hits[0]
    c = r.case
    G = c.H // c.heads_kv
    got = [m[(0, h)] for h in range(c.H)]
    right = [h // G for h in range(c.H)]
    guesses = []
    for rr, mm in hits:
        cc = rr.case
        g = cc.H // cc.heads_kv
        seen = [mm[(0, h)] for h in range(cc.H)]
        guesses.append({name for name, f in (("h % GROUP_SIZE", lambda h: h % g), ("h % H_kv", lambda h: h % cc.heads_kv),
                                             ("h // H_kv (GROUP_SIZE is H // H_kv, not H_kv)", lambda h: h // cc.heads_kv),
                                             ("0 for every head", lambda h: 0), ("h * GROUP_SIZE", lambda h: h * g))
                        if all(f(h) == seen[h] for h in range(cc.H))})
    common = set.intersection(*guesses) if guesses else set()
    # the most telling formula first: a GROUP_SIZE of H_kv also sends every head to 0 when H = H_kv
    ranked = sorted(common, key=lambda n: (not n.startswith("h // H_kv"), n))
    fits = f"; it fits h_kv = {ranked[0]} in every such case" if common else ""
    past = f"; in {len(others)} more case(s) loads ran past the end of K/V (a head index >= H_kv)" if others else ""
    return (f"in '{c.name}' (H={c.H}, H_kv={c.heads_kv}) query heads 0-{c.H - 1} read K/V heads {got}, "
            f"not {right}{fits}{past}")


def _reads_past_kv(r) -> bool:
    seen = r.oob_reads or r.nan_from
    return bool(seen) and set(seen) <= {"k", "v"}


# --------------------------------------------------------------------------------------
# a grid (or loop) sized by the other length
# --------------------------------------------------------------------------------------
@mistake("grid_length", MEMORY, "the grid (or a loop) is sized by the other length: the last blocks get no program",
         "A dK/dV program owns a block of keys: the grid's first axis is cdiv(S_k, BLOCK_N). A dQ "
         "program owns a block of query rows: cdiv(S_q, BLOCK_M). Sized by the other length, the "
         "blocks past it are never visited where that length is the smaller (and the extra programs "
         "are masked off where it is the larger, which is why those cases pass).")
def _grid_length(ctx):
    if not ctx.failing:
        return None
    seen = None
    for r in ctx.failing:
        c = r.case
        hits = False
        for t in r.bad():
            if not t.unwritten:
                return None
            keys = t.name in ("dK", "dV")
            own, other = (c.S_k, c.S_q) if keys else (c.S_q, c.S_k)
            fits = [b for b in BLOCKS if other < own and -(-other // b) * b < own
                    and t.bad_rows() == list(range(-(-other // b) * b, own))]
            if not fits:
                return None
            hits = True
            seen = seen or (r, t, fits[-1], "S_q" if keys else "S_k")
        if not hits:
            return None
    r, t, b, length = seen
    what = "keys" if t.name in ("dK", "dV") else "rows"
    return (f"in '{r.case.name}' (S_q={r.case.S_q}, S_k={r.case.S_k}) {what} {ranges(t.bad_rows())} of {t.name} never "
            f"written: everything from cdiv({length}, {b}) * {b} on -- a grid of cdiv({length}, {b}) blocks; "
            f"{ctx.case_pattern()}")


# --------------------------------------------------------------------------------------
# exactly zero, equal to another tensor
# --------------------------------------------------------------------------------------
def _zero_like(r, t) -> str:
    """How output t of case r is 'nothing accumulated': '' if it is not."""
    f = _facts(r, t.name)
    if f.get("zero"):
        return "exactly 0"
    zh = f.get("zero_heads")
    if zh and all(bool(ok) or i in zh for i, ok in enumerate(t.heads_ok.flatten().tolist())):
        return f"exactly 0 in (batch, head) {_heads_text(r.case, zh)}, right in the others"
    g = f.get("group")
    if g:
        G = r.case.H // r.case.heads_kv
        subs = sorted({s for s in g.values()})
        return f"the sum over query heads {', '.join(str(list(s)) for s in subs)} of each group of {G} only"
    return ""


@mistake("output_zero", OUTPUTS, "an output is exactly zero: nothing was accumulated into it",
         "Exactly 0 is what an accumulator holds when nothing was ever added to it: a loop that runs "
         "no iteration (a bound of 0, range(GROUP_SIZE - 1) when GROUP_SIZE is 1, a start past the "
         "end), `acc + x` computed but never assigned, the accumulator stored before the loop, or "
         "another (zeroed) variable stored. Zero in some heads only: those heads' loop or grid never "
         "reaches them. Under GQA a sum over only part of each group is the same mistake in the loop "
         "over the group.")
def _output_zero(ctx):
    if not ctx.failing:
        return None
    found, full = [], False
    for r in ctx.failing:
        bad = r.bad()
        if not bad:
            return None
        for t in bad:
            how = _zero_like(r, t)
            if not how:
                return None
            full |= how.startswith("exactly 0")
            found.append((r, t, how))
    if not full:
        return None
    first = {}
    for r, t, how in found:
        first.setdefault((t.name, how.split(" in ")[0] if how.startswith("exactly") else "group"), (r, how))
    parts = [f"{name} {how} in '{r.case.name}'" for (name, _), (r, how) in list(first.items())[:4]]
    return f"{'; '.join(parts)}; {ctx.tensor_pattern()}"


@mistake("equals_output", OUTPUTS, "an output equals another tensor: a variable or pointer is mixed up",
         "This output holds, to rounding, the values of another tensor (named in the evidence): "
         "the wrong variable returned or stored, a store through another output's pointer, an input "
         "passed through, or a copy made before the value was computed. Each output gets its own "
         "accumulator, its own pointer and its own strides.")
def _equals_output(ctx):
    if not ctx.failing:
        return None
    common = {}
    for r in ctx.failing:
        for t in r.bad():
            labels = set(_facts(r, t.name).get("equals", ()))
            if not labels:
                return None
            common[t.name] = common.get(t.name, labels) & labels
    if not all(common.values()):
        return None
    said = "; ".join(f"{n} equals {' and '.join(sorted(ls))}" for n, ls in common.items())
    return f"{said}, in all {len(ctx.failing)} failing cases; {ctx.tensor_pattern()}"


# --------------------------------------------------------------------------------------
# NaN only under the causal mask
# --------------------------------------------------------------------------------------
@mistake("mask_plus_inf", OUTPUTS, "hidden scores are set to +inf: the minus sign of -inf is missing",
         "Hidden keys must get the score -inf, so that exp gives exactly 0. With +inf, P is inf "
         "exactly at the hidden keys (and everything computed from it inf or NaN); the cases "
         "without the mask stay right.")
def _mask_plus_inf(ctx):
    if not ctx.failing or not all(r.case.causal for r in ctx.failing):
        return None
    for r in ctx.failing:
        t = r.tensors.get("P")
        if t is None or t.actual is None or t.actual.dim() != 4 or t.unwritten:
            return None
        c = r.case
        hidden = ~torch.ones(c.S_q, c.S_k, dtype=torch.bool).tril()
        if not (bool((t.actual[..., hidden] == math.inf).all()) and bool(torch.isfinite(t.actual[..., ~hidden]).all())):
            return None
    return f"P is +inf at exactly the hidden keys (j > i), finite elsewhere, in every failing case; {ctx.case_pattern()}"


# --------------------------------------------------------------------------------------
# a constant factor; only the first block right
# --------------------------------------------------------------------------------------
@mistake("factor", NUMBERS, "the error is a constant factor",
         "Each wrong output is the right one times one constant (named in the evidence, with the "
         "quantities it equals). Whole numbers: a contribution added more than once (a block or a "
         "head visited twice); scale, 1/scale, sqrt(D), 1/D: a factor of the scale applied twice, "
         "missing, or of the wrong value; GROUP_SIZE: a sum over the group where one head's share "
         "belongs, or the reverse; S_q or S_k (lesson 07's L): a mean over the rows or keys where "
         "their sum belongs (.mean() for .sum()), or the reverse.")
def _factor(ctx):
    seen, ratios = [], {}
    for r in ctx.failing:
        bad = r.bad()
        if not bad:
            return None
        for t in bad:
            f = _facts(r, t.name).get("factor")
            if f is None:
                return None
            seen.append((r, t, f))
            ratios.setdefault(t.name, []).append(f[0])
    if not seen:
        return None
    # named constants, or one unnamed constant the same in every case
    for r, t, (ratio, names) in seen:
        if not names and max(ratios[t.name]) / min(ratios[t.name]) > 1.01:
            return None
    parts = []
    for name in ratios:
        r, t, (ratio, names) = next(s for s in seen if s[1].name == name)
        what = f" (= {' = '.join(names)})" if names else ""
        parts.append(f"{name}: yours / reference = {ratio:.4g}{what} in '{r.case.name}'")
    evidence = "; ".join(parts) + f"; {ctx.tensor_pattern()}"
    if all({"1/S_q", "1/S_k"} & set(names) for _, _, (_, names) in seen):
        wrong = sorted(ratios)
        return evidence, (f"{' and '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} divided by a length: a "
                          f"mean where the sum belongs (.mean() for .sum()). A gradient adds up every "
                          f"contribution -- over the query rows for a parameter shared by them all -- and "
                          f"dividing by their number gives 1/S_q (or 1/S_k) of it.")
    return evidence


@mistake("first_block_only", FALLBACK, "only the first block of rows (keys) is right",
         "Every wrong output is right in its first block of rows (of keys, for dK and dV) and wrong "
         "after it: the later blocks are reached with the wrong offsets (the block's start from the "
         "program id or the loop variable, times the block size, times the row stride), or are not "
         "visited, or receive the first block's values.")
def _first_block_only(ctx):
    seen = []
    for r in ctx.failing:
        bad = r.bad()
        if not bad:
            return None
        for t in bad:
            b = _facts(r, t.name).get("first_rows")
            if not b:
                return None
            seen.append((r, t, b))
    if not seen:
        return None
    r, t, b = seen[0]
    what = "keys" if t.name in ("dK", "dV") else "rows"
    return (f"in '{r.case.name}' {t.name}: {what} 0-{b - 1} right, wrong {what} {ranges(t.bad_rows())}; "
            f"{ctx.case_pattern()}")


def seen_facts(ctx, limit: int = 3) -> str:
    """What the fallback diagnoses report: for the first failing cases, each wrong output's
    best-fit factor and cosine with the reference, and any structural fact."""
    out = []
    for r in ctx.failing[:2]:
        for t in r.bad()[:limit]:
            if not t.finite:
                out.append(f"'{r.case.name}' {t.name}: not finite ({t.unwritten} never written)")
                continue
            f = _facts(r, t.name)
            bits = [f"cosine with the reference {t.cosine:.2f}", f"best-fit factor {t.ratio:.3g}"]
            if f.get("zero_heads"):
                bits.append(f"zero in (batch, head) {_heads_text(r.case, f['zero_heads'])}")
            if f.get("equals"):
                bits.append(f"equals {' and '.join(f['equals'])}")
            if f.get("first_rows"):
                bits.append(f"right in its first {f['first_rows']} rows only")
            ok = int(t.heads_ok.sum())
            if ok:
                bits.append(f"{ok} of {t.heads_ok.numel()} heads right")
            out.append(f"'{r.case.name}' {t.name}: " + ", ".join(bits))
    return "; ".join(out)
