"""Stage "a pattern that pins the cause": only the cases with several batch elements fail (a batch
offset), only the head-dim-24 case (the head-dim mask), only the GQA cases (a grid per query head,
too few programs, dK/dV off by the group's size, a head index, named with the map the outputs
show), or exactly the cases where two tensors' strides differ.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from ..engine import PINNED, mistake
from ..evidence import INPUT_NAMES, exactly, facts
from ..structure import head_sets_idea


@mistake("batch", PINNED, "only batch element 0 is right: a batch offset is missing or wrong",
         "Wrong exactly in the cases with several batch elements: some tensor's pointer is not moved "
         "to its batch element (b * that tensor's own batch stride), or is moved with another "
         "tensor's batch stride.", proof="planted/dq.no_batch_offset")
def _batch(ctx):
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}" if exactly(ctx, "batch") else None


@mistake("head_dim_mask", PINNED, "a load or store lacks the head-dim mask (offs_d < HEAD_DIM)",
         "Only the case whose head dim D is below its padded block (D = 24, BLOCK_D = 32) fails. "
         "The columns D..BLOCK_D-1 of each tile do not exist: a load without `offs_d < HEAD_DIM` "
         "reads the next row's first elements (past the last row: whatever follows the tensor), a "
         "store without it writes over them. Every load and store of a [rows, D] tile needs the "
         "head-dim mask beside its row mask (`row_ok[:, None] & d_ok[None, :]`), and HEAD_DIM is "
         "the real D, not BLOCK_D.", proof="planted/dq.k_without_d_mask")
def _head_dim_mask(ctx):
    if not exactly(ctx, "head_dim"):
        return None
    seen = []
    read = list(dict.fromkeys(n for r in ctx.failing for n in (r.oob_reads or r.nan_from or ())))
    if read:
        seen.append(f"loads read past the end of {', '.join(INPUT_NAMES.get(n, n) for n in read)} "
                    f"(a load of {'/'.join(INPUT_NAMES.get(n, n) for n in read)} without the head-dim mask)")
    written = list(dict.fromkeys(t.name for _, t in ctx.bad_tensors() if t.guard_touched))
    if written:
        seen.append(f"stores wrote past the end of {', '.join(written)} (its store without the head-dim mask)")
    return "; ".join([ctx.case_pattern()] + seen + [ctx.tensor_pattern()])


def _values_right(ctx) -> bool:
    """Every head's values right in every failing case: only memory (reads or writes past the
    end, a guard touched) failed."""
    return bool(ctx.failing) and all(bool(t.heads_ok.all()) and t.unwritten == 0
                                     for r in ctx.failing for t in r.tensors.values())


@mistake("gqa_grid", PINNED, "the grid has a program per query head where one per K/V head belongs",
         "With GQA a dK/dV program owns one K/V head and loops over the query heads of its group: "
         "the grid's second axis is B * H_kv. Programs for heads that do not exist read and write "
         "past the end of the tensors (the values themselves came out right).",
         proof="example/dkdv_kernel/launch_dkdv_direct(grid over query heads)")
def _gqa_grid(ctx):
    if exactly(ctx, "gqa") and _values_right(ctx):
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
         "poison.", proof="example/dq_kernel/launch_dq_grid_over_kv_heads")
def _grid_heads(ctx):
    if not exactly(ctx, "gqa"):
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
         "per K/V head (H_kv = H) the two agree, which is why those cases pass.", proof="slips/04/group_factor")
def _group_factor(ctx):
    if not exactly(ctx, "gqa"):
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


@mistake("gqa", PINNED, "a head index is wrong under grouped-query attention",
         "With GQA, query head h reads K/V head h // GROUP_SIZE (h_kv); Q, dO, LSE, delta and dQ "
         "belong to the query head h, K, V, dK and dV to h_kv. A dK/dV program loops over the query "
         "heads of its group (h = h_kv * GROUP_SIZE + g) and adds up all their contributions.",
         proof="example/dq_kernel/planted dq.kv_offset_with_h (GQA)")
def _gqa(ctx):
    if ctx.failing and set.intersection(*(set(r.fingerprints) for r in ctx.failing)):
        return None                                       # a fingerprint's mistake names it exactly
    if not exactly(ctx, "gqa"):
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
                return evidence, head_sets_idea(r.case, name, sets)
    return evidence


def _reads_past_kv(r) -> bool:
    seen = r.oob_reads or r.nan_from
    return bool(seen) and set(seen) <= {"k", "v"}


@mistake("kv_head", PINNED, "query heads read the wrong K/V head: the K/V head index is wrong",
         "Query head h belongs to K/V head h // GROUP_SIZE (GROUP_SIZE = H / H_kv; without GQA, "
         "the same h): K, V (and in a dK/dV program, dK and dV) are offset with that head, Q, dO, LSE, "
         "delta and dQ with h. Your dQ of each query head equals what another K/V head gives "
         "(the map is in the evidence).", proof="slips/03/kv_head")
def _kv_head(ctx):
    hits, others = [], []
    for r in ctx.failing:
        m = facts(r, "dQ").get("kv_heads")
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


_STRIDE_ID = re.compile(r"^stride_(\w+?)_(\w+?)(?:_\d)?$|^[qkv]_layout$")


def _unlike_contiguous(case, name: str, dims) -> bool:
    """Whether input ``name``'s strides in ``dims`` differ from those of the output of its shape
    the checker hands over (contiguous, or for dQ and dV in one case a [B, S, H, D] view)."""
    return any(case.strides()[name][d] != case.output_strides(name)[d] for d in dims)


@mistake("stride", PINNED, "a tensor is addressed with another tensor's strides",
         "Wrong exactly in the cases where two tensors' strides differ: one of them is offset with "
         "the other's stride. Every tensor gets its own stride arguments, named after it "
         "(stride_v_s for V's rows, never stride_k_s), and each load uses its own.",
         proof="planted/dq.do_head_stride")
def _stride(ctx):
    if ctx.pattern is None or not ctx.exact or not _STRIDE_ID.match(ctx.pattern.id.split("&")[0]):
        return None
    stored = [(r, t) for r, t in ctx.bad_tensors() if t.unwritten and t.guard_touched]
    if ctx.pattern.id.endswith("_layout") and not stored:
        return None
    if stored:          # the output's own elements left unwritten, memory past it written
        r, t = stored[0]
        failing = {id(x) for x in ctx.failing}
        source = next((n for dims in ((2,), (3,), (1,), (0,), (0, 1, 2, 3)) for n in ("Q", "K", "V")
                       if failing == {id(x) for x in ctx.results if _unlike_contiguous(x.case, n.lower(), dims)}),
                      None)
        where = (f"exactly the cases where {source}'s strides differ from those of the output fail"
                 if source else f"{len(ctx.failing)} of {len(ctx.results)} cases fail "
                 f"({ctx.names_of(ctx.failing)}), each with an input laid out unlike the output")
        return (f"{where}; in '{r.case.name}' {t.unwritten} elements of {t.name} never written and "
                f"{t.guard_touched} written past its end: {t.name} is stored with "
                f"{source + chr(39) + 's' if source else 'an input' + chr(39) + 's'} strides (the output "
                f"has strides of its own; use them, stride_{t.name.lower()}_*)")
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}"
