"""Stage "the launch": what the launcher handed the kernel (``check.dq_kernel``, ``check.dkdv_kernel``).

The runner records every Triton launch: the scalar arguments by the kernel's parameter names
and the grid (:class:`flashattn.check.instruments.Launch`). Where the kernel keeps the exercise's
parameter names (``H``, ``H_KV``, ``GROUP_SIZE``, ``S_q``, ``S_k``, ``HEAD_DIM``, ``BLOCK_M``,
...), a value unlike the case's -- H_kv where H belongs, two arguments in each other's place --
or a grid whose axes are the other way round from the kernel's ``tl.program_id`` reads is the
mistake itself, whatever the outputs look like. Last, an address outside every tensor
(``wild_access``): a wrong head count is also what sends addresses there.
"""
from __future__ import annotations

import inspect
import re
from typing import Optional

import torch

from ..checkers import DQ
from ..engine import LAUNCH, mistake
from ..evidence import displaced_stores


def _expected(case, checker) -> dict:
    """The exercise kernel's integer parameters -> (what belongs there, its value)."""
    out = {"GROUP_SIZE": ("GROUP_SIZE (H // H_kv)", case.H // max(1, case.heads_kv)),
           "S_q": ("S_q", case.S_q), "S_k": ("S_k", case.S_k), "HEAD_DIM": ("D", case.D)}
    if checker is DQ:
        out["H"] = ("H", case.H)
    else:
        out["H_KV"] = ("H_kv", case.heads_kv)
    return out


def _mismatches(r, checker) -> list:
    """[(parameter, got, (label, want))] for the launches of one case."""
    out = []
    for launch in r.launch_args or ():
        for name, (label, want) in _expected(r.case, checker).items():
            got = launch.args.get(name)
            if isinstance(got, bool) or got is None or not float(got).is_integer():
                continue
            if int(got) != want:
                out.append((name, int(got), (label, want)))
    return out


def _quantities(case) -> dict:
    """Name -> value of every integer a launch could pass (several names may share a value)."""
    H, H_kv = case.H, case.heads_kv
    return {"H": H, "H_kv": H_kv, "GROUP_SIZE (H // H_kv)": H // max(1, H_kv), "S_q": case.S_q,
            "S_k": case.S_k, "D": case.D, "B": case.B, "B * H": case.B * H, "B * H_kv": case.B * H_kv}


def _named(value, case, exclude: str = "") -> str:
    names = [n for n, v in _quantities(case).items() if v == value and n != exclude][:2]
    return f"{value} (= {' or '.join(names)})" if names else f"{value}"


@mistake("launch_value", LAUNCH, "a kernel parameter receives the wrong value from the launch",
         "The launch's arguments fill the kernel's parameters in order: compare them one by one with "
         "the kernel's signature (a value passed twice, two swapped, or one left out shifts every "
         "later one). Each number must be the quantity the kernel's code assumes: H the query heads, "
         "H_KV the K/V heads, GROUP_SIZE = H // H_kv, S_q and S_k, HEAD_DIM = D.", proof="slips/03/launch_value")
def _launch_value(ctx):
    # the mismatches must account for every failing case (a passing case may have one by luck:
    # H_KV = H reads the right heads while B = 1 and the tensors are contiguous)
    mismatches = {id(r): _mismatches(r, ctx.checker) for r in ctx.results}
    ran = [r for r in ctx.failing if r.error is None]
    if not ran or not all(mismatches[id(r)] for r in ran):
        return None
    if {name for r in ran for name, _, _ in mismatches[id(r)]} == {"S_q", "S_k"}:
        return None                  # the two lengths swapped: lengths_swapped names it, with its memory evidence
    seen: dict = {}
    for r in ctx.results:
        for name, got, (label, want) in mismatches[id(r)]:
            seen.setdefault((name, label), []).append((r, got, want))
    found = []
    for (name, label), hits in seen.items():
        failing = [h for h in hits if not h[0].ok]
        if not failing:
            continue
        r, got, want = failing[0]
        found.append(f"{name} received {_named(got, r.case, label)} where {label} = {want} belongs "
                     f"(in {len(failing)} failing case{'s' if len(failing) > 1 else ''}, e.g. '{r.case.name}')")
    return "; ".join(found) + f"; {ctx.tensor_pattern()}"


def _in_every_failing_run(ctx, find) -> Optional[list]:
    """[(case result, find(it))] for the failing cases that ran (raised nothing), when ``find``
    finds something in every one of them; else None."""
    found = [(r, find(r)) for r in ctx.failing if r.error is None]
    return found if found and all(hit for _, hit in found) else None


def _bare(name: str) -> str:
    """A pointer parameter's name without its decorations: ``q_ptr``, ``Q``, ``p_q`` -> ``q``."""
    return re.sub(r"^(p_|ptr_)|(_ptr|_p)$", "", name.lower())


#: the lessons' parameter names (lower case, without "_ptr") -> the handed tensor they stand for
_TENSOR_PARAMS = {"q": "Q", "k": "K", "v": "V", "do": "dO", "lse": "LSE", "delta": "delta",
                  "dq": "dQ", "dk": "dK", "dv": "dV"}


def _tensor_param(name: str):
    """The handed tensor a kernel parameter's name says it holds (``Q``, ``q_ptr``, ``LSE``,
    ``Delta``, ``DK_ptr``), or None for a name the lessons do not use."""
    return _TENSOR_PARAMS.get(_bare(name))


def _wrong_tensors(r) -> list:
    """[(parameter, the tensor it got, the tensor its name says)] for one case's launches."""
    out = []
    for launch in r.launch_args or ():
        for param, got in (launch.tensors or {}).items():
            want = _tensor_param(param)
            if want is not None and got != want and (param, got, want) not in out:
                out.append((param, got, want))
    return out


@mistake("launch_tensor", LAUNCH, "a kernel parameter receives another tensor than its name says",
         "The launch's tensors fill the kernel's pointer parameters in order: compare the call with "
         "the kernel's signature, position by position. Two tensors in each other's place (LSE and "
         "delta, K and V, dK and dV) or one passed twice run without an error -- they are all "
         "pointers -- and the kernel reads or writes the wrong memory.", proof="slips/03/launch_tensor")
def _launch_tensor(ctx):
    found = _in_every_failing_run(ctx, _wrong_tensors)
    if found is None:
        return None
    said = "; ".join(f"parameter {p} received {got} where {want} belongs" for p, got, want in found[0][1])
    return f"{said} (every launch, all {len(found)} failing cases); {ctx.tensor_pattern()}"


def _two_axis_launches(r, block: str):
    """(launch, its block size) for the case's launches with a positive integer ``block`` and a
    grid of at least two axes."""
    for launch in r.launch_args or ():
        size = launch.args.get(block)
        if isinstance(size, int) and size > 0 and launch.grid and len(launch.grid) >= 2:
            yield launch, size


def _row_blocks(r, checker) -> tuple:
    """(the kernel's block parameter, the rows it blocks, the heads per batch element): a dQ
    program owns query rows of one of H heads, a dK/dV program keys of one of H_kv heads."""
    return ("BLOCK_M", r.case.S_q, r.case.H) if checker is DQ else ("BLOCK_N", r.case.S_k, r.case.heads_kv)


_PROGRAM_ID = re.compile(r"(\w+)\s*=\s*tl\.program_id\((?:axis\s*=\s*)?0\)")


def _axis0_is_block(fn, block: str) -> bool:
    """Whether the kernel's source takes its row block from ``tl.program_id(0)`` (the name it
    assigns is multiplied by ``block``)."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    m = _PROGRAM_ID.search(src)
    return bool(m) and re.search(rf"\b{m.group(1)}\s*\*\s*{block}\b", src) is not None


def _swapped_grid(r, checker):
    """(grid, expected) where a launch's grid has the kernel's two axes the other way round."""
    block, rows, heads = _row_blocks(r, checker)
    for launch, size in _two_axis_launches(r, block):
        want = (-(-rows // size), r.case.B * heads)
        if launch.grid[:2] == want[::-1] and want[0] != want[1] and _axis0_is_block(launch.fn, block):
            return launch.grid, want, block
    return None


@mistake("grid_axes", LAUNCH, "the grid's axes are the other way round from the kernel's tl.program_id reads",
         "Your kernel takes its block of rows from tl.program_id(0) and the (batch, head) from "
         "tl.program_id(1), so the grid must list them in that order: (number of row blocks, "
         "B * heads). Swapped, programs get a block index that runs up to B * heads (rows far past "
         "the end, masked or out of bounds) and a head index that stops at the block count (heads "
         "never written).", proof="slips/03/grid_axes")
def _grid_axes(ctx):
    for r in ctx.failing:
        hit = _swapped_grid(r, ctx.checker)
        if hit:
            grid, want, block = hit
            heads = "B * H" if ctx.checker is DQ else "B * H_kv"
            rows = "S_q" if ctx.checker is DQ else "S_k"
            return (f"'{r.case.name}': the grid is {tuple(grid)}, while the kernel reads its row block "
                    f"from program_id(0) (times {block}) and needs (cdiv({rows}, {block}), {heads}) = "
                    f"{want}; {len(ctx.failing)} of {len(ctx.results)} cases fail")
    return None


def _grid_short_in(r, checker):
    """(axis, what the grid has, what belongs, why) where a launch's grid has too few programs:
    row blocks counted with another block size than the kernel's, or a (batch, head) axis
    without the batch."""
    block, rows, heads = _row_blocks(r, checker)
    label = "H" if checker is DQ else "H_kv"
    for launch, size in _two_axis_launches(r, block):
        blocks, pairs = launch.grid[:2]
        if blocks * size < rows and blocks != rows // size:      # rows // size: unwritten's cdiv story
            other = next((b for b in (16, 32, 64, 128) if b != size and -(-rows // b) == blocks), None)
            why = (f"it counts blocks of {other} rows while the kernel's {block} is {size}: the same block size "
                   f"must size both" if other else f"{blocks} programs of {size} rows cover {blocks * size} "
                   f"of {rows}")
            return 0, blocks, f"cdiv({'S_q' if checker is DQ else 'S_k'}, {block}) = {-(-rows // size)}", why
        other_heads = r.case.heads_kv if checker is DQ else r.case.H      # grid_heads' slip, not this one
        if r.case.B > 1 and pairs == heads and pairs < r.case.B * heads and pairs != r.case.B * other_heads:
            later = "batch element 1" if r.case.B == 2 else f"batch elements 1 ... {r.case.B - 1}"
            return 1, pairs, f"B * {label} = {r.case.B * heads}", (
                f"it counts the heads of one batch element only: no program runs for {later}, whose "
                f"outputs are never written")
    return None


@mistake("grid_short", LAUNCH, "the grid has too few programs: part of the output is never computed",
         "The grid is (row blocks, B * heads): one program per block of rows (cdiv of the length by the "
         "kernel's own block size) for every (batch, head) pair, the kernel taking b = pid // heads and "
         "h = pid % heads. With fewer programs the rows or batch elements that no program owns keep "
         "whatever the output held.", proof="slips/03/grid_short")
def _grid_short(ctx):
    for r in ctx.failing:
        hit = _grid_short_in(r, ctx.checker)
        if hit:
            axis, got, want, why = hit
            return (f"'{r.case.name}': grid axis {axis} is {got} where {want} belongs: {why}; "
                    f"{ctx.case_pattern()}")
    return None


def _rows_written(t) -> int:
    """How many leading rows (keys for dK, dV) of a partly unwritten output hold values: n when
    rows 0 ... n - 1 were written and every later one was not; -1 for any other picture."""
    a = t.actual
    if a is None or a.dim() != 4 or not t.unwritten:
        return -1
    written = torch.isfinite(a).flatten(3).any(-1).any(0).any(0)          # [rows]
    n = int(written.sum())
    return n if n and bool(written[:n].all()) else -1


@mistake("block_offset_step", LAUNCH, "the programs' rows overlap: a block's first row is its program id, not id * BLOCK",
         "Program p owns rows p * BLOCK ... p * BLOCK + BLOCK - 1: offs = pid * BLOCK + tl.arange(0, BLOCK). "
         "Without the * BLOCK the programs start one row apart, so their blocks overlap and the rows past "
         "(programs + BLOCK - 1) are never written.", proof="slips/03/block_offset_step")
def _block_offset_step(ctx):
    block = "BLOCK_M" if ctx.checker is DQ else "BLOCK_N"
    for r in ctx.failing:
        for launch in r.launch_args or ():
            size, grid = launch.args.get(block), launch.grid
            if not isinstance(size, int) or not grid:
                continue
            for t in r.bad():
                n = _rows_written(t)
                if n > 0 and n == grid[0] + size - 1 and grid[0] > 1:
                    return (f"'{r.case.name}': {t.name} holds values in rows 0-{n - 1} only: {grid[0]} programs "
                            f"of {block} = {size} rows starting one row apart reach row {grid[0] - 1} + {size - 1}; "
                            f"{ctx.case_pattern()}")
    return None


_PROGRAM_AXIS = re.compile(r"program_id\(\s*(?:axis\s*=\s*)?(\d)\s*\)")


@mistake("grid_missing_axis", LAUNCH, "the grid has fewer axes than the kernel's tl.program_id reads",
         "tl.program_id(axis) is 0 on every axis the grid does not have: a kernel that takes its "
         "(batch, head) from program_id(1) needs a two-axis grid, (row blocks, B * heads). Flattened "
         "into one axis, every program computes batch 0, head 0, and the rest is never written.",
         proof="slips/04/grid_missing_axis")
def _grid_missing_axis(ctx):
    for r in ctx.failing:
        for launch in r.launch_args or ():
            try:
                src = inspect.getsource(launch.fn)
            except (OSError, TypeError):
                continue
            axes = [int(a) for a in _PROGRAM_AXIS.findall(src)]
            if launch.grid and axes and max(axes) >= len(launch.grid):
                return (f"'{r.case.name}': the grid {tuple(launch.grid)} has {len(launch.grid)} axis(es), and "
                        f"the kernel reads tl.program_id({max(axes)}); {ctx.case_pattern()}")
    return None


def _stride_args(launch, param: str) -> tuple:
    """What a launch passed as tensor parameter ``param``'s strides (stride_q_b, stride_qs, ...)."""
    return tuple(v for n, v in launch.args.items() if re.fullmatch(rf"stride_?{_bare(param)}_?[bhsdmn]", n))


def _copies_with_old_strides(r) -> list:
    """[(parameter, the strides of the tensor it got, the strides its stride_* parameters got)]:
    a tensor that is not one of those handed in (a copy: .contiguous(), .float()) launched with
    strides that are not its own -- the original's, read before the copy was made."""
    out = []
    for launch in r.launch_args or ():
        for param, own in (launch.strides or {}).items():
            if _tensor_param(param) is None or (launch.tensors or {}).get(param) is not None:
                continue
            passed = _stride_args(launch, param)
            if len(passed) == len(own) and passed != own and (param, own, passed) not in out:
                out.append((param, own, passed))
    return out


@mistake("copy_strides", LAUNCH, "a copy is launched with the strides of the tensor it was copied from",
         "q.contiguous() (or .float(), .clone()) is a new tensor with strides of its own: where the input "
         "was not contiguous they differ from q.stride(). The kernel walks the copy with the strides it is "
         "given, so pass the strides of the tensor you pass: make the copy first (q = q.contiguous()), "
         "then launch with q and *q.stride().", proof="slips/03/copy_strides")
def _copy_strides(ctx):
    ran = [r for r in ctx.failing if r.error is None]
    found = {id(r): _copies_with_old_strides(r) for r in ran}
    hits = [r for r in ran if found[id(r)]]
    if not hits or len(hits) < len(ran) / 2:
        return None
    param, own, passed = found[id(hits[0])][0]
    return (f"in '{hits[0].case.name}' parameter {param} received a tensor that is not the one handed in (a copy) "
            f"with strides {own}, while its stride parameters received {passed}; {ctx.case_pattern()}")


def _outputs_copied(r) -> list:
    """The output parameters (dQ, dK, dV) that received a tensor other than the one handed in."""
    return sorted({_tensor_param(p) for launch in r.launch_args or () for p in (launch.pointers or {})
                   if _tensor_param(p) in ("dQ", "dK", "dV") and (launch.tensors or {}).get(p) is None})


@mistake("output_copy", LAUNCH, "the kernel writes into a copy of the output, not into the output handed in",
         "dq.contiguous() (like .clone(), .float(), .to(...)) is a new tensor wherever dq is not already "
         "contiguous: the kernel fills the copy, and the dq the caller holds keeps its old contents. Pass "
         "the output itself with its own strides (*dq.stride()): the kernel can write any layout.",
         proof="slips/03/output_copy")
def _output_copy(ctx):
    found = _in_every_failing_run(ctx, _outputs_copied)
    if found is None or any(_outputs_copied(r) for r in ctx.results if r.ok):
        return None
    r, names = found[0]
    return (f"in '{r.case.name}' the kernel's {' and '.join(names)} parameter received a tensor that is not "
            f"the one handed in (its address differs), and the output handed in was not written; the cases that "
            f"pass hand contiguous outputs, where .contiguous() returns the tensor itself; {ctx.case_pattern()}")


def _borrowed_strides(r) -> list:
    """[(parameter, the tensor it got, its strides, what its stride parameters got, whose they are)]:
    a handed tensor launched with another tensor's strides."""
    out = []
    output = lambda name: name in ("dQ", "dK", "dV")  # noqa: E731  (an output's likely donor: an output)
    for launch in r.launch_args or ():
        strides, tensors = launch.strides or {}, launch.tensors or {}
        for param, own in strides.items():
            got = tensors.get(param)
            passed = _stride_args(launch, param)
            if got is None or len(passed) != len(own) or passed == own:
                continue
            whose = [tensors[p] for p, st in strides.items() if st == passed and p != param and p in tensors]
            if not whose:
                continue
            whose.sort(key=lambda name: output(name) != output(got))
            hit = (param, got, own, passed, f"{whose[0]}'s")
            if hit not in out:
                out.append(hit)
    return out


@mistake("borrowed_strides", LAUNCH, "a tensor is launched with another tensor's strides",
         "Each tensor's stride parameters must get that tensor's own .stride(): *dk.stride() for dK, "
         "*dv.stride() for dV. Two tensors laid out alike hide the slip (their strides are equal), which "
         "is why one case hands them in different layouts.", proof="slips/04/borrowed_strides")
def _borrowed_strides_test(ctx):
    found = _in_every_failing_run(ctx, _borrowed_strides)
    if found is None:
        return None
    r, ((param, got, own, passed, whose), *_) = found[0]
    return (f"in '{r.case.name}' parameter {param} received {got} (strides {own}) but its stride parameters "
            f"received {passed}, which are {whose}; {ctx.case_pattern()}")


@mistake("wild_access", LAUNCH, "an address falls outside every tensor the kernel was given",
         "Some loads or stores reached memory that belongs to none of the kernel's tensors (in the "
         "interpreter the checker fences them off; on a GPU they land wherever the address points: an "
         "illegal memory access, or silent corruption of something else). "
         "The address is far off, not one block too far: the batch and head decoded from the program "
         "id the wrong way round, two strides swapped, a head count or a grid larger than the tensors "
         "(H_kv passed where H belongs), or an offset built from the wrong length.",
         proof="planted/dq.batch_head_swapped")
def _wild_access(ctx):
    hits = [r for r in ctx.results if r.wild]
    if not hits:
        return displaced_stores(ctx)
    loads, stores = (sum(r.wild[k] for r in hits) for k in ("loads", "stores"))
    return (f"{stores} stores and {loads} loads outside every tensor, in {len(hits)} of "
            f"{len(ctx.results)} cases ({ctx.names_of(hits)})")
