"""Diagnoses that read the learner's code, for mistakes whose outputs look like many others.

Some slips leave a trace in the source that no output pattern can pin: ``apply`` called with
two arguments in another order than ``forward`` takes them; a loop that counts blocks
(``tl.cdiv(S_q, BLOCK_M)``) but steps by rows (``BLOCK_M``); the dK/dV kernel's scores tile
built as S = Q K^T while the rest of the kernel works on S^T. Each fires only when the
checker also saw outputs fail, and names the line; they come before ``exception`` in every
order (:mod:`flashattn.check.checkers`). ``ctx.sources`` holds the learner's function, the kernels
it launches and the autograd classes it calls (:func:`flashattn.check.origin.learner_sources`).
"""
from __future__ import annotations

import re

from .engine import CODE, mistake
from .evidence import quoted_line
from .source import calls, first_found, first_line, forward_params, line_of, unused_assignments
from .checkers import DKDV, DQ


# --------------------------------------------------------------------------------------
# autograd: apply's arguments against forward's parameters
# --------------------------------------------------------------------------------------


@mistake("apply_order", CODE, "apply passes its arguments in another order than forward takes them",
         "Function.apply(...) hands its arguments to forward(ctx, ...) by position, after ctx: "
         "the call must list them in forward's order. Two swapped (causal and scale) reach forward "
         "under each other's names.")
def _apply_order(ctx):
    for src in ctx.sources:
        for text, args in calls(src, r"(\w+)\.apply"):
            cls_name = text.split(".apply")[0].split()[-1]
            params = forward_params(ctx, cls_name)
            names = [a.split("=")[-1].strip() for a in args]
            if not params or len(names) != len(params) or any("=" in a for a in args) or \
                    sorted(names) != sorted(params) or names == params:
                continue
            moved = [f"{n} where forward takes {p}" for n, p in zip(names, params) if n != p]
            return (f"`{line_of(src, text.splitlines()[0])}` passes {', '.join(moved)} "
                    f"(forward(ctx, {', '.join(params)})); {len(ctx.failing)} of {len(ctx.results)} cases fail")
    return None


# --------------------------------------------------------------------------------------
# kernels: a loop that counts blocks but steps by rows; the scores tile's orientation
# --------------------------------------------------------------------------------------
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
         "or over block indices (range(0, tl.cdiv(S, BLOCK)) with offsets index * BLOCK).")
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
         "agree and nothing raises: every value is just read across the diagonal).")
def _scores_orientation(ctx):
    _, found = first_found(ctx, lambda src: _scores_tile(src, ctx.checker))
    if not found:
        return None
    line, built, wanted, lse = found
    return f"`{line}` builds {built}, but the kernel reads the LSE as {lse}, which belongs to {wanted}; {ctx.tensor_pattern()}"


# --------------------------------------------------------------------------------------
# an offset vector multiplied by the stride of the other axis
# --------------------------------------------------------------------------------------
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
         "strides happen to agree nothing shows.")
def _stride_axes(ctx):
    _, lines = first_found(ctx, _stride_axis_slips)
    if not lines:
        return None
    shown = "; ".join(f"`{line}`" for line in lines[:2])
    return f"{shown} pairs a row offset with a head-dim stride (or the reverse); {ctx.tensor_pattern()}"


# --------------------------------------------------------------------------------------
# an address built with another tensor's stride, or another tensor's head
# --------------------------------------------------------------------------------------
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
         "where they differ.")
def _address_terms(ctx):
    _, slips = first_found(ctx, lambda src: _address_slips(src) + _mask_slips(src))
    if not slips:
        return None
    by_line: dict = {}
    for line, what in slips:
        by_line.setdefault(line, []).append(what)
    shown = "; ".join(f"`{line}`: {'; '.join(whats)}" for line, whats in list(by_line.items())[:2])
    return f"{shown}; {ctx.case_pattern()}; {ctx.tensor_pattern()}"


# --------------------------------------------------------------------------------------
# a value computed and thrown away
# --------------------------------------------------------------------------------------


@mistake("discarded_value", CODE, "a line computes a value that nothing uses",
         "An expression on a line of its own changes nothing: `mask & cond` or `S.masked_fill(...)` "
         "return a new value, which must be assigned (mask = mask & cond, S = S.masked_fill(...)) -- "
         "and used: a tensor masked after what depends on it was computed (P built from S, then S "
         "masked) leaves that result unmasked. Only the methods ending in _ (masked_fill_, mul_) "
         "change a tensor in place.")
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


# --------------------------------------------------------------------------------------
# a bound with <= where < belongs
# --------------------------------------------------------------------------------------
_INCLUSIVE = re.compile(r"\b(offs_\w+|rows?|cols?)\b(?:\s*\[[^\]]*\])?\s*<=\s*(S_q|S_k|HEAD_DIM|S|D)\b")


mistake("bound_inclusive", CODE, "a mask compares with <= the length: index S is already past the end",
        "Positions run 0 ... S - 1: the mask of valid rows is offs < S. With <= the row (or column) S "
        "-- one past the end -- passes, and its load reads whatever lies after the tensor.",
        test=quoted_line(_INCLUSIVE.search, show=("case", "tensors")))


# --------------------------------------------------------------------------------------
# a sequence length read from the head-dim axis
# --------------------------------------------------------------------------------------
_LENGTH_FROM_D = re.compile(r"^\s*(?:\w+\s*,\s*)*(S_q|S_k|S|N|L|M|seq_?len\w*|n_?keys|n_?queries|len_\w+)\s*=\s*"
                            r"((?:q|k|v|o|do|dq|dk|dv|query|key|value)(?:_\w+)?)\."
                            r"(?:shape\s*\[\s*-1\s*\]|size\(\s*-1\s*\))\s*$")


mistake("length_from_head_dim", CODE, "a sequence length is read from the last axis, the head dim",
        "q, k, v are [B, H, S, D]: the last axis is D, the head dimension, and the sequence length "
        "is shape[2] (or shape[-2]; shape[0] of lesson 07's [L, D]). A loop bound or mask from "
        "shape[-1] visits D keys or rows: it drops some when S > D, and runs past the end when S < D.",
        test=quoted_line(_LENGTH_FROM_D.search))


# --------------------------------------------------------------------------------------
# a division by an index that starts at 0
# --------------------------------------------------------------------------------------
# torch.arange(0, ...), or arange(n) / arange(n, device=...) with one positional argument
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
         "row i sees (0 ... i): divide by i + 1.")
def _divide_by_index(ctx):
    if not ctx.failing:        # row 0's inf need not reach the outputs (a gate's P + c > 0 holds)
        return None
    _, lines = first_found(ctx, _zero_divisions)
    return f"`{lines[0]}`; {ctx.tensor_pattern()}" if lines else None


# --------------------------------------------------------------------------------------
# a cast to a fixed low dtype (for low_precision's evidence)
# --------------------------------------------------------------------------------------


