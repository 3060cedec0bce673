"""Readers of the learner's source: lines, calls, assignments, guards.

The mistakes that read code (a line that shows the slip) and the readers of exceptions and shapes
all look at the same texts -- the learner's function, the kernels it launches and the autograd
classes it calls (``Evidence.sources``, from :func:`flashattn.check.origin.learner_sources`). The
helpers they share are here; nothing here registers a mistake.
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap

from .origin import unwrap

#: a line that switches between two forms (a test's planted function, ``a if bug else b``): no slip
SWITCH = re.compile(r"\bif\b.*\belse\b")


def call_args(text: str, start: int) -> tuple:
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


def calls(src: str, name: str) -> list:
    """[(the call's text, its arguments)] for every call of ``name`` (a regex) in ``src``."""
    out = []
    for m in re.finditer(rf"\b{name}\s*\(", src):
        args, end = call_args(src, m.end() - 1)
        out.append((src[m.start():end], args))
    return out


def first_found(ctx, find):
    """(src, what ``find(src)`` found) for the first of the learner's sources where it finds
    something (a non-empty list, a match), or (None, None)."""
    for src in ctx.sources:
        found = find(src)
        if found:
            return src, found
    return None, None


def code_lines(src: str):
    """The source's lines without comments, stripped, skipping blank ones."""
    for line in src.splitlines():
        code = line.split("#")[0].strip()
        if code:
            yield code


def syntax_trees(ctx):
    """The learner's sources, each parsed (those that do not parse are passed over)."""
    for src in ctx.sources:
        try:
            yield ast.parse(textwrap.dedent(src))
        except SyntaxError:
            continue


def first_line(ctx, test):
    """The first code line of the learner's sources for which ``test(line)`` holds, or None."""
    _, line = first_found(ctx, lambda src: next((c for c in code_lines(src) if test(c)), None))
    return line


def line_of(src: str, needle: str) -> str:
    return next((line.split("#")[0].strip() for line in src.splitlines() if needle in line), needle)


def forward_params(ctx, cls_name: str):
    glb = getattr(unwrap(ctx.subject), "__globals__", {})
    cls = glb.get(cls_name)
    forward = getattr(cls, "forward", None)
    try:
        return list(inspect.signature(forward).parameters)[1:]      # after ctx
    except (TypeError, ValueError):
        return None


#: methods and functions that return a new value and leave their operands alone
_PURE = {"masked_fill", "where", "maximum", "minimum", "exp", "exp2", "log", "to", "float", "half", "double",
         "transpose", "trans", "sum", "softmax", "clone", "contiguous", "view", "reshape", "abs", "mul",
         "add", "sub", "div", "squeeze", "unsqueeze", "expand", "dot", "max", "min", "amax", "mean", "tril",
         "triu", "logical_and", "logical_or", "logical_not"}


def pure_call(v) -> bool:
    return isinstance(v, ast.Call) and ((isinstance(v.func, ast.Attribute) and v.func.attr in _PURE) or
                                        (isinstance(v.func, ast.Name) and v.func.id in _PURE))


def one_typo(a: str, b: str) -> bool:
    """Names one edit apart (an underscore, a letter): d_q and dq, dkk and dk."""
    if a == b or abs(len(a) - len(b)) > 1 or min(len(a), len(b)) < 2:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def discarded(src: str) -> list:
    """[line] of statements whose value is computed and dropped: ``visible & (...)`` or
    ``S.masked_fill(...)`` on a line of its own, never assigned -- or assigned to a name that
    nothing reads afterwards (``S = S.masked_fill(...)`` after P was already built from S), outside
    any loop (where the next iteration may read it)."""
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return []
    lines = textwrap.dedent(src).splitlines()
    in_loop = {id(n) for loop in ast.walk(tree) if isinstance(loop, (ast.For, ast.While))
               for n in ast.walk(loop)}
    loads = [(n.id, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr):
            v = node.value
            if isinstance(v, (ast.BinOp, ast.BoolOp, ast.Compare, ast.UnaryOp)) or pure_call(v):
                out.append(lines[node.lineno - 1].split("#")[0].strip())
        elif isinstance(node, ast.Assign) and id(node) not in in_loop and \
                len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, end = node.targets[0].id, getattr(node, "end_lineno", node.lineno)
            if any(n == name and line > end for n, line in loads):
                continue
            later = {n for n, line in loads if line > end}
            # a computed value (not a launch or a call for its effect), or a name a typo away from one
            # used later (d_q = ... ; return dq)
            size = ast.unparse(node.value)      # a length read and left unused is harmless
            if re.search(r"\.shape\b|\.size\(|^len\(", size) and \
                    not any(one_typo(name, n) and len(n) != len(name) for n in later):   # (S_k beside S_q: no typo)
                continue
            if pure_call(node.value) or isinstance(node.value, ast.BinOp) or \
                    any(one_typo(name, n) for n in later):
                out.append(lines[node.lineno - 1].split("#")[0].strip())
    return out


def unused_assignments(ctx) -> list:
    """The lines of the learner's code whose value nothing uses (for the rules that come before
    this module's, to name in their evidence)."""
    return [line for src in ctx.sources for line in discarded(src)]


_LOW_CAST = re.compile(r"\.to\(\s*(?:tl|torch)\.(?:float16|bfloat16|half)\s*\)|\.half\(\)|\.bfloat16\(\)")


def low_dtype_casts(ctx) -> list:
    """Lines of the learner's code that cast to a fixed fp16/bf16, whatever the inputs' dtype."""
    out = []
    for src in ctx.sources:
        out += [line.split("#")[0].strip() for line in src.splitlines()
                if _LOW_CAST.search(line) and not line.strip().startswith("#")]
    return out


def guard_story(ctx, missing) -> tuple | None:
    """(evidence, idea) for gradients (``missing``: "q", "k", "v") that came back None because of
    their ``needs_input_grad`` guard: inverted (``if not ...``), or another input's."""
    inverted = first_line(ctx, lambda c: re.search(r"\bif\s+not\s+(?:\w+\.)?needs_input_grad\[", c) is not None)
    if inverted:
        return (f"`{inverted}`",
                "The guard is inverted: ctx.needs_input_grad[i] is True when input i *needs* its gradient. "
                "`if not ...` computes the gradient exactly when nobody wants it and returns None when "
                "somebody does. Drop the `not`.")
    guarded = under_another_guard(ctx, missing)
    if guarded:
        return (f"`{guarded[0]}` sits inside `{guarded[1]}`",
                "Each gradient needs its own guard: ctx.needs_input_grad[i] is indexed like forward's "
                "inputs, 0 q, 1 k, 2 v. Computed inside another input's guard, a gradient is None whenever "
                "that other input needs none -- a frozen q takes dK and dV with it. Give the dK/dV call "
                "its own `if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:` (or none at all).")
    return None


def under_another_guard(ctx, missing) -> tuple | None:
    """(the line, its guard) where a missing gradient (q, k, v) is assigned inside an
    ``if ...needs_input_grad[i]`` for another input i, else None."""
    index = {"q": 0, "k": 1, "v": 2}
    for tree in syntax_trees(ctx):
        for node in ast.walk(tree):
            if not isinstance(node, ast.If):
                continue
            test = ast.unparse(node.test)
            guards = {int(i) for i in re.findall(r"needs_input_grad\[(\d)\]", test)}
            if not guards:
                continue
            for stmt in ast.walk(ast.Module(body=node.body, type_ignores=[])):
                if not isinstance(stmt, ast.Assign):
                    continue
                names = {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                for name in missing:
                    if f"d{name}" in names and index[name] not in guards:
                        return ast.unparse(stmt).splitlines()[0], f"if {test}:"
    return None


def shape_unpacked_out_of_order(line: str) -> bool:
    """``B, S_q, H, D = q.shape``: [B, H, S, D] unpacked as if it were [B, S, H, D]."""
    m = re.match(r"^(\w+),\s*(\w+),\s*(\w+),\s*(\w+)\s*=\s*\w+\.shape$", line)
    return bool(m) and bool(re.fullmatch(r"S\w*|L|N|T|seq\w*", m.group(2))) and \
        bool(re.fullmatch(r"H\w*|heads?|n_heads", m.group(3)))


