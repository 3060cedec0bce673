"""Stage "a formula's line": lines of the formulas whose outputs look like several other
mistakes -- the scores divided by the scale, the scale on the LSE too, a softmax without dim, a
causal comparison without the diagonal, delta summed over the wrong axis, block numbers used as
positions, a constant handed to apply, a loop that never reads its variable, a group's query head
without the group's size, a mask along the tile's other axis. After the exact matches (an output
that equals a wrong formula is stronger evidence than a line that looks like one), before the
mistakes that only say where the outputs are wrong. Each quotes the line.
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap

from ..checkers import DKDV, DQ
from ..engine import FORMULA_LINE, mistake
from ..evidence import quoted_line
from ..origin import unwrap
from ..source import calls, code_lines, first_found, forward_params, line_of


_DIVIDES = re.compile(r"/\s*(?:ctx\.|self\.)?scale\b(?!\s*\*\*)")


#: a line that builds the scores: assigned to S (s, sT, scores, qk, ...) from a product
_SCORES = re.compile(r"^\s*(?:s|sT|s_?t|scores?|qk|qkT|logits?)\s*=.*(?:@|tl\.dot\(|matmul\(|einsum\(|bmm\()", re.I)


mistake("scale_divides", FORMULA_LINE, "the scores are divided by the scale",
        "The scale already is 1/sqrt(D): S = Q K^T * scale. Dividing by it multiplies the scores by "
        "sqrt(D) instead, scale^2 = 1/D times too large -- large enough that exp overflows to inf "
        "and then NaN. (Dividing by sqrt(D) is the same as multiplying by the scale, and fine.)",
        test=quoted_line(lambda c: _DIVIDES.search(c) and _SCORES.search(c), show=("tensors",)),
        proof="slips/02p/scale_divides")


_ON_LSE = re.compile(r"-\s*\w*lse\w*(?:\[[^\]]*\])?\s*\)\s*\*\s*(?:ctx\.)?scale\b|"
                     r"\bscale\s*\*\s*\([^()]*-\s*\w*lse\w*")


mistake("scale_on_lse", FORMULA_LINE, "the scale multiplies the LSE too",
        "P = exp(S * scale - LSE): the LSE was computed from the *scaled* scores, so it is "
        "subtracted as it is. (S - LSE) * scale scales the LSE a second time, and every rebuilt "
        "probability is off by a factor exp(LSE * (1 - scale)) that differs from row to row.",
        test=quoted_line(_ON_LSE.search, show=("tensors",)), proof="slips/09b/scale_on_lse")


_SOFTMAX_NO_DIM = re.compile(r"\b(?:functional|F)\.(?:log_)?softmax\(\s*[^,()]*(?:\([^()]*\)[^,()]*)*\)|"
                             r"\bnn\.Softmax\(\s*\)")


mistake("softmax_no_dim", FORMULA_LINE, "softmax is called without dim",
        "F.softmax(x) with no dim lets PyTorch pick one (a deprecated implicit choice, with a "
        "warning): dim=1 for a 4-D [B, H, S_q, S_k] tensor, the heads, and 0 for 0-, 1- and 3-D "
        "ones. The softmax of attention runs over the keys, the last axis: dim=-1.",
        test=quoted_line(_SOFTMAX_NO_DIM.search, show=("tensors",)), proof="slips/01/softmax_no_dim")


_QUERY_NAMES = re.compile(r"^(offs_m|rows?|i|qi|q_idx|queries|q_pos|m_idx)$")


_KEY_NAMES = re.compile(r"^(offs_n|cols?|j|kj|k_idx|keys?|k_pos|n_idx)$")


def _side(name: str, index) -> str | None:
    if _KEY_NAMES.match(name):
        return "key"
    if _QUERY_NAMES.match(name):
        return "query"
    if index:     # in an [S_q, S_k] matrix the columns ([None, :]) are the keys
        return "key" if "None" in index.split(",")[0] else "query"
    return None


_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}


_INDEX = r"(\w+)(\[\s*(?:None\s*,\s*:|:\s*,\s*None)\s*\])?"


_COMPARE = re.compile(rf"{_INDEX}\s*(<=|>=|<|>)\s*{_INDEX}")


def _strict_causal(src: str):
    """(line, 'visible'|'hidden') of a causal comparison that leaves out the diagonal: key < query
    where it says which keys are seen, key >= query where it says which are hidden (inside a
    masked_fill)."""
    for code in code_lines(src):
        for m in _COMPARE.finditer(code):
            before, after = code[:m.start()].rstrip(), code[m.end():].lstrip()
            if before[-1:] in ("+", "-", "*", "/", ".") or after[:1] in ("+", "-", "*", "/", ".", "("):
                continue                              # a comparison with an offset: not the causal one
            a, ia, op, b, ib = m.groups()
            if a == b:        # one index for both sides (lazy attention's i): the broadcast says which
                if not (ia and ib):
                    continue
                sa, sb = _side("", ia), _side("", ib)
            else:
                sa, sb = _side(a, ia), _side(b, ib)
            if {sa, sb} != {"key", "query"}:
                continue
            if sa == "query":
                op = _FLIP[op]                        # now: key <op> query
            hidden = "masked_fill" in code[:m.start()]
            if (not hidden and op == "<") or (hidden and op == ">="):
                return code, "hidden" if hidden else "visible"
    return None


@mistake("causal_strict", FORMULA_LINE, "the causal mask leaves out the diagonal: a query does not see its own key",
         "Causal attention lets query i see keys j <= i -- its own position included. Seen keys are "
         "j <= i (hidden ones j > i); with j < i (or j >= i hidden) the diagonal is masked too: each "
         "row loses its own key, and the first row sees nothing at all.", proof="slips/07/causal_strict")
def _causal_strict(ctx):
    if not ctx.failing or not all(getattr(r.case, "causal", True) for r in ctx.failing):
        return None
    _, found = first_found(ctx, _strict_causal)
    if not found:
        return None
    line, meaning = found
    said = "the keys seen are j < i" if meaning == "visible" else "the keys hidden are j >= i"
    return f"`{line}`: {said}; {ctx.tensor_pattern()}"


_DELTA_SUM = re.compile(r"^\s*delta\w*\s*=.*\.sum\(\s*(?:dim\s*=\s*)?(-2|0)\s*[,)]|"
                        r"^\s*delta\w*\s*=.*torch\.sum\(.*,\s*(?:dim\s*=\s*)?(-2|0)\s*[,)]")


mistake("delta_axis", FORMULA_LINE, "delta is summed over the wrong axis",
        "delta has one number per query row: delta_i = sum_j P_ij dP_ij = sum_d dO_id O_id, a sum "
        "along the last axis (keys, or the head dim) -- sum(-1, keepdim=True). Summed over axis -2 "
        "(the query rows) it holds a number per column instead, and dS = P * (dP - delta) subtracts "
        "the wrong value from every entry.", test=quoted_line(_DELTA_SUM.search, show=("tensors",)),
        proof="slips/07/delta_axis")


def _block_numbers_as_positions(src: str):
    """(for line, slice line) of ``for j in range(n_blocks)`` (a count made with // or cdiv)
    whose body slices ``[j:j + block]``: block numbers 0, 1, 2 used as positions."""
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return None
    lines = textwrap.dedent(src).splitlines()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.For) and isinstance(node.target, ast.Name) and
                isinstance(node.iter, ast.Call) and getattr(node.iter.func, "id", "") == "range" and
                len(node.iter.args) == 1):
            continue
        count = ast.unparse(node.iter.args[0])
        if "//" not in count and "cdiv" not in count:
            continue
        var = node.target.id
        body = "\n".join(lines[node.body[0].lineno - 1:node.end_lineno])
        m = re.search(rf"\[[^\]]*\b{var}\s*:\s*{var}\s*\+[^\]]*\]", body)
        if m:
            return lines[node.lineno - 1].strip(), line_of(body, m.group(0))
    return None


@mistake("block_numbers_as_positions", FORMULA_LINE, "the loop counts blocks, but its number is used as a position",
         "range(S // block) yields block numbers 0, 1, 2, ...; a slice [j : j + block] takes them as key "
         "positions, so the blocks overlap (keys 0-15, 1-16, ...) and most keys are never visited. "
         "Loop over positions -- for start in range(0, S, block) -- or turn the number into one "
         "(start = j * block). And // drops a partial last block: range(0, S, block) keeps it.",
         proof="slips/02o/block_numbers_as_positions")
def _block_numbers(ctx):
    if not ctx.failing:
        return None
    _, found = first_found(ctx, _block_numbers_as_positions)
    if not found:
        return None
    loop, sliced = found
    return f"`{loop}` with `{sliced}`; {ctx.case_pattern()}"


_LITERAL = re.compile(r"^(True|False|None|-?\d+(?:\.\d*)?)$")


@mistake("apply_constant", FORMULA_LINE, "apply is handed a constant where the caller's argument belongs",
         "The wrapper's arguments reach the kernels only through Function.apply(...): a constant "
         "there (False for causal, 1.0 for scale) ignores what the caller asked for, so every call "
         "that asks for something else is computed as the constant says. Pass the wrapper's own "
         "argument on.", proof="slips/05/apply_constant")
def _apply_constant(ctx):
    if not ctx.failing:
        return None
    try:
        wrapper = list(inspect.signature(unwrap(ctx.subject)).parameters)
    except (TypeError, ValueError):
        return None
    for src in ctx.sources:
        for text, args in calls(src, r"(\w+)\.apply"):
            params = forward_params(ctx, text.split(".apply")[0].split()[-1])
            if not params or len(args) != len(params):
                continue
            for arg, param in zip(args, params):
                value = arg.split("=")[-1].strip()
                if _LITERAL.match(value) and param in wrapper:
                    return (f"`{line_of(src, text.splitlines()[0])}` passes {value} where forward takes "
                            f"{param}, which the wrapper receives as its argument {param}; {ctx.case_pattern()}")
    return None


def _idle_loops(src: str) -> list:
    """[(for line, variable)] of loops whose body never reads their variable (``for start_n in
    ...`` with offs_n = tl.arange(0, BLOCK_N)): every iteration does the same work."""
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return []
    lines = textwrap.dedent(src).splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and not node.target.id.startswith("_"):
            var = node.target.id
            reads = any(isinstance(n, ast.Name) and n.id == var and isinstance(n.ctx, ast.Load)
                        for stmt in node.body for n in ast.walk(stmt))
            if not reads:
                out.append((lines[node.lineno - 1].split("#")[0].strip(), var))
    return out


@mistake("loop_variable_unused", FORMULA_LINE, "a loop never uses its own variable: every iteration does the same",
         "A loop over blocks moves to its block through the loop variable: offsets = start + "
         "tl.arange(0, BLOCK) (or a slice start : start + block). Where the body never reads the "
         "variable, every iteration loads the first block again: the others are never seen and the "
         "first is counted once per iteration.", proof="slips/03/loop_variable_unused")
def _loop_variable_unused(ctx):
    if not ctx.failing:
        return None
    _, loops = first_found(ctx, _idle_loops)
    if not loops:
        return None
    line, var = loops[0]
    return f"`{line}`: the body never reads {var}; {ctx.case_pattern()}; {ctx.tensor_pattern()}"


_GROUP_HEAD = re.compile(r"^\s*(\w+)\s*=\s*(?:(\w*kv\w*)\s*\+\s*(\w+)|(\w+)\s*\+\s*(\w*kv\w*))\s*$")


mistake("group_head_index", FORMULA_LINE, "the query heads of a group are numbered without the group's size",
        "Under GQA, K/V head h_kv serves GROUP_SIZE = H // H_kv query heads, numbered h_kv * "
        "GROUP_SIZE + g for g = 0 ... GROUP_SIZE - 1. h_kv + g makes the groups overlap (K/V head 1 "
        "would take query heads 1 and 2 instead of 2 and 3); without GQA (GROUP_SIZE = 1) it happens "
        "to be right.", test=quoted_line(_GROUP_HEAD.match, show=("case", "tensors")),
        proof="slips/04/group_head_index")


_KEY_VECTORS = r"(?:col_ok|offs_n|cols?)"


_QUERY_VECTORS = r"(?:row_ok|offs_m|rows?)"


def _mask_axes(src: str, checker):
    """(line, what is wrong) of a mask (not a load's or store's) that lines the query vector up
    with the tile's key axis: in the dK/dV kernel's transposed tile S^T (rows: keys, the LSE as
    lse[None, :]) the queries run along the columns, [None, :]; in the dQ kernel's S along the
    rows, [:, None]."""
    transposed = re.search(r"lse\w*\s*\[\s*None\s*,\s*:\s*\]", src) is not None
    if checker is DKDV and transposed:
        wrong = [(rf"\b{_QUERY_VECTORS}\[\s*:\s*,\s*None\s*\]", "the query rows", "[None, :]", "columns"),
                 (rf"\b{_KEY_VECTORS}\[\s*None\s*,\s*:\s*\]", "the keys", "[:, None]", "rows")]
    elif checker is DQ:
        wrong = [(rf"\b{_QUERY_VECTORS}\[\s*None\s*,\s*:\s*\]", "the query rows", "[:, None]", "rows"),
                 (rf"\b{_KEY_VECTORS}\[\s*:\s*,\s*None\s*\]", "the keys", "[None, :]", "columns")]
    else:
        return None
    for code in code_lines(src):
        if re.search(r"tl\.(load|store)\(|\bmask\s*=|stride", code) or "=" not in code:
            continue
        for pattern, what, right, axis in wrong:
            m = re.search(pattern, code)
            if m:
                return code, (f"`{m.group(0)}` lines {what} up with the other axis: in this kernel's tile "
                                      f"they run along the {axis}, {right}")
    return None


@mistake("mask_axes", FORMULA_LINE, "a mask is broadcast along the other axis of the tile",
         "A tile's row vector is [:, None], its column vector [None, :]. The dQ kernel's tile S = Q K^T "
         "has the queries as rows (row_ok[:, None], offs_m[:, None]) and the keys as columns; the "
         "dK/dV kernel's S^T = K Q^T the other way round (col_ok[:, None], row_ok[None, :]). Swapped, "
         "the padded rows are not hidden and real ones are, at the edges only -- so only lengths "
         "that are not block multiples fail.", proof="slips/04/mask_axes")
def _mask_axes_test(ctx):
    if not ctx.failing:
        return None
    _, found = first_found(ctx, lambda src: _mask_axes(src, ctx.checker))
    if not found:
        return None
    line, what = found
    return f"`{line}`: {what}; {ctx.case_pattern()}; {ctx.tensor_pattern()}"
