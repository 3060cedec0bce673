"""Stage "memory": rows bounded by the other length, S_q and S_k swapped, loads past the end (a
wrong address or a missing mask), an output never stored, a head-dim tile too narrow, elements
never written. In the interpreter the runner sees the loads themselves; a GPU's evidence is the
NaN that a guard's values put into the outputs and the output's own guard.
"""
from __future__ import annotations

import torch

from ..battery import BLOCKS, aligned
from ..engine import MEMORY, mistake
from ..evidence import INPUT_NAMES, exactly, ranges


def _past_other_length(query_side: bool):
    """Rows S_k..S_q-1 of dQ / O / LSE never written (or keys S_q..S_k-1 of dK / dV), and only
    where S_q != S_k: a row mask with S_k where S_q belongs (a key mask with S_q). It comes
    before read_past_end: the same mask also lets loads past the end through when the other
    length is the larger, and the missing rows say which mask it is."""
    side = {"q", "do", "lse", "delta"} if query_side else {"k", "v"}

    def _over_read(ctx):
        # a row mask against S_k loads query rows S_q..S_k-1 where S_q < S_k: past the end of
        # the query-side tensors only (a key mask against S_q: past K and V where S_k < S_q)
        # (the interpreter records the loads; a GPU run finds them by moving the NaN guards)
        read = {id(r): list(r.oob_reads or r.nan_from or ()) for r in ctx.failing}
        over = [r for r in ctx.failing if read[id(r)]]
        longer = (lambda c: c.S_q < c.S_k) if query_side else (lambda c: c.S_k < c.S_q)
        if over and all(set(read[id(r)]) <= side and longer(r.case) for r in over):
            r = over[0]
            names = ", ".join(INPUT_NAMES.get(n, n) for n in read[id(r)])
            return (f"loads ran past the end of {names} -- and of nothing else -- in exactly the cases with "
                    f"{'S_q < S_k' if query_side else 'S_k < S_q'} ({ctx.names_of(over)}): the "
                    f"{'rows' if query_side else 'keys'} up to {'S_k' if query_side else 'S_q'} were loaded; "
                    f"{ctx.case_pattern()}",
                    ("A query-row mask is bounded by S_k where S_q belongs: the rows S_q..S_k-1 do not exist, "
                     "and loading them reads past the end of Q, dO, LSE and delta (where S_q > S_k the same "
                     "mask drops rows that do exist). Query rows are masked with `offs_m < S_q`, keys with "
                     "`offs_n < S_k`." if query_side else
                     "A key mask is bounded by S_q where S_k belongs: the keys S_k..S_q-1 do not exist, and "
                     "loading them reads past the end of K and V. Keys are masked with `offs_n < S_k`, query "
                     "rows with `offs_m < S_q`."))
        return None

    def test(ctx):
        if not ctx.failing or any(r.case.S_q == r.case.S_k for r in ctx.failing):
            return None
        hits = []
        for r, t in ctx.bad_tensors():
            if not t.unwritten:
                continue
            keys = t.name in ("dK", "dV")
            if keys == query_side:
                continue
            own, other = (r.case.S_k, r.case.S_q) if keys else (r.case.S_q, r.case.S_k)
            if not (other < own and t.bad_rows() == list(range(other, own))):
                return None
            hits.append((r, t))
        if not hits:
            return _over_read(ctx)
        r, t = hits[0]
        what, length = ("keys", "S_q") if not query_side else ("rows", "S_k")
        return (f"{what} {r.case.S_k if query_side else r.case.S_q}-{(r.case.S_q if query_side else r.case.S_k) - 1} "
                f"of {t.name} never written in '{r.case.name}' (S_q={r.case.S_q}, S_k={r.case.S_k}): "
                f"exactly the {what} from {length} on; {ctx.case_pattern()}")
    return test


mistake("row_mask_length", MEMORY, "the query rows are bounded by S_k: a row mask or bound uses the wrong length",
        "The query rows from S_k on were never written: a row mask (or the loop, or the grid) is "
        "bounded by S_k where S_q belongs. Query rows -- Q, dO, LSE, delta, dQ, O -- are masked "
        "with `rows < S_q`, keys -- K, V, dK, dV -- with `keys < S_k`. Where S_q < S_k the same "
        "mask lets loads and stores run past the end of the query-side tensors.",
        test=_past_other_length(query_side=True), proof="planted/dq.row_mask_uses_S_k")


mistake("key_mask_length", MEMORY, "the keys are bounded by S_q: a key mask or bound uses the wrong length",
        "The keys from S_q on were never written: a key mask (or the loop, or the grid) is bounded "
        "by S_q where S_k belongs. Keys -- K, V, dK, dV -- are masked with `keys < S_k`, query rows "
        "with `rows < S_q`.", test=_past_other_length(query_side=False), proof="planted/dkdv.key_mask_uses_S_q")


@mistake("grid_length", MEMORY, "the grid (or a loop) is sized by the other length: the last blocks get no program",
         "A dK/dV program owns a block of keys: the grid's first axis is cdiv(S_k, BLOCK_N). A dQ "
         "program owns a block of query rows: cdiv(S_q, BLOCK_M). Sized by the other length, the "
         "blocks past it are never visited where that length is the smaller (and the extra programs "
         "are masked off where it is the larger, which is why those cases pass).",
         proof="blind/s/S04_grid_over_queries")
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


_QUERY_SIDE = {"q", "do", "lse", "delta"}


def _lengths_swapped_by_stores(ctx) -> bool:
    """The same mistake seen through stores alone (a GPU keeps no record of loads): each output
    bounded by the other length, both ways, and rows below both lengths wrong too."""
    past = unwritten = low = False
    for r, t in ctx.bad_tensors():
        keys = t.name in ("dK", "dV")
        own, other = (r.case.S_k, r.case.S_q) if keys else (r.case.S_q, r.case.S_k)
        if own > other and t.guard_touched:
            return False
        past |= own < other and t.guard_touched > 0
        unwritten |= own > other and t.unwritten > 0
        low |= any(row < min(own, other) for row in t.bad_rows())
    return past and unwritten and low


@mistake("lengths_swapped", MEMORY, "S_q and S_k are swapped (in the launch or the kernel's arguments)",
         "Wrong exactly where S_q != S_k, and the loads run past the end of the query-side tensors "
         "(Q, dO, LSE, delta) where S_q < S_k, of K and V where S_q > S_k: the kernel believes each "
         "length is the other. Compare the call's arguments with the kernel's signature.",
         proof="example/dq_kernel/launch_dq_lengths_swapped")
def _lengths_swapped(ctx):
    seen = [r for r in ctx.failing if r.oob_reads]
    if not seen and exactly(ctx, "sq_ne_sk") and _lengths_swapped_by_stores(ctx):
        return (f"{ctx.case_pattern()}; outputs written past their end where their own length is the "
                f"smaller, left unwritten from the other length on where it is the larger, and rows below "
                f"both lengths wrong as well")
    if not (exactly(ctx, "sq_ne_sk") and 2 * len(seen) >= len(ctx.failing)):
        return None
    for r in seen:      # (a read past one head's rows into the next shows no guard: not every case)
        query_side = set(r.oob_reads) <= _QUERY_SIDE
        if query_side != (r.case.S_q < r.case.S_k) or (not query_side and set(r.oob_reads) & _QUERY_SIDE):
            return None
    return f"{ctx.case_pattern()}; reads past the end of Q/dO/LSE/delta where S_q < S_k, of K/V where S_q > S_k"


@mistake("address_past_end", MEMORY, "a load's address is wrong (a stride, an index or an offset), not its mask",
         "Loads read past the end of a tensor even in cases where every length is a multiple of the "
         "block, so no mask is needed there: the address itself points outside. Check the offsets "
         "of that tensor: each dimension's index times that tensor's own stride for that same "
         "dimension (b with stride_b, h with stride_h, rows with stride_s, columns with stride_d), "
         "and head indices that stay below the number of heads.", proof="planted/dq.q_row_stride_typo")
def _address_past_end(ctx):
    seen = [r for r in ctx.failing if r.oob_reads and aligned(r.case)]
    traced = [r for r in ctx.failing if r.nan_from and aligned(r.case)]   # a GPU's evidence
    if not seen and traced:
        names = list(dict.fromkeys(n for r in traced for n in r.nan_from))
        return (f"a load reached past the end of {', '.join(INPUT_NAMES.get(n, n) for n in names)} (with NaN only "
                f"there, the output turns NaN) in {ctx.names_of(traced)}, where S_q and S_k are multiples of "
                f"{BLOCKS[-1]}: no mask is at stake there")
    if not seen:
        return None
    names = list(dict.fromkeys(n for r in seen for n in r.oob_reads))
    return (f"loads returned the NaN past the end of {', '.join(INPUT_NAMES[n] for n in names)} in "
            f"{ctx.names_of(seen)}, where S_q and S_k are multiples of {BLOCKS[-1]}: no mask is at stake there")


@mistake("read_past_end", MEMORY, "a load reads past the end of a tensor (a mask is missing)",
         "The memory around every input holds NaN here, and your code read it: some load reaches "
         "rows (or columns) that do not exist. Every load needs the mask of its own tensor -- the "
         "query-row mask for q, dO, LSE and delta, the key mask for k and v -- so that padded "
         "positions read a harmless `other` value. (Past the end of a tensor there may be another "
         "tensor, or no memory at all: even a value that is thrown away later must not be read.)",
         proof="planted/dq.keys_unmasked")
def _read_past_end(ctx):
    seen = [r for r in ctx.failing if r.oob_reads]
    if seen:
        names = list(dict.fromkeys(n for r in seen for n in r.oob_reads))
        return (f"loads returned the NaN that lies past the end of {', '.join(INPUT_NAMES[n] for n in names)} "
                f"in {len(seen)} of {len(ctx.results)} cases ({ctx.names_of(seen)})")
    hits = [r for r in ctx.failing if r.nan_from]
    if not hits:
        return None
    names = list(dict.fromkeys(n for r in hits for n in r.nan_from))
    return (f"with NaN only around {', '.join(INPUT_NAMES.get(n, n) for n in names)}, the output "
            f"turns NaN; with finite values there it does not (case '{hits[0].case.name}')")


@mistake("never_stored", MEMORY, "an output is never written at all: its store is missing or goes elsewhere",
         "Not one element of this output was written, in any case: the kernel has no store for it, "
         "or the store goes through another output's pointer (DV where DK belongs: the other output "
         "then keeps whichever store came last), or the launcher writes into a tensor of its own "
         "instead of the one it was given. Each output is stored once, through its own pointer with "
         "its own strides.", proof="planted/dkdv.dk_stored_to_dv")
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


@mistake("head_dim_tile", MEMORY, "the head-dim tile is narrower than the head dim: the last columns are never stored",
         "Every row was stored, but only its first columns: the tile's column axis, tl.arange(0, BLOCK_D), "
         "must cover the whole head dim, so BLOCK_D is D rounded up to a power of two "
         "(triton.next_power_of_2(D)) with the columns masked by `offs_d < D` -- not the row block's "
         "size or a fixed number. Cases with D <= that width pass, which is why only some fail.",
         proof="slips/03/head_dim_tile")
def _head_dim_tile(ctx):
    for r, t in ctx.bad_tensors():
        a = t.actual
        if not t.unwritten or a is None or a.dim() != 4:
            continue
        nan_cols = torch.isnan(a).all(dim=(0, 1, 2))
        width = int((~nan_cols).sum())
        if 0 < width < a.shape[-1] and bool(nan_cols[width:].all()) and bool(torch.isfinite(a[..., :width]).all()):
            return (f"in '{r.case.name}' (D = {a.shape[-1]}) columns {width}-{a.shape[-1] - 1} of every row of "
                    f"{t.name} were never written, columns 0-{width - 1} were: the tile is {width} columns wide; "
                    f"{ctx.case_pattern()}")
    return None


@mistake("unwritten", MEMORY, "some output elements were never written",
         "Outputs start filled with a marked NaN here, and some still hold it: those elements were "
         "never stored. Check that the grid covers the last, partial block (cdiv, not //), that the "
         "store's mask is not stricter than `row < S`, and that the launcher writes into the output "
         "it was given.", proof="example/dq_kernel/launch_dq_rows_rounded_down")
def _unwritten(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.unwritten]
    if not bad:
        return None
    r, t = bad[0]
    what = "keys" if t.name in ("dK", "dV") else "rows"
    return (f"{t.unwritten} elements of {t.name} never written in '{r.case.name}' ({what} "
            f"{ranges(t.bad_rows())} of 0-{t.row_err.numel() - 1}); {ctx.case_pattern()}")
