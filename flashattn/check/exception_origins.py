"""Ideas for an exception whose cause lies on another line than the one that raised: the
accumulator a product is added to (made by ``tl.zeros`` above the loop), an argument that
arrived wrong from the caller (sliced with the other sequence's span), a loop whose last
iteration indexes one past the end, a call given more positional values than it takes, a value
written into a slice with its axes in another order.
Called by :func:`flashattn.check.exception_ideas.exception_idea` before its generic ideas.
"""
from __future__ import annotations

import ast
import inspect
import linecache
import re
import textwrap
from typing import Optional

import torch

from .origin import made_by, raising_line, tile_shapes
from .shape_names import said, size_names


def exception_chain(exc: BaseException) -> list:
    """The exception and the ones it wraps (Triton's compile error wraps the shape error)."""
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _compiled_made_by(exc: BaseException, name: str) -> str:
    """The kernel source's last line above the failing one that assigns ``name``, for a compile
    error (a GPU compiles the kernel: no frame holds its variables, the error holds its source)."""
    for e in exception_chain(exc):
        src, node = getattr(e, "src", None), getattr(e, "node", None)
        if isinstance(src, str) and getattr(node, "lineno", None):
            target = re.compile(rf"^\s*{re.escape(name)}\s*=(?!=)")
            above = src.splitlines()[:node.lineno - 1]
            return next((ln.split("#")[0].strip() for ln in reversed(above) if target.match(ln)), "")
    return ""


def _accumulator_idea(r) -> Optional[str]:
    """``acc += product`` raising on shapes: the accumulator was made with the wrong shape."""
    if not any(re.search(r"incompatible dimensions|make_shape_compatible|must match the size", str(e))
               for e in exception_chain(r.error)):
        return None
    line = r.error_where.split(" -> ", 1)[-1] if r.error_where else ""
    m = re.match(r"\s*(\w+)\s*(?:[-+*]=|=\s*\1\s*[-+*])", line)
    if not m:
        return None
    acc = m.group(1)
    made = made_by(r.error, [acc]).get(acc, "") or _compiled_made_by(r.error, acc)
    if not re.search(r"\b(?:zeros|full|empty)\w*\(", made):
        return None
    shape = tile_shapes(r.error).get(acc)
    tile = f" ({list(shape)})" if shape else ""
    return (f"{acc} is made by `{made}`{tile}, and what the line adds to it has another shape: an "
            f"accumulator has its result's shape. dQ accumulates dS K: [BLOCK_M, BLOCK_D] (a row per query, "
            f"a column per feature); dK and dV accumulate [BLOCK_N, BLOCK_D]. The block sizes of the "
            f"product's *inner* dimension (BLOCK_N for dQ) never appear in it.")


def _index_past_end(r) -> Optional[str]:
    """``x[b + 1]`` out of range inside ``for b in range(len(x))``: the loop runs once too often."""
    if not re.search(r"out of range|out of bounds", str(r.error)):
        return None
    found = raising_line(r.error)
    if found is None:
        return None
    f, lineno, line, _ = found
    for name, var in re.findall(r"(\w+)\[\s*(\w+)\s*\+\s*1\s*\]", line):
        header = re.compile(rf"^\s*for\s+{var}\s+in\s+range\(\s*(len\(\s*{name}\s*\)|{name}\.numel\(\)|"
                            rf"{name}\.shape\[0\])\s*\)")
        for n in range(lineno - 1, f.f_code.co_firstlineno - 1, -1):
            text = linecache.getline(f.f_code.co_filename, n)
            if header.match(text):
                return (f"`{text.strip()}` runs {var} up to the last index of {name}, and `{name}[{var} + 1]` "
                        f"reads one past it. {name} holds the boundaries of the sequences: B + 1 numbers for B "
                        f"sequences (the last is the end of the last one), so the loop runs range(len({name}) - 1).")
    return None


def _call_arguments(f, callee: str) -> dict:
    """parameter name -> the argument's source in the call to ``callee`` made by frame ``f``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(f.f_code)))
    except (OSError, TypeError, SyntaxError):
        return {}
    target = f.f_globals.get(callee)
    code = getattr(target, "__code__", None)
    if code is None:
        return {}
    params = code.co_varnames[:code.co_argcount]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == callee:
            out = {p: ast.unparse(a) for p, a in zip(params, node.args) if not isinstance(a, ast.Starred)}
            out.update({kw.arg: ast.unparse(kw.value) for kw in node.keywords if kw.arg})
            return out
    return {}


def _argument_from_caller(r) -> Optional[str]:
    """Two operands sized S_q and S_k where they should agree, one of them a parameter: how the
    caller made it (a sequence's O sliced with the keys' span, say)."""
    from .origin import error_frames, learners_frame

    m = re.search(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)", str(r.error))
    c = r.case
    found = learners_frame(r.error)
    if not m or found is None:
        return None
    f, _ = found
    frames = [fr for fr, _ in error_frames(r.error)]
    caller = frames[frames.index(f) - 1] if f in frames and frames.index(f) > 0 else None
    line_found = raising_line(r.error)
    if caller is None or line_found is None:
        return None
    sizes = {int(m.group(1)), int(m.group(2))}
    names = size_names(c)
    params = f.f_code.co_varnames[:f.f_code.co_argcount]
    args = _call_arguments(caller, f.f_code.co_name)
    tensors = {n: f.f_locals[n] for n in line_found[3] if isinstance(f.f_locals.get(n), torch.Tensor)}
    # the wrong one disagrees with its own side's anchor too: q for a row per query, k per key
    anchor = lambda n: f.f_locals.get("q" if n in _PER_QUERY else "k" if n in _PER_KEY else "")  # noqa: E731

    def other_sides(n, o, axis):
        """n per query and o per key (or the other way round), n as long as its own side: a length
        that differs as it should (q @ k^T), not a wrong slice."""
        a = anchor(n)
        sides = {n in _PER_QUERY, o in _PER_QUERY} == {True, False} and {n, o} <= _PER_QUERY | _PER_KEY
        return sides and isinstance(a, torch.Tensor) and a.dim() == tensors[n].dim() and \
            a.shape[axis] == tensors[n].shape[axis]

    clashes = []
    for n, t in tensors.items():
        for o, u in tensors.items():
            off = [i for i, (x, y) in enumerate(zip(t.shape, u.shape)) if x != y]
            if n != o and n in params and n in args and t.dim() == u.dim() and len(off) == 1 and \
                    {t.shape[off[0]], u.shape[off[0]]} == sizes and not other_sides(n, o, off[0]):
                clashes.append((n, o, off[0]))
    clashes.sort(key=lambda c: not (isinstance(anchor(c[0]), torch.Tensor) and c[0] not in ("q", "k") and
                                    anchor(c[0]).dim() == tensors[c[0]].dim() and
                                    anchor(c[0]).shape[c[2]] != tensors[c[0]].shape[c[2]]))
    for n, o, _ in clashes[:1]:
        return (f"{n} {said(tuple(tensors[n].shape), names)} meets {o} {said(tuple(tensors[o].shape), names)} "
                f"here. {n} is a parameter: {caller.f_code.co_name} passes `{args[n]}`. Check that slice: "
                f"tensors with a row per query (q, o, do, the LSE) take the queries' span, k and v the keys' "
                f"-- where a sequence's lengths differ, the other span has the wrong length.")
    return None


_PER_QUERY = {"q", "o", "do", "dq", "lse", "delta"}
_PER_KEY = {"k", "v", "dk", "dv"}


_ARITY = re.compile(r"(\w+)\(\) got multiple values for argument '(\w+)'")


def _arity_idea(r) -> Optional[str]:
    """A call given more positional values than the parameters before a keyword it also got."""
    m = _ARITY.search(str(r.error))
    if not m:
        return None
    found = raising_line(r.error)
    extra = ""
    if found is not None:
        f = found[0]
        odd = [f"{n} {list(t.shape)}" for n, t in f.f_locals.items()
               if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == 1]
        if odd:
            extra = (f" Here {', '.join(odd)} ends in an axis of size 1 (keepdim=True): unpacked as *t.stride() "
                     f"it gives one stride more than the kernel's parameters take.")
    return (f"{m.group(1)} received more positional values than it has parameters before {m.group(2)}, so "
            f"{m.group(2)} arrived twice. Count the call's arguments against the signature: a tensor with an "
            f"extra axis adds a value to *t.stride().{extra}")


_TARGET = re.compile(r"Target sizes: \[([\d, ]*)\]\.\s+Tensor sizes: \[([\d, ]*)\]")


def _assignment_idea(r) -> Optional[str]:
    """``out[s] = value`` with the value's axes in another order than the slice's."""
    m = _TARGET.search(str(r.error))
    if not m:
        return None
    target, value = ([int(x) for x in g.split(",") if x.strip()] for g in m.groups())
    line = r.error_where.split(" -> ", 1)[-1] if r.error_where else "the line shown"
    if "expand" in line and len(value) < len(target):
        return (f"`{line}` expands a tensor shaped {value} to {target}. expand/expand_as line up the *trailing* "
                f"dimensions, as broadcasting does: the value's last axis ({value[-1]}) is put under the target's "
                f"last ({target[-1]}). A statistic per query row (LSE, the row max, delta) needs an axis of "
                f"size 1 for the keys first -- lse[..., None] or lse.unsqueeze(-1) -- and then it broadcasts "
                f"by itself, no expand needed.")
    if sorted(target) == sorted(value) and target != value:
        return (f"`{line}` writes a value shaped {value} into a slice shaped {target}: the same sizes in another "
                f"order. The value's axes must be put back in the output's order first -- a tensor computed "
                f"per head as [H, S, D] goes back into a packed [S, H, D] output transposed (t.transpose(0, 1)).")
    return (f"`{line}` writes a value shaped {value} into a slice shaped {target}: an assignment needs the "
            f"slice's shape (or one that broadcasts to it).")


def origin_idea(r) -> Optional[str]:
    for idea in (_accumulator_idea, _index_past_end, _argument_from_caller, _arity_idea, _assignment_idea):
        found = idea(r)
        if found:
            return found
    return None
