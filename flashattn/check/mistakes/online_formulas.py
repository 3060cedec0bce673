"""Stage "a known wrong formula", for exercise 02's online softmax: the outputs equal the loop
with one of its classic slips (the maximum never kept, l or acc not rescaled, alpha against the
block's maximum, a softmax per block, the blocks overlapping or one key short, ...), simulated
block by block in float64 exactly as the exercise's loop runs.
"""
from __future__ import annotations

from ..engine import FORMULA, mistake
from ..evidence import matches


mistake("online_unscaled", FORMULA, "the scores are not scaled",
        "S = Q K^T * scale in every block, before the maximum and the exponential: the LSE and O "
        "belong to the scaled scores.", test=matches("online_unscaled"), proof="blind/s/S02o_unscaled")


mistake("online_exp2", FORMULA, "p uses exp2 while the rest of the loop uses exp",
        "The running maximum, alpha, p and the final LSE must use one base. exp2 is faster on a GPU, "
        "but only with the scores converted to base 2 (times log2(e)) everywhere, and the LSE "
        "converted back to a natural log at the end.", test=matches("online_exp2"),
        proof="example/online_softmax/make_online(online_exp2)")


mistake("online_max_not_kept", FORMULA, "the running maximum is never updated",
        "After each block the new maximum becomes the running one (m = m_new): the next block's "
        "alpha and p are taken against it, and LSE = m + log(l) needs the final one.",
        test=matches("online_max_not_kept"), proof="blind/r/R02o_m_not_updated")


mistake("online_not_normalized", FORMULA, "O is returned without dividing by the normaliser l",
        "acc holds the unnormalised sum of p V; the softmax divides by its row sum, so O = acc / l "
        "after the loop (the LSE, m + log(l), is already right).", test=matches("online_not_normalized"),
        proof="blind/s/S02o_not_normalized")


mistake("online_scale_in_p", FORMULA, "the scale enters p's exponent only: the maximum, alpha and the LSE see unscaled scores",
        "Scale the scores once, s = Q K^T * scale, before anything uses them: the running maximum, "
        "alpha = exp(m_old - m_new) and LSE = m + log(l) are all in units of the scaled scores. With "
        "the scale only inside p = exp((s - m) * scale), alpha rescales with the wrong base and the "
        "LSE comes out in unscaled units.", test=matches("online_scale_in_p"),
        proof="example/online_softmax/make_online(online_scale_in_p)")


mistake("online_alpha_block_max", FORMULA, "alpha rescales against the block's maximum, not the new running maximum",
        "alpha = exp(m_old - m_new) converts the old sums from the old maximum to the *new running* "
        "one, m_new = max(m_old, max of this block), the same maximum p = exp(s - m_new) uses. Against "
        "the block's own maximum, alpha exceeds 1 whenever the block's scores are below the running "
        "maximum (and is inf for a block whose keys are all hidden).", test=matches("online_alpha_block_max"),
        proof="slips/02o/online_alpha_block_max")


mistake("online_normalise_in_loop", FORMULA, "each block's p V is divided by l inside the loop: O is normalised twice",
        "acc holds the unnormalised sum of p V, rescaled by alpha as the maximum grows; the division by "
        "the full normaliser l happens once, after the loop (O = acc / l). Dividing each block's share by "
        "the running l as well normalises it twice.", test=matches("online_normalise_in_loop"),
        proof="slips/02o/online_normalise_in_loop")


mistake("online_mask_zero", FORMULA, "hidden scores are set to 0, not -inf",
        "A hidden key must get weight exp(-inf) = 0: masked_fill(cols > rows, float('-inf')). Filled with "
        "0, its score is an ordinary one, exp(0 - m) > 0, and it enters l, acc and the LSE.",
        test=matches("online_mask_zero"), proof="slips/02o/online_mask_zero")


mistake("online_p_times_alpha", FORMULA, "the new block's p is multiplied by alpha too",
        "alpha = exp(m_old - m_new) rescales what was summed *before* this block (l and acc) to the new "
        "maximum; this block's p = exp(s - m_new) is already taken against m_new and needs no factor.",
        test=matches("online_p_times_alpha"), proof="slips/02o/online_p_times_alpha")


mistake("online_overlapping_blocks", FORMULA, "the blocks overlap: the loop's step is smaller than the block",
        "The loop must step by the block's width, range(0, S_k, block_n), for block [start, start + "
        "block_n) to follow the previous one exactly; a smaller step makes consecutive blocks share keys, "
        "which are then counted twice.", test=matches("online_overlapping_blocks"),
        proof="slips/02o/online_overlapping_blocks")


mistake("online_bottom_right", FORMULA, "the causal mask is aligned bottom-right: j <= i + S_k - S_q",
        "This course aligns the causal mask top-left: query i sees keys j <= i, whatever S_q and S_k "
        "(FlashAttention aligns it bottom-right when S_q != S_k, so that the last query sees every key). "
        "The two agree when S_q == S_k; with S_q > S_k the bottom-right mask leaves the first rows with "
        "no key at all (0/0 = NaN). Mask with cols > rows, no offset.", test=matches("online_bottom_right"),
        proof="slips/02o/online_bottom_right")


mistake("online_mask_reversed", FORMULA, "the causal comparison is reversed: the past is hidden, the future kept",
        "Query i sees keys j <= i: hide cols > rows. masked_fill(rows > cols, -inf) hides the keys *before* "
        "the query and keeps the later ones; a block whose every key lies before row i leaves that row "
        "with nothing (0/0 = NaN).", test=matches("online_mask_reversed"), proof="slips/02o/online_mask_reversed")


_RESCALE = ("When the running maximum grows, everything summed so far was taken against the old maximum: "
            "both running sums, l and acc, must be multiplied by alpha = exp(m_old - m_new) before the new "
            "block is added ")


mistake("online_acc_not_rescaled", FORMULA, "acc is not rescaled by alpha: acc = acc + p V",
        _RESCALE + "(acc = acc * alpha + p V). Yours rescales l (the LSE is right) but not acc.",
        test=matches("online_acc_not_rescaled"), proof="slips/02o/online_acc_not_rescaled")


mistake("online_l_not_rescaled", FORMULA, "l is not rescaled by alpha: l = l + rowsum(p)",
        _RESCALE + "(l = l * alpha + rowsum(p)). Yours rescales acc but not l.",
        test=matches("online_l_not_rescaled"), proof="slips/02o/online_l_not_rescaled")


mistake("online_m_block", FORMULA, "m is set to the block's maximum, not kept as the running maximum",
        "m must be the maximum over *every* key seen so far: m = m_new = max(m, rowmax(s)). Set to this "
        "block's own maximum, it can fall, alpha = exp(m - m_new) then grows past 1, and a block with "
        "every key hidden gives m = -inf and NaN.", test=matches("online_m_block"), proof="slips/02o/online_m_block")


mistake("online_l_unshifted", FORMULA, "l adds exp(s), not p = exp(s - m_new)",
        "l and acc must be sums of the same p = exp(s - m_new): l = l * alpha + rowsum(p). Adding "
        "rowsum(exp(s)) mixes unshifted exponentials (which may overflow) with sums taken against the "
        "running maximum, so O = acc / l and the LSE are off.", test=matches("online_l_unshifted"),
        proof="slips/02o/online_l_unshifted")


mistake("online_block_softmax", FORMULA, "each block is normalised by its own softmax",
        "p = exp(s - m_new), unnormalised: the division happens once, at the end, by l -- the sum over "
        "*every* block, each rescaled by alpha. A softmax per block divides each block by its own sum, "
        "so every block weighs the same whatever its scores, and a block whose keys are all hidden "
        "gives 0/0 = NaN.", test=matches("online_block_softmax"), proof="slips/02o/online_block_softmax")


mistake("online_block_max", FORMULA, "the new maximum is the block's maximum alone",
        "m_new = max(m_old, max of this block): the running maximum never decreases. Taken from the "
        "block alone, a block whose keys are all hidden (causal rows before the block starts) has "
        "m_new = -inf, and exp(s - m_new) = exp(-inf - -inf) is NaN.", test=matches("online_block_max"),
        proof="blind/s/S02o_block_max_only")


mistake("online_block_short", FORMULA, "each block drops its last key (a slice or range one short)",
        "Block n0 covers keys n0 ... n0 + block_n - 1: the slice is k[..., n0:n0 + block_n, :] (Python's "
        "end is exclusive), the same for V and for the mask's column indices.", test=matches("online_block_short"),
        proof="blind/r/R02o_block_slice_short")


mistake("online_drop_partial", FORMULA, "the loop visits only full blocks: the last, partial block of keys is dropped",
        "range(0, S_k, block_n) starts a block at every multiple of block_n below S_k, the last one "
        "partial; a stop of S_k - block_n + 1 leaves that one out (and every key when S_k < block_n). "
        "Slicing k[..., n0:n0 + block_n] past the end is safe in PyTorch: it stops at S_k.",
        test=matches("online_drop_partial"), proof="slips/02o/online_drop_partial")


mistake("online_l_rescales_new", FORMULA, "l = (l + rowsum(p)) * alpha: the new block's sum is rescaled too",
        "alpha = exp(m_old - m_new) converts what was summed *before* this block to the new maximum; "
        "this block's p is already taken against m_new. So l = l * alpha + rowsum(p): multiply first, "
        "then add (the same for acc).", test=matches("online_l_rescales_new"),
        proof="slips/02o/online_l_rescales_new")


mistake("online_v_from_k", FORMULA, "the value block is sliced from k",
        "O = P V: each block's p multiplies that block of the *values*, vb = v[..., start:start + block_n, :]. "
        "Yours equals the loop with K in V's place.", test=matches("online_v_from_k"),
        proof="slips/02o/online_v_from_k")


mistake("online_alpha_on_new", FORMULA, "alpha multiplies the new block instead of the running sums",
        "alpha = exp(m_old - m_new) rescales what was accumulated *before* the maximum changed: "
        "l = l * alpha + rowsum(p), acc = acc * alpha + p V. Applied to the new block instead, the "
        "first block (where alpha = 0) is lost and one-block rows divide 0 by 0.",
        test=matches("online_alpha_on_new"), proof="blind/s/S02o_alpha_on_new")
