"""Every mistake the checkers can name, one module per stage of the order.

Each module registers its mistakes (:func:`flashattn.check.engine.mistake`: id, stage, title, idea,
test, proof) and nothing else: importing one places nothing, and no module here imports another.
The order every checker tries them in is :mod:`flashattn.check.checkers`' stage tables. A module
holds the mistakes of one stage -- the stages "a line of the code" and "a known wrong formula"
are split by what they read -- listed in the order of its table:

=====================  =============================================================================
did_not_run            not written, no kernel, gradients in the wrong order, dtype, shape
code_python            a Python line's slip, in any exercise (x *= a + b, a return in the loop, ...)
code_pytorch           a PyTorch call that does something else than it looks (transpose_, expm1, .T)
code_kernels           a Triton kernel's line (strides of another axis, masks joined with |, ...)
code_autograd          an autograd.Function's plumbing (apply's arguments, no_grad, 0 for None)
code_exercises         one exercise's line (online softmax, lazy attention, lesson 09's packing)
raised                 the code raised, wrote into an input, or ran differently twice
launch                 what the launcher handed the kernel; addresses outside every tensor
lesson09               the window's edges, dropout's mask and rescale, the packed sequences
pinned                 a pattern that pins the cause: a batch offset, the head-dim mask, GQA, strides
memory                 reads past the end, rows bounded by the other length, elements never written
formulas               the outputs equal a known wrong formula of the backward, a mask, P's rebuild
online_formulas        ... of the online softmax (exercise 02)
lazy_formulas          ... of lazy attention's backward (exercise 07)
ring_formulas          ... of the merge and the ring's backward (exercise 11)
outputs                an output is zero, equals another tensor, NaN in row 0 only, +inf at hidden keys
formula_lines          a line of the formulas, after the exact matches (the scale, the causal compare)
numbers                NaN, writes past the end, a sign, a factor, float32 rounding, lost precision
fallback               which heads, which outputs, which cases are wrong; and last what was seen
=====================  =============================================================================
"""
from . import (code_autograd, code_exercises, code_kernels, code_pytorch, code_python, did_not_run,  # noqa: F401
               fallback, formula_lines, formulas, launch, lazy_formulas, lesson09, memory, numbers, online_formulas,
               outputs, pinned, raised, ring_formulas)
