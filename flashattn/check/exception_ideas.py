"""Ideas for a learner's exception, chosen from the error itself: its message, its sizes, the
line it came from and the cases it raised in. The specific ones first (an operand transposed, a
mask built [S_k, S_q], an input written in place, .T on a 4-D tensor), then by the error's kind.
"""
from __future__ import annotations

import linecache
import re
from typing import Optional

import torch

from .exception_origins import origin_idea
from .origin import line_shapes, line_tensors, made_by, raising_line, tile_shapes
from .shape_names import said, size_names, symbolic

_SIZES = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)"
                    r"(?: at non-singleton dimension (\d+))?")


def _dot_idea(r) -> Optional[str]:
    """tl.dot with inner dimensions that differ: which operand needs tl.trans."""
    if not re.search(r"equal reduction dimensions|not compatible for matmul", str(r.error)):
        return None
    tiles = "; ".join(f"{n} {list(sh)}" for n, sh in tile_shapes(r.error).items())
    return ("A tl.dot's inner dimensions differ: tl.dot(a, b) multiplies a [M, K] by b [K, N]"
            + (f" (on the line shown: {tiles})" if tiles else "") + ". Every tile is loaded a row per "
            "position -- q, do [BLOCK_M, BLOCK_D]; k, v [BLOCK_N, BLOCK_D] -- so S = Q K^T is "
            "tl.dot(q, tl.trans(k)) and dP = dO V^T is tl.dot(do, tl.trans(v)), while dQ += dS K is "
            "tl.dot(ds, k). Where two block sizes happen to be equal the missing transpose runs and is "
            "silently wrong.")


def _scalar_tensor_idea(r) -> Optional[str]:
    """0-d tensors handed where a Python number belongs (a kernel's sizes read them as pointers):
    lengths computed from a cu_seqlens tensor without .tolist() / int()."""
    compiled = type(r.error).__name__ in ("CompilationError", "InterpreterError")   # (a GPU says less)
    if not compiled and not re.search(r"pointer<|must be (?:an )?int|only integer|expected an integer", str(r.error)):
        return None
    scalars = [n for n, t in line_tensors(r.error).items() if t.dim() == 0 and not t.dtype.is_floating_point]
    if not scalars:
        return None
    made = made_by(r.error, scalars)
    origin = "".join(f" {n} is made by `{made[n]}`." for n in scalars if n in made)
    return (f"{', '.join(scalars)} {'is a 0-d tensor' if len(scalars) == 1 else 'are 0-d tensors'}, not Python "
            f"ints, where the call wants numbers (a kernel takes a tensor argument as a pointer).{origin} Indexing "
            f"a tensor gives a tensor: take the offsets out of torch once, cu_q = cu_seqlens_q.tolist(), or "
            f"int(...) each length.")


def _bool_names(exc: BaseException) -> set:
    return {n for n, t in line_tensors(exc).items() if t.dtype == torch.bool}


def _row_vector_on_keys(shapes: dict, sizes: set, line: str) -> Optional[tuple]:
    """(vector, matrix): a per-row vector ``[..., S]`` named on the line beside a tensor
    ``[..., S, S']`` of whose rows it holds one value each, and the error is theirs: its length
    met the keys (the error's two sizes are S and S'), or it is used bare (no index, no method:
    lined up from the right, all its dimensions shift by one). The LSE or delta without its
    trailing 1. An operand reshaped on the line ("lse.transpose(1, 2)") is not this story."""
    for a, sa in shapes.items():
        bare = re.search(rf"(?<![.\w]){re.escape(a)}(?![\w.\[(])", line) is not None
        for b, sb in shapes.items():
            if not (sa and len(sb) == len(sa) + 1 and sb[:-1] == sa):
                continue
            if {sa[-1], sb[-1]} == sizes or (bare and sizes <= set(sa) | set(sb)):
                return a, b
    return None


def _forward_inputs(sources: list) -> list:
    """The names of an autograd.Function's forward inputs, after ctx, from the learner's source."""
    for text in sources:
        m = re.search(r"def\s+forward\s*\(\s*ctx\s*,([^)]*)\)", text)
        if m:
            return [a.split(":")[0].split("=")[0].strip().lstrip("*") for a in m.group(1).split(",") if a.strip()]
    return []


def _autograd_idea(r, sources: list) -> Optional[str]:
    """autograd.Function plumbing: an attribute backward reads that forward never set on ctx, a
    gradient returned for a non-tensor input."""
    message = str(r.error)
    m = re.search(r"'(\w+)Backward' object has no attribute '(\w+)'", message)
    if m:
        name = m.group(2)
        assign = re.compile(rf"^\s*(?:[\w.]+\s*,\s*)*ctx\.{name}\b(?:\s*,\s*[\w.]+)*\s*=(?!=)")
        stored = any(assign.search(line) for t in sources for line in t.splitlines())
        said = ("which was not set when backward ran (assigned on another object, or in a branch "
                "that did not run?)") if stored else "but your forward never assigns it"
        for t in sources:        # assigned below forward's return: lines after a return never run
            body = t.split("def forward", 1)[1].split("def backward", 1)[0] if "def forward" in t else ""
            lines = [line for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
            ret = next((i for i, line in enumerate(lines) if line.strip().startswith("return")), None)
            late = next((line.strip() for line in lines[ret + 1:] if assign.search(line)), None) \
                if ret is not None else None
            if late:
                said = (f"but your forward assigns it *after* its `return` (`{late}`): a return ends the "
                        f"function, and the lines after it never run -- set ctx's attributes before returning")
                break
        return (f"backward reads ctx.{name}, {said}. ctx is the only thing the "
                f"two share: forward puts every non-tensor it needs on it as an attribute (ctx.{name} = "
                f"{name}) and the tensors through ctx.save_for_backward(...).")
    m = re.search(r"returned a gradient different than None at position (\d+)", message)
    if m:
        pos = int(m.group(1))
        names = _forward_inputs(sources)
        which = f" -- forward's input {pos} is {names[pos - 1]}" if 0 < pos <= len(names) else ""
        return (f"backward returned a value at position {pos}{which}, which is not a tensor: there is no "
                f"gradient to give it. backward returns one value per forward input, in order, and None for "
                f"each non-tensor one (causal, scale): return dq, dk, dv, None, None.")
    return None


def _used_before_assigned(r) -> Optional[str]:
    """UnboundLocalError for a name the function assigns only *below* the line that used it."""
    m = re.search(r"local variable '(\w+)'", str(r.error))
    found = raising_line(r.error) if m else None
    if not found:
        return None
    f, lineno, _, _ = found
    name, path = m.group(1), f.f_code.co_filename
    assign = re.compile(rf"^\s*(?:[\w\s,]*,\s*)?{name}\s*(?:,[\w\s,]*)?=(?!=)")
    loop = _loop_left_behind(path, lineno, assign)
    if loop:
        return (f"{name} is assigned only inside the loop above (`{loop}`), and the line shown is not in that "
                f"loop: it is indented less, so it runs once, after the loop. Where the loop ran no times (here), "
                f"{name} never existed; where it ran, the line saw only the last round's {name}. A statement that "
                f"adds up every round (dk += ..., acc = acc + ...) belongs inside the loop: indent it.")
    for n in range(lineno + 1, lineno + 60):
        text = linecache.getline(path, n)
        if not text:
            break
        if assign.match(text):
            return (f"{name} is used on the line shown before it is assigned, further down "
                    f"(`{text.split('#')[0].strip()}`): Python runs the lines in order. Move the line that "
                    f"uses it below that assignment.")
    return None


def _loop_left_behind(path: str, lineno: int, assign) -> Optional[str]:
    """The header of the loop just above line ``lineno`` when ``assign`` (a name's assignment)
    matches only inside that loop's body: the line was dedented out of the loop."""
    text = linecache.getline(path, lineno)
    indent = len(text) - len(text.lstrip())
    assigned = False
    for n in range(lineno - 1, max(0, lineno - 60), -1):
        above = linecache.getline(path, n)
        if not above.strip() or above.lstrip().startswith("#"):
            continue
        if len(above) - len(above.lstrip()) <= indent:     # the statement this line follows
            header = above.split("#")[0].strip()
            return header if assigned and re.match(r"(for|while)\b", header) else None
        assigned = assigned or bool(assign.match(above))
    return None


def _undefined_name(r) -> Optional[str]:
    """NameError: the names the failing frame does have that look like it (o for O, d_q for dq)."""
    m = re.search(r"name '(\w+)' is not defined", str(r.error))
    found = raising_line(r.error) if m else None
    if not found:
        return None
    import difflib

    name, f = m.group(1), found[0]
    known = list(f.f_locals) + [n for n in f.f_globals if not n.startswith("_")]
    fold = lambda n: n.lower().replace("_", "")  # noqa: E731
    alike = [n for n in known if n != name and fold(n) == fold(name)] or \
        difflib.get_close_matches(name, known, n=2, cutoff=0.75)
    if not alike:
        return (f"{name} is not a name this code has: it was never assigned here, or is a parameter of "
                f"another function. Use the name the value has where this line runs.")
    return (f"{name} is not defined here; {' or '.join(f'`{n}`' for n in alike)} is: Python's names are "
            f"case-sensitive and exact (o is not O, d_q is not dq). Use the name the value was given.")


def _specific_idea(r, sources: list = ()):
    """An idea from the error's own numbers and line, where they pin the mistake."""
    message, line, c = str(r.error), r.error_where or "", r.case
    plumbing = _autograd_idea(r, list(sources)) or _used_before_assigned(r) or _undefined_name(r)
    if plumbing:
        return plumbing
    saves = [line.split("#")[0].strip() for src in sources for line in src.splitlines()
             if "save_for_backward(" in line and not line.strip().startswith("#")]
    if re.search(r"values to unpack", message) and len(saves) > 1:
        return (f"save_for_backward is called {len(saves)} times ({'; '.join(f'`{s}`' for s in saves)}): each call "
                f"*replaces* what the previous one saved, so ctx.saved_tensors holds the last call's tensors only. "
                f"Save everything in one call, ctx.save_for_backward(q, k, v, o, lse).")
    if re.search(r"cannot be multiplied|size mismatch|Expected size for first two dimensions", message) and "@" in line:
        shapes, names = line_shapes(r.error), size_names(c)
        same = [n for n, sh in shapes.items() if list(shapes.values()).count(sh) > 1 and len(sh) >= 2]
        # alike by their sizes' names too: [S_q, D] and [S_q, S_k] are not alike where S_k = D
        alike = symbolic(shapes[same[0]][-2:], names) if same else []
        # [S_q, S_k] alike (P and dP): not [S, D] (dO and V), where a transpose is what is missing
        if len(same) >= 2 and shapes[same[0]][-1] != shapes[same[0]][-2] and \
                all(isinstance(x, str) and x != "D" for x in alike):
            return (f"A matrix product (@) of two tensors shaped alike ({', '.join(same)}: "
                    f"{said(shapes[same[0]], names)}): where both are [S_q, S_k] the formula wants the elementwise "
                    f"product (*), as in dS = P * (dP - delta). @ runs only where the shapes happen to "
                    f"chain (S_q = S_k), and is wrong there.")
        product = _product_idea(r.error, line, shapes, names)
        if product:
            return product
    dtypes = _dtype_idea(r)
    if dtypes:
        return dtypes
    dot = _dot_idea(r) or _scalar_tensor_idea(r)
    if dot:
        return dot
    if re.search(r"\w\.T\b", line):
        return (".T reverses *every* dimension of a tensor: on [B, H, S, D] it gives [D, S, H, B]. "
                "Transpose the last two only: .transpose(-1, -2) (or .mT).")
    if re.search(r"must be a (bool|float)", message):
        return ("An argument arrived in the wrong place: compare the call with the function's "
                "signature, argument by argument -- and, in an autograd.Function, what forward saved "
                "in ctx (ctx.causal = causal, ctx.scale = scale, not the other way round).")
    listed = next((line for line in saves if re.search(r"save_for_backward\(\s*[\[(]", line)), None)
    if "save_for_backward can only save" in message and listed:
        return (f"`{listed}` hands save_for_backward one list (or tuple): it takes the tensors themselves, "
                f"as separate arguments -- ctx.save_for_backward(q, k, v, o, lse) -- and hands them back as a "
                f"tuple in ctx.saved_tensors.")
    if "save_for_backward can only save" in message:
        return ("ctx.save_for_backward takes tensors only (it keeps them safe for the backward and "
                "checks they were not modified in between). Plain values -- causal, scale -- go on "
                "ctx as attributes: ctx.causal, ctx.scale = causal, scale.")
    if "more than one element of the written-to tensor" in message or "a leaf Variable that requires grad" in message:
        return ("An input was modified in place (a method ending in _, like mul_, or +=, *= on an "
                "argument). Never write into the inputs: the caller still needs them, and the dO "
                "autograd hands over may be one number expanded to the whole shape (stride 0), "
                "which cannot be written. Compute into a new tensor (do * o, not do.mul_(o)).")
    m = _SIZES.search(message)
    if not m:
        return None
    sizes = {int(m.group(1)), int(m.group(2))}
    shapes = line_shapes(r.error)
    packed = _packed_layout_idea(shapes, sizes, c)
    if packed:
        return packed
    middle = next(((n, sh) for n, sh in shapes.items() if len(sh) >= 2 and
                   re.search(rf"(?<![.\w]){re.escape(n)}\[\s*:\s*,\s*None\s*\]", line)), None)
    if middle and middle[1][-1] in sizes:
        n, sh = middle
        moved = list(sh[:1]) + [1] + list(sh[1:])
        return (f"`{n}[:, None]` puts the new axis second: {n} {list(sh)} becomes {moved}, its values "
                f"lined up along the last axis, against the keys. A value per query row (the LSE, delta) "
                f"must be a column, [..., S_q, 1]: {n}[..., None] (or {n}.unsqueeze(-1)). Where the lengths "
                f"happen to agree, the row broadcasts and is silently wrong.")
    pair = _row_vector_on_keys(shapes, sizes, line)
    if pair:
        vec, mat = pair
        return (f"{vec} {list(shapes[vec])} holds one value per row of {mat} {list(shapes[mat])}, but it "
                f"is lined up from the right, with its last dimension against the keys: a value per query row "
                f"(delta, the LSE) subtracted from every key of its row must be a column, [..., S_q, 1] "
                f"(keepdim=True, or [..., None]). Where a row vector happens to broadcast, it is silently wrong.")
    S_q, S_k, D = getattr(c, "S_q", None), getattr(c, "S_k", None), getattr(c, "D", None)
    if D in sizes and D not in (S_q, S_k, getattr(c, "block_n", None)) and "mask" in line:
        return (f"The mask is sized by the head dimension D = {D}: a length was read from the wrong "
                f"axis. The sequence lengths are S_q = q.shape[-2] and S_k = k.shape[-2] (or the scores' "
                f"S.shape[-2], S.shape[-1]); shape[-1] of q or k is D.")
    if sizes == {S_q, S_k} and S_q != S_k:
        rows = m.group(3) == "2"                   # the query axis of [B, H, S_q, S_k]
        masks = {n: sh for n, sh in shapes.items() if n in _bool_names(r.error) and len(sh) == 2}
        if any(sh == (S_k, S_q) for sh in masks.values()):
            return ("The mask is built with its two lengths swapped: it must be [S_q, S_k] like "
                    "the scores (query rows first), and its two sizes met S_q and S_k the wrong way "
                    f"round here ({m.group(1)} vs {m.group(2)}).")
        twice = re.search(r"(\w+)\(\s*([^,()]+)\s*,\s*\2\s*[,)]", line)
        made = "" if twice else next((f"{n} is {list(shapes[n])}, made by `{t}`: " for n, t in
                                      made_by(r.error, shapes).items()
                                      if re.search(r"(\w+)\(\s*([^,()]+)\s*,\s*\2\s*[,)]", t)), "")
        if not twice and made:     # the operand was made a line or two above, from one length twice
            twice = re.search(r"(\w+)\(\s*([^,()]+)\s*,\s*\2\s*[,)]", made)
        if twice:
            return (f"{made}`{twice.group(1)}({twice.group(2)}, {twice.group(2)}, ...)` is given the same length "
                    f"twice: it builds a square [{twice.group(2)}, {twice.group(2)}] where the scores are "
                    f"[S_q, S_k] = [{S_q}, {S_k}]. The rows count the queries (S.shape[-2]), the last axis the "
                    f"keys (S.shape[-1]).")
        built = _built_from_wrong_length(r.error, shapes, sizes, size_names(c))
        if built:
            return built
        if masks or ("mask" in line and not shapes and not rows):
            got = "".join(f" {n} is {list(sh)}." for n, sh in masks.items())
            return ("The mask does not have the scores' shape: it must be [S_q, S_k] (query rows first, "
                    f"keys last; S_q = {S_q}, S_k = {S_k} here), not its lengths swapped or one length used "
                    f"twice.{got}")
        # the transpose story only where the line's own tensors show one the other way round (with
        # no tensors to read, as before); otherwise the sizes idea lists them with their origins
        flipped = [n for n, sh in shapes.items() if len(sh) >= 2 and sh[-2:] == (S_k, S_q)]
        if rows and (flipped or not shapes):
            made = made_by(r.error, flipped[:1])
            which = (f"{flipped[0]} {said(shapes[flipped[0]], size_names(c))}"
                     + (f", from `{made[flipped[0]]}`," if flipped[0] in made else "")
                     + " is the transpose of the [S_q, S_k] it meets here" if flipped else
                     "An [S_k, S_q] matrix met an [S_q, S_k] one: one operand is transposed")
            return (f"{which}. Write down each product's shape: S and P [S_q, S_k]; dP = dO V^T is "
                    f"[S_q, S_k] (not V dO^T); dV = P^T dO and dK = dS^T Q need the transpose.")
    return None


_PER_HEAD = {"q", "k", "v", "o", "do", "dq", "dk", "dv"}
_TRANSPOSED = r"(?:\.transpose\(\s*-[12]\s*,\s*-[12]\s*\)|\.mT)"
_MATMUL = re.compile(rf"(?<![\w.])(\w+)({_TRANSPOSED}?)\s*\)?\s*@\s*\(?\s*(\w+)({_TRANSPOSED}?)(?![\w(\[.])")


def _product_idea(exc, line: str, shapes: dict, names: dict) -> Optional[str]:
    """A @ B on the line whose inner sizes differ: the operands' shapes by name, and the one
    change that makes it chain -- a transpose added or dropped, or the order swapped."""
    for m in _MATMUL.finditer(line):
        a, ta, b, tb = m.groups()
        if len(shapes.get(a, ())) < 2 or len(shapes.get(b, ())) < 2:
            continue
        flip = lambda sh: list(sh[:-2]) + [sh[-1], sh[-2]]   # noqa: E731
        sa = flip(shapes[a]) if ta else list(shapes[a])
        sb = flip(shapes[b]) if tb else list(shapes[b])
        if sa[-1] == sb[-2]:
            continue
        A, B = a + ("^T" if ta else ""), b + ("^T" if tb else "")
        made = made_by(exc, [a, b])
        origins = "".join(f" {n} is made by `{made[n]}`." for n in (a, b) if n in made)
        square = next((n for n, sh in ((a, sa), (b, sb)) if sh[-1] == sh[-2] and
                       symbolic(sh[-2:], names)[0] in ("S_q", "S_k")), None)
        if square:       # [S_q, S_q]: no quantity of attention has that shape -- it was made wrong
            side = symbolic(shapes[square][-1:], names)[0]
            return (f"{A} @ {B} does not chain: {A} is {said(sa, names)} and {B} is {said(sb, names)}. {square} is "
                    f"[{side}, {side}], a shape no quantity of attention has (S, P, dP, dS are [S_q, S_k]): it was "
                    f"made wrong, by @ where the elementwise * belongs (dS = P * (dP - delta)) or a transpose too "
                    f"many.{origins}")
        # the changes that make it chain, those whose result is not [D, D] (no quantity has it) first
        fixes = []
        if flip(sa)[-1] == sb[-2]:
            fixes.append((flip(sa)[-2], sb[-1], f"{a} {'without its' if ta else 'with a'} transpose: "
                          f"{a}{'' if ta else '^T'} @ {B}"))
        if sa[-1] == flip(sb)[-2]:
            fixes.append((sa[-2], flip(sb)[-1], f"{b} {'without its' if tb else 'with a'} transpose: "
                          f"{A} @ {b}{'' if tb else '^T'}"))
        if sb[-1] == sa[-2]:
            fixes.append((sb[-2], sa[-1], f"the operands in the other order: {B} @ {A}"))
        fixes.sort(key=lambda f: symbolic([f[0], f[1]], names) == ["D", "D"])
        if not fixes:
            continue
        fix = fixes[0][2]
        return (f"{A} @ {B} does not chain: {A} is {said(sa, names)} and {B} is {said(sb, names)}, so the inner "
                f"sizes {sa[-1]} and {sb[-2]} differ. It chains with {fix}.{origins} Each product of the backward: "
                f"dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q ([S_k, S_q] @ [S_q, D]).")
    return None


def _dtype_idea(r) -> Optional[str]:
    """Two float dtypes on the line that raised a dtype error: the operands of the odd one out
    (the lower precision: the one that missed its cast) and the line that made it."""
    if not re.search(r"same dtype|dtype mismatch|expected scalar type|expected m1 and m2", str(r.error)):
        return None
    floats = {n: t.dtype for n, t in line_tensors(r.error).items() if t.is_floating_point()}
    kinds = set(floats.values())
    if len(kinds) != 2:
        return None
    low, high = sorted(kinds, key=lambda d: d.itemsize)
    line = raising_line(r.error)[2]
    # a cast down on the line itself (p.to(v.dtype), x.half()): the cast is the odd operand, and a
    # name read only for its .dtype is no operand at all
    cast = re.search(r"([A-Za-z_][\w.]*)\.(?:to\(\s*(\w+)\.dtype\s*\)|half\(\)|bfloat16\(\)|"
                     r"to\(\s*torch\.(?:float16|half|bfloat16)\s*\))", line)
    if cast and (cast.group(2) is None or floats.get(cast.group(2)) == low):
        return (f"`{cast.group(0)}` casts {cast.group(1)} down to {low} on this line, while the rest of it is "
                f"{high}: a product of the two raises. Keep the running values in fp32 (no cast inside the loop) "
                f"and cast the result once, at the end, with .to(q.dtype).")
    odd = [n for n, d in floats.items() if d == low]
    made = made_by(r.error, odd)
    where = f" (made by `{made[odd[0]]}`)" if odd[0] in made else ""
    return (f"{', '.join(odd)} {'is' if len(odd) == 1 else 'are'} {low} while {'the rest' if len(floats) > 2 else 'the other'} "
            f"of the line {'are' if len(floats) > 2 else 'is'} {high}{where}: {odd[0]} missed the cast its "
            f"neighbours have. Compute in fp32 -- cast every input slice with .float() as it is taken -- and "
            f"cast the results back with .to(q.dtype).")


def _built_from_wrong_length(exc, shapes: dict, sizes: set, names: dict) -> Optional[str]:
    """A position vector from torch.arange (one axis longer than 1) whose length is one of the
    clashing sizes, beside an operand that holds the other one: built from the wrong length."""
    made = made_by(exc, shapes)
    for n, sh in shapes.items():
        long_axes = [d for d in sh if d != 1]
        if "arange(" not in made.get(n, "") or len(long_axes) != 1 or long_axes[0] not in sizes:
            continue
        length, other = long_axes[0], next(iter(sizes - {long_axes[0]}))
        meets = next((o for o, osh in shapes.items() if o != n and other in osh), None)
        if meets is None:
            continue
        # arange(S_k) made a column, or arange(S_q) a row: the right length on the wrong axis
        arg = re.search(r"arange\(([^)]*)\)", made[n]).group(1)
        keys = bool(re.search(r"S_k|shape\[-1\]|shape\[3\]", arg))
        queries = bool(re.search(r"S_q|shape\[-2\]|shape\[2\]", arg))
        column = len(sh) == 2 and sh[-1] == 1
        named = ("keys" if re.fullmatch(r"j|cols?|key\w*|k_\w*|offs_n", n) else
                 "queries" if re.fullmatch(r"i|rows?|quer\w*|q_\w*|offs_m", n) else None)
        if keys != queries and column == keys and named in (None, "keys" if keys else "queries"):
            return (f"{n} {said(sh, names)} from `{made[n]}` is a {'column' if column else 'row'} where a "
                    f"{'row' if column else 'column'} belongs: {'key' if keys else 'query'} positions run along "
                    f"the {'last' if keys else 'first'} axis of [S_q, S_k], so they go "
                    f"{'[None, :]' if keys else '[:, None]'} (a {'row [1, S_k]' if keys else 'column [S_q, 1]'}). "
                    f"Query positions i are a column, key positions j a row: i - j then broadcasts to [S_q, S_k].")
        return (f"{n} {said(sh, names)} from `{made[n]}` has {length} entries, but on this line it meets {meets} "
                f"{said(shapes[meets], names)}, whose axis there holds {other}: {n} is built from the wrong length. "
                f"Query positions run over S_q, key positions over S_k.")
    return None


def _packed_layout_idea(shapes: dict, sizes: set, case=None) -> Optional[str]:
    """Lesson 09's packed batches: a per-sequence tensor still in the packed layout (heads
    second-to-last, [S, H]) where [H, S] belongs, a window mask sized by the sequence's end
    offsets, or P's key axis unlike the window's mask."""
    seen = shapes.get("seen")
    lens_q, lens_k = getattr(case, "lens_q", None), getattr(case, "lens_k", None)
    H, D = getattr(case, "H", None), getattr(case, "D", None)
    for name, sh in shapes.items():
        # a sequence's q, k, v (...) are [H, S, D]: heads first; [S, D, H] is transpose(1, 2) of [S, H, D]
        if lens_q and name.lower() in _PER_HEAD and len(sh) == 3 and H != D and sh[-1] == H and sh[0] != H:
            return (f"{name} {list(sh)} has the heads last, [S, D, H] (H = {H}, D = {D}): one sequence's q, k, v, "
                    f"o and dO are [H, S, D], heads first. The packed slice is [S, H, D], so it is transpose(0, 1) "
                    f"that moves the heads first; transpose(1, 2) swaps H and D.")
    if seen is not None and len(seen) == 2 and lens_q:
        ends = list(zip(_cumulative(lens_q), _cumulative(lens_k)))
        if seen in ends and seen not in list(zip(lens_q, lens_k)):
            return (f"The window's mask is {list(seen)}: the end offsets of a sequence in the packed batch "
                    f"(cu_seqlens_q[b + 1], cu_seqlens_k[b + 1]), not its lengths. A sequence's length is "
                    f"end - start: cu_seqlens[b + 1] - cu_seqlens[b]; only the first sequence starts at 0.")
    for name, sh in shapes.items() if lens_q else ():     # (lesson 09's packed batches only)
        for other, osh in shapes.items():
            # [S_q, H] beside [H, S_q, ...]: the LSE (or a row vector) not transposed per sequence
            if name != other and len(sh) == 2 and len(osh) >= 3 and sh == (osh[1], osh[0]) and sh[0] != sh[1]:
                return (f"{name} {list(sh)} is in the packed layout, heads last, beside {other} {list(osh)}, heads "
                        f"first: one sequence's slice of a packed [total, H] tensor must be transposed to [H, S] "
                        f"({name}[qs].T), as q, k and v are moved to [H, S, D].")
    if seen is not None and len(seen) == 2 and lens_q:
        # the mask [S_k, S_q] while the scores are sliced right too is visible_mask's arguments swapped (below)
        swapped = [b for b, (lq, lk) in enumerate(zip(lens_q, lens_k)) if lq != lk and tuple(seen) == (lk, lq)
                   and not any(len(sh) == 3 and tuple(sh[-2:]) == (lq, lk) for sh in shapes.values())]
        if swapped:
            b = swapped[0]
            return (f"The window's mask is {list(seen)} in sequence {b}, whose S_q = {lens_q[b]} and S_k = "
                    f"{lens_k[b]}: its query length came from cu_seqlens_k and its key length from cu_seqlens_q. "
                    f"The two offset lists are swapped -- where they are unpacked, passed or indexed -- so the "
                    f"queries are also sliced at the keys' offsets. Query-side tensors (q, o, do, lse) go with "
                    f"cu_seqlens_q, key-side ones (k, v) with cu_seqlens_k.")
    if seen is not None and len(seen) == 2:
        for name, sh in shapes.items():
            if name != "seen" and len(sh) == 3 and sh[-2:] == seen[::-1] and seen[0] != seen[1]:
                return (f"The window's mask is {list(seen)} while {name} is {list(sh)}: the mask is [S_k, S_q], its "
                        f"two lengths the other way round. visible_mask takes (S_q, S_k, window) -- the query "
                        f"rows first -- and returns [S_q, S_k]: check the call's argument order.")
            if name != "seen" and len(sh) == 3 and sh[-2:] != seen and sizes <= set(sh) | set(seen):
                which = "keys (its last axis)" if sh[-1] != seen[-1] else "query rows"
                return (f"{name} {list(sh)} does not have the window mask's shape {list(seen)} = [S_q, S_k] of "
                        f"this sequence in its {which}: the slices differ. Query-side tensors (q, o, do, lse) "
                        f"are sliced with cu_seqlens_q[b]:cu_seqlens_q[b + 1], key-side ones (k, v) with "
                        f"cu_seqlens_k[b]:cu_seqlens_k[b + 1].")
    return None


def _matmul_idea(r) -> Optional[str]:
    """A matrix product whose inner dimensions disagree: its operands' shapes and the lines that
    made them (the wrong one is often made a line or two above, by @ where * belongs)."""
    if not re.search(r"mat1 and mat2|cannot be multiplied|size mismatch|Expected size for first two dimensions",
                     str(r.error)):
        return None
    shapes = line_shapes(r.error)
    if not shapes:
        return None
    made = made_by(r.error, shapes)
    known = "; ".join(f"{n} {list(sh)}" + (f" from `{made[n]}`" if n in made else "") for n, sh in shapes.items())
    return (f"A matrix product's inner dimensions do not agree (its tensors: {known}). Check which operand "
            f"is transposed (Q K^T, P^T dO, dO V^T, dS K, dS^T Q) -- and how each was made: an operand "
            f"built with @ where the elementwise * belongs (dS = P * (dP - delta)) has the wrong shape "
            f"already.")


def _cumulative(lens) -> list:
    out, total = [], 0
    for n in lens:
        total += n
        out.append(total)
    return out


def _sizes_idea(r) -> Optional[str]:
    """For a broadcast error that no idea above explains: the sizes, the operands' shapes and
    the line, with no story about which mistake it is."""
    m = _SIZES.search(str(r.error))
    if not m:
        return None
    shapes = line_shapes(r.error)
    dim = f" at dimension {m.group(3)}" if m.group(3) else ""
    made = made_by(r.error, shapes)
    known = "; ".join(f"{n} {list(sh)}" + (f" from `{made[n]}`" if n in made else "") for n, sh in shapes.items())
    return (f"Two operands' shapes do not line up: sizes {m.group(1)} and {m.group(2)} met{dim} on the line "
            f"shown{f' (its tensors: {known})' if known else ''}. Write down the shape of every operand on "
            f"that line -- after each indexing, transpose and sum -- and which dimension should meet which.")


_EXCEPTION_IDEAS = [
    (r"must match the size of tensor|broadcast|size of tensor a",
     "Two operands' shapes do not line up: write down the shape of every operand on the line "
     "shown, and which dimension should meet which."),
    (r"Expected all tensors to be on the same device|is not on the expected device",
     "Tensors on two devices met: a tensor created inside your code (torch.zeros, torch.full, "
     "torch.arange, ...) lives on the CPU unless told otherwise, while the inputs may be on the "
     "GPU. Create each one on the inputs' device (device=q.device), and with their dtype where "
     "it matters."),
    (r"same dtype|dtype mismatch|expected scalar type",
     "Two operands of one operation have different dtypes (fp16 scores and an fp32 LSE, say): "
     "type promotion makes the result fp32 and the next matrix product refuses to mix it with "
     "fp16. Cast on purpose (.float() for the arithmetic, .to(q.dtype) for the results)."),
    (r"mat1 and mat2|cannot be multiplied|size mismatch|Expected size for first two dimensions",
     "A matrix product's inner dimensions do not agree: check which operand is transposed "
     "(Q K^T, P^T dO, dO V^T, dS K, dS^T Q) -- the cases with S_q != S_k tell them apart."),
    (r"view size is not compatible|\.view",
     ".view needs memory laid out for it: on a non-contiguous tensor use .reshape, or avoid "
     "reshaping at all."),
    (r"referenced before assignment|cannot access local variable",
     "A name is used on a path where it was never assigned: it is set inside an `if` (or a loop) "
     "that did not run in the cases that raised -- they say which branch was skipped (a frozen "
     "input: ctx.needs_input_grad False). Compute what every branch needs before the branches."),
    (r"is not defined",
     "A name is used where it does not exist: it was defined only inside another loop or function "
     "(a kernel's row mask lives in the loop over query blocks, not where dK and dV are stored), "
     "or misspelt. Use the quantity that belongs at this place."),
    (r"Expected reduction dim .* non-zero size|cannot perform reduction function .* on .* empty|numel\(\) == 0|zero-size array",
     "A reduction (max, sum) over an empty tensor: a slice with nothing in it. Most often a loop that "
     "runs one block past the end -- range(0, S + 1, block) or range(0, S + block, block) -- whose "
     "last slice starts at S. range(0, S, block) already reaches the partial last block."),
    (r"negative dimension",
     "A length came out negative: a slice or a size computed as end - 1 or end - start where the "
     "sequence is empty (length 0) or the end comes first -- cu_seqlens[b + 1] - 1 as a slice's end, "
     "say. A packed batch may hold an empty sequence: slices end at cu_seqlens[b + 1], exclusive."),
    (r"not enough values to unpack|too many values to unpack",
     "Unpacking got another number of values than names: ctx.saved_tensors holds exactly what "
     "ctx.save_for_backward was given, in that order (and a function returns what it returns: "
     "o, lse = attention_forward(...)). Save everything backward unpacks."),
    (r"must be \[B, H, S_q\]",
     "The package refused the LSE or delta you passed: both hold one number per query row, [B, H, "
     "S_q], as attention_forward and attention_backward_delta return them. The message says which "
     "and what it got."),
    (r"does not require grad and does not have a grad_fn",
     "The output reached backward() without a gradient function: autograd does not see it as "
     "computed from the inputs. In an autograd.Function that is ctx.mark_non_differentiable(o) "
     "(only for outputs with no gradient, like an index or the LSE), or an output computed under "
     "torch.no_grad() or .detach()-ed on the way out."),
    (r"'NoneType' object has no attribute '(?:save_for_backward|saved_tensors|needs_input_grad|mark_\w+)'",
     "forward got None for ctx: the autograd.Function's forward was called directly. Call "
     "FlashAttention.apply(q, k, v, ...): apply makes the ctx, runs forward with it, and records "
     "the node whose backward autograd calls later."),
    (r"incorrect number of gradients",
     "backward returns one value per input of forward, in order, None for the non-tensor ones."),
    (r"must be a bool|must be a float|must be a torch.Tensor",
     "An argument arrived in the wrong place: compare the call with the function's signature, "
     "argument by argument."),
]


def substitution_story(results: list) -> Optional[tuple]:
    """(evidence, idea) when the cases that ran all equal one tensor-for-another swap exactly and
    the cases that raised are exactly those where the swap's two tensors differ in shape: the
    same wrong operand runs where it fits and raises where it does not -- not a transpose."""
    from .substitutions import possible

    raised = [r for r in results if r.error is not None]
    ran_bad = [r for r in results if r.error is None and not r.ok]
    if not raised or len(ran_bad) < 2:
        return None
    common = set.intersection(*({f for f in r.fingerprints if f.startswith("subst:")} for r in ran_bad))
    labels = sorted(l for l in common if " in place of " in l and not any(possible(r.case, l[6:]) for r in raised)
                    and all(possible(r.case, l[6:]) for r in ran_bad))
    if not labels:
        return None
    label = labels[0][6:]
    said = label.split(" equals ", 1)[-1].split(" equal ", 1)[-1]
    m = re.search(r"with (\w+) in place of (\w+) in (.+)$", label)
    product = sorted(f for r in ran_bad[:1] for f in r.fingerprints if f.startswith("operand:"))
    exact = f"yours equals {product[0].split(':', 1)[1]}, exactly" if product else f"yours: {said}, exactly"
    evidence = (f"in all {len(ran_bad)} failing cases that ran {exact}; the {len(raised)} that raised are "
                f"those where the two tensors' shapes differ")
    swap = f"{m.group(1)} where {m.group(2)} belongs in {m.group(3)}" if m else said
    idea = ("One product uses the wrong operand, not a transposed one: " + swap + ". Where the two "
            "tensors happen to have the same shape the product runs and gives a wrong value; where "
            "they differ it raises. Each gradient is one product with fixed operands: dQ = dS K * "
            "scale, dK = dS^T Q * scale, dV = P^T dO, dP = dO V^T.")
    return evidence, idea


def exception_idea(raised: list, sep, sources: list = ()) -> Optional[str]:
    """The idea for the exceptions in ``raised`` (case results); ``sep``: the property that sets
    the raising cases apart, as :func:`flashattn.check.evidence.separating` gives it;
    ``sources``: the learner's source texts."""
    # a case whose sizes all differ first: there every size in the story has one name
    distinct = lambda r: len({getattr(r.case, a, None) for a in ("S_q", "S_k", "D")}) == 3   # noqa: E731
    raised = sorted(raised, key=lambda r: not distinct(r))
    idea = next((i for i in (_specific_idea(r, sources) for r in raised) if i), None)
    if idea:
        return idea

    idea = next((i for i in (origin_idea(r) for r in raised) if i), None)
    if idea:
        return idea
    if sep and sep[1] and sep[0].id == "multi_block":
        return ("It raised only where the keys come in several blocks: the code that runs for the "
                "second block on. Check the block's slice (start : start + block_n, not "
                "start : block_n) and everything offset by the block's start.")
    sized = _sizes_idea(raised[0]) or _matmul_idea(raised[0])
    if sized:
        return sized
    message = str(raised[0].error)
    return next((idea for pattern, idea in _EXCEPTION_IDEAS if re.search(pattern, message)), None)
