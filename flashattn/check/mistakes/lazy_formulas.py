"""Stage "a known wrong formula", for exercise 07's lazy attention: the outputs equal the lazy
backward with one of its slips (the ReLU's gate missing, inverted or transposed, delta from dA,
dBias from the wrong diagonals, dTau without its 1/(i + 1), ...), or with one operand of its chain
in another's place.
"""
from __future__ import annotations

import math
import re

from ..engine import FORMULA, mistake
from ..evidence import in_every_failing_case, matches
from ..source import first_line


mistake("lazy_delta", FORMULA, "delta = rowsum(dO * O) does not hold for lazy attention",
        "The shortcut delta = rowsum(dO * O) holds because O = P V in softmax attention; here "
        "O = A V with A = ReLU(P + tau/(i+1)), so delta must be summed the long way: rowsum(P * dP).",
        test=matches("lazy_delta"), proof="blind/r/R07_delta_shortcut")


@mistake("lazy_gate", FORMULA, "the ReLU's gate is missing, or lets hidden entries through",
         "A = ReLU(P + tau/(i+1)) on the visible entries only: the gradient reaches P (and tau) only "
         "where the ReLU let it through, and only on j <= i: dP = dA * gate with "
         "gate = causal & (P + tau/(i+1) > 0). Mistakes show in the heads where the ReLU clips "
         "(tau < 0) or where a positive shift lands on hidden keys (tau > 0).",
         proof="example/lazy_backward/_lazy(no_gate)")
def _lazy_gate(ctx):
    if [n for n in ctx.names if ctx.wrong_in(n)] == ["dTau"]:      # dTau's own mistakes speak
        return None
    common = set.intersection(*(set(r.fingerprints) for r in ctx.failing)) if ctx.failing else set()
    if "lazy_gate" in common:
        return f"your outputs match dP = dA without the gate exactly; {ctx.tensor_pattern()}"
    if common:
        return None                        # another exact match (dS from dA, delta from dA, ...): its mistake speaks
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


mistake("lazy_ds_from_da", FORMULA, "dS is built from dA where dP = dA * gate belongs",
        "The softmax's Jacobian acts on the gradient that reaches P: dP = dA * gate (the ReLU's gate, "
        "causal entries only), then dS = P * (dP - delta). dA is the gradient of A, one step earlier.",
        test=matches("lazy_ds_from_da"), proof="example/lazy_backward/_lazy(ds_from_da)")


mistake("lazy_ds_from_a", FORMULA, "dS is built with A where the softmax's P belongs",
        "dS = P * (dP - delta) is the softmax's Jacobian applied to dP: it multiplies by the softmax "
        "output P. A = ReLU(P + tau/(i+1)) is the next step of the forward and enters only dV = A^T dO.",
        test=matches("lazy_ds_from_a"), proof="blind/s/S07_ds_uses_A")


mistake("lazy_gate_not_causal", FORMULA, "the ReLU's gate lacks the causal condition",
        "A = ReLU(P + tau/(i+1)) on the visible entries j <= i only: the gate that passes dA on to dP "
        "is causal AND (P + tau/(i+1) > 0). Without the causal part, the hidden entries (P = 0 there) "
        "pass whenever tau > 0, and their dA leaks into dTau.", test=matches("lazy_gate_not_causal"),
        proof="blind/u/U07_gate_no_causal")


mistake("lazy_gate_c_column", FORMULA, "tau/(i+1) in the gate is lined up with the keys, not the queries",
        "c_i = tau / (i + 1) belongs to query row i: in an [L, L] tile it is a column vector, "
        "c[:, None], added to every key of row i. c[None, :] adds c_j, the key's, to column j.",
        test=matches("lazy_gate_c_column"), proof="blind/t/T07_c_column_broadcast")


mistake("lazy_delta_from_da", FORMULA, "delta is built from dA where the gated dP belongs",
        "The softmax's Jacobian acts on the gradient that reaches P, dP = dA * gate: both dP and its "
        "row mean delta = rowsum(P * dP) use the gated dP. delta from the ungated dA counts the "
        "entries the ReLU cut off.", test=matches("lazy_delta_from_da"), proof="blind/s/S07_delta_from_dA")


mistake("lazy_dbias_from_dp", FORMULA, "dBias sums dP where dS belongs",
        "bias[d] is added to the scores S, before the softmax: its gradient is the gradient of S, "
        "dBias[d] = sum of dS along diagonal d. dP is the gradient after the softmax (of P).",
        test=matches("lazy_dbias_from_dp"), proof="blind/r/R07_dbias_from_dP")


mistake("lazy_dbias_mean", FORMULA, "dBias averages each diagonal instead of summing it",
        "bias[d] enters every entry of diagonal d, so its gradient is the *sum* of dS over them: "
        ".sum(), not .mean() (a mean divides diagonal d by its L - d entries).", test=matches("lazy_dbias_mean"),
        proof="blind/s/S07_dbias_diag_mean")


mistake("lazy_gate_inverted", FORMULA, "the ReLU's gate is inverted: dA passes where the ReLU cut it off",
        "dP = dA * gate with gate = causal & (P + tau/(i+1) > 0): dA reaches P only where the ReLU "
        "passed its input. masked_fill(gate, 0) zeroes exactly those entries: fill where the gate is "
        "False (masked_fill(~gate, 0), or multiply by the gate).", test=matches("lazy_gate_inverted"),
        proof="slips/07/lazy_gate_inverted")


mistake("lazy_dbias_shifted", FORMULA, "dBias reads the diagonals one further: d + 1 where d belongs",
        "bias[d] sits on diagonal d = i - j, for d = 0 ... W: dBias[d] = sum of dS along diagonal d "
        "(torch.diagonal(dS, offset=-d)), over range(W + 1). A range that starts at 1 shifts every "
        "entry by one diagonal.", test=matches("lazy_dbias_shifted"), proof="slips/07/lazy_dbias_shifted")


_DTAU_BROADCAST = ("tau/(i+1) belongs to query row i: divide each *row* sum of dP, dP.sum(-1), by i + 1. Two "
                   "slips give the same wrong numbers, column j divided by j + 1: a vector of length L broadcast "
                   "along the last axis (dP / (i + 1)), and the column sums dP.sum(0) divided by i + 1.")


@mistake("lazy_dtau_broadcast", FORMULA, "dTau divides by the key's position, not the query row's",
         _DTAU_BROADCAST, proof="slips/07/lazy_dtau_broadcast")
def _dtau_broadcast(ctx):
    evidence = matches("lazy_dtau_broadcast")(ctx)
    column_sums = evidence and first_line(ctx, lambda c: re.search(
        r"\.sum\(\s*(?:dim\s*=\s*|axis\s*=\s*)?(?:0|-2)\s*\)", c) and "tau" in c.lower())
    if not column_sums:
        return evidence
    return (f"`{column_sums}`; {evidence}",
            "`.sum(0)` sums dP over the query rows: one sum per *key* j, which the division by i + 1 then "
            "gives key j's 1/(j + 1). tau/(i+1) belongs to query row i: divide each *row* sum, "
            "dP.sum(-1) (or dim=1), by i + 1, then add the rows up.")


mistake("lazy_delta_scalar", FORMULA, "delta is one number for the whole head: summed over every row too",
        "delta_i = rowsum(P * dP)_i, one number per query row: (P * dP).sum(-1, keepdim=True). A .sum() "
        "over everything subtracts the head's total from every entry of dP.", test=matches("lazy_delta_scalar"),
        proof="slips/07/lazy_delta_scalar")


mistake("lazy_ds_gated", FORMULA, "the ReLU's gate is applied to dS too",
        "The gate belongs to dP = dA * gate only. dS = P * (dP - delta) then runs the softmax's Jacobian, "
        "whose - P * delta term reaches every visible entry, clipped by the ReLU or not: multiplying dS by "
        "the gate again drops that term where the ReLU clipped.", test=matches("lazy_ds_gated"),
        proof="slips/07/lazy_ds_gated")


mistake("lazy_dp_modified", FORMULA, "dP is changed in place before dTau reads it",
        "dP.sub_(delta) (or -=) writes dP - delta into dP itself: dS comes out right, but dTau = "
        "sum_i rowsum(dP)_i / (i + 1), computed afterwards, now sums dP - delta. Compute dP - delta into a "
        "new tensor (dP - delta), leaving dP as it is.", test=matches("lazy_dp_modified"),
        proof="slips/07/lazy_dp_modified")


mistake("lazy_dtau_floor", FORMULA, "dTau divides with //: floor division rounds each row down",
        "x // n is floor division: on floats it rounds every quotient down to a whole number. dTau's "
        "1/(i+1) is a true division, /.", test=matches("lazy_dtau_floor"), proof="slips/07/lazy_dtau_floor")


mistake("lazy_dbias_last_zero", FORMULA, "dBias' last entry (d = W) is 0: its guard stops one diagonal early",
        "bias[d] for d = 0 ... W sits on diagonal d of dS; the guard only skips diagonals past the matrix "
        "(d >= L). A guard d < W leaves the last diagonal, d = W, at 0.", test=matches("lazy_dbias_last_zero"),
        proof="slips/07/lazy_dbias_last_zero")


mistake("lazy_dbias_corner_zero", FORMULA, "dBias misses the last diagonal, d = L - 1: its guard stops one early",
        "Diagonal d = i - j of an L x L matrix exists for d = 0 ... L - 1; the last, d = L - 1, is the one "
        "entry dS[L - 1, 0]. A guard d < L - 1 (or range(L - 1)) leaves it out: dBias[L - 1] stays 0 whenever "
        "W >= L - 1. The guard is d < L.", test=matches("lazy_dbias_corner_zero"),
        proof="slips/07/lazy_dbias_corner_zero")


mistake("lazy_dtau_times_tau", FORMULA, "dTau is tau times too large: c = tau / (i + 1) where 1 / (i + 1) belongs",
        "c_i = tau / (i + 1), so dc_i / dtau = 1 / (i + 1): dTau = sum_i rowsum(dP)_i / (i + 1). Multiplying "
        "by c itself keeps a factor tau (and gives 0 at tau = 0).", test=matches("lazy_dtau_times_tau"),
        proof="slips/07/lazy_dtau_times_tau")


mistake("lazy_dbias_cumulative", FORMULA, "dBias[d] sums every diagonal from d on, not diagonal d alone",
        "bias[d] sits on diagonal d = i - j only: dBias[d] = torch.diagonal(dS, offset=-d).sum(). "
        "torch.tril(dS, -d).sum() adds every entry on or below that diagonal -- diagonals d, d + 1, ...",
        test=matches("lazy_dbias_cumulative"), proof="slips/07/lazy_dbias_cumulative")


mistake("lazy_dbias_clamped", FORMULA, "dBias[W] also collects the diagonals past W: distances clamped, not skipped",
        "bias[d] is used only for d = i - j <= W; farther pairs get no bias at all, so their dS belongs to no "
        "dBias entry. Clamping the distance (dist.clamp(max=W), as a lookup bias[min(d, W)] does) without "
        "the d <= W guard adds every diagonal past W into dBias[W].", test=matches("lazy_dbias_clamped"),
        proof="slips/07/lazy_dbias_clamped")


mistake("lazy_gate_causal_transposed", FORMULA, "the gate's causal mask is transposed: j >= i where j <= i belongs",
        "Query i sees keys j <= i: the causal mask is i[None, :] <= i[:, None] (row index i down the "
        "rows, key index j along the columns), the lower triangle. i[:, None] <= i[None, :] is the "
        "upper triangle: the gate lets dA through at the hidden future entries and cuts it at the "
        "visible past ones.", test=matches("lazy_gate_causal_transposed"),
        proof="slips/07/lazy_gate_causal_transposed")


mistake("lazy_gate_sign", FORMULA, "the gate tests P - tau/(i+1) > 0: a sign slip",
        "The ReLU's input is P + tau/(i+1) (the forward adds c = tau/(i+1) to P): gate = causal & "
        "(P + c > 0). With P - c the gate is wrong wherever 0 < P < c or -c < P < 0, that is "
        "wherever tau is not 0.", test=matches("lazy_gate_sign"), proof="slips/07/lazy_gate_sign")


mistake("lazy_positions_one_based", FORMULA, "the positions start at 1: tau/(i+2) where tau/(i+1) belongs",
        "The formulas count the query row's keys as i + 1 with i = 0 ... L - 1 (torch.arange(L)). "
        "Positions 1 ... L with the same + 1 divide by i + 2: both c = tau/(i+1) in the gate and "
        "dTau's 1/(i+1) are off. Either 0-based positions, or drop the + 1.",
        test=matches("lazy_positions_one_based"), proof="slips/07/lazy_positions_one_based")


mistake("lazy_p_a_swapped", FORMULA, "P and A trade places: the forward's results are unpacked in the wrong order",
        "forward_one_head returns (P, A, O): P the softmax, A the ReLU's output. Unpacked as (A, P, O), "
        "dV = A^T dO gets P, the gate tests the ReLU's output and dS = P * (dP - delta) uses A: "
        "unpack in the order the function returns.", test=matches("lazy_p_a_swapped"),
        proof="slips/07/lazy_p_a_swapped")


mistake("lazy_delta_columns", FORMULA, "delta lines up with the keys: a row vector where a column belongs",
        "delta_i = rowsum(P * dP)_i belongs to query row i: a column [L, 1], .sum(-1, keepdim=True). A "
        "vector of length L (the sum without keepdim) or a row [1, L] (the column transposed, .T) "
        "broadcasts along the last axis: dP - delta subtracts delta_j from column j.",
        test=matches("lazy_delta_columns"), proof="slips/07/lazy_delta_columns")


mistake("lazy_dk_operand_k", FORMULA, "dK is dS^T K: K where Q belongs",
        "dK = dS^T Q * scale: key j collects dS[i, j] times the *query* q_i over the rows i (S = Q K^T, "
        "so the derivative by K brings Q).", test=matches("lazy_dk_operand_k"), proof="slips/07/lazy_dk_operand_k")


mistake("lazy_dbias_from_da", FORMULA, "dBias sums dA where dS belongs",
        "bias is added to the scores S before the softmax, so its gradient is dS's: dBias[d] = the sum "
        "of dS along diagonal d. dA is the gradient before the ReLU's gate and the softmax's Jacobian.",
        test=matches("lazy_dbias_from_da"), proof="slips/07/lazy_dbias_from_da")


@mistake("lazy_wrong_operand", FORMULA, "one tensor of the lazy backward is used in another's place",
         "Each step of the lazy backward has fixed operands: dV = A^T dO (A, the ReLU's output), dA = dO V^T, "
         "gate = causal & (P + c > 0), dP = dA * gate, delta = rowsum(P * dP), dS = P * (dP - delta), "
         "dQ = dS K * scale, dK = dS^T Q * scale, dBias from dS's diagonals, dTau from dP's row sums. "
         "Your outputs equal the chain with one of them replaced (named in the evidence): compare that "
         "line with its formula.", proof="slips/07/lazy_wrong_operand")
def _lazy_wrong_operand(ctx):
    common = in_every_failing_case(ctx, "lazy_subst:")
    if not common:
        return None
    label = min(sorted(common), key=len)
    return (f"yours: the formula with {label.split(':', 1)[1]}, exactly, in all {len(ctx.failing)} failing "
            f"cases; {ctx.tensor_pattern()}")


mistake("lazy_scale", FORMULA, "dQ and dK are missing the scale",
        "S = Q K^T * scale + b, so dQ = dS K * scale and dK = dS^T Q * scale.", test=matches("lazy_scale"),
        proof="blind/s/S07_dq_missing_scale")
mistake("lazy_gate_value", FORMULA, "the gate is the ReLU's value, relu(P + c), not its derivative",
        "The chain rule multiplies dA by the ReLU's *derivative*: 1 where P + c > 0 (on the visible keys), "
        "0 elsewhere -- gate = causal & (P + c > 0), a mask. relu(P + c) is the ReLU's output A itself.", test=matches("lazy_gate_value"),
        proof="slips/07/lazy_gate_value")
mistake("lazy_dbias_reversed", FORMULA, "dBias' diagonals are in reverse order: bias[d] gets diagonal W - d",
        "bias[d] sits on diagonal d below the main one (i - j = d): dBias[d] = the sum of dS's d-th "
        "diagonal, for d = 0, 1, ..., W in that order (range(W + 1)), not W down to 0.", test=matches("lazy_dbias_reversed"),
        proof="slips/07/lazy_dbias_reversed")
mistake("lazy_recompute_unscaled", FORMULA, "the forward is recomputed without the scale (scale 1.0)",
        "The backward rebuilds P, A and O with the forward's own call, so that call needs the same "
        "scale as the forward had: with 1.0 every recomputed matrix is that of other scores, and all "
        "five gradients follow it. Pass scale on: forward_one_head(q, k, v, bias, tau, scale).", test=matches("lazy_recompute_unscaled"),
        proof="slips/07/lazy_recompute_unscaled")
mistake("lazy_dk_transpose", FORMULA, "dK needs dS transposed",
        "Key j collects dS[i, j] over the query rows i: dK = dS^T Q * scale.", test=matches("lazy_dk_transpose"),
        proof="example/lazy_backward/_one_head_backward(dK without transpose)")
mistake("lazy_dv", FORMULA, "dV is computed from P instead of A",
        "O = A V, so dV = A^T dO with A the ReLU-shifted matrix, not the softmax P.", test=matches("lazy_dv"),
        proof="blind/r/R07_dv_uses_P")
mistake("lazy_dbias_diagonals", FORMULA, "dBias sums the wrong diagonals",
        "bias[d] enters S[i, j] for i - j = d (keys before the query): dBias[d] sums dS along the "
        "d-th diagonal *below* the main one.", test=matches("lazy_dbias_diagonals"),
        proof="blind/r/R07_dbias_upper_diagonals")
mistake("lazy_dtau_count", FORMULA, "dTau is missing the 1/(i+1) factor",
        "tau enters row i as tau/(i+1): dTau sums dP[i, j] / (i + 1).", test=matches("lazy_dtau_count"),
        proof="blind/t/T07_dtau_no_divide")
mistake("lazy_dtau_gate", FORMULA, "dTau is not gated by the ReLU",
        "Entries the ReLU clipped pass no gradient to tau either: sum dA * gate / (i + 1).", test=matches("lazy_dtau_gate"),
        proof="example/lazy_backward/_one_head_backward(ungated dtau)")
mistake("lazy_dtau_causal", FORMULA, "dTau sums over hidden keys too",
        "tau/(i+1) is added only on the visible keys j <= i: sum the causal entries only (and gate them).", test=matches("lazy_dtau_causal"),
        proof="blind/r/R07_dtau_from_dA")
