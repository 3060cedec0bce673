"""Python and Triton slips that one line of the learner's code shows, whatever the formulas:
an augmented assignment whose right side is a sum (``acc *= alpha + x``), a loop variable that
already counts positions multiplied by the block size again, a ``return`` inside a loop, a
boundary plus one where the next boundary belongs (``cu[b] + 1``), the same argument passed
twice, a head count read from the head-dim axis, a tile addressed as if contiguous, a (batch,
head) program id times the head stride alone, P filled with -inf after the exponential.

Each fires only when outputs fail, and quotes the line; tried with the other code slips,
before the exceptions they cause (:mod:`flashattn.check.checkers`).
"""
from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from .engine import CODE, DID_NOT_RUN, mistake
from .evidence import quoted_line
from .source import code_lines, first_found, first_line, shape_unpacked_out_of_order, syntax_trees
from .origin import _PACKAGE, _unwrap



def _top_level(expr: str) -> str:
    """``expr`` with every parenthesised, bracketed or braced group taken out."""
    while True:
        shorter = re.sub(r"\([^()]*\)|\[[^\[\]]*\]|\{[^{}]*\}", "", expr)
        if shorter == expr:
            return expr
        expr = shorter


_AUGMENTED = re.compile(r"^(\w+)\s*([*/])=\s*(.+)$")


def _augmented_sum(line: str) -> bool:
    m = _AUGMENTED.match(line)
    return bool(m) and re.search(r"[^\s*/]\s*[-+]\s*\S", _top_level(m.group(3))) is not None


mistake("augmented_precedence", CODE, "`x *= a + b` multiplies x by the whole sum",
        "An augmented assignment applies its operator to everything on the right: acc *= alpha + p @ v "
        "is acc = acc * (alpha + p @ v), not acc = acc * alpha + p @ v. An accumulator that starts at 0 "
        "stays 0. Write the update out: acc = acc * alpha + p @ v.",
        test=quoted_line(_augmented_sum, show=("tensors",)))


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
         "BLOCK^2 -- past the end, masked away. Use it as it is: offs = start_n + tl.arange(0, BLOCK_N).")
def _positions_times_block_rule(ctx):
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
         "return after the loop, at the function's own level.")
def _return_in_loop_rule(ctx):
    _, header = first_found(ctx, _return_in_loop) if ctx.failing else (None, None)
    return f"`{header}` holds a return; {ctx.case_pattern()}" if header else None


_BOUNDARY_PLUS_ONE = re.compile(r"\b(\w*cu\w*)\[\s*(\w+)\s*\]\s*\+\s*1\b")


mistake("boundary_plus_one", CODE, "a boundary plus one where the next boundary belongs: cu[b] + 1 for cu[b + 1]",
        "cu_seqlens holds the sequences' boundaries: sequence b is cu_seqlens[b] : cu_seqlens[b + 1]. "
        "cu_seqlens[b] + 1 is one row past the start, so the slice keeps the sequence's first row only.",
        test=quoted_line(_BOUNDARY_PLUS_ONE.search))


_HEADS_FROM_D = re.compile(r"^\s*(?:\w+\s*,\s*)*(H|H_q|H_kv|n_?heads|num_heads|heads)\s*=\s*"
                           r"((?:q|k|v|o|do|query|key|value)(?:_\w+)?)\.(?:shape\s*\[\s*-1\s*\]|size\(\s*-1\s*\))\s*$")


mistake("heads_from_head_dim", CODE, "the number of heads is read from the last axis, the head dim",
        "The head count is shape[1] -- of [B, H, S, D] and of a packed [total, H, D] alike; the last "
        "axis is D, the head dimension. Every per-head tensor drawn or allocated with that count gets D "
        "heads.", test=quoted_line(_HEADS_FROM_D.search))


def _same_argument_twice(ctx):
    """(call, argument, [its two parameters]) for a call of the learner's own function that passes
    one expression (not a name alone, not a constant) for two parameters."""
    glb = getattr(_unwrap(ctx.subject), "__globals__", {})
    for tree in syntax_trees(ctx):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            code = getattr(glb.get(node.func.id), "__code__", None)
            if code is None or _PACKAGE in Path(code.co_filename).resolve().parents:
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
         "each parameter gets its own tensor, sliced its own way.")
def _same_argument(ctx):
    found = _same_argument_twice(ctx) if ctx.failing else None
    if not found:
        return None
    fn, arg, (a, b) = found
    return f"{fn} gets `{arg}` both as {a} and as {b}; {ctx.tensor_pattern()}"


_CONTIGUOUS = re.compile(r"tl\.(?:load|store)\(\s*\w+\s*\+\s*\w+\[[^\]]*\]\s*\*\s*(?:HEAD_DIM|BLOCK_D|D)\b")


mistake("contiguous_assumed", CODE, "a tile is addressed as if its tensor were contiguous",
        "A row's address is row * stride_s + column * stride_d, with the tensor's own strides: a row "
        "is HEAD_DIM elements long only when the tensor is contiguous and unpadded. A transposed "
        "[B, S, H, D] view or a padded head dim has other strides, and offs * HEAD_DIM reads other rows.",
        test=quoted_line(lambda c: _CONTIGUOUS.search(c) and "stride" not in c))


_FLAT_PROGRAM = re.compile(r"\bpid_bh(?:\.to\(tl\.int64\))?\s*\*\s*stride_\w*_h\b")


mistake("flat_batch_head", CODE, "a (batch, head) program id times the head stride alone",
        "pid_bh * stride_h reaches the right (batch, head) only when stride_b = H * stride_h, a "
        "contiguous [B, H, S, D] tensor. Split the id, b = pid_bh // H and h = pid_bh % H, and offset "
        "b * stride_b + h * stride_h: a transposed or padded tensor has other strides.",
        test=quoted_line(_FLAT_PROGRAM.search))


_P_FILLED = re.compile(r"^\s*([pP]\w*)\s*=\s*\1\.masked_fill\(.*,\s*(?:float\(\s*[\"']-inf[\"']\s*\)|"
                       r"-\s*float\(\s*[\"']inf[\"']\s*\)|-\s*(?:math|torch)\.inf)\s*\)\s*$")
_FILL_NEG_INF = re.compile(r"where\(.*\bexp2?\(.*,\s*(?:-\s*float\(\s*[\"']inf[\"']\s*\)|float\(\s*[\"']-inf[\"']\s*\)|"
                           r"-\s*(?:math|torch)\.inf)\s*\)\s*$")


mistake("p_filled_neg_inf", CODE, "P is filled with -inf after the exponential: the hidden entries need 0",
        "-inf belongs on the *scores*, before the exponential: exp(-inf) = 0. After it, P itself is "
        "the weight, and a hidden entry's weight is 0: where the mask is False, fill 0.0. -inf in P "
        "turns every product it enters into -inf or NaN.",
        test=quoted_line(lambda c: _FILL_NEG_INF.search(c) or _P_FILLED.search(c), show=("tensors",)))


mistake("shape_unpack_order", CODE, "the shape is unpacked in another order than the tensor's axes",
        "q, k, v are [B, H, S, D]: batch, heads, sequence, head dim. `B, S_q, H, D = q.shape` reads the "
        "heads into S_q and the sequence into H: every size after it (the masks, the positions, the "
        "buffers) is built from the other length. Unpack in the axes' order: B, H, S_q, D = q.shape.",
        test=quoted_line(shape_unpacked_out_of_order))


mistake("divides_by_p", CODE, "the dropout rescale divides by p, the drop probability",
        "Dropout keeps each element with probability 1 - p and scales the kept ones by 1 / (1 - p), so that "
        "the expectation is unchanged. Dividing by p (dropout_p) scales by the *drop* probability -- and "
        "divides by zero when dropout is off (p = 0). Write keep / (1 - dropout_p).",
        test=quoted_line(lambda c: re.search(r"/\s*\(?\s*dropout_p\s*\)?\s*(?:$|[),#*])", c) is not None))


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
        test=quoted_line(_bitwise_before_comparison))

mistake("cdiv_swapped", CODE, "triton.cdiv's arguments are swapped: cdiv(BLOCK, S) is 1",
        "triton.cdiv(a, b) is ceil(a / b): the number of blocks is cdiv(S, BLOCK), the length first. "
        "cdiv(BLOCK, S) is 1 (or 0-1 blocks) whatever the length, so only the first block gets a program.",
        test=quoted_line(lambda c: re.search(r"cdiv\(\s*BLOCK\w*\s*,", c) is not None))


mistake("row_vector_as_column", CODE, "a per-row vector is loaded as a column: [BLOCK_M, 1] before its [:, None]",
        "The LSE and delta hold one number per query row: load them with the 1-D offsets, "
        "tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok), a vector [BLOCK_M]. Loaded with "
        "offs_m[:, None] they are already a column [BLOCK_M, 1], and the lse[:, None] that meets the "
        "[BLOCK_M, BLOCK_N] tile makes a third axis, which tl.dot refuses.",
        test=quoted_line(lambda c: re.search(r"^(?:lse|delta|m_i|l_i)\w*\s*=\s*tl\.load\(.*offs_\w+\[:,\s*None\]", c) is not None))


# --------------------------------------------------------------------------------------
# blind set P: Python, PyTorch and Triton calls that do something else than they look like
# --------------------------------------------------------------------------------------
_INPUTS = ("q", "k", "v", "o", "do", "lse", "delta")

mistake("mask_or", CODE, "a load or store mask joins its conditions with | (or): both must hold",
        "A tile's mask keeps an element where *either* condition holds when the two are joined with |: "
        "a row past the end with a valid column (or the reverse) is read from outside the tensor. Each "
        "element needs both: row_ok[:, None] & d_ok[None, :].",
        test=quoted_line(lambda c: re.search(r"mask\s*=\s*[^,]*\[[^\]]*\]\s*\|\s*[\w.]+\s*\[", c) is not None))

mistake("operand_other_inf", CODE, "an operand tile is loaded with other=-inf",
        "The masked-off elements of a q, k, v or dO tile enter a matrix product, where -inf times 0 "
        "is NaN, which spreads to every score of the row. Operand tiles take other=0.0 (they then add "
        "nothing); -inf belongs on the scores, before the softmax, and +inf on the LSE of padded rows.",
        test=quoted_line(lambda c: re.search(r"other\s*=\s*(?:float\(\s*['\"]-inf|-\s*float\(\s*['\"]inf|-\s*math\.inf)", c)
             is not None and "lse" not in c.lower()))

mistake("inplace_transpose", CODE, "a tensor is transposed in place (transpose_): every later use sees it turned",
        "x.transpose_(-1, -2) (and t_(), swapaxes_) turns x itself round and returns it: from that line "
        "on, every use of x sees the transposed tensor. For a product with x^T write x.transpose(-1, -2), "
        "without the underscore: a transposed view, x unchanged.",
        test=quoted_line(lambda c: any(m.group(1) not in _INPUTS     # (an input's: input_modified tells its shape)
             for m in re.finditer(r"\b(\w+)\.(?:transpose_|t_|swapaxes_|swapdims_)\(", c))))

mistake("reshape_for_transpose", CODE, "reshape (view) to the transposed shape is not a transpose",
        "x.reshape(..., n, m) of an [..., m, n] tensor reads the same values in memory order into the new "
        "shape: rows and columns get mixed, not swapped. A transpose is x.transpose(-1, -2) (x.mT).",
        test=quoted_line(lambda c: re.search(r"\.(?:reshape|view)\([^)]*shape\[-1\]\s*,\s*[\w.]+\.shape\[-2\]", c) is not None))

mistake("transpose_of_vector", CODE, ".T of a 1-D tensor: it stays the same vector",
        "A 1-D tensor has no second axis to swap: its .T (.mT, .t()) is the same vector, still lined up "
        "with the last axis when it broadcasts. A column needs an axis of its own: torch.arange(S_q)[:, None] "
        "(or .unsqueeze(-1)).",
        test=quoted_line(lambda c: re.search(r"arange\([^()]*(?:\([^()]*\)[^()]*)*\)\s*\.(?:T|mT|t\(\))(?!\w)", c) is not None))

mistake("gradients_as_list", CODE, "backward returns a list: autograd counts it as one value",
        "autograd reads backward's result as a tuple of one gradient per input of forward; a list is one "
        "object, so it counts as one gradient (\"expected 5, got 1\"). Return a tuple: "
        "return dq, dk, dv, None, None.", test=quoted_line(lambda c: re.match(r"return\s*\[", c) is not None))

mistake("expm1_for_exp", CODE, "expm1 where exp belongs: e^x - 1",
        "torch.expm1(x) is e^x - 1 (made for precision near x = 0), not e^x: every P comes out 1 too small "
        "and the hidden keys (x = -inf) get -1 instead of 0. P = torch.exp(S - lse[..., None]).",
        test=quoted_line(lambda c: "expm1(" in c))

mistake("invert_before_compare", CODE, "~ binds before the comparison: ~j < x is (~j) < x",
        "Python applies ~ to the name next to it before any comparison, and on integers ~j is -j - 1: "
        "~j < i - left compares -j - 1. Negate the whole comparison, ~(j < i - left), or write its "
        "opposite, j >= i - left.",
        test=quoted_line(lambda c: re.search(r"~\s*[\w.\[\]]+\s*(?:<|>|<=|>=|==|!=)", c) is not None))

mistake("where_swapped", CODE, "tl.where / torch.where with 0 where the kept value belongs",
        "where(cond, a, b) takes a where cond holds and b elsewhere: where(visible, 0.0, p) zeroes the "
        "visible entries and keeps the hidden ones. The kept value comes first: where(visible, p, 0.0).",
        test=quoted_line(lambda c: re.search(
                 r"where\(\s*[\w.\[\]:, ]*(?:visible|ok|seen|keep|valid|mask|causal)[\w.\[\]:, ]*,\s*0(?:\.0*)?\s*,", c)
             is not None))

mistake("inplace_on_input", CODE, "an input or saved tensor is changed in place (a method ending in _)",
        "A method with a trailing _ (mul_, add_, div_, exp_, ...) changes the tensor itself. On q, k, v, "
        "dO, O or the LSE that is a tensor the caller still holds or that forward saved for backward, "
        "overwritten on the way: o.mul_(do) overwrites the forward's output, q.mul_(scale) the caller's "
        "q. In-place methods belong only on tensors your code made: write o * do, q * scale.",
        test=quoted_line(lambda c: re.search(r"\b(?:o|q|k|v|do|lse|out|grad_out|dout)\.(?:mul_|add_|sub_|div_|exp_|clamp_|"
             r"masked_fill_|copy_|zero_)\(", c) is not None))

mistake("tile_transposed_at_load", CODE, "an operand tile is transposed at its load: [BLOCK_D, rows]",
        "Every tile is loaded a row per position -- q, dO [BLOCK_M, BLOCK_D]; k, v [BLOCK_N, BLOCK_D] -- "
        "and turned round only inside the product that needs it: S = tl.dot(q, tl.trans(k)), while "
        "dQ += dS K is tl.dot(ds, k) with k as loaded. A tile transposed at its load is [BLOCK_D, BLOCK_N] "
        "for every later line, and the products that take it as loaded multiply the wrong axes.",
        test=quoted_line(lambda c: re.match(
                 r"(?:q|k|v|do)\s*=\s*(?:tl\.trans\(\s*tl\.load\(|tl\.load\(.*offs_d\[\s*:\s*,\s*None\s*\])", c)
             is not None))


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
         "exist). A sum over the loop's rounds belongs in the loop's body: indent it.")
def _accumulation_after_loop_rule(ctx):
    _, line = first_found(ctx, _accumulation_after_loop)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


# --------------------------------------------------------------------------------------
# blind set P, second round: lines that look right and do something else
# --------------------------------------------------------------------------------------
mistake("dot_acc_and_add", CODE, "`x += tl.dot(a, b, acc=x)` adds x twice",
        "tl.dot(a, b, acc=x) already returns x + a b. Assigned with +=, x is added once more: every step "
        "doubles what was summed before. Write one of the two: x += tl.dot(a, b) or x = tl.dot(a, b, acc=x).",
        test=quoted_line(lambda c: (m := re.match(r"(\w+)\s*\+=\s*tl\.dot\(", c)) is not None and
             re.search(rf"acc\s*=\s*{m.group(1)}\b", c) is not None))

@mistake("atomic_add_store", CODE, "an output is written with tl.atomic_add: it adds onto what the output held",
         "Each program owns its block of rows -- no other program writes them -- so a plain tl.store is "
         "right. tl.atomic_add adds the tile onto the output's old contents, and the launcher's output "
         "is made with torch.empty: whatever memory it got comes through. Store it: tl.store(...).")
def _atomic_add_store(ctx):
    if any(r.nondeterministic for r in ctx.results):
        return None                  # results that change from run to run: programs share rows (race says it)
    line = first_line(ctx, lambda c: "tl.atomic_add(" in c)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


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
         "(a slice is a view, so copy_ reaches dq).")
def _loop_name_rebound_rule(ctx):
    _, line = first_found(ctx, _loop_name_rebound)
    return f"`{line}`; {ctx.tensor_pattern()}" if line else None


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
         "ctx.causal, ctx.scale = causal, scale.")
def _chained_tuple_rule(ctx):
    _, line = first_found(ctx, _chained_tuple)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


mistake("forward_half", CODE, "the forward runs on 16-bit copies of the inputs",
        "q.half() (or .to(torch.float16), .bfloat16()) makes a 16-bit copy: O and the LSE come out of "
        "the copies, in 16-bit precision, while backward gets the saved full-precision q, k, v beside a "
        "16-bit O and dO. Call the kernels on the tensors as they came; the dtype is the caller's choice.",
        test=quoted_line(lambda c: re.search(r"\.(?:half|bfloat16)\(\)|\.to\(\s*(?:dtype\s*=\s*)?torch\.(?:float16|half|bfloat16)",
             c) is not None))

mistake("dq_from_dkdv", DID_NOT_RUN, "dQ is taken from the dK/dV function: its first output is dK",
        "attention_backward_dkdv returns (dK, dV); attention_backward_dq returns dQ. Index [0] of the "
        "first is dK -- shaped like k, [B, H_kv, S_k, D] -- and equals dQ's shape only when S_q = S_k "
        "without GQA. Call attention_backward_dq for dQ.",
        test=quoted_line(lambda c: re.match(r"dq\s*=.*dkdv\(", c) is not None))

mistake("key_blocks_reversed", CODE, "the key blocks are visited last to first",
        "The online softmax may visit blocks in any order -- but the causal mask hides the *last* "
        "blocks from the first rows entirely. Visited first, such a block leaves m = -inf, and "
        "exp(m - m_new) = exp(-inf - -inf) is NaN. Walk the keys forwards: range(0, S_k, block_n).",
        test=quoted_line(lambda c: re.search(r"for\s.*\bin\s+reversed\(|range\([^()]*,\s*-1\s*,\s*-", c) is not None))

mistake("key_loop_over_queries", CODE, "the loop over key blocks runs to S_q",
        "The loop walks the *keys*: range(0, S_k, block_n). With S_q where S_k belongs it stops early "
        "when S_q < S_k (the last keys never enter the sum) and runs past the keys when S_q > S_k (an "
        "empty block, whose max over nothing raises).",
        test=quoted_line(lambda c: re.search(r"for\s+\w+\s+in\s+range\([^()]*\bS_q\b[^()]*,\s*block_n\s*\)", c) is not None))

mistake("divides_by_exp_lse", CODE, "O is divided by exp(LSE) = l * e^m, not by l",
        "acc holds sum_j exp(s_j - m) v_j: the running max m is already taken out. Dividing by "
        "exp(LSE) = exp(m) * l takes it out a second time, so each row is e^(-m) times too small. "
        "O = acc / l; the LSE, m + log(l), is returned beside it.",
        test=quoted_line(lambda c: re.search(r"/\s*\(?\s*torch\.exp\(\s*(?:m\s*\+\s*torch\.log\(\s*l|\w*lse)|/\s*\w*lse\w*\.exp\(",
             c) is not None))

mistake("mask_made_float", DID_NOT_RUN, "the mask is made with torch.ones / torch.zeros without dtype=torch.bool",
        "torch.ones(S_q, S_k) is float32: &= with a comparison (a bool tensor) raises, and a float "
        "mask is no mask to masked_fill or ~. Make it bool: torch.ones(S_q, S_k, dtype=torch.bool).",
        test=quoted_line(lambda c: re.match(r"(?:seen|mask|visible|keep)\w*\s*=\s*torch\.(?:ones|zeros)\((?![^)]*dtype)[^)]*\)\s*$",
             c) is not None))

mistake("to_other_tensor", CODE, "`.to(q)` takes q's dtype too, not only its device",
        "Tensor.to(other) converts to other's dtype *and* device: a bool mask .to(q) becomes a float64 "
        "mask (and ~ on it raises). For the device alone write .to(q.device).",
        test=quoted_line(lambda c: re.search(r"\.to\(\s*(?:q|k|v|o|do|x|out)\s*\)", c) is not None))


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
         "Make a real tensor of that size -- torch.ones(S_q, S_k, dtype=torch.bool), or .expand(...).clone().")
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
         "raises where the lengths differ).")
def _positions_not_column(ctx):
    _, line = first_found(ctx, _positions_left_flat)
    return f"`{line}`; {ctx.case_pattern()}" if line else None
