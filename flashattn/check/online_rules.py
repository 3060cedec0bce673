"""The online softmax's NaN from the first block (exercise 02's forward): alpha's exponent the
wrong way round, or p taken against the old maximum -- told apart by the learner's own line.
Tried after the fingerprints and before the NaN menu (:mod:`flashattn.check.checkers`)."""
from __future__ import annotations

import re

from .engine import OUTPUTS, mistake
from .source import first_line


@mistake("alpha", OUTPUTS, "NaN from the first block: an exponential taken against the wrong maximum",
         "NaN in every case, even with one block of keys, so it starts at the first block, where "
         "the old maximum is -inf. Two exponentials meet it: alpha = exp(m_old - m_new) must be <= 1 "
         "(0 at the first block; exp(m_new - m_old) is inf there, and inf * 0 is NaN), and p = "
         "exp(s - m_new) must use the *new* maximum (exp(s - m_old) is inf at the first block). The "
         "outputs cannot tell these two apart: check both.")
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
