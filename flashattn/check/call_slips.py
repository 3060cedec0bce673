"""More one-line slips (blind set Q): a value that PyTorch, Triton or autograd read otherwise than
the learner meant -- +inf for the hidden scores, delta left a product or made a matrix product,
``.T`` of a 4-D tensor, a kernel called like a function, ``tl.arange`` over a runtime size, apply
under ``no_grad``, 0 for a gradient that must be None, a mask from ``torch.empty``, offsets summed
again, the running max overwritten before alpha reads it, an early ``return`` before a kernel's
store.

Each fires only when outputs fail, and quotes the line (:func:`flashattn.check.evidence.quoted_line`).
Their place in each checker's order: :mod:`flashattn.check.checkers`.
"""
from __future__ import annotations

import ast
import re
import textwrap

from .engine import CODE, DID_NOT_RUN, mistake
from .evidence import quoted_line
from .source import code_lines, first_found, first_line

#: a line that switches between two forms (a test's planted function): not a learner's slip
_SWITCH = re.compile(r"\bif\b.*\belse\b")

mistake("hidden_plus_inf", CODE, "the hidden scores are filled with +inf: -inf belongs there",
        "A hidden key must get P = 0, so its score is -inf before the softmax (exp(-inf) = 0). +inf makes "
        "the row's maximum infinite and exp(inf - inf) = NaN across the whole row. "
        "S.masked_fill(hidden, float(\"-inf\")).",
        test=quoted_line(lambda c: re.search(r"masked_fill\(.*,\s*(?:float\(\s*['\"]\+?inf['\"]\s*\)|math\.inf|torch\.inf)\s*\)",
             c) is not None))

mistake("delta_not_summed", CODE, "delta is left the elementwise product dO * O, not summed over the head dim",
        "delta_i = rowsum(dO * O)_i, one number per query row: (do * o).sum(dim=-1, keepdim=True), "
        "[..., S_q, 1]. The product alone is [..., S_q, D], which meets dP [..., S_q, S_k] only where D "
        "happens to equal S_k.",
        test=quoted_line(lambda c: re.match(r"delta\s*=\s*\(?\s*(?:do|o|dout|grad_out)\s*\*\s*(?:do|o|out)\s*\)?\s*$", c) is not None))

mistake("delta_as_matmul", CODE, "delta is a matrix product: it is a row-wise dot product",
        "delta_i = sum_d dO[i, d] O[i, d] pairs each row of dO with the *same* row of O: "
        "(do * o).sum(-1, keepdim=True). dO @ O^T pairs every row with every row, an [S_q, S_q] matrix.",
        test=quoted_line(lambda c: re.match(r"delta\s*=[^*]*@", c) is not None))   # (not rowsum(P * (dO @ V^T)))

mistake("T_of_4d", CODE, "`.T` of a 4-D tensor reverses all four axes",
        "On a tensor of more than two dimensions .T reverses *every* axis: k.T of [B, H, S_k, D] is "
        "[D, S_k, H, B]. Swap the last two only: k.transpose(-1, -2) (or k.mT).",
        test=quoted_line(lambda c: re.search(r"\b(?:q|k|v|o|do|dS|ds|P|S)\.T\b", c) is not None and
             not _SWITCH.search(c)))

mistake("lse_recomputed", CODE, "the LSE is recomputed instead of the forward's being used",
        "P = exp(S - LSE) with the forward's LSE, one per query row: the lesson's point is that it is "
        "*given*. A logsumexp recomputed here -- over dim=-2, the queries, gives columns that sum to 1 -- "
        "is not the forward's. Use lse[..., None].", test=quoted_line(lambda c: "logsumexp(" in c))

mistake("mask_given_dtype", CODE, "causal_mask gets a dtype where it takes a device",
        "causal_mask(S_q, S_k, device) builds its positions with torch.arange(..., device=device): "
        "S.dtype there is no device. Pass S.device.",
        test=quoted_line(lambda c: re.search(r"causal_mask\([^()]*\.dtype\s*\)", c) is not None))

mistake("unsigned_positions", CODE, "positions in an unsigned dtype: i - left wraps around below 0",
        "uint8 holds 0 ... 255 and has no negative numbers: i - left for a row i < left wraps around to "
        "about 255, past every key. Positions are plain integers: torch.arange(S_q) (int64).",
        test=quoted_line(lambda c: re.search(r"arange\([^)]*dtype\s*=\s*torch\.uint8", c) is not None))

mistake("uint8_mask", CODE, "a uint8 mask: ~ flips its bits, and masked_fill wants bool",
        "Old PyTorch built masks as uint8 0/1. On uint8, ~ is a bitwise not (0 -> 255, 1 -> 254: both "
        "'true'), and masked_fill refuses anything but bool. Build the mask as bool: "
        "torch.ones(..., dtype=torch.bool).tril(), or causal_mask(S_q, S_k, device).",
        test=quoted_line(lambda c: re.search(r"dtype\s*=\s*torch\.uint8|\.byte\(\)", c) is not None and "arange(" not in c))

mistake("range_past_end", CODE, "the loop's end is one past the length: range(0, S + 1, block)",
        "range(0, S_k, block_n) already covers the last, partial block. With S_k + 1 (an 'inclusive' "
        "end), a length that block_n divides gets one more block, which starts at S_k and is empty.",
        test=quoted_line(lambda c: re.search(r"range\(\s*[^(),]+,\s*[\w.]+\s*\+\s*1\s*,\s*\w*block\w*\s*\)", c, re.I) is not None))

mistake("launch_call_syntax", CODE, "the kernel is called like a function: the grid goes in [ ]",
        "A @triton.jit kernel is launched as kernel[grid](arguments...): the grid in square brackets, then "
        "the arguments. kernel(grid) calls the Python function itself, with the grid as its first "
        "argument.", test=quoted_line(lambda c: re.search(r"\w+\(\s*grid\s*\)\s*\(", c) is not None))

mistake("arange_runtime_size", CODE, "tl.arange over a size that is not a power-of-two constexpr",
        "tl.arange(0, N) needs N to be a tl.constexpr and a power of two: the tile's width BLOCK_D (the "
        "head dim rounded up), not HEAD_DIM itself. The columns past HEAD_DIM are masked: "
        "d_ok = offs_d < HEAD_DIM.",
        test=quoted_line(lambda c: re.search(r"tl\.arange\(\s*0\s*,\s*(?:HEAD_DIM|D|S_q|S_k|head_dim)\s*\)", c) is not None))

mistake("apply_under_no_grad", CODE, "apply runs under torch.no_grad(): no graph, no backward",
        "torch.no_grad() switches autograd off: the output of apply then has no grad_fn and .backward() "
        "has nothing to call. Your Function's forward already runs without recording (autograd treats it "
        "as one step); call apply plainly.",
        test=quoted_line(lambda c: re.match(r"with\s+torch\.(?:no_grad|inference_mode)\(\)", c) is not None))

mistake("zero_for_none", CODE, "backward returns 0 for a non-tensor input: None belongs there",
        "backward returns one value per input of forward: a tensor for q, k, v, and None for causal and "
        "scale, which have no gradient. A 0 is a value autograd cannot take as one.",
        test=quoted_line(lambda c: re.match(r"return\s+.*,\s*0(?:\.0)?\s*(?:,\s*(?:0(?:\.0)?|None)\s*)*$", c) is not None))

mistake("save_non_tensors", CODE, "save_for_backward is given values that are not tensors",
        "ctx.save_for_backward(...) takes tensors only. Plain values -- causal, scale -- are kept as "
        "attributes: ctx.causal, ctx.scale = causal, scale.",
        test=quoted_line(lambda c: re.search(r"save_for_backward\([^)]*\b(?:causal|scale|is_causal|dropout_p)\b", c) is not None))

mistake("input_detached", DID_NOT_RUN, "an input is detached before apply: no gradient reaches it",
        "x.detach() is a tensor cut off from the graph: autograd will not route a gradient back through "
        "it to x. apply already hands its forward the data; pass q, k, v as they are.",
        test=quoted_line(lambda c: re.search(r"\.apply\([^)]*\.detach\(\)", c) is not None))

mistake("mask_from_empty", CODE, "the mask starts from torch.empty: whatever the memory held",
        "torch.empty allocates without filling: the mask starts from leftover bytes (often all False, "
        "sometimes not). Each side's limit then takes keys *away* from that. Start from all True: "
        "torch.ones(S_q, S_k, dtype=torch.bool).",
        test=quoted_line(lambda c: re.match(r"(?:seen|mask|visible|keep)\w*\s*=\s*torch\.empty\(", c) is not None))

mistake("offsets_summed_again", CODE, "cu_seqlens are summed up again: they already are the offsets",
        "cu_seqlens_q = [0, S_0, S_0 + S_1, ...] holds where each sequence *starts* (cumulative lengths), "
        "so sequence b is rows cu[b] : cu[b + 1]. A cumsum of them adds the offsets up once more.",
        test=quoted_line(lambda c: re.search(r"cu\w*\.cumsum\(|cumsum\(\s*cu\w*", c) is not None))

mistake("packed_lse_unsliced", CODE, "the whole packed LSE is handed to one sequence",
        "The packed LSE is [total, H]: sequence b's rows are lse[qs] (then .T for [H, S_q]). The whole "
        "tensor has every sequence's rows and fits only when there is one sequence.",
        test=quoted_line(lambda c: re.search(r"\blse\.(?:T|transpose\(|t\(\))", c) is not None))

@mistake("early_return", CODE, "the kernel returns before its store: those rows stay unwritten",
         "A program that returns early writes nothing, and the launcher's output came from torch.empty: "
         "whatever memory it got stays there. A block with no work still owns its output rows -- let "
         "its loop run zero times and store the zeros.")
def _early_return(ctx):
    # (a return that skips rows past the end -- a program with nothing to own -- is harmless: only
    # outputs left holding the checker's poison make it the cause)
    if not any(t.unwritten for r in ctx.failing for t in r.tensors.values()):
        return None
    _, line = first_found(ctx, _kernel_early_return)
    return f"`{line}`: an early return; {ctx.case_pattern()}; {ctx.tensor_pattern()}" if line else None


def _kernel_early_return(src: str):
    """The ``if ...: return`` of a @triton.jit function (a bare return under a condition)."""
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return None
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list):
            for node in ast.walk(fn):
                if isinstance(node, ast.If) and any(isinstance(b, ast.Return) and b.value is None for b in node.body):
                    return f"if {ast.unparse(node.test)}: return"
    return None


def _max_overwritten_before_alpha(src: str):
    """``m = m_new`` on a line before the one that forms exp(m - m_new) in the same loop."""
    lines = list(code_lines(src))
    for n, line in enumerate(lines):
        m = re.match(r"(m\w*)\s*=\s*(m_new\w*|new_m\w*|m_ij\w*)\s*$", line)
        if m and any(re.search(rf"exp2?\(\s*{m.group(1)}\s*-\s*{m.group(2)}\b", later) for later in lines[n + 1:]):
            return line
    return None


@mistake("max_overwritten_before_alpha", CODE, "the running max is overwritten before alpha reads it",
         "alpha = exp(m - m_new) rescales the old sums from the old max to the new one: it needs the *old* "
         "m. Updated first (m = m_new), alpha is exp(0) = 1 and the old sums are never rescaled. Update m "
         "last, after alpha, l and acc.")
def _max_before_alpha(ctx):
    _, line = first_found(ctx, _max_overwritten_before_alpha)
    return f"`{line}`; {ctx.case_pattern()}" if line else None

mistake("causal_in_packed", CODE, "a causal mask is added in the packed backward: causal is already in the window",
        "The packed backward takes no causal flag: a causal call reaches it as the window (left, 0) -- "
        "right = 0 hides every key after the query. visible_mask(S_q, S_k, window) alone is the mask; "
        "a causal_mask on top also hides the keys that a window with right > 0 (or no window) lets through.",
        test=quoted_line(lambda c: "causal_mask(" in c))

mistake("dq_keys_from_diagonal", CODE, "the dQ kernel's key loop starts at the query block: the keys before it are skipped",
        "A query row sees keys 0 ... i (causal) or every key: the dQ kernel's loop starts at key 0 and, "
        "under causal, ends after the diagonal block. Starting at the query block's own position is the "
        "dK/dV kernel's loop (queries from the key block on), copied the other way round.",
        test=quoted_line(lambda c: re.search(r"for\s+\w+\s+in\s+range\(\s*(?:pid_m|start_m|m_start)\b", c) is not None))


@mistake("exp_overflow", CODE, "exp of a raw score overflows: subtract the row's maximum or LSE inside the exp",
         "float32's exp overflows to inf past 88.7 (fp16's past 11): exp(S) / exp(LSE) and exp(S) / sum "
         "exp(S) are inf / inf = NaN for a large score, although they equal exp(S - LSE) on paper. The "
         "softmax is safe only as exp(S - m) with m the row's maximum (or LSE), which keeps every "
         "exponent <= 0.")
def _exp_overflow(ctx):
    if not ctx.failing or not all(r.case.name.startswith("large scores") for r in ctx.failing):
        return None
    line = first_line(ctx, lambda c: re.search(r"\bexp2?\(\s*[\w.\[\]]+\s*(?:[*/][^-()]*)?\)", c) is not None)
    return (f"`{line}`; " if line else "") + ctx.case_pattern()


_SQ = r"(?:S_q|\w+\.shape\[\s*-2\s*\]|\w+\.size\(\s*-2\s*\))"
_SK = r"(?:S_k|\w+\.shape\[\s*-1\s*\]|\w+\.size\(\s*-1\s*\))"

mistake("lengths_swapped_in_call", CODE, "S_k and S_q are passed the other way round",
        "causal_mask(S_q, S_k, ...) and dropout_mask(seed, H, S_q, S_k, ...) take the queries' length first: "
        "their result is [S_q, S_k], a row per query. Swapped, the mask is [S_k, S_q] -- the same when "
        "S_q = S_k, so square cases pass -- and meets the scores only by accident elsewhere.",
        test=quoted_line(lambda c: not _SWITCH.search(c) and re.search(rf"causal_mask\(\s*{_SK}\s*,\s*{_SQ}(?!\w)|dropout_mask\([^,()]+,[^,()]+,\s*{_SK}\s*,"
             rf"\s*{_SQ}(?!\w)", c) is not None))

mistake("positions_from_other_length", CODE, "query positions built from S_k (or key positions from S_q)",
        "Rows are queries, columns keys: i = torch.arange(S_q)[:, None] (one per query), j = "
        "torch.arange(S_k)[None, :] (one per key). A position vector from the other length has the "
        "other axis's size: it lines up only where S_q = S_k.",
        test=quoted_line(lambda c: not _SWITCH.search(c) and re.match(
             r"\s*(?:(?:i|rows?|q_pos\w*|query_pos\w*)\s*=\s*torch\.arange\(\s*S_k"
             r"|(?:j|cols?|k_pos\w*|key_pos\w*)\s*=\s*torch\.arange\(\s*S_q)\b", c) is not None))

mistake("lse_without_log", CODE, "the LSE is m + l: the log of the sum is missing",
        "l is the running *sum* of exp(S - m); the log-sum-exp is m + log(l). m + l mixes a log-domain "
        "number with a plain one; O = acc / l is unaffected, only the LSE is off.",
        test=quoted_line(lambda c: not _SWITCH.search(c) and re.search(r"\bm\w*\s*\+\s*l\w*\b", c) is not None and "log" not in c))

mistake("loop_stops_before_partial_block", CODE, "the loop stops before the partial last block",
        "range(0, S - BLOCK + 1, BLOCK) visits only full blocks: the last, partial one (S not a multiple "
        "of BLOCK) is never visited, and its keys (or rows) never counted. Loop to the end -- range(0, S, "
        "BLOCK) -- and let the masks take care of the positions past it.",
        test=quoted_line(lambda c: not _SWITCH.search(c) and re.search(r"range\([^,()]+,\s*[\w.]+\s*-\s*(?:BLOCK_\w+|block_\w+)\s*\+\s*1\s*,", c)
             is not None))

mistake("dp_transposed", CODE, "dP is built as V dO^T: the transpose of dO V^T",
        "dP = dO V^T, [S_q, S_k], a row per query like P. V dO^T is [S_k, S_q], its transpose: it fits only "
        "where S_q = S_k, and there it pairs each query with the wrong key.",
        test=quoted_line(lambda c: not _SWITCH.search(c) and re.search(r"=\s*v\w*\s*@\s*(?:do|d_o|dout|grad_out)\w*\.(?:T\b|mT\b|t\(\)|transpose\()", c)
             is not None))

# blind set U
mistake("offset_from_length", CODE, "a base pointer is offset by a length, not by the tensor's strides",
        "pid_bh * S_q places row 0 of head (b, h) as if LSE and delta were one contiguous [B * H, S_q] "
        "block. The ones handed in may be padded or strided (a slice of a bigger buffer): offset each by "
        "b * stride_b + h * stride_h, the strides the launcher passes, and step rows by stride_s.",
        test=quoted_line(lambda c: re.search(r"\w*(?:base|ptrs?)\w*\s*=\s*[A-Z_]+\s*\+\s*[\w.()]+\s*\*\s*(?:S_q|S_k|N_CTX|SEQ\w*)\b",
             c) is not None))

mistake("kernel_mask_bottom_right", CODE, "the causal mask is aligned bottom-right (shifted by S_k - S_q)",
        "The course's causal mask is aligned top-left: query i sees keys j <= i, whatever S_q and S_k "
        "(as SDPA's is_causal). Shifting it by S_k - S_q is FlashAttention's bottom-right alignment: the "
        "same where S_q = S_k, another mask everywhere else.",
        test=quoted_line(lambda c: not _SWITCH.search(c) and re.search(r"offs_\w+", c) is not None and
             re.search(r"\bS_k\s*-\s*S_q\b|\bS_q\s*-\s*S_k\b", c) is not None))

mistake("group_loop_from_one", CODE, "the loop over a group's query heads counts from 1",
        "The query heads of kv head h_kv are h_kv * GROUP_SIZE + g for g = 0 ... GROUP_SIZE - 1: "
        "range(GROUP_SIZE). range(1, GROUP_SIZE + 1) skips the group's first head and reads the next "
        "group's first (past the last head for the last group).",
        test=quoted_line(lambda c: re.search(r"range\(\s*1\s*,\s*\w*(?:GROUP|group)\w*\s*\+\s*1\s*\)", c) is not None))

mistake("lazy_dtau_by_length", CODE, "dTau divides every row by L: row i's bias term is tau / (i + 1)",
        "Lazy attention adds c_i = tau / (i + 1) to row i, so dTau = sum_i rowsum(dP_i * gate_i) / (i + 1), "
        "one divisor per row. Dividing by L (or any one number) weights every row alike.",
        test=quoted_line(lambda c: re.match(r"\s*d_?tau\w*\s*=", c) is not None and
             re.search(r"/\s*\(?\s*(?:L|S|seq_len|n)\s*\)?(?!\s*[+\-*])", c) is not None and "i + 1" not in c))
