"""Stage "window and dropout": lesson 09's checkers (``check.window_mask``,
``check.beyond_backward``). First which of the lesson's classic mistakes the outputs match
(fingerprints computed by :mod:`flashattn.check.beyond`), then which *kind* of case fails -- only
with dropout, only with a window, only with several sequences -- when no fingerprint fits.
"""
from __future__ import annotations

import re

import torch

from .. import window_edges
from ..engine import LESSON_09, mistake
from ..evidence import in_every_failing_case, matches
from ..source import first_line


@mistake("beyond_empty_rows", LESSON_09, "NaN in rows that see no key",
         "Where the window hides every key of a row, softmax over an all -inf row is 0/0. The "
         "forward stored LSE = +inf for such a row, so P = exp(S - LSE) is 0 there: rebuild P from "
         "the LSE (or set those rows to 0), never with a softmax over nothing.",
         proof="beyond/beyond_backward/beyond_empty_rows")
def _empty_rows(ctx):
    nan = [r for r in ctx.failing if any(t.nan_computed for t in r.tensors.values())]
    if nan and all(r.case.empty_rows for r in nan) and \
            all(not any(t.nan_computed for t in r.tensors.values()) for r in ctx.ran if not r.case.empty_rows):
        return (f"NaN in {ctx.names_of(nan)}, the case(s) whose window leaves some rows without a key; "
                f"no other case has NaN")
    return None


WINDOW_IDEA = ("window = (left, right): query i sees keys i - left ... i + right, both ends included "
               "(-1: no limit on that side), counted from the start of each sequence. Causal is (-1, 0).")


mistake("window_left_off", LESSON_09, "the window's left edge is off by one",
        WINDOW_IDEA + " Yours moves the left edge: check >= against >, and i - left against i - left + 1.",
        test=matches("window_left_off"), proof="beyond/window_mask/window_left_off")


mistake("window_right_off", LESSON_09, "the window's right edge is off by one",
        WINDOW_IDEA + " Yours moves the right edge: check <= against <, and i + right against i + right - 1.",
        test=matches("window_right_off"), proof="beyond/window_mask/window_right_off")


mistake("window_swapped", LESSON_09, "left and right are swapped (or the mask is transposed)",
        WINDOW_IDEA + " left bounds the keys *before* the query (j >= i - left), right those after it.",
        test=matches("window_swapped"), proof="beyond/window_mask/window_swapped")


mistake("window_minus_one", LESSON_09, "-1 is taken as a number, not as 'no limit'",
        WINDOW_IDEA + " A side of -1 adds no condition at all: skip that comparison.",
        test=matches("window_minus_one"), proof="beyond/window_mask/window_minus_one")


mistake("window_zero_unlimited", LESSON_09, "a side of 0 is taken as 'no limit'",
        WINDOW_IDEA + " Only -1 means no limit; 0 is a real bound (left = 0: no key before the "
        "query). Test the side with >= 0, not > 0.", test=matches("window_zero_unlimited"),
        proof="beyond/window_mask/window_zero_unlimited")


mistake("window_abs_distance", LESSON_09, "one side of the window is written as a distance, |i - j| <= w",
        WINDOW_IDEA + " Each side bounds one direction only: left the keys before the query "
        "(j >= i - left), right those after it (j <= i + right). |i - j| <= left also cuts the keys "
        "after the query at i + left.", test=matches("window_abs_distance"),
        proof="beyond/window_mask/window_abs_distance")


mistake("window_other_side", LESSON_09, "one edge of the window uses the other side's width",
        WINDOW_IDEA + " The left edge uses left (j >= i - left), the right edge right (j <= i + right): "
        "yours bounds one side with the other side's number (a copied line not fully changed?).",
        test=matches("window_other_side"), proof="slips/09m/window_other_side")


mistake("window_edge_sign", LESSON_09, "a sign slip in one edge of the window",
        WINDOW_IDEA + " Keys before the query: j >= i - left; keys after it: j <= i + right. Yours has "
        "the wrong sign or the operands the other way round (left - i, i + left, i - right).",
        test=matches("window_edge_sign"), proof="slips/09m/window_edge_sign")


@mistake("window_truthiness", LESSON_09, "a side of the window is tested by truthiness (if left: or if right:)",
         WINDOW_IDEA + " `if left:` is False for 0 -- a real bound, no key before the query -- and True "
         "for -1, which means no limit (`if right:` likewise). Test the sentinel itself: if left >= 0 "
         "(or != -1).", proof="slips/09m/window_truthiness")
def _window_truthiness(ctx):
    seen = matches("window_truthiness")(ctx)
    if seen is None:
        return None

    line = first_line(ctx, lambda c: re.match(r"(?:el)?if\s+(?:not\s+)?\(?\s*\w+\s*\)?\s*:", c) is not None and
                       re.search(r"\b(?:left|right|w|window\[\d\])\b", c) is not None)
    return (f"`{line}`; " if line else "") + seen


mistake("window_empty", LESSON_09, "the mask is False everywhere: it starts empty",
        WINDOW_IDEA + " Start from a mask where every key is seen (torch.ones(..., dtype=torch.bool)) "
        "and take keys away with &= for each limited side; a mask that starts all False stays all False.",
        test=matches("window_empty"), proof="slips/09m/window_empty")


mistake("window_elif", LESSON_09, "the second side is tested with elif: it is skipped whenever the first applies",
        WINDOW_IDEA + " The two sides are independent conditions: two `if`s, each adding its own limit. "
        "`elif` runs the second only when the first did not.", test=matches("window_elif"),
        proof="slips/09m/window_elif")


mistake("window_right_nested", LESSON_09, "the right edge is tested inside the left side's if: it applies only when left is limited",
        WINDOW_IDEA + " The two sides are independent: `if right >= 0:` sits at the same level as "
        "`if left >= 0:`, not indented under it. Nested, a window with no left limit -- causal "
        "(-1, 0) among them -- loses its right edge too, while windows limited on the left are right.",
        test=matches("window_right_nested"), proof="slips/09m/window_right_nested")


mistake("window_one_edge_bottom_right", LESSON_09, "one edge is aligned bottom-right (shifted by S_k - S_q), the other top-left",
        WINDOW_IDEA + " Both edges count the query's position the same way, from the start of the "
        "sequence: j >= i - left and j <= i + right. Shifting one of them by S_k - S_q (the bottom-right "
        "alignment) moves that edge alone where S_q != S_k.", test=matches("window_one_edge_bottom_right"),
        proof="slips/09m/window_one_edge_bottom_right")


mistake("window_absolute", LESSON_09, "an edge is an absolute key position, not relative to the query",
        WINDOW_IDEA + " The right edge moves with the query: j <= i + right. j <= right cuts every row "
        "at the same key.", test=matches("window_absolute"), proof="slips/09m/window_absolute")


mistake("window_starts_causal", LESSON_09, "the mask starts from the causal triangle, not from all True",
        WINDOW_IDEA + " Start from a mask where every key is seen, torch.ones(S_q, S_k, dtype=torch.bool), and "
        "take keys away per limited side. Starting from .tril() hides every key after the query "
        "even when right allows some (or is -1, no limit).", test=matches("window_starts_causal"),
        proof="slips/09m/window_starts_causal")


mistake("window_sentinel_clamped", LESSON_09, "-1 (no limit) is clamped to 0, a limit of zero keys",
        WINDOW_IDEA + " max(w, 0) turns the sentinel -1 into 0: no key on that side at all "
        "((-1, -1) keeps only the diagonal). Test the sentinel (if left >= 0) instead of clamping it.",
        test=matches("window_sentinel_clamped"), proof="slips/09m/window_sentinel_clamped")


mistake("window_one_based", LESSON_09, "positions counted from 1 on one axis and from 0 on the other",
        WINDOW_IDEA + " Query and key positions both start at 0 (torch.arange(S)); numbering one of "
        "them from 1 shifts every window by one key: one extra key on one side, one fewer on the other.",
        test=matches("window_one_based"), proof="slips/09m/window_one_based")


mistake("window_and_precedence", LESSON_09, "`seen & j <= i + right`: & binds before <=",
        WINDOW_IDEA + " In Python & binds tighter than the comparisons: seen & j <= i + right is "
        "(seen & j) <= (i + right), a bitwise and of the mask with the key positions. Parenthesise the "
        "comparison, seen & (j <= i + right), or write seen &= j <= i + right.",
        test=matches("window_and_precedence"), proof="slips/09m/window_and_precedence")


mistake("window_both_required", LESSON_09, "a one-sided window gets no limit at all: the limits apply only when both sides are given",
        WINDOW_IDEA + " Each side is its own condition: `if left >= 0: seen &= j >= i - left`, then "
        "`if right >= 0: seen &= j <= i + right`. Tested together (if left >= 0 and right >= 0), a "
        "window limited on one side only -- causal (-1, 0) among them -- keeps every key.",
        test=matches("window_both_required"), proof="slips/09m/window_both_required")


mistake("window_one_side_twice", LESSON_09, "one side's limit is used for both sides",
        WINDOW_IDEA + " Unpack both: left, right = window. Yours takes one of them for both edges "
        "(window[0], window[0]), so every window whose two limits differ comes out wrong.",
        test=matches("window_one_side_twice"), proof="slips/09m/window_one_side_twice")


mistake("window_returned_inverted", LESSON_09, "the mask is inverted: True where the key is hidden",
        WINDOW_IDEA + " visible_mask returns True where query i *sees* key j. The mask that "
        "masked_fill takes is the opposite one (True where hidden): return seen, not ~seen, and "
        "invert where you fill.", test=matches("window_returned_inverted"),
        proof="slips/09m/window_returned_inverted")


mistake("window_side_lost", LESSON_09, "one side of the window is lost: the mask holds the other edge alone",
        WINDOW_IDEA + " Each limited side takes keys *away* from the mask: seen &= (that edge). An "
        "assignment (seen = ...) throws the first side's limit away, and |= on a mask of all True "
        "adds nothing.", test=matches("window_side_lost"), proof="slips/09m/window_side_lost")


mistake("window_guard_other", LESSON_09, "one side's limit is guarded by the other side's test",
        WINDOW_IDEA + " Each limit is applied when *its own* side is limited: `if right >= 0:` guards "
        "j <= i + right, `if left >= 0:` guards j >= i - left (a copied `if` half changed?).",
        test=matches("window_guard_other"), proof="slips/09m/window_guard_other")


mistake("window_bottom_right", LESSON_09, "the window is aligned bottom-right",
        WINDOW_IDEA + " With S_q != S_k the course aligns query i with key i (top-left, as its causal "
        "mask); yours shifts the queries by S_k - S_q.", test=matches("window_bottom_right"),
        proof="beyond/window_mask/window_bottom_right")


mistake("window_inverted", LESSON_09, "the window's mask is inverted: P is kept on the hidden keys",
        "The window's mask is True where the key is *seen*: zero P where it is False "
        "(masked_fill(~seen, 0)), not where it is True.", test=matches("window_inverted"),
        proof="beyond/beyond_backward/window_inverted")


mistake("unscaled_scores", LESSON_09, "P is rebuilt from scores without the scale",
        "S = Q K^T * scale: the LSE the forward stored belongs to the scaled scores, so "
        "P = exp(S - LSE) needs the same scale (and dQ, dK one more factor each).", test=matches("unscaled_scores"),
        proof="beyond/beyond_backward/unscaled_scores")


mistake("scale_ignored", LESSON_09, "the scale argument is ignored: D ** -0.5 is used instead",
        "The function receives scale: use it wherever the forward did (the scores, and dQ and dK), "
        "since a model may pass any scale.", test=matches("scale_ignored"),
        proof="beyond/beyond_backward/scale_ignored")


mistake("softmax_then_mask", LESSON_09, "P is a softmax over every key, masked afterwards",
        "The forward's softmax ran over the *visible* keys only: P = exp(S - LSE) on them, 0 "
        "elsewhere (the LSE already holds the right normaliser). A softmax over all keys followed "
        "by the mask gives rows that no longer sum to 1.", test=matches("softmax_then_mask"),
        proof="beyond/beyond_backward/softmax_then_mask")


mistake("mask_after_dv", LESSON_09, "the window's mask is put on P after dV used it",
        "exp(S - LSE) is positive everywhere: the keys the window hides must be set to P = 0 before P "
        "enters *any* product. Yours masks P only after dV = P^T dO was formed (dQ and dK, computed "
        "later, are right): move the masked_fill up, right after P = exp(S - LSE).", test=matches("mask_after_dv"),
        proof="slips/09b/mask_after_dv")


mistake("no_visible", LESSON_09, "P is rebuilt from the LSE without the window's mask",
        "exp(S - LSE) is positive everywhere: the keys the window hides must be set to P = 0 "
        "(masked_fill or where) before P enters dV, dP and dS.", test=matches("no_visible"),
        proof="beyond/beyond_backward/no_visible")


# after no_visible: with both sides limited, | lets every key through -- in the packed backward the
# same outputs as no window mask at all, which is the likelier slip there
mistake("window_or", LESSON_09, "the window's two edges are joined with | (or): a key must pass both",
        WINDOW_IDEA + " A key is seen when it is within the left edge *and* within the right edge: "
        "combine the conditions with & (&=). With | every key passes one of them.", test=matches("window_or"),
        proof="slips/09m/window_or")


_DROPOUT_IDEA = ("The forward computed O = (P * Z / (1 - p)) V with Z the dropout mask. So dV = "
                 "(P * Z / (1 - p))^T dO, and dP = (dO V^T) * Z / (1 - p) (what reached O went through "
                 "Z / (1 - p)); dS = P * (dP - delta) keeps the *undropped* P (the softmax's own "
                 "Jacobian), and delta = rowsum(dO * O) still holds.")


mistake("no_rescale_dv", LESSON_09, "dV is missing the 1 / (1 - p) rescale",
        _DROPOUT_IDEA, test=matches("no_rescale_dv"), proof="beyond/beyond_backward/no_rescale_dv")


mistake("no_rescale_dp", LESSON_09, "dP is missing the 1 / (1 - p) rescale",
        _DROPOUT_IDEA, test=matches("no_rescale_dp"), proof="beyond/beyond_backward/no_rescale_dp")


mistake("no_rescale", LESSON_09, "the 1 / (1 - p) rescale is missing in the backward (dV and dP)",
        _DROPOUT_IDEA, test=matches("no_rescale"),
        proof="beyond/beyond_backward/no_rescale")   # after the two above: each of those explains fewer wrong outputs


mistake("dv_no_mask", LESSON_09, "dV ignores the dropout mask (P^T dO)",
        _DROPOUT_IDEA, test=matches("dv_no_mask"), proof="beyond/beyond_backward/dv_no_mask")


mistake("dp_no_mask", LESSON_09, "dP ignores the dropout mask",
        _DROPOUT_IDEA, test=matches("dp_no_mask"), proof="beyond/beyond_backward/dp_no_mask")


mistake("dq_dropped", LESSON_09, "dQ multiplies dS by the dropout mask again: Z is already inside dP",
        _DROPOUT_IDEA + " dQ = dS K * scale and dK = dS^T Q * scale share that one dS: a second Z / (1 - p) "
        "on dQ's line alone (dK right) drops and rescales dS twice.", test=matches("dq_dropped"),
        proof="slips/09b/dq_dropped")


mistake("ds_dropped_p", LESSON_09, "dS uses the dropped P (P * Z / (1 - p)) instead of P",
        _DROPOUT_IDEA, test=matches("ds_dropped_p"), proof="beyond/beyond_backward/ds_dropped_p")


mistake("delta_unmasked_dp", LESSON_09, "delta is summed from a dP without the dropout mask",
        _DROPOUT_IDEA, test=matches("delta_unmasked_dp"), proof="beyond/beyond_backward/delta_unmasked_dp")


mistake("delta_rescaled", LESSON_09, "delta ends up divided by 1 - p: the rescale reaches more than dP",
        _DROPOUT_IDEA + " O already carries the 1 / (1 - p), so delta = rowsum(dO * O) needs none. The "
        "usual ways to divide it anyway: delta / (1 - p) itself; the whole of dS (or P before dS) "
        "divided by 1 - p, where only dP should be; delta summed as rowsum(P * Z / (1 - p) * dP) "
        "with a dP that already holds Z / (1 - p) (that is rowsum(dO * O) / (1 - p)).",
        test=matches("delta_rescaled"), proof="slips/09b/delta_rescaled")


mistake("delta_dropped", LESSON_09, "delta is multiplied by the dropout mask: dS = P * (dP - delta * Z / (1 - p))",
        _DROPOUT_IDEA + " delta = rowsum(dO * O) is one number per row, the same for every key: it is "
        "not dropped. Only dP carries Z / (1 - p).", test=matches("delta_dropped"), proof="slips/09b/delta_dropped")


mistake("rescale_inverted", LESSON_09, "the rescale multiplies by 1 - p instead of dividing",
        _DROPOUT_IDEA, test=matches("rescale_inverted"), proof="beyond/beyond_backward/rescale_inverted")


mistake("rescale_by_p", LESSON_09, "the rescale divides by p, the drop probability, instead of 1 - p",
        _DROPOUT_IDEA +
        " The kept elements are scaled by 1 / (1 - p), the inverse of the *keep* probability, so that the "
        "expectation is unchanged; 1 / p blows them up (and is inf at p = 0).", test=matches("rescale_by_p"),
        proof="slips/09b/rescale_by_p")


mistake("rescale_twice", LESSON_09, "the 1 / (1 - p) rescale is applied twice",
        _DROPOUT_IDEA, test=matches("rescale_twice"), proof="beyond/beyond_backward/rescale_twice")


mistake("keep_inverted", LESSON_09, "the dropout mask is inverted: the dropped elements are kept",
        "Z is True where the element *survives* (dropout_mask returns the keep-mask): multiply by Z, "
        "not by ~Z or 1 - Z.", test=matches("keep_inverted"), proof="beyond/beyond_backward/keep_inverted")


mistake("rescale_precedence", LESSON_09, "keep / 1.0 - p: the parentheses around 1 - p are missing",
        _DROPOUT_IDEA + " Division binds before subtraction: keep / (1.0 - p), with the parentheses.",
        test=matches("rescale_precedence"), proof="slips/09b/rescale_precedence")


mistake("mask_one_head", LESSON_09, "the dropout mask is drawn for one head and broadcast to all",
        "dropout_mask(seed, H, S_q, S_k, p, ...) draws one mask per head of the sequence, heads numbered "
        "b * H ... b * H + H - 1: with a head count of 1 every head reuses the first head's mask.",
        test=matches("mask_one_head"), proof="slips/09b/mask_one_head")


mistake("stops_at_empty", LESSON_09, "the loop over the sequences stops at an empty one",
        "A packed batch may hold a sequence of length 0: it has nothing to compute, but the sequences "
        "after it still do. Skip it (`continue`), don't leave the loop (`break`) -- or let the empty "
        "slices run, which computes nothing.", test=matches("stops_at_empty"), proof="slips/09b/stops_at_empty")


mistake("keep_probability", LESSON_09, "the dropout mask is drawn with the keep probability 1 - p",
        "dropout_mask(seed, H, S_q, S_k, p, ...) takes the *drop* probability p, the dropout_p the "
        "forward used: it returns Z, True where an element survives (with probability 1 - p). Hand it "
        "1 - p and it draws another mask.", test=matches("keep_probability"), proof="slips/09b/keep_probability")


mistake("masks_swapped", LESSON_09, "the window's mask and the dropout mask are passed in each other's place",
        "sequence_backward(..., keep, dropout_p, seen, scale): keep is the dropout mask Z [H, S_q, S_k], "
        "seen the window's [S_q, S_k]. Both are bool and broadcast against each other, so swapped they "
        "run -- and the window hides what dropout dropped. Compare the call with the signature.",
        test=matches("masks_swapped"), proof="slips/09b/masks_swapped")


mistake("mask_same_for_all", LESSON_09, "every sequence uses sequence 0's dropout mask",
        "Sequence b's heads were numbered b * H ... b * H + H - 1 when the forward drew their "
        "masks: draw each sequence's Z with first_seq_head=b * H.", test=matches("mask_same_for_all"),
        proof="beyond/beyond_backward/mask_same_for_all")


mistake("mask_numbered_by_b", LESSON_09, "sequence b's dropout mask is drawn with first_seq_head=b, not b * H",
        "Each (sequence, head) pair has its own number b * H + h; with first_seq_head=b, sequence 1 "
        "takes sequence 0's second head's mask.", test=matches("mask_numbered_by_b"),
        proof="beyond/beyond_backward/mask_numbered_by_b")


mistake("mask_drawn_at_longest", LESSON_09, "each sequence's dropout mask is drawn at the longest lengths and cut down",
        "Element (i, j)'s bits come from a Philox counter that counts the row's groups of 32 keys, "
        "ceil(S_k / 32) of them, so a mask drawn for another S_k differs wherever the two lengths "
        "fall in different multiples of 32 -- slicing does not give back the shorter sequence's "
        "mask. Draw each sequence's at its own (S_q, S_k), as the forward did: dropout_mask(seed, H, "
        "S_q, S_k, p, device, first_seq_head=b * H).", test=matches("mask_drawn_at_longest"),
        proof="slips/09b/mask_drawn_at_longest")


mistake("mask_sliced_from_whole", LESSON_09, "each sequence's dropout mask is cut out of one mask for the whole batch",
        "The forward drew a mask per (sequence, head), of that sequence's own (S_q, S_k), numbered "
        "b * H + h -- not one mask over the packed tensor: draw each sequence's with "
        "dropout_mask(seed, H, S_q, S_k, p, device, first_seq_head=b * H).", test=matches("mask_sliced_from_whole"),
        proof="beyond/beyond_backward/mask_sliced_from_whole")


def _rounded_rescale(p: float, value: float):
    """The low-precision dtype whose 1 / (1 - p) is ``value`` (as a division or as the rounded
    quotient), or None."""
    exact = 1.0 / (1.0 - p)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        divided = float(torch.tensor(1.0, dtype=dtype) / torch.tensor(1.0 - p, dtype=dtype))
        for r in (divided, float(torch.tensor(exact, dtype=dtype))):
            if r != exact and abs(value - r) <= 1e-9 * r:
                return str(dtype).replace("torch.", "")
    return None


@mistake("rescale_rounded", LESSON_09, "1 / (1 - p) is rounded to a lower precision than the inputs'",
         _DROPOUT_IDEA + " The battery runs in float64, and 1 / (1 - p) is not a round number for every p "
         "(1 / 0.7 = 1.428571428571...). A bool mask divided by a float comes out in torch's default "
         "dtype, float32, which keeps 7 digits of it (fp16 3): every gradient through it is off by that "
         "much, in the cases whose p shows it. Make the mask the inputs' dtype first: keep.to(q.dtype) / "
         "(1.0 - dropout_p).", proof="slips/09b/rescale_rounded")
def _rescale_rounded(ctx):
    if not ctx.failing or not all(r.case.dropout_p > 0 and not r.error for r in ctx.failing):
        return None
    found = []
    for r in ctx.failing:
        bad = r.bad()
        if not bad or any(t.rel > 1e-2 for t in bad):
            return None
        p = r.case.dropout_p
        for t in bad:
            dtype = _rounded_rescale(p, t.ratio / (1.0 - p)) if t.ratio_resid < 1e-9 else None
            if dtype:
                found.append(f"{t.name} = {t.ratio:.10g} x the right one in '{r.case.name}': your 1 / (1 - p) "
                             f"is {t.ratio / (1.0 - p):.9g} where {1.0 / (1.0 - p):.12g}... belongs, {dtype}'s "
                             f"rounding of it")
                break
        else:
            return None
    return "; ".join(found[:2]) if found else None


@mistake("dropout_rescale", LESSON_09, "only dropout cases fail, and an output is off by a constant factor: a rescale slip",
         _DROPOUT_IDEA, proof="beyond/beyond_backward/dropout_rescale")
def _rescale_factor(ctx):
    if not ctx.failing or not all(r.case.dropout_p > 0 and not r.error for r in ctx.failing):
        return None
    found = []
    for r in ctx.failing:
        for t in r.bad():
            if t.ratio_resid < 1e-6 and abs(t.ratio - 1) > 1e-6:
                one_minus_p = 1.0 - r.case.dropout_p
                found.append(f"{t.name} = {t.ratio:.4g} x the right one in '{r.case.name}' "
                             f"((1 - p) = {one_minus_p:g}, 1 / (1 - p) = {1 / one_minus_p:.4g})")
    return "; ".join(found[:3]) if found else None


def _per_sequence(ctx, cases) -> str:
    """'sequence 0 right, sequences 1-2 wrong' over ``cases``, from the per-(sequence, head) errors."""
    ok_first, bad_later = True, False
    for r in cases:
        for t in r.tensors.values():
            seq_ok = t.heads_ok.all(dim=1)
            ok_first &= bool(seq_ok[0])
            bad_later |= bool((~seq_ok[1:]).any())
    return "sequence 0 is right in every one of them, later sequences are wrong" if ok_first and bad_later else ""


@mistake("dropout_mask_differs", LESSON_09, "the backward's dropout mask is not the forward's",
         "Z is never stored: the backward must draw the very same bits the forward drew -- the same "
         "seed, the same first_seq_head (b * H for sequence b) and the same (S_q, S_k) for each "
         "sequence, from beyond.dropout_mask -- not a new draw (torch.rand, bernoulli, another seed). "
         "Then apply it in dV and dP with the 1 / (1 - p).", proof="beyond/beyond_backward/dropout_mask_differs")
def _mask_differs(ctx):
    dropout = [r for r in ctx.results if r.case.dropout_p > 0]
    if ctx.failing and all(r.case.dropout_p > 0 for r in ctx.failing):
        which = _per_sequence(ctx, [r for r in ctx.failing if r.case.packed])
        return (f"only cases with dropout fail ({len(ctx.failing)} of {len(dropout)}), every case without dropout "
                f"passes, and the outputs match none of the rescale slips" + (f"; {which}" if which else ""))
    return None


mistake("o_do_swapped", LESSON_09, "O and dO are passed in each other's places",
        "The two have the same shape [S_q, H, D], so swapped they run: delta = rowsum(dO * O) does not "
        "notice (a product of the two), but dV = P^T dO and dP = dO V^T then use O. Compare the call "
        "with the signature: sequence_backward(q, k, v, o, do, lse, ...).", test=matches("swapped_o_do"),
        proof="slips/09b/o_do_swapped")   # a swap in the call changes dQ, dK and dV: all three must be wrong


mistake("dv_uses_o", LESSON_09, "dV multiplies by O where dO belongs",
        "dV = (P * Z / (1 - p))^T dO: the gradient that reaches V is the one that arrived at the "
        "output, dO. O has the same shape, so the product runs. (dQ and dK are right: they go "
        "through dP = dO V^T.)", test=matches("dv_uses_o"), proof="slips/09b/dv_uses_o")


mistake("dp_uses_o", LESSON_09, "dP multiplies by O where dO belongs",
        "dP = dO V^T (times Z / (1 - p)): the gradient of P comes from dO, the gradient that "
        "arrived at the output. O has the same shape, so the product runs; dV = P^T dO is right.",
        test=matches("dp_uses_o"), proof="slips/09b/dp_uses_o")


mistake("lse_reshape", LESSON_09, "a sequence's LSE is reshaped from [S_q, H] to [H, S_q], not transposed",
        "reshape keeps the elements in memory order and only relabels the dimensions: the packed "
        "LSE's slice [S_q, H] reshaped to [H, S_q] puts row i's heads into one head's row, so "
        "P = exp(S - LSE) subtracts another row's and head's LSE. Swapping the two axes is a "
        "transpose: lse[qs].T (or .transpose(0, 1)).", test=matches("lse_reshape"), proof="slips/09b/lse_reshape")


mistake("heads_reshape", LESSON_09, "[S, H, D] and [H, S, D] are converted with reshape, not transpose",
        "reshape keeps the elements in memory order and only relabels the dimensions: [S, H, D] "
        "reshaped to [H, S, D] mixes rows of different heads and positions. Swapping two axes is a "
        "transpose: t.transpose(0, 1) (and back the same way).", test=matches("heads_reshape"),
        proof="beyond/beyond_backward/heads_reshape")


mistake("leak", LESSON_09, "attention leaks across the packed sequences",
        "A packed batch is several sequences end to end: query rows of sequence b may see only "
        "sequence b's keys. Work sequence by sequence (rows cu_seqlens[b] : cu_seqlens[b + 1]), "
        "not on the packed tensor as one long sequence.", test=matches("leak"), proof="beyond/beyond_backward/leak")


mistake("global_positions", LESSON_09, "the window compares positions in the packed tensor, not in the sequence",
        "Positions restart at 0 in each sequence: build each sequence's mask from its own lengths "
        "(S_q, S_k), so query i and key j are counted from cu_seqlens_q[b] and cu_seqlens_k[b].",
        test=matches("global_positions"), proof="beyond/beyond_backward/global_positions")


@mistake("last_sequence", LESSON_09, "the last sequence is wrong in every failing case, the others right",
         "A batch of n sequences has n + 1 offsets: the loop runs over b = 0 ... n - 1, i.e. "
         "range(len(cu_seqlens) - 1), and sequence b ends at cu_seqlens[b + 1].",
         proof="beyond/beyond_backward/last_sequence")
def _last_sequence(ctx):
    # a batch of one sequence has no "others": only a failing batch of several shows the pattern
    if not ctx.failing or any(r.error for r in ctx.failing) or all(len(r.case.lens_q) < 2 for r in ctx.failing):
        return None
    for r in ctx.failing:
        wrong = set()
        for t in r.bad():
            wrong |= {int(b) for b in (~t.heads_ok.all(dim=1)).nonzero().flatten()}
        if wrong != {len(r.case.lens_q) - 1}:
            return None
    return f"in all {len(ctx.failing)} failing cases only the last sequence is wrong ({ctx.tensor_pattern()})"


@mistake("sequences", LESSON_09, "only batches of several sequences fail: how the sequences are cut out or put back",
         "Sequence b is rows cu_seqlens_q[b] : cu_seqlens_q[b + 1] of q, o, do, lse and rows "
         "cu_seqlens_k[b] : cu_seqlens_k[b + 1] of k, v -- two different offsets when the lengths "
         "differ -- and its gradients go back to exactly those rows.", proof="beyond/beyond_backward/sequences")
def _sequences(ctx):
    single = [r for r in ctx.results if not r.case.packed]
    if ctx.failing and all(r.case.packed for r in ctx.failing) and single and all(r.ok for r in single):
        lens = [r for r in ctx.failing if r.case.lens_q != r.case.lens_k]
        extra = (f"; {len(lens)} of them have S_q != S_k in a sequence" if lens else "")
        return f"every one-sequence case passes, {len(ctx.failing)} packed case(s) fail{extra}"
    return None


@mistake("beyond_custom_scale", LESSON_09, "only the case with a scale of its own fails: the scale given is not used everywhere",
         "The function gets `scale` (not always D ** -0.5): the scores that rebuild P are "
         "q @ k^T * scale, and dQ and dK carry the same factor. Every case but the one whose scale "
         "differs from D ** -0.5 passes, so somewhere D ** -0.5 (or a default) stands where `scale` "
         "belongs.", proof="beyond/beyond_backward/beyond_custom_scale")
def _beyond_custom_scale(ctx):
    custom = lambda c: getattr(c, "scale", None) is not None and abs(c.scale - c.D ** -0.5) > 1e-12  # noqa: E731
    if ctx.failing and all(custom(r.case) for r in ctx.failing) and \
            all(r.ok for r in ctx.results if not custom(r.case)):
        return f"only {ctx.names_of(ctx.failing)} fail(s), the case(s) whose scale is not D ** -0.5; {ctx.tensor_pattern()}"
    return None


# an edge with another formula (window_edges.py generates them): after the named slips
@mistake("window_edge_formula", LESSON_09, "one edge of the window is computed with another formula",
         "window = (left, right): query i sees keys i - left ... i + right, both ends included (-1: no "
         "limit on that side). Each edge is relative to the query's own position i, with its own side's "
         "width: j >= i - left and j <= i + right.", proof="slips/09m/window_edge_formula")
def _edge_formula(ctx):
    common = in_every_failing_case(ctx, "edge:")
    if not common:
        return None
    # the simplest formula that fits every failing case: the base i, no end moved, the comparison kept
    label = min(sorted(common), key=lambda n: (" 1" in n, "S_k" in n, " i " not in f" {n} ", len(n)))
    _, side, formula = label.split(":", 2)
    why = {"j <= i + right - left": " -- i itself was moved by left before this edge (an in-place i -= left or "
                                    "i.sub_(left) changes i for every later line)",
           "j <= min(i + right, S_q - 1)": " -- keys run to S_k - 1, not S_q - 1: a key position is no row index",
           "j <= i - left": " -- the side kept is the wrong one (tril(k) keeps j <= i + k, below the diagonal; "
                            "the left edge keeps j >= i - left: triu(-left))"}
    return (f"in all {len(ctx.failing)} failing cases your mask equals the right one with its {side} edge "
            f"`{formula}` where `{window_edges.RIGHT_EDGES[side]}` belongs{why.get(formula, '')}")


@mistake("window_cases", LESSON_09, "only cases with a window fail, in a way no classic slip explains",
         WINDOW_IDEA + " Print your mask next to the expected one for a small case (check.last.report()).",
         proof="example/window_mask/_window_off_at_the_corner")
def _window_cases(ctx):
    if ctx.failing and all(getattr(r.case, "window", (-1, -1)) not in ((-1, -1),) for r in ctx.failing) and \
            any(getattr(r.case, "window", (-1, -1)) == (-1, -1) and r.ok for r in ctx.results):
        wins = sorted({r.case.window for r in ctx.failing})
        return f"windows {', '.join(map(str, wins))} fail; without a window every case passes"
    return None
