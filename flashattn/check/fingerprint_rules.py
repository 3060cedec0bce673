"""The diagnoses that rest on fingerprints: the learner's outputs equal, to rounding, what a
known wrong computation gives on the same inputs (:mod:`flashattn.check.fingerprints` computes
them in float64). Registered in :mod:`flashattn.check.rules`' order, at the place this module
is imported there: after the memory rules, before NaN, constant factors and the case patterns.
"""
from __future__ import annotations

import math
import re

from .diagnose import fingerprint_rule as _fp
from .diagnose import fingerprint_test as _fingerprint_test
from .diagnose import in_every_failing_case
from .diagnose import rule


_fp("delta", "dS is missing the - delta term",
    "dS = P * (dP - delta): the softmax Jacobian subtracts, from each row of dP, its P-weighted "
    "mean delta = rowsum(P * dP) = rowsum(dO * O) -- one number per query row.", name="no_delta")
_fp("softmax_axis", "the softmax runs over the wrong axis",
    "P's rows must sum to 1 over the keys: softmax over the last dimension (the keys), not over "
    "the queries.", kinds=("backward",))
_fp("scale_in_scores", "P is rebuilt from scores without the scale",
    "S = Q K^T * scale in the forward, so P = exp(S - LSE) must be rebuilt from the *scaled* "
    "scores -- the same S as the forward, or LSE does not match it. Check every place the scale "
    "enters: the scores that rebuild P, and the one factor in dQ and dK.", name="unscaled_s")
_fp("lse", "P rebuilt with exp2 from a natural-log LSE",
    "The forward's LSE is a natural log: rebuild P = exp(S - LSE). exp2 works only if both S and "
    "LSE are converted to base 2 (multiplied by log2(e)).", name="exp2")
_fp("lse_broadcast", "the LSE is lined up with the keys instead of the query rows",
    "LSE holds one number per query row: subtract it from every key of its row -- broadcast along "
    "the key axis of the tile (a column in the [query, key] orientation, a row in the transposed "
    "[key, query] one).", kinds=("dq", "dkdv"))
_fp("delta_broadcast", "delta is lined up with the keys instead of the query rows",
    "delta holds one number per query row: dS = P * (dP - delta) subtracts it from every key of "
    "its row -- broadcast along the key axis of the tile.", kinds=("dq", "dkdv"))
_fp("dp_operand", "dP is computed from the wrong tensor",
    "dP = dO V^T: the output's gradient meets the *values* (O = P V), not the keys.")
@rule("loop_one_block_short", "the loop stops one block early: its last block is never visited",
      "range(start, end, BLOCK) already stops before end, and its last block may be partial (the "
      "masks handle that). A stop of end - BLOCK leaves the last block out: for dQ the key block with "
      "the diagonal (causal) or the last keys, for dK/dV the last query block.", kinds=("dq", "dkdv"))
def _loop_one_block_short(ctx):
    # where S_q < S_k only, a key loop bounded by S_q drops blocks the same way: keys_bound names that
    if any(r.case.S_q >= r.case.S_k for r in ctx.failing):
        return _fingerprint_test("loop_one_block_short")(ctx)
    return None
_fp("ds_missing_p", "dS is missing its factor P",
    "dS = P * (dP - delta): the softmax's Jacobian multiplies by P elementwise, which is also "
    "what keeps hidden and padded keys at 0.", kinds=("backward", "dq", "dkdv"), name="ds_no_p")
_fp("delta_mean", "delta is a mean over the head dimension, not a sum",
    "delta = rowsum(dO * O) = sum over the D features of dO * O, one number per query row. "
    "A mean divides it by D (here every dQ and dK equals the backward with delta / D): use "
    ".sum(-1, keepdim=True), not .mean(-1).", kinds=("backward",))
_fp("delta_scalar", "delta is one number for everything, not one per query row",
    "delta_i = rowsum(dO * O)_i belongs to query row i (and to its batch element and head): sum "
    "over the last dimension only, keeping it, (do * o).sum(-1, keepdim=True). A .sum() over "
    "every dimension subtracts the same total from every row.", kinds=("backward",))
_fp("ds_from_s", "dS is built from the scores S where P belongs",
    "dS = P * (dP - delta): the softmax's Jacobian multiplies by the probabilities P, not by the "
    "scores S they came from (S is -inf at hidden keys: -inf times anything is inf or NaN).",
    kinds=("backward",))
_fp("log_softmax", "P is log_softmax(S): log-probabilities where the probabilities belong",
    "torch.log_softmax returns log P (negative, -inf at hidden keys). Attention weights the values by "
    "P itself: torch.softmax(S, dim=-1).", kinds=("backward",))
_fp("delta_per_head", "delta is one number per head, summed over the query rows too",
    "delta_i = rowsum(dO * O)_i belongs to query row i: sum over the last dimension (the D "
    "features) only, (do * o).sum(-1, keepdim=True). Summing over (-2, -1) adds every row of the "
    "head together and subtracts that total from each row of dP.", kinds=("backward",))
_fp("ds_diagonal", "dS = P (1 - P) dP: only the diagonal of the softmax's Jacobian",
    "dP_ij reaches S_ij and every other S_ik of its row: the softmax's Jacobian is "
    "dP_i/dS_ik = P_ij (1[j = k] - P_ik). The diagonal alone gives P (1 - P) dP; the whole "
    "Jacobian gives dS = P * (dP - delta), delta_i = sum_j P_ij dP_ij.", kinds=("backward",))
# the causal mask gone wrong, told apart by what each wrong mask computes
@rule("no_mask", "the causal mask is missing: hidden keys (j > i) get weight",
      "Under a causal mask query i sees keys j <= i only. The hidden scores must be -inf before the "
      "softmax (or P = 0 there when P is rebuilt from the LSE); without it every key counts. A mask "
      "that is there but has no effect is the same bug: masked_fill returns a new tensor (S = "
      "S.masked_fill(...), not S.masked_fill(...) alone). (If the function under test is a "
      "reference you wrote to test a kernel, the bug is in the test: test the test.)",
      kinds=("backward", "rebuild_p", "dq", "dkdv"))
def _no_mask(ctx):
    evidence = _fingerprint_test("no_mask")(ctx)
    if evidence is None:
        return None
    square = [r for r in ctx.results if getattr(r.case, "causal", False) and r.case.S_q == r.case.S_k]
    if square and all(r.ok for r in square) and all(r.case.S_q != r.case.S_k for r in ctx.failing):
        return evidence, ("Only the causal cases with S_q != S_k lose the mask; the square causal ones keep it: "
                          "the mask is guarded by a condition on the shape (S_q == S_k) besides causal. "
                          "Causal applies to every shape: query i sees keys j <= i (top-left aligned).")
    wrong = [n for n in ctx.names if ctx.wrong_in(n)]
    if wrong in (["dK"], ["dQ"], ["dQ", "dK"]) and "dV" in ctx.names:    # dV's P masked, dS's not
        return evidence, (f"Only {' and '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} wrong, and "
                          f"{'it equals' if len(wrong) == 1 else 'they equal'} the gradient with P unmasked: the "
                          f"P of dV = P^T dO is masked (dV is right in every case), the P that dS = P * (dP - "
                          f"delta) uses is not -- dS built from an exponential computed again, without the "
                          f"mask. Build dS from the masked P.")
    if wrong == ["dV"]:        # dK right: dS was masked; the P of dV = P^T dO was not
        return evidence, ("Only dV is wrong, and it equals dV with P unmasked: the mask reaches dS (dK is "
                          "right in every case) but not the P that dV = P^T dO uses. Mask P itself, before "
                          "both products use it.")
    return evidence
@rule("causal_inverted", "the causal test is inverted: the mask is applied exactly when causal is False",
      "Every causal case is computed without the mask and every non-causal one with it: the condition "
      "that guards the mask says the opposite of causal (`if not causal:`, or the flag negated on its "
      "way). Mask when causal is True, only then.", kinds=("backward", "rebuild_p"))
def _causal_inverted(ctx):
    causal = [r for r in ctx.failing if r.case.causal]
    plain = [r for r in ctx.failing if not r.case.causal]
    if causal and plain and all("no_mask" in r.fingerprints for r in causal) and \
            all("mask_applied" in r.fingerprints for r in plain):
        return (f"the {len(causal)} causal cases match attention without the mask, the {len(plain)} "
                f"non-causal ones attention with it; {ctx.tensor_pattern()}")
    return None
_fp("backward_not_causal", "the backward runs without the causal mask",
    "The forward is right (O matches) but the gradients are those of P rebuilt over every key: "
    "the causal flag does not reach the backward kernels. Save it in ctx in forward and pass "
    "ctx.causal on to both backward kernels.", kinds=("autograd",))
_fp("forward_not_causal", "the forward runs without the causal mask",
    "O equals attention over every key: the causal flag does not reach the forward kernel (and "
    "the LSE and O it saves for the backward are those of unmasked attention too).",
    kinds=("autograd",))
_fp("lse_unmasked", "the backward's LSE is not the forward's: recomputed without the mask",
    "P = exp(S - LSE) is exact only with the forward's own LSE, which was taken over the visible "
    "keys. Save the forward's LSE and use it; an LSE recomputed over every key (no causal mask) "
    "makes every causal row's P too small.", kinds=("autograd",))
_fp("mask_inverted", "the causal mask is inverted: visible keys hidden, hidden keys shown",
    "The mask marks what to hide: keys j > i get -inf (or P = 0), keys j <= i keep their score. "
    "Here it is the other way round (a `~` too many or too few).", kinds=("rebuild_p", "backward"))
_fp("mask_zero", "hidden scores are set to 0 instead of -inf",
    "A hidden key must get weight exactly 0: its score -inf before the exponential. A score of "
    "0 gives exp(0 - LSE) > 0, so hidden keys still count.", kinds=("backward", "rebuild_p", "dq", "dkdv"))
_fp("mask_after_softmax", "the causal mask is applied after the softmax",
    "The softmax must see the mask: scores of hidden keys -inf *before* it, so each row sums to 1 "
    "over its visible keys. Zeroing P afterwards leaves rows that sum to less than 1. (Only P "
    "rebuilt from the forward's LSE may be masked afterwards: the LSE already saw the mask.)",
    kinds=("backward",))
_fp("mask_strict", "the causal mask hides the diagonal: j < i where j <= i belongs",
    "A query sees its own key: visible is j <= i. With j < i row 0 sees nothing and every row "
    "loses its diagonal term.", kinds=("dq", "dkdv", "rebuild_p"))
_fp("mask_shifted", "the causal mask is off by one: query i also sees key i + 1",
    "Visible keys are j <= i, the diagonal included and nothing beyond: tril(ones) with diagonal=0, "
    "or hidden = j > i. One more (tril(diagonal=1), j <= i + 1, j < i + 2) lets each query see the "
    "next key.", kinds=("dq", "dkdv", "rebuild_p", "backward"))
_fp("p_hidden_neg_inf", "the hidden entries of P are -inf: -inf belongs on S, 0 on P",
    "A hidden key gets S = -inf *before* the exponential (exp(-inf) = 0), or P = 0 after it. Filling "
    "P itself with -inf puts -inf into every product that uses it.", kinds=("rebuild_p",))
_fp("mask_ge", "the causal mask points the wrong way: keys j >= i kept",
    "Visible keys are those at or before the query, j <= i. In a [key, query] tile that reads "
    "key <= query, i.e. offs_n[:, None] <= offs_m[None, :]. (tril and triu: the hidden keys are "
    "triu(ones, diagonal=1), the strictly upper triangle.)", kinds=("dq", "dkdv", "rebuild_p", "backward"))
_fp("mask_bottom_right", "the causal mask is aligned bottom-right: j <= i + S_k - S_q",
    "This course aligns the causal mask top-left: query i sees keys j <= i, whatever S_q and S_k "
    "(FlashAttention aligns it bottom-right when S_q != S_k: the last query sees every key). The "
    "two agree when S_q == S_k; with S_q > S_k the bottom-right mask leaves the first rows with no "
    "key at all (NaN), with S_q < S_k it shows keys j > i.", kinds=("rebuild_p", "backward"))
_fp("only_diagonal_tile", "the loop visits the diagonal tile only",
    "Under a causal mask a query block sees every key block up to and including its diagonal "
    "one: dQ's key loop runs from 0 to the end of the query block (not from the block's own "
    "start); dK/dV's query loop runs from the key block's own tile to S_q. Yours visits the "
    "diagonal tile alone (a mask transposed inside the tile would hide the other tiles the same "
    "way: check the loop's bounds first).", kinds=("dq", "dkdv"))
_fp("mask_tile_transposed", "the causal mask is transposed inside the tile",
    "The mask must have the tile's orientation: in a [query, key] tile the query index runs down "
    "the rows and the key index along the columns (in a [key, query] tile the other way round). "
    "A mask built in the other orientation still broadcasts on a square tile, but compares the "
    "wrong pairs.", kinds=("dq", "dkdv"))
_fp("diag_tile_skipped", "the loop skips the diagonal tile",
    "Under a causal mask the tile on the diagonal is half visible: the loop must include it (the "
    "keys up to the end of the query block for dQ; the query blocks from the key block's own "
    "on for dK/dV) and mask inside it.", kinds=("dq", "dkdv"))
_fp("scale_divided", "the scores are divided by the scale",
    "scale is already 1/sqrt(D): S = Q K^T * scale. Dividing by it multiplies by sqrt(D).",
    kinds=("backward",))
_fp("softmax_unnormalised", "P is exp(S - max) without the division by the row sum",
    "A stable softmax subtracts the row's maximum *and* divides by the row's sum: P = exp(S - m) / "
    "sum_j exp(S_j - m). Without the division the rows do not sum to 1 (torch.softmax does both; or "
    "rebuild P = exp(S - LSE), where the LSE holds the normaliser already).", kinds=("backward",))
_fp("scale_twice", "the scores carry the scale twice (scale^2)",
    "S = Q K^T * scale, once: scaling q and k both, or multiplying a score that already carries "
    "the scale again (in the exponent, say), gives scale^2, and the LSE -- computed with one scale "
    "-- no longer normalises it. Follow the scale from the product to the exponential.",
    kinds=("backward", "rebuild_p", "dq", "dkdv"))
_fp("dp_scaled", "dP carries the scale",
    "dP = dO V^T has no scale: the scale enters the scores (S = Q K^T * scale) and so, by the chain "
    "rule, dQ = dS K * scale and dK = dS^T Q * scale -- once each, after dS. A scale on dP goes "
    "through dS = P * (dP - delta) unevenly (delta has none) and is not a plain factor.",
    kinds=("backward", "dq", "dkdv"))
@rule("causal_bounds_unguarded", "the causal loop bounds are applied without the causal mask",
      "The shortened loop (dQ: keys only up to the end of the query block; dK/dV: query blocks from the "
      "key block's diagonal on) is right only under the causal mask. Without it every key sees every "
      "query: compute the bound inside `if CAUSAL:` and keep the full range otherwise.",
      kinds=("dq", "dkdv"))
def _causal_bounds_unguarded(ctx):
    # with one query block the dQ loop's causal bound reaches the same keys as a loop run to S_q:
    # at least one failing case must tell the two apart
    if not any("causal_bounds_unguarded" in r.fingerprints and "key_loop_to_sq" not in r.fingerprints
               for r in ctx.failing):
        return None
    return _fingerprint_test("causal_bounds_unguarded")(ctx)
_fp("scale_in_loop", "the final factor scale is applied inside the loop",
    "dQ = (sum over key blocks of dS K) * scale: the factor is applied once, after the loop (or to "
    "each block's share as it is added). Inside the loop, acc = acc * scale multiplies everything "
    "accumulated so far again at every iteration: the first blocks carry scale^2, scale^3, ... "
    "Only one-block rows come out right.", kinds=("dq", "dkdv"))
_fp("tile_transposed_again", "a tile is transposed once more in a product",
    "In the dK/dV kernel the tiles are already transposed (pT, dsT are [BLOCK_N, BLOCK_M]): dV += "
    "tl.dot(pT, do) and dK += tl.dot(dsT, q) as they are. In the dQ kernel ds is [BLOCK_M, BLOCK_N]: "
    "dQ += tl.dot(ds, k). An extra tl.trans still runs when BLOCK_M == BLOCK_N, and reads each tile "
    "across its diagonal.", kinds=("dq", "dkdv"))
_fp("lse_divided", "P = exp(S) / LSE: the LSE is a logarithm",
    "LSE = log(sum exp(S)), so the softmax is exp(S) / exp(LSE) = exp(S - LSE): subtract the LSE "
    "inside the exponential, never divide by it.", kinds=("rebuild_p",))
_fp("exp2_lse", "S is converted to base 2, the LSE is still a natural log",
    "exp2 needs both sides of the difference in base 2: exp(S - LSE) = exp2((S - LSE) * log2(e)). "
    "The forward's LSE is a natural log: multiply it by log2(e) too, or use exp.", kinds=("rebuild_p",))
_fp("p_sign", "P = exp(LSE - S): the subtraction is the wrong way round",
    "P = exp(S - LSE) is at most 1 (S <= LSE in every row); exp(LSE - S) is its reciprocal, above "
    "1 everywhere and inf on the hidden keys, where S = -inf.", kinds=("rebuild_p",))
_fp("log_p", "the exponential is missing: you return S - LSE = log P",
    "S - LSE is the log of the softmax (negative, -inf on hidden keys); P is its exponential, "
    "exp(S - LSE), between 0 and 1.", kinds=("rebuild_p",))
_fp("online_unscaled", "the scores are not scaled",
    "S = Q K^T * scale in every block, before the maximum and the exponential: the LSE and O "
    "belong to the scaled scores.", kinds=("online_softmax",))
_fp("online_exp2", "p uses exp2 while the rest of the loop uses exp",
    "The running maximum, alpha, p and the final LSE must use one base. exp2 is faster on a GPU, "
    "but only with the scores converted to base 2 (times log2(e)) everywhere, and the LSE "
    "converted back to a natural log at the end.", kinds=("online_softmax",))
_fp("online_max_not_kept", "the running maximum is never updated",
    "After each block the new maximum becomes the running one (m = m_new): the next block's "
    "alpha and p are taken against it, and LSE = m + log(l) needs the final one.", kinds=("online_softmax",))
_fp("lse_added", "P = exp(S + LSE): the LSE is subtracted",
    "softmax(S) = exp(S) / exp(LSE) = exp(S - LSE).", kinds=("rebuild_p", "backward", "dq", "dkdv"))
_fp("scale_on_difference", "the LSE is multiplied by the scale: exp(S - LSE * scale)",
    "The LSE belongs to the scaled scores already: S = Q K^T * scale, then P = exp(S - LSE), the LSE as "
    "it is. Multiplying it by the scale -- lse * scale, or (Q K^T - LSE) * scale, which is the same -- "
    "treats it as if it were in unscaled units.", kinds=("rebuild_p",))


@rule("wrong_operand", "a product uses the wrong operand",
      "Each gradient is one product with fixed operands: dQ = dS K * scale, dK = dS^T Q * scale, "
      "dV = P^T dO, and dP = dO V^T. Your output equals the same product with another tensor of "
      "the same shape in one place (named in the evidence).")
def _wrong_operand(ctx):
    if not ctx.failing:
        return None
    common = set.intersection(*({f for f in r.fingerprints if f.startswith("operand:")} for r in ctx.failing))
    if not common:
        return None
    formula = sorted(common)[0].split(":", 1)[1]
    return f"in all {len(ctx.failing)} failing cases yours equals {formula}; {ctx.tensor_pattern()}"
_fp("lse_delta_swapped", "LSE and delta are passed in each other's place",
    "Your outputs match a kernel that rebuilt P = exp(S - delta) and subtracted the LSE in dS: "
    "the two per-row vectors arrive in swapped arguments. Compare the call with the kernel's "
    "signature, argument by argument.", kinds=("dq", "dkdv", "autograd"))
_fp("delta_is_lse", "delta is the LSE: dS subtracts the wrong per-row vector",
    "delta = rowsum(dO * O), one number per query row, computed by the delta kernel; the LSE is "
    "the other per-row vector, and it belongs in P = exp(S - LSE) only. Check which pointer, "
    "argument or load delta comes from.", kinds=("dq", "dkdv", "autograd"))
_fp("delta_rowsum_dp", "delta = rowsum(dP): the product with P (or dO * O) is missing",
    "delta is the P-weighted mean of dP's row: rowsum(P * dP), which equals rowsum(dO * O). "
    "rowsum(dP) alone weighs every key the same.", kinds=("backward", "dq", "dkdv"))
_fp("kv_swapped", "K and V are passed in each other's place",
    "Your dQ equals a kernel that got V where K belongs and K where V belongs: the scores then "
    "come from V and dP from K. Compare the call with the kernel's signature, argument by argument.",
    kinds=("dq", "autograd"))
_fp("dp_tile_transposed", "the dP tile has the other orientation than the P tile it meets",
    "dP must have P's orientation: a dQ program works on [query, key] tiles, dP = dO V^T; a "
    "dK/dV program on [key, query] tiles, dP^T = V dO^T. The other product fits the shape on "
    "square tiles and puts every value in its mirror position.",
    kinds=("dkdv", "dq"))
_fp("query_block_from_pid", "the query block comes from the program id, not from the loop",
    "A key-block program loops over the query blocks: the rows it loads in each iteration must "
    "follow the loop variable (start_m + arange), not the program id. Here every iteration "
    "loaded the same query block again.", kinds=("dkdv",))
_fp("gqa_last_head", "only the last query head of each group reaches dK and dV",
    "The accumulators of a K/V head sum over every query head of its group and every query "
    "block: set them to zero once, before the loop over the group, not inside it.", kinds=("dkdv",))
_fp("gqa_one_head", "only the first query head of each group reaches dK and dV",
    "With GQA, K/V head h_kv is shared by GROUP_SIZE query heads: its dK and dV sum the "
    "contributions of all of them (loop g over the whole group).", kinds=("dkdv",))
_fp("lazy_delta", "delta = rowsum(dO * O) does not hold for lazy attention",
    "The shortcut delta = rowsum(dO * O) holds because O = P V in softmax attention; here "
    "O = A V with A = ReLU(P + tau/(i+1)), so delta must be summed the long way: rowsum(P * dP).",
    kinds=("lazy",))


@rule("lazy_gate", "the ReLU's gate is missing, or lets hidden entries through",
      "A = ReLU(P + tau/(i+1)) on the visible entries only: the gradient reaches P (and tau) only "
      "where the ReLU let it through, and only on j <= i: dP = dA * gate with "
      "gate = causal & (P + tau/(i+1) > 0). Mistakes show in the heads where the ReLU clips "
      "(tau < 0) or where a positive shift lands on hidden keys (tau > 0).", kinds=("lazy",))
def _lazy_gate(ctx):
    if [n for n in ctx.names if ctx.wrong_in(n)] == ["dTau"]:      # dTau's own rules speak
        return None
    common = set.intersection(*(set(r.fingerprints) for r in ctx.failing)) if ctx.failing else set()
    if "lazy_gate" in common:
        return f"your outputs match dP = dA without the gate exactly; {ctx.tensor_pattern()}"
    if common:
        return None                        # another exact match (dS from dA, delta from dA, ...): its rule speaks
    for sign, label in ((1, "tau > 0"), (-1, "tau < 0")):
        agree = disagree = 0
        for r in ctx.ran:
            for h, tau in enumerate(getattr(r.case, "taus", ())):
                head_wrong = any(h < t.heads_ok.numel() and not bool(t.heads_ok.flatten()[h])
                                 for t in r.tensors.values())
                predicted = tau != 0 and math.copysign(1, tau) == sign
                agree, disagree = (agree + 1, disagree) if head_wrong == predicted else (agree, disagree + 1)
        if agree and not disagree:
            return f"wrong exactly in the heads with {label}; {ctx.tensor_pattern()}"
    return None


for _id, _title, _idea in [
        ("lazy_scale", "dQ and dK are missing the scale", "S = Q K^T * scale + b, so dQ = dS K * scale and dK = dS^T Q * scale."),
        ("lazy_gate_value", "the gate is the ReLU's value, relu(P + c), not its derivative",
         "The chain rule multiplies dA by the ReLU's *derivative*: 1 where P + c > 0 (on the visible keys), "
         "0 elsewhere -- gate = causal & (P + c > 0), a mask. relu(P + c) is the ReLU's output A itself."),
        ("lazy_dbias_reversed", "dBias' diagonals are in reverse order: bias[d] gets diagonal W - d",
         "bias[d] sits on diagonal d below the main one (i - j = d): dBias[d] = the sum of dS's d-th "
         "diagonal, for d = 0, 1, ..., W in that order (range(W + 1)), not W down to 0."),
        ("lazy_recompute_unscaled", "the forward is recomputed without the scale (scale 1.0)",
         "The backward rebuilds P, A and O with the forward's own call, so that call needs the same "
         "scale as the forward had: with 1.0 every recomputed matrix is that of other scores, and all "
         "five gradients follow it. Pass scale on: forward_one_head(q, k, v, bias, tau, scale)."),
        ("lazy_dk_transpose", "dK needs dS transposed", "Key j collects dS[i, j] over the query rows i: dK = dS^T Q * scale."),
        ("lazy_dv", "dV is computed from P instead of A", "O = A V, so dV = A^T dO with A the ReLU-shifted matrix, not the softmax P."),
        ("lazy_dbias_diagonals", "dBias sums the wrong diagonals",
         "bias[d] enters S[i, j] for i - j = d (keys before the query): dBias[d] sums dS along the "
         "d-th diagonal *below* the main one."),
        ("lazy_dtau_count", "dTau is missing the 1/(i+1) factor", "tau enters row i as tau/(i+1): dTau sums dP[i, j] / (i + 1)."),
        ("lazy_dtau_gate", "dTau is not gated by the ReLU",
         "Entries the ReLU clipped pass no gradient to tau either: sum dA * gate / (i + 1)."),
        ("lazy_dtau_causal", "dTau sums over hidden keys too",
         "tau/(i+1) is added only on the visible keys j <= i: sum the causal entries only (and gate them).")]:
    _fp(_id, _title, _idea, kinds=("lazy",))


_fp("ds_precedence", "dS = P * dP - delta: the parentheses are missing",
    "delta is subtracted from dP *before* the product with P: dS = P * (dP - delta). Without the "
    "parentheses the product binds first, and every key -- hidden ones too -- gets -delta.",
    kinds=("backward", "dq", "dkdv"))
_fp("exp_minus_lse", "P = exp(S) - LSE: the LSE is subtracted outside the exponential",
    "The LSE divides: P = exp(S) / exp(LSE) = exp(S - LSE), the subtraction *inside* the "
    "exponential.", kinds=("backward", "dq", "dkdv", "rebuild_p"))
_fp("exp_difference", "P = exp(S) - exp(LSE): a difference where a quotient belongs",
    "exp(S - LSE) = exp(S) / exp(LSE): subtracting in the exponent divides after it. Keep the "
    "subtraction inside one exponential, torch.exp(S - lse[..., None]) (exp(S) alone also "
    "overflows for large scores, which is why the LSE is subtracted first).", kinds=("rebuild_p",))
_fp("p_max_and_lse", "P is exp(S - rowmax - LSE): the row's maximum is subtracted on top of the LSE",
    "The LSE already holds the maximum: LSE = max + log(sum_j exp(S_j - max)). P = exp(S - LSE) "
    "needs nothing else; subtracting the maximum too divides every row by exp(max).", kinds=("rebuild_p",))
_fp("p_max_not_lse", "P is exp(S - rowmax): the row's maximum where the LSE belongs",
    "exp(S - max) is only the numerator of a stable softmax: its rows sum to more than 1. The LSE "
    "is max + log(sum_j exp(S_j - max)), the maximum *and* the normaliser in one number, so "
    "P = exp(S - LSE) with the forward's LSE needs no maximum at all.", kinds=("rebuild_p",))
@rule("scale_value", "the scale used is not the one given",
      "Use the `scale` argument everywhere (the scores and the factor in dQ and dK); when it has to "
      "be defaulted, the default is 1/sqrt(D), not 1/D. The evidence's computation used another value.",
      kinds=("backward", "dq", "dkdv", "autograd", "online_softmax"))
def _scale_value(ctx):
    evidence = _fingerprint_test("scale_value")(ctx)
    if evidence is None:
        return None
    labels = set.intersection(*({f.split(":", 1)[1] for f in r.fingerprints if f.startswith("scale_value:")}
                                for r in ctx.failing if "scale_value" in r.fingerprints))
    if not labels:
        return evidence
    used = " = ".join(sorted(labels))         # values that coincide here (S_q = S_k) are all named
    return (f"your outputs are those of scale = {used}; {evidence}",
            f"The scale used is {used}. The softmax scale is 1/sqrt(D) -- D the head dimension, "
            f"q.shape[-1] -- when none is given, and the `scale` argument when one is; use that one "
            f"value everywhere (the scores, and the factor in dQ and dK).")
_fp("online_not_normalized", "O is returned without dividing by the normaliser l",
    "acc holds the unnormalised sum of p V; the softmax divides by its row sum, so O = acc / l "
    "after the loop (the LSE, m + log(l), is already right).", kinds=("online_softmax",))
_fp("online_scale_in_p", "the scale enters p's exponent only: the maximum, alpha and the LSE see unscaled scores",
    "Scale the scores once, s = Q K^T * scale, before anything uses them: the running maximum, "
    "alpha = exp(m_old - m_new) and LSE = m + log(l) are all in units of the scaled scores. With "
    "the scale only inside p = exp((s - m) * scale), alpha rescales with the wrong base and the "
    "LSE comes out in unscaled units.", kinds=("online_softmax",))
_fp("online_alpha_block_max", "alpha rescales against the block's maximum, not the new running maximum",
    "alpha = exp(m_old - m_new) converts the old sums from the old maximum to the *new running* "
    "one, m_new = max(m_old, max of this block), the same maximum p = exp(s - m_new) uses. Against "
    "the block's own maximum, alpha exceeds 1 whenever the block's scores are below the running "
    "maximum (and is inf for a block whose keys are all hidden).", kinds=("online_softmax",))
_fp("online_normalise_in_loop", "each block's p V is divided by l inside the loop: O is normalised twice",
    "acc holds the unnormalised sum of p V, rescaled by alpha as the maximum grows; the division by "
    "the full normaliser l happens once, after the loop (O = acc / l). Dividing each block's share by "
    "the running l as well normalises it twice.", kinds=("online_softmax",))
_fp("online_mask_zero", "hidden scores are set to 0, not -inf",
    "A hidden key must get weight exp(-inf) = 0: masked_fill(cols > rows, float('-inf')). Filled with "
    "0, its score is an ordinary one, exp(0 - m) > 0, and it enters l, acc and the LSE.",
    kinds=("online_softmax",))
_fp("online_p_times_alpha", "the new block's p is multiplied by alpha too",
    "alpha = exp(m_old - m_new) rescales what was summed *before* this block (l and acc) to the new "
    "maximum; this block's p = exp(s - m_new) is already taken against m_new and needs no factor.",
    kinds=("online_softmax",))
_fp("online_overlapping_blocks", "the blocks overlap: the loop's step is smaller than the block",
    "The loop must step by the block's width, range(0, S_k, block_n), for block [start, start + "
    "block_n) to follow the previous one exactly; a smaller step makes consecutive blocks share keys, "
    "which are then counted twice.", kinds=("online_softmax",))
_fp("online_bottom_right", "the causal mask is aligned bottom-right: j <= i + S_k - S_q",
    "This course aligns the causal mask top-left: query i sees keys j <= i, whatever S_q and S_k "
    "(FlashAttention aligns it bottom-right when S_q != S_k, so that the last query sees every key). "
    "The two agree when S_q == S_k; with S_q > S_k the bottom-right mask leaves the first rows with "
    "no key at all (0/0 = NaN). Mask with cols > rows, no offset.", kinds=("online_softmax",))
_fp("online_mask_reversed", "the causal comparison is reversed: the past is hidden, the future kept",
    "Query i sees keys j <= i: hide cols > rows. masked_fill(rows > cols, -inf) hides the keys *before* "
    "the query and keeps the later ones; a block whose every key lies before row i leaves that row "
    "with nothing (0/0 = NaN).", kinds=("online_softmax",))
_RESCALE = ("When the running maximum grows, everything summed so far was taken against the old maximum: "
            "both running sums, l and acc, must be multiplied by alpha = exp(m_old - m_new) before the new "
            "block is added ")
_fp("online_acc_not_rescaled", "acc is not rescaled by alpha: acc = acc + p V",
    _RESCALE + "(acc = acc * alpha + p V). Yours rescales l (the LSE is right) but not acc.",
    kinds=("online_softmax",))
_fp("online_l_not_rescaled", "l is not rescaled by alpha: l = l + rowsum(p)",
    _RESCALE + "(l = l * alpha + rowsum(p)). Yours rescales acc but not l.", kinds=("online_softmax",))
_fp("online_m_block", "m is set to the block's maximum, not kept as the running maximum",
    "m must be the maximum over *every* key seen so far: m = m_new = max(m, rowmax(s)). Set to this "
    "block's own maximum, it can fall, alpha = exp(m - m_new) then grows past 1, and a block with "
    "every key hidden gives m = -inf and NaN.", kinds=("online_softmax",))
_fp("online_l_unshifted", "l adds exp(s), not p = exp(s - m_new)",
    "l and acc must be sums of the same p = exp(s - m_new): l = l * alpha + rowsum(p). Adding "
    "rowsum(exp(s)) mixes unshifted exponentials (which may overflow) with sums taken against the "
    "running maximum, so O = acc / l and the LSE are off.", kinds=("online_softmax",))
_fp("online_block_softmax", "each block is normalised by its own softmax",
    "p = exp(s - m_new), unnormalised: the division happens once, at the end, by l -- the sum over "
    "*every* block, each rescaled by alpha. A softmax per block divides each block by its own sum, "
    "so every block weighs the same whatever its scores, and a block whose keys are all hidden "
    "gives 0/0 = NaN.", kinds=("online_softmax",))
_fp("online_block_max", "the new maximum is the block's maximum alone",
    "m_new = max(m_old, max of this block): the running maximum never decreases. Taken from the "
    "block alone, a block whose keys are all hidden (causal rows before the block starts) has "
    "m_new = -inf, and exp(s - m_new) = exp(-inf - -inf) is NaN.", kinds=("online_softmax",))
_fp("online_block_short", "each block drops its last key (a slice or range one short)",
    "Block n0 covers keys n0 ... n0 + block_n - 1: the slice is k[..., n0:n0 + block_n, :] (Python's "
    "end is exclusive), the same for V and for the mask's column indices.", kinds=("online_softmax",))
_fp("online_drop_partial", "the loop visits only full blocks: the last, partial block of keys is dropped",
    "range(0, S_k, block_n) starts a block at every multiple of block_n below S_k, the last one "
    "partial; a stop of S_k - block_n + 1 leaves that one out (and every key when S_k < block_n). "
    "Slicing k[..., n0:n0 + block_n] past the end is safe in PyTorch: it stops at S_k.",
    kinds=("online_softmax",))
_fp("online_l_rescales_new", "l = (l + rowsum(p)) * alpha: the new block's sum is rescaled too",
    "alpha = exp(m_old - m_new) converts what was summed *before* this block to the new maximum; "
    "this block's p is already taken against m_new. So l = l * alpha + rowsum(p): multiply first, "
    "then add (the same for acc).", kinds=("online_softmax",))
_fp("online_v_from_k", "the value block is sliced from k",
    "O = P V: each block's p multiplies that block of the *values*, vb = v[..., start:start + block_n, :]. "
    "Yours equals the loop with K in V's place.", kinds=("online_softmax",))
_fp("accumulated_into_other", "one gradient's product is added into the other's accumulator",
    "dV += P^T dO and dK += dS^T Q each go into their own accumulator: yours adds one of them into the "
    "other (dK's share into dv, say), so one output is zero and the other holds both.", kinds=("dkdv",))
_fp("online_alpha_on_new", "alpha multiplies the new block instead of the running sums",
    "alpha = exp(m_old - m_new) rescales what was accumulated *before* the maximum changed: "
    "l = l * alpha + rowsum(p), acc = acc * alpha + p V. Applied to the new block instead, the "
    "first block (where alpha = 0) is lost and one-block rows divide 0 by 0.", kinds=("online_softmax",))
_fp("lazy_ds_from_da", "dS is built from dA where dP = dA * gate belongs",
    "The softmax's Jacobian acts on the gradient that reaches P: dP = dA * gate (the ReLU's gate, "
    "causal entries only), then dS = P * (dP - delta). dA is the gradient of A, one step earlier.",
    kinds=("lazy",))
_fp("lazy_ds_from_a", "dS is built with A where the softmax's P belongs",
    "dS = P * (dP - delta) is the softmax's Jacobian applied to dP: it multiplies by the softmax "
    "output P. A = ReLU(P + tau/(i+1)) is the next step of the forward and enters only dV = A^T dO.",
    kinds=("lazy",))
_fp("lazy_gate_not_causal", "the ReLU's gate lacks the causal condition",
    "A = ReLU(P + tau/(i+1)) on the visible entries j <= i only: the gate that passes dA on to dP "
    "is causal AND (P + tau/(i+1) > 0). Without the causal part, the hidden entries (P = 0 there) "
    "pass whenever tau > 0, and their dA leaks into dTau.", kinds=("lazy",))
_fp("lazy_gate_c_column", "tau/(i+1) in the gate is lined up with the keys, not the queries",
    "c_i = tau / (i + 1) belongs to query row i: in an [L, L] tile it is a column vector, "
    "c[:, None], added to every key of row i. c[None, :] adds c_j, the key's, to column j.",
    kinds=("lazy",))
_fp("lazy_delta_from_da", "delta is built from dA where the gated dP belongs",
    "The softmax's Jacobian acts on the gradient that reaches P, dP = dA * gate: both dP and its "
    "row mean delta = rowsum(P * dP) use the gated dP. delta from the ungated dA counts the "
    "entries the ReLU cut off.", kinds=("lazy",))
_fp("lazy_dbias_from_dp", "dBias sums dP where dS belongs",
    "bias[d] is added to the scores S, before the softmax: its gradient is the gradient of S, "
    "dBias[d] = sum of dS along diagonal d. dP is the gradient after the softmax (of P).",
    kinds=("lazy",))
_fp("lazy_dbias_mean", "dBias averages each diagonal instead of summing it",
    "bias[d] enters every entry of diagonal d, so its gradient is the *sum* of dS over them: "
    ".sum(), not .mean() (a mean divides diagonal d by its L - d entries).", kinds=("lazy",))
_fp("lazy_gate_inverted", "the ReLU's gate is inverted: dA passes where the ReLU cut it off",
    "dP = dA * gate with gate = causal & (P + tau/(i+1) > 0): dA reaches P only where the ReLU "
    "passed its input. masked_fill(gate, 0) zeroes exactly those entries: fill where the gate is "
    "False (masked_fill(~gate, 0), or multiply by the gate).", kinds=("lazy",))
_fp("lazy_dbias_shifted", "dBias reads the diagonals one further: d + 1 where d belongs",
    "bias[d] sits on diagonal d = i - j, for d = 0 ... W: dBias[d] = sum of dS along diagonal d "
    "(torch.diagonal(dS, offset=-d)), over range(W + 1). A range that starts at 1 shifts every "
    "entry by one diagonal.", kinds=("lazy",))
_DTAU_BROADCAST = ("tau/(i+1) belongs to query row i: divide each *row* sum of dP, dP.sum(-1), by i + 1. Two "
                   "slips give the same wrong numbers, column j divided by j + 1: a vector of length L broadcast "
                   "along the last axis (dP / (i + 1)), and the column sums dP.sum(0) divided by i + 1.")


@rule("lazy_dtau_broadcast", "dTau divides by the key's position, not the query row's", _DTAU_BROADCAST,
      kinds=("lazy",))
def _dtau_broadcast(ctx):
    from .code_rules import _first_line
    evidence = _fingerprint_test("lazy_dtau_broadcast")(ctx)
    column_sums = evidence and _first_line(ctx, lambda c: re.search(
        r"\.sum\(\s*(?:dim\s*=\s*|axis\s*=\s*)?(?:0|-2)\s*\)", c) and "tau" in c.lower())
    if not column_sums:
        return evidence
    return (f"`{column_sums}`; {evidence}",
            "`.sum(0)` sums dP over the query rows: one sum per *key* j, which the division by i + 1 then "
            "gives key j's 1/(j + 1). tau/(i+1) belongs to query row i: divide each *row* sum, "
            "dP.sum(-1) (or dim=1), by i + 1, then add the rows up.")
_fp("lazy_delta_scalar", "delta is one number for the whole head: summed over every row too",
    "delta_i = rowsum(P * dP)_i, one number per query row: (P * dP).sum(-1, keepdim=True). A .sum() "
    "over everything subtracts the head's total from every entry of dP.", kinds=("lazy",))
_fp("lazy_ds_gated", "the ReLU's gate is applied to dS too",
    "The gate belongs to dP = dA * gate only. dS = P * (dP - delta) then runs the softmax's Jacobian, "
    "whose - P * delta term reaches every visible entry, clipped by the ReLU or not: multiplying dS by "
    "the gate again drops that term where the ReLU clipped.", kinds=("lazy",))
_fp("lazy_dp_modified", "dP is changed in place before dTau reads it",
    "dP.sub_(delta) (or -=) writes dP - delta into dP itself: dS comes out right, but dTau = "
    "sum_i rowsum(dP)_i / (i + 1), computed afterwards, now sums dP - delta. Compute dP - delta into a "
    "new tensor (dP - delta), leaving dP as it is.", kinds=("lazy",))
_fp("lazy_dtau_floor", "dTau divides with //: floor division rounds each row down",
    "x // n is floor division: on floats it rounds every quotient down to a whole number. dTau's "
    "1/(i+1) is a true division, /.", kinds=("lazy",))
_fp("lazy_dbias_last_zero", "dBias' last entry (d = W) is 0: its guard stops one diagonal early",
    "bias[d] for d = 0 ... W sits on diagonal d of dS; the guard only skips diagonals past the matrix "
    "(d >= L). A guard d < W leaves the last diagonal, d = W, at 0.", kinds=("lazy",))
_fp("lazy_dbias_corner_zero", "dBias misses the last diagonal, d = L - 1: its guard stops one early",
    "Diagonal d = i - j of an L x L matrix exists for d = 0 ... L - 1; the last, d = L - 1, is the one "
    "entry dS[L - 1, 0]. A guard d < L - 1 (or range(L - 1)) leaves it out: dBias[L - 1] stays 0 whenever "
    "W >= L - 1. The guard is d < L.", kinds=("lazy",))
_fp("lazy_dtau_times_tau", "dTau is tau times too large: c = tau / (i + 1) where 1 / (i + 1) belongs",
    "c_i = tau / (i + 1), so dc_i / dtau = 1 / (i + 1): dTau = sum_i rowsum(dP)_i / (i + 1). Multiplying "
    "by c itself keeps a factor tau (and gives 0 at tau = 0).", kinds=("lazy",))
_fp("lazy_dbias_cumulative", "dBias[d] sums every diagonal from d on, not diagonal d alone",
    "bias[d] sits on diagonal d = i - j only: dBias[d] = torch.diagonal(dS, offset=-d).sum(). "
    "torch.tril(dS, -d).sum() adds every entry on or below that diagonal -- diagonals d, d + 1, ...", kinds=("lazy",))
_fp("lazy_dbias_clamped", "dBias[W] also collects the diagonals past W: distances clamped, not skipped",
    "bias[d] is used only for d = i - j <= W; farther pairs get no bias at all, so their dS belongs to no "
    "dBias entry. Clamping the distance (dist.clamp(max=W), as a lookup bias[min(d, W)] does) without "
    "the d <= W guard adds every diagonal past W into dBias[W].", kinds=("lazy",))
_fp("lazy_gate_causal_transposed", "the gate's causal mask is transposed: j >= i where j <= i belongs",
    "Query i sees keys j <= i: the causal mask is i[None, :] <= i[:, None] (row index i down the "
    "rows, key index j along the columns), the lower triangle. i[:, None] <= i[None, :] is the "
    "upper triangle: the gate lets dA through at the hidden future entries and cuts it at the "
    "visible past ones.", kinds=("lazy",))
_fp("lazy_gate_sign", "the gate tests P - tau/(i+1) > 0: a sign slip",
    "The ReLU's input is P + tau/(i+1) (the forward adds c = tau/(i+1) to P): gate = causal & "
    "(P + c > 0). With P - c the gate is wrong wherever 0 < P < c or -c < P < 0, that is "
    "wherever tau is not 0.", kinds=("lazy",))
_fp("lazy_positions_one_based", "the positions start at 1: tau/(i+2) where tau/(i+1) belongs",
    "The formulas count the query row's keys as i + 1 with i = 0 ... L - 1 (torch.arange(L)). "
    "Positions 1 ... L with the same + 1 divide by i + 2: both c = tau/(i+1) in the gate and "
    "dTau's 1/(i+1) are off. Either 0-based positions, or drop the + 1.", kinds=("lazy",))
_fp("lazy_p_a_swapped", "P and A trade places: the forward's results are unpacked in the wrong order",
    "forward_one_head returns (P, A, O): P the softmax, A the ReLU's output. Unpacked as (A, P, O), "
    "dV = A^T dO gets P, the gate tests the ReLU's output and dS = P * (dP - delta) uses A: "
    "unpack in the order the function returns.", kinds=("lazy",))
_fp("lazy_delta_columns", "delta lines up with the keys: a row vector where a column belongs",
    "delta_i = rowsum(P * dP)_i belongs to query row i: a column [L, 1], .sum(-1, keepdim=True). A "
    "vector of length L (the sum without keepdim) or a row [1, L] (the column transposed, .T) "
    "broadcasts along the last axis: dP - delta subtracts delta_j from column j.", kinds=("lazy",))
_fp("lazy_dk_operand_k", "dK is dS^T K: K where Q belongs",
    "dK = dS^T Q * scale: key j collects dS[i, j] times the *query* q_i over the rows i (S = Q K^T, "
    "so the derivative by K brings Q).", kinds=("lazy",))
_fp("lazy_dbias_from_da", "dBias sums dA where dS belongs",
    "bias is added to the scores S before the softmax, so its gradient is dS's: dBias[d] = the sum "
    "of dS along diagonal d. dA is the gradient before the ReLU's gate and the softmax's Jacobian.",
    kinds=("lazy",))


@rule("accumulate", "only the last block's contribution survives: accumulate, don't overwrite",
      "A program sums its output over every block it visits: dQ over the key blocks, dK and dV "
      "over the query blocks. `acc += tl.dot(...)` inside the loop, one store after it; `acc = ...` "
      "or a store of the tile's share inside the loop keeps only the last block.",
      kinds=("dq", "dkdv"))
def _accumulate(ctx):
    hits = [r for r in ctx.failing if any(f.startswith("last_block") for f in r.fingerprints)]
    if hits and len(hits) == len(ctx.failing):
        block = sorted(f for f in hits[0].fingerprints if f.startswith("last_block"))[0].split("_")[-1]
        return (f"your outputs equal the last block's share alone (blocks of {block}) in every "
                f"failing case; {ctx.case_pattern()}")
    return None


_fp("overcount", "too large by whole factors: several threads add the same value into one address",
    "Every element is a whole multiple of the reference (1x, 2x, ...), many of them 2x or more: "
    "the same contribution was added more than once. Several threads (or programs) were mapped to "
    "the same output indices and each added the whole value -- a loop that steps by 1 where it "
    "should step by the number of threads sharing the work, or that ignores the thread's own "
    "index. The factor follows the block shape. Give each thread unique indices: every output "
    "element owned by exactly one thread, which accumulates it and stores it once.")


@rule("wrong_argument", "one tensor is used in another's place",
      "Your outputs equal the backward computed with one tensor replaced by another of the same "
      "shape -- in one product, or as one argument of a call (named in the evidence). Each "
      "product has fixed operands: S = Q K^T * scale, dP = dO V^T, dQ = dS K * scale, dK = dS^T Q "
      "* scale, dV = P^T dO; compare each call with the signature, argument by argument.",
      kinds=("backward", "dq", "dkdv", "autograd"))
def _wrong_argument(ctx):
    from .substitutions import possible
    labels = {f for r in ctx.failing for f in r.fingerprints if f.startswith("subst:") and " scale in place" not in f}
    best = None
    for label in sorted(labels):
        where = [r for r in ctx.failing if possible(r.case, label[6:])]
        hits = [r for r in where if label in r.fingerprints]
        # every failing case where the swap can happen matches it (elsewhere shapes differ, so
        # the same code may do anything there), and at least two do
        if len(hits) >= 2 and len(hits) == len(where) and (best is None or len(hits) > best[0]):
            best = (len(hits), label[6:], len(ctx.failing) - len(where))
    if best is None:
        return None
    n, label, other = best
    rest = f" (in the other {other} the two tensors' shapes differ)" if other else ""
    return f"yours: {label}, exactly, in {n} of {len(ctx.failing)} failing cases{rest}; {ctx.tensor_pattern()}"


@rule("scaled_statistic", "the LSE or delta carries the scale once more",
      "The scale belongs once, on the scores: S = Q K^T * scale, and so on dQ and dK. The LSE "
      "(the log of the scaled scores' row sums) and delta = rowsum(dO * O) are made from what "
      "already carries it: multiplied (or divided) by the scale again, P = exp(S - LSE) or dS = P * "
      "(dP - delta) comes out wrong. Find where that vector is made or passed on, and drop the factor.",
      kinds=("backward", "dq", "dkdv", "autograd"))
def _scaled_statistic(ctx):
    common = in_every_failing_case(ctx, "subst:", lambda f: " scale in place" in f)
    if not common or len(ctx.failing) < 2:
        return None
    label = sorted(common)[0]
    return f"yours: {label[6:]}, exactly, in {len(ctx.failing)} of {len(ctx.failing)} failing cases; {ctx.tensor_pattern()}"


@rule("lazy_wrong_operand", "one tensor of the lazy backward is used in another's place",
      "Each step of the lazy backward has fixed operands: dV = A^T dO (A, the ReLU's output), dA = dO V^T, "
      "gate = causal & (P + c > 0), dP = dA * gate, delta = rowsum(P * dP), dS = P * (dP - delta), "
      "dQ = dS K * scale, dK = dS^T Q * scale, dBias from dS's diagonals, dTau from dP's row sums. "
      "Your outputs equal the chain with one of them replaced (named in the evidence): compare that "
      "line with its formula.", kinds=("lazy",))
def _lazy_wrong_operand(ctx):
    common = in_every_failing_case(ctx, "lazy_subst:")
    if not common:
        return None
    label = min(sorted(common), key=len)
    return (f"yours: the formula with {label.split(':', 1)[1]}, exactly, in all {len(ctx.failing)} failing "
            f"cases; {ctx.tensor_pattern()}")
