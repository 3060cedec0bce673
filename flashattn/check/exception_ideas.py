"""Ideas for a learner's exception, chosen from the error itself: its message, its sizes, the
line it came from and the cases it raised in. The specific ones first (an operand transposed, a
mask built [S_k, S_q], an input written in place, .T on a 4-D tensor), then by the error's kind.
"""
from __future__ import annotations

import re
from typing import Optional


_SIZES = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)")


def _specific_idea(r):
    """An idea from the error's own numbers and line, where they pin the mistake."""
    message, line, c = str(r.error), r.error_where or "", r.case
    if re.search(r"\w\.T\b", line):
        return (".T reverses *every* dimension of a tensor: on [B, H, S, D] it gives [D, S, H, B]. "
                "Transpose the last two only: .transpose(-1, -2) (or .mT).")
    if re.search(r"must be a (bool|float)", message):
        return ("An argument arrived in the wrong place: compare the call with the function's "
                "signature, argument by argument -- and, in an autograd.Function, what forward saved "
                "in ctx (ctx.causal = causal, ctx.scale = scale, not the other way round).")
    if "more than one element of the written-to tensor" in message or "a leaf Variable that requires grad" in message:
        return ("An input was modified in place (a method ending in _, like mul_, or +=, *= on an "
                "argument). Never write into the inputs: the caller still needs them, and the dO "
                "autograd hands over may be one number expanded to the whole shape (stride 0), "
                "which cannot be written. Compute into a new tensor (do * o, not do.mul_(o)).")
    m = _SIZES.search(message)
    if m and {int(m.group(1)), int(m.group(2))} == {c.S_q, c.S_k} and c.S_q != c.S_k:
        rows = re.search(r"dimension (-2|2)\b", message) is not None     # the query axis of [B, H, S_q, S_k]
        if "mask" in line and not rows:
            return ("The mask is built with its two lengths swapped: it must be [S_q, S_k] like "
                    "the scores (query rows first), and its two sizes met S_q and S_k the wrong way "
                    f"round here ({m.group(1)} vs {m.group(2)}).")
        if rows:
            return ("An [S_k, S_q] matrix met an [S_q, S_k] one: one operand is transposed. Write "
                    "down each product's shape: S and P [S_q, S_k]; dP = dO V^T is [S_q, S_k] "
                    "(not V dO^T); dV = P^T dO and dK = dS^T Q need the transpose.")
    return None


_EXCEPTION_IDEAS = [
    (r"must match the size of tensor|broadcast|size of tensor a",
     "Two operands' shapes do not line up. A value per query row (delta, the LSE) subtracted "
     "from every key of its row must be a column, [..., S_q, 1] (keepdim=True, or [..., None]); "
     "lined up with the keys instead, it only fits when S_q == S_k -- and is wrong there."),
    (r"same dtype|dtype mismatch|expected scalar type",
     "Two operands of one operation have different dtypes (fp16 scores and an fp32 LSE, say): "
     "type promotion makes the result fp32 and the next matrix product refuses to mix it with "
     "fp16. Cast on purpose (.float() for the arithmetic, .to(q.dtype) for the results)."),
    (r"mat1 and mat2|cannot be multiplied|size mismatch|Expected size for first two dimensions",
     "A matrix product's inner dimensions do not agree: check which operand is transposed "
     "(Q K^T, P^T dO, dO V^T, dS K, dS^T Q) -- the cases with S_q != S_k tell them apart."),
    (r"view size is not compatible|\.view",
     ".view needs memory laid out for it: on a non-contiguous tensor use .reshape, or avoid "
     "reshaping at all."),
    (r"incorrect number of gradients",
     "backward returns one value per input of forward, in order, None for the non-tensor ones."),
    (r"must be a bool|must be a float|must be a torch.Tensor",
     "An argument arrived in the wrong place: compare the call with the function's signature, "
     "argument by argument."),
]


def exception_idea(raised: list, sep) -> Optional[str]:
    """The idea for the exceptions in ``raised`` (case results); ``sep``: the property that sets
    the raising cases apart, as :func:`flashattn.check.diagnose.separating` gives it."""
    idea = next((i for i in map(_specific_idea, raised) if i), None)
    if idea:
        return idea
    if sep and sep[1] and sep[0].id == "multi_block":
        return ("It raised only where the keys come in several blocks: the code that runs for the "
                "second block on. Check the block's slice (start : start + block_n, not "
                "start : block_n) and everything offset by the block's start.")
    message = str(raised[0].error)
    return next((idea for pattern, idea in _EXCEPTION_IDEAS if re.search(pattern, message)), None)
