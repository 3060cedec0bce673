"""Stage "a line of the code": Triton kernel lines of exercises 03 and 04 -- a loop that counts
blocks but steps by rows, the scores tile built the other way round, an offset times the other
axis' stride, an address with another tensor's stride or head, ``<=`` in a mask, masks joined with
``|``, ``other=-inf`` on an operand, ``acc += tl.dot(..., acc=acc)``, ``tl.atomic_add`` for a
store, a kernel called like a function, ``tl.arange`` over a runtime size, an early return. Each
quotes the line (or the launch's call).
"""
from __future__ import annotations

import ast
import re
import textwrap

from ..checkers import DKDV, DQ
from ..engine import CODE, mistake
from ..evidence import quoted_line
from ..source import SWITCH, calls, first_found, first_line, line_of


def _loop_mixing_units(src: str):
    """The text of a ``range(start, stop, BLOCK)`` whose stop counts blocks (tl.cdiv(...) or
    ... // BLOCK) while its step is a block of rows."""
    for text, args in calls(src, r"(?:tl\.)?(?:static_)?range"):
        if len(args) != 3 or not re.fullmatch(r"BLOCK_\w+", args[2]):
            continue
        stop = args[1]
        if re.fullmatch(r"(?:tl\.|triton\.)?cdiv\(.*\)", stop) or re.search(r"//\s*BLOCK_\w+\s*$", stop):
            return text
    return None


@mistake("loop_units", CODE, "a loop counts blocks but steps by rows",
         "range(start, stop, BLOCK) walks row positions: start, start + BLOCK, ... up to the number of "
         "rows. tl.cdiv(S, BLOCK) is a number of blocks, so as a stop beside a step of BLOCK it ends "
         "the loop after the first block or two. Either loop over positions (range(start, S, BLOCK)) "
         "or over block indices (range(0, tl.cdiv(S, BLOCK)) with offsets index * BLOCK).",
         proof="slips/03/loop_units")
def _loop_units(ctx):
    if any(r.error is not None for r in ctx.failing):
        return None
    src, text = first_found(ctx, _loop_mixing_units)
    return f"`{line_of(src, text)}`; {ctx.case_pattern()}; {ctx.tensor_pattern()}" if text else None


_DOT_TRANS = re.compile(r"tl\.dot\(\s*(\w+)\s*,\s*tl\.trans\(\s*(\w+)\s*\)")


def _scores_tile(src: str, checker):
    """The line building the scores with the other kernel's orientation: Q K^T in a kernel that
    uses LSE along the tile's columns (lse[None, :]: the dK/dV kernel's S^T), or K Q^T in one
    that uses it along the rows (lse[:, None]: the dQ kernel's S)."""
    lse_columns = re.search(r"lse\w*\s*\[\s*None\s*,\s*:\s*\]", src) is not None
    lse_rows = re.search(r"lse\w*\s*\[\s*:\s*,\s*None\s*\]", src) is not None
    for m in _DOT_TRANS.finditer(src):
        a, b = m.group(1).lower(), m.group(2).lower()
        if checker is DKDV and a.startswith("q") and b.startswith("k") and lse_columns and not lse_rows:
            return line_of(src, m.group(0)), "S = Q K^T [BLOCK_M, BLOCK_N]", "S^T = K Q^T [BLOCK_N, BLOCK_M]", \
                "lse[None, :]"
        if checker is DQ and a.startswith("k") and b.startswith("q") and lse_rows and not lse_columns:
            return line_of(src, m.group(0)), "S^T = K Q^T [BLOCK_N, BLOCK_M]", "S = Q K^T [BLOCK_M, BLOCK_N]", \
                "lse[:, None]"
    return None


@mistake("scores_orientation", CODE, "the scores tile is built the other way round from the rest of the kernel",
         "A dK/dV program owns a block of keys, so the lesson's kernel works on the transposed tile "
         "S^T = K Q^T (rows: keys, columns: queries): P^T = exp(S^T - LSE[None, :]), dV += P^T dO, "
         "dK += dS^T Q. A dQ program works on S = Q K^T (rows: queries) with LSE[:, None]. Build "
         "the scores in the orientation the rest of your kernel uses (with square blocks the shapes "
         "agree and nothing raises: every value is just read across the diagonal).",
         proof="slips/03/scores_orientation")
def _scores_orientation(ctx):
    _, found = first_found(ctx, lambda src: _scores_tile(src, ctx.checker))
    if not found:
        return None
    line, built, wanted, lse = found
    return f"`{line}` builds {built}, but the kernel reads the LSE as {lse}, which belongs to {wanted}; {ctx.tensor_pattern()}"


_OFFSET_TIMES_STRIDE = re.compile(r"\b(\w+)\s*\[[^\]]*\]\s*\*\s*(stride\w*)")


def _axis(name: str, kind: str):
    """'row' or 'dim' for an offset (kind 'offset') or stride (kind 'stride') name in the lessons'
    dialect (offs_m, offs_n, offs_d; stride_q_s, stride_q_d), None where the name does not say."""
    n = name.lower()
    if kind == "offset":
        if re.search(r"(^|_)(d|dim|head_dim)$|^d_?offs", n):
            return "dim"
        return "row" if re.search(r"(^|_)(m|n|q|k|s|rows?|cols?|seq)$", n) else None
    if re.search(r"_(d|dim)$", n):
        return "dim"
    return "row" if re.search(r"_(s|seq|m|n|row|tok)$", n) else None


def _stride_axis_slips(src: str) -> list:
    """[line] where a row offset is multiplied by a head-dim stride or the reverse."""
    out = []
    for line in src.splitlines():
        code = line.split("#")[0]
        for m in _OFFSET_TIMES_STRIDE.finditer(code):
            offset, stride = _axis(m.group(1), "offset"), _axis(m.group(2), "stride")
            if offset and stride and offset != stride and code.strip() not in out:
                out.append(code.strip())
    return out


@mistake("stride_axes", CODE, "an offset is multiplied by the stride of the other axis",
         "A tile's address is base + rows * (the sequence stride) + columns * (the head-dim stride): "
         "offs_m or offs_n (positions) go with stride_x_s, offs_d (head-dim entries) with stride_x_d. "
         "Swapped, a contiguous tensor is read across its rows instead of along them -- and where the "
         "strides happen to agree nothing shows.", proof="slips/03/stride_axes")
def _stride_axes(ctx):
    _, lines = first_found(ctx, _stride_axis_slips)
    if not lines:
        return None
    shown = "; ".join(f"`{line}`" for line in lines[:2])
    return f"{shown} pairs a row offset with a head-dim stride (or the reverse); {ctx.tensor_pattern()}"


_BASE = re.compile(r"^\s*(\w+?)_base\s*=\s*(\w+)\s*\+")


_LOAD = re.compile(r"tl\.(?:load|store)\(\s*(\w+?)(?:_base|_ptrs?)?\s*\+")


_TERM = re.compile(r"(\w+)(?:\.to\(\s*tl\.int64\s*\))?\s*\*\s*stride_([a-z]+)_([bhsd])\b")


_INDEX_AXIS = {"b": "b", "batch": "b", "h": "h", "h_kv": "h", "head": "h", "offs_m": "s", "offs_n": "s",
               "offs_d": "d"}


_AXIS_NAME = {"b": "batch", "h": "head", "s": "sequence", "d": "head-dim"}


_QUERY_SIDE = {"q", "do", "lse", "delta", "dq", "o"}


_KV_SIDE = {"k", "v", "dk", "dv"}


def _address_slips(src: str) -> list:
    """[(line, what is wrong)]: a tensor's address with a stride of another tensor (K's head
    offset with stride_v_h), a head index of the other side under GQA (dQ at h_kv, dK at the
    query head h, LSE at the group index g), or the other side's positions (LSE at offs_n)."""
    kv_named = re.search(r"\b\w*kv\w*\s*=", src) is not None      # the kernel names its K/V head
    out = []
    for line in src.splitlines():
        code = line.split("#")[0]
        m = _BASE.match(code) or _LOAD.search(code)
        if not m:
            continue
        tensor = (m.group(2) if m.re is _BASE else m.group(1)).lower()
        if tensor not in _QUERY_SIDE | _KV_SIDE:
            continue
        if m.re is _LOAD:            # a query-side tile at the key positions, or the reverse
            bare = re.search(r"\+\s*(offs_[mn])\b(?:\s*\[[^\]]*\])?\s*(?=[,)+]|$)", code)
            if bare:                 # a position added without the tensor's stride
                out.append((code.strip(), f"{bare.group(1)} is added without {tensor}'s stride: that "
                                          f"assumes its positions are adjacent in memory (stride 1)"))
            offsets = set(re.findall(r"\boffs_([mn])\b", code))
            if tensor in _QUERY_SIDE and offsets == {"n"}:
                out.append((code.strip(), f"{tensor} holds a value per query row but is addressed at the key positions offs_n"))
            elif tensor in _KV_SIDE and offsets == {"m"}:
                out.append((code.strip(), f"{tensor} holds a value per key but is addressed at the query rows offs_m"))
        for var, owner, axis in _TERM.findall(code):
            index_axis = _INDEX_AXIS.get(var.lower())
            if index_axis and index_axis != axis and owner == tensor:
                out.append((code.strip(), f"{var} is multiplied by stride_{owner}_{axis}: the {_AXIS_NAME[index_axis]} "
                                          f"index goes with the {_AXIS_NAME[index_axis]} stride, "
                                          f"stride_{owner}_{index_axis}"))
            elif owner != tensor and owner in _QUERY_SIDE | _KV_SIDE:
                out.append((code.strip(), f"{tensor}'s address uses stride_{owner}_{axis}, {owner}'s stride"))
            elif axis == "h" and tensor in _QUERY_SIDE and ("kv" in var.lower() or var in ("g", "group")):
                what = "the K/V head" if "kv" in var.lower() else "the index inside the group"
                out.append((code.strip(), f"{tensor} is a query-side tensor but is addressed at {var}, {what}"))
            elif axis == "h" and tensor in _KV_SIDE and kv_named and "kv" not in var.lower():
                out.append((code.strip(), f"{tensor} belongs to the K/V head but is addressed at {var}"))
    return out


def _mask_slips(src: str) -> list:
    """[(call, what is wrong)]: a key-side tile (K, V, dK, dV) loaded or stored with the query
    rows' mask row_ok, or a query-side one with the key mask col_ok."""
    out = []
    for text, args in calls(src, r"tl\.(?:load|store)"):
        if not args:
            continue
        m = re.match(r"(\w+?)(?:_base|_ptrs?)?\s*\+", args[0])
        mask = next((a.split("=", 1)[1] for a in args if re.match(r"mask\s*=", a)), "")
        tensor = m.group(1).lower() if m else ""
        uses = set(re.findall(r"\b(row_ok|col_ok)\b", mask))
        if tensor in _KV_SIDE and uses == {"row_ok"}:
            out.append((text.split("\n")[0].strip(), f"{tensor} (a row per key) is masked with row_ok, the query rows' mask: col_ok"))
        elif tensor in _QUERY_SIDE and uses == {"col_ok"}:
            out.append((text.split("\n")[0].strip(), f"{tensor} (a row per query) is masked with col_ok, the keys' mask: row_ok"))
    return out


@mistake("address_terms", CODE, "an address is built with another tensor's stride, head or positions",
         "Each tensor's address uses its own strides (K with stride_k_*, never stride_v_*: the layouts "
         "may differ), its own head -- Q, dO, LSE, delta and dQ belong to the query head h, K, V, dK "
         "and dV to the K/V head h_kv = h // GROUP_SIZE -- and its own positions: the query rows offs_m "
         "for Q, dO, LSE, delta, dQ; the keys offs_n for K, V, dK, dV. Where the two agree (contiguous "
         "tensors, no GQA, equal lengths) the slip is invisible, so the failing cases are the ones "
         "where they differ.", proof="slips/03/address_terms")
def _address_terms(ctx):
    _, slips = first_found(ctx, lambda src: _address_slips(src) + _mask_slips(src))
    if not slips:
        return None
    by_line: dict = {}
    for line, what in slips:
        by_line.setdefault(line, []).append(what)
    shown = "; ".join(f"`{line}`: {'; '.join(whats)}" for line, whats in list(by_line.items())[:2])
    return f"{shown}; {ctx.case_pattern()}; {ctx.tensor_pattern()}"


_INCLUSIVE = re.compile(r"\b(offs_\w+|rows?|cols?)\b(?:\s*\[[^\]]*\])?\s*<=\s*(S_q|S_k|HEAD_DIM|S|D)\b")


mistake("bound_inclusive", CODE, "a mask compares with <= the length: index S is already past the end",
        "Positions run 0 ... S - 1: the mask of valid rows is offs < S. With <= the row (or column) S "
        "-- one past the end -- passes, and its load reads whatever lies after the tensor.",
        test=quoted_line(_INCLUSIVE.search, show=("case", "tensors")), proof="slips/03/bound_inclusive")


_CONTIGUOUS = re.compile(r"tl\.(?:load|store)\(\s*\w+\s*\+\s*\w+\[[^\]]*\]\s*\*\s*(?:HEAD_DIM|BLOCK_D|D)\b")


mistake("contiguous_assumed", CODE, "a tile is addressed as if its tensor were contiguous",
        "A row's address is row * stride_s + column * stride_d, with the tensor's own strides: a row "
        "is HEAD_DIM elements long only when the tensor is contiguous and unpadded. A transposed "
        "[B, S, H, D] view or a padded head dim has other strides, and offs * HEAD_DIM reads other rows.",
        test=quoted_line(lambda c: _CONTIGUOUS.search(c) and "stride" not in c), proof="slips/03/contiguous_assumed")


_FLAT_PROGRAM = re.compile(r"\bpid_bh(?:\.to\(tl\.int64\))?\s*\*\s*stride_\w*_h\b")


mistake("flat_batch_head", CODE, "a (batch, head) program id times the head stride alone",
        "pid_bh * stride_h reaches the right (batch, head) only when stride_b = H * stride_h, a "
        "contiguous [B, H, S, D] tensor. Split the id, b = pid_bh // H and h = pid_bh % H, and offset "
        "b * stride_b + h * stride_h: a transposed or padded tensor has other strides.",
        test=quoted_line(_FLAT_PROGRAM.search), proof="slips/03/flat_batch_head")


mistake("cdiv_swapped", CODE, "triton.cdiv's arguments are swapped: cdiv(BLOCK, S) is 1",
        "triton.cdiv(a, b) is ceil(a / b): the number of blocks is cdiv(S, BLOCK), the length first. "
        "cdiv(BLOCK, S) is 1 (or 0-1 blocks) whatever the length, so only the first block gets a program.",
        test=quoted_line(lambda c: re.search(r"cdiv\(\s*BLOCK\w*\s*,", c) is not None), proof="slips/04/cdiv_swapped")


mistake("row_vector_as_column", CODE, "a per-row vector is loaded as a column: [BLOCK_M, 1] before its [:, None]",
        "The LSE and delta hold one number per query row: load them with the 1-D offsets, "
        "tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok), a vector [BLOCK_M]. Loaded with "
        "offs_m[:, None] they are already a column [BLOCK_M, 1], and the lse[:, None] that meets the "
        "[BLOCK_M, BLOCK_N] tile makes a third axis, which tl.dot refuses.",
        test=quoted_line(lambda c: re.search(r"^(?:lse|delta|m_i|l_i)\w*\s*=\s*tl\.load\(.*offs_\w+\[:,\s*None\]", c) is not None),
        proof="slips/03/row_vector_as_column")


mistake("mask_or", CODE, "a load or store mask joins its conditions with | (or): both must hold",
        "A tile's mask keeps an element where *either* condition holds when the two are joined with |: "
        "a row past the end with a valid column (or the reverse) is read from outside the tensor. Each "
        "element needs both: row_ok[:, None] & d_ok[None, :].",
        test=quoted_line(lambda c: re.search(r"mask\s*=\s*[^,]*\[[^\]]*\]\s*\|\s*[\w.]+\s*\[", c) is not None),
        proof="slips/03/mask_or")


mistake("operand_other_inf", CODE, "an operand tile is loaded with other=-inf",
        "The masked-off elements of a q, k, v or dO tile enter a matrix product, where -inf times 0 "
        "is NaN, which spreads to every score of the row. Operand tiles take other=0.0 (they then add "
        "nothing); -inf belongs on the scores, before the softmax, and +inf on the LSE of padded rows.",
        test=quoted_line(lambda c: re.search(r"other\s*=\s*(?:float\(\s*['\"]-inf|-\s*float\(\s*['\"]inf|-\s*math\.inf)", c)
             is not None and "lse" not in c.lower()), proof="slips/03/operand_other_inf")


mistake("tile_transposed_at_load", CODE, "an operand tile is transposed at its load: [BLOCK_D, rows]",
        "Every tile is loaded a row per position -- q, dO [BLOCK_M, BLOCK_D]; k, v [BLOCK_N, BLOCK_D] -- "
        "and turned round only inside the product that needs it: S = tl.dot(q, tl.trans(k)), while "
        "dQ += dS K is tl.dot(ds, k) with k as loaded. A tile transposed at its load is [BLOCK_D, BLOCK_N] "
        "for every later line, and the products that take it as loaded multiply the wrong axes.",
        test=quoted_line(lambda c: re.match(
                 r"(?:q|k|v|do)\s*=\s*(?:tl\.trans\(\s*tl\.load\(|tl\.load\(.*offs_d\[\s*:\s*,\s*None\s*\])", c)
             is not None), proof="slips/03/tile_transposed_at_load")


mistake("dot_acc_and_add", CODE, "`x += tl.dot(a, b, acc=x)` adds x twice",
        "tl.dot(a, b, acc=x) already returns x + a b. Assigned with +=, x is added once more: every step "
        "doubles what was summed before. Write one of the two: x += tl.dot(a, b) or x = tl.dot(a, b, acc=x).",
        test=quoted_line(lambda c: (m := re.match(r"(\w+)\s*\+=\s*tl\.dot\(", c)) is not None and
             re.search(rf"acc\s*=\s*{m.group(1)}\b", c) is not None), proof="slips/04/dot_acc_and_add")


@mistake("atomic_add_store", CODE, "an output is written with tl.atomic_add: it adds onto what the output held",
         "Each program owns its block of rows -- no other program writes them -- so a plain tl.store is "
         "right. tl.atomic_add adds the tile onto the output's old contents, and the launcher's output "
         "is made with torch.empty: whatever memory it got comes through. Store it: tl.store(...).",
         proof="slips/04/atomic_add_store")
def _atomic_add_store(ctx):
    if any(r.nondeterministic for r in ctx.results):
        return None                  # results that change from run to run: programs share rows (race says it)
    line = first_line(ctx, lambda c: "tl.atomic_add(" in c)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


mistake("launch_call_syntax", CODE, "the kernel is called like a function: the grid goes in [ ]",
        "A @triton.jit kernel is launched as kernel[grid](arguments...): the grid in square brackets, then "
        "the arguments. kernel(grid) calls the Python function itself, with the grid as its first "
        "argument.", test=quoted_line(lambda c: re.search(r"\w+\(\s*grid\s*\)\s*\(", c) is not None),
        proof="slips/03/launch_call_syntax")


mistake("arange_runtime_size", CODE, "tl.arange over a size that is not a power-of-two constexpr",
        "tl.arange(0, N) needs N to be a tl.constexpr and a power of two: the tile's width BLOCK_D (the "
        "head dim rounded up), not HEAD_DIM itself. The columns past HEAD_DIM are masked: "
        "d_ok = offs_d < HEAD_DIM.",
        test=quoted_line(lambda c: re.search(r"tl\.arange\(\s*0\s*,\s*(?:HEAD_DIM|D|S_q|S_k|head_dim)\s*\)", c) is not None),
        proof="slips/03/arange_runtime_size")


def _kernel_early_return(src: str):
    """The ``if ...: return`` of a @triton.jit function (a bare return under a condition)."""
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return None
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list):
            for node in ast.walk(fn):
                if isinstance(node, ast.If) and any(isinstance(b, ast.Return) and b.value is None for b in node.body):
                    return f"if {ast.unparse(node.test)}: return"
    return None


@mistake("early_return", CODE, "the kernel returns before its store: those rows stay unwritten",
         "A program that returns early writes nothing, and the launcher's output came from torch.empty: "
         "whatever memory it got stays there. A block with no work still owns its output rows -- let "
         "its loop run zero times and store the zeros.", proof="slips/04/early_return")
def _early_return(ctx):
    # (a return that skips rows past the end -- a program with nothing to own -- is harmless: only
    # outputs left holding the checker's poison make it the cause)
    if not any(t.unwritten for r in ctx.failing for t in r.tensors.values()):
        return None
    _, line = first_found(ctx, _kernel_early_return)
    return f"`{line}`: an early return; {ctx.case_pattern()}; {ctx.tensor_pattern()}" if line else None


mistake("dq_keys_from_diagonal", CODE, "the dQ kernel's key loop starts at the query block: the keys before it are skipped",
        "A query row sees keys 0 ... i (causal) or every key: the dQ kernel's loop starts at key 0 and, "
        "under causal, ends after the diagonal block. Starting at the query block's own position is the "
        "dK/dV kernel's loop (queries from the key block on), copied the other way round.",
        test=quoted_line(lambda c: re.search(r"for\s+\w+\s+in\s+range\(\s*(?:pid_m|start_m|m_start)\b", c) is not None),
        proof="slips/03/dq_keys_from_diagonal")


mistake("loop_stops_before_partial_block", CODE, "the loop stops before the partial last block",
        "range(0, S - BLOCK + 1, BLOCK) visits only full blocks: the last, partial one (S not a multiple "
        "of BLOCK) is never visited, and its keys (or rows) never counted. Loop to the end -- range(0, S, "
        "BLOCK) -- and let the masks take care of the positions past it.",
        test=quoted_line(lambda c: not SWITCH.search(c) and re.search(r"range\([^,()]+,\s*[\w.]+\s*-\s*(?:BLOCK_\w+|block_\w+)\s*\+\s*1\s*,", c)
             is not None), proof="slips/03/loop_stops_before_partial_block")


mistake("offset_from_length", CODE, "a base pointer is offset by a length, not by the tensor's strides",
        "pid_bh * S_q places row 0 of head (b, h) as if LSE and delta were one contiguous [B * H, S_q] "
        "block. The ones handed in may be padded or strided (a slice of a bigger buffer): offset each by "
        "b * stride_b + h * stride_h, the strides the launcher passes, and step rows by stride_s.",
        test=quoted_line(lambda c: re.search(r"\w*(?:base|ptrs?)\w*\s*=\s*[A-Z_]+\s*\+\s*[\w.()]+\s*\*\s*(?:S_q|S_k|N_CTX|SEQ\w*)\b",
             c) is not None), proof="slips/03/offset_from_length")


mistake("kernel_mask_bottom_right", CODE, "the causal mask is aligned bottom-right (shifted by S_k - S_q)",
        "The course's causal mask is aligned top-left: query i sees keys j <= i, whatever S_q and S_k "
        "(as SDPA's is_causal). Shifting it by S_k - S_q is FlashAttention's bottom-right alignment: the "
        "same where S_q = S_k, another mask everywhere else.",
        test=quoted_line(lambda c: not SWITCH.search(c) and re.search(r"offs_\w+", c) is not None and
             re.search(r"\bS_k\s*-\s*S_q\b|\bS_q\s*-\s*S_k\b", c) is not None),
        proof="slips/03/kernel_mask_bottom_right")


mistake("group_loop_from_one", CODE, "the loop over a group's query heads counts from 1",
        "The query heads of kv head h_kv are h_kv * GROUP_SIZE + g for g = 0 ... GROUP_SIZE - 1: "
        "range(GROUP_SIZE). range(1, GROUP_SIZE + 1) skips the group's first head and reads the next "
        "group's first (past the last head for the last group).",
        test=quoted_line(lambda c: re.search(r"range\(\s*1\s*,\s*\w*(?:GROUP|group)\w*\s*\+\s*1\s*\)", c) is not None),
        proof="slips/04/group_loop_from_one")
