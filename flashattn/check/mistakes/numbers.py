"""Stage "NaN and constant factors": NaN computed inside the code, writes past an output's end, a
flipped sign, a factor of the scale or another constant, float32's rounding in a float64 run,
and precision lost to a lower dtype.
"""
from __future__ import annotations

import math
import re

from ..engine import NUMBERS, mistake
from ..evidence import exactly, facts
from ..source import first_line, low_dtype_casts


@mistake("nan", NUMBERS, "NaN computed inside your code",
         "NaN appeared although every element was written and no load reads past the end: "
         "something like exp(+inf), inf - inf or 0 * inf. A row whose every key is masked with -inf "
         "(max = -inf, then -inf - (-inf)) is the classic; so is exp applied before the mask.",
         proof="example/attention_backward/make_backward(nan)")
def _nan(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.nan_computed]
    if not bad:
        return None
    r, t = bad[0]
    evidence = f"{t.name} holds NaN in '{r.case.name}'; {ctx.case_pattern()}"
    if exactly(ctx, "causal"):             # only under the mask: the mask's values make the NaN
        return evidence, ("NaN only in the causal cases, none from a read past the end: the mask's own "
                          "values make it. Hidden scores must be -inf, so that exp gives exactly 0: +inf "
                          "(the minus sign forgotten) gives inf, then inf - inf or 0 * inf is NaN; so "
                          "does arithmetic on the -inf itself (S / S, -inf * 0, -inf - -inf). Apply the "
                          "mask once, as -inf on S before the exponential, or as 0 on P after it.")
    return evidence


@mistake("oob_write", NUMBERS, "memory just past the output was written: a store without its mask",
         "The kernel stored elements beyond the end of the output tensor: the store's mask is missing "
         "the row (or column) condition, so the padded rows of the last block land in whatever "
         "follows in memory -- another head's rows, or another tensor.", proof="planted/dq.store_without_row_mask")
def _oob_write(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.guard_touched]
    if not bad:
        return None
    r, t = bad[0]
    return f"'{r.case.name}': {t.guard_touched} elements written after the end of {t.name}"


@mistake("sign", NUMBERS, "the sign is flipped: yours = -reference",
         "The outputs are the reference times -1: a subtraction the wrong way round. dS = P * (dP - "
         "delta): dP first, delta subtracted.", proof="blind/t/T01_ds_sign_flipped")
def _sign(ctx):
    bad = ctx.bad_tensors()
    if bad and all(math.isfinite(t.ratio) and abs(t.ratio + 1) < 2e-2 and t.ratio_resid < 1e-2 for _, t in bad):
        return f"yours / reference = {bad[0][1].ratio:.4f} in every wrong output; {ctx.tensor_pattern()}"
    return None


@mistake("scale", NUMBERS, "the error is a constant factor tied to the softmax scale",
         "S = Q K^T * scale, so the chain rule puts one factor `scale` into dQ = dS K * scale and "
         "dK = dS^T Q * scale -- exactly one, after the matrix product -- and none into dV. A ratio "
         "of 1/scale means the factor is missing, scale means it is applied twice.", proof="slips/04/scale")
def _scale(ctx):
    bad = ctx.bad_tensors()
    if not bad:
        return None

    def factor(r, t):
        s = r.case.scale_value
        if not (math.isfinite(t.ratio) and t.ratio_resid < 1e-2):
            return None
        for f in (1.0 / s, s, (1.0 / math.sqrt(r.case.D)) / s, s * math.sqrt(r.case.D), 1 / s ** 2, s ** 2):
            # with the default scale, 1/sqrt(D) / scale is 1: a ratio of 1 is rounding, not a factor
            if abs(f - 1.0) >= 2e-2 and abs(t.ratio / f - 1.0) < 2e-2:
                return f
        return None

    if all(factor(r, t) is not None for r, t in bad):
        parts = [f"'{r.case.name}' {t.name}: yours / reference = {t.ratio:.4g} (scale = "
                 f"{r.case.scale_value:.4g}, 1/scale = {1 / r.case.scale_value:.4g})" for r, t in bad[:3]]
        return "; ".join(parts) + f"; {ctx.tensor_pattern()}"
    return None


@mistake("factor", NUMBERS, "the error is a constant factor",
         "Each wrong output is the right one times one constant (named in the evidence, with the "
         "quantities it equals). Whole numbers: a contribution added more than once (a block or a "
         "head visited twice); scale, 1/scale, sqrt(D), 1/D: a factor of the scale applied twice, "
         "missing, or of the wrong value; GROUP_SIZE: a sum over the group where one head's share "
         "belongs, or the reverse; S_q or S_k (lesson 07's L): a mean over the rows or keys where "
         "their sum belongs (.mean() for .sum()), or the reverse.", proof="slips/07/factor")
def _factor(ctx):
    seen, ratios = [], {}
    for r in ctx.failing:
        bad = r.bad()
        if not bad:
            return None
        for t in bad:
            f = facts(r, t.name).get("factor")
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


@mistake("float32_rounding", NUMBERS, "a float64 computation carries float32's rounding: a step runs in float32",
         "float32 keeps about 7 significant digits, float64 about 16: errors of 1e-8 to 1e-6 in a float64 "
         "run are float32's rounding, not a wrong formula. Some step makes float32: .float() (float32 "
         "exactly, not 'at least'), a cast to torch.float32 or to a float32 tensor's dtype, a bool or int "
         "tensor divided by a Python number, torch.tensor / zeros / ones without dtype=. Keep every tensor "
         "in the inputs' dtype (dtype=q.dtype, .to(q.dtype)).", proof="slips/09b/float32_rounding")
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


@mistake("low_precision", NUMBERS, "close to the right values but not within the tolerance: precision is lost",
         "Every wrong output is right but for rounding: a small relative error, spread over the "
         "rows, in case after case -- no formula is wrong. Some step runs in a lower precision than "
         "the inputs: a cast to fp16 or bf16 (.half(), .to(torch.float16), autocast) of the scores, "
         "the softmax or its sums, TF32 matrix products, or an accumulator kept in the inputs' low "
         "dtype. Compute the softmax and every sum and accumulation in fp32 (at least the inputs' "
         "precision) and cast only the results.", proof="slips/03/low_precision")
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
