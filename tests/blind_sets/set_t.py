"""Blind set T (2026-11-24): 74 mistakes and 12 harmless rewrites, written like set R without seeing
sets R or S. Same format and runner (``python tests/blind_sets/run.py t``).
"""

MASK_LINE = 'S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))'

VARIANTS = [
    # ============================================================== 01 attention_backward
    dict(id="T01_softmax_over_queries", exercise="01", kind="bug",
         edits=[("P = torch.softmax(S, dim=-1)", "P = torch.softmax(S, dim=-2)")],
         truth="The softmax is taken over dim=-2 (the query axis, columns) instead of over the keys "
               "(dim=-1), so P is column-normalised and every gradient is wrong; a good diagnosis names "
               "the softmax axis."),
    dict(id="T01_delta_no_keepdim", exercise="01", kind="bug",
         edits=[("delta = (do * o).sum(dim=-1, keepdim=True)", "delta = (do * o).sum(dim=-1)")],
         truth="delta is reduced without keepdim, so [B,H,S_q] broadcasts along the key axis: dS subtracts "
               "delta_j (indexed by key) instead of delta_i per query row (shape error when S_q != S_k); "
               "dV right, dQ/dK wrong: a delta broadcast/shape problem."),
    dict(id="T01_dk_untransposed_dS", exercise="01", kind="bug",
         edits=[("dk = (dS.transpose(-1, -2) @ q) * scale", "dk = (dS @ q) * scale")],
         truth="dK is computed as dS Q instead of dS^T Q (transpose of dS forgotten): wrong values when "
               "S_q == S_k and a shape error when they differ; only dK is affected."),
    dict(id="T01_ignores_scale_arg", exercise="01", kind="bug",
         edits=[("    S = (q @ k.transpose(-1, -2)) * scale",
                 "    scale = 1.0 / math.sqrt(q.shape[-1])\n    S = (q @ k.transpose(-1, -2)) * scale")],
         truth="The scale argument is overwritten by the default 1/sqrt(D), so every case with a custom "
               "scale is wrong (all three gradients) while default-scale cases pass; the diagnosis should "
               "name the scale value / ignoring the given scale."),
    dict(id="T01_dq_from_v", exercise="01", kind="bug",
         edits=[("dq = (dS @ k) * scale", "dq = (dS @ v) * scale")],
         truth="dQ uses V where K belongs (dS V * scale instead of dS K * scale); dK and dV are right, "
               "dQ wrong: a wrong operand in dQ."),
    dict(id="T01_mask_not_negated", exercise="01", kind="bug",
         edits=[(MASK_LINE, 'S = S.masked_fill(causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))')],
         truth="The causal mask is used without ~, so the visible keys (j <= i) are set to -inf and the "
               "future keys kept: the mask is inverted (rows with no future key become NaN); causal cases "
               "only."),
    dict(id="T01_ds_sign_flipped", exercise="01", kind="bug",
         edits=[("dS = P * (dP - delta)", "dS = P * (delta - dP)")],
         truth="dS has the wrong sign, P*(delta - dP): dQ and dK are exactly negated (ratio -1), dV is "
               "right."),
    dict(id="T01_dv_scaled", exercise="01", kind="bug",
         edits=[("dv = P.transpose(-1, -2) @ do", "dv = (P.transpose(-1, -2) @ do) * scale")],
         truth="dV is multiplied by the softmax scale although V is not inside the scaled product: dV off "
               "by exactly the factor scale, dQ and dK right."),
    dict(id="H01_delta_from_P_dP", exercise="01", kind="harmless",
         edits=[("delta = (do * o).sum(dim=-1, keepdim=True)", "delta = (P * dP).sum(dim=-1, keepdim=True)")],
         truth="delta = rowsum(P * dP) equals rowsum(dO * O) for standard attention: still correct."),
    dict(id="H01_mask_finfo_min", exercise="01", kind="harmless",
         edits=[(MASK_LINE,
                 'S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), torch.finfo(S.dtype).min)')],
         truth="Hidden scores set to the most negative finite value instead of -inf: the softmax still "
               "gives exactly 0 there and every row has a visible key, so it is still correct."),

    # ============================================================== 02p rebuild_p
    dict(id="T02p_lse_as_row", exercise="02p", kind="bug",
         edits=[("torch.exp(S - lse[..., None])", "torch.exp(S - lse[..., None, :])")],
         truth="LSE is broadcast along the query axis ([..., 1, S_q]) so key j gets LSE_j subtracted: "
               "wrong P when S_q == S_k, shape error otherwise; LSE must be a column, one value per query row."),
    dict(id="T02p_exp_plus_lse", exercise="02p", kind="bug",
         edits=[("torch.exp(S - lse[..., None])", "torch.exp(S + lse[..., None])")],
         truth="P = exp(S + LSE): the LSE is added instead of subtracted, so P is off by exp(2 LSE_i) per "
               "row (rows don't sum to 1)."),
    dict(id="T02p_default_scale", exercise="02p", kind="bug",
         edits=[("S = (q @ k.transpose(-1, -2)) * scale",
                 "S = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])")],
         truth="S is rebuilt with the default 1/sqrt(D) instead of the given scale: right only when the "
               "scale is the default; custom-scale cases wrong (rows no longer sum to 1)."),
    dict(id="T02p_scale_divides", exercise="02p", kind="bug",
         edits=[("S = (q @ k.transpose(-1, -2)) * scale", "S = (q @ k.transpose(-1, -2)) / scale")],
         truth="The scores are divided by scale instead of multiplied (scale is already 1/sqrt(D)), so S "
               "is not the forward's S and exp(S - LSE) is not the softmax."),
    dict(id="T02p_triu_hides_diagonal", exercise="02p", kind="bug",
         edits=[(MASK_LINE,
                 'S = S.masked_fill(torch.ones(S.shape[-2], S.shape[-1], dtype=torch.bool, device=S.device).triu(), float("-inf"))')],
         truth="The hand-built causal mask uses triu() (diagonal included) instead of triu(1): the "
               "diagonal j == i is hidden too, so P is 0 on the diagonal (row 0 all zeros); causal only."),
    dict(id="T02p_mask_bottom_right", exercise="02p", kind="bug",
         edits=[(MASK_LINE,
                 'S = S.masked_fill(~torch.ones(S.shape[-2], S.shape[-1], dtype=torch.bool, device=S.device).tril(S.shape[-1] - S.shape[-2]), float("-inf"))')],
         truth="The causal mask is bottom-right aligned (j <= i + S_k - S_q, FlashAttention-2's "
               "convention) instead of the course's top-left one: identical when S_q == S_k, wrong in the "
               "causal cases with S_q != S_k."),
    dict(id="T02p_subtract_rowmax", exercise="02p", kind="bug",
         edits=[("    return torch.exp(S - lse[..., None])",
                 "    S = S - S.amax(dim=-1, keepdim=True)\n    return torch.exp(S - lse[..., None])")],
         truth="The row maximum is subtracted from S 'for stability' before subtracting the LSE, which "
               "already contains it: P is off by exp(-max_i) per row."),
    dict(id="H02p_einsum", exercise="02p", kind="harmless",
         edits=[("S = (q @ k.transpose(-1, -2)) * scale",
                 'S = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale')],
         truth="Scores through einsum instead of matmul with a transpose: the same S, still correct."),

    # ============================================================== 02o online_softmax_forward
    dict(id="T02o_causal_block_local_cols", exercise="02o", kind="bug",
         edits=[("cols = torch.arange(start, start + kb.shape[2], device=q.device)[None, :]",
                 "cols = torch.arange(kb.shape[2], device=q.device)[None, :]")],
         truth="The causal mask compares block-local key indices (0..block_n-1) with global query rows, so "
               "every block after the first is masked as if it were block 0: causal with several blocks "
               "wrong, single block right."),
    dict(id="T02o_alpha_inverted", exercise="02o", kind="bug",
         edits=[("alpha = torch.exp(m - m_new)", "alpha = torch.exp(m_new - m)")],
         truth="The rescale factor is inverted, exp(m_new - m): with m = -inf initially it is inf and the "
               "sums become NaN; the old sums must be scaled by exp(m_old - m_new) <= 1."),
    dict(id="T02o_running_max_not_updated", exercise="02o", kind="bug",
         edits=[("        m = m_new\n", "")],
         truth="The running maximum is never updated (m = m_new missing): alpha = exp(-inf - m_new) = 0 "
               "wipes everything before the last block and the LSE is -inf; wrong with any block count."),
    dict(id="T02o_lse_keepdim", exercise="02o", kind="bug",
         edits=[("(m + torch.log(l)).squeeze(-1)", "(m + torch.log(l))")],
         truth="The LSE is returned with its trailing singleton axis, [B,H,S_q,1] instead of [B,H,S_q]: "
               "values right, shape wrong."),
    dict(id="T02o_o_dtype_not_restored", exercise="02o", kind="bug",
         edits=[("return (acc / l).to(q.dtype), ", "return acc / l, ")],
         truth="O is returned in the fp32 accumulator dtype instead of q's dtype: right for fp32 inputs, "
               "wrong dtype for fp16/bf16 inputs."),
    dict(id="T02o_l_not_rescaled", exercise="02o", kind="bug",
         edits=[("l = l * alpha + p.sum(dim=-1, keepdim=True)", "l = l + p.sum(dim=-1, keepdim=True)")],
         truth="The running sum l is not rescaled by alpha when the max grows (acc is): right with one "
               "block, wrong O and LSE with several blocks whenever the maximum increases."),
    dict(id="T02o_block_max_only", exercise="02o", kind="bug",
         edits=[("m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))", "m_new = s.amax(dim=-1, keepdim=True)")],
         truth="m_new is the block's own max, not the running max: a causal row that sees no key in a block "
               "gets m_new = -inf, alpha = inf and NaN (it can also overflow); the max must be "
               "max(m, rowmax(block))."),
    dict(id="T02o_p_uses_old_max", exercise="02o", kind="bug",
         edits=[("p = torch.exp(s - m_new)", "p = torch.exp(s - m)")],
         truth="p is exponentiated against the old maximum m (which is -inf on the first block) instead "
               "of m_new: inf/NaN and inconsistent scaling with l and acc."),
    dict(id="H02o_where_mask", exercise="02o", kind="harmless",
         edits=[('s = s.masked_fill(cols > rows, float("-inf"))',
                 's = torch.where(cols <= rows, s, torch.full_like(s, float("-inf")))')],
         truth="The causal mask written with torch.where and the complementary comparison: still correct."),

    # ============================================================== 03 dq kernel
    dict(id="T03_kv_uses_query_head", exercise="03", kind="bug",
         edits=[("k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h",
                 "k_base = K + b.to(tl.int64) * stride_k_b + h.to(tl.int64) * stride_k_h"),
                ("v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h",
                 "v_base = V + b.to(tl.int64) * stride_v_b + h.to(tl.int64) * stride_v_h")],
         truth="K and V are offset with the query head h instead of the K/V head h_kv: right without GQA, "
               "wrong (reads other heads/batches or past the end) when GROUP_SIZE > 1; a GQA kv-head bug."),
    dict(id="T03_scale_twice", exercise="03", kind="bug",
         edits=[("dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)        # dQ += dS K",
                 "dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION) * scale")],
         truth="scale is applied inside the loop and again after it, so dQ carries scale^2: off by exactly "
               "the factor scale everywhere."),
    dict(id="T03_delta_as_row", exercise="03", kind="bug",
         edits=[("ds = p * (dp - delta[:, None])", "ds = p * (dp - delta[None, :])")],
         truth="delta is broadcast along the rows ([None, :], indexed by key position in the tile) instead "
               "of as a per-query-row column: dS = P*(dP - delta) uses the wrong row's delta, dQ wrong."),
    dict(id="T03_v_with_k_strides", exercise="03", kind="bug",
         edits=[("v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,",
                 "v = tl.load(v_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,")],
         truth="V's tile is addressed with K's sequence/dim strides (copy-paste): right when K and V share a "
               "layout, wrong when V's strides differ from K's; a stride bug naming V."),
    dict(id="T03_s_without_trans", exercise="03", kind="bug",
         edits=[("s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale",
                 "s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale")],
         truth="S = Q K without transposing the K tile: a shape error when BLOCK_D != BLOCK_N, otherwise "
               "silently wrong scores (Q times K's block as a matrix)."),
    dict(id="T03_store_no_dmask", exercise="03", kind="bug",
         edits=[("dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])",
                 "dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])")],
         truth="The dQ store masks only the rows, not the padded head dimension: when D < BLOCK_D it writes "
               "BLOCK_D - D extra columns past each row (into the next row / past the tensor's end)."),
    dict(id="T03_causal_mask_flipped", exercise="03", kind="bug",
         edits=[("visible = visible & (offs_n[None, :] <= offs_m[:, None])",
                 "visible = visible & (offs_n[None, :] >= offs_m[:, None])")],
         truth="The causal comparison is reversed (j >= i instead of j <= i): the tile mask keeps the "
               "future keys and hides the past; causal cases wrong."),
    dict(id="T03_delta_loaded_from_lse", exercise="03", kind="bug",
         edits=[("delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)",
                 "delta = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)")],
         truth="delta is loaded from the LSE pointer (copy-paste of the line above), so dS = P*(dP - LSE): "
               "dQ wrong; the diagnosis should point at delta/LSE."),
    dict(id="T03_causal_start_at_diagonal", exercise="03", kind="bug",
         edits=[("    for start_n in range(0, kv_end, BLOCK_N):",
                 "    kv_start = 0\n    if CAUSAL:\n        kv_start = pid_m * BLOCK_M\n"
                 "    for start_n in range(kv_start, kv_end, BLOCK_N):")],
         truth="Under causal the key loop starts at the query block's own diagonal (the dK/dV kernel's "
               "start rule), skipping the fully visible earlier key blocks: causal dQ wrong for every block "
               "but the first."),
    dict(id="H03_exp2_with_log2e", exercise="03", kind="harmless",
         edits=[("p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)",
                 "p = tl.where(visible, tl.exp2((s - lse[:, None]) * 1.4426950408889634), 0.0)")],
         truth="exp(x) computed as exp2(x * log2(e)): the same P up to rounding, still correct."),
    dict(id="H03_no_causal_early_stop", exercise="03", kind="harmless",
         edits=[("        kv_end = tl.minimum(S_k, (pid_m + 1) * BLOCK_M)", "        kv_end = S_k")],
         truth="The causal loop visits every key block and relies on the element-wise mask: slower but "
               "still correct."),

    # ============================================================== 04 dkdv kernel
    dict(id="T04_no_causal_mask_in_tile", exercise="04", kind="bug",
         edits=[("\n            if CAUSAL:\n                visible = visible & (offs_n[:, None] <= offs_m[None, :])", "")],
         truth="The element-wise causal mask on P^T is dropped (only the loop start is causal), so the "
               "diagonal tiles keep the hidden entries j > i: causal dK and dV wrong."),
    dict(id="T04_lse_broadcast_by_key", exercise="04", kind="bug",
         edits=[("pT = tl.where(visible, tl.exp(sT - lse[None, :]), 0.0)",
                 "pT = tl.where(visible, tl.exp(sT - lse[:, None]), 0.0)")],
         truth="In the transposed tile the LSE is broadcast as a column ([:, None], along keys) instead of "
               "a row ([None, :], one per query column): P^T rebuilt with the wrong rows' LSE, dK and dV wrong."),
    dict(id="T04_scale_on_dv", exercise="04", kind="bug",
         edits=[("    dk = dk * scale\n", "    dv = dv * scale\n")],
         truth="The final factor of scale is applied to dV instead of dK: dV off by a factor scale, dK off "
               "by 1/scale."),
    dict(id="T04_gqa_heads_interleaved", exercise="04", kind="bug",
         edits=[("h = h_kv * GROUP_SIZE + g", "h = g * H_KV + h_kv")],
         truth="The query heads of a GQA group are taken as h_kv, h_kv + H_KV, ... (interleaved) instead of "
               "the contiguous block h_kv*GROUP_SIZE + g that repeat_interleave implies: right without GQA, "
               "dK/dV summed over the wrong heads with GQA."),
    dict(id="T04_accum_reset_per_head", exercise="04", kind="bug",
         edits=[("        h = h_kv * GROUP_SIZE + g\n",
                 "        h = h_kv * GROUP_SIZE + g\n"
                 "        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)\n"
                 "        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)\n")],
         truth="dK/dV accumulators are re-zeroed at the start of every GQA head iteration, so only the last "
               "query head of each group contributes: right without GQA, wrong with GROUP_SIZE > 1."),
    dict(id="T04_q_no_row_mask", exercise="04", kind="bug",
         edits=[("q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,\n"
                 "                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)",
                 "q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,\n"
                 "                        mask=d_ok[None, :], other=0.0)")],
         truth="Q is loaded without the row mask, so in the last query block rows past S_q are read from "
               "beyond the tensor; dK += dS^T Q multiplies their garbage/NaN by 0 and NaN propagates into dK "
               "(a read past the end of Q)."),
    dict(id="T04_m_start_always", exercise="04", kind="bug",
         edits=[("    m_start = 0\n    if CAUSAL:\n        m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M",
                 "    m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M")],
         truth="The causal loop start is applied unconditionally, so in non-causal attention the key blocks "
               "after the first skip the earlier query rows: non-causal dK/dV wrong for pid_n > 0."),
    dict(id="T04_dk_from_do", exercise="04", kind="bug",
         edits=[("dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)",
                 "dk += tl.dot(dsT.to(do.dtype), do, input_precision=DOT_PRECISION)")],
         truth="dK accumulates dS^T dO instead of dS^T Q (wrong operand): dV right, dK wrong."),
    dict(id="T04_q_missing_batch_offset", exercise="04", kind="bug",
         edits=[("q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h",
                 "q_base = Q + h.to(tl.int64) * stride_q_h")],
         truth="Q's base pointer omits the batch offset, so every batch element reads batch 0's queries: "
               "right for B = 1, dK wrong for B > 1."),
    dict(id="H04_causal_loop_from_zero", exercise="04", kind="harmless",
         edits=[("m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M", "m_start = 0")],
         truth="The causal query loop starts at 0 and relies on the element-wise mask: slower, still correct."),

    # ============================================================== 05 autograd function
    dict(id="T05_forward_default_scale", exercise="05", kind="bug",
         edits=[("o, lse = flashattn.attention_forward(q, k, v, causal, scale)",
                 "o, lse = flashattn.attention_forward(q, k, v, causal)")],
         truth="The forward kernel is called without the scale (defaults to 1/sqrt(D)) while backward uses "
               "ctx.scale: right with the default scale, O and gradients wrong with a custom scale."),
    dict(id="T05_delta_o_o", exercise="05", kind="bug",
         edits=[("delta = flashattn.attention_backward_delta(o, do)",
                 "delta = flashattn.attention_backward_delta(o, o)")],
         truth="delta computed as rowsum(O * O) instead of rowsum(dO * O): dV right, dQ and dK wrong "
               "(wrong argument to the delta preprocess)."),
    dict(id="T05_dkdv_scale_omitted", exercise="05", kind="bug",
         edits=[("dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal, ctx.scale)",
                 "dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal)")],
         truth="The dK/dV kernel is called without ctx.scale, so it rebuilds P with the default scale: right "
               "for the default scale, dK and dV wrong with a custom scale (dQ right)."),
    dict(id="T05_return_four_grads", exercise="05", kind="bug",
         edits=[("return dq, dk, dv, None, None", "return dq, dk, dv, None")],
         truth="backward returns 4 values for forward's 5 inputs (one None missing for scale): autograd "
               "raises 'returned an incorrect number of gradients'."),
    dict(id="T05_gqa_repeat_kv", exercise="05", kind="bug",
         edits=[("        o, lse = flashattn.attention_forward(q, k, v, causal, scale)\n",
                 "        group = q.shape[1] // k.shape[1]\n"
                 "        k = k.repeat_interleave(group, dim=1)\n"
                 "        v = v.repeat_interleave(group, dim=1)\n"
                 "        o, lse = flashattn.attention_forward(q, k, v, causal, scale)\n")],
         truth="K and V are expanded to the query heads inside forward (GQA by repeat), and backward returns "
               "dK/dV with H heads instead of summing back to H_kv: autograd rejects the gradient shape in "
               "GQA cases; fine without GQA."),
    dict(id="T05_saved_unpack_order", exercise="05", kind="bug",
         edits=[("q, k, v, o, lse = ctx.saved_tensors", "q, k, v, lse, o = ctx.saved_tensors")],
         truth="The saved tensors are unpacked in a different order than saved (lse and o swapped), so the "
               "delta preprocess receives the LSE as O (shape error) and the kernels get O as LSE."),
    dict(id="T05_ctx_attrs_swapped", exercise="05", kind="bug",
         edits=[("ctx.causal, ctx.scale = causal, scale", "ctx.causal, ctx.scale = scale, causal")],
         truth="causal and scale are stored into the wrong ctx attributes, so backward passes a float as "
               "causal and a bool as scale: the kernels' argument validation raises."),
    dict(id="T05_forward_returns_lse", exercise="05", kind="bug",
         edits=[("        return o\n        ### END SOLUTION", "        return o, lse\n        ### END SOLUTION")],
         truth="forward returns (o, lse), so my_flash_attention returns a tuple and backward would receive "
               "two gradients: the output is not a tensor / backward's signature does not match."),
    dict(id="H05_delta_args_swapped", exercise="05", kind="harmless",
         edits=[("delta = flashattn.attention_backward_delta(o, do)",
                 "delta = flashattn.attention_backward_delta(do, o)")],
         truth="rowsum(dO * O) is symmetric in its two arguments, and the kernel takes any strides: still correct."),
    dict(id="H05_do_contiguous", exercise="05", kind="harmless",
         edits=[("q, k, v, o, lse = ctx.saved_tensors",
                 "q, k, v, o, lse = ctx.saved_tensors\n        do = do.contiguous()")],
         truth="dO copied to a contiguous tensor before the kernels: an unneeded copy, still correct."),

    # ============================================================== 07 lazy backward
    dict(id="T07_delta_shortcut", exercise="07", kind="bug",
         edits=[("delta = (P * dP).sum(-1, keepdim=True)", "delta = (do * O).sum(-1, keepdim=True)")],
         truth="FlashAttention's shortcut delta = rowsum(dO * O) is used; with O = A V it is off by "
               "c_i * rowsum(dP)_i, so dQ, dK, dbias are wrong whenever tau != 0 (dV, dtau right)."),
    dict(id="T07_gate_not_causal", exercise="07", kind="bug",
         edits=[("gate = causal & (P + c[:, None] > 0)", "gate = P + c[:, None] > 0")],
         truth="The ReLU gate is not restricted to visible entries: with tau > 0 the hidden entries j > i "
               "pass dA into dP, which leaves dS alone (P = 0 there) but adds spurious terms to dtau."),
    dict(id="T07_dbias_upper_diagonals", exercise="07", kind="bug",
         edits=[("torch.diagonal(dS, offset=-d)", "torch.diagonal(dS, offset=d)")],
         truth="dbias sums the diagonals above the main one (offset=+d, where j - i = d, all zero under the "
               "causal mask) instead of below (i - j = d): dbias[0] right, dbias[d>0] zero."),
    dict(id="T07_dbias_from_dP", exercise="07", kind="bug",
         edits=[("torch.diagonal(dS, offset=-d).sum()", "torch.diagonal(dP, offset=-d).sum()")],
         truth="dbias sums diagonals of dP instead of dS: the bias enters S, before the softmax, so its "
               "gradient needs the softmax Jacobian (dS); dbias wrong, everything else right."),
    dict(id="T07_dtau_no_divide", exercise="07", kind="bug",
         edits=[("dtau = (dP.sum(-1) / (i + 1)).sum()", "dtau = dP.sum()")],
         truth="dtau sums dP without the 1/(i+1) factor of c_i = tau/(i+1): dtau wrong, the rest right."),
    dict(id="T07_c_column_broadcast", exercise="07", kind="bug",
         edits=[("gate = causal & (P + c[:, None] > 0)", "gate = causal & (P + c[None, :] > 0)")],
         truth="c = tau/(i+1) is broadcast along the columns (indexed by key j) instead of per query row i, "
               "so the ReLU gate is evaluated at the wrong threshold (matters when tau < 0 clips entries)."),
    dict(id="T07_dv_uses_P", exercise="07", kind="bug",
         edits=[("dv = A.T @ do", "dv = P.T @ do")],
         truth="dV = P^T dO as in standard attention instead of A^T dO: O = A V here, so dV is wrong when "
               "tau != 0 (the other gradients are right)."),
    dict(id="T07_dbias_range_W", exercise="07", kind="bug",
         edits=[("for d in range(W + 1)])", "for d in range(W)])")],
         truth="Off-by-one: dbias has W entries instead of W + 1 (distances 0..W inclusive), so its shape is "
               "wrong and the last distance's gradient is missing."),
    dict(id="T07_dA_transposed", exercise="07", kind="bug",
         edits=[("dA = do @ v.T", "dA = v @ do.T")],
         truth="dA computed as V dO^T, the transpose of dO V^T (both L x L, so no shape error): dP, dS and all "
               "gradients except dV wrong."),
    dict(id="H07_no_diag_guard", exercise="07", kind="harmless",
         edits=[("dbias = torch.stack([torch.diagonal(dS, offset=-d).sum() if d < L else dS.new_zeros(())\n"
                 "                         for d in range(W + 1)])",
                 "dbias = torch.stack([torch.diagonal(dS, offset=-d).sum() for d in range(W + 1)])")],
         truth="Without the d < L guard: torch.diagonal with an offset past the matrix is empty and sums to 0, "
               "so still correct."),

    # ============================================================== 09m visible_mask
    dict(id="T09m_left_edge_strict", exercise="09m", kind="bug",
         edits=[("seen &= j >= i - left", "seen &= j > i - left")],
         truth="The left edge is exclusive (j > i - left): key i - left, which the window includes, is hidden."),
    dict(id="T09m_right_edge_strict", exercise="09m", kind="bug",
         edits=[("seen &= j <= i + right", "seen &= j < i + right")],
         truth="The right edge is exclusive (j < i + right): key i + right is hidden; with right = 0 the "
               "diagonal itself disappears."),
    dict(id="T09m_zero_means_unlimited", exercise="09m", kind="bug",
         edits=[("if left >= 0:", "if left > 0:")],
         truth="left = 0 is treated as 'no limit' (test > 0 instead of >= 0): windows (0, r) see all past keys "
               "instead of none."),
    dict(id="T09m_sides_swapped", exercise="09m", kind="bug",
         edits=[("left, right = window", "right, left = window")],
         truth="window is unpacked as (right, left): the mask is mirrored (asymmetric windows wrong, e.g. the "
               "causal (-1, 0) becomes anti-causal)."),
    dict(id="T09m_bottom_right_aligned", exercise="09m", kind="bug",
         edits=[("i = torch.arange(S_q)[:, None]", "i = torch.arange(S_q)[:, None] + (S_k - S_q)")],
         truth="Query positions are shifted by S_k - S_q (bottom-right alignment as in FlashAttention-2) "
               "instead of the course's top-left alignment: wrong only when S_q != S_k."),
    dict(id="T09m_no_left_guard", exercise="09m", kind="bug",
         edits=[("    if left >= 0:\n        seen &= j >= i - left", "    seen &= j >= i - left")],
         truth="The left comparison is applied even when left = -1 (no limit): it becomes j >= i + 1 and "
               "hides the past and the diagonal."),
    dict(id="T09m_axes_swapped", exercise="09m", kind="bug",
         edits=[("i = torch.arange(S_q)[:, None]\n    j = torch.arange(S_k)[None, :]",
                 "i = torch.arange(S_q)[None, :]\n    j = torch.arange(S_k)[:, None]")],
         truth="Query positions are laid along columns and keys along rows: a transposed [S_k, S_q] pattern "
               "(error when S_q != S_k, the transposed mask when square)."),
    dict(id="H09m_distance_form", exercise="09m", kind="harmless",
         edits=[("seen &= j >= i - left", "seen &= (i - j) <= left"),
                ("seen &= j <= i + right", "seen &= (j - i) <= right")],
         truth="The two edges written as distances, i - j <= left and j - i <= right: the same mask."),

    # ============================================================== 09b packed backward
    dict(id="T09b_seq_head_number", exercise="09b", kind="bug",
         edits=[("first_seq_head=b * H)", "first_seq_head=b)")],
         truth="The dropout mask is drawn with (sequence, head) number b + h instead of b*H + h: for b > 0 "
               "and H > 1 the backward uses different bits than the forward; wrong only with dropout."),
    dict(id="T09b_lse_not_transposed", exercise="09b", kind="bug",
         edits=[("lse[qs].T, keep", "lse[qs], keep")],
         truth="The packed LSE slice [S_q, H] is passed without transposing to the [H, S_q] layout "
               "sequence_backward expects: a broadcasting error or the wrong row/head LSE."),
    dict(id="T09b_mask_global_positions", exercise="09b", kind="bug",
         edits=[("seen = visible_mask(S_q, S_k, window).to(q.device)",
                 "seen = visible_mask(int(cu_q[-1]), int(cu_k[-1]), window)[qs, ks].to(q.device)")],
         truth="The window mask is built over packed (global) positions and sliced, so positions do not "
               "restart at 0 in each sequence: wrong with a window whenever a sequence's query and key "
               "offsets differ."),
    dict(id="T09b_dropout_no_rescale", exercise="09b", kind="bug",
         edits=[("z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = keep.to(q.dtype)")],
         truth="The dropout mask is used without the 1/(1-p) rescale: dV and dP are too small by (1-p); "
               "right only when p = 0."),
    dict(id="T09b_ds_dropped_P", exercise="09b", kind="bug",
         edits=[("ds = P * (dp - delta)", "ds = (P * z) * (dp - delta)")],
         truth="dS uses the dropped, rescaled P instead of the softmax's own P: dQ and dK wrong with dropout "
               "(dV right)."),
    dict(id="T09b_dp_no_dropout", exercise="09b", kind="bug",
         edits=[("dp = (do @ v.transpose(-1, -2)) * z", "dp = do @ v.transpose(-1, -2)")],
         truth="dP misses the dropout factor Z/(1-p) (the chain rule meets dropout in dV and dP): dQ and dK "
               "wrong with dropout, dV right."),
    dict(id="T09b_dk_rows_of_q", exercise="09b", kind="bug",
         edits=[("dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)",
                 "dq[qs], dk[qs], dv[ks] = (heads(t) for t in g)")],
         truth="dK is written back into the query rows (slice qs) instead of the key rows ks: a shape error "
               "or misplaced rows when the packed query and key offsets differ."),
    dict(id="T09b_last_sequence_skipped", exercise="09b", kind="bug",
         edits=[("for b in range(len(cu_q) - 1):", "for b in range(len(cu_q) - 2):")],
         truth="Off-by-one in the sequence loop: the last sequence of the packed batch is never processed and "
               "its gradients stay zero."),
    dict(id="T09b_heads_reshape", exercise="09b", kind="bug",
         edits=[("heads = lambda t: t.transpose(0, 1)",
                 "heads = lambda t: t.reshape(t.shape[1], t.shape[0], t.shape[2])")],
         truth="[S, H, D] -> [H, S, D] done with reshape instead of transpose: the tokens and heads are "
               "scrambled (right only when H = 1 or S = 1)."),
    dict(id="H09b_delta_from_P_dp", exercise="09b", kind="harmless",
         edits=[("delta = (do * o).sum(-1, keepdim=True)", "delta = (P * dp).sum(-1, keepdim=True)")],
         truth="delta = rowsum(P * dP) with dP already carrying Z/(1-p) equals rowsum(dO * O): still correct."),
]
