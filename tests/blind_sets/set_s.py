"""Blind set S (2026-11-24): 77 mistakes and 10 harmless rewrites, written like set R but asked for
mistakes *unlike* set R's. Same format and runner as set R (``python tests/blind_sets/run.py s``).
"""

V = []


def bug(id, ex, edits, truth):
    V.append(dict(id=id, exercise=ex, kind="bug", edits=edits, truth=truth))


def ok(id, ex, edits, truth):
    V.append(dict(id=id, exercise=ex, kind="harmless", edits=edits, truth=truth))


_MASK = '        S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))'

# ------------------------------------------------------------------ 01 attention_backward
bug("S01_mask_after_softmax", "01",
    [("    if causal:\n" + _MASK + "\n    P = torch.softmax(S, dim=-1)\n",
      "    P = torch.softmax(S, dim=-1)\n    if causal:\n"
      "        P = P.masked_fill(~causal_mask(P.shape[-2], P.shape[-1], P.device), 0.0)\n")],
    "The causal mask is applied to P after the softmax (hidden entries zeroed) instead of to S before it: "
    "rows are no longer normalised over the visible keys, so P (and dV, dQ, dK) is wrong in every causal case; "
    "non-causal cases are right.")
bug("S01_ds_precedence", "01",
    [("dS = P * (dP - delta)", "dS = P * dP - delta")],
    "Parentheses dropped: dS = P*dP - delta instead of P*(dP - delta), so delta is subtracted from every "
    "entry (hidden ones too) without the factor P; dV right, dQ and dK wrong.")
bug("S01_delta_mean", "01",
    [("delta = (do * o).sum(dim=-1, keepdim=True)", "delta = (do * o).mean(dim=-1, keepdim=True)")],
    "delta is a mean over the head dimension (rowsum / D) instead of the row sum of dO*O: dV right, dQ and "
    "dK wrong in every case.")
bug("S01_grad_order", "01",
    [("return dq, dk, dv", "return dq, dv, dk")],
    "The gradients are returned as (dq, dv, dk): dK and dV (same shapes) are swapped; dQ is right.")
bug("S01_view_noncontiguous", "01",
    [("    S = (q @ k.transpose(-1, -2)) * scale\n",
      "    B, H, S_q, D = q.shape\n"
      "    S = torch.bmm(q.view(B * H, S_q, D), k.view(B * H, -1, D).transpose(1, 2)).view(B, H, S_q, -1) * scale\n")],
    "Batch and head are flattened with .view for a bmm: .view fails on non-contiguous inputs (q/k stored "
    "[B, S, H, D] and transposed), raising in the strided cases; right on contiguous inputs. Use reshape or "
    "plain batched @.")
bug("S01_causal_mask_args_swapped", "01",
    [("causal_mask(S.shape[-2], S.shape[-1], S.device)", "causal_mask(S.shape[-1], S.shape[-2], S.device)")],
    "causal_mask is called with (S_k, S_q) instead of (S_q, S_k): identical when S_q == S_k, a shape "
    "(broadcast) error in causal cases with S_q != S_k.")
bug("S01_delta_over_queries", "01",
    [("delta = (do * o).sum(dim=-1, keepdim=True)", "delta = (P * dP).sum(dim=-2, keepdim=True)")],
    "delta written as the P-weighted sum of dP but over the query axis (dim=-2, one value per key column) "
    "instead of over the keys (one per query row): broadcasts silently; dV right, dQ and dK wrong.")
bug("S01_scale_divided", "01",
    [("    S = (q @ k.transpose(-1, -2)) * scale", "    S = (q @ k.transpose(-1, -2)) / scale")],
    "The scores are divided by scale (the '/ sqrt(D)' habit applied to scale = 1/sqrt(D)) instead of "
    "multiplied: P is wrong, so every gradient is wrong in every case.")
ok("S01_ds_inplace_on_p", "01",
    [("dS = P * (dP - delta)", "dS = P.mul_(dP - delta)        # P is not needed any more")],
    "Harmless: dS computed in place in P's storage; P was already used for dV and is not read again, and "
    "P is a fresh local tensor (no input is modified).")
ok("S01_dq_einsum", "01",
    [("dq = (dS @ k) * scale", "dq = torch.einsum('...qk,...kd->...qd', dS, k) * scale")],
    "Harmless: dQ = dS K written as an einsum over the key axis, the same contraction.")

# ------------------------------------------------------------------ 02p rebuild_p
bug("S02p_exp2", "02p",
    [("return torch.exp(S - lse[..., None])", "return torch.exp2(S - lse[..., None])")],
    "P rebuilt with exp2 while the LSE is a natural-log log-sum-exp: P = 2^(S - LSE) is wrong in every case "
    "(rows do not sum to 1).")
bug("S02p_no_mask", "02p",
    [("    if causal:\n" + _MASK + "\n", "")],
    "The causal flag is ignored (no mask when rebuilding S): hidden keys get exp(S - LSE) > 0 instead of 0; "
    "wrong in every causal case, right otherwise.")
bug("S02p_lse_divided", "02p",
    [("return torch.exp(S - lse[..., None])", "return torch.exp(S) / lse[..., None]")],
    "P computed as exp(S) / LSE (dividing by the log-sum-exp itself) instead of exp(S - LSE) = exp(S) / "
    "exp(LSE): wrong in every case.")
bug("S02p_mask_inverted", "02p",
    [("S.masked_fill(~causal_mask(", "S.masked_fill(causal_mask(")],
    "The ~ is missing: the visible keys j <= i are set to -inf and the hidden ones kept, so P is zero where "
    "it should be nonzero and vice versa; causal cases only.")
bug("S02p_row_max_not_lse", "02p",
    [("return torch.exp(S - lse[..., None])", "return torch.exp(S - S.amax(dim=-1, keepdim=True))")],
    "The row maximum is subtracted (the stable-softmax trick) instead of the LSE, and nothing normalises: "
    "P = exp(S - max) is unnormalised (row sums > 1) in every case; the lse argument is ignored.")
bug("S02p_tril_mask", "02p",
    [(_MASK, "        S = S.tril()")],
    "Causal masking with S.tril(), which sets hidden scores to 0 rather than -inf, so hidden keys get "
    "P = exp(0 - LSE) > 0; causal cases only.")
bug("S02p_k_dot_T", "02p",
    [("S = (q @ k.transpose(-1, -2)) * scale", "S = (q @ k.T) * scale")],
    "k.T on a 4-D tensor reverses all four axes ([D, S_k, H, B]) instead of transposing the last two: a "
    "matmul shape error (or garbage) in every case; the batched transpose is k.transpose(-1, -2) / k.mT.")
bug("S02p_returns_log_p", "02p",
    [("return torch.exp(S - lse[..., None])", "return S - lse[..., None]")],
    "The exp is forgotten: returns log P = S - LSE (and -inf on hidden keys) instead of P.")
ok("S02p_mT_unsqueeze", "02p",
    [("S = (q @ k.transpose(-1, -2)) * scale", "S = torch.matmul(q, k.mT) * scale"),
     ("return torch.exp(S - lse[..., None])", "return (S - lse.unsqueeze(-1)).exp()")],
    "Harmless: the batched transpose written as k.mT with torch.matmul, and the LSE column as "
    "lse.unsqueeze(-1) with Tensor.exp(); the same computation.")

# ------------------------------------------------------------------ 02o online_softmax_forward
bug("S02o_alpha_on_new", "02o",
    [("l = l * alpha + p.sum(dim=-1, keepdim=True)", "l = l + alpha * p.sum(dim=-1, keepdim=True)"),
     ("acc = acc * alpha + p @ vb", "acc = acc + alpha * (p @ vb)")],
    "alpha multiplies the new block's terms instead of the old running sums l and acc: the first block "
    "(alpha = exp(-inf) = 0) contributes nothing, so O and LSE are wrong (NaN/inf with one block).")
bug("S02o_not_normalized", "02o",
    [("return (acc / l).to(q.dtype), ", "return acc.to(q.dtype), ")],
    "O returned as the unnormalised accumulator acc, without the final division by l: O wrong, LSE right.")
bug("S02o_lse_missing_log", "02o",
    [("(m + torch.log(l)).squeeze(-1)", "(m + l).squeeze(-1)")],
    "LSE returned as m + l instead of m + log(l): O right, LSE wrong in every case.")
bug("S02o_unscaled", "02o",
    [("s = (q.float() @ kb.transpose(-1, -2)) * scale", "s = q.float() @ kb.transpose(-1, -2)")],
    "The scores in the online loop are not multiplied by scale: O and LSE are those of unscaled attention, "
    "wrong in every case.")
bug("S02o_acc_not_rescaled", "02o",
    [("acc = acc * alpha + p @ vb", "acc = acc + p @ vb")],
    "The running output acc is not rescaled by alpha when the max grows (l is): right with one key block, "
    "O wrong with several blocks (LSE right).")
bug("S02o_block_max_only", "02o",
    [("m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))", "m_new = s.amax(dim=-1, keepdim=True)")],
    "m_new is the current block's maximum only, not max(running m, block max): algebraically consistent, "
    "but a block whose keys are all hidden (causal, rows before the block) gives m_new = -inf, "
    "alpha = exp(+inf) and p = exp(-inf + inf) = NaN; non-causal cases (and causal with one block) are "
    "right, causal with several key blocks gives NaN.")
bug("S02o_loop_drops_partial_block", "02o",
    [("for start in range(0, S_k, block_n):", "for start in range(0, S_k - block_n + 1, block_n):")],
    "The loop only visits full blocks (stop S_k - block_n + 1): the partial last key block is skipped "
    "when S_k is not a multiple of block_n, so its keys are missing from O and LSE.")
bug("S02o_fp16_matmul_mixed", "02o",
    [("s = (q.float() @ kb.transpose(-1, -2)) * scale", "s = (q @ kb.transpose(-1, -2)) * scale")],
    "q is not cast to fp32 while kb is: fine for fp32 inputs, but with fp16/bf16 inputs the matmul mixes "
    "dtypes and raises (expected both operands to have the same dtype).")
bug("S02o_rows_from_S_k", "02o",
    [("rows = torch.arange(S_q, device=q.device)[:, None]", "rows = torch.arange(S_k, device=q.device)[:, None]")],
    "The query positions for the causal mask are built with S_k instead of S_q: right when S_q == S_k, a "
    "broadcast error in causal cases with S_q != S_k.")
ok("S02o_mask_with_where", "02o",
    [('s = s.masked_fill(cols > rows, float("-inf"))', 's = torch.where(cols <= rows, s, float("-inf"))')],
    "Harmless: the causal mask written as torch.where keeping cols <= rows, the same -inf fill.")

# ------------------------------------------------------------------ 03 dQ kernel
bug("S03_do_with_q_head_stride", "03",
    [("do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h",
      "do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_q_h")],
    "dO's head offset uses Q's head stride (stride_q_h): right when dO and Q share a layout, wrong when "
    "they differ (Q stored [B, S, H, D] transposed, or dO of stride 0 from out.sum()).")
bug("S03_dq_not_accumulated", "03",
    [("dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)",
      "dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)")],
    "dq = instead of dq +=: each key block overwrites the accumulator, so only the last block visited "
    "survives; right only when there is a single key block.")
bug("S03_scores_unscaled", "03",
    [("s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale",
      "s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)")],
    "The scores are rebuilt without the scale, so P = exp(QK^T - LSE) does not match the forward's LSE: "
    "dQ wrong in every case (the final * scale is still there).")
bug("S03_exp2_natural_lse", "03",
    [("p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)",
      "p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)")],
    "tl.exp2 is used with the natural-log LSE (the forward's base-2 trick copied without converting "
    "scores/LSE by log2(e)): P wrong, dQ wrong in every case.")
bug("S03_store_without_row_mask", "03",
    [("             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])",
      "             dq.to(DQ.dtype.element_ty), mask=d_ok[None, :])")],
    "The dQ store is masked by the head dimension only, not by row_ok: the padded rows of the last query "
    "block are written past S_q (into the next head's rows or past the end of dQ) whenever S_q is not a "
    "multiple of BLOCK; an out-of-bounds write.")
bug("S03_loop_full_blocks_only", "03",
    [("for start_n in range(0, kv_end, BLOCK_N):", "for start_n in range(0, kv_end - BLOCK_N + 1, BLOCK_N):")],
    "The key loop stops before a partial last key block (stop kv_end - BLOCK_N + 1): keys in the last, "
    "partial block are never visited; wrong whenever S_k (or the causal bound) is not a block multiple.")
bug("S03_ds_precedence", "03",
    [("ds = p * (dp - delta[:, None])", "ds = p * dp - delta[:, None]")],
    "Parentheses dropped: dS = P*dP - delta, so delta is subtracted on every (also hidden) entry without "
    "the factor P; dQ wrong in every case.")
bug("S03_k_load_no_dim_mask", "03",
    [("        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,\n"
      "                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)",
      "        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,\n"
      "                    mask=col_ok[:, None], other=0.0)")],
    "K is loaded without the head-dimension mask d_ok: when D is not a power of two (BLOCK_D > D) the padded "
    "columns read the next row / past the end of K (NaN there poisons S = Q K^T); right when D == BLOCK_D.")
bug("S03_delta_from_lse_pointer", "03",
    [("delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)",
      "delta = tl.load(lse_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)")],
    "Copy-paste: delta is loaded through LSE's base pointer, so dS = P*(dP - LSE): dQ wrong in every case.")
ok("S03_p_without_row_mask", "03",
    [("visible = row_ok[:, None] & col_ok[None, :]", "visible = col_ok[None, :]")],
    "Harmless: row_ok dropped from P's mask; padded query rows compute garbage only in their own rows of "
    "the accumulator, which the masked store never writes.")

# ------------------------------------------------------------------ 04 dK/dV kernel
bug("S04_delta_forgotten", "04",
    [("dsT = pT * (dpT - delta[None, :])", "dsT = pT * dpT")],
    "delta is left out of dS^T = P^T * (dP^T - delta): dV right, dK wrong in every case.")
bug("S04_dv_from_p_not_pT", "04",
    [("dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)",
      "dv += tl.dot(tl.trans(pT).to(do.dtype), do, input_precision=DOT_PRECISION)")],
    "dV accumulated from the tile of P (transposing the already transposed pT) instead of P^T: runs because "
    "BLOCK_M == BLOCK_N, but dV is wrong; dK right.")
bug("S04_offs_m_from_pid", "04",
    [("offs_m = start_m + tl.arange(0, BLOCK_M)", "offs_m = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)")],
    "The query rows are computed from the program id instead of the loop variable start_m: every iteration "
    "revisits the same query block; wrong dK/dV whenever there is more than one query block or pid_n > 0.")
bug("S04_group_loop_short", "04",
    [("for g in range(0, GROUP_SIZE):", "for g in range(0, GROUP_SIZE - 1):")],
    "Off-by-one in the loop over the GQA group (range(GROUP_SIZE - 1)): the last query head of each group "
    "is skipped, and without GQA the loop never runs so dK = dV = 0.")
bug("S04_dk_stored_through_dv", "04",
    [("dk_base = DK + b.to(tl.int64) * stride_dk_b + h_kv.to(tl.int64) * stride_dk_h",
      "dk_base = DV + b.to(tl.int64) * stride_dk_b + h_kv.to(tl.int64) * stride_dk_h")],
    "Copy-paste: dK's base pointer is built from DV, so dK is written into dV (then overwritten by dV's "
    "store) and dK itself is never stored.")
bug("S04_group_head_h_kv_plus_g", "04",
    [("h = h_kv * GROUP_SIZE + g", "h = h_kv + g")],
    "The group's query heads are numbered h_kv + g instead of h_kv*GROUP_SIZE + g: right without GQA "
    "(GROUP_SIZE = 1), groups overlap and the wrong query heads are summed when GROUP_SIZE > 1 and H_KV > 1.")
bug("S04_v_loaded_with_k_strides", "04",
    [("    v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,",
      "    v = tl.load(v_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,")],
    "V's tile is addressed with K's sequence/dim strides (copy-paste): right when K and V share a layout, "
    "wrong dK when V has different strides than K (e.g. V stored [B, S, H, D], K contiguous).")
bug("S04_grid_over_queries", "04",
    [("grid = (triton.cdiv(S_k, BLOCK), B * H_kv)", "grid = (triton.cdiv(S_q, BLOCK), B * H_kv)")],
    "The launcher's grid counts query blocks (cdiv(S_q, BLOCK)) instead of key blocks: when S_q < S_k the "
    "last key blocks get no program (dK, dV never written there); when S_q > S_k extra programs do nothing.")
bug("S04_dk_not_accumulated", "04",
    [("dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)",
      "dk = tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)")],
    "dk = instead of dk +=: only the last query block (of the last group head) survives in dK; dV right.")
ok("S04_pT_without_row_mask", "04",
    [("visible = row_ok[None, :] & col_ok[:, None]", "visible = col_ok[:, None]")],
    "Harmless here: without row_ok padded query rows get P = exp(0 - 0) = 1, but their dO, delta load as 0 "
    "(masked loads, other=0), so they add nothing to dV or dK.")

# ------------------------------------------------------------------ 05 autograd.Function
bug("S05_grad_order", "05",
    [("return dq, dk, dv, None, None", "return dq, dv, dk, None, None")],
    "backward returns (dq, dv, dk, ...): K receives dV and V receives dK (same shapes, so no error); O and "
    "dQ right.")
bug("S05_dq_not_causal", "05",
    [("dq = flashattn.attention_backward_dq(q, k, v, do, lse, delta, ctx.causal, ctx.scale)",
      "dq = flashattn.attention_backward_dq(q, k, v, do, lse, delta, scale=ctx.scale)")],
    "causal is not passed to the dQ kernel (defaults to False): in causal cases dQ includes hidden keys; "
    "O, dK, dV right; non-causal cases right.")
bug("S05_lse_delta_swapped", "05",
    [("dq = flashattn.attention_backward_dq(q, k, v, do, lse, delta, ctx.causal, ctx.scale)",
      "dq = flashattn.attention_backward_dq(q, k, v, do, delta, lse, ctx.causal, ctx.scale)")],
    "lse and delta passed to the dQ kernel in swapped positions: dQ wrong in every case, dK and dV right.")
bug("S05_dq_guard_wrong_index", "05",
    [("if ctx.needs_input_grad[0]:", "if ctx.needs_input_grad[1]:")],
    "dQ is guarded by needs_input_grad[1] (k) instead of [0] (q): when q needs a gradient but k does not, "
    "dQ comes back None (q.grad missing).")
bug("S05_forward_not_causal", "05",
    [("o, lse = flashattn.attention_forward(q, k, v, causal, scale)",
      "o, lse = flashattn.attention_forward(q, k, v, scale=scale)")],
    "causal is not passed to the forward kernel: O (and the saved LSE) are non-causal in causal cases, so "
    "the output and all gradients are wrong there; non-causal cases right.")
bug("S05_dkdv_default_scale", "05",
    [("dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal, ctx.scale)",
      "dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal)")],
    "The scale is not passed to the dK/dV kernel, which then uses the default 1/sqrt(D): right when the "
    "default scale is used, dK and dV wrong with a custom scale.")
bug("S05_save_non_tensors", "05",
    [("ctx.save_for_backward(q, k, v, o, lse)", "ctx.save_for_backward(q, k, v, o, lse, causal, scale)"),
     ("q, k, v, o, lse = ctx.saved_tensors", "q, k, v, o, lse, causal, scale = ctx.saved_tensors")],
    "causal and scale (a bool and a float) are passed to ctx.save_for_backward, which accepts only tensors "
    "(or None): forward raises a TypeError in every case; they belong in plain ctx attributes.")
bug("S05_guard_inverted", "05",
    [("if ctx.needs_input_grad[0]:", "if not ctx.needs_input_grad[0]:")],
    "The needs_input_grad guard is inverted: dQ is computed only when q does not need it, so q.grad is "
    "None whenever q requires grad.")
bug("S05_delta_keepdim", "05",
    [("delta = flashattn.attention_backward_delta(o, do)", "delta = (do * o).sum(dim=-1, keepdim=True)")],
    "delta computed in PyTorch with keepdim=True, as in exercise 01: the kernels need [B, H, S_q] (one "
    "number per row), so they reject the [B, H, S_q, 1] tensor and every backward raises.")
ok("S05_guard_dkdv_too", "05",
    [("        dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal, ctx.scale)\n",
      "        dk = dv = None\n"
      "        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:\n"
      "            dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal, ctx.scale)\n")],
    "Harmless: the dK/dV kernel is skipped (None returned) when neither k nor v needs a gradient; whenever "
    "one does, both are computed as before.")

# ------------------------------------------------------------------ 07 lazy backward
bug("S07_gate_without_c", "07",
    [("gate = causal & (P + c[:, None] > 0)", "gate = causal & (P > 0)")],
    "The ReLU gate tests P > 0 instead of the ReLU's input P + tau/(i+1) > 0: with tau < 0 entries the ReLU "
    "clipped still pass gradient; right for tau >= 0. dQ, dK, dbias, dtau wrong for negative tau.")
bug("S07_delta_from_dA", "07",
    [("delta = (P * dP).sum(-1, keepdim=True)", "delta = (P * dA).sum(-1, keepdim=True)")],
    "delta summed from the ungated dA instead of the gated dP: differs wherever the ReLU clipped a visible "
    "entry (tau < 0); dQ, dK, dbias wrong then, dV and dtau right.")
bug("S07_ds_uses_A", "07",
    [("dS = P * (dP - delta)", "dS = A * (dP - delta)")],
    "The softmax Jacobian uses A = ReLU(P + c) instead of P: dS wrong whenever tau != 0 (dQ, dK, dbias); "
    "dV and dtau right.")
bug("S07_dtau_times_c", "07",
    [("dtau = (dP.sum(-1) / (i + 1)).sum()", "dtau = (dP.sum(-1) * c).sum()")],
    "dtau weights each row by c_i = tau/(i+1) (the value added) instead of dc_i/dtau = 1/(i+1): off by a "
    "factor tau (zero for tau = 0); only dtau is wrong.")
bug("S07_dbias_guard_off_by_one", "07",
    [("if d < L else dS.new_zeros(())", "if d < L - 1 else dS.new_zeros(())")],
    "Off-by-one in the guard: the diagonal d = L - 1 (the single corner cell dS[L-1, 0]) is replaced by 0; "
    "dbias wrong only when the window reaches it (W >= L - 1).")
bug("S07_dq_missing_scale", "07",
    [("dq = dS @ k * scale", "dq = dS @ k")],
    "dQ without its factor of scale (S = scale * QK^T + b): dQ too large by 1/scale; the rest right.")
bug("S07_dbias_diag_mean", "07",
    [("torch.diagonal(dS, offset=-d).sum()", "torch.diagonal(dS, offset=-d).mean()")],
    "Each diagonal is averaged instead of summed: bias[d] was added to every cell at distance d, so its "
    "gradient is the sum; dbias too small by the diagonal's length L - d.")
bug("S07_dA_transposed", "07",
    [("dA = do @ v.T", "dA = v @ do.T")],
    "dA computed as V dO^T (the transpose of dO V^T): runs because the matrix is square [L, L], but dP, dS "
    "and every gradient except dV are wrong.")
ok("S07_dtau_elementwise", "07",
    [("dtau = (dP.sum(-1) / (i + 1)).sum()", "dtau = (dP / (i[:, None] + 1)).sum()")],
    "Harmless: each entry of dP divided by its row's i + 1 and everything summed, the same total.")

# ------------------------------------------------------------------ 09m visible_mask
bug("S09m_left_sign", "09m",
    [("seen &= j >= i - left", "seen &= j >= i + left")],
    "Sign error on the left edge (j >= i + left): the window's left side moves to the right of the query; "
    "right only for left = 0 or left = -1.")
bug("S09m_right_sign", "09m",
    [("seen &= j <= i + right", "seen &= j <= i - right")],
    "Sign error on the right edge (j <= i - right): right only for right = 0 or -1.")
bug("S09m_rows_from_S_k", "09m",
    [("i = torch.arange(S_q)[:, None]", "i = torch.arange(S_k)[:, None]")],
    "Query positions built with S_k instead of S_q: right when S_q == S_k (or window (-1, -1)), a shape "
    "error (in-place &= cannot broadcast) when S_q != S_k.")
bug("S09m_float_ones", "09m",
    [("seen = torch.ones(S_q, S_k, dtype=torch.bool)", "seen = torch.ones(S_q, S_k)")],
    "The mask starts as a float tensor (dtype=torch.bool forgotten): &= with a bool comparison raises for "
    "float, and for window (-1, -1) a float tensor is returned instead of bool.")
bug("S09m_right_uses_left", "09m",
    [("seen &= j <= i + right", "seen &= j <= i + left")],
    "Copy-paste: the right edge uses left (j <= i + left): right only for symmetric windows.")
bug("S09m_minus_one_not_special", "09m",
    [("    if left >= 0:\n        seen &= j >= i - left\n    if right >= 0:\n        seen &= j <= i + right\n",
      "    seen &= j >= i - left\n    seen &= j <= i + right\n")],
    "-1 is not treated as 'no limit': both edges are always applied, so a side of -1 becomes j >= i + 1 "
    "(left) or j <= i - 1 (right); right only when both sides are >= 0.")
bug("S09m_one_based_queries", "09m",
    [("i = torch.arange(S_q)[:, None]", "i = torch.arange(1, S_q + 1)[:, None]")],
    "Query positions counted from 1 while keys count from 0: the whole window is shifted one key to the "
    "right; right only for (-1, -1).")
bug("S09m_causal_base", "09m",
    [("seen = torch.ones(S_q, S_k, dtype=torch.bool)", "seen = torch.ones(S_q, S_k, dtype=torch.bool).tril()")],
    "The mask starts from the causal triangle (tril) as if every window were causal: right for right = 0, "
    "wrong for right > 0 or right = -1.")
ok("S09m_triu_tril", "09m",
    [("        seen &= j >= i - left", "        seen = seen.triu(-left)"),
     ("        seen &= j <= i + right", "        seen = seen.tril(right)")],
    "Harmless: the two edges written with triu(diagonal=-left) (keeps j - i >= -left) and tril(diagonal=right) "
    "(keeps j - i <= right), which are the same inequalities, top-left aligned also for S_q != S_k.")

# ------------------------------------------------------------------ 09b packed_backward
bug("S09b_dv_without_dropout", "09b",
    [("dv = (P * z).transpose(-1, -2) @ do", "dv = P.transpose(-1, -2) @ do")],
    "dV uses the undropped P instead of P * Z/(1-p): right for p = 0, dV wrong for p > 0 (dQ, dK right).")
bug("S09b_rescale_multiplied", "09b",
    [("z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = keep.to(q.dtype) * (1.0 - dropout_p)")],
    "The dropout rescale multiplies by (1-p) instead of dividing: right for p = 0, dV, dQ, dK wrong for p > 0.")
bug("S09b_keep_inverted", "09b",
    [("z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = (~keep).to(q.dtype) / (1.0 - dropout_p)")],
    "keep read as a drop mask (inverted with ~): the kept entries get 0 and the dropped ones 1/(1-p); wrong "
    "in every case (with p = 0 everything is dropped).")
bug("S09b_dropout_mask_sq_sk_swapped", "09b",
    [("dropout_mask(seed, H, S_q, S_k, dropout_p", "dropout_mask(seed, H, S_k, S_q, dropout_p")],
    "dropout_mask called with (S_k, S_q): the mask is [H, S_k, S_q], a broadcast error in sequence_backward "
    "for any sequence with S_q != S_k (even with p = 0); identical (harmless) when every sequence is square.")
bug("S09b_lse_not_transposed", "09b",
    [("lse[qs].T, keep", "lse[qs], keep")],
    "The sequence's LSE is passed as [S_q, H] (packed layout) instead of [H, S_q]: a broadcast error (or "
    "the wrong row's LSE) inside sequence_backward.")
bug("S09b_heads_by_reshape", "09b",
    [("heads = lambda t: t.transpose(0, 1)", "heads = lambda t: t.reshape(t.shape[1], t.shape[0], t.shape[2])")],
    "The head axis is moved first with reshape instead of transpose: [S, H, D] -> [H, S, D] by reshape "
    "reinterprets memory and scrambles tokens and heads; wrong whenever H > 1.")
bug("S09b_p_masked_with_neg_inf", "09b",
    [("P = P.masked_fill(~seen, 0.0)", "P = P.masked_fill(~seen, float(\"-inf\"))")],
    "The window's hidden entries of P (a probability, after the exp) are filled with -inf instead of 0: the "
    "-inf belongs in S before the exp. dV, dP * P and dS become -inf/NaN wherever the window hides a key; "
    "right only for the window (-1, -1).")
bug("S09b_writeback_q_offsets", "09b",
    [("dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)", "dq[qs], dk[qs], dv[qs] = (heads(t) for t in g)")],
    "dK and dV are written back at the query offsets qs instead of the key offsets ks: right when "
    "cu_seqlens_q == cu_seqlens_k, a shape error or misplaced rows otherwise.")
bug("S09b_p_unscaled", "09b",
    [("P = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])",
      "P = torch.exp(q @ k.transpose(-1, -2) - lse[..., None])")],
    "P is rebuilt from unscaled scores: exp(QK^T - LSE) does not match the LSE of the scaled scores, so every "
    "gradient is wrong.")
ok("S09b_mask_scores_first", "09b",
    [("    P = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])\n    P = P.masked_fill(~seen, 0.0)\n",
      "    S = torch.where(seen, q @ k.transpose(-1, -2) * scale, float(\"-inf\"))\n"
      "    P = torch.exp(S - lse[..., None])\n")],
    "Harmless: the hidden scores are set to -inf before the exp instead of zeroing P after it; exp(-inf - LSE) "
    "= 0, also on rows that see no key (LSE = +inf).")

VARIANTS = V
