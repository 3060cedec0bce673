"""Shapes said with the names of their sizes: [B, H, S_q, D] instead of [1, 2, 23, 32].

A learner reads "dk has shape (15, 2, 8), expected (14, 2, 8)" as a riddle; "dk is [total_q, H, D],
shaped like q, where [total_k, H, D] belongs" as the answer. A case's sizes are chosen different
from each other where the checkers can (S_q != S_k, D apart from both), so most sizes have one
name; a size with two names (S_k = D = 32) stays a number rather than a guess. Two stories read
the learner's source as well: buffers made by one chained assignment (one tensor under three
names), and size-1 axes lost to squeeze() or to a result indexed [0].
"""
from __future__ import annotations

import re
from typing import Optional
from .source import first_line, shape_unpacked_out_of_order
from .checkers import AUTOGRAD, BACKWARD, ONLINE, REBUILD_P


def size_names(case) -> dict:
    """size -> the names it may stand for in ``case`` (a battery, lazy, window or packed case)."""
    names: dict = {}

    def add(size, name):
        if size and size > 1:
            names.setdefault(int(size), [])
            if name not in names[int(size)]:
                names[int(size)].append(name)

    if case is None:
        return names
    lens_q = getattr(case, "lens_q", ())
    if lens_q:                                   # lesson 09's packed batch
        add(sum(lens_q), "total_q")
        add(sum(getattr(case, "lens_k", ()) or lens_q), "total_k")
        add(case.H, "H")
        add(case.D, "D")
        return names
    if hasattr(case, "taus"):                    # lazy attention: one head's [L, L] and W + 1 diagonals
        add(case.S_q, "L")
        add(case.W + 1, "W + 1")
        add(case.H, "H")
        add(case.D, "D")
        return names
    add(case.B, "B")
    add(case.H, "H")
    if getattr(case, "H_kv", None) not in (None, case.H):
        add(case.H_kv, "H_kv")
    add(case.S_q, "S_q")
    add(case.S_k, "S_k")
    if hasattr(case, "window"):                  # a window mask: [S_q, S_k] only
        return names
    add(case.D, "D")
    return names


def symbolic(shape, names: dict) -> list:
    """Each size by its one name, else the number: [1, 2, 'S_q', 'D']."""
    out = []
    for n in shape:
        said = names.get(int(n), [])
        out.append(said[0] if len(said) == 1 else int(n))
    return out


def said(shape, names: dict) -> str:
    return "[" + ", ".join(str(x) for x in symbolic(shape, names)) + "]"


def input_shapes(case) -> dict:
    """name -> shape of the checker's inputs for ``case`` (q, k, v as handed over)."""
    lens_q = getattr(case, "lens_q", ())
    if lens_q:
        total_q, total_k = sum(lens_q), sum(getattr(case, "lens_k", ()) or lens_q)
        return {"q": (total_q, case.H, case.D), "k": (total_k, case.H, case.D), "v": (total_k, case.H, case.D)}
    if hasattr(case, "taus") or hasattr(case, "window"):
        return {}
    H_kv = case.H if getattr(case, "H_kv", None) is None else case.H_kv
    return {"q": (case.B, case.H, case.S_q, case.D), "k": (case.B, H_kv, case.S_k, case.D),
            "v": (case.B, H_kv, case.S_k, case.D)}


def shape_story(name: str, got, want, case) -> Optional[str]:
    """Why output ``name`` came out ``got`` where ``want`` belongs, said with the sizes' names:
    its last two axes swapped, the shape of another input, or a size from another length."""
    names = size_names(case)
    got, want = [int(x) for x in got], [int(x) for x in want]
    if len(got) != len(want) or got == want:
        return None
    g, w = said(got, names), said(want, names)
    if len(got) >= 2 and got[:-2] == want[:-2] and got[-2:] == want[-2:][::-1]:
        if "mask" in name:
            return (f"The {name} comes out transposed: {g} where {w} belongs, a row per key instead of a row "
                    f"per query. Build it [S_q, S_k]: the query index as a column, i[:, None], the key index "
                    f"as a row, j[None, :] -- or drop the transpose (.T) that turns it round.")
        return (f"{name} comes out transposed: {g} where {w} belongs (its last two axes swapped). The product "
                f"that makes it has its operands in the other order, or one transpose too many or too few: "
                f"(A B)^T = B^T A^T, so dV = P^T dO is [S_k, S_q] @ [S_q, D], while dO^T P is its transpose "
                f"[D, S_k].")
    if "mask" in name and len(want) == 2 and got in ([want[0], 1], [1, want[1]]):
        column = got[1] == 1
        pos = "i, the query positions [S_q, 1]" if column else "j, the key positions [1, S_k]"
        return (f"The {name} is {g}, the shape of {pos}, where {w} belongs: it was started from that vector "
                f"(torch.ones_like({'i' if column else 'j'}), {'i' if column else 'j'} >= ...) and never "
                f"broadcast against the other axis. Start from the full grid, torch.ones(S_q, S_k, "
                f"dtype=torch.bool), or from a comparison that holds both i and j.")
    for other, shape in input_shapes(case).items():
        if list(shape) == got and list(shape) != want:
            return (f"{name} is {g}, the shape of {other}, where {w} belongs: it was made from {other} "
                    f"(torch.zeros_like({other}), {other}.shape, {other}.new_zeros(...)) instead of from the "
                    f"input it is the gradient of.")
    wrong = [(a, b) for a, b in zip(symbolic(got, names), symbolic(want, names)) if a != b]
    if wrong and all(isinstance(a, str) and isinstance(b, str) for a, b in wrong):
        number = {names[size][0]: size for size in names if len(names[size]) == 1}
        sizes = ", ".join(f"{a} = {number[a]} where {b} = {number[b]} belongs" for a, b in wrong)
        return (f"{name} is {g} where {w} belongs ({sizes}): a size was taken from the wrong length. "
                f"Find where {name} gets that size -- a range, a slice, an allocation -- and what it "
                f"should count.")
    return None


def aliased_buffers(ctx):
    """`a = b = c = torch.zeros_like(q)`: one tensor under several names."""

    line = first_line(ctx, lambda c: re.match(r"^(\w+\s*=\s*){2,}\w[\w.]*\((?:[^()]|\([^()]*\))*\)$", c) and
                       re.search(r"zeros|empty|full|ones", c))
    if not line:
        return None
    names = [n.strip() for n in line.split("=")[:-1]]
    return (f"`{line}` makes *one* tensor and gives it {len(names)} names: {', '.join(names)} are the same "
            f"memory, so writing one writes them all, and all have the shape of the one tensor it copied. "
            f"Make each buffer separately, shaped like its own input (zeros_like(q), zeros_like(k), ...).")


def lost_axes(ctx, name: str, got: list, want: list) -> str:
    """Why an output lost its size-1 axes: a squeeze() with no dimension, or a result indexed [0]."""

    lost = f"{name} lost its size-1 dimension(s): {tuple(want)} became {tuple(got)}."
    indexed = first_line(ctx, lambda c: re.search(r"\)\s*\[\s*0\s*\]\s*$", c) and "squeeze" not in c)
    if indexed and not first_line(ctx, lambda c: re.search(r"\.squeeze\(\s*\)", c)):
        return (f"{lost} `{indexed}` indexes a result with [0], which takes its first element along the "
                f"first axis -- here the first batch element. A function that returns one tensor (as "
                f"forward returns O alone, so apply does too) needs no [0]; a tuple is unpacked by name, "
                f"o, lse = ....")
    return (f"{lost} squeeze() without a dimension drops *every* axis of size 1 -- B, H or S_q of 1 "
            f"too; squeeze(-1) (or [..., 0]) drops the one you mean.")


def returned_the_wrong_thing(ctx, message: str):
    """What the learner's function returned in place of a tensor, when the ShapeError's message
    says: None (no return reached), a method (named without its ()), a row reduced over the rows,
    a tuple from an autograd.Function's forward."""

    if "got NoneType" in message:
        cases = [x.case.name for x in ctx.results if x.error is not None and "got NoneType" in str(x.error)]
        return (f"Your function returned None in {len(cases)} case(s) ({', '.join(cases[:3])}): it "
                f"reached its end without a return. A return inside an `if` (or a loop) returns only "
                f"when that branch runs: put the final return at the function's own level.")
    if re.search(r"got (?:builtin_function_or_method|method)\b", message):   # .bool, not .bool()
        line = first_line(ctx, lambda c: re.search(r"\.(?:bool|float|half|int|long|contiguous|clone|detach|t)\s*$", c))
        return ((f"`{line}` names the method without calling it: " if line else "A method was named "
                 "without calling it: ") + "x.bool is the method itself, x.bool() its result. Add the ().")
    axis = first_line(ctx, lambda c: re.search(r"\.(?:sum|amax|max|mean|logsumexp)\(\s*(?:dim\s*=\s*)?-2\b", c))
    if axis and ctx.checker in (ONLINE, BACKWARD, REBUILD_P):    # a row's reduction over the rows
        return (f"`{axis}` reduces over axis -2, the query rows: one value per *key*, which then broadcasts "
                f"into the wrong shape. A row's maximum and sum run over its keys, the last axis: dim=-1.")
    if ctx.checker is AUTOGRAD and "got tuple" in message:
        return ("Your function returned a tuple where the output alone belongs, as SDPA returns "
                "it. An autograd.Function's forward that returns (o, lse) makes apply return both: "
                "return o, and put what the backward needs besides (the LSE) into "
                "ctx.save_for_backward.")
    return None


def dtype_story(ctx, message: str):
    """(the line, the idea) where float64 inputs came back float32 and the code has a .float()."""

    if "expected torch.float64" not in message:
        return None
    line = first_line(ctx, lambda c: re.search(r"\.float\(\)|torch\.float32\b", c))
    return line and (line, ".float() means float32 exactly, not 'at least float32': on float64 inputs it "
                           "rounds every value to float32, and what is computed from it comes back float32. "
                           "Compute in the inputs' dtype, or promote: x.to(torch.promote_types(x.dtype, "
                           "torch.float32)).")


def squeeze_story(ctx, case) -> Optional[str]:
    """The idea where the code squeezes without naming an axis and this case has another axis
    of size 1 than the one meant: .squeeze() drops them all."""

    line = first_line(ctx, lambda c: re.search(r"\.squeeze\(\s*\)|torch\.squeeze\(\s*[\w.\[\]]+\s*\)", c))
    ones = [n for n, v in (("B", case.B), ("H", case.H), ("S_q", case.S_q), ("S_k", case.S_k)) if v == 1]
    if not line or not ones:
        return None
    return (f"`{line}` squeezes without naming an axis: .squeeze() removes *every* axis of size 1, and in case "
            f"'{case.name}' {' and '.join(ones)} {'is' if len(ones) == 1 else 'are'} 1 too, so that axis goes as "
            f"well and the rest broadcast against the wrong dimensions. Name the axis: .squeeze(-1) (or index "
            f"it away, x[..., 0]).")


def unpacked_out_of_order_line(ctx) -> Optional[str]:
    """The line that unpacks a shape in another order than the axes (what line_slips'
    shape_unpack_order names), or None."""

    return first_line(ctx, shape_unpacked_out_of_order)


def saved_unpacked_otherwise(ctx) -> str:
    """'; `q, k, v, lse, o = ctx.saved_tensors` unpacks ... saved as (q, k, v, o, lse)' where the names
    unpacked are the names saved in another order, else ''."""
    text = "\n".join(ctx.sources)
    saved = re.search(r"save_for_backward\(([^()]*)\)", text)
    got = re.search(r"^\s*([\w\s,]+?)\s*=\s*ctx\.saved_tensors", text, re.M)
    if not saved or not got:
        return ""
    names = lambda t: [n.strip() for n in t.split(",") if n.strip()]  # noqa: E731
    a, b = names(saved.group(1)), names(got.group(1))
    if sorted(a) != sorted(b) or a == b:
        return ""
    return (f"; `{got.group(0).strip()}` unpacks in another order than save_for_backward saved them "
            f"({', '.join(a)}): ctx.saved_tensors come back in the saved order")
