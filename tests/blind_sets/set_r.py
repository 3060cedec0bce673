"""Blind set R (2026-11-24): 71 single realistic learner mistakes (kind "bug") and 13 still-correct
rewrites (kind "harmless") of the worked solutions, written by a helper that had read the lessons,
exercises and solutions but not the checker, and verified against float64 references. Each variant's
edits (old, new) apply in order to the exercise's solution code as tests/conftest.solution loads it;
each old occurs exactly once. Run with ``python tests/blind_sets/run.py r`` (see run.py).
"""

V = []


def bug(id, ex, edits, truth):
    V.append(dict(id=id, exercise=ex, kind="bug", edits=edits, truth=truth))


def ok(id, ex, edits, truth):
    V.append(dict(id=id, exercise=ex, kind="harmless", edits=edits, truth=truth))


_MASK01 = '        S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))'

# ------------------------------------------------------------------ 01 attention_backward
bug("R01_causal_bottom_right", "01",
    [(_MASK01,
      '        S_q, S_k = S.shape[-2], S.shape[-1]\n'
      '        hidden = torch.ones(S_q, S_k, dtype=torch.bool, device=S.device).triu(S_k - S_q + 1)\n'
      '        S = S.masked_fill(hidden, float("-inf"))')],
    "The causal mask is built bottom-right aligned (triu with diagonal S_k - S_q + 1, the flash-attn "
    "convention) instead of the course's top-left j <= i; identical when S_q == S_k, wrong (NaN rows when "
    "S_q > S_k) in the causal cases with S_q != S_k.")
bug("R01_delta_no_keepdim", "01",
    [("delta = (do * o).sum(dim=-1, keepdim=True)", "delta = (do * o).sum(dim=-1)")],
    "delta is summed without keepdim, so [B,H,S_q] is right-aligned against dP [B,H,S_q,S_k] instead of "
    "being a per-row column: a broadcast shape error in general (silently wrong, delta indexed by key, "
    "only when the shapes happen to line up); dV would be right.")
bug("R01_softmax_over_queries", "01",
    [("P = torch.softmax(S, dim=-1)", "P = torch.softmax(S, dim=-2)")],
    "The softmax is taken over dim=-2 (over the queries, column-normalised) instead of over the keys; "
    "P is wrong so dV, dQ and dK all are.")
bug("R01_dv_from_o", "01",
    [("dv = P.transpose(-1, -2) @ do", "dv = P.transpose(-1, -2) @ o")],
    "dV is computed as P^T O (the output) instead of P^T dO; dQ and dK stay right, only dV is wrong "
    "(wrong operand, O in place of dO).")
bug("R01_prescaled_q_reused", "01",
    [("    S = (q @ k.transpose(-1, -2)) * scale",
      "    q = q * scale                               # fold the scale into Q once\n"
      "    S = q @ k.transpose(-1, -2)")],
    "The scale is folded into q for S, but the rebound (scaled) q is then reused in dK = dS^T Q * scale, "
    "so dK carries scale twice (ratio = scale); dQ and dV are right.")
bug("R01_ignores_scale_arg", "01",
    [("    S = (q @ k.transpose(-1, -2)) * scale",
      "    scale = 1.0 / math.sqrt(q.shape[-1])\n    S = (q @ k.transpose(-1, -2)) * scale")],
    "The scale argument is overwritten with the default 1/sqrt(D); correct whenever the default is "
    "passed, wrong in every gradient when a custom scale is given.")
bug("R01_dk_ds_not_transposed", "01",
    [("dk = (dS.transpose(-1, -2) @ q) * scale", "dk = (dS @ q) * scale")],
    "dK uses dS instead of dS^T; raises a shape error when S_q != S_k and gives a wrong dK (the transpose "
    "of the right contraction) when S_q == S_k. dQ and dV are fine.")
bug("R01_dp_from_dv", "01",
    [("dP = do @ v.transpose(-1, -2)", "dP = do @ dv.transpose(-1, -2)")],
    "dP is computed from the freshly computed dv instead of v (dO dV^T instead of dO V^T); dV is right, "
    "dQ and dK are wrong.")
ok("R01_delta_from_p_dp", "01",
    [("delta = (do * o).sum(dim=-1, keepdim=True)", "delta = (P * dP).sum(dim=-1, keepdim=True)")],
    "Harmless: delta as rowsum(P * dP), which equals rowsum(dO * O) exactly (O = P V).")
ok("R01_dk_double_transpose", "01",
    [("dk = (dS.transpose(-1, -2) @ q) * scale", "dk = (q.transpose(-1, -2) @ dS).transpose(-1, -2) * scale")],
    "Harmless: dK written as (Q^T dS)^T * scale, equal to dS^T Q * scale.")

# ------------------------------------------------------------------ 02p rebuild_p
_MASK02 = _MASK01
bug("R02p_lse_broadcast_keys", "02p",
    [("return torch.exp(S - lse[..., None])", "return torch.exp(S - lse[..., None, :])")],
    "lse is unsqueezed on the wrong axis ([..., 1, S_q]) so each LSE is subtracted along a row of keys "
    "instead of down its query row: shape error when S_q != S_k, wrong P when S_q == S_k.")
bug("R02p_default_scale", "02p",
    [("S = (q @ k.transpose(-1, -2)) * scale", "S = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])")],
    "S is rebuilt with 1/sqrt(D) instead of the scale argument: right only when the default scale is "
    "passed; with a custom scale P no longer matches the forward's LSE (rows do not sum to 1).")
bug("R02p_mask_bottom_right", "02p",
    [(_MASK02,
      '        S_q, S_k = S.shape[-2], S.shape[-1]\n'
      '        hidden = torch.ones(S_q, S_k, dtype=torch.bool, device=S.device).triu(S_k - S_q + 1)\n'
      '        S = S.masked_fill(hidden, float("-inf"))')],
    "Causal mask bottom-right aligned (triu diagonal S_k - S_q + 1) instead of the top-left j <= i; "
    "wrong only in causal cases with S_q != S_k.")
bug("R02p_mask_hides_diagonal", "02p",
    [(_MASK02, '        S = S.masked_fill(torch.ones_like(S, dtype=torch.bool).triu(), float("-inf"))')],
    "Hand-built causal mask with triu() (diagonal=0), which hides the diagonal j == i as well: row 0 "
    "becomes all zero and every row loses its diagonal entry (strict mask, off by one).")
bug("R02p_qk_swapped", "02p",
    [("S = (q @ k.transpose(-1, -2)) * scale", "S = (k @ q.transpose(-1, -2)) * scale")],
    "Scores computed as K Q^T (S transposed): shape errors when S_q != S_k, and a wrong (transposed) P "
    "when S_q == S_k.")
bug("R02p_scale_after_lse", "02p",
    [("S = (q @ k.transpose(-1, -2)) * scale", "S = q @ k.transpose(-1, -2)"),
     ("return torch.exp(S - lse[..., None])", "return torch.exp((S - lse[..., None]) * scale)")],
    "The scale is applied to (QK^T - LSE) instead of to QK^T before subtracting: LSE gets multiplied by "
    "the scale too, so P = exp(scale*QK^T - scale*LSE) is wrong in every case (scale != 1).")
bug("R02p_exp_then_divide", "02p",
    [("return torch.exp(S - lse[..., None])", "return torch.exp(S) / torch.exp(lse[..., None])")],
    "P computed as exp(S) / exp(LSE): mathematically equal but overflows (inf/inf = NaN) once scores "
    "exceed ~88 in fp32 (large-magnitude inputs); it throws away the whole point of subtracting the LSE.")
ok("R02p_mask_after_exp", "02p",
    [("        S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float(\"-inf\"))\n"
      "    return torch.exp(S - lse[..., None])",
      "        return torch.exp(S - lse[..., None]).masked_fill(\n"
      "            ~causal_mask(S.shape[-2], S.shape[-1], S.device), 0.0)\n"
      "    return torch.exp(S - lse[..., None])")],
    "Harmless: P = exp(S - LSE) first, then the hidden entries set to exactly 0 (the LSE already "
    "belongs to the masked row, so visible entries are unchanged).")

# ------------------------------------------------------------------ 02o online_softmax_forward
bug("R02o_causal_local_cols", "02o",
    [("cols = torch.arange(start, start + kb.shape[2], device=q.device)[None, :]",
      "cols = torch.arange(kb.shape[2], device=q.device)[None, :]")],
    "The causal mask compares query rows with block-local key indices (0..block_n-1) instead of global "
    "ones (start + ...): right with one block, wrong for causal with several key blocks (later blocks are "
    "under-masked).")
bug("R02o_alpha_inverted", "02o",
    [("alpha = torch.exp(m - m_new)", "alpha = torch.exp(m_new - m)")],
    "The rescale factor is exp(m_new - m) instead of exp(m - m_new): the first block gives exp(+inf) * 0 "
    "= NaN, and later rescales go the wrong way.")
bug("R02o_l_not_rescaled", "02o",
    [("l = l * alpha + p.sum(dim=-1, keepdim=True)", "l = l + p.sum(dim=-1, keepdim=True)")],
    "The running sum l is not rescaled by alpha when the max grows (only acc is): right with a single "
    "block, wrong O and LSE with several blocks.")
bug("R02o_m_not_updated", "02o",
    [("        acc = acc * alpha + p @ vb\n        m = m_new\n", "        acc = acc * alpha + p @ vb\n")],
    "The running max is never updated (m = m_new missing): m stays -inf, every block's alpha is 0 so "
    "earlier blocks are discarded, and LSE = m + log l is -inf.")
bug("R02o_mask_fill_zero", "02o",
    [('s = s.masked_fill(cols > rows, float("-inf"))', 's = s.masked_fill(cols > rows, 0.0)')],
    "Hidden scores are filled with 0 instead of -inf, so exp(0 - m) gives hidden keys weight: wrong O "
    "and LSE in every causal case.")
bug("R02o_block_slice_short", "02o",
    [("kb = k[:, :, start:start + block_n].float()", "kb = k[:, :, start:start + block_n - 1].float()"),
     ("vb = v[:, :, start:start + block_n].float()", "vb = v[:, :, start:start + block_n - 1].float()")],
    "Off-by-one in the block slice (start:start+block_n-1, an inclusive-end habit): the last key of every "
    "block is skipped, so O and LSE are wrong in every case.")
bug("R02o_lse_squeeze_all", "02o",
    [("(m + torch.log(l)).squeeze(-1)", "(m + torch.log(l)).squeeze()")],
    "LSE squeezed with .squeeze() instead of .squeeze(-1): also drops the batch/head axes when B == 1 or "
    "H == 1, so the LSE has the wrong shape in those cases (values right).")
bug("R02o_o_not_cast", "02o",
    [("return (acc / l).to(q.dtype), ", "return acc / l, ")],
    "O is returned in the fp32 accumulator dtype instead of q's dtype: values right, dtype wrong for "
    "fp16/bf16 inputs.")
ok("R02o_finite_m_init", "02o",
    [('m = torch.full((B, H, S_q, 1), float("-inf"), **f32)', 'm = torch.full((B, H, S_q, 1), -1e30, **f32)')],
    "Harmless: the running max starts at -1e30 instead of -inf; the first block still gives alpha = 0 "
    "and every row sees a finite score in the first block.")

# ------------------------------------------------------------------ 03 dQ kernel
bug("R03_diag_tile_skipped", "03",
    [("kv_end = tl.minimum(S_k, (pid_m + 1) * BLOCK_M)", "kv_end = tl.minimum(S_k, pid_m * BLOCK_M)")],
    "Causal loop bound stops at the block's first row instead of after its last row: the diagonal key "
    "tile is never visited (the first query block gets dQ = 0), causal cases only.")
bug("R03_kv_by_query_head", "03",
    [("k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h",
      "k_base = K + b.to(tl.int64) * stride_k_b + h.to(tl.int64) * stride_k_h"),
     ("v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h",
      "v_base = V + b.to(tl.int64) * stride_v_b + h.to(tl.int64) * stride_v_h")],
    "K and V are addressed with the query head h instead of the K/V head h_kv: right without GQA, wrong "
    "(other heads' / out-of-range K, V) when GROUP_SIZE > 1.")
bug("R03_scale_twice", "03",
    [("ds = p * (dp - delta[:, None])", "ds = p * (dp - delta[:, None]) * scale")],
    "The scale is applied to dS inside the loop and again to dQ after it: dQ is scale times too large "
    "(ratio = scale) in every case.")
bug("R03_causal_mask_tile_local", "03",
    [("visible = visible & (offs_n[None, :] <= offs_m[:, None])",
      "visible = visible & ((offs_n[None, :] - start_n) <= (offs_m[:, None] - pid_m * BLOCK_M))")],
    "The causal test compares tile-local indices: right on the diagonal tile, but full tiles below the "
    "diagonal get their upper triangle masked too; wrong in causal cases with more than one key block.")
bug("R03_dp_v_not_transposed", "03",
    [("dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)",
      "dp = tl.dot(do, v, input_precision=DOT_PRECISION)")],
    "dP = dO V instead of dO V^T: a shape error unless BLOCK_D == BLOCK_N; when D == 32 (BLOCK_D == "
    "BLOCK_N) it runs and gives a wrong dQ.")
bug("R03_dq_base_q_strides", "03",
    [("dq_base = DQ + b.to(tl.int64) * stride_dq_b + h.to(tl.int64) * stride_dq_h",
      "dq_base = DQ + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h")],
    "dQ's base pointer uses Q's batch/head strides: right when Q and dQ share a layout, wrong (rows "
    "written to other heads, others left unwritten) when Q is strided (e.g. [B,S,H,D] transposed) and dQ "
    "contiguous.")
bug("R03_lse_broadcast_cols", "03",
    [("p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)",
      "p = tl.where(visible, tl.exp(s - lse[None, :]), 0.0)")],
    "LSE broadcast along the key axis (lse[None, :]) instead of down the rows: P rebuilt with the wrong "
    "row's LSE (runs because BLOCK_M == BLOCK_N); dQ wrong everywhere.")
bug("R03_key_mask_uses_S_q", "03",
    [("col_ok = offs_n < S_k", "col_ok = offs_n < S_q")],
    "The key mask uses S_q instead of S_k: when S_q < S_k the last keys are dropped, when S_q > S_k keys "
    "past the end of K/V are read and used; right only when S_q == S_k.")
ok("R03_kv_end_unclamped", "03",
    [("kv_end = tl.minimum(S_k, (pid_m + 1) * BLOCK_M)", "kv_end = (pid_m + 1) * BLOCK_M")],
    "Harmless: the causal loop bound is not clamped to S_k; extra key blocks past S_k are fully masked by "
    "col_ok (loads other=0, P = 0).")

# ------------------------------------------------------------------ 04 dK/dV kernel
bug("R04_m_start_always", "04",
    [("    m_start = 0\n    if CAUSAL:\n        m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M",
      "    m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M")],
    "The causal loop start is applied unconditionally: without a causal mask, key blocks after the first "
    "skip the query blocks above them; non-causal cases with several key blocks are wrong.")
bug("R04_gqa_heads_interleaved", "04",
    [("h = h_kv * GROUP_SIZE + g", "h = h_kv + g * H_KV")],
    "GQA group heads enumerated as h_kv + g*H_KV (interleaved, torch.repeat style) instead of "
    "h_kv*GROUP_SIZE + g (repeat_interleave): wrong dK/dV whenever GROUP_SIZE > 1 and H_KV > 1.")
bug("R04_delta_broadcast_rows", "04",
    [("dsT = pT * (dpT - delta[None, :])", "dsT = pT * (dpT - delta[:, None])")],
    "delta broadcast along the wrong axis of the transposed tile (delta[:, None] on [BLOCK_N, BLOCK_M]): "
    "each key row gets a query's delta; runs (square tiles), dV right, dK wrong.")
bug("R04_causal_strict", "04",
    [("visible = visible & (offs_n[:, None] <= offs_m[None, :])",
      "visible = visible & (offs_n[:, None] < offs_m[None, :])")],
    "Causal test j < i instead of j <= i: the diagonal is hidden in the backward (but not in the forward), "
    "so dK and dV are wrong in every causal case.")
bug("R04_dk_uses_do", "04",
    [("dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)",
      "dk += tl.dot(dsT.to(q.dtype), do, input_precision=DOT_PRECISION)")],
    "dK accumulates dS^T dO instead of dS^T Q (wrong operand); dV right, dK wrong.")
bug("R04_acc_reset_per_group_head", "04",
    [("    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)   # fp32 (fp64 for fp64 inputs)\n"
      "    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)\n", ""),
     ("        h = h_kv * GROUP_SIZE + g\n",
      "        h = h_kv * GROUP_SIZE + g\n"
      "        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)\n"
      "        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)\n")],
    "The dK/dV accumulators are zeroed inside the loop over the GQA group, so only the last query head "
    "of each group is stored: right without GQA, wrong (missing heads' contributions) when GROUP_SIZE > 1.")
bug("R04_row_mask_uses_S_k", "04",
    [("row_ok = offs_m < S_q", "row_ok = offs_m < S_k")],
    "The query-row mask uses S_k: when S_q > S_k real query rows past S_k are dropped, when S_q < S_k "
    "rows past S_q are read out of bounds and, unmasked in P, added in; right only when S_q == S_k.")
bug("R04_dv_scaled", "04",
    [("    dk = dk * scale\n", "    dk = dk * scale\n    dv = dv * scale\n")],
    "dV is multiplied by the scale as well as dK (copy-paste): dV too small by the factor scale; dK right.")
ok("R04_m_start_unaligned", "04",
    [("m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M", "m_start = pid_n * BLOCK_N")],
    "Harmless: the causal query loop starts exactly at the block's first key row instead of rounding down "
    "to a query-block boundary; all rows >= that key are still visited, the rest are masked.")

# ------------------------------------------------------------------ 05 autograd.Function
bug("R05_apply_args_swapped", "05",
    [("return FlashAttention.apply(q, k, v, causal, scale)", "return FlashAttention.apply(q, k, v, scale, causal)")],
    "causal and scale passed to apply in the wrong order (forward's signature is q, k, v, causal, scale): "
    "the kernels reject a float causal (TypeError) in every case.")
bug("R05_default_scale_seq_len", "05",
    [("scale = 1.0 / math.sqrt(q.shape[-1])", "scale = 1.0 / math.sqrt(q.shape[-2])")],
    "The default scale uses q.shape[-2] (sequence length) instead of the head dimension q.shape[-1]: "
    "wrong O and gradients whenever scale is left None and S_q != D.")
bug("R05_saved_unpack_order", "05",
    [("q, k, v, o, lse = ctx.saved_tensors", "q, k, v, lse, o = ctx.saved_tensors")],
    "saved_tensors unpacked in a different order than saved (o and lse swapped): backward fails (shape "
    "error in delta) in every case; forward is fine.")
bug("R05_forward_returns_lse", "05",
    [("        return o\n", "        return o, lse\n")],
    "forward returns (o, lse) instead of o: my_flash_attention returns a tuple instead of the output "
    "tensor, so nothing downstream (out.backward, comparisons) works.")
bug("R05_gqa_repeat_no_sum", "05",
    [("        o, lse = flashattn.attention_forward(q, k, v, causal, scale)\n",
      "        if k.shape[1] != q.shape[1]:                 # GQA: give K, V the query heads\n"
      "            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)\n"
      "            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)\n"
      "        o, lse = flashattn.attention_forward(q, k, v, causal, scale)\n")],
    "For GQA, K and V are expanded to H heads inside forward and saved expanded, so backward returns dK, "
    "dV with H heads instead of H_kv (never summed over the group): autograd shape error in GQA cases.")
bug("R05_guard_wraps_dkdv", "05",
    [("        dq = None\n        if ctx.needs_input_grad[0]:\n"
      "            dq = flashattn.attention_backward_dq(q, k, v, do, lse, delta, ctx.causal, ctx.scale)\n"
      "        dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal, ctx.scale)\n",
      "        dq = dk = dv = None\n        if ctx.needs_input_grad[0]:\n"
      "            dq = flashattn.attention_backward_dq(q, k, v, do, lse, delta, ctx.causal, ctx.scale)\n"
      "            dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal, ctx.scale)\n")],
    "The needs_input_grad[0] (q) guard also wraps the dK/dV call: when q does not require grad but k, v "
    "do, dK and dV come back None.")
bug("R05_return_four", "05",
    [("return dq, dk, dv, None, None", "return dq, dk, dv, None")],
    "backward returns four values for five forward inputs (one None missing): autograd raises "
    "'returned an incorrect number of gradients' in every backward.")
bug("R05_dkdv_given_o", "05",
    [("dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal, ctx.scale)",
      "dk, dv = flashattn.attention_backward_dkdv(q, k, v, o, lse, delta, ctx.causal, ctx.scale)")],
    "The dK/dV kernel is given o in place of do (wrong argument): O and dQ are right, dK and dV wrong.")
ok("R05_do_contiguous", "05",
    [("        q, k, v, o, lse = ctx.saved_tensors\n",
      "        q, k, v, o, lse = ctx.saved_tensors\n        do = do.contiguous()\n")],
    "Harmless: dO copied to a contiguous tensor before the kernels (an unneeded copy, same values).")
ok("R05_delta_args_swapped", "05",
    [("delta = flashattn.attention_backward_delta(o, do)", "delta = flashattn.attention_backward_delta(do, o)")],
    "Harmless: attention_backward_delta's arguments swapped; rowsum(dO * O) is symmetric in the two.")

# ------------------------------------------------------------------ 07 lazy backward
bug("R07_delta_shortcut", "07",
    [("delta = (P * dP).sum(-1, keepdim=True)", "delta = (do * O).sum(-1, keepdim=True)")],
    "Uses FlashAttention's shortcut delta = rowsum(dO * O), which is off by c_i * rowsum(dP) here because "
    "O = A V not P V: dQ, dK, dbias wrong whenever tau != 0; dV, dtau right.")
bug("R07_gate_not_causal", "07",
    [("gate = causal & (P + c[:, None] > 0)", "gate = P + c[:, None] > 0")],
    "The ReLU gate is not restricted to visible entries: with tau > 0 the hidden keys j > i (P = 0, "
    "c > 0) pass the gate, so dP is nonzero there and dtau picks them up; dQ/dK/dV stay right, dtau wrong "
    "for tau > 0.")
bug("R07_dtau_from_dA", "07",
    [("dtau = (dP.sum(-1) / (i + 1)).sum()", "dtau = (dA.sum(-1) / (i + 1)).sum()")],
    "dtau summed from the ungated dA instead of dP: it includes hidden (j > i) and ReLU-clipped entries; "
    "only dtau is wrong.")
bug("R07_dtau_sum_wrong_axis", "07",
    [("dtau = (dP.sum(-1) / (i + 1)).sum()", "dtau = (dP.sum(0) / (i + 1)).sum()")],
    "dP summed over rows (dim 0, per key) before dividing by i+1: each column sum gets the wrong row's "
    "1/(i+1); only dtau is wrong.")
bug("R07_dbias_upper_diagonals", "07",
    [("torch.diagonal(dS, offset=-d)", "torch.diagonal(dS, offset=d)")],
    "dbias sums the diagonals above the main one (j - i = d, all hidden, dS = 0) instead of below "
    "(i - j = d): dbias[0] right, dbias[d > 0] zero.")
bug("R07_dbias_misses_last", "07",
    [("for d in range(W + 1)])", "for d in range(W)])")],
    "Loop over distances stops at W-1 (range(W) instead of range(W+1)): dbias has W entries instead of "
    "W+1 (and W = 0 crashes on an empty stack).")
bug("R07_dbias_from_dP", "07",
    [("torch.diagonal(dS, offset=-d)", "torch.diagonal(dP, offset=-d)")],
    "dbias sums diagonals of dP (before the softmax Jacobian) instead of dS; bias enters S, so its "
    "gradient is dS. Only dbias is wrong.")
bug("R07_dv_uses_P", "07",
    [("dv = A.T @ do", "dv = P.T @ do")],
    "dV computed from P (the FlashAttention habit) instead of A = ReLU(P + tau/(i+1)): wrong whenever "
    "tau != 0; the other gradients are right.")
ok("R07_gate_from_A", "07",
    [("gate = causal & (P + c[:, None] > 0)", "gate = A > 0")],
    "Harmless: A > 0 exactly where the entry is visible and P + c > 0 (A = ReLU(P + c) on visible "
    "entries, 0 elsewhere), the same gate.")
ok("R07_dbias_no_guard", "07",
    [("torch.stack([torch.diagonal(dS, offset=-d).sum() if d < L else dS.new_zeros(())\n"
      "                         for d in range(W + 1)])",
      "torch.stack([torch.diagonal(dS, offset=-d).sum() for d in range(W + 1)])")],
    "Harmless: without the d < L guard torch.diagonal returns an empty tensor for d >= L, whose sum is 0.")

# ------------------------------------------------------------------ 09m visible_mask
bug("R09m_left_edge_excluded", "09m",
    [("seen &= j >= i - left", "seen &= j > i - left")],
    "Left edge excluded (j > i - left): the window sees one key too few on the left whenever left >= 0.")
bug("R09m_right_edge_excluded", "09m",
    [("seen &= j <= i + right", "seen &= j < i + right")],
    "Right edge excluded (j < i + right): one key too few on the right; right = 0 (causal) even hides "
    "the diagonal.")
bug("R09m_left_zero_ignored", "09m",
    [("if left >= 0:", "if left > 0:")],
    "left = 0 treated as 'no limit' (if left > 0): a window (0, r) lets a query see every earlier key; "
    "right for every left != 0.")
bug("R09m_right_truthiness", "09m",
    [("if right >= 0:", "if right:")],
    "'if right:' tests truthiness: right = 0 (the causal case) is skipped, and right = -1 (no limit) is "
    "applied as j <= i - 1.")
bug("R09m_window_unpacked_swapped", "09m",
    [("left, right = window", "right, left = window")],
    "window unpacked as (right, left): the two sides swapped; right only for symmetric windows.")
bug("R09m_bottom_right_aligned", "09m",
    [("i = torch.arange(S_q)[:, None]", "i = torch.arange(S_q)[:, None] + (S_k - S_q)")],
    "Query positions shifted by S_k - S_q (bottom-right alignment, flash-attn's convention) instead of "
    "top-left: right when S_q == S_k, wrong otherwise.")
bug("R09m_left_as_abs_distance", "09m",
    [("seen &= j >= i - left", "seen &= (i - j).abs() <= left")],
    "The left limit written as |i - j| <= left, which also cuts keys to the right further than left: "
    "wrong for windows with right > left or right = -1 (e.g. (2, -1)).")
ok("R09m_distance_form", "09m",
    [("seen &= j >= i - left", "seen &= i - j <= left"), ("seen &= j <= i + right", "seen &= j - i <= right")],
    "Harmless: the same two inequalities written as distances (i - j <= left, j - i <= right).")

# ------------------------------------------------------------------ 09b packed_backward
bug("R09b_dropout_no_rescale", "09b",
    [("z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = keep.to(q.dtype)")],
    "The dropout mask is used without the 1/(1-p) rescale in dV and dP: right for p = 0, dV and dP too "
    "small by (1-p) for p > 0.")
bug("R09b_ds_uses_dropped_p", "09b",
    [("ds = P * (dp - delta)", "ds = (P * z) * (dp - delta)")],
    "dS built from the dropped P (P * Z/(1-p)) instead of the undropped P: the softmax Jacobian does not "
    "see dropout; dV right, dQ/dK wrong for p > 0.")
bug("R09b_dp_no_dropout", "09b",
    [("dp = (do @ v.transpose(-1, -2)) * z", "dp = do @ v.transpose(-1, -2)")],
    "dP = dO V^T without the dropout factor Z/(1-p): dV right, dQ/dK wrong when p > 0.")
bug("R09b_first_seq_head_b", "09b",
    [("first_seq_head=b * H", "first_seq_head=b")],
    "The dropout mask of sequence b is drawn from (sequence, head) number b instead of b*H: sequences "
    "b > 0 get a different mask than the forward's (with H > 1 and p > 0).")
bug("R09b_cu_q_for_k", "09b",
    [("slice(cu_k[b], cu_k[b + 1])", "slice(cu_q[b], cu_q[b + 1])")],
    "Keys/values sliced with cu_seqlens_q instead of cu_seqlens_k: right when both are equal, a shape "
    "error or wrong gradients when a sequence has S_q != S_k.")
bug("R09b_mask_from_packed_positions", "09b",
    [("seen = visible_mask(S_q, S_k, window).to(q.device)",
      "seen = visible_mask(cu_q[-1], cu_k[-1], window)[qs, ks].to(q.device)")],
    "The window mask is cut out of one mask over packed positions instead of built per sequence: "
    "positions do not restart at 0, which only matters when the q and k offsets differ (S_q != S_k in an "
    "earlier sequence), and then the window is shifted.")
bug("R09b_last_sequence_skipped", "09b",
    [("for b in range(len(cu_q) - 1):", "for b in range(len(cu_q) - 2):")],
    "Loop over sequences stops one short (len(cu) - 2): the last sequence's gradients stay zero.")
bug("R09b_softmax_not_lse", "09b",
    [("    P = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])\n    P = P.masked_fill(~seen, 0.0)\n",
      "    P = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(~seen, float(\"-inf\")), dim=-1)\n")],
    "P recomputed with a softmax over the masked scores instead of exp(S - LSE): equal on normal rows, "
    "but a row that sees no key gives NaN (softmax of all -inf) instead of P = 0.")
bug("R09b_window_not_applied", "09b",
    [("    P = P.masked_fill(~seen, 0.0)\n", "")],
    "P = exp(S - LSE) is not zeroed where the window hides the key: hidden keys get nonzero P on every "
    "row that sees something; right only for the window (-1, -1).")
ok("R09b_lse_transpose_first", "09b",
    [("lse[qs].T", "lse.T[:, qs]")],
    "Harmless: lse transposed first and then sliced by columns, the same [H, S_q] block.")
ok("R09b_delta_from_p_dp", "09b",
    [("delta = (do * o).sum(-1, keepdim=True)", "delta = (P * dp).sum(-1, keepdim=True)")],
    "Harmless: delta = rowsum(P * dP) with the dropped dP, equal to rowsum(dO * O) since "
    "O = (P * Z/(1-p)) V (0 on rows that see no key either way).")

VARIANTS = V
