"""A randomized differential battery for every kernel family: ``python -m flashattn.fuzz``.

Hand-picked test lists miss what a sweep finds (a dO read with the wrong strides on the GPU only,
a NaN at lengths of 64 mod 128): this draws random problems for every family -- the lesson
kernels, the fast path, its fp32 pieces, lesson 09's windows, dropout and packed batches, lazy
attention, the drop-in with SDPA's signature, the CUDA appendix -- and checks each, per head,
against a float64 reference, with SDPA's own error on the same inputs as the floor.

    problems   drawing a problem from (seed, index); its inputs, laid out inside NaN
    families   running one problem of each family, and its float64 oracle
    battery    judging a problem, running many (in worker processes on a GPU), the summary

CI runs a short budget on the CPU (``tests/test_fuzz.py``); a GPU runs a long one::

    python -m flashattn.fuzz --minutes 5 --seed 1            # workers default to the CPU count / 2
    python -m flashattn.fuzz --seed 1 --problem 4711         # rebuild and rerun one problem
"""
from .battery import check_problem, judge, one_line, run
from .problems import FAMILIES, Problem, draw, make_inputs

__all__ = ["run", "check_problem", "judge", "one_line", "draw", "make_inputs", "Problem", "FAMILIES"]
