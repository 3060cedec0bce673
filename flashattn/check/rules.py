"""Every diagnosis the checkers can give, in the order they are tried: the first that fits wins.

Each rule is one function with its title (what is wrong) and idea (the principle to check: no
code) beside it, and returns the evidence from this run, or None. Adding a diagnosis means
adding one rule here -- at the place in the order where it is more specific than the rules
after it -- and a planted bug (``flashattn.planted.CATALOG`` or a test function) that triggers
exactly it (``tests/test_check_kernels.py``, ``tests/test_check.py``).

The order, roughly: the code did not run (not written, no kernel, wrong order or shape, exceptions);
it ran differently twice (a race); patterns that pin a cause exactly (a batch offset, the GQA head,
one tensor with another's strides); memory (reads past the end, elements never written); exact
matches with known wrong formulas; NaN; writes past the end; constant factors; which outputs are
wrong; which cases are wrong; and last, what was seen."""
from __future__ import annotations

import math
import re

import torch

from .battery import BLOCKS
from .diagnose import DtypeError, NoGradient, ShapeError, _first_error, _ranges, rule, separating
from .exception_ideas import exception_idea

# --------------------------------------------------------------------------------------
# the code did not run
# --------------------------------------------------------------------------------------


@rule("not_implemented", "not written yet",
      "Your code still raises NotImplementedError: replace the `raise NotImplementedError()` line "
      "(the `# YOUR CODE HERE` block) with your implementation, re-run that cell, then this one.")
def _not_implemented(ctx):
    return "" if _first_error(ctx, NotImplementedError) is not None else None


@rule("no_kernel", "your launcher ran no kernel",
      "This checker checks a kernel: the launcher must launch it (kernel[grid](...)) and let it "
      "write the outputs it was given. It computed them some other way (plain PyTorch?) or not at all.",
      kinds=("dq", "dkdv"))
def _no_kernel(ctx):
    counted = [r for r in ctx.results if r.launches is not None]
    if counted and all(r.launches == 0 for r in counted):
        return f"the launcher returned without launching any kernel, in all {len(counted)} cases"
    return None


@rule("grad_order", "gradients returned in the wrong order",
      "Return the gradients in the order of the inputs they belong to: (dq, dk, dv) for "
      "(q, k, v) -- and in an autograd.Function, one per input of forward, None for the "
      "non-tensor ones.")
def _grad_order(ctx):
    swapped = [r for r in ctx.results if r.swapped]
    if swapped:
        got, wanted = swapped[0].swapped
        return f"in {ctx.names_of(swapped)} the tensor returned as {got} has the shape of {wanted}"
    if ctx.failing and all("swapped" in r.fingerprints for r in ctx.failing):
        evidence = f"in every failing case two gradients hold each other's true values ({ctx.tensor_pattern()})"
        if ctx.kind in ("dq", "dkdv"):
            return evidence, ("Each output pointer gets its own values: the kernel stores dK's "
                              "accumulator into DK with DK's strides, dV's into DV.")
        return evidence
    return None


_SHAPE = re.compile(r"[\[(](\d+(?:, ?\d+)+)[\])]")


@rule("saved_order", "the tensors saved for backward come back in another order",
      "ctx.saved_tensors returns the tensors in the order they were given to "
      "ctx.save_for_backward: unpack them in that same order (here a tensor with the LSE's shape "
      "[B, H, S_q] arrived where O [B, H, S_q, D] was expected, or the reverse).",
      kinds=("autograd",))
def _saved_order(ctx):
    for r in ctx.results:
        if r.error is None:
            continue
        c = r.case
        shapes = {tuple(int(x) for x in m.split(",")) for m in _SHAPE.findall(str(r.error))}
        if (c.B, c.H, c.S_q) in shapes and (c.B, c.H, c.S_q, c.D) in shapes:
            return f"case '{c.name}': {type(r.error).__name__}: {str(r.error)[:200]}"
    return None


@rule("dtype", "an output has the wrong dtype",
      "Return each output in the dtype the exercise asks for: O like q (cast the fp32 "
      "accumulator back with .to(q.dtype)), LSE in fp32, gradients like the inputs they belong to.")
def _dtype(ctx):
    r = _first_error(ctx, DtypeError)
    return f"case '{r.case.name}': {r.error}" if r is not None else None


@rule("none_gradient", "a gradient came back None although its input requires grad",
      "backward returns None for an input only when ctx.needs_input_grad says it needs none. "
      "needs_input_grad is indexed like forward's inputs: 0 is q, 1 is k, 2 is v -- check which "
      "index guards which gradient.", kinds=("autograd",))
def _none_gradient(ctx):
    r = _first_error(ctx, NoGradient)
    return f"case '{r.case.name}' (inputs requiring grad: {', '.join(r.case.requires)}): {r.error}" if r else None


@rule("shape", "an output has the wrong shape or type",
      "Return tensors shaped like the reference: dQ like q, dK and dV like k and v, "
      "P [B, H, S_q, S_k], LSE [B, H, S_q].")
def _shape(ctx):
    r = _first_error(ctx, ShapeError)
    return str(r.error) if r is not None else None


@rule("exception", "your code raised an exception",
      "The error and the line it came from are shown below; the cases it raised in say what they "
      "share (S_q != S_k, non-contiguous tensors, ...).")
def _exception(ctx):
    raised = [r for r in ctx.results if r.error is not None]
    if not raised:
        return None
    sep = separating(ctx.results, raised)
    where = f"only in {sep[0].label}" if sep and sep[1] else f"in {len(raised)} of {len(ctx.results)} cases"
    evidence = f"raised {where} ({ctx.names_of(raised)})"
    idea = exception_idea(raised, sep)
    return (evidence, idea) if idea else evidence


@rule("race", "results change between runs on the same input: a race on a global accumulator",
      "Two runs on identical inputs gave different bits. Several programs (or threads) add into "
      "the same output addresses, and the order of those additions -- or whether an update is "
      "lost -- depends on scheduling. Atomics fix lost updates but not the order. Give every "
      "output block to exactly one program that accumulates in registers and stores once.")
def _race(ctx):
    r = next((r for r in ctx.results if r.nondeterministic), None)
    return f"case '{r.case.name}': {', '.join(r.nondeterministic)} differed between two runs" if r else None


@rule("wild_access", "an address falls outside every tensor the kernel was given",
      "Some loads or stores reached memory that belongs to none of the kernel's tensors (in the "
      "interpreter the checker fences them off; on a GPU they land wherever the address points: an "
      "illegal memory access, or silent corruption of something else). "
      "The address is far off, not one block too far: the batch and head decoded from the program "
      "id the wrong way round, two strides swapped, a head count or a grid larger than the tensors "
      "(H_kv passed where H belongs), or an offset built from the wrong length.")
def _wild_access(ctx):
    hits = [r for r in ctx.results if r.wild]
    if not hits:
        return _displaced_stores(ctx)
    loads, stores = (sum(r.wild[k] for r in hits) for k in ("loads", "stores"))
    return (f"{stores} stores and {loads} loads outside every tensor, in {len(hits)} of "
            f"{len(ctx.results)} cases ({ctx.names_of(hits)})")


def _displaced_stores(ctx):
    """A GPU fences nothing off, but the guard past an output shows stores that landed there: with
    contiguous inputs and block-multiple lengths, unwritten elements beside elements written past
    the end mean the store's address itself is wrong."""
    shifted = [(r, t) for r, t in ctx.bad_tensors()
               if r.case.contiguous and _aligned(r.case) and t.unwritten and t.guard_touched]
    if not shifted:
        return None
    r, t = shifted[0]
    return (f"'{r.case.name}' (contiguous inputs, lengths multiples of {BLOCKS[-1]}): {t.unwritten} "
            f"elements of {t.name} never written and {t.guard_touched} written past its end -- its stores "
            f"went to other addresses; {ctx.case_pattern()}")


from . import beyond_rules  # noqa: E402,F401  (lesson 09's checkers: registered here, in this order)


# --------------------------------------------------------------------------------------
# patterns that pin one cause
# --------------------------------------------------------------------------------------
def _exactly(ctx, *bases):
    p = ctx.pattern
    return p is not None and ctx.exact and p.id.split("&")[0] in bases


@rule("batch", "only batch element 0 is right: a batch offset is missing or wrong",
      "Wrong exactly in the cases with several batch elements: some tensor's pointer is not moved "
      "to its batch element (b * that tensor's own batch stride), or is moved with another "
      "tensor's batch stride.")
def _batch(ctx):
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}" if _exactly(ctx, "batch") else None


def _values_right(ctx) -> bool:
    """Every head's values right in every failing case: only memory (reads or writes past the
    end, a guard touched) failed."""
    return bool(ctx.failing) and all(bool(t.heads_ok.all()) and t.unwritten == 0
                                     for r in ctx.failing for t in r.tensors.values())


@rule("gqa_grid", "the grid has a program per query head where one per K/V head belongs",
      "With GQA a dK/dV program owns one K/V head and loops over the query heads of its group: "
      "the grid's second axis is B * H_kv. Programs for heads that do not exist read and write "
      "past the end of the tensors (the values themselves came out right).", kinds=("dkdv",))
def _gqa_grid(ctx):
    if _exactly(ctx, "gqa") and _values_right(ctx):
        past = [r for r in ctx.failing if r.oob_reads or any(t.guard_touched for t in r.tensors.values())]
        if past:
            return f"{ctx.case_pattern()}; every value right, but memory past the end read or written in {ctx.names_of(past)}"
    return None


@rule("gqa", "a head index is wrong under grouped-query attention",
      "With GQA, query head h reads K/V head h // GROUP_SIZE (h_kv); Q, dO, LSE, delta and dQ "
      "belong to the query head h, K, V, dK and dV to h_kv. A dK/dV program loops over the query "
      "heads of its group (h = h_kv * GROUP_SIZE + g) and adds up all their contributions.")
def _gqa(ctx):
    if ctx.failing and set.intersection(*(set(r.fingerprints) for r in ctx.failing)):
        return None                                       # a fingerprint rule names it exactly
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}" if _exactly(ctx, "gqa") else None


_STRIDE_ID = re.compile(r"^stride_(\w+?)_(\w+?)(?:_\d)?$|^[qkv]_layout$")


def _unlike_contiguous(case, name: str, dims) -> bool:
    """Whether input ``name``'s strides in ``dims`` differ from those of a contiguous tensor of
    its shape (the outputs a checker hands over are contiguous)."""
    H, S, D = case.H if name == "q" else case.heads_kv, case.S_q if name == "q" else case.S_k, case.D
    own, contiguous = case.strides()[name], (H * S * D, S * D, D, 1)
    return any(own[d] != contiguous[d] for d in dims)


@rule("stride", "a tensor is addressed with another tensor's strides",
      "Wrong exactly in the cases where two tensors' strides differ: one of them is offset with "
      "the other's stride. Every tensor gets its own stride arguments, named after it "
      "(stride_v_s for V's rows, never stride_k_s), and each load uses its own.")
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
        where = (f"exactly the cases where {source}'s strides differ from those of the (contiguous) output fail"
                 if source else f"{len(ctx.failing)} of {len(ctx.results)} cases fail "
                 f"({ctx.names_of(ctx.failing)}), each with an input laid out unlike the output")
        return (f"{where}; in '{r.case.name}' {t.unwritten} elements of {t.name} never written and "
                f"{t.guard_touched} written past its end: {t.name} is stored with "
                f"{source + chr(39) + 's' if source else 'an input' + chr(39) + 's'} strides (the output "
                f"is allocated contiguous; use its own, stride_{t.name.lower()}_*)")
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}"


_INPUT_NAMES = {"q": "Q", "k": "K", "v": "V", "do": "dO", "lse": "LSE", "delta": "delta"}


def _past_other_length(query_side: bool):
    """Rows S_k..S_q-1 of dQ / O / LSE never written (or keys S_q..S_k-1 of dK / dV), and only
    where S_q != S_k: a row mask with S_k where S_q belongs (a key mask with S_q). It comes
    before read_past_end: the same mask also lets loads past the end through when the other
    length is the larger, and the missing rows say which mask it is."""
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
            return None
        r, t = hits[0]
        what, length = ("keys", "S_q") if not query_side else ("rows", "S_k")
        return (f"{what} {r.case.S_k if query_side else r.case.S_q}-{(r.case.S_q if query_side else r.case.S_k) - 1} "
                f"of {t.name} never written in '{r.case.name}' (S_q={r.case.S_q}, S_k={r.case.S_k}): "
                f"exactly the {what} from {length} on; {ctx.case_pattern()}")
    return test


rule("row_mask_length", "the query rows are bounded by S_k: a row mask or bound uses the wrong length",
     "The query rows from S_k on were never written: a row mask (or the loop, or the grid) is "
     "bounded by S_k where S_q belongs. Query rows -- Q, dO, LSE, delta, dQ, O -- are masked "
     "with `rows < S_q`, keys -- K, V, dK, dV -- with `keys < S_k`. Where S_q < S_k the same "
     "mask lets loads and stores run past the end of the query-side tensors.",
     )(_past_other_length(query_side=True))

rule("key_mask_length", "the keys are bounded by S_q: a key mask or bound uses the wrong length",
     "The keys from S_q on were never written: a key mask (or the loop, or the grid) is bounded "
     "by S_q where S_k belongs. Keys -- K, V, dK, dV -- are masked with `keys < S_k`, query rows "
     "with `rows < S_q`.",
     )(_past_other_length(query_side=False))


_QUERY_SIDE = {"q", "do", "lse", "delta"}


@rule("lengths_swapped", "S_q and S_k are swapped (in the launch or the kernel's arguments)",
      "Wrong exactly where S_q != S_k, and the loads run past the end of the query-side tensors "
      "(Q, dO, LSE, delta) where S_q < S_k, of K and V where S_q > S_k: the kernel believes each "
      "length is the other. Compare the call's arguments with the kernel's signature.")
def _lengths_swapped(ctx):
    seen = [r for r in ctx.failing if r.oob_reads]
    if not seen and _exactly(ctx, "sq_ne_sk") and _lengths_swapped_by_stores(ctx):
        return (f"{ctx.case_pattern()}; outputs written past their end where their own length is the "
                f"smaller, left unwritten from the other length on where it is the larger, and rows below "
                f"both lengths wrong as well")
    if not (_exactly(ctx, "sq_ne_sk") and 2 * len(seen) >= len(ctx.failing)):
        return None
    for r in seen:      # (a read past one head's rows into the next shows no guard: not every case)
        query_side = set(r.oob_reads) <= _QUERY_SIDE
        if query_side != (r.case.S_q < r.case.S_k) or (not query_side and set(r.oob_reads) & _QUERY_SIDE):
            return None
    return f"{ctx.case_pattern()}; reads past the end of Q/dO/LSE/delta where S_q < S_k, of K/V where S_q > S_k"


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


def _aligned(case) -> bool:
    """Every length a multiple of the largest block: no load needs a mask."""
    return case.S_q % BLOCKS[-1] == 0 and case.S_k % BLOCKS[-1] == 0


@rule("address_past_end", "a load's address is wrong (a stride, an index or an offset), not its mask",
      "Loads read past the end of a tensor even in cases where every length is a multiple of the "
      "block, so no mask is needed there: the address itself points outside. Check the offsets "
      "of that tensor: each dimension's index times that tensor's own stride for that same "
      "dimension (b with stride_b, h with stride_h, rows with stride_s, columns with stride_d), "
      "and head indices that stay below the number of heads.")
def _address_past_end(ctx):
    seen = [r for r in ctx.failing if r.oob_reads and _aligned(r.case)]
    traced = [r for r in ctx.failing if r.nan_from and _aligned(r.case)]   # a GPU's evidence
    if not seen and traced:
        names = list(dict.fromkeys(n for r in traced for n in r.nan_from))
        return (f"a load reached past the end of {', '.join(_INPUT_NAMES.get(n, n) for n in names)} (with NaN only "
                f"there, the output turns NaN) in {ctx.names_of(traced)}, where S_q and S_k are multiples of "
                f"{BLOCKS[-1]}: no mask is at stake there")
    if not seen:
        return None
    names = list(dict.fromkeys(n for r in seen for n in r.oob_reads))
    return (f"loads returned the NaN past the end of {', '.join(_INPUT_NAMES[n] for n in names)} in "
            f"{ctx.names_of(seen)}, where S_q and S_k are multiples of {BLOCKS[-1]}: no mask is at stake there")


@rule("read_past_end", "a load reads past the end of a tensor (a mask is missing)",
      "The memory around every input holds NaN here, and your code read it: some load reaches "
      "rows (or columns) that do not exist. Every load needs the mask of its own tensor -- the "
      "query-row mask for q, dO, LSE and delta, the key mask for k and v -- so that padded "
      "positions read a harmless `other` value. (Past the end of a tensor there may be another "
      "tensor, or no memory at all: even a value that is thrown away later must not be read.)")
def _read_past_end(ctx):
    seen = [r for r in ctx.failing if r.oob_reads]
    if seen:
        names = list(dict.fromkeys(n for r in seen for n in r.oob_reads))
        return (f"loads returned the NaN that lies past the end of {', '.join(_INPUT_NAMES[n] for n in names)} "
                f"in {len(seen)} of {len(ctx.results)} cases ({ctx.names_of(seen)})")
    hits = [r for r in ctx.failing if r.nan_from]
    if not hits:
        return None
    names = list(dict.fromkeys(n for r in hits for n in r.nan_from))
    return (f"with NaN only around {', '.join(_INPUT_NAMES.get(n, n) for n in names)}, the output "
            f"turns NaN; with finite values there it does not (case '{hits[0].case.name}')")


@rule("unwritten", "some output elements were never written",
      "Outputs start filled with a marked NaN here, and some still hold it: those elements were "
      "never stored. Check that the grid covers the last, partial block (cdiv, not //), that the "
      "store's mask is not stricter than `row < S`, and that the launcher writes into the output "
      "it was given.")
def _unwritten(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.unwritten]
    if not bad:
        return None
    r, t = bad[0]
    what = "keys" if t.name in ("dK", "dV") else "rows"
    return (f"{t.unwritten} elements of {t.name} never written in '{r.case.name}' ({what} "
            f"{_ranges(t.bad_rows())} of 0-{t.row_err.numel() - 1}); {ctx.case_pattern()}")


# --------------------------------------------------------------------------------------
# exact matches with known wrong formulas (fingerprints.py computes them)
# --------------------------------------------------------------------------------------
from . import fingerprint_rules  # noqa: E402,F401  (registers them here, in this order)

# --------------------------------------------------------------------------------------
# NaN, writes past the end, constant factors
# --------------------------------------------------------------------------------------
@rule("alpha", "NaN from the first block: an exponential taken against the wrong maximum",
      "NaN in every case, even with one block of keys, so it starts at the first block, where "
      "the old maximum is -inf. Two exponentials meet it: alpha = exp(m_old - m_new) must be <= 1 "
      "(0 at the first block; exp(m_new - m_old) is inf there, and inf * 0 is NaN), and p = "
      "exp(s - m_new) must use the *new* maximum (exp(s - m_old) is inf at the first block). The "
      "outputs cannot tell these two apart: check both.", kinds=("online_softmax",))
def _alpha(ctx):
    if ctx.ran and len(ctx.failing) == len(ctx.results) and \
            all("O" in r.tensors and not r.tensors["O"].finite for r in ctx.ran):
        return f"NaN in all {len(ctx.results)} cases, the one-block ones too"
    return None


def _nonfinite_rows(a: torch.Tensor) -> list:
    """The query rows (dim 2) of ``a`` that hold inf or NaN anywhere."""
    bad = ~torch.isfinite(a.movedim(2, 0).reshape(a.shape[2], -1))
    return [int(i) for i in torch.nonzero(bad.any(1)).flatten()]


@rule("mask_hides_diagonal", "the causal mask hides the diagonal: row 0 sees no key at all",
      "NaN in query row 0 only, in the causal cases only: row 0's one visible key is its own "
      "diagonal, and the mask hid it (j < i, or >=, where j <= i belongs). With every key -inf "
      "the softmax divides 0 by 0. A query sees its own key.")
def _mask_hides_diagonal(ctx):
    if not ctx.failing or not all(r.case.causal for r in ctx.failing):
        return None
    for r in ctx.failing:
        query_side = [t.actual for n, t in r.tensors.items() if n in ("O", "dQ", "LSE", "P")
                      and t.actual is not None and t.actual.dim() >= 3]
        if not any(_nonfinite_rows(a) == [0] for a in query_side):
            return None
    return f"NaN in row 0 only (of O, dQ, LSE or P) in every failing case; {ctx.case_pattern()}"


@rule("nan", "NaN computed inside your code",
      "NaN appeared although every element was written and no load reads past the end: "
      "something like exp(+inf), inf - inf or 0 * inf. A row whose every key is masked with -inf "
      "(max = -inf, then -inf - (-inf)) is the classic; so is exp applied before the mask.")
def _nan(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.nan_computed]
    if not bad:
        return None
    r, t = bad[0]
    return f"{t.name} holds NaN in '{r.case.name}'; {ctx.case_pattern()}"


@rule("oob_write", "memory just past the output was written: a store without its mask",
      "The kernel stored elements beyond the end of the output tensor: the store's mask is missing "
      "the row (or column) condition, so the padded rows of the last block land in whatever "
      "follows in memory -- another head's rows, or another tensor.")
def _oob_write(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.guard_touched]
    if not bad:
        return None
    r, t = bad[0]
    return f"'{r.case.name}': {t.guard_touched} elements written after the end of {t.name}"


@rule("sign", "the sign is flipped: yours = -reference",
      "The outputs are the reference times -1: a subtraction the wrong way round. dS = P * (dP - "
      "delta): dP first, delta subtracted.")
def _sign(ctx):
    bad = ctx.bad_tensors()
    if bad and all(math.isfinite(t.ratio) and abs(t.ratio + 1) < 2e-2 and t.ratio_resid < 1e-2 for _, t in bad):
        return f"yours / reference = {bad[0][1].ratio:.4f} in every wrong output; {ctx.tensor_pattern()}"
    return None


@rule("scale", "the error is a constant factor tied to the softmax scale",
      "S = Q K^T * scale, so the chain rule puts one factor `scale` into dQ = dS K * scale and "
      "dK = dS^T Q * scale -- exactly one, after the matrix product -- and none into dV. A ratio "
      "of 1/scale means the factor is missing, scale means it is applied twice.")
def _scale(ctx):
    bad = ctx.bad_tensors()
    if not bad:
        return None

    def factor(r, t):
        s = r.case.scale_value
        if not (math.isfinite(t.ratio) and t.ratio_resid < 1e-2):
            return None
        for f in (1.0 / s, s, (1.0 / math.sqrt(r.case.D)) / s, s * math.sqrt(r.case.D), 1 / s ** 2, s ** 2):
            if abs(t.ratio / f - 1.0) < 2e-2:
                return f
        return None

    if all(factor(r, t) is not None for r, t in bad):
        parts = [f"'{r.case.name}' {t.name}: yours / reference = {t.ratio:.4g} (scale = "
                 f"{r.case.scale_value:.4g}, 1/scale = {1 / r.case.scale_value:.4g})" for r, t in bad[:3]]
        return "; ".join(parts) + f"; {ctx.tensor_pattern()}"
    return None


@rule("heads", "only some (batch, head) pairs are right: the offset of the later heads is wrong",
      "Head 0 (or batch 0) is right and the others are not, so some tensor's pointer is not moved "
      "to the right head: the head offset (h * that tensor's own head stride) is missing, uses "
      "another tensor's stride, or the wrong head index. Every tensor gets its own offset; the bug "
      "hides when all tensors share one layout, which is why the cases mix layouts.",
      kinds=("backward", "dq", "dkdv", "autograd", "rebuild_p", "online_softmax"))
def _heads(ctx):
    seen = []
    for r, t in ctx.bad_tensors():
        ok = t.heads_ok
        if ok.numel() < 2:
            continue
        if not bool(ok.any()):
            return None
        seen.append((r, t))
    if not seen:
        return None
    r, t = seen[0]
    per = ", ".join(f"({b},{h}) {'ok' if t.heads_ok[b, h] else f'{float(t.per_head[b, h]):.0e}'}"
                    for b in range(t.per_head.shape[0]) for h in range(t.per_head.shape[1]))
    return f"case '{r.case.name}', {t.name} per (batch, head): {per}"


def _pattern_rule(prop_ids, kinds=None, exact: bool = True):
    def test(ctx):
        if kinds is not None and ctx.kind not in kinds:
            return None
        p = ctx.pattern
        base = p.id.split("&")[0] if p is not None else ""
        if p is None or not any(base == i or (i.endswith("*") and base.startswith(i[:-1])) for i in prop_ids):
            return None
        if exact and not ctx.exact:
            return None
        return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}"
    return test


rule("default_scale", "the scale you were given is not the one used",
     "Only the case with a custom scale fails: somewhere 1/sqrt(D) is used instead of the `scale` "
     "argument (when rebuilding S, or for the factor in dQ / dK).")(_pattern_rule(["custom_scale"]))


# --------------------------------------------------------------------------------------
# which outputs are wrong
# --------------------------------------------------------------------------------------
@rule("dv_formula", "only dV is wrong: dV = P^T dO, check its formula or a transpose",
      "dK and dQ need P too, and they are right, so P is right. dV = P^T dO: each key's row sums "
      "P[i, j] * dO[i] over the query rows i -- in a key-block program, the transposed tile P^T "
      "times the dO tile.")
def _dv_formula(ctx):
    if ctx.wrong_in("dV") and all(ctx.right_everywhere(n) for n in ("dK", "dQ") if n in ctx.names) \
            and any(n in ctx.names for n in ("dK", "dQ")):
        return ctx.tensor_pattern()
    return None


@rule("dq_formula", "only dQ is wrong: dQ = dS K * scale",
      "dK and dV are right, so P and dS are right: what is left is dQ's own product -- dS times K "
      "(not K^T, not dS^T), one factor of scale -- and where it is accumulated and stored.")
def _dq_formula(ctx):
    if ctx.wrong_in("dQ") and all(ctx.right_everywhere(n) for n in ("dK", "dV") if n in ctx.names) \
            and any(n in ctx.names for n in ("dK", "dV")):
        return ctx.tensor_pattern()
    return None


@rule("ds", "dV is right but dK / dQ are wrong: delta or dS is wrong",
      "dV = P^T dO needs only P, so P is fine. dK and dQ go through dS = P * (dP - delta) with "
      "dP = dO V^T and delta = rowsum(dO * O) (one number per query row). Check dP, the "
      "subtraction of delta and its broadcasting (one value per row).")
def _ds(ctx):
    if "dV" in ctx.names and ctx.right_everywhere("dV") and \
            all(ctx.wrong_in(n) for n in ("dK", "dQ") if n in ctx.names) and \
            any(n in ctx.names for n in ("dK", "dQ")):         # dS feeds both: both wrong
        return ctx.tensor_pattern()
    return None


@rule("lse_output", "O is right but LSE is wrong",
      "LSE must be the natural log of the row's sum of exp(S): with the running maximum m and the "
      "running sum l of exp(S - m), LSE = m + log(l).", kinds=("online_softmax",))
def _lse_output(ctx):
    if "O" in ctx.names and ctx.right_everywhere("O") and ctx.wrong_in("LSE"):
        return ctx.tensor_pattern()
    return None


@rule("one_output", "only one output is wrong, in every case: its own formula",
      "Every other output is right in every case, so everything they share (the inputs, P, dS, "
      "the masks) is right too: what is left is the formula of this one output, its operands, "
      "its accumulation and its store.")
def _one_output(ctx):
    wrong = [n for n in ctx.names if ctx.wrong_in(n)]
    if len(ctx.names) > 1 and len(wrong) == 1 and len(ctx.wrong_in(wrong[0])) == len(ctx.results) and \
            all(ctx.right_everywhere(n) for n in ctx.names if n != wrong[0]):
        return f"only {wrong[0]} is wrong; {ctx.tensor_pattern()}"
    return None


# --------------------------------------------------------------------------------------
# which cases are wrong
# --------------------------------------------------------------------------------------
@rule("causal_global_index", "the causal mask compares positions inside the block, not global ones",
      "Wrong exactly where a causal mask meets several blocks: the mask must compare the global "
      "key position (the block's start plus the offset inside it) with the global query position. "
      "Within the first block the two coincide, which is why one-block cases pass.")
def _causal_global_index(ctx):
    p = ctx.pattern
    if p is None or not ctx.exact or not p.id.endswith("&causal"):
        return None
    base = p.id.split("&")[0]
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}" if base.startswith(("multi_", "multi_block")) else None


rule("causal", "only causal cases are wrong: the mask is on the wrong quantity or the wrong keys",
     "Hidden keys (j > i) must get P = 0, which the softmax gives when S = -inf *before* it. "
     "Setting S = 0 gives exp(0) = 1; zeroing P *after* a softmax leaves rows that no longer sum "
     "to 1 (only when P is rebuilt from the forward's LSE is zeroing it afterwards right). The "
     "loop bounds must still visit every visible key. Under a causal mask row 0 of dQ is zero "
     "(row 0 sees one key); if the function under test is your *reference*, test the test.",
     )(_pattern_rule(["causal"], exact=False))

rule("rescale", "wrong only when the keys come in several blocks: running sums not rescaled",
     "When the running maximum grows from m_old to m_new, everything accumulated so far (the sum "
     "l and the output accumulator) must be multiplied by exp(m_old - m_new) before the new "
     "block is added.", )(_pattern_rule(["multi_block"], kinds=("online_softmax",)))

rule("rows_bound", "a bound or mask on the query rows uses S_k",
     "Wrong exactly where there are more query rows than keys: rows past S_k are never visited, "
     "or masked away, because a loop bound or a row mask uses S_k where S_q belongs.",
     )(_pattern_rule(["sq_gt_sk"], exact=False))

rule("keys_bound", "a bound or mask on the keys uses S_q",
     "Wrong exactly where there are more keys than query rows: keys past S_q are never visited, "
     "or masked away, because a loop bound or a key mask uses S_q where S_k belongs.",
     )(_pattern_rule(["sq_lt_sk"], exact=False))

rule("lengths_mixed", "S_q and S_k are mixed up somewhere",
     "Wrong only where S_q != S_k: a bound, mask or shape uses one length for the other.",
     )(_pattern_rule(["sq_ne_sk"]))

rule("query_blocks", "wrong only where S_q spans several query blocks: the loop over query blocks",
     "A key-block program must visit every query block that sees its keys and add up their "
     "contributions: each iteration loads the block it steps to (offsets from the loop variable, "
     "not from the program id) and adds (+=) into dK, dV, stored once after the loop.",
     kinds=("dkdv",))(_pattern_rule(["multi_q*"]))

rule("key_blocks", "wrong only where S_k spans several key blocks: the loop over key blocks",
     "A query-block program must visit every key block its rows see and add up their "
     "contributions: each iteration loads the key block it steps to and adds (+=) into dQ, "
     "stored once after the loop.", kinds=("dq",))(_pattern_rule(["multi_k*"]))

rule("padding", "only lengths that are not block multiples are wrong: the partial last block",
     "Rows and keys past S_q / S_k must be masked in every load and get P = 0, and the loops "
     "and the grid must cover the partial last block.")(_pattern_rule(["ragged*"], exact=False))

rule("do_strides", "only the cases with an unusual dO are wrong: dO's own strides",
     "dO arrives as autograd makes it: contiguous, a strided view, or one number expanded to the "
     "whole shape (every stride 0, after out.sum()). Offset dO with its own four strides, "
     "never assume it is contiguous, never copy another tensor's strides.",
     )(_pattern_rule(["do_stride0", "do_strided"]))

rule("strides", "only non-contiguous inputs are wrong: offsets computed from shapes, not strides",
     "Contiguous inputs pass, strided ones (transposed [B, S, H, D] views, slices) fail. Pass "
     "every tensor's own .stride() to the kernel and use it for every offset, including the last "
     "dimension's stride.")(_pattern_rule(["strided", "qkv_strided"], exact=False))


_EVERYTHING_IDEAS = {
    "rebuild_p": "P = exp(S - LSE) with S = Q K^T * scale (masked like the forward) and the "
                 "forward's natural-log LSE, one value per query row. Check the scores, the exponent "
                 "and the LSE's broadcasting.",
    "online_softmax": "Check the scores (the scale, the mask), the running maximum, alpha = "
                      "exp(m_old - m_new), p = exp(s - m_new), the sums, O = acc / l and LSE = m + log(l).",
    "dq": "The checker sees only dQ here, so it cannot tell which step is wrong. Check, in order: "
          "the scores (scale, mask), P = exp(S - LSE), dP = dO V^T, delta, dS = P (dP - delta), "
          "dQ = dS K * scale -- and which pointer each load reads.",
}


@rule("everything_wrong", "every case and every head is wrong",
      "The backward rebuilds P = exp(S - LSE) with S = Q K^T * scale computed exactly as in the "
      "forward (same scale, same mask) and LSE the forward's natural-log log-sum-exp. Check the "
      "scores, the exponent and the LSE's broadcasting (one value per query row), then dP and dS.")
def _everything_wrong(ctx):
    if ctx.failing and len(ctx.failing) == len(ctx.results) and \
            all(not bool(t.heads_ok.any()) for r in ctx.failing for t in r.bad()):
        return ctx.tensor_pattern(), _EVERYTHING_IDEAS.get(ctx.kind, _everything_wrong.idea)
    return None


_everything_wrong.idea = ("The backward rebuilds P = exp(S - LSE) with S = Q K^T * scale computed "
                          "exactly as in the forward (same scale, same mask) and LSE the forward's "
                          "natural-log log-sum-exp. Check the scores, the exponent and the LSE's "
                          "broadcasting (one value per query row), then dP and dS.")


@rule("pattern", "no classic mistake fits; here is the pattern that was seen",
      "Compare the failing and the passing cases in the table: what do the failing ones share, "
      "which outputs are wrong, and in which rows?")
def _pattern(ctx):
    if not ctx.failing:
        return None
    r = ctx.failing[0]
    t = r.bad()[0] if r.bad() else None
    rows = ""
    if t is not None and t.row_err.numel() > 1:
        what = "keys" if t.name in ("dK", "dV") else "rows"
        rows = f"; in '{r.case.name}', {t.name}: wrong {what} {_ranges(t.bad_rows())} of 0-{t.row_err.numel() - 1}"
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}{rows}"
