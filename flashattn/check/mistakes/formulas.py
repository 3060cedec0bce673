"""Stage "a known wrong formula": the learner's outputs equal, to rounding, what a known wrong
computation gives on the same inputs (:mod:`flashattn.check.fingerprints` computes them in float64)
-- dS without delta, an unscaled or doubly scaled score, exp2, the LSE or delta lined up with the
keys, every wrong causal mask, a loop one block short, a tile transposed again, one operand or
argument in another's place, a wrong scale value. After the memory mistakes, before NaN, constant
factors and the case patterns.
"""
from __future__ import annotations

from ..engine import FORMULA, mistake
from ..evidence import in_every_failing_case, matches


mistake("delta", FORMULA, "dS is missing the - delta term",
        "dS = P * (dP - delta): the softmax Jacobian subtracts, from each row of dP, its P-weighted "
        "mean delta = rowsum(P * dP) = rowsum(dO * O) -- one number per query row.", test=matches("no_delta"),
        proof="planted/dq.no_delta")


mistake("softmax_axis", FORMULA, "the softmax runs over the wrong axis",
        "P's rows must sum to 1 over the keys: softmax over the last dimension (the keys), not over "
        "the queries.", test=matches("softmax_axis"), proof="blind/u/U01_softmax_dim_rows")


mistake("scale_in_scores", FORMULA, "P is rebuilt from scores without the scale",
        "S = Q K^T * scale in the forward, so P = exp(S - LSE) must be rebuilt from the *scaled* "
        "scores -- the same S as the forward, or LSE does not match it. Check every place the scale "
        "enters: the scores that rebuild P, and the one factor in dQ and dK.", test=matches("unscaled_s"),
        proof="slips/02p/scale_in_scores")


mistake("lse", FORMULA, "P rebuilt with exp2 from a natural-log LSE",
        "The forward's LSE is a natural log: rebuild P = exp(S - LSE). exp2 works only if both S and "
        "LSE are converted to base 2 (multiplied by log2(e)).", test=matches("exp2"), proof="planted/dq.exp2")


mistake("lse_broadcast", FORMULA, "the LSE is lined up with the keys instead of the query rows",
        "LSE holds one number per query row: subtract it from every key of its row -- broadcast along "
        "the key axis of the tile (a column in the [query, key] orientation, a row in the transposed "
        "[key, query] one).", test=matches("lse_broadcast"), proof="planted/dq.lse_as_row")


mistake("delta_broadcast", FORMULA, "delta is lined up with the keys instead of the query rows",
        "delta holds one number per query row: dS = P * (dP - delta) subtracts it from every key of "
        "its row -- broadcast along the key axis of the tile.", test=matches("delta_broadcast"),
        proof="planted/dq.delta_as_row")


mistake("dp_operand", FORMULA, "dP is computed from the wrong tensor",
        "dP = dO V^T: the output's gradient meets the *values* (O = P V), not the keys.", test=matches("dp_operand"),
        proof="planted/dq.dp_from_k")


@mistake("loop_one_block_short", FORMULA, "the loop stops one block early: its last block is never visited",
         "range(start, end, BLOCK) already stops before end, and its last block may be partial (the "
         "masks handle that). A stop of end - BLOCK leaves the last block out: for dQ the key block with "
         "the diagonal (causal) or the last keys, for dK/dV the last query block.",
         proof="slips/03/loop_one_block_short")
def _loop_one_block_short(ctx):
    # where S_q < S_k only, a key loop bounded by S_q drops blocks the same way: keys_bound names that
    if any(r.case.S_q >= r.case.S_k for r in ctx.failing):
        return matches("loop_one_block_short")(ctx)
    return None


mistake("ds_missing_p", FORMULA, "dS is missing its factor P",
        "dS = P * (dP - delta): the softmax's Jacobian multiplies by P elementwise, which is also "
        "what keeps hidden and padded keys at 0.", test=matches("ds_no_p"), proof="planted/dq.ds_without_p")


mistake("delta_mean", FORMULA, "delta is a mean over the head dimension, not a sum",
        "delta = rowsum(dO * O) = sum over the D features of dO * O, one number per query row. "
        "A mean divides it by D (here every dQ and dK equals the backward with delta / D): use "
        ".sum(-1, keepdim=True), not .mean(-1).", test=matches("delta_mean"), proof="blind/s/S01_delta_mean")


mistake("delta_scalar", FORMULA, "delta is one number for everything, not one per query row",
        "delta_i = rowsum(dO * O)_i belongs to query row i (and to its batch element and head): sum "
        "over the last dimension only, keeping it, (do * o).sum(-1, keepdim=True). A .sum() over "
        "every dimension subtracts the same total from every row.", test=matches("delta_scalar"),
        proof="example/attention_backward/make_backward(delta_scalar)")


mistake("ds_from_s", FORMULA, "dS is built from the scores S where P belongs",
        "dS = P * (dP - delta): the softmax's Jacobian multiplies by the probabilities P, not by the "
        "scores S they came from (S is -inf at hidden keys: -inf times anything is inf or NaN).",
        test=matches("ds_from_s"), proof="slips/01/ds_from_s")


mistake("log_softmax", FORMULA, "P is log_softmax(S): log-probabilities where the probabilities belong",
        "torch.log_softmax returns log P (negative, -inf at hidden keys). Attention weights the values by "
        "P itself: torch.softmax(S, dim=-1).", test=matches("log_softmax"), proof="slips/01/log_softmax")


mistake("delta_per_head", FORMULA, "delta is one number per head, summed over the query rows too",
        "delta_i = rowsum(dO * O)_i belongs to query row i: sum over the last dimension (the D "
        "features) only, (do * o).sum(-1, keepdim=True). Summing over (-2, -1) adds every row of the "
        "head together and subtracts that total from each row of dP.", test=matches("delta_per_head"),
        proof="slips/01/delta_per_head")


mistake("ds_diagonal", FORMULA, "dS = P (1 - P) dP: only the diagonal of the softmax's Jacobian",
        "dP_ij reaches S_ij and every other S_ik of its row: the softmax's Jacobian is "
        "dP_i/dS_ik = P_ij (1[j = k] - P_ik). The diagonal alone gives P (1 - P) dP; the whole "
        "Jacobian gives dS = P * (dP - delta), delta_i = sum_j P_ij dP_ij.", test=matches("ds_diagonal"),
        proof="example/attention_backward/make_backward(ds_diagonal)")


# the causal mask gone wrong, told apart by what each wrong mask computes
@mistake("no_mask", FORMULA, "the causal mask is missing: hidden keys (j > i) get weight",
         "Under a causal mask query i sees keys j <= i only. The hidden scores must be -inf before the "
         "softmax (or P = 0 there when P is rebuilt from the LSE); without it every key counts. A mask "
         "that is there but has no effect is the same bug: masked_fill returns a new tensor (S = "
         "S.masked_fill(...), not S.masked_fill(...) alone). (If the function under test is a "
         "reference you wrote to test a kernel, the bug is in the test: test the test.)", proof="slips/04/no_mask")
def _no_mask(ctx):
    evidence = matches("no_mask")(ctx)
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


@mistake("causal_inverted", FORMULA, "the causal test is inverted: the mask is applied exactly when causal is False",
         "Every causal case is computed without the mask and every non-causal one with it: the condition "
         "that guards the mask says the opposite of causal (`if not causal:`, or the flag negated on its "
         "way). Mask when causal is True, only then.", proof="slips/02p/causal_inverted")
def _causal_inverted(ctx):
    causal = [r for r in ctx.failing if r.case.causal]
    plain = [r for r in ctx.failing if not r.case.causal]
    if causal and plain and all("no_mask" in r.fingerprints for r in causal) and \
            all("mask_applied" in r.fingerprints for r in plain):
        return (f"the {len(causal)} causal cases match attention without the mask, the {len(plain)} "
                f"non-causal ones attention with it; {ctx.tensor_pattern()}")
    return None


mistake("backward_not_causal", FORMULA, "the backward runs without the causal mask",
        "The forward is right (O matches) but the gradients are those of P rebuilt over every key: "
        "the causal flag does not reach the backward kernels. Save it in ctx in forward and pass "
        "ctx.causal on to both backward kernels.", test=matches("backward_not_causal"),
        proof="blind/s/S05_dq_not_causal")


mistake("forward_not_causal", FORMULA, "the forward runs without the causal mask",
        "O equals attention over every key: the causal flag does not reach the forward kernel (and "
        "the LSE and O it saves for the backward are those of unmasked attention too).",
        test=matches("forward_not_causal"), proof="blind/s/S05_forward_not_causal")


mistake("lse_unmasked", FORMULA, "the backward's LSE is not the forward's: recomputed without the mask",
        "P = exp(S - LSE) is exact only with the forward's own LSE, which was taken over the visible "
        "keys. Save the forward's LSE and use it; an LSE recomputed over every key (no causal mask) "
        "makes every causal row's P too small.", test=matches("lse_unmasked"),
        proof="example/autograd_function/make_function(lse_no_mask)")


mistake("mask_inverted", FORMULA, "the causal mask is inverted: visible keys hidden, hidden keys shown",
        "The mask marks what to hide: keys j > i get -inf (or P = 0), keys j <= i keep their score. "
        "Here it is the other way round (a `~` too many or too few).", test=matches("mask_inverted"),
        proof="blind/s/S02p_mask_inverted")


mistake("mask_zero", FORMULA, "hidden scores are set to 0 instead of -inf",
        "A hidden key must get weight exactly 0: its score -inf before the exponential. A score of "
        "0 gives exp(0 - LSE) > 0, so hidden keys still count.", test=matches("mask_zero"),
        proof="planted/dq.causal_mask_on_S_with_0")


mistake("mask_after_softmax", FORMULA, "the causal mask is applied after the softmax",
        "The softmax must see the mask: scores of hidden keys -inf *before* it, so each row sums to 1 "
        "over its visible keys. Zeroing P afterwards leaves rows that sum to less than 1. (Only P "
        "rebuilt from the forward's LSE may be masked afterwards: the LSE already saw the mask.)",
        test=matches("mask_after_softmax"), proof="blind/s/S01_mask_after_softmax")


mistake("mask_strict", FORMULA, "the causal mask hides the diagonal: j < i where j <= i belongs",
        "A query sees its own key: visible is j <= i. With j < i row 0 sees nothing and every row "
        "loses its diagonal term.", test=matches("mask_strict"), proof="planted/dq.causal_strict")


mistake("mask_shifted", FORMULA, "the causal mask is off by one: query i also sees key i + 1",
        "Visible keys are j <= i, the diagonal included and nothing beyond: tril(ones) with diagonal=0, "
        "or hidden = j > i. One more (tril(diagonal=1), j <= i + 1, j < i + 2) lets each query see the "
        "next key.", test=matches("mask_shifted"), proof="slips/02p/mask_shifted")


mistake("p_hidden_neg_inf", FORMULA, "the hidden entries of P are -inf: -inf belongs on S, 0 on P",
        "A hidden key gets S = -inf *before* the exponential (exp(-inf) = 0), or P = 0 after it. Filling "
        "P itself with -inf puts -inf into every product that uses it.", test=matches("p_hidden_neg_inf"),
        proof="slips/02p/p_hidden_neg_inf")


mistake("mask_ge", FORMULA, "the causal mask points the wrong way: keys j >= i kept",
        "Visible keys are those at or before the query, j <= i. In a [key, query] tile that reads "
        "key <= query, i.e. offs_n[:, None] <= offs_m[None, :]. (tril and triu: the hidden keys are "
        "triu(ones, diagonal=1), the strictly upper triangle.)", test=matches("mask_ge"),
        proof="planted/dkdv.causal_ge")


mistake("mask_bottom_right", FORMULA, "the causal mask is aligned bottom-right: j <= i + S_k - S_q",
        "This course aligns the causal mask top-left: query i sees keys j <= i, whatever S_q and S_k "
        "(FlashAttention aligns it bottom-right when S_q != S_k: the last query sees every key). The "
        "two agree when S_q == S_k; with S_q > S_k the bottom-right mask leaves the first rows with no "
        "key at all (NaN), with S_q < S_k it shows keys j > i.", test=matches("mask_bottom_right"),
        proof="blind/r/R02p_mask_bottom_right")


mistake("only_diagonal_tile", FORMULA, "the loop visits the diagonal tile only",
        "Under a causal mask a query block sees every key block up to and including its diagonal "
        "one: dQ's key loop runs from 0 to the end of the query block (not from the block's own "
        "start); dK/dV's query loop runs from the key block's own tile to S_q. Yours visits the "
        "diagonal tile alone (a mask transposed inside the tile would hide the other tiles the same "
        "way: check the loop's bounds first).", test=matches("only_diagonal_tile"),
        proof="planted/dq.loop_from_diagonal")


mistake("mask_tile_transposed", FORMULA, "the causal mask is transposed inside the tile",
        "The mask must have the tile's orientation: in a [query, key] tile the query index runs down "
        "the rows and the key index along the columns (in a [key, query] tile the other way round). "
        "A mask built in the other orientation still broadcasts on a square tile, but compares the "
        "wrong pairs.", test=matches("mask_tile_transposed"), proof="planted/dq.causal_mask_transposed")


mistake("diag_tile_skipped", FORMULA, "the loop skips the diagonal tile",
        "Under a causal mask the tile on the diagonal is half visible: the loop must include it (the "
        "keys up to the end of the query block for dQ; the query blocks from the key block's own "
        "on for dK/dV) and mask inside it.", test=matches("diag_tile_skipped"), proof="planted/dq.short_causal_loop")


mistake("scale_divided", FORMULA, "the scores are divided by the scale",
        "scale is already 1/sqrt(D): S = Q K^T * scale. Dividing by it multiplies by sqrt(D).",
        test=matches("scale_divided"), proof="blind/s/S01_scale_divided")


mistake("softmax_unnormalised", FORMULA, "P is exp(S - max) without the division by the row sum",
        "A stable softmax subtracts the row's maximum *and* divides by the row's sum: P = exp(S - m) / "
        "sum_j exp(S_j - m). Without the division the rows do not sum to 1 (torch.softmax does both; or "
        "rebuild P = exp(S - LSE), where the LSE holds the normaliser already).",
        test=matches("softmax_unnormalised"), proof="slips/01/softmax_unnormalised")


mistake("scale_twice", FORMULA, "the scores carry the scale twice (scale^2)",
        "S = Q K^T * scale, once: scaling q and k both, or multiplying a score that already carries "
        "the scale again (in the exponent, say), gives scale^2, and the LSE -- computed with one scale "
        "-- no longer normalises it. Follow the scale from the product to the exponential.",
        test=matches("scale_twice"), proof="slips/01/scale_twice")


mistake("dp_scaled", FORMULA, "dP carries the scale",
        "dP = dO V^T has no scale: the scale enters the scores (S = Q K^T * scale) and so, by the chain "
        "rule, dQ = dS K * scale and dK = dS^T Q * scale -- once each, after dS. A scale on dP goes "
        "through dS = P * (dP - delta) unevenly (delta has none) and is not a plain factor.",
        test=matches("dp_scaled"), proof="slips/01/dp_scaled")


@mistake("causal_bounds_unguarded", FORMULA, "the causal loop bounds are applied without the causal mask",
         "The shortened loop (dQ: keys only up to the end of the query block; dK/dV: query blocks from the "
         "key block's diagonal on) is right only under the causal mask. Without it every key sees every "
         "query: compute the bound inside `if CAUSAL:` and keep the full range otherwise.",
         proof="slips/04/causal_bounds_unguarded")
def _causal_bounds_unguarded(ctx):
    # with one query block the dQ loop's causal bound reaches the same keys as a loop run to S_q:
    # at least one failing case must tell the two apart
    if not any("causal_bounds_unguarded" in r.fingerprints and "key_loop_to_sq" not in r.fingerprints
               for r in ctx.failing):
        return None
    return matches("causal_bounds_unguarded")(ctx)


mistake("scale_in_loop", FORMULA, "the final factor scale is applied inside the loop",
        "dQ = (sum over key blocks of dS K) * scale: the factor is applied once, after the loop (or to "
        "each block's share as it is added). Inside the loop, acc = acc * scale multiplies everything "
        "accumulated so far again at every iteration: the first blocks carry scale^2, scale^3, ... "
        "Only one-block rows come out right.", test=matches("scale_in_loop"), proof="slips/03/scale_in_loop")


mistake("tile_transposed_again", FORMULA, "a tile is transposed once more in a product",
        "In the dK/dV kernel the tiles are already transposed (pT, dsT are [BLOCK_N, BLOCK_M]): dV += "
        "tl.dot(pT, do) and dK += tl.dot(dsT, q) as they are. In the dQ kernel ds is [BLOCK_M, BLOCK_N]: "
        "dQ += tl.dot(ds, k). An extra tl.trans still runs when BLOCK_M == BLOCK_N, and reads each tile "
        "across its diagonal.", test=matches("tile_transposed_again"), proof="slips/04/tile_transposed_again")


mistake("lse_divided", FORMULA, "P = exp(S) / LSE: the LSE is a logarithm",
        "LSE = log(sum exp(S)), so the softmax is exp(S) / exp(LSE) = exp(S - LSE): subtract the LSE "
        "inside the exponential, never divide by it.", test=matches("lse_divided"), proof="blind/s/S02p_lse_divided")


mistake("exp2_lse", FORMULA, "S is converted to base 2, the LSE is still a natural log",
        "exp2 needs both sides of the difference in base 2: exp(S - LSE) = exp2((S - LSE) * log2(e)). "
        "The forward's LSE is a natural log: multiply it by log2(e) too, or use exp.", test=matches("exp2_lse"),
        proof="example/rebuild_p/make_rebuild_p(exp2_lse)")


mistake("p_sign", FORMULA, "P = exp(LSE - S): the subtraction is the wrong way round",
        "P = exp(S - LSE) is at most 1 (S <= LSE in every row); exp(LSE - S) is its reciprocal, above "
        "1 everywhere and inf on the hidden keys, where S = -inf.", test=matches("p_sign"),
        proof="example/rebuild_p/make_rebuild_p(p_sign)")


mistake("log_p", FORMULA, "the exponential is missing: you return S - LSE = log P",
        "S - LSE is the log of the softmax (negative, -inf on hidden keys); P is its exponential, "
        "exp(S - LSE), between 0 and 1.", test=matches("log_p"), proof="blind/s/S02p_returns_log_p")


mistake("lse_added", FORMULA, "P = exp(S + LSE): the LSE is subtracted",
        "softmax(S) = exp(S) / exp(LSE) = exp(S - LSE).", test=matches("lse_added"), proof="slips/04/lse_added")


mistake("scale_on_difference", FORMULA, "the LSE is multiplied by the scale: exp(S - LSE * scale)",
        "The LSE belongs to the scaled scores already: S = Q K^T * scale, then P = exp(S - LSE), the LSE as "
        "it is. Multiplying it by the scale -- lse * scale, or (Q K^T - LSE) * scale, which is the same -- "
        "treats it as if it were in unscaled units.", test=matches("scale_on_difference"),
        proof="slips/02p/scale_on_difference")


@mistake("wrong_operand", FORMULA, "a product uses the wrong operand",
         "Each gradient is one product with fixed operands: dQ = dS K * scale, dK = dS^T Q * scale, "
         "dV = P^T dO, and dP = dO V^T. Your output equals the same product with another tensor of "
         "the same shape in one place (named in the evidence).", proof="slips/01/wrong_operand")
def _wrong_operand(ctx):
    if not ctx.failing:
        return None
    common = set.intersection(*({f for f in r.fingerprints if f.startswith("operand:")} for r in ctx.failing))
    if not common:
        return None
    formula = sorted(common)[0].split(":", 1)[1]
    return f"in all {len(ctx.failing)} failing cases yours equals {formula}; {ctx.tensor_pattern()}"


mistake("lse_delta_swapped", FORMULA, "LSE and delta are passed in each other's place",
        "Your outputs match a kernel that rebuilt P = exp(S - delta) and subtracted the LSE in dS: "
        "the two per-row vectors arrive in swapped arguments. Compare the call with the kernel's "
        "signature, argument by argument.", test=matches("lse_delta_swapped"), proof="blind/s/S05_lse_delta_swapped")


mistake("delta_is_lse", FORMULA, "delta is the LSE: dS subtracts the wrong per-row vector",
        "delta = rowsum(dO * O), one number per query row, computed by the delta kernel; the LSE is "
        "the other per-row vector, and it belongs in P = exp(S - LSE) only. Check which pointer, "
        "argument or load delta comes from.", test=matches("delta_is_lse"), proof="planted/dq.delta_from_lse")


mistake("delta_rowsum_dp", FORMULA, "delta = rowsum(dP): the product with P (or dO * O) is missing",
        "delta is the P-weighted mean of dP's row: rowsum(P * dP), which equals rowsum(dO * O). "
        "rowsum(dP) alone weighs every key the same.", test=matches("delta_rowsum_dp"),
        proof="example/attention_backward/make_backward(delta_rowsum_dp)")


mistake("kv_swapped", FORMULA, "K and V are passed in each other's place",
        "Your dQ equals a kernel that got V where K belongs and K where V belongs: the scores then "
        "come from V and dP from K. Compare the call with the kernel's signature, argument by argument.",
        test=matches("kv_swapped"), proof="example/autograd_function/make_function(kv_swapped)")


mistake("dp_tile_transposed", FORMULA, "the dP tile has the other orientation than the P tile it meets",
        "dP must have P's orientation: a dQ program works on [query, key] tiles, dP = dO V^T; a "
        "dK/dV program on [key, query] tiles, dP^T = V dO^T. The other product fits the shape on "
        "square tiles and puts every value in its mirror position.", test=matches("dp_tile_transposed"),
        proof="planted/dq.dp_transposed")


mistake("query_block_from_pid", FORMULA, "the query block comes from the program id, not from the loop",
        "A key-block program loops over the query blocks: the rows it loads in each iteration must "
        "follow the loop variable (start_m + arange), not the program id. Here every iteration "
        "loaded the same query block again.", test=matches("query_block_from_pid"),
        proof="planted/dkdv.query_tile_from_pid")


mistake("gqa_last_head", FORMULA, "only the last query head of each group reaches dK and dV",
        "The accumulators of a K/V head sum over every query head of its group and every query "
        "block: set them to zero once, before the loop over the group, not inside it.", test=matches("gqa_last_head"),
        proof="blind/u/U04_acc_reset_per_head")


mistake("gqa_one_head", FORMULA, "only the first query head of each group reaches dK and dV",
        "With GQA, K/V head h_kv is shared by GROUP_SIZE query heads: its dK and dV sum the "
        "contributions of all of them (loop g over the whole group).", test=matches("gqa_one_head"),
        proof="example/dkdv_kernel/planted dkdv.gqa_first_head_only (GQA)")


mistake("ds_precedence", FORMULA, "dS = P * dP - delta: the parentheses are missing",
        "delta is subtracted from dP *before* the product with P: dS = P * (dP - delta). Without the "
        "parentheses the product binds first, and every key -- hidden ones too -- gets -delta.",
        test=matches("ds_precedence"), proof="planted/dq.ds_precedence")


mistake("exp_minus_lse", FORMULA, "P = exp(S) - LSE: the LSE is subtracted outside the exponential",
        "The LSE divides: P = exp(S) / exp(LSE) = exp(S - LSE), the subtraction *inside* the "
        "exponential.", test=matches("exp_minus_lse"), proof="planted/dq.exp_minus_lse")


mistake("exp_difference", FORMULA, "P = exp(S) - exp(LSE): a difference where a quotient belongs",
        "exp(S - LSE) = exp(S) / exp(LSE): subtracting in the exponent divides after it. Keep the "
        "subtraction inside one exponential, torch.exp(S - lse[..., None]) (exp(S) alone also "
        "overflows for large scores, which is why the LSE is subtracted first).", test=matches("exp_difference"),
        proof="slips/02p/exp_difference")


mistake("p_max_and_lse", FORMULA, "P is exp(S - rowmax - LSE): the row's maximum is subtracted on top of the LSE",
        "The LSE already holds the maximum: LSE = max + log(sum_j exp(S_j - max)). P = exp(S - LSE) "
        "needs nothing else; subtracting the maximum too divides every row by exp(max).",
        test=matches("p_max_and_lse"), proof="slips/02p/p_max_and_lse")


mistake("p_max_not_lse", FORMULA, "P is exp(S - rowmax): the row's maximum where the LSE belongs",
        "exp(S - max) is only the numerator of a stable softmax: its rows sum to more than 1. The LSE "
        "is max + log(sum_j exp(S_j - max)), the maximum *and* the normaliser in one number, so "
        "P = exp(S - LSE) with the forward's LSE needs no maximum at all.", test=matches("p_max_not_lse"),
        proof="slips/02p/p_max_not_lse")


@mistake("scale_value", FORMULA, "the scale used is not the one given",
         "Use the `scale` argument everywhere (the scores and the factor in dQ and dK); when it has to "
         "be defaulted, the default is 1/sqrt(D), not 1/D. The evidence's computation used another value.",
         proof="slips/05/scale_value")
def _scale_value(ctx):
    evidence = matches("scale_value")(ctx)
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


mistake("accumulated_into_other", FORMULA, "one gradient's product is added into the other's accumulator",
        "dV += P^T dO and dK += dS^T Q each go into their own accumulator: yours adds one of them into the "
        "other (dK's share into dv, say), so one output is zero and the other holds both.",
        test=matches("accumulated_into_other"), proof="slips/04/accumulated_into_other")


@mistake("accumulate", FORMULA, "only the last block's contribution survives: accumulate, don't overwrite",
         "A program sums its output over every block it visits: dQ over the key blocks, dK and dV "
         "over the query blocks. `acc += tl.dot(...)` inside the loop, one store after it; `acc = ...` "
         "or a store of the tile's share inside the loop keeps only the last block.", proof="planted/dq.overwrite")
def _accumulate(ctx):
    hits = [r for r in ctx.failing if any(f.startswith("last_block") for f in r.fingerprints)]
    if hits and len(hits) == len(ctx.failing):
        block = sorted(f for f in hits[0].fingerprints if f.startswith("last_block"))[0].split("_")[-1]
        return (f"your outputs equal the last block's share alone (blocks of {block}) in every "
                f"failing case; {ctx.case_pattern()}")
    return None


mistake("overcount", FORMULA, "too large by whole factors: several threads add the same value into one address",
        "Every element is a whole multiple of the reference (1x, 2x, ...), many of them 2x or more: "
        "the same contribution was added more than once. Several threads (or programs) were mapped to "
        "the same output indices and each added the whole value -- a loop that steps by 1 where it "
        "should step by the number of threads sharing the work, or that ignores the thread's own "
        "index. The factor follows the block shape. Give each thread unique indices: every output "
        "element owned by exactly one thread, which accumulates it and stores it once.", test=matches("overcount"),
        proof="example/attention_backward/overcounted_backward")


@mistake("wrong_argument", FORMULA, "one tensor is used in another's place",
         "Your outputs equal the backward computed with one tensor replaced by another of the same "
         "shape -- in one product, or as one argument of a call (named in the evidence). Each "
         "product has fixed operands: S = Q K^T * scale, dP = dO V^T, dQ = dS K * scale, dK = dS^T Q "
         "* scale, dV = P^T dO; compare each call with the signature, argument by argument.",
         proof="slips/05/wrong_argument")
def _wrong_argument(ctx):
    from ..substitutions import possible
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


@mistake("scaled_statistic", FORMULA, "the LSE or delta carries the scale once more",
         "The scale belongs once, on the scores: S = Q K^T * scale, and so on dQ and dK. The LSE "
         "(the log of the scaled scores' row sums) and delta = rowsum(dO * O) are made from what "
         "already carries it: multiplied (or divided) by the scale again, P = exp(S - LSE) or dS = P * "
         "(dP - delta) comes out wrong. Find where that vector is made or passed on, and drop the factor.",
         proof="slips/01/scaled_statistic")
def _scaled_statistic(ctx):
    common = in_every_failing_case(ctx, "subst:", lambda f: " scale in place" in f)
    if not common or len(ctx.failing) < 2:
        return None
    label = sorted(common)[0]
    return f"yours: {label[6:]}, exactly, in {len(ctx.failing)} of {len(ctx.failing)} failing cases; {ctx.tensor_pattern()}"
