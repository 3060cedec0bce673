"""Stage "what was seen", tried last: which heads, which outputs and which cases are wrong (only
the causal ones, only where S_q > S_k, only the ragged lengths, only with a custom scale, ...),
right only in the first block, everything wrong; and last ``pattern``, the pattern that was seen,
where nothing more specific fits.
"""
from __future__ import annotations

from ..checkers import DKDV, DQ, ONLINE, REBUILD_P
from ..engine import FALLBACK, mistake
from ..evidence import facts, heads_text, ranges
from ..structure import head_sets_idea


@mistake("heads", FALLBACK, "only some (batch, head) pairs are right: the offset of the later heads is wrong",
         "Head 0 (or batch 0) is right and the others are not, so some tensor's pointer is not moved "
         "to the right head: the head offset (h * that tensor's own head stride) is missing, uses "
         "another tensor's stride, or the wrong head index. Every tensor gets its own offset; the bug "
         "hides when all tensors share one layout, which is why the cases mix layouts.",
         proof="planted/dq.no_do_head_offset")
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


def _named_by_pattern(prop_ids, only=None, exact: bool = True):
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
         "length. Every call that passes its own scale is right, so the defaulting line is the place.",
         proof="slips/05/default_scale_value")
def _default_scale_value(ctx):
    return _named_by_pattern(["scale_none"])(ctx)


@mistake("default_scale", FALLBACK, "the scale you were given is not the one used",
         "Only the case with a custom scale fails: somewhere 1/sqrt(D) is used instead of the `scale` "
         "argument (when rebuilding S, or for the factor in dQ / dK).", proof="blind/r/R02p_default_scale")
def _default_scale(ctx):
    evidence = _named_by_pattern(["custom_scale"])(ctx)
    if evidence is None:
        return None
    if "O" in ctx.names and ctx.wrong_in("O"):      # an autograd.Function: the forward already
        return evidence, ("Only the case with a custom scale fails, and O with it: the *forward* ran "
                          "with the default 1/sqrt(D). The default belongs only where no scale was "
                          "given (if scale is None: scale = 1/sqrt(D)); then pass that `scale` on to the "
                          "forward kernel's call and save the same value for the backward.")
    return evidence


@mistake("dv_formula", FALLBACK, "only dV is wrong: dV = P^T dO, check its formula or a transpose",
         "dK and dQ need P too, and they are right, so P is right. dV = P^T dO: each key's row sums "
         "P[i, j] * dO[i] over the query rows i -- in a key-block program, the transposed tile P^T "
         "times the dO tile.", proof="example/attention_backward/make_backward_lse(dv_mixed_rows)")
def _dv_formula(ctx):
    if ctx.wrong_in("dV") and all(ctx.right_everywhere(n) for n in ("dK", "dQ") if n in ctx.names) \
            and any(n in ctx.names for n in ("dK", "dQ")):
        return ctx.tensor_pattern()
    return None


@mistake("dq_formula", FALLBACK, "only dQ is wrong: dQ = dS K * scale",
         "dK and dV are right, so P and dS are right: what is left is dQ's own product -- dS times K "
         "(not K^T, not dS^T), one factor of scale -- and where it is accumulated and stored.",
         proof="example/attention_backward/make_backward(dq_plus_q)")
def _dq_formula(ctx):
    if ctx.wrong_in("dQ") and all(ctx.right_everywhere(n) for n in ("dK", "dV") if n in ctx.names) \
            and any(n in ctx.names for n in ("dK", "dV")):
        return ctx.tensor_pattern()
    return None


@mistake("ds", FALLBACK, "dV is right but dK / dQ are wrong: delta or dS is wrong",
         "dV = P^T dO needs only P, so P is fine. dK and dQ go through dS = P * (dP - delta) with "
         "dP = dO V^T and delta = rowsum(dO * O) (one number per query row). Check dP, the "
         "subtraction of delta and its broadcasting (one value per row).",
         proof="example/attention_backward/make_backward(dp_scaled)")
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
         "running sum l of exp(S - m), LSE = m + log(l).", proof="example/online_softmax/make_online(lse_output)")
def _lse_output(ctx):
    if "O" in ctx.names and ctx.right_everywhere("O") and ctx.wrong_in("LSE"):
        return ctx.tensor_pattern()
    return None


@mistake("one_output", FALLBACK, "only one output is wrong, in every case: its own formula",
         "Every other output is right in every case, so everything they share (the inputs, P, dS, "
         "the masks) is right too: what is left is the formula of this one output, its operands, "
         "its accumulation and its store.", proof="example/attention_backward/make_backward(dk_plus_k)")
def _one_output(ctx):
    wrong = [n for n in ctx.names if ctx.wrong_in(n)]
    if len(ctx.names) > 1 and len(wrong) == 1 and len(ctx.wrong_in(wrong[0])) == len(ctx.results) and \
            all(ctx.right_everywhere(n) for n in ctx.names if n != wrong[0]):
        return f"only {wrong[0]} is wrong; {ctx.tensor_pattern()}"
    return None


@mistake("causal_global_index", FALLBACK, "the causal mask compares positions inside the block, not global ones",
         "Wrong exactly where a causal mask meets several blocks: the mask must compare the global "
         "key position (the block's start plus the offset inside it) with the global query position. "
         "Within the first block the two coincide, which is why one-block cases pass.",
         proof="planted/dq.causal_block_local")
def _causal_global_index(ctx):
    p = ctx.pattern
    if p is None or not ctx.exact or not p.id.endswith("&causal"):
        return None
    base = p.id.split("&")[0]
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}" if base.startswith(("multi_", "multi_block")) else None


mistake("mask_always", FALLBACK, "the causal mask is applied even when causal is False",
        "Exactly the cases *without* the causal mask fail, and every causal case passes: the mask "
        "is applied whatever the `causal` argument says (an `if causal:` missing, or a flag that "
        "does not reach the code). Mask only when causal is True.", test=_named_by_pattern(["noncausal"]),
        proof="example/rebuild_p/make_rebuild_p(mask_always)")


mistake("causal", FALLBACK, "only causal cases are wrong: the mask is on the wrong quantity or the wrong keys",
        "Hidden keys (j > i) must get P = 0, which the softmax gives when S = -inf *before* it. "
        "Setting S = 0 gives exp(0) = 1; zeroing P *after* a softmax leaves rows that no longer sum "
        "to 1 (only when P is rebuilt from the forward's LSE is zeroing it afterwards right). The "
        "loop bounds must still visit every visible key. Under a causal mask row 0 of dQ is zero "
        "(row 0 sees one key); if the function under test is your *reference*, test the test.",
        test=_named_by_pattern(["causal"], exact=False),
        proof="example/attention_backward/make_backward_lse(mask_three_ahead)")


mistake("rescale", FALLBACK, "wrong only when the keys come in several blocks: running sums not rescaled",
        "When the running maximum grows from m_old to m_new, everything accumulated so far (the sum "
        "l and the output accumulator) must be multiplied by exp(m_old - m_new) before the new "
        "block is added.", test=_named_by_pattern(["multi_block"], only=ONLINE),
        proof="example/online_softmax/make_online(rescale)")


mistake("rows_bound", FALLBACK, "a bound or mask on the query rows uses S_k",
        "Wrong exactly where there are more query rows than keys: rows past S_k are never visited, "
        "or masked away, because a loop bound or a row mask uses S_k where S_q belongs.",
        test=_named_by_pattern(["sq_gt_sk"], exact=False), proof="planted/dkdv.query_loop_to_S_k")


mistake("keys_bound", FALLBACK, "a bound or mask on the keys uses S_q",
        "Wrong exactly where there are more keys than query rows: keys past S_q are never visited, "
        "or masked away, because a loop bound or a key mask uses S_q where S_k belongs.",
        test=_named_by_pattern(["sq_lt_sk"], exact=False), proof="planted/dq.key_loop_to_S_q")


mistake("lengths_mixed", FALLBACK, "S_q and S_k are mixed up somewhere",
        "Wrong only where S_q != S_k: a bound, mask or shape uses one length for the other.",
        test=_named_by_pattern(["sq_ne_sk"]), proof="example/attention_backward/make_backward_lse(lengths_mixed)")


mistake("query_blocks", FALLBACK, "wrong only where S_q spans several query blocks: the loop over query blocks",
        "A key-block program must visit every query block that sees its keys and add up their "
        "contributions: each iteration loads the block it steps to (offsets from the loop variable, "
        "not from the program id) and adds (+=) into dK, dV, stored once after the loop.",
        test=_named_by_pattern(["multi_q*"]), proof="planted/dkdv.same_query_tile")


mistake("key_blocks", FALLBACK, "wrong only where S_k spans several key blocks: the loop over key blocks",
        "A query-block program must visit every key block its rows see and add up their "
        "contributions: each iteration loads the key block it steps to and adds (+=) into dQ, "
        "stored once after the loop. (Under a causal mask the early query blocks see one key block "
        "only, which is why some of these cases may pass.)", test=_named_by_pattern(["multi_k*"], exact=False),
        proof="planted/dq.same_key_tile")


mistake("padding", FALLBACK, "only lengths that are not block multiples are wrong: the partial last block",
        "Rows and keys past S_q / S_k must be masked in every load and get P = 0, and the loops "
        "and the grid must cover the partial last block.", test=_named_by_pattern(["ragged*"], exact=False),
        proof="planted/dq.partial_key_block_skipped")


mistake("do_strides", FALLBACK, "only the cases with an unusual dO are wrong: dO's own strides",
        "dO arrives as autograd makes it: contiguous, a strided view, or one number expanded to the "
        "whole shape (every stride 0, after out.sum()). Offset dO with its own four strides, "
        "never assume it is contiguous, never copy another tensor's strides.",
        test=_named_by_pattern(["do_stride0", "do_strided"]),
        proof="example/autograd_function/make_function(do_strided_only)")


mistake("strides", FALLBACK, "only non-contiguous inputs are wrong: offsets computed from shapes, not strides",
        "Contiguous inputs pass, strided ones (transposed [B, S, H, D] views, slices) fail. Pass "
        "every tensor's own .stride() to the kernel and use it for every offset, including the last "
        "dimension's stride.", test=_named_by_pattern(["strided", "qkv_strided"], exact=False),
        proof="example/attention_backward/wrong_for_strided_inputs")


@mistake("first_block_only", FALLBACK, "only the first block of rows (keys) is right",
         "Every wrong output is right in its first block of rows (of keys, for dK and dV) and wrong "
         "after it: the later blocks are reached with the wrong offsets (the block's start from the "
         "program id or the loop variable, times the block size, times the row stride), or are not "
         "visited, or receive the first block's values.", proof="example/attention_backward/later_blocks_off")
def _first_block_only(ctx):
    seen = []
    for r in ctx.failing:
        bad = r.bad()
        if not bad:
            return None
        for t in bad:
            b = facts(r, t.name).get("first_rows")
            if not b:
                return None
            seen.append((r, t, b))
    if not seen:
        return None
    r, t, b = seen[0]
    what = "keys" if t.name in ("dK", "dV") else "rows"
    return (f"in '{r.case.name}' {t.name}: {what} 0-{b - 1} right, wrong {what} {ranges(t.bad_rows())}; "
            f"{ctx.case_pattern()}")


_EVERYTHING_IDEA = ("No known mistake matches these outputs exactly, and nothing sets some cases apart: "
                    "the mistake is in a step every case goes through. Check, in order: the scores S = Q K^T "
                    "* scale (same scale, same mask as the forward), P = exp(S - LSE) with the forward's "
                    "natural-log LSE (one value per query row), dP = dO V^T, delta, dS = P * (dP - delta), "
                    "then each gradient's product. The evidence's cosine says how far off the direction "
                    "is (1: only the size), the factor how far off the size.")


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


def seen_facts(ctx, limit: int = 3) -> str:
    """What the fallback diagnoses report: for the first failing cases, each wrong output's
    best-fit factor and cosine with the reference, and any structural fact."""
    out = []
    for r in ctx.failing[:2]:
        for t in r.bad()[:limit]:
            if not t.finite:
                out.append(f"'{r.case.name}' {t.name}: not finite ({t.unwritten} never written)")
                continue
            f = facts(r, t.name)
            bits = [f"cosine with the reference {t.cosine:.2f}", f"best-fit factor {t.ratio:.3g}"]
            if f.get("zero_heads"):
                bits.append(f"zero in (batch, head) {heads_text(r.case, f['zero_heads'])}")
            if f.get("equals"):
                bits.append(f"equals {' and '.join(f['equals'])}")
            if f.get("first_rows"):
                bits.append(f"right in its first {f['first_rows']} rows only")
            ok = int(t.heads_ok.sum())
            if ok:
                bits.append(f"{ok} of {t.heads_ok.numel()} heads right")
            out.append(f"'{r.case.name}' {t.name}: " + ", ".join(bits))
    return "; ".join(out)


@mistake("everything_wrong", FALLBACK, "every case and every head is wrong, with no known pattern",
         _EVERYTHING_IDEA, proof="planted/dq.count_trips")
def _everything_wrong(ctx):
    if ctx.failing and len(ctx.failing) == len(ctx.results) and \
            all(not bool(t.heads_ok.any()) for r in ctx.failing for t in r.bad()):
        evidence = f"{ctx.tensor_pattern()}; {seen_facts(ctx)}"
        if ctx.checker in _EVERYTHING_IDEAS:
            return evidence, "No known mistake matches these outputs exactly. " + _EVERYTHING_IDEAS[ctx.checker]
        return evidence
    return None


# after every mistake that names a line: some GQA cases fail, and the summed heads say which map
@mistake("gqa_head_map", FALLBACK, "a head index is wrong under grouped-query attention",
         "With GQA, the dK/dV program of K/V head h_kv adds up the query heads of its group.",
         proof="slips/04/gqa_head_map")
def _gqa_head_map(ctx):
    """Some of the GQA cases fail, not all (a map that agrees with the right one where H_kv = 1), and
    no earlier mistake named a line: the query heads dK and dV summed say which map it was."""
    if not ctx.failing or any(r.case.H == r.case.heads_kv for r in ctx.failing):
        return None
    for r in ctx.failing:
        for name in ("dK", "dV"):
            sets = r.structure.get(name, {}).get("head_sets")
            if sets:
                return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}", head_sets_idea(r.case, name, sets)
    return None


@mistake("pattern", FALLBACK, "no classic mistake fits; here is the pattern that was seen",
         "Compare the failing and the passing cases in the table: what do the failing ones share, "
         "which outputs are wrong, and in which rows?",
         proof="example/attention_backward/make_backward_lse(some_cases)")
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
