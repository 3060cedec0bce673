"""The mistakes tried last, after the constant factors (stage "what was seen" of
:mod:`flashattn.check.checkers`): which heads, which outputs and which cases are wrong, and last
what was seen."""
from __future__ import annotations

import re

from . import head_rules
from .checkers import DKDV, DQ, ONLINE, REBUILD_P
from .engine import FALLBACK, NUMBERS, mistake
from .evidence import ranges
from .source import first_line, low_dtype_casts
from .structure_rules import seen_facts

# a constant factor not tied to the scale alone (2, GROUP_SIZE, sqrt(D), ...)

#: the largest relative error (per head) still read as lost precision, not a wrong formula
PRECISION_BOUND = 1e-2


def _precision_loss(r, t) -> bool:
    """Output t of case r is right but for rounding: finite, every element written, its worst
    head within PRECISION_BOUND (and 100x the tolerance), and the error spread over the rows --
    a wrong formula that is slightly off concentrates on some rows (a mask, a block's edge)."""
    if not t.finite or t.unwritten or t.guard_touched or t.row_err.numel() < 2:
        return False
    if t.worst > min(PRECISION_BOUND, 100 * t.tol):
        return False
    rows = t.row_err[t.row_err > 0]       # (rows no query reaches have no gradient, no error)
    return rows.numel() >= 2 and float((rows > 0.1 * rows.max()).double().mean()) >= 0.25


@mistake("float32_rounding", NUMBERS, "a float64 computation carries float32's rounding: a step runs in float32",
         "float32 keeps about 7 significant digits, float64 about 16: errors of 1e-8 to 1e-6 in a float64 "
         "run are float32's rounding, not a wrong formula. Some step makes float32: .float() (float32 "
         "exactly, not 'at least'), a cast to torch.float32 or to a float32 tensor's dtype, a bool or int "
         "tensor divided by a Python number, torch.tensor / zeros / ones without dtype=. Keep every tensor "
         "in the inputs' dtype (dtype=q.dtype, .to(q.dtype)).")
def _float32_rounding(ctx):
    if not ctx.failing or any(r.error is not None or r.oob_reads or r.wild for r in ctx.failing):
        return None
    bad = ctx.bad_tensors()
    if not bad or not all(t.tol <= 1e-9 and t.finite and not t.unwritten and t.worst <= 1e-5 for _, t in bad):
        return None

    worst = max(bad, key=lambda rt: rt[1].worst)
    line = first_line(ctx, lambda c: re.search(r"\.float\(\)|float32|torch\.(?:tensor|zeros|ones|empty|full)\((?!.*dtype)",
                                                c))
    return (f"every wrong output is within {worst[1].worst:.1e} of the float64 reference (tolerance "
            f"{worst[1].tol:.0e}; largest in '{worst[0].case.name}' {worst[1].name}), in {len(ctx.failing)} of "
            f"{len(ctx.results)} cases" + (f"; a line that can make float32: `{line}`" if line else ""))


@mistake("low_precision", NUMBERS, "close to the right values but not within the tolerance: precision is lost",
         "Every wrong output is right but for rounding: a small relative error, spread over the "
         "rows, in case after case -- no formula is wrong. Some step runs in a lower precision than "
         "the inputs: a cast to fp16 or bf16 (.half(), .to(torch.float16), autocast) of the scores, "
         "the softmax or its sums, TF32 matrix products, or an accumulator kept in the inputs' low "
         "dtype. Compute the softmax and every sum and accumulation in fp32 (at least the inputs' "
         "precision) and cast only the results.")
def _low_precision(ctx):
    if not ctx.failing or any(r.error is not None or r.oob_reads or r.wild or r.nondeterministic
                              for r in ctx.failing):
        return None
    bad = ctx.bad_tensors()
    if not bad or not all(_precision_loss(r, t) for r, t in bad):
        return None
    worst = max(bad, key=lambda rt: rt[1].worst)
    evidence = (f"every wrong output is within {worst[1].worst:.1e} of the reference (tolerance {worst[1].tol:.0e}; "
                f"largest in '{worst[0].case.name}' {worst[1].name}), the error spread over the rows, in "
                f"{len(ctx.failing)} of {len(ctx.results)} cases; {ctx.tensor_pattern()}")

    casts = low_dtype_casts(ctx)
    if casts:
        lines = "; ".join(f"`{c}`" for c in casts[:2])
        return (f"{evidence}; your code casts to a fixed 16-bit dtype, whatever the inputs': {lines}",
                "A cast to a fixed fp16/bf16 rounds every value of that tensor to 11 (8) significant bits, "
                "even when the inputs are fp32. Cast a tile only to the dtype of the product's other "
                "operand (x.to(k.dtype)) and keep the softmax, dS and every sum in fp32.")
    return evidence


@mistake("heads", FALLBACK, "only some (batch, head) pairs are right: the offset of the later heads is wrong",
         "Head 0 (or batch 0) is right and the others are not, so some tensor's pointer is not moved "
         "to the right head: the head offset (h * that tensor's own head stride) is missing, uses "
         "another tensor's stride, or the wrong head index. Every tensor gets its own offset; the bug "
         "hides when all tensors share one layout, which is why the cases mix layouts.")
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


def _pattern_rule(prop_ids, only=None, exact: bool = True):
    """The test of a mistake named by the property that sets the failing cases apart (one of
    ``prop_ids``; ``x*``: any id starting with x); ``only``: for that checker alone."""
    def test(ctx):
        if only is not None and ctx.checker is not only:
            return None
        p = ctx.pattern
        base = p.id.split("&")[0] if p is not None else ""
        if p is None or not any(base == i or (i.endswith("*") and base.startswith(i[:-1])) for i in prop_ids):
            return None
        if exact and not ctx.exact:
            return None
        return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}"
    return test


@mistake("default_scale_value", FALLBACK, "the default scale is wrong: only the call with scale=None fails",
         "When no scale is given, the softmax scale is 1 / sqrt(D), D = q.shape[-1]: a float division "
         "(1.0 / math.sqrt(D)). `//` floors it to 0, sqrt(D) without the 1 / inverts it, shape[-2] is a "
         "length. Every call that passes its own scale is right, so the defaulting line is the place.")
def _default_scale_value(ctx):
    return _pattern_rule(["scale_none"])(ctx)


@mistake("default_scale", FALLBACK, "the scale you were given is not the one used",
         "Only the case with a custom scale fails: somewhere 1/sqrt(D) is used instead of the `scale` "
         "argument (when rebuilding S, or for the factor in dQ / dK).")
def _default_scale(ctx):
    evidence = _pattern_rule(["custom_scale"])(ctx)
    if evidence is None:
        return None
    if "O" in ctx.names and ctx.wrong_in("O"):      # an autograd.Function: the forward already
        return evidence, ("Only the case with a custom scale fails, and O with it: the *forward* ran "
                          "with the default 1/sqrt(D). The default belongs only where no scale was "
                          "given (if scale is None: scale = 1/sqrt(D)); then pass that `scale` on to the "
                          "forward kernel's call and save the same value for the backward.")
    return evidence


# --------------------------------------------------------------------------------------
# which outputs are wrong
# --------------------------------------------------------------------------------------
@mistake("dv_formula", FALLBACK, "only dV is wrong: dV = P^T dO, check its formula or a transpose",
         "dK and dQ need P too, and they are right, so P is right. dV = P^T dO: each key's row sums "
         "P[i, j] * dO[i] over the query rows i -- in a key-block program, the transposed tile P^T "
         "times the dO tile.")
def _dv_formula(ctx):
    if ctx.wrong_in("dV") and all(ctx.right_everywhere(n) for n in ("dK", "dQ") if n in ctx.names) \
            and any(n in ctx.names for n in ("dK", "dQ")):
        return ctx.tensor_pattern()
    return None


@mistake("dq_formula", FALLBACK, "only dQ is wrong: dQ = dS K * scale",
         "dK and dV are right, so P and dS are right: what is left is dQ's own product -- dS times K "
         "(not K^T, not dS^T), one factor of scale -- and where it is accumulated and stored.")
def _dq_formula(ctx):
    if ctx.wrong_in("dQ") and all(ctx.right_everywhere(n) for n in ("dK", "dV") if n in ctx.names) \
            and any(n in ctx.names for n in ("dK", "dV")):
        return ctx.tensor_pattern()
    return None


@mistake("ds", FALLBACK, "dV is right but dK / dQ are wrong: delta or dS is wrong",
         "dV = P^T dO needs only P, so P is fine. dK and dQ go through dS = P * (dP - delta) with "
         "dP = dO V^T and delta = rowsum(dO * O) (one number per query row). Check dP, the "
         "subtraction of delta and its broadcasting (one value per row).")
def _ds(ctx):
    if "dV" in ctx.names and ctx.right_everywhere("dV") and \
            all(ctx.wrong_in(n) for n in ("dK", "dQ") if n in ctx.names) and \
            any(n in ctx.names for n in ("dK", "dQ")):         # dS feeds both: both wrong
        if ctx.checker is DKDV:     # no dQ here: dS^T and the one product that uses it
            return ctx.tensor_pattern(), (
                "dV = P^T dO needs only P, so P is fine. dK goes through dS^T = P^T * (dP^T - delta) "
                "and then the product dK += dS^T Q: check dP^T = V dO^T, delta (one value per query "
                "row, lined up with the columns of the [key, query] tile), and which tile the dK "
                "product multiplies (dS^T, not dP^T or P^T; not transposed again).")
        return ctx.tensor_pattern()
    return None


@mistake("lse_output", FALLBACK, "O is right but LSE is wrong",
         "LSE must be the natural log of the row's sum of exp(S): with the running maximum m and the "
         "running sum l of exp(S - m), LSE = m + log(l).")
def _lse_output(ctx):
    if "O" in ctx.names and ctx.right_everywhere("O") and ctx.wrong_in("LSE"):
        return ctx.tensor_pattern()
    return None


@mistake("one_output", FALLBACK, "only one output is wrong, in every case: its own formula",
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
@mistake("causal_global_index", FALLBACK, "the causal mask compares positions inside the block, not global ones",
         "Wrong exactly where a causal mask meets several blocks: the mask must compare the global "
         "key position (the block's start plus the offset inside it) with the global query position. "
         "Within the first block the two coincide, which is why one-block cases pass.")
def _causal_global_index(ctx):
    p = ctx.pattern
    if p is None or not ctx.exact or not p.id.endswith("&causal"):
        return None
    base = p.id.split("&")[0]
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}" if base.startswith(("multi_", "multi_block")) else None


mistake("mask_always", FALLBACK, "the causal mask is applied even when causal is False",
        "Exactly the cases *without* the causal mask fail, and every causal case passes: the mask "
        "is applied whatever the `causal` argument says (an `if causal:` missing, or a flag that "
        "does not reach the code). Mask only when causal is True.", test=_pattern_rule(["noncausal"]))

mistake("causal", FALLBACK, "only causal cases are wrong: the mask is on the wrong quantity or the wrong keys",
        "Hidden keys (j > i) must get P = 0, which the softmax gives when S = -inf *before* it. "
        "Setting S = 0 gives exp(0) = 1; zeroing P *after* a softmax leaves rows that no longer sum "
        "to 1 (only when P is rebuilt from the forward's LSE is zeroing it afterwards right). The "
        "loop bounds must still visit every visible key. Under a causal mask row 0 of dQ is zero "
        "(row 0 sees one key); if the function under test is your *reference*, test the test.",
        test=_pattern_rule(["causal"], exact=False))

mistake("rescale", FALLBACK, "wrong only when the keys come in several blocks: running sums not rescaled",
        "When the running maximum grows from m_old to m_new, everything accumulated so far (the sum "
        "l and the output accumulator) must be multiplied by exp(m_old - m_new) before the new "
        "block is added.", test=_pattern_rule(["multi_block"], only=ONLINE))

mistake("rows_bound", FALLBACK, "a bound or mask on the query rows uses S_k",
        "Wrong exactly where there are more query rows than keys: rows past S_k are never visited, "
        "or masked away, because a loop bound or a row mask uses S_k where S_q belongs.",
        test=_pattern_rule(["sq_gt_sk"], exact=False))

mistake("keys_bound", FALLBACK, "a bound or mask on the keys uses S_q",
        "Wrong exactly where there are more keys than query rows: keys past S_q are never visited, "
        "or masked away, because a loop bound or a key mask uses S_q where S_k belongs.",
        test=_pattern_rule(["sq_lt_sk"], exact=False))

mistake("lengths_mixed", FALLBACK, "S_q and S_k are mixed up somewhere",
        "Wrong only where S_q != S_k: a bound, mask or shape uses one length for the other.",
        test=_pattern_rule(["sq_ne_sk"]))

mistake("query_blocks", FALLBACK, "wrong only where S_q spans several query blocks: the loop over query blocks",
        "A key-block program must visit every query block that sees its keys and add up their "
        "contributions: each iteration loads the block it steps to (offsets from the loop variable, "
        "not from the program id) and adds (+=) into dK, dV, stored once after the loop.",
        test=_pattern_rule(["multi_q*"]))

mistake("key_blocks", FALLBACK, "wrong only where S_k spans several key blocks: the loop over key blocks",
        "A query-block program must visit every key block its rows see and add up their "
        "contributions: each iteration loads the key block it steps to and adds (+=) into dQ, "
        "stored once after the loop. (Under a causal mask the early query blocks see one key block "
        "only, which is why some of these cases may pass.)", test=_pattern_rule(["multi_k*"], exact=False))

mistake("padding", FALLBACK, "only lengths that are not block multiples are wrong: the partial last block",
        "Rows and keys past S_q / S_k must be masked in every load and get P = 0, and the loops "
        "and the grid must cover the partial last block.", test=_pattern_rule(["ragged*"], exact=False))

mistake("do_strides", FALLBACK, "only the cases with an unusual dO are wrong: dO's own strides",
        "dO arrives as autograd makes it: contiguous, a strided view, or one number expanded to the "
        "whole shape (every stride 0, after out.sum()). Offset dO with its own four strides, "
        "never assume it is contiguous, never copy another tensor's strides.",
        test=_pattern_rule(["do_stride0", "do_strided"]))

mistake("strides", FALLBACK, "only non-contiguous inputs are wrong: offsets computed from shapes, not strides",
        "Contiguous inputs pass, strided ones (transposed [B, S, H, D] views, slices) fail. Pass "
        "every tensor's own .stride() to the kernel and use it for every offset, including the last "
        "dimension's stride.", test=_pattern_rule(["strided", "qkv_strided"], exact=False))


_EVERYTHING_IDEAS = {
    REBUILD_P: "P = exp(S - LSE) with S = Q K^T * scale (masked like the forward) and the "
                 "forward's natural-log LSE, one value per query row. Check the scores, the exponent "
                 "and the LSE's broadcasting.",
    ONLINE: "Check the scores (the scale, the mask), the running maximum, alpha = "
                      "exp(m_old - m_new), p = exp(s - m_new), the sums, O = acc / l and LSE = m + log(l).",
    DQ: "The checker sees only dQ here, so it cannot tell which step is wrong. Check, in order: "
          "the scores (scale, mask), P = exp(S - LSE), dP = dO V^T, delta, dS = P (dP - delta), "
          "dQ = dS K * scale -- and which pointer each load reads.",
}




_EVERYTHING_IDEA = ("No known mistake matches these outputs exactly, and nothing sets some cases apart: "
                    "the mistake is in a step every case goes through. Check, in order: the scores S = Q K^T "
                    "* scale (same scale, same mask as the forward), P = exp(S - LSE) with the forward's "
                    "natural-log LSE (one value per query row), dP = dO V^T, delta, dS = P * (dP - delta), "
                    "then each gradient's product. The evidence's cosine says how far off the direction "
                    "is (1: only the size), the factor how far off the size.")


@mistake("everything_wrong", FALLBACK, "every case and every head is wrong, with no known pattern",
         _EVERYTHING_IDEA)
def _everything_wrong(ctx):
    if ctx.failing and len(ctx.failing) == len(ctx.results) and \
            all(not bool(t.heads_ok.any()) for r in ctx.failing for t in r.bad()):
        evidence = f"{ctx.tensor_pattern()}; {seen_facts(ctx)}"
        if ctx.checker in _EVERYTHING_IDEAS:
            return evidence, "No known mistake matches these outputs exactly. " + _EVERYTHING_IDEAS[ctx.checker]
        return evidence
    return None


# after every rule that names a line: some GQA cases fail, and the summed heads say which map
@mistake("gqa_head_map", FALLBACK, "a head index is wrong under grouped-query attention",
         "With GQA, the dK/dV program of K/V head h_kv adds up the query heads of its group.")
def _gqa_head_map(ctx):
    """Some of the GQA cases fail, not all (a map that agrees with the right one where H_kv = 1), and
    no earlier rule named a line: the query heads dK and dV summed say which map it was."""
    if not ctx.failing or any(r.case.H == r.case.heads_kv for r in ctx.failing):
        return None
    for r in ctx.failing:
        for name in ("dK", "dV"):
            sets = r.structure.get(name, {}).get("head_sets")
            if sets:
                return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}", head_rules._head_sets_idea(r.case, name, sets)
    return None


@mistake("pattern", FALLBACK, "no classic mistake fits; here is the pattern that was seen",
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
        rows = f"; in '{r.case.name}', {t.name}: wrong {what} {ranges(t.bad_rows())} of 0-{t.row_err.numel() - 1}"
    facts = seen_facts(ctx)
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}{rows}" + (f"; {facts}" if facts else "")
