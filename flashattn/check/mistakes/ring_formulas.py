"""Stage "a known wrong formula", for exercise 11's ring attention: the merge of two partial
results with one of its classic slips (the plain exp form that overflows, NaN on a row no block
saw, the weights swapped, the LSE without its log1p term), and the ring's backward with one of
its own (a stale K/V block, the wrong rank's LSE or delta, dK/dV kept, reset or never sent home),
each simulated exactly as the exercise runs it (flashattn.check.ring).
"""
from __future__ import annotations

from ..engine import FORMULA, mistake
from ..evidence import matches

# ---- the merge (check.merge_partials)

mistake("merge_overflow", FORMULA, "the merge exponentiates the LSEs themselves: exp() overflows",
        "e^LSE is the row's whole exp-sum: an LSE above 88 makes it inf in fp32 (11 in fp16), and "
        "inf / inf is NaN. Only differences of LSEs may be exponentiated, and only where they are "
        "<= 0: LSE = max + log1p(exp(min - max)), and the weights sigmoid(LSE_a - LSE_b), "
        "sigmoid(LSE_b - LSE_a).",
        test=matches("merge_overflow"), proof="slips/11m/merge_overflow")


mistake("merge_masked_rows", FORMULA, "NaN on the rows that saw no key in either partial",
        "A row that saw no key of a block has LSE = -inf there (and O = 0). Where both partials "
        "are -inf, LSE_a - LSE_b = -inf - (-inf) = NaN, and sigmoid(NaN) makes the row's O and LSE "
        "NaN. Such a row saw nothing at all: its merged LSE is -inf and its O is 0. Treat the "
        "difference as 0 there (torch.nan_to_num, or a where on both being -inf): the weights are "
        "then 1/2 each, of two zero rows, and max + log1p(1) stays -inf.",
        test=matches("merge_masked_rows"), proof="slips/11m/merge_masked_rows")


mistake("merge_exp_weights", FORMULA, "the weights are exp(LSE_a - LSE_b) and its inverse, not sigmoids",
        "O_a's weight is block a's share of the whole row: e^LSE_a / (e^LSE_a + e^LSE_b) = "
        "sigmoid(LSE_a - LSE_b). exp(LSE_a - LSE_b) is the ratio of the two blocks' sums, not a "
        "share: the two weights do not add up to 1, and one of them overflows when the LSEs lie "
        "far apart.",
        test=matches("merge_exp_weights"), proof="slips/11m/merge_exp_weights")


mistake("merge_one_empty", FORMULA, "a row empty in one partial is merged as if it were empty in both",
        "Where only one partial saw no key (its LSE -inf, its O 0), the difference of the LSEs is "
        "+-inf, and the safe form already gives the other partial unchanged: sigmoid(-inf) = 0, "
        "sigmoid(+inf) = 1, max + log1p(exp(-inf)) = the other LSE. Only -inf - (-inf) = NaN, a "
        "row empty in *both*, needs the difference set to 0; set to 0 wherever one is -inf, the "
        "row keeps half of the other O and an LSE log 2 too large.",
        test=matches("merge_one_empty"), proof="slips/11m/merge_one_empty")


mistake("merge_weights_swapped", FORMULA, "each partial O is weighted by the other block's share",
        "O_a's weight is block a's share of the row's exp-sum: e^(LSE_a - LSE) = "
        "sigmoid(LSE_a - LSE_b), large when LSE_a is the larger. The sign of the difference "
        "decides which block a weight belongs to.",
        test=matches("merge_weights_swapped"), proof="slips/11m/merge_weights_swapped")


mistake("merge_lse_max", FORMULA, "the merged LSE is the larger of the two, without log1p(exp(min - max))",
        "log(e^a + e^b) = max + log(1 + e^(min - max)): the second term is log 2 where the LSEs are "
        "equal and vanishes only when they lie far apart. The max alone drops the smaller block's "
        "keys from the row's normaliser, and a backward with that LSE rebuilds P too large.",
        test=matches("merge_lse_max"), proof="slips/11m/merge_lse_max")


mistake("merge_lse_signed", FORMULA, "log1p(exp(...)) is given the signed difference, not -|LSE_a - LSE_b|",
        "max + log1p(exp(min - max)) needs min - max = -|LSE_a - LSE_b|, which is <= 0 for either "
        "order. With the signed difference the term is right only where LSE_a is the larger; where "
        "LSE_b is, it adds log(1 + e^|d|), about |d| too much.",
        test=matches("merge_lse_signed"), proof="slips/11m/merge_lse_signed")


mistake("merge_lse_added", FORMULA, "the merged LSE is LSE_a + LSE_b",
        "The blocks' exp-sums add up, so their logs do not: e^LSE = e^LSE_a + e^LSE_b. Adding the "
        "LSEs multiplies the sums. LSE = max + log1p(exp(min - max)).",
        test=matches("merge_lse_added"), proof="slips/11m/merge_lse_added")


mistake("merge_log_for_log1p", FORMULA, "log where log1p belongs: the merged LSE is the smaller of the two",
        "log(e^a + e^b) = max + log(1 + e^(min - max)): the 1 inside the log is the larger block's own "
        "share. torch.log1p(x) computes log(1 + x) (accurately for small x); torch.log(exp(min - max)) "
        "is just min - max, and max + (min - max) = min.",
        test=matches("merge_log_for_log1p"), proof="slips/11m/merge_log_for_log1p")


mistake("merge_average", FORMULA, "the partial outputs are averaged, not weighted by their blocks' shares",
        "Each partial O is normalised over its own block only. The merged row weights each by its "
        "block's share of the whole exp-sum, e^(LSE_block - LSE), which is 1/2 only where the two "
        "LSEs are equal.",
        test=matches("merge_average"), proof="slips/11m/merge_average")


mistake("merge_low_precision", FORMULA, "the merge runs in o's fp16, then is cast to fp32",
        "The partial outputs may arrive in fp16 (a kernel's output), but their weighted sum must be "
        "formed in fp32: each merge adds its rounding, and a ring merges W times. Cast o_a and o_b "
        "to fp32 first, then weight and add.",
        test=matches("merge_low_precision"), proof="slips/11m/merge_low_precision")


# ---- the ring's backward (check.ring_backward)

mistake("ring_stale_kv", FORMULA, "the K/V block is never passed on: every step uses the rank's own",
        "At step t rank r must hold rank (r - t)'s K/V block: after each step every rank sends the "
        "block it holds to rank r + 1 and takes rank r - 1's. Without that pass each rank computes "
        "its own block W times (with other ranks' positions for the mask), and the other blocks' "
        "shares are never computed.",
        test=matches("ring_stale_kv"), proof="slips/11r/ring_stale_kv")


mistake("ring_source_index", FORMULA, "the visiting block's positions are those of rank r + t, not r - t",
        "The blocks move to rank r + 1 at every step, so the block at rank r at step t came from "
        "rank s = (r - t) mod W. Its keys' positions are positions[s]; with (r + t) the causal mask "
        "is taken at another block's positions (non-causal cases, which need no positions, pass).",
        test=matches("ring_source_index"), proof="slips/11r/ring_source_index")


mistake("ring_key_positions", FORMULA, "the keys' positions are the rank's own, not the visiting block's",
        "The causal mask compares global positions: query i sees key j when j <= i. The rows' "
        "positions are this rank's, positions[r]; the keys belong to the visiting block, "
        "positions[s] with s = (r - t) mod W. With positions[r] for both every block is masked "
        "as if it were the diagonal one.",
        test=matches("ring_key_positions"), proof="slips/11r/ring_key_positions")


mistake("ring_kv_swapped", FORMULA, "the visiting block's K and V are passed in each other's place",
        "block_grads(q, k, v, ...) takes the block's keys, then its values: the scores come from K, "
        "dP = dO V^T from V. Compare the call with the signature, argument by argument.",
        test=matches("ring_kv_swapped"), proof="slips/11r/ring_kv_swapped")


mistake("ring_lse_of_source", FORMULA, "P is rebuilt with the visiting rank's LSE, not the rows' own",
        "P = exp(S - LSE) needs the LSE of the *rows*, the queries: this rank's lse[r], the global "
        "one the forward's merges produced. The visiting block brings keys, not rows; lse[s] "
        "belongs to other queries.",
        test=matches("ring_lse_of_source"), proof="slips/11r/ring_lse_of_source")


mistake("ring_delta_of_source", FORMULA, "delta of the visiting rank's rows, not this rank's",
        "delta_i = rowsum(dO_i * O_i) is one number per query row, from the rank's own dO and O: "
        "no communication, and it never changes during the ring. delta[s] belongs to rank s's "
        "queries.",
        test=matches("ring_delta_of_source"), proof="slips/11r/ring_delta_of_source")


mistake("ring_one_step_short", FORMULA, "the ring runs W - 1 steps: one block never visits each rank",
        "Each rank must meet all W blocks, its own included: W steps, t = 0 ... W - 1. With W - 1 "
        "the last block never visits, and the dK/dV that travel have made one pass too few to be "
        "home.",
        test=matches("ring_one_step_short"), proof="slips/11r/ring_one_step_short")


mistake("ring_dkdv_not_home", FORMULA, "dK/dV are not sent home: each rank returns the next rank's",
        "A block's dK/dV travel with it, collecting every rank's share. After the last step the "
        "block at rank r is rank r + 1's (it has moved W - 1 times): one more pass brings every "
        "block's dK/dV to its owner. The K/V blocks themselves need no last pass.",
        test=matches("ring_dkdv_not_home"), proof="slips/11r/ring_dkdv_not_home")


mistake("ring_dkdv_kept", FORMULA, "dK/dV are added up at the rank that computed them, not with their block",
        "A share of dK and dV belongs to the keys of the block that is visiting, not to the rank "
        "that computed it. Add it to that block's dK/dV, which travel with the block and reach "
        "its owner at the end; summed at the computing rank, shares of W different blocks pile up "
        "on one rank's keys.",
        test=matches("ring_dkdv_kept"), proof="slips/11r/ring_dkdv_kept")


mistake("ring_dkdv_by_source", FORMULA,
        "a share of dK/dV is added to the slot of the block's owner, not where the block is",
        "The dK/dV that travel are a list indexed like the blocks that travel: dk_here[r] belongs to "
        "the block rank r holds *now*, whoever owns it. dk_here[s] is the slot of the block that "
        "rank s holds at this step -- another block -- so the share lands on the wrong keys. The "
        "owner gets its dK/dV at the end, by the last pass.",
        test=matches("ring_dkdv_by_source"), proof="slips/11r/ring_dkdv_by_source")


mistake("ring_dkdv_reset", FORMULA, "dK/dV start from zero at every step: only the last rank's share survives",
        "A block's dK/dV are created once, at its owner, before the first step, and then only "
        "added to and passed on. Zeroed at each step, they keep the share of the last rank that "
        "held the block.",
        test=matches("ring_dkdv_reset"), proof="slips/11r/ring_dkdv_reset")


mistake("ring_dq_overwritten", FORMULA, "dQ keeps the last block's share only",
        "dQ of a rank's rows sums the shares of every K/V block that visits: dq[r] += the share, "
        "at every step. dq[r] = the share keeps the last block's.",
        test=matches("ring_dq_overwritten"), proof="slips/11r/ring_dq_overwritten")
