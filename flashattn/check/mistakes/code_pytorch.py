"""Stage "a line of the code": PyTorch calls that do something else than they look like --
``transpose_`` (in place), a reshape for a transpose, ``.T`` of a vector or of a 4-D tensor,
``expm1``, ``.to(q)``, an expanded tensor written in place, +inf for the hidden scores, delta left
a product, positions in uint8, a mask of uint8, exp of raw scores that overflows. Each quotes the
line.
"""
from __future__ import annotations

import ast
import re
import textwrap

from ..engine import CODE, mistake
from ..evidence import quoted_line
from ..source import SWITCH, code_lines, first_found, first_line


_INPUTS = ("q", "k", "v", "o", "do", "lse", "delta")


mistake("inplace_transpose", CODE, "a tensor is transposed in place (transpose_): every later use sees it turned",
        "x.transpose_(-1, -2) (and t_(), swapaxes_) turns x itself round and returns it: from that line "
        "on, every use of x sees the transposed tensor. For a product with x^T write x.transpose(-1, -2), "
        "without the underscore: a transposed view, x unchanged.",
        test=quoted_line(lambda c: any(m.group(1) not in _INPUTS     # (an input's: input_modified tells its shape)
             for m in re.finditer(r"\b(\w+)\.(?:transpose_|t_|swapaxes_|swapdims_)\(", c))),
        proof="slips/01/inplace_transpose")


mistake("reshape_for_transpose", CODE, "reshape (view) to the transposed shape is not a transpose",
        "x.reshape(..., n, m) of an [..., m, n] tensor reads the same values in memory order into the new "
        "shape: rows and columns get mixed, not swapped. A transpose is x.transpose(-1, -2) (x.mT).",
        test=quoted_line(lambda c: re.search(r"\.(?:reshape|view)\([^)]*shape\[-1\]\s*,\s*[\w.]+\.shape\[-2\]", c) is not None),
        proof="slips/01/reshape_for_transpose")


mistake("transpose_of_vector", CODE, ".T of a 1-D tensor: it stays the same vector",
        "A 1-D tensor has no second axis to swap: its .T (.mT, .t()) is the same vector, still lined up "
        "with the last axis when it broadcasts. A column needs an axis of its own: torch.arange(S_q)[:, None] "
        "(or .unsqueeze(-1)).",
        test=quoted_line(lambda c: re.search(r"arange\([^()]*(?:\([^()]*\)[^()]*)*\)\s*\.(?:T|mT|t\(\))(?!\w)", c) is not None),
        proof="slips/09m/transpose_of_vector")


mistake("expm1_for_exp", CODE, "expm1 where exp belongs: e^x - 1",
        "torch.expm1(x) is e^x - 1 (made for precision near x = 0), not e^x: every P comes out 1 too small "
        "and the hidden keys (x = -inf) get -1 instead of 0. P = torch.exp(S - lse[..., None]).",
        test=quoted_line(lambda c: "expm1(" in c), proof="slips/02p/expm1_for_exp")


def _loop_name_rebound(src: str):
    """``for buf, t in zip(outputs, values): buf = ...``: the loop's name rebound, nothing written."""
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.For):
            continue
        names = {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        for stmt in node.body:     # (x = f(x) updates a value the loop handed over: not this slip)
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in stmt.targets) \
                    and not {t.id for t in stmt.targets if isinstance(t, ast.Name)} & \
                    {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)}:
                return ast.unparse(stmt)
    return None


@mistake("loop_name_rebound", CODE, "assigning to the loop's name writes nothing into the tensor it stood for",
         "`for buf, t in zip((dq[qs], ...), grads): buf = ...` makes the name buf point at a new tensor; the "
         "slice dq[qs] it stood for is not touched. Write into the tensor: dq[qs] = ..., or buf.copy_(...) "
         "(a slice is a view, so copy_ reaches dq).", proof="slips/09b/loop_name_rebound")
def _loop_name_rebound_test(ctx):
    _, line = first_found(ctx, _loop_name_rebound)
    return f"`{line}`; {ctx.tensor_pattern()}" if line else None


mistake("to_other_tensor", CODE, "`.to(q)` takes q's dtype too, not only its device",
        "Tensor.to(other) converts to other's dtype *and* device: a bool mask .to(q) becomes a float64 "
        "mask (and ~ on it raises). For the device alone write .to(q.device).",
        test=quoted_line(lambda c: re.search(r"\.to\(\s*(?:q|k|v|o|do|x|out)\s*\)", c) is not None),
        proof="slips/09b/to_other_tensor")


def _written_after_expand(src: str):
    """A name made by .expand(...) and later written in place (&=, |=, [...] =, x.op_()): the
    expanded view has stride 0, one element stands for many."""
    lines = list(code_lines(src))
    for n, line in enumerate(lines):
        m = re.match(r"(\w+)\s*=.*\.expand(?:_as)?\(", line)
        if m and not re.search(r"\.(?:clone|contiguous)\(\)\s*$", line):
            name = m.group(1)
            if any(re.match(rf"{name}\s*(?:[&|+\-*/]=|\[.*\]\s*=)|{name}\.\w+_\(", later) for later in lines[n + 1:]):
                return line
    return None


@mistake("inplace_on_expanded", CODE, "an expanded tensor is written in place: one element stands for many",
         "x.expand(S_q, S_k) makes a view with stride 0: every position reads the same element, and PyTorch "
         "refuses to write into it in place ('more than one element ... refers to a single memory location'). "
         "Make a real tensor of that size -- torch.ones(S_q, S_k, dtype=torch.bool), or .expand(...).clone().",
         proof="slips/09m/inplace_on_expanded")
def _inplace_on_expanded(ctx):
    _, line = first_found(ctx, _written_after_expand)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


def _positions_left_flat(src: str):
    """``rows = torch.arange(S_q)`` (query positions) never turned into a column, yet compared with
    key positions: both lie along the last axis and broadcast as rows."""
    lines = list(code_lines(src))
    for n, line in enumerate(lines):
        m = re.match(r"(rows|i|q_pos\w*|query_pos\w*|offs_m)\s*=\s*[^=]*torch\.arange\([^\[]*\)$", line)
        if not m or re.search(r"\.(?:unsqueeze|view|reshape)\(|\.T\b", line):
            continue
        name = m.group(1)
        later = lines[n + 1:]
        if any(re.search(rf"\b{name}\s*\[[^\]]*None|\b{name}\.(?:unsqueeze|view|reshape)\(", c) for c in later):
            continue
        if any(re.search(rf"\b{name}\b\s*(?:<=|>=|<|>)|(?:<=|>=|<|>)\s*{name}\b(?!\s*\[)", c) for c in later):
            return line
    return None


@mistake("positions_not_column", CODE, "the query positions are a flat vector, not a column",
         "A mask compares every query row i with every key j: i must run down the rows -- a column "
         "[S_q, 1], torch.arange(S_q)[:, None] -- and j along the columns, [1, S_k]. A flat arange lines up "
         "with the *last* axis, beside the keys: the comparison then pairs position n with position n (or "
         "raises where the lengths differ).", proof="slips/02o/positions_not_column")
def _positions_not_column(ctx):
    _, line = first_found(ctx, _positions_left_flat)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


mistake("hidden_plus_inf", CODE, "the hidden scores are filled with +inf: -inf belongs there",
        "A hidden key must get P = 0, so its score is -inf before the softmax (exp(-inf) = 0). +inf makes "
        "the row's maximum infinite and exp(inf - inf) = NaN across the whole row. "
        "S.masked_fill(hidden, float(\"-inf\")).",
        test=quoted_line(lambda c: re.search(r"masked_fill\(.*,\s*(?:float\(\s*['\"]\+?inf['\"]\s*\)|math\.inf|torch\.inf)\s*\)",
             c) is not None), proof="slips/01/hidden_plus_inf")


mistake("delta_not_summed", CODE, "delta is left the elementwise product dO * O, not summed over the head dim",
        "delta_i = rowsum(dO * O)_i, one number per query row: (do * o).sum(dim=-1, keepdim=True), "
        "[..., S_q, 1]. The product alone is [..., S_q, D], which meets dP [..., S_q, S_k] only where D "
        "happens to equal S_k.",
        test=quoted_line(lambda c: re.match(r"delta\s*=\s*\(?\s*(?:do|o|dout|grad_out)\s*\*\s*(?:do|o|out)\s*\)?\s*$", c) is not None),
        proof="slips/01/delta_not_summed")


mistake("delta_as_matmul", CODE, "delta is a matrix product: it is a row-wise dot product",
        "delta_i = sum_d dO[i, d] O[i, d] pairs each row of dO with the *same* row of O: "
        "(do * o).sum(-1, keepdim=True). dO @ O^T pairs every row with every row, an [S_q, S_q] matrix.",
        test=quoted_line(lambda c: re.match(r"delta\s*=[^*]*@", c) is not None),
        proof="slips/01/delta_as_matmul")   # (not rowsum(P * (dO @ V^T)))


mistake("T_of_4d", CODE, "`.T` of a 4-D tensor reverses all four axes",
        "On a tensor of more than two dimensions .T reverses *every* axis: k.T of [B, H, S_k, D] is "
        "[D, S_k, H, B]. Swap the last two only: k.transpose(-1, -2) (or k.mT).",
        test=quoted_line(lambda c: re.search(r"\b(?:q|k|v|o|do|dS|ds|P|S)\.T\b", c) is not None and
             not SWITCH.search(c)), proof="slips/02p/T_of_4d")


mistake("lse_recomputed", CODE, "the LSE is recomputed instead of the forward's being used",
        "P = exp(S - LSE) with the forward's LSE, one per query row: the lesson's point is that it is "
        "*given*. A logsumexp recomputed here -- over dim=-2, the queries, gives columns that sum to 1 -- "
        "is not the forward's. Use lse[..., None].", test=quoted_line(lambda c: "logsumexp(" in c),
        proof="slips/02p/lse_recomputed")


mistake("mask_given_dtype", CODE, "causal_mask gets a dtype where it takes a device",
        "causal_mask(S_q, S_k, device) builds its positions with torch.arange(..., device=device): "
        "S.dtype there is no device. Pass S.device.",
        test=quoted_line(lambda c: re.search(r"causal_mask\([^()]*\.dtype\s*\)", c) is not None),
        proof="slips/02p/mask_given_dtype")


mistake("unsigned_positions", CODE, "positions in an unsigned dtype: i - left wraps around below 0",
        "uint8 holds 0 ... 255 and has no negative numbers: i - left for a row i < left wraps around to "
        "about 255, past every key. Positions are plain integers: torch.arange(S_q) (int64).",
        test=quoted_line(lambda c: re.search(r"arange\([^)]*dtype\s*=\s*torch\.uint8", c) is not None),
        proof="slips/09m/unsigned_positions")


mistake("uint8_mask", CODE, "a uint8 mask: ~ flips its bits, and masked_fill wants bool",
        "Old PyTorch built masks as uint8 0/1. On uint8, ~ is a bitwise not (0 -> 255, 1 -> 254: both "
        "'true'), and masked_fill refuses anything but bool. Build the mask as bool: "
        "torch.ones(..., dtype=torch.bool).tril(), or causal_mask(S_q, S_k, device).",
        test=quoted_line(lambda c: re.search(r"dtype\s*=\s*torch\.uint8|\.byte\(\)", c) is not None and "arange(" not in c),
        proof="slips/02p/uint8_mask")


mistake("range_past_end", CODE, "the loop's end is one past the length: range(0, S + 1, block)",
        "range(0, S_k, block_n) already covers the last, partial block. With S_k + 1 (an 'inclusive' "
        "end), a length that block_n divides gets one more block, which starts at S_k and is empty.",
        test=quoted_line(lambda c: re.search(r"range\(\s*[^(),]+,\s*[\w.]+\s*\+\s*1\s*,\s*\w*block\w*\s*\)", c, re.I) is not None),
        proof="slips/02o/range_past_end")


@mistake("exp_overflow", CODE, "exp of a raw score overflows: subtract the row's maximum or LSE inside the exp",
         "float32's exp overflows to inf past 88.7 (fp16's past 11): exp(S) / exp(LSE) and exp(S) / sum "
         "exp(S) are inf / inf = NaN for a large score, although they equal exp(S - LSE) on paper. The "
         "softmax is safe only as exp(S - m) with m the row's maximum (or LSE), which keeps every "
         "exponent <= 0.", proof="slips/02p/exp_overflow")
def _exp_overflow(ctx):
    if not ctx.failing or not all(r.case.name.startswith("large scores") for r in ctx.failing):
        return None
    line = first_line(ctx, lambda c: re.search(r"\bexp2?\(\s*[\w.\[\]]+\s*(?:[*/][^-()]*)?\)", c) is not None)
    return (f"`{line}`; " if line else "") + ctx.case_pattern()


mistake("positions_from_other_length", CODE, "query positions built from S_k (or key positions from S_q)",
        "Rows are queries, columns keys: i = torch.arange(S_q)[:, None] (one per query), j = "
        "torch.arange(S_k)[None, :] (one per key). A position vector from the other length has the "
        "other axis's size: it lines up only where S_q = S_k.",
        test=quoted_line(lambda c: not SWITCH.search(c) and re.match(
             r"\s*(?:(?:i|rows?|q_pos\w*|query_pos\w*)\s*=\s*torch\.arange\(\s*S_k"
             r"|(?:j|cols?|k_pos\w*|key_pos\w*)\s*=\s*torch\.arange\(\s*S_q)\b", c) is not None),
        proof="slips/02o/positions_from_other_length")
