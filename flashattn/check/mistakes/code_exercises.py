"""Stage "a line of the code": slips of one exercise's own code -- the online softmax (keys visited
backwards, a loop to S_q, O divided by exp(LSE), the max overwritten before alpha, m + l), lesson
09's packing (cu[b] + 1, offsets summed again, the whole LSE, a causal mask on top of the window,
``/ dropout_p``, a mask from ``torch.empty``) and lazy attention's (dP as V dO^T, dTau / L).
"""
from __future__ import annotations

import re

from ..engine import CODE, mistake
from ..evidence import quoted_line
from ..source import SWITCH, code_lines, first_found


_BOUNDARY_PLUS_ONE = re.compile(r"\b(\w*cu\w*)\[\s*(\w+)\s*\]\s*\+\s*1\b")


mistake("boundary_plus_one", CODE, "a boundary plus one where the next boundary belongs: cu[b] + 1 for cu[b + 1]",
        "cu_seqlens holds the sequences' boundaries: sequence b is cu_seqlens[b] : cu_seqlens[b + 1]. "
        "cu_seqlens[b] + 1 is one row past the start, so the slice keeps the sequence's first row only.",
        test=quoted_line(_BOUNDARY_PLUS_ONE.search), proof="slips/09b/boundary_plus_one")


mistake("divides_by_p", CODE, "the dropout rescale divides by p, the drop probability",
        "Dropout keeps each element with probability 1 - p and scales the kept ones by 1 / (1 - p), so that "
        "the expectation is unchanged. Dividing by p (dropout_p) scales by the *drop* probability -- and "
        "divides by zero when dropout is off (p = 0). Write keep / (1 - dropout_p).",
        test=quoted_line(lambda c: re.search(r"/\s*\(?\s*dropout_p\s*\)?\s*(?:$|[),#*])", c) is not None),
        proof="slips/09b/divides_by_p")


mistake("key_blocks_reversed", CODE, "the key blocks are visited last to first",
        "The online softmax may visit blocks in any order -- but the causal mask hides the *last* "
        "blocks from the first rows entirely. Visited first, such a block leaves m = -inf, and "
        "exp(m - m_new) = exp(-inf - -inf) is NaN. Walk the keys forwards: range(0, S_k, block_n).",
        test=quoted_line(lambda c: re.search(r"for\s.*\bin\s+reversed\(|range\([^()]*,\s*-1\s*,\s*-", c) is not None),
        proof="slips/02o/key_blocks_reversed")


mistake("key_loop_over_queries", CODE, "the loop over key blocks runs to S_q",
        "The loop walks the *keys*: range(0, S_k, block_n). With S_q where S_k belongs it stops early "
        "when S_q < S_k (the last keys never enter the sum) and runs past the keys when S_q > S_k (an "
        "empty block, whose max over nothing raises).",
        test=quoted_line(lambda c: re.search(r"for\s+\w+\s+in\s+range\([^()]*\bS_q\b[^()]*,\s*block_n\s*\)", c) is not None),
        proof="slips/02o/key_loop_over_queries")


mistake("divides_by_exp_lse", CODE, "O is divided by exp(LSE) = l * e^m, not by l",
        "acc holds sum_j exp(s_j - m) v_j: the running max m is already taken out. Dividing by "
        "exp(LSE) = exp(m) * l takes it out a second time, so each row is e^(-m) times too small. "
        "O = acc / l; the LSE, m + log(l), is returned beside it.",
        test=quoted_line(lambda c: re.search(r"/\s*\(?\s*torch\.exp\(\s*(?:m\s*\+\s*torch\.log\(\s*l|\w*lse)|/\s*\w*lse\w*\.exp\(",
             c) is not None), proof="slips/02o/divides_by_exp_lse")


mistake("mask_from_empty", CODE, "the mask starts from torch.empty: whatever the memory held",
        "torch.empty allocates without filling: the mask starts from leftover bytes (often all False, "
        "sometimes not). Each side's limit then takes keys *away* from that. Start from all True: "
        "torch.ones(S_q, S_k, dtype=torch.bool).",
        test=quoted_line(lambda c: re.match(r"(?:seen|mask|visible|keep)\w*\s*=\s*torch\.empty\(", c) is not None),
        proof="slips/09m/mask_from_empty")


mistake("offsets_summed_again", CODE, "cu_seqlens are summed up again: they already are the offsets",
        "cu_seqlens_q = [0, S_0, S_0 + S_1, ...] holds where each sequence *starts* (cumulative lengths), "
        "so sequence b is rows cu[b] : cu[b + 1]. A cumsum of them adds the offsets up once more.",
        test=quoted_line(lambda c: re.search(r"cu\w*\.cumsum\(|cumsum\(\s*cu\w*", c) is not None),
        proof="slips/09b/offsets_summed_again")


mistake("packed_lse_unsliced", CODE, "the whole packed LSE is handed to one sequence",
        "The packed LSE is [total, H]: sequence b's rows are lse[qs] (then .T for [H, S_q]). The whole "
        "tensor has every sequence's rows and fits only when there is one sequence.",
        test=quoted_line(lambda c: re.search(r"\blse\.(?:T|transpose\(|t\(\))", c) is not None),
        proof="slips/09b/packed_lse_unsliced")


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
         "last, after alpha, l and acc.", proof="slips/02o/max_overwritten_before_alpha")
def _max_before_alpha(ctx):
    _, line = first_found(ctx, _max_overwritten_before_alpha)
    return f"`{line}`; {ctx.case_pattern()}" if line else None


mistake("causal_in_packed", CODE, "a causal mask is added in the packed backward: causal is already in the window",
        "The packed backward takes no causal flag: a causal call reaches it as the window (left, 0) -- "
        "right = 0 hides every key after the query. visible_mask(S_q, S_k, window) alone is the mask; "
        "a causal_mask on top also hides the keys that a window with right > 0 (or no window) lets through.",
        test=quoted_line(lambda c: "causal_mask(" in c), proof="slips/09b/causal_in_packed")


mistake("lse_without_log", CODE, "the LSE is m + l: the log of the sum is missing",
        "l is the running *sum* of exp(S - m); the log-sum-exp is m + log(l). m + l mixes a log-domain "
        "number with a plain one; O = acc / l is unaffected, only the LSE is off.",
        test=quoted_line(lambda c: not SWITCH.search(c) and re.search(r"\bm\w*\s*\+\s*l\w*\b", c) is not None and "log" not in c),
        proof="slips/02o/lse_without_log")


mistake("dp_transposed", CODE, "dP is built as V dO^T: the transpose of dO V^T",
        "dP = dO V^T, [S_q, S_k], a row per query like P. V dO^T is [S_k, S_q], its transpose: it fits only "
        "where S_q = S_k, and there it pairs each query with the wrong key.",
        test=quoted_line(lambda c: not SWITCH.search(c) and re.search(r"=\s*v\w*\s*@\s*(?:do|d_o|dout|grad_out)\w*\.(?:T\b|mT\b|t\(\)|transpose\()", c)
             is not None), proof="slips/07/dp_transposed")


mistake("lazy_dtau_by_length", CODE, "dTau divides every row by L: row i's bias term is tau / (i + 1)",
        "Lazy attention adds c_i = tau / (i + 1) to row i, so dTau = sum_i rowsum(dP_i * gate_i) / (i + 1), "
        "one divisor per row. Dividing by L (or any one number) weights every row alike.",
        test=quoted_line(lambda c: re.match(r"\s*d_?tau\w*\s*=", c) is not None and
             re.search(r"/\s*\(?\s*(?:L|S|seq_len|n)\s*\)?(?!\s*[+\-*])", c) is not None and "i + 1" not in c),
        proof="slips/07/lazy_dtau_by_length")
