"""The mistakes of the stages that come first and in between: the code did not run, it raised,
wrote into an input or raced, stray addresses, a batch offset, the head-dim mask, strides,
memory, NaN, a sign and the scale. Each is one function with its title (what is wrong) and idea
(the principle to check: no code) beside it, and returns the evidence from this run, or None.

Every checker tries the stages in this order (:mod:`flashattn.check.checkers` holds each row): the code did not run (not written, no kernel, wrong order or shape, exceptions);
it wrote into an input; it ran differently twice (a race); patterns that pin a cause exactly (a
batch offset, the head-dim mask, the GQA head, one tensor with another's strides); memory (reads past the end, elements never written); exact
matches with known wrong formulas; NaN; writes past the end; constant factors; which outputs are
wrong; which cases are wrong; and last, what was seen."""
from __future__ import annotations

import inspect
import math
import re

import torch

from .battery import BLOCKS
from .checkers import AUTOGRAD, KERNELS
from .engine import DID_NOT_RUN, LAUNCH, MEMORY, NUMBERS, OUTPUTS, PINNED, RAN_BADLY, mistake
from .errors import CtxTensors, DtypeError, NoBackwardKernel, NoGradient, ShapeError, Unwritten
from .evidence import errors_raised, exactly as _exactly, first_raised, ranges, separating
from .source import first_line, guard_story, unused_assignments
from .exception_ideas import exception_idea, substitution_story
from .exception_origins import _chain
from .origin import _kernels_used
from .shape_names import (aliased_buffers, dtype_story, lost_axes, returned_the_wrong_thing, saved_unpacked_otherwise,
                          shape_story, squeeze_story, unpacked_out_of_order_line)

# --------------------------------------------------------------------------------------
# the code did not run
# --------------------------------------------------------------------------------------


#: an accumulator made by tl.zeros in the inputs' 16-bit type: ``name = tl.zeros(..., dtype=...)``
_ZEROS = re.compile(r"^\s*(\w+)\s*=\s*tl\.zeros\((.*)\)\s*(?:#.*)?$")
_HALF_DTYPE = re.compile(r"dtype\s*=\s*(tl\.(?:float16|bfloat16)|\b(?:Q|K|V|DO|DQ|DK|DV|O)\.dtype\.element_ty)")


def _launched_kernels(results: list, fn) -> list:
    """(name, Python function) of the Triton kernels the cases launched -- or, where none got as far
    as launching (a compile error), those the launcher ``fn`` names (``origin._kernels_used``)."""
    found = {id(l.fn): (l.kernel, l.fn) for r in results for l in r.launch_args or [] if l.fn is not None}
    return list(found.values()) or [(name, k.fn) for name, k in _kernels_used(fn)]


@mistake("accumulator_precision", DID_NOT_RUN, "an accumulator is made in a 16-bit type",
         "A sum over many tiles -- dQ, dK, dV, O -- is kept in tl.float32 and cast to the "
         "output's type once, at the store. Triton's CPU interpreter computes a 16-bit "
         "tl.zeros in fp32 anyway, so the values pass there; on a GPU the loop does not "
         "compile (tl.dot returns fp32, which changes the carried variable's type), and "
         "summed in fp16 the gradient would lose its low digits. Make it tl.zeros(..., "
         "dtype=tl.float32).", when_passing=True)
def _accumulator_precision(ctx):
    """A kernel whose values passed, but whose accumulators (``tl.zeros`` outside the loop) take a
    16-bit type: Triton's CPU interpreter quietly computes them in fp32, while a GPU refuses to
    compile the loop (tl.dot's fp32 result changes the carried variable's type) or, written to
    compile, sums in half precision. Tried only where every case passed (the interpreter) or
    failed to compile (a GPU), on the kernels the cases launched. Tried even when every case
    passed (``when_passing``): it reads the code, not the values."""
    results = ctx.results
    compiled_not = bool(results) and all(r.error is not None and
                                         any(type(e).__name__ == "CompilationError" for e in _chain(r.error))
                                         for r in results)
    if not results or not (all(r.ok for r in results) or compiled_not):
        return None
    for kernel, kernel_fn in _launched_kernels(results, ctx.subject):
        try:
            source = inspect.getsource(kernel_fn)
        except (OSError, TypeError):
            continue
        for line in source.splitlines():
            m = _ZEROS.match(line)
            half = _HALF_DTYPE.search(m.group(2)) if m else None
            if half:
                return (f"`{line.split('#')[0].strip()}` in {kernel}: dtype {half.group(1)}" +
                        ("; on this GPU the kernel did not compile" if compiled_not else ""))
    return None


@mistake("not_implemented", DID_NOT_RUN, "not written yet",
         "Your code still raises NotImplementedError: replace the `raise NotImplementedError()` line "
         "(the `# YOUR CODE HERE` block) with your implementation, re-run that cell, then this one.")
def _not_implemented(ctx):
    first = first_raised(ctx, Unwritten)
    if first is None:
        return None
    function = getattr(first.error, "function", "")
    return (f"it is raised in `{function}`: that function is still to be written"
            if function and not function.startswith("<") else "")


@mistake("no_backward_kernel", DID_NOT_RUN, "the backward launched no kernel",
         "Lesson 05 wires the *kernels* into autograd: backward calls attention_backward_delta, "
         "attention_backward_dq and attention_backward_dkdv on what forward saved. Yours got the "
         "gradients without launching one (PyTorch's autograd on a recomputed softmax?): the values "
         "are right, but that backward builds the S_q x S_k matrices the kernels exist to avoid.")
def _no_backward_kernel(ctx):
    hits = errors_raised(ctx, NoBackwardKernel)
    if not hits:
        return None
    return f"no Triton kernel ran inside backward, in {len(hits)} of {len(ctx.results)} cases"


@mistake("ctx_attributes", DID_NOT_RUN, "tensors are kept on ctx as attributes, not with ctx.save_for_backward",
         "ctx.save_for_backward(q, k, v, o, lse) is how an autograd.Function keeps tensors for its "
         "backward (ctx.saved_tensors hands them back): autograd then checks that none was changed in "
         "place before the backward runs -- a silently wrong gradient otherwise -- and frees them once "
         "the backward is done. A tensor put on ctx as an attribute (ctx.o = o) gets neither: an in-place "
         "change goes unnoticed, and ctx and the output keep each other alive until the garbage "
         "collector runs. Plain values (causal, scale) are the ones that go on ctx as attributes.")
def _ctx_attributes(ctx):
    hits = errors_raised(ctx, CtxTensors)
    if not hits:
        return None
    return (f"forward put {', '.join('ctx.' + n for n in hits[0].error.names)} on ctx, in {len(hits)} of "
            f"{len(ctx.results)} cases")


@mistake("no_kernel", DID_NOT_RUN, "your launcher ran no kernel",
         "This checker checks a kernel: the launcher must launch it (kernel[grid](...)) and let it "
         "write the outputs it was given. It computed them some other way (plain PyTorch?) or not at all.")
def _no_kernel(ctx):
    counted = [r for r in ctx.results if r.launches is not None]
    if counted and all(r.launches == 0 for r in counted):
        return f"the launcher returned without launching any kernel, in all {len(counted)} cases"
    return None


@mistake("grad_order", DID_NOT_RUN, "gradients returned in the wrong order",
         "Return the gradients in the order of the inputs they belong to: (dq, dk, dv) for "
         "(q, k, v) -- and in an autograd.Function, one per input of forward, None for the "
         "non-tensor ones.")
def _grad_order(ctx):
    swapped = [r for r in ctx.results if r.swapped]
    if swapped:
        got, wanted = swapped[0].swapped
        return f"in {ctx.names_of(swapped)} the tensor returned as {got} has the shape of {wanted}"
    # (a case that asks for some gradients only cannot show a pair holding each other's values)
    full = [r for r in ctx.failing if ctx.checker is not AUTOGRAD or {"dQ", "dK", "dV"} <= set(r.tensors)]
    if full and all("swapped" in r.fingerprints for r in full):
        evidence = f"in every failing case two gradients hold each other's true values ({ctx.tensor_pattern()})"
        if ctx.checker in KERNELS:
            return evidence, ("Each output pointer gets its own values: the kernel stores dK's "
                              "accumulator into DK with DK's strides, dV's into DV.")
        # the return may be right and the names wrong where a call's results are unpacked
        unpacked = next((m.group(0) for src in ctx.sources for m in
                         [re.search(r"\b(dv\s*,\s*dk|dk\s*,\s*dq|dv\s*,\s*dq)\s*=\s*[\w.]+\(", src)] if m), None)
        if unpacked:
            return evidence + f"; `{unpacked}...)` names the call's results the other way round", (
                "Two places decide the order: the return, (dq, dk, dv) for (q, k, v), and where a call's "
                "results are unpacked into names -- attention_backward_dkdv returns (dk, dv), in that "
                "order, so dk, dv = attention_backward_dkdv(...). Here the return is right and the names "
                "are swapped.")
        return evidence
    return None


_SHAPE = re.compile(r"[\[(](\d+(?:, ?\d+)+)[\])]")


@mistake("saved_order", DID_NOT_RUN, "O and the LSE trade places on their way to the backward",
         "A tensor with the LSE's shape [B, H, S_q] arrived where O [B, H, S_q, D] was expected, or the "
         "reverse. Two places can swap them: the forward's results (o, lse = attention_forward(...), "
         "in the order it returns them) and ctx.saved_tensors, which come back in the order "
         "ctx.save_for_backward was given them.")
def _saved_order(ctx):
    for r in ctx.results:
        if r.error is None:
            continue
        c = r.case
        shapes = {tuple(int(x) for x in m.split(",")) for m in _SHAPE.findall(str(r.error))}
        if (c.B, c.H, c.S_q) in shapes and (c.B, c.H, c.S_q, c.D) in shapes:
            unpacked = [line.split("#")[0].strip() for src in ctx.sources for line in src.splitlines()
                        if re.search(r"\blse\s*,\s*o\s*=\s*.*attention_forward\(", line)]
            where = f"; `{unpacked[0]}` takes the forward's results in the other order (it returns o, lse)" \
                if unpacked else saved_unpacked_otherwise(ctx)
            return f"case '{c.name}': {type(r.error).__name__}: {str(r.error)[:200]}{where}"
    return None


@mistake("dtype", DID_NOT_RUN, "an output has the wrong dtype",
         "Return each output in the dtype the exercise asks for: O like q (cast the fp32 "
         "accumulator back with .to(q.dtype)), LSE in fp32, gradients like the inputs they belong to.")
def _dtype(ctx):
    r = first_raised(ctx, DtypeError)
    if r is None:
        return None
    made = first_line(ctx, lambda c: re.search(r"torch\.(?:zeros|empty|ones)\(\s*[\w.]+\.shape\s*\)", c))
    if made:     # a buffer in torch's defaults: float32 on the CPU
        return (f"case '{r.case.name}': {r.error}; `{made}`",
                "torch.zeros(shape) (empty, ones) makes torch's default: float32, on the CPU. A buffer "
                "the results are written into takes its input's dtype and device: torch.zeros_like(q), "
                "or dtype=q.dtype, device=q.device.")
    story = dtype_story(ctx, str(r.error))          # .float() on float64 inputs
    return (f"case '{r.case.name}': {r.error}; `{story[0]}`", story[1]) if story else f"case '{r.case.name}': {r.error}"


@mistake("none_gradient", DID_NOT_RUN, "a gradient came back None although its input requires grad",
         "backward returns None for an input only when ctx.needs_input_grad says it needs none. "
         "needs_input_grad is indexed like forward's inputs: 0 is q, 1 is k, 2 is v -- check which "
         "index guards which gradient.")
def _none_gradient(ctx):
    r = first_raised(ctx, NoGradient)
    if r is None:
        return None
    evidence = f"case '{r.case.name}' (inputs requiring grad: {', '.join(r.case.requires)}): {r.error}"
    unused = unused_assignments(ctx)
    if unused:                     # d_q = ... computed, dq returned: the gradient is never handed back
        return (f"{evidence}; `{unused[0]}` computes a value that is never used afterwards",
                "The gradient is computed but not returned: the name assigned is not the one returned (a "
                "typo, d_q for dq?), or it is assigned after the return. backward returns one value per "
                "forward input, in order.")
    story = guard_story(ctx, getattr(r.error, "missing", ()))
    if story:                      # `if not needs_input_grad[i]`, or dK/dV inside q's guard
        return f"{evidence}; {story[0]}", story[1]
    # None for *every* input that needs a gradient, in every case: the guard is the wrong way round
    if all(isinstance(x.error, NoGradient) and set(getattr(x.error, "missing", ())) == set(x.case.requires)
           for x in ctx.results):
        return (evidence + "; in every case, for every input that requires grad",
                "backward returned None for every input that needs a gradient, and only for those: the "
                "guard is inverted. ctx.needs_input_grad[i] is True when input i *needs* its gradient: "
                "compute it then, return None otherwise.")
    return evidence


@mistake("shape", DID_NOT_RUN, "an output has the wrong shape or type",
         "Return tensors shaped like the reference: dQ like q, dK and dV like k and v, "
         "P [B, H, S_q, S_k], LSE [B, H, S_q].")
def _shape(ctx):
    r = first_raised(ctx, ShapeError)
    if r is None:
        return None
    message = str(r.error)
    if r.error.idea:            # the place that raised knew the story (a float; K/V heads under GQA)
        return message, r.error.idea
    if unpacked_out_of_order_line(ctx):      # B, S_q, H, D = q.shape: line rule shape_unpack_order names it
        return None
    returned = returned_the_wrong_thing(ctx, message) or squeeze_story(ctx, r.case)
    if returned:
        return message, returned
    aliased = aliased_buffers(ctx)
    if aliased:
        return message, aliased
    m = re.search(r"(\w+) has shape \(([\d, ]+)\), expected (?:\[[\w, ]+\] = )?[(\[]([\d, ]+)[)\]]", message)
    if m:
        got = [int(x) for x in m.group(2).split(",") if x.strip()]
        want = [int(x) for x in m.group(3).split(",") if x.strip()]
        story = shape_story(m.group(1), got, want, r.case)
        if story and "comes out transposed" in story:
            turned = first_line(ctx, lambda c: c.startswith("return") and
                                 re.search(r"\.mT\b|\.T\b|\.transpose\(|\.permute\(", c))
            if turned and "mask" in m.group(1):
                story = f"`{turned}` turns it round. {story}"
            elif turned:
                story = (f"`{turned}` turns the result round: {m.group(1)} comes out {tuple(got)} where "
                         f"{tuple(want)} belongs. Return it as it was computed, without that transpose.")
        if story:
            return message, story
        off = [(i, g - w) for i, (g, w) in enumerate(zip(got, want)) if g != w] if len(got) == len(want) else []
        if len(off) == 1 and abs(off[0][1]) == 1:
            i, d = off[0]
            return message, (f"{m.group(1)} is one {'short' if d < 0 else 'too long'} in dimension {i} "
                             f"({got[i]} where {want[i]} belongs): a range or slice one off -- Python's "
                             f"range(n) and [a:b] leave out their end (n, b); W + 1 diagonals are range(W + 1).")
        if len(got) < len(want) and got == [w for w in want if w != 1][:len(got)] and 1 in want:
            return message, lost_axes(ctx, m.group(1), got, want)
        if got == want + [1]:
            return message, (f"{m.group(1)} has an extra trailing axis of size 1: {tuple(got)} where "
                             f"{tuple(want)} belongs. A running maximum or sum kept with keepdim=True (or "
                             f"shaped [..., 1] to broadcast against the rows) still carries it at the end: "
                             f"drop it where you return, .squeeze(-1).")
    return message





@mistake("exception", RAN_BADLY, "your code raised an exception",
         "The error and the line it came from are shown below; the cases it raised in say what they "
         "share (S_q != S_k, non-contiguous tensors, ...).")
def _exception(ctx):
    raised = [r for r in ctx.results if r.error is not None]
    if not raised:
        return None
    sep = separating(ctx.results, raised)
    where = f"only in {sep[0].label}" if sep and sep[1] else f"in {len(raised)} of {len(ctx.results)} cases"
    evidence = f"raised {where} ({ctx.names_of(raised)})"
    story = substitution_story(ctx.results)
    if story:                      # a wrong operand: it runs where shapes fit, raises elsewhere
        return f"{evidence}; {story[0]}", story[1]
    ran_bad = [r for r in ctx.results if r.error is None and not r.ok]
    if ran_bad and all("scores_transposed" in r.fingerprints for r in ran_bad) and \
            all(r.case.S_q != r.case.S_k for r in raised):
        return (f"{evidence}; in the {len(ran_bad)} square cases that ran, yours equals P rebuilt from S^T = K Q^T "
                f"exactly; the cases that raised are those with S_q != S_k",
                "The scores are transposed: S = K Q^T is [S_k, S_q]. S = Q K^T * scale is [S_q, S_k], "
                "a row per query, as the LSE and the mask expect. Where S_q = S_k the transposed scores "
                "run (and are wrong); elsewhere they raise.")
    idea = exception_idea(raised, sep, ctx.sources)
    return (evidence, idea) if idea else evidence


_HANDED_NAMES = {"q": "Q", "k": "K", "v": "V", "o": "O", "do": "dO", "lse": "LSE", "delta": "delta",
                 "bias": "bias", "tau": "tau"}


def _factor_text(f, case) -> str:
    if f is None:
        return ""
    if isinstance(f, str):            # the shape changed: what inputs_changed says about it
        return f"; {f}"
    if f == 0:
        return ", set to zero"
    s = case.scale_value
    named = " = the softmax scale" if abs(f / s - 1) < 1e-2 else " = 1/scale" if abs(f * s - 1) < 1e-2 else ""
    return f", scaled by {f:.4g}{named}"


@mistake("input_modified", RAN_BADLY, "your code wrote into one of its inputs",
         "Inputs are read-only: compute into a new tensor (q * scale, not q.mul_(scale); q = q * "
         "scale, not q *= scale; no do.zero_(), no out= pointing at an input). The caller still "
         "needs them -- autograd reuses the tensors it saved, and a second call sees the changed "
         "values, which is also why two runs on the same input differ.")
def _input_modified(ctx):
    hits = [r for r in ctx.results if r.inputs_modified]
    if not hits:
        return None
    # stores outside every tensor (or, on a GPU, output elements unwritten beside stores past its
    # end): whether some also land in an input is luck of the memory layout; wild_access speaks
    if any(r.wild and r.wild.get("stores") for r in ctx.results) or _displaced_stores(ctx) is not None \
            or any(t.guard_touched for _, t in ctx.bad_tensors()):      # (stores past an output's end too)
        return None
    r = hits[0]
    name, (n, total, f) = next(iter(r.inputs_modified.items()))
    names = list(dict.fromkeys(_HANDED_NAMES.get(m, m) for h in hits for m in h.inputs_modified))
    evidence = (f"your code wrote into its input {_HANDED_NAMES.get(name, name)} in '{r.case.name}' ({n} of "
                f"{total} elements changed{_factor_text(f, r.case)}); inputs written: "
                f"{', '.join(names)}, in {len(hits)} of {len(ctx.results)} cases")
    if ctx.checker in KERNELS:
        return evidence, ("Inputs are read-only: a kernel stores only into the outputs it is given (DQ; DK "
                          "and DV), and the launcher does not change its arguments in place (q * scale, not "
                          "q.mul_(scale)). Check each tl.store's pointer: it must be built from the output's "
                          "base and the output's strides, not an input's.")
    return evidence


@mistake("race", RAN_BADLY, "results change between runs on the same input: a race on a global accumulator",
         "Two runs on identical inputs gave different bits. Several programs (or threads) add into "
         "the same output addresses, and the order of those additions -- or whether an update is "
         "lost -- depends on scheduling. Atomics fix lost updates but not the order. Give every "
         "output block to exactly one program that accumulates in registers and stores once.")
def _race(ctx):
    r = next((r for r in ctx.results if r.nondeterministic), None)
    return f"case '{r.case.name}': {', '.join(r.nondeterministic)} differed between two runs" if r else None




@mistake("wild_access", LAUNCH, "an address falls outside every tensor the kernel was given",
         "Some loads or stores reached memory that belongs to none of the kernel's tensors (in the "
         "interpreter the checker fences them off; on a GPU they land wherever the address points: an "
         "illegal memory access, or silent corruption of something else). "
         "The address is far off, not one block too far: the batch and head decoded from the program "
         "id the wrong way round, two strides swapped, a head count or a grid larger than the tensors "
         "(H_kv passed where H belongs), or an offset built from the wrong length.")
def _wild_access(ctx):
    hits = [r for r in ctx.results if r.wild]
    if not hits:
        return _displaced_stores(ctx)
    loads, stores = (sum(r.wild[k] for r in hits) for k in ("loads", "stores"))
    return (f"{stores} stores and {loads} loads outside every tensor, in {len(hits)} of "
            f"{len(ctx.results)} cases ({ctx.names_of(hits)})")


def _displaced_stores(ctx):
    """A GPU fences nothing off, but the guard past an output shows stores that landed there: with
    contiguous inputs and block-multiple lengths, unwritten elements beside elements written past
    the end mean the store's address itself is wrong."""
    shifted = [(r, t) for r, t in ctx.bad_tensors()
               if r.case.contiguous and _aligned(r.case) and t.unwritten and t.guard_touched]
    if not shifted:
        return None
    r, t = shifted[0]
    return (f"'{r.case.name}' (contiguous inputs, lengths multiples of {BLOCKS[-1]}): {t.unwritten} "
            f"elements of {t.name} never written and {t.guard_touched} written past its end -- its stores "
            f"went to other addresses; {ctx.case_pattern()}")




# --------------------------------------------------------------------------------------
# patterns that pin one cause
# --------------------------------------------------------------------------------------

@mistake("batch", PINNED, "only batch element 0 is right: a batch offset is missing or wrong",
         "Wrong exactly in the cases with several batch elements: some tensor's pointer is not moved "
         "to its batch element (b * that tensor's own batch stride), or is moved with another "
         "tensor's batch stride.")
def _batch(ctx):
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}" if _exactly(ctx, "batch") else None


@mistake("head_dim_mask", PINNED, "a load or store lacks the head-dim mask (offs_d < HEAD_DIM)",
         "Only the case whose head dim D is below its padded block (D = 24, BLOCK_D = 32) fails. "
         "The columns D..BLOCK_D-1 of each tile do not exist: a load without `offs_d < HEAD_DIM` "
         "reads the next row's first elements (past the last row: whatever follows the tensor), a "
         "store without it writes over them. Every load and store of a [rows, D] tile needs the "
         "head-dim mask beside its row mask (`row_ok[:, None] & d_ok[None, :]`), and HEAD_DIM is "
         "the real D, not BLOCK_D.")
def _head_dim_mask(ctx):
    if not _exactly(ctx, "head_dim"):
        return None
    seen = []
    read = list(dict.fromkeys(n for r in ctx.failing for n in (r.oob_reads or r.nan_from or ())))
    if read:
        seen.append(f"loads read past the end of {', '.join(_INPUT_NAMES.get(n, n) for n in read)} "
                    f"(a load of {'/'.join(_INPUT_NAMES.get(n, n) for n in read)} without the head-dim mask)")
    written = list(dict.fromkeys(t.name for _, t in ctx.bad_tensors() if t.guard_touched))
    if written:
        seen.append(f"stores wrote past the end of {', '.join(written)} (its store without the head-dim mask)")
    return "; ".join([ctx.case_pattern()] + seen + [ctx.tensor_pattern()])




_STRIDE_ID = re.compile(r"^stride_(\w+?)_(\w+?)(?:_\d)?$|^[qkv]_layout$")


def _unlike_contiguous(case, name: str, dims) -> bool:
    """Whether input ``name``'s strides in ``dims`` differ from those of the output of its shape
    the checker hands over (contiguous, or for dQ and dV in one case a [B, S, H, D] view)."""
    return any(case.strides()[name][d] != case.output_strides(name)[d] for d in dims)


@mistake("stride", PINNED, "a tensor is addressed with another tensor's strides",
         "Wrong exactly in the cases where two tensors' strides differ: one of them is offset with "
         "the other's stride. Every tensor gets its own stride arguments, named after it "
         "(stride_v_s for V's rows, never stride_k_s), and each load uses its own.")
def _stride(ctx):
    if ctx.pattern is None or not ctx.exact or not _STRIDE_ID.match(ctx.pattern.id.split("&")[0]):
        return None
    stored = [(r, t) for r, t in ctx.bad_tensors() if t.unwritten and t.guard_touched]
    if ctx.pattern.id.endswith("_layout") and not stored:
        return None
    if stored:          # the output's own elements left unwritten, memory past it written
        r, t = stored[0]
        failing = {id(x) for x in ctx.failing}
        source = next((n for dims in ((2,), (3,), (1,), (0,), (0, 1, 2, 3)) for n in ("Q", "K", "V")
                       if failing == {id(x) for x in ctx.results if _unlike_contiguous(x.case, n.lower(), dims)}),
                      None)
        where = (f"exactly the cases where {source}'s strides differ from those of the output fail"
                 if source else f"{len(ctx.failing)} of {len(ctx.results)} cases fail "
                 f"({ctx.names_of(ctx.failing)}), each with an input laid out unlike the output")
        return (f"{where}; in '{r.case.name}' {t.unwritten} elements of {t.name} never written and "
                f"{t.guard_touched} written past its end: {t.name} is stored with "
                f"{source + chr(39) + 's' if source else 'an input' + chr(39) + 's'} strides (the output "
                f"has strides of its own; use them, stride_{t.name.lower()}_*)")
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}"


_INPUT_NAMES = {"q": "Q", "k": "K", "v": "V", "do": "dO", "lse": "LSE", "delta": "delta"}


def _past_other_length(query_side: bool):
    """Rows S_k..S_q-1 of dQ / O / LSE never written (or keys S_q..S_k-1 of dK / dV), and only
    where S_q != S_k: a row mask with S_k where S_q belongs (a key mask with S_q). It comes
    before read_past_end: the same mask also lets loads past the end through when the other
    length is the larger, and the missing rows say which mask it is."""
    side = {"q", "do", "lse", "delta"} if query_side else {"k", "v"}

    def _over_read(ctx):
        # a row mask against S_k loads query rows S_q..S_k-1 where S_q < S_k: past the end of
        # the query-side tensors only (a key mask against S_q: past K and V where S_k < S_q)
        # (the interpreter records the loads; a GPU run finds them by moving the NaN guards)
        read = {id(r): list(r.oob_reads or r.nan_from or ()) for r in ctx.failing}
        over = [r for r in ctx.failing if read[id(r)]]
        longer = (lambda c: c.S_q < c.S_k) if query_side else (lambda c: c.S_k < c.S_q)
        if over and all(set(read[id(r)]) <= side and longer(r.case) for r in over):
            r = over[0]
            names = ", ".join(_INPUT_NAMES.get(n, n) for n in read[id(r)])
            return (f"loads ran past the end of {names} -- and of nothing else -- in exactly the cases with "
                    f"{'S_q < S_k' if query_side else 'S_k < S_q'} ({ctx.names_of(over)}): the "
                    f"{'rows' if query_side else 'keys'} up to {'S_k' if query_side else 'S_q'} were loaded; "
                    f"{ctx.case_pattern()}",
                    ("A query-row mask is bounded by S_k where S_q belongs: the rows S_q..S_k-1 do not exist, "
                     "and loading them reads past the end of Q, dO, LSE and delta (where S_q > S_k the same "
                     "mask drops rows that do exist). Query rows are masked with `offs_m < S_q`, keys with "
                     "`offs_n < S_k`." if query_side else
                     "A key mask is bounded by S_q where S_k belongs: the keys S_k..S_q-1 do not exist, and "
                     "loading them reads past the end of K and V. Keys are masked with `offs_n < S_k`, query "
                     "rows with `offs_m < S_q`."))
        return None

    def test(ctx):
        if not ctx.failing or any(r.case.S_q == r.case.S_k for r in ctx.failing):
            return None
        hits = []
        for r, t in ctx.bad_tensors():
            if not t.unwritten:
                continue
            keys = t.name in ("dK", "dV")
            if keys == query_side:
                continue
            own, other = (r.case.S_k, r.case.S_q) if keys else (r.case.S_q, r.case.S_k)
            if not (other < own and t.bad_rows() == list(range(other, own))):
                return None
            hits.append((r, t))
        if not hits:
            return _over_read(ctx)
        r, t = hits[0]
        what, length = ("keys", "S_q") if not query_side else ("rows", "S_k")
        return (f"{what} {r.case.S_k if query_side else r.case.S_q}-{(r.case.S_q if query_side else r.case.S_k) - 1} "
                f"of {t.name} never written in '{r.case.name}' (S_q={r.case.S_q}, S_k={r.case.S_k}): "
                f"exactly the {what} from {length} on; {ctx.case_pattern()}")
    return test


mistake("row_mask_length", MEMORY, "the query rows are bounded by S_k: a row mask or bound uses the wrong length",
        "The query rows from S_k on were never written: a row mask (or the loop, or the grid) is "
        "bounded by S_k where S_q belongs. Query rows -- Q, dO, LSE, delta, dQ, O -- are masked "
        "with `rows < S_q`, keys -- K, V, dK, dV -- with `keys < S_k`. Where S_q < S_k the same "
        "mask lets loads and stores run past the end of the query-side tensors.",
        test=_past_other_length(query_side=True))

mistake("key_mask_length", MEMORY, "the keys are bounded by S_q: a key mask or bound uses the wrong length",
        "The keys from S_q on were never written: a key mask (or the loop, or the grid) is bounded "
        "by S_q where S_k belongs. Keys -- K, V, dK, dV -- are masked with `keys < S_k`, query rows "
        "with `rows < S_q`.", test=_past_other_length(query_side=False))



_QUERY_SIDE = {"q", "do", "lse", "delta"}


@mistake("lengths_swapped", MEMORY, "S_q and S_k are swapped (in the launch or the kernel's arguments)",
         "Wrong exactly where S_q != S_k, and the loads run past the end of the query-side tensors "
         "(Q, dO, LSE, delta) where S_q < S_k, of K and V where S_q > S_k: the kernel believes each "
         "length is the other. Compare the call's arguments with the kernel's signature.")
def _lengths_swapped(ctx):
    seen = [r for r in ctx.failing if r.oob_reads]
    if not seen and _exactly(ctx, "sq_ne_sk") and _lengths_swapped_by_stores(ctx):
        return (f"{ctx.case_pattern()}; outputs written past their end where their own length is the "
                f"smaller, left unwritten from the other length on where it is the larger, and rows below "
                f"both lengths wrong as well")
    if not (_exactly(ctx, "sq_ne_sk") and 2 * len(seen) >= len(ctx.failing)):
        return None
    for r in seen:      # (a read past one head's rows into the next shows no guard: not every case)
        query_side = set(r.oob_reads) <= _QUERY_SIDE
        if query_side != (r.case.S_q < r.case.S_k) or (not query_side and set(r.oob_reads) & _QUERY_SIDE):
            return None
    return f"{ctx.case_pattern()}; reads past the end of Q/dO/LSE/delta where S_q < S_k, of K/V where S_q > S_k"


def _lengths_swapped_by_stores(ctx) -> bool:
    """The same mistake seen through stores alone (a GPU keeps no record of loads): each output
    bounded by the other length, both ways, and rows below both lengths wrong too."""
    past = unwritten = low = False
    for r, t in ctx.bad_tensors():
        keys = t.name in ("dK", "dV")
        own, other = (r.case.S_k, r.case.S_q) if keys else (r.case.S_q, r.case.S_k)
        if own > other and t.guard_touched:
            return False
        past |= own < other and t.guard_touched > 0
        unwritten |= own > other and t.unwritten > 0
        low |= any(row < min(own, other) for row in t.bad_rows())
    return past and unwritten and low


def _aligned(case) -> bool:
    """Every length a multiple of the largest block: no load needs a mask."""
    return case.S_q % BLOCKS[-1] == 0 and case.S_k % BLOCKS[-1] == 0


@mistake("address_past_end", MEMORY, "a load's address is wrong (a stride, an index or an offset), not its mask",
         "Loads read past the end of a tensor even in cases where every length is a multiple of the "
         "block, so no mask is needed there: the address itself points outside. Check the offsets "
         "of that tensor: each dimension's index times that tensor's own stride for that same "
         "dimension (b with stride_b, h with stride_h, rows with stride_s, columns with stride_d), "
         "and head indices that stay below the number of heads.")
def _address_past_end(ctx):
    seen = [r for r in ctx.failing if r.oob_reads and _aligned(r.case)]
    traced = [r for r in ctx.failing if r.nan_from and _aligned(r.case)]   # a GPU's evidence
    if not seen and traced:
        names = list(dict.fromkeys(n for r in traced for n in r.nan_from))
        return (f"a load reached past the end of {', '.join(_INPUT_NAMES.get(n, n) for n in names)} (with NaN only "
                f"there, the output turns NaN) in {ctx.names_of(traced)}, where S_q and S_k are multiples of "
                f"{BLOCKS[-1]}: no mask is at stake there")
    if not seen:
        return None
    names = list(dict.fromkeys(n for r in seen for n in r.oob_reads))
    return (f"loads returned the NaN past the end of {', '.join(_INPUT_NAMES[n] for n in names)} in "
            f"{ctx.names_of(seen)}, where S_q and S_k are multiples of {BLOCKS[-1]}: no mask is at stake there")


@mistake("read_past_end", MEMORY, "a load reads past the end of a tensor (a mask is missing)",
         "The memory around every input holds NaN here, and your code read it: some load reaches "
         "rows (or columns) that do not exist. Every load needs the mask of its own tensor -- the "
         "query-row mask for q, dO, LSE and delta, the key mask for k and v -- so that padded "
         "positions read a harmless `other` value. (Past the end of a tensor there may be another "
         "tensor, or no memory at all: even a value that is thrown away later must not be read.)")
def _read_past_end(ctx):
    seen = [r for r in ctx.failing if r.oob_reads]
    if seen:
        names = list(dict.fromkeys(n for r in seen for n in r.oob_reads))
        return (f"loads returned the NaN that lies past the end of {', '.join(_INPUT_NAMES[n] for n in names)} "
                f"in {len(seen)} of {len(ctx.results)} cases ({ctx.names_of(seen)})")
    hits = [r for r in ctx.failing if r.nan_from]
    if not hits:
        return None
    names = list(dict.fromkeys(n for r in hits for n in r.nan_from))
    return (f"with NaN only around {', '.join(_INPUT_NAMES.get(n, n) for n in names)}, the output "
            f"turns NaN; with finite values there it does not (case '{hits[0].case.name}')")




@mistake("head_dim_tile", MEMORY, "the head-dim tile is narrower than the head dim: the last columns are never stored",
         "Every row was stored, but only its first columns: the tile's column axis, tl.arange(0, BLOCK_D), "
         "must cover the whole head dim, so BLOCK_D is D rounded up to a power of two "
         "(triton.next_power_of_2(D)) with the columns masked by `offs_d < D` -- not the row block's "
         "size or a fixed number. Cases with D <= that width pass, which is why only some fail.")
def _head_dim_tile(ctx):
    for r, t in ctx.bad_tensors():
        a = t.actual
        if not t.unwritten or a is None or a.dim() != 4:
            continue
        nan_cols = torch.isnan(a).all(dim=(0, 1, 2))
        width = int((~nan_cols).sum())
        if 0 < width < a.shape[-1] and bool(nan_cols[width:].all()) and bool(torch.isfinite(a[..., :width]).all()):
            return (f"in '{r.case.name}' (D = {a.shape[-1]}) columns {width}-{a.shape[-1] - 1} of every row of "
                    f"{t.name} were never written, columns 0-{width - 1} were: the tile is {width} columns wide; "
                    f"{ctx.case_pattern()}")
    return None


@mistake("unwritten", MEMORY, "some output elements were never written",
         "Outputs start filled with a marked NaN here, and some still hold it: those elements were "
         "never stored. Check that the grid covers the last, partial block (cdiv, not //), that the "
         "store's mask is not stricter than `row < S`, and that the launcher writes into the output "
         "it was given.")
def _unwritten(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.unwritten]
    if not bad:
        return None
    r, t = bad[0]
    what = "keys" if t.name in ("dK", "dV") else "rows"
    return (f"{t.unwritten} elements of {t.name} never written in '{r.case.name}' ({what} "
            f"{ranges(t.bad_rows())} of 0-{t.row_err.numel() - 1}); {ctx.case_pattern()}")



# --------------------------------------------------------------------------------------
# NaN, writes past the end, constant factors
# --------------------------------------------------------------------------------------


def _nonfinite_rows(a: torch.Tensor) -> list:
    """The query rows (dim 2) of ``a`` that hold inf or NaN anywhere."""
    bad = ~torch.isfinite(a.movedim(2, 0).reshape(a.shape[2], -1))
    return [int(i) for i in torch.nonzero(bad.any(1)).flatten()]


@mistake("mask_hides_diagonal", OUTPUTS, "the causal mask hides the diagonal: row 0 sees no key at all",
         "NaN in query row 0 only, in the causal cases only: row 0's one visible key is its own "
         "diagonal, and the mask hid it (j < i, or >=, where j <= i belongs). With every key -inf "
         "the softmax divides 0 by 0. A query sees its own key.")
def _mask_hides_diagonal(ctx):
    if not ctx.failing or not all(r.case.causal for r in ctx.failing):
        return None
    for r in ctx.failing:
        query_side = [t.actual for n, t in r.tensors.items() if n in ("O", "dQ", "LSE", "P")
                      and t.actual is not None and t.actual.dim() >= 3]
        if not any(_nonfinite_rows(a) == [0] for a in query_side):
            return None
    return f"NaN in row 0 only (of O, dQ, LSE or P) in every failing case; {ctx.case_pattern()}"






@mistake("nan", NUMBERS, "NaN computed inside your code",
         "NaN appeared although every element was written and no load reads past the end: "
         "something like exp(+inf), inf - inf or 0 * inf. A row whose every key is masked with -inf "
         "(max = -inf, then -inf - (-inf)) is the classic; so is exp applied before the mask.")
def _nan(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.nan_computed]
    if not bad:
        return None
    r, t = bad[0]
    evidence = f"{t.name} holds NaN in '{r.case.name}'; {ctx.case_pattern()}"
    if _exactly(ctx, "causal"):             # only under the mask: the mask's values make the NaN
        return evidence, ("NaN only in the causal cases, none from a read past the end: the mask's own "
                          "values make it. Hidden scores must be -inf, so that exp gives exactly 0: +inf "
                          "(the minus sign forgotten) gives inf, then inf - inf or 0 * inf is NaN; so "
                          "does arithmetic on the -inf itself (S / S, -inf * 0, -inf - -inf). Apply the "
                          "mask once, as -inf on S before the exponential, or as 0 on P after it.")
    return evidence


@mistake("oob_write", NUMBERS, "memory just past the output was written: a store without its mask",
         "The kernel stored elements beyond the end of the output tensor: the store's mask is missing "
         "the row (or column) condition, so the padded rows of the last block land in whatever "
         "follows in memory -- another head's rows, or another tensor.")
def _oob_write(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.guard_touched]
    if not bad:
        return None
    r, t = bad[0]
    return f"'{r.case.name}': {t.guard_touched} elements written after the end of {t.name}"


@mistake("sign", NUMBERS, "the sign is flipped: yours = -reference",
         "The outputs are the reference times -1: a subtraction the wrong way round. dS = P * (dP - "
         "delta): dP first, delta subtracted.")
def _sign(ctx):
    bad = ctx.bad_tensors()
    if bad and all(math.isfinite(t.ratio) and abs(t.ratio + 1) < 2e-2 and t.ratio_resid < 1e-2 for _, t in bad):
        return f"yours / reference = {bad[0][1].ratio:.4f} in every wrong output; {ctx.tensor_pattern()}"
    return None


@mistake("scale", NUMBERS, "the error is a constant factor tied to the softmax scale",
         "S = Q K^T * scale, so the chain rule puts one factor `scale` into dQ = dS K * scale and "
         "dK = dS^T Q * scale -- exactly one, after the matrix product -- and none into dV. A ratio "
         "of 1/scale means the factor is missing, scale means it is applied twice.")
def _scale(ctx):
    bad = ctx.bad_tensors()
    if not bad:
        return None

    def factor(r, t):
        s = r.case.scale_value
        if not (math.isfinite(t.ratio) and t.ratio_resid < 1e-2):
            return None
        for f in (1.0 / s, s, (1.0 / math.sqrt(r.case.D)) / s, s * math.sqrt(r.case.D), 1 / s ** 2, s ** 2):
            if abs(t.ratio / f - 1.0) < 2e-2:
                return f
        return None

    if all(factor(r, t) is not None for r, t in bad):
        parts = [f"'{r.case.name}' {t.name}: yours / reference = {t.ratio:.4g} (scale = "
                 f"{r.case.scale_value:.4g}, 1/scale = {1 / r.case.scale_value:.4g})" for r, t in bad[:3]]
        return "; ".join(parts) + f"; {ctx.tensor_pattern()}"
    return None

