"""Stage "did not run": the code is not written, launches no kernel (or none in its backward),
keeps tensors on ctx, returns its gradients in another order, or returns something of the wrong
dtype or shape. A few lines that cause these symptoms come right before them (a dK taken for dQ,
an input detached before apply, a mask made float).
"""
from __future__ import annotations

import inspect
import re

from ..checkers import AUTOGRAD, KERNELS
from ..engine import DID_NOT_RUN, mistake
from ..errors import CtxTensors, DtypeError, NoBackwardKernel, NoGradient, ShapeError, Unwritten
from ..evidence import errors_raised, first_raised, quoted_line
from ..exception_origins import exception_chain
from ..origin import kernels_used
from ..shape_names import (aliased_buffers, dtype_story, lost_axes, returned_the_wrong_thing,
                           saved_unpacked_otherwise, shape_story, squeeze_story, unpacked_out_of_order_line)
from ..source import first_line, guard_story, unused_assignments


#: an accumulator made by tl.zeros in the inputs' 16-bit type: ``name = tl.zeros(..., dtype=...)``
_ZEROS = re.compile(r"^\s*(\w+)\s*=\s*tl\.zeros\((.*)\)\s*(?:#.*)?$")
_HALF_DTYPE = re.compile(r"dtype\s*=\s*(tl\.(?:float16|bfloat16)|\b(?:Q|K|V|DO|DQ|DK|DV|O)\.dtype\.element_ty)")


def _launched_kernels(results: list, fn) -> list:
    """(name, Python function) of the Triton kernels the cases launched -- or, where none got as far
    as launching (a compile error), those the launcher ``fn`` names (``origin.kernels_used``)."""
    found = {id(l.fn): (l.kernel, l.fn) for r in results for l in r.launch_args or [] if l.fn is not None}
    return list(found.values()) or [(name, k.fn) for name, k in kernels_used(fn)]


@mistake("accumulator_precision", DID_NOT_RUN, "an accumulator is made in a 16-bit type",
         "A sum over many tiles -- dQ, dK, dV, O -- is kept in tl.float32 and cast to the "
         "output's type once, at the store. Triton's CPU interpreter computes a 16-bit "
         "tl.zeros in fp32 anyway, so the values pass there; on a GPU the loop does not "
         "compile (tl.dot returns fp32, which changes the carried variable's type), and "
         "summed in fp16 the gradient would lose its low digits. Make it tl.zeros(..., "
         "dtype=tl.float32).", when_passing=True, proof="slips/04/accumulator_precision")
def _accumulator_precision(ctx):
    """A kernel whose values passed, but whose accumulators (``tl.zeros`` outside the loop) take a
    16-bit type: Triton's CPU interpreter quietly computes them in fp32, while a GPU refuses to
    compile the loop (tl.dot's fp32 result changes the carried variable's type) or, written to
    compile, sums in half precision. It reads the code of the kernels the cases launched, not
    the values. So it is tried even when every case passed (``when_passing``). It is tried only
    where no case failed for another reason: each case passed or did not compile (on a GPU,
    ``dtype=K.dtype.element_ty`` compiles and passes in the fp32 case, not in the fp16 ones)."""
    results = ctx.results

    def did_not_compile(r) -> bool:
        return r.error is not None and any(type(e).__name__ == "CompilationError" for e in exception_chain(r.error))

    compiled_not = sum(map(did_not_compile, results))
    if not results or not all(r.ok or did_not_compile(r) for r in results):
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
                        (f"; on this GPU the kernel did not compile ({compiled_not} of {len(results)} cases)"
                         if compiled_not else ""))
    return None


@mistake("not_implemented", DID_NOT_RUN, "not written yet",
         "Your code still raises NotImplementedError: replace the `raise NotImplementedError()` line "
         "(the `# YOUR CODE HERE` block) with your implementation, re-run that cell, then this one.",
         proof="example/attention_backward/unwritten_backward")
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
         "are right, but that backward builds the S_q x S_k matrices the kernels exist to avoid.",
         proof="example/autograd_function/autograd_without_kernels")
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
         "collector runs. Plain values (causal, scale) are the ones that go on ctx as attributes.",
         proof="example/autograd_function/o kept on ctx")
def _ctx_attributes(ctx):
    hits = errors_raised(ctx, CtxTensors)
    if not hits:
        return None
    return (f"forward put {', '.join('ctx.' + n for n in hits[0].error.names)} on ctx, in {len(hits)} of "
            f"{len(ctx.results)} cases")


@mistake("no_kernel", DID_NOT_RUN, "your launcher ran no kernel",
         "This checker checks a kernel: the launcher must launch it (kernel[grid](...)) and let it "
         "write the outputs it was given. It computed them some other way (plain PyTorch?) or not at all.",
         proof="example/dkdv_kernel/launch_dkdv_in_pytorch")
def _no_kernel(ctx):
    counted = [r for r in ctx.results if r.launches is not None]
    if counted and all(r.launches == 0 for r in counted):
        return f"the launcher returned without launching any kernel, in all {len(counted)} cases"
    return None


mistake("dq_from_dkdv", DID_NOT_RUN, "dQ is taken from the dK/dV function: its first output is dK",
        "attention_backward_dkdv returns (dK, dV); attention_backward_dq returns dQ. Index [0] of the "
        "first is dK -- shaped like k, [B, H_kv, S_k, D] -- and equals dQ's shape only when S_q = S_k "
        "without GQA. Call attention_backward_dq for dQ.",
        test=quoted_line(lambda c: re.match(r"dq\s*=.*dkdv\(", c) is not None), proof="slips/05/dq_from_dkdv")


@mistake("grad_order", DID_NOT_RUN, "gradients returned in the wrong order",
         "Return the gradients in the order of the inputs they belong to: (dq, dk, dv) for "
         "(q, k, v) -- and in an autograd.Function, one per input of forward, None for the "
         "non-tensor ones.", proof="slips/05/grad_order")
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
         "ctx.save_for_backward was given them.", proof="slips/05/saved_order")
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
         "accumulator back with .to(q.dtype)), LSE in fp32, gradients like the inputs they belong to "
         "-- but fp32 where the exercise says so (exercise 11: the merge and the ring's gradients).",
         proof="slips/09b/dtype")
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


mistake("input_detached", DID_NOT_RUN, "an input is detached before apply: no gradient reaches it",
        "x.detach() is a tensor cut off from the graph: autograd will not route a gradient back through "
        "it to x. apply already hands its forward the data; pass q, k, v as they are.",
        test=quoted_line(lambda c: re.search(r"\.apply\([^)]*\.detach\(\)", c) is not None),
        proof="slips/05/input_detached")


@mistake("none_gradient", DID_NOT_RUN, "a gradient came back None although its input requires grad",
         "backward returns None for an input only when ctx.needs_input_grad says it needs none. "
         "needs_input_grad is indexed like forward's inputs: 0 is q, 1 is k, 2 is v -- check which "
         "index guards which gradient.", proof="slips/05/none_gradient")
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


mistake("mask_made_float", DID_NOT_RUN, "the mask is made with torch.ones / torch.zeros without dtype=torch.bool",
        "torch.ones(S_q, S_k) is float32: &= with a comparison (a bool tensor) raises, and a float "
        "mask is no mask to masked_fill or ~. Make it bool: torch.ones(S_q, S_k, dtype=torch.bool).",
        test=quoted_line(lambda c: re.match(r"(?:seen|mask|visible|keep)\w*\s*=\s*torch\.(?:ones|zeros)\((?![^)]*dtype)[^)]*\)\s*$",
             c) is not None), proof="slips/09m/mask_made_float")


@mistake("shape", DID_NOT_RUN, "an output has the wrong shape or type",
         "Return tensors shaped like the reference: dQ like q, dK and dV like k and v, "
         "P [B, H, S_q, S_k], LSE [B, H, S_q].", proof="slips/01/shape")
def _shape(ctx):
    r = first_raised(ctx, ShapeError)
    if r is None:
        return None
    message = str(r.error)
    if r.error.idea:            # the place that raised knew the story (a float; K/V heads under GQA)
        return message, r.error.idea
    if unpacked_out_of_order_line(ctx):      # B, S_q, H, D = q.shape: the mistake shape_unpack_order names it
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
