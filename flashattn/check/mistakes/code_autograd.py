"""Stage "a line of the code": exercise 05's autograd plumbing -- apply's arguments in another order
than forward takes them, a list of gradients, an input changed in place, the forward on 16-bit
copies, apply under ``no_grad``, 0 where None belongs, non-tensors given to save_for_backward.
"""
from __future__ import annotations

import re

from ..engine import CODE, mistake
from ..evidence import quoted_line
from ..source import calls, forward_params, line_of


@mistake("apply_order", CODE, "apply passes its arguments in another order than forward takes them",
         "Function.apply(...) hands its arguments to forward(ctx, ...) by position, after ctx: "
         "the call must list them in forward's order. Two swapped (causal and scale) reach forward "
         "under each other's names.", proof="slips/05/apply_order")
def _apply_order(ctx):
    for src in ctx.sources:
        for text, args in calls(src, r"(\w+)\.apply"):
            cls_name = text.split(".apply")[0].split()[-1]
            params = forward_params(ctx, cls_name)
            names = [a.split("=")[-1].strip() for a in args]
            if not params or len(names) != len(params) or any("=" in a for a in args) or \
                    sorted(names) != sorted(params) or names == params:
                continue
            moved = [f"{n} where forward takes {p}" for n, p in zip(names, params) if n != p]
            return (f"`{line_of(src, text.splitlines()[0])}` passes {', '.join(moved)} "
                    f"(forward(ctx, {', '.join(params)})); {len(ctx.failing)} of {len(ctx.results)} cases fail")
    return None


mistake("gradients_as_list", CODE, "backward returns a list: autograd counts it as one value",
        "autograd reads backward's result as a tuple of one gradient per input of forward; a list is one "
        "object, so it counts as one gradient (\"expected 5, got 1\"). Return a tuple: "
        "return dq, dk, dv, None, None.", test=quoted_line(lambda c: re.match(r"return\s*\[", c) is not None),
        proof="slips/05/gradients_as_list")


mistake("inplace_on_input", CODE, "an input or saved tensor is changed in place (a method ending in _)",
        "A method with a trailing _ (mul_, add_, div_, exp_, ...) changes the tensor itself. On q, k, v, "
        "dO, O or the LSE that is a tensor the caller still holds or that forward saved for backward, "
        "overwritten on the way: o.mul_(do) overwrites the forward's output, q.mul_(scale) the caller's "
        "q. In-place methods belong only on tensors your code made: write o * do, q * scale.",
        test=quoted_line(lambda c: re.search(r"\b(?:o|q|k|v|do|lse|out|grad_out|dout)\.(?:mul_|add_|sub_|div_|exp_|clamp_|"
             r"masked_fill_|copy_|zero_)\(", c) is not None), proof="slips/05/inplace_on_input")


mistake("forward_half", CODE, "the forward runs on 16-bit copies of the inputs",
        "q.half() (or .to(torch.float16), .bfloat16()) makes a 16-bit copy: O and the LSE come out of "
        "the copies, in 16-bit precision, while backward gets the saved full-precision q, k, v beside a "
        "16-bit O and dO. Call the kernels on the tensors as they came; the dtype is the caller's choice.",
        test=quoted_line(lambda c: re.search(r"\.(?:half|bfloat16)\(\)|\.to\(\s*(?:dtype\s*=\s*)?torch\.(?:float16|half|bfloat16)",
             c) is not None), proof="slips/05/forward_half")


mistake("apply_under_no_grad", CODE, "apply runs under torch.no_grad(): no graph, no backward",
        "torch.no_grad() switches autograd off: the output of apply then has no grad_fn and .backward() "
        "has nothing to call. Your Function's forward already runs without recording (autograd treats it "
        "as one step); call apply plainly.",
        test=quoted_line(lambda c: re.match(r"with\s+torch\.(?:no_grad|inference_mode)\(\)", c) is not None),
        proof="slips/05/apply_under_no_grad")


mistake("zero_for_none", CODE, "backward returns 0 for a non-tensor input: None belongs there",
        "backward returns one value per input of forward: a tensor for q, k, v, and None for causal and "
        "scale, which have no gradient. A 0 is a value autograd cannot take as one.",
        test=quoted_line(lambda c: re.match(r"return\s+.*,\s*0(?:\.0)?\s*(?:,\s*(?:0(?:\.0)?|None)\s*)*$", c) is not None),
        proof="slips/05/zero_for_none")


mistake("save_non_tensors", CODE, "save_for_backward is given values that are not tensors",
        "ctx.save_for_backward(...) takes tensors only. Plain values -- causal, scale -- are kept as "
        "attributes: ctx.causal, ctx.scale = causal, scale.",
        test=quoted_line(lambda c: re.search(r"save_for_backward\([^)]*\b(?:causal|scale|is_causal|dropout_p)\b", c) is not None),
        proof="slips/05/save_non_tensors")
