"""Stage "a line of the code": Python slips one line shows, in any exercise -- ``acc *= alpha + x``,
a return inside the loop, a loop variable that counts positions multiplied by the block again,
``a & b <= c``, ``~j < i``, a chained tuple assignment, the same argument passed twice, a length or
head count read from the head-dim axis, a division by a position that starts at 0, a value never
used. Each fires only when outputs fail, and quotes the line.
"""
from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from ..engine import CODE, mistake
from ..evidence import quoted_line
from ..origin import PACKAGE, unwrap
from ..source import (SWITCH, code_lines, first_found, first_line, shape_unpacked_out_of_order, syntax_trees,
                      unused_assignments)


@mistake("discarded_value", CODE, "a line computes a value that nothing uses",
         "An expression on a line of its own changes nothing: `mask & cond` or `S.masked_fill(...)` "
         "return a new value, which must be assigned (mask = mask & cond, S = S.masked_fill(...)) -- "
         "and used: a tensor masked after what depends on it was computed (P built from S, then S "
         "masked) leaves that result unmasked. Only the methods ending in _ (masked_fill_, mul_) "
         "change a tensor in place.", proof="slips/03/discarded_value")
def _discarded_value(ctx):
    lines = unused_assignments(ctx)
    if not lines:
        return None
    evidence = f"the value of `{lines[0]}` is never used afterwards; {ctx.tensor_pattern()}"
    name = re.match(r"\s*(\w+)\s*=(?!=)", lines[0])
    pointer = name and re.fullmatch(r"(\w+?)_(?:base|ptrs?)", name.group(1))
    if pointer:   # delta_base unused, delta loaded through another tensor's pointer (a copied line)
        what = pointer.group(1)
        load = first_line(ctx, lambda c: re.match(rf"{what}\w*\s*=\s*tl\.load\(", c) and name.group(1) not in c)
        if load:
            return (f"{evidence}; `{load}` loads {what} through another tensor's pointer",
                    f"`{name.group(1)}` is made and never read, and {what} is loaded from another tensor's "
                    f"pointer and strides -- a line copied from the one above and not fully edited. Load "
                    f"{what} through `{name.group(1)}` with its own strides.")
    if name:      # a name computed, then left out: the formula it belongs in runs without it
        return (evidence, f"`{name.group(1)}` is computed and then never read: the formula it was made for "
                          f"runs without it. Find the line whose math has that term (the wrong outputs say which "
                          f"step) and put `{name.group(1)}` back into it.")
    return evidence


_LENGTH_FROM_D = re.compile(r"^\s*(?:\w+\s*,\s*)*(S_q|S_k|S|N|L|M|seq_?len\w*|n_?keys|n_?queries|len_\w+)\s*=\s*"
                            r"((?:q|k|v|o|do|dq|dk|dv|query|key|value)(?:_\w+)?)\."
                            r"(?:shape\s*\[\s*-1\s*\]|size\(\s*-1\s*\))\s*$")


mistake("length_from_head_dim", CODE, "a sequence length is read from the last axis, the head dim",
        "q, k, v are [B, H, S, D]: the last axis is D, the head dimension, and the sequence length "
        "is shape[2] (or shape[-2]; shape[0] of lesson 07's [L, D]). A loop bound or mask from "
        "shape[-1] visits D keys or rows: it drops some when S > D, and runs past the end when S < D.",
        test=quoted_line(_LENGTH_FROM_D.search), proof="slips/02o/length_from_head_dim")


_ARANGE = re.compile(r"\b(\w+)\s*=\s*torch\.arange\(\s*(?:0\s*,|[^,()=]+(?:\([^()]*\))?\s*(?:\)|,\s*\w+\s*=))")


def _zero_divisions(src: str) -> list:
    """[line] dividing by an index from torch.arange that starts at 0 (``x / i``, ``x / i[:, None]``,
    not ``x / (i + 1)``)."""
    out = []
    for name in dict.fromkeys(m.group(1) for m in _ARANGE.finditer(src)):
        divide = re.compile(rf"/\s*(?:\(\s*)?{name}\b(?:\[[^\]]*\])?(?!\s*[-+*/\w.(\[])")
        out += [line.split("#")[0].strip() for line in src.splitlines()
                if divide.search(line.split("#")[0]) and not line.strip().startswith("#")]
    return out


@mistake("divide_by_index", CODE, "a division by a position that starts at 0",
         "torch.arange(L) starts at 0: dividing by it gives inf (or 0 / 0 = NaN) in row 0 and "
         "divides every other row by one less than meant. The lesson's 1 / (i + 1) counts the keys "
         "row i sees (0 ... i): divide by i + 1.", proof="slips/07/divide_by_index")
def _divide_by_index(ctx):
    if not ctx.failing:        # row 0's inf need not reach the outputs (a gate's P + c > 0 holds)
        return None
    _, lines = first_found(ctx, _zero_divisions)
    return f"`{lines[0]}`; {ctx.tensor_pattern()}" if lines else None


_AUGMENTED = re.compile(r"^(\w+)\s*([*/])=\s*(.+)$")


def _top_level(expr: str) -> str:
    """``expr`` with every parenthesised, bracketed or braced group taken out."""
    while True:
        shorter = re.sub(r"\([^()]*\)|\[[^\[\]]*\]|\{[^{}]*\}", "", expr)
        if shorter == expr:
            return expr
        expr = shorter


def _augmented_sum(line: str) -> bool:
    m = _AUGMENTED.match(line)
    return bool(m) and re.search(r"[^\s*/]\s*[-+]\s*\S", _top_level(m.group(3))) is not None


mistake("augmented_precedence", CODE, "`x *= a + b` multiplies x by the whole sum",
        "An augmented assignment applies its operator to everything on the right: acc *= alpha + p @ v "
        "is acc = acc * (alpha + p @ v), not acc = acc * alpha + p @ v. An accumulator that starts at 0 "
        "stays 0. Write the update out: acc = acc * alpha + p @ v.",
        test=quoted_line(_augmented_sum, show=("tensors",)), proof="slips/02o/augmented_precedence")


def _positions_times_block(src: str):
    """The line multiplying a loop variable that steps by a block size by a block size again."""
    for var, _ in re.findall(r"for\s+(\w+)\s+in\s+(?:tl\.)?range\([^()]*,\s*(BLOCK_\w+)\s*\)", src):
        for line in code_lines(src):
            if re.search(rf"\b{var}\s*\*\s*BLOCK_\w+|BLOCK_\w+\s*\*\s*{var}\b", line):
                return line
    return None


@mistake("positions_times_block", CODE, "a loop variable that already counts positions is multiplied by the block size",
         "range(start, end, BLOCK) steps by BLOCK: the loop variable is already the first position of "
         "its block (0, BLOCK, 2 BLOCK, ...). Multiplied by BLOCK again, the second block starts at "
         "BLOCK^2 -- past the end, masked away. Use it as it is: offs = start_n + tl.arange(0, BLOCK_N).",
         proof="slips/03/positions_times_block")
def _positions_times_block_test(ctx):
    _, line = first_found(ctx, _positions_times_block) if ctx.failing else (None, None)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


def _return_in_loop(src: str):
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.While)) and any(isinstance(s, ast.Return) for s in node.body):
            return ast.unparse(node).splitlines()[0]
    return None


@mistake("return_in_loop", CODE, "a return inside the loop: the function returns after the first pass",
         "The return sits in the loop's body (indented one level too deep), so the first iteration "
         "returns and every later one -- the other sequences, blocks or heads -- never runs. Put the "
         "return after the loop, at the function's own level.", proof="slips/09b/return_in_loop")
def _return_in_loop_test(ctx):
    _, header = first_found(ctx, _return_in_loop) if ctx.failing else (None, None)
    return f"`{header}` holds a return; {ctx.case_pattern()}" if header else None


_HEADS_FROM_D = re.compile(r"^\s*(?:\w+\s*,\s*)*(H|H_q|H_kv|n_?heads|num_heads|heads)\s*=\s*"
                           r"((?:q|k|v|o|do|query|key|value)(?:_\w+)?)\.(?:shape\s*\[\s*-1\s*\]|size\(\s*-1\s*\))\s*$")


mistake("heads_from_head_dim", CODE, "the number of heads is read from the last axis, the head dim",
        "The head count is shape[1] -- of [B, H, S, D] and of a packed [total, H, D] alike; the last "
        "axis is D, the head dimension. Every per-head tensor drawn or allocated with that count gets D "
        "heads.", test=quoted_line(_HEADS_FROM_D.search), proof="slips/09b/heads_from_head_dim")


def _same_argument_twice(ctx):
    """(call, argument, [its two parameters]) for a call of the learner's own function that passes
    one expression (not a name alone, not a constant) for two parameters."""
    glb = getattr(unwrap(ctx.subject), "__globals__", {})
    for tree in syntax_trees(ctx):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            code = getattr(glb.get(node.func.id), "__code__", None)
            if code is None or PACKAGE in Path(code.co_filename).resolve().parents:
                continue          # the learner's own functions (a call into the package shows in its exception)
            params = code.co_varnames[:code.co_argcount]
            texts = [ast.unparse(a) for a in node.args]
            for i, t in enumerate(texts):
                if isinstance(node.args[i], (ast.Call, ast.Subscript)) and t in texts[i + 1:]:
                    j = texts.index(t, i + 1)
                    if j < len(params):
                        return node.func.id, t, (params[i], params[j])
    return None


@mistake("same_argument_twice", CODE, "one argument is passed for two parameters",
         "The call hands the same expression to two parameters (a copied argument not fully changed?): "
         "each parameter gets its own tensor, sliced its own way.", proof="slips/09b/same_argument_twice")
def _same_argument(ctx):
    found = _same_argument_twice(ctx) if ctx.failing else None
    if not found:
        return None
    fn, arg, (a, b) = found
    return f"{fn} gets `{arg}` both as {a} and as {b}; {ctx.tensor_pattern()}"


_FILL_NEG_INF = re.compile(r"where\(.*\bexp2?\(.*,\s*(?:-\s*float\(\s*[\"']inf[\"']\s*\)|float\(\s*[\"']-inf[\"']\s*\)|"
                           r"-\s*(?:math|torch)\.inf)\s*\)\s*$")


_P_FILLED = re.compile(r"^\s*([pP]\w*)\s*=\s*\1\.masked_fill\(.*,\s*(?:float\(\s*[\"']-inf[\"']\s*\)|"
                       r"-\s*float\(\s*[\"']inf[\"']\s*\)|-\s*(?:math|torch)\.inf)\s*\)\s*$")


mistake("p_filled_neg_inf", CODE, "P is filled with -inf after the exponential: the hidden entries need 0",
        "-inf belongs on the *scores*, before the exponential: exp(-inf) = 0. After it, P itself is "
        "the weight, and a hidden entry's weight is 0: where the mask is False, fill 0.0. -inf in P "
        "turns every product it enters into -inf or NaN.",
        test=quoted_line(lambda c: _FILL_NEG_INF.search(c) or _P_FILLED.search(c), show=("tensors",)),
        proof="slips/04/p_filled_neg_inf")


mistake("shape_unpack_order", CODE, "the shape is unpacked in another order than the tensor's axes",
        "q, k, v are [B, H, S, D]: batch, heads, sequence, head dim. `B, S_q, H, D = q.shape` reads the "
        "heads into S_q and the sequence into H: every size after it (the masks, the positions, the "
        "buffers) is built from the other length. Unpack in the axes' order: B, H, S_q, D = q.shape.",
        test=quoted_line(shape_unpacked_out_of_order), proof="slips/02o/shape_unpack_order")


def _bitwise_before_comparison(line: str) -> bool:
    """``mask & a <= b``: & (or |) and a comparison side by side, unparenthesised."""
    top = _top_level(line.split("#")[0])
    top = re.sub(r"^[\w.\[\], ]+[&|]=", "", top)       # seen &= j >= i: the right side is one comparison
    return bool(re.search(r"[&|]", top)) and bool(re.search(r"<=|>=|==|!=|(?<![<>=-])[<>](?![<>=])", top)) \
        and not re.search(r"\bif\b|\bwhile\b|\band\b|\bor\b", top)


mistake("bitwise_precedence", CODE, "`a & b <= c`: & binds before the comparison",
        "In Python (and Triton) & and | bind more tightly than <, <=, ==: `visible & offs_n <= offs_m` is "
        "`(visible & offs_n) <= offs_m`, a bitwise and of a mask with positions, then compared. Put every "
        "comparison in parentheses: visible & (offs_n[None, :] <= offs_m[:, None]).",
        test=quoted_line(_bitwise_before_comparison), proof="slips/03/bitwise_precedence")


mistake("invert_before_compare", CODE, "~ binds before the comparison: ~j < x is (~j) < x",
        "Python applies ~ to the name next to it before any comparison, and on integers ~j is -j - 1: "
        "~j < i - left compares -j - 1. Negate the whole comparison, ~(j < i - left), or write its "
        "opposite, j >= i - left.",
        test=quoted_line(lambda c: re.search(r"~\s*[\w.\[\]]+\s*(?:<|>|<=|>=|==|!=)", c) is not None),
        proof="slips/09m/invert_before_compare")


mistake("where_swapped", CODE, "tl.where / torch.where with 0 where the kept value belongs",
        "where(cond, a, b) takes a where cond holds and b elsewhere: where(visible, 0.0, p) zeroes the "
        "visible entries and keeps the hidden ones. The kept value comes first: where(visible, p, 0.0).",
        test=quoted_line(lambda c: re.search(
                 r"where\(\s*[\w.\[\]:, ]*(?:visible|ok|seen|keep|valid|mask|causal)[\w.\[\]:, ]*,\s*0(?:\.0*)?\s*,", c)
             is not None), proof="slips/03/where_swapped")


def _accumulation_after_loop(src: str):
    """The first ``x += ...`` placed right after a loop whose body assigns a name it reads: the
    accumulation was dedented out of the loop (it then adds the last round's term only)."""
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for loop, after in zip(body, body[1:]):
            if not (isinstance(loop, (ast.For, ast.While)) and isinstance(after, ast.AugAssign)
                    and isinstance(after.op, ast.Add)):
                continue
            inside = {n.id for n in ast.walk(ast.Module(body=loop.body, type_ignores=[]))
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            if inside & {n.id for n in ast.walk(after.value) if isinstance(n, ast.Name)}:
                return ast.get_source_segment(textwrap.dedent(src), after)
    return None


@mistake("accumulation_after_loop", CODE, "an accumulation is placed after its loop, not in it: only the last round is added",
         "`dk += ...` right after the loop, reading a tile the loop computes, runs once, after the loop has "
         "finished: it adds the last round's term only (and where the loop ran no times, the tile does not "
         "exist). A sum over the loop's rounds belongs in the loop's body: indent it.",
         proof="slips/04/accumulation_after_loop")
def _accumulation_after_loop_test(ctx):
    _, line = first_found(ctx, _accumulation_after_loop)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


def _chained_tuple(src: str):
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) > 1 and isinstance(node.value, ast.Tuple):
            return ast.unparse(node)
    return None


@mistake("chained_tuple_assignment", CODE, "`a = b = x, y` gives both names the whole tuple",
         "A chained assignment hands the same value to every target: ctx.causal = ctx.scale = causal, scale "
         "sets both to the tuple (causal, scale). Unpacking needs commas on the left: "
         "ctx.causal, ctx.scale = causal, scale.", proof="slips/05/chained_tuple_assignment")
def _chained_tuple_test(ctx):
    _, line = first_found(ctx, _chained_tuple)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


_SK = r"(?:S_k|\w+\.shape\[\s*-1\s*\]|\w+\.size\(\s*-1\s*\))"


_SQ = r"(?:S_q|\w+\.shape\[\s*-2\s*\]|\w+\.size\(\s*-2\s*\))"


mistake("lengths_swapped_in_call", CODE, "S_k and S_q are passed the other way round",
        "causal_mask(S_q, S_k, ...) and dropout_mask(seed, H, S_q, S_k, ...) take the queries' length first: "
        "their result is [S_q, S_k], a row per query. Swapped, the mask is [S_k, S_q] -- the same when "
        "S_q = S_k, so square cases pass -- and meets the scores only by accident elsewhere.",
        test=quoted_line(lambda c: not SWITCH.search(c) and re.search(rf"causal_mask\(\s*{_SK}\s*,\s*{_SQ}(?!\w)|dropout_mask\([^,()]+,[^,()]+,\s*{_SK}\s*,"
             rf"\s*{_SQ}(?!\w)", c) is not None), proof="slips/01/lengths_swapped_in_call")
