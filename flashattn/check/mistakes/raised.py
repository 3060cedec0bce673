"""Stage "raised, wrote an input, raced": the code raised (with an idea chosen from the error's
sizes and kind, :mod:`flashattn.check.exception_ideas`), wrote into one of its inputs, or gave
other bits when run twice on the same input.
"""
from __future__ import annotations

from ..checkers import KERNELS
from ..engine import RAN_BADLY, mistake
from ..evidence import displaced_stores, separating
from ..exception_ideas import exception_idea, substitution_story


@mistake("exception", RAN_BADLY, "your code raised an exception",
         "The error and the line it came from are shown below; the cases it raised in say what they "
         "share (S_q != S_k, non-contiguous tensors, ...).", proof="slips/01/exception")
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
         "values, which is also why two runs on the same input differ.", proof="slips/02p/input_modified")
def _input_modified(ctx):
    hits = [r for r in ctx.results if r.inputs_modified]
    if not hits:
        return None
    # stores outside every tensor (or, on a GPU, output elements unwritten beside stores past its
    # end): whether some also land in an input is luck of the memory layout; wild_access speaks
    if any(r.wild and r.wild.get("stores") for r in ctx.results) or displaced_stores(ctx) is not None \
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
         "output block to exactly one program that accumulates in registers and stores once.",
         proof="example/attention_backward/make_backward(race)")
def _race(ctx):
    r = next((r for r in ctx.results if r.nondeterministic), None)
    return f"case '{r.case.name}': {', '.join(r.nondeterministic)} differed between two runs" if r else None
