"""Stage "how the outputs are wrong": an output exactly zero, equal to another tensor; NaN from the
online softmax's first block (alpha); NaN in row 0 only (the mask hides the diagonal); +inf at
exactly the hidden keys. They name a class of mistake, so they come after the exact formulas.
"""
from __future__ import annotations

import math
import re

import torch

from ..engine import OUTPUTS, mistake
from ..evidence import facts, heads_text
from ..source import first_line


def _zero_like(r, t) -> str:
    """How output t of case r is 'nothing accumulated': '' if it is not."""
    f = facts(r, t.name)
    if f.get("zero"):
        return "exactly 0"
    zh = f.get("zero_heads")
    if zh and all(bool(ok) or i in zh for i, ok in enumerate(t.heads_ok.flatten().tolist())):
        return f"exactly 0 in (batch, head) {heads_text(r.case, zh)}, right in the others"
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
         "over the group.", proof="planted/dkdv.group_loop_short")
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
         "accumulator, its own pointer and its own strides.", proof="planted/dkdv.dk_holds_dv")
def _equals_output(ctx):
    if not ctx.failing:
        return None
    common = {}
    for r in ctx.failing:
        for t in r.bad():
            labels = set(facts(r, t.name).get("equals", ()))
            if not labels:
                return None
            common[t.name] = common.get(t.name, labels) & labels
    if not all(common.values()):
        return None
    said = "; ".join(f"{n} equals {' and '.join(sorted(ls))}" for n, ls in common.items())
    return f"{said}, in all {len(ctx.failing)} failing cases; {ctx.tensor_pattern()}"


@mistake("alpha", OUTPUTS, "NaN from the first block: an exponential taken against the wrong maximum",
         "NaN in every case, even with one block of keys, so it starts at the first block, where "
         "the old maximum is -inf. Two exponentials meet it: alpha = exp(m_old - m_new) must be <= 1 "
         "(0 at the first block; exp(m_new - m_old) is inf there, and inf * 0 is NaN), and p = "
         "exp(s - m_new) must use the *new* maximum (exp(s - m_old) is inf at the first block). The "
         "outputs cannot tell these two apart: check both.", proof="slips/02o/alpha")
def _alpha(ctx):
    if ctx.ran and len(ctx.failing) == len(ctx.results) and \
            all("O" in r.tensors and not r.tensors["O"].finite for r in ctx.ran):
        evidence = f"NaN in all {len(ctx.results)} cases, the one-block ones too"
        # which of the two the code shows: alpha's exponent the wrong way round, or p against m_old
        alpha = first_line(ctx, lambda c: re.match(r"alpha\s*=.*exp2?\(\s*m_new\s*-\s*m\b", c))
        p_old = first_line(ctx, lambda c: re.match(r"p\s*=.*exp2?\(\s*s\s*-\s*m\s*\)", c))
        if bool(alpha) != bool(p_old):
            line = alpha or p_old
            return (f"`{line}`; {evidence}",
                    (f"alpha = exp(m_old - m_new) must be <= 1: the old maximum minus the new one (0 at the "
                     f"first block, where m_old = -inf). `{line}` is exp(m_new - m_old): inf at the first "
                     f"block, and inf * 0 is NaN." if alpha else
                     f"p = exp(s - m_new) takes the scores against the *new* maximum. `{line}` uses the old "
                     f"one, -inf at the first block: exp(+inf) = inf, and inf / inf is NaN."))
        return evidence
    return None


def _nonfinite_rows(a: torch.Tensor) -> list:
    """The query rows (dim 2) of ``a`` that hold inf or NaN anywhere."""
    bad = ~torch.isfinite(a.movedim(2, 0).reshape(a.shape[2], -1))
    return [int(i) for i in torch.nonzero(bad.any(1)).flatten()]


@mistake("mask_hides_diagonal", OUTPUTS, "the causal mask hides the diagonal: row 0 sees no key at all",
         "NaN in query row 0 only, in the causal cases only: row 0's one visible key is its own "
         "diagonal, and the mask hid it (j < i, or >=, where j <= i belongs). With every key -inf "
         "the softmax divides 0 by 0. A query sees its own key.",
         proof="example/attention_backward/make_backward(mask_hides_diagonal)")
def _mask_hides_diagonal(ctx):
    if not ctx.failing or not all(r.case.causal for r in ctx.failing):
        return None
    for r in ctx.failing:
        query_side = [t.actual for n, t in r.tensors.items() if n in ("O", "dQ", "LSE", "P")
                      and t.actual is not None and t.actual.dim() >= 3]
        if not any(_nonfinite_rows(a) == [0] for a in query_side):
            return None
    return f"NaN in row 0 only (of O, dQ, LSE or P) in every failing case; {ctx.case_pattern()}"


@mistake("mask_plus_inf", OUTPUTS, "hidden scores are set to +inf: the minus sign of -inf is missing",
         "Hidden keys must get the score -inf, so that exp gives exactly 0. With +inf, P is inf "
         "exactly at the hidden keys (and everything computed from it inf or NaN); the cases "
         "without the mask stay right.", proof="example/rebuild_p/make_rebuild_p_lse(plus_inf)")
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
