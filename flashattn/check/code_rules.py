"""Diagnoses that read the learner's code, for mistakes whose outputs look like many others.

Some slips leave a trace in the source that no output pattern can pin: ``apply`` called with
two arguments in another order than ``forward`` takes them; a loop that counts blocks
(``tl.cdiv(S_q, BLOCK_M)``) but steps by rows (``BLOCK_M``); the dK/dV kernel's scores tile
built as S = Q K^T while the rest of the kernel works on S^T. Each rule fires only when the
checker also saw outputs fail, and names the line. Registered in :mod:`flashattn.check.rules`
right before the rule for exceptions. ``ctx.sources`` holds the learner's function, the kernels
it launches and the autograd classes it calls (:func:`flashattn.check.origin.learner_sources`).
"""
from __future__ import annotations

import inspect
import re

from .diagnose import rule
from .origin import _unwrap


def _args(text: str, start: int) -> tuple:
    """The top-level, comma-separated arguments of the call whose '(' is at ``start``, and the
    index just past its ')'."""
    depth, out, cur = 0, [], ""
    for i in range(start, len(text)):
        ch = text[i]
        if ch in "([{":
            depth += 1
            if depth == 1:
                continue
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                out.append(cur.strip())
                return [a for a in out if a], i + 1
        elif ch == "," and depth == 1:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return [], len(text)


def _calls(src: str, name: str) -> list:
    """[(the call's text, its arguments)] for every call of ``name`` (a regex) in ``src``."""
    out = []
    for m in re.finditer(rf"\b{name}\s*\(", src):
        args, end = _args(src, m.end() - 1)
        out.append((src[m.start():end], args))
    return out


def _line_of(src: str, needle: str) -> str:
    return next((line.split("#")[0].strip() for line in src.splitlines() if needle in line), needle)


# --------------------------------------------------------------------------------------
# autograd: apply's arguments against forward's parameters
# --------------------------------------------------------------------------------------
def _forward_params(ctx, cls_name: str):
    glb = getattr(_unwrap(ctx.subject), "__globals__", {})
    cls = glb.get(cls_name)
    forward = getattr(cls, "forward", None)
    try:
        return list(inspect.signature(forward).parameters)[1:]      # after ctx
    except (TypeError, ValueError):
        return None


@rule("apply_order", "apply passes its arguments in another order than forward takes them",
      "Function.apply(...) hands its arguments to forward(ctx, ...) by position, after ctx: "
      "the call must list them in forward's order. Two swapped (causal and scale) reach forward "
      "under each other's names.", kinds=("autograd",))
def _apply_order(ctx):
    for src in ctx.sources:
        for text, args in _calls(src, r"(\w+)\.apply"):
            cls_name = text.split(".apply")[0].split()[-1]
            params = _forward_params(ctx, cls_name)
            names = [a.split("=")[-1].strip() for a in args]
            if not params or len(names) != len(params) or any("=" in a for a in args) or \
                    sorted(names) != sorted(params) or names == params:
                continue
            moved = [f"{n} where forward takes {p}" for n, p in zip(names, params) if n != p]
            return (f"`{_line_of(src, text.splitlines()[0])}` passes {', '.join(moved)} "
                    f"(forward(ctx, {', '.join(params)})); {len(ctx.failing)} of {len(ctx.results)} cases fail")
    return None


# --------------------------------------------------------------------------------------
# kernels: a loop that counts blocks but steps by rows; the scores tile's orientation
# --------------------------------------------------------------------------------------
def _loop_mixing_units(src: str):
    """The text of a ``range(start, stop, BLOCK)`` whose stop counts blocks (tl.cdiv(...) or
    ... // BLOCK) while its step is a block of rows."""
    for text, args in _calls(src, r"(?:tl\.)?(?:static_)?range"):
        if len(args) != 3 or not re.fullmatch(r"BLOCK_\w+", args[2]):
            continue
        stop = args[1]
        if re.fullmatch(r"(?:tl\.|triton\.)?cdiv\(.*\)", stop) or re.search(r"//\s*BLOCK_\w+\s*$", stop):
            return text
    return None


@rule("loop_units", "a loop counts blocks but steps by rows",
      "range(start, stop, BLOCK) walks row positions: start, start + BLOCK, ... up to the number of "
      "rows. tl.cdiv(S, BLOCK) is a number of blocks, so as a stop beside a step of BLOCK it ends "
      "the loop after the first block or two. Either loop over positions (range(start, S, BLOCK)) "
      "or over block indices (range(0, tl.cdiv(S, BLOCK)) with offsets index * BLOCK).",
      kinds=("dq", "dkdv"))
def _loop_units(ctx):
    if any(r.error is not None for r in ctx.failing):
        return None
    for src in ctx.sources:
        text = _loop_mixing_units(src)
        if text:
            return f"`{_line_of(src, text)}`; {ctx.case_pattern()}; {ctx.tensor_pattern()}"
    return None


_DOT_TRANS = re.compile(r"tl\.dot\(\s*(\w+)\s*,\s*tl\.trans\(\s*(\w+)\s*\)")


def _scores_tile(src: str, kind: str):
    """The line building the scores with the other kernel's orientation: Q K^T in a kernel that
    uses LSE along the tile's columns (lse[None, :]: the dK/dV kernel's S^T), or K Q^T in one
    that uses it along the rows (lse[:, None]: the dQ kernel's S)."""
    lse_columns = re.search(r"lse\w*\s*\[\s*None\s*,\s*:\s*\]", src) is not None
    lse_rows = re.search(r"lse\w*\s*\[\s*:\s*,\s*None\s*\]", src) is not None
    for m in _DOT_TRANS.finditer(src):
        a, b = m.group(1).lower(), m.group(2).lower()
        if kind == "dkdv" and a.startswith("q") and b.startswith("k") and lse_columns and not lse_rows:
            return _line_of(src, m.group(0)), "S = Q K^T [BLOCK_M, BLOCK_N]", "S^T = K Q^T [BLOCK_N, BLOCK_M]", \
                "lse[None, :]"
        if kind == "dq" and a.startswith("k") and b.startswith("q") and lse_rows and not lse_columns:
            return _line_of(src, m.group(0)), "S^T = K Q^T [BLOCK_N, BLOCK_M]", "S = Q K^T [BLOCK_M, BLOCK_N]", \
                "lse[:, None]"
    return None


@rule("scores_orientation", "the scores tile is built the other way round from the rest of the kernel",
      "A dK/dV program owns a block of keys, so the lesson's kernel works on the transposed tile "
      "S^T = K Q^T (rows: keys, columns: queries): P^T = exp(S^T - LSE[None, :]), dV += P^T dO, "
      "dK += dS^T Q. A dQ program works on S = Q K^T (rows: queries) with LSE[:, None]. Build "
      "the scores in the orientation the rest of your kernel uses (with square blocks the shapes "
      "agree and nothing raises: every value is just read across the diagonal).", kinds=("dq", "dkdv"))
def _scores_orientation(ctx):
    for src in ctx.sources:
        found = _scores_tile(src, ctx.kind)
        if found:
            line, built, wanted, lse = found
            return (f"`{line}` builds {built}, but the kernel reads the LSE as {lse}, which belongs to "
                    f"{wanted}; {ctx.tensor_pattern()}")
    return None


# --------------------------------------------------------------------------------------
# a cast to a fixed low dtype (for low_precision's evidence)
# --------------------------------------------------------------------------------------
_LOW_CAST = re.compile(r"\.to\(\s*(?:tl|torch)\.(?:float16|bfloat16|half)\s*\)|\.half\(\)|\.bfloat16\(\)")


def low_dtype_casts(ctx) -> list:
    """Lines of the learner's code that cast to a fixed fp16/bf16, whatever the inputs' dtype."""
    out = []
    for src in ctx.sources:
        out += [line.split("#")[0].strip() for line in src.splitlines()
                if _LOW_CAST.search(line) and not line.strip().startswith("#")]
    return out
