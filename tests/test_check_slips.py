"""Diagnoses added for the slips of a blind set of learner mistakes: each proven by an edit of
a worked solution (exercises 01, 02, 03, 04, 05, 07, 09) that triggers exactly it and says the
phrase that names the slip, while the unedited solutions trigger none.

The diagnoses and what they read:
  launch_tensor       the launch's tensors by the kernel's parameter names (LSE received delta)
  stride_axes         an offset multiplied by the other axis' stride (offs_m * stride_q_d)
  address_terms       an address with another tensor's stride, head or positions
  discarded_value     a line whose value is computed and never assigned
  divide_by_index     x / i with i = torch.arange(...) from 0
  exception ideas     tl.dot's inner dimensions (the kernel line, the tiles' shapes), a ctx
                      attribute forward never set, a gradient for a non-tensor input, a name
                      assigned in a branch that did not run, where a broadcast operand was made
  fingerprints        softmax not normalised, scale twice, dP scaled, causal mask off by one, P
                      filled with -inf, the partial block dropped, the causal bounds without the
                      mask, a tile transposed again, the scale inside the loop, sqrt(D) as the
                      default, the lazy gate inverted, dBias' diagonals shifted
  lesson 09           a window edge with the other side's width, a sign slip, | for &, a side
                      tested by truthiness, an empty start; slices one row short, the keep
                      probability for the drop one, the two masks swapped
  one line's slip     scores divided by the scale, the scale on the LSE too, a causal comparison
                      without the diagonal, delta summed over axis -2, block numbers used as
                      positions, a constant handed to apply, a loop that never reads its
                      variable, h_kv + g for a group's query head, a mask along the other axis,
                      an index times another axis' stride (formula_rules.py, code_rules.py)
  shapes by name      an output transposed, shaped like another input, or a size from another
                      length ([H, L] where [H, W + 1] belongs); an exception's operands by their
                      sizes' names: a call given one length twice, a position vector from the
                      wrong length, the transposed operand and the line that made it, the
                      transpose that makes A @ B chain, the operand that missed its cast, a
                      sequence's tensors with the heads last (shape_names.py, exception_ideas.py)
  blind set L         softmax without dim, a length from shape[-1]; fingerprints: delta per head,
                      exp(S - rowmax) and exp(S) - exp(LSE) for P, a softmax per block, alpha
                      against the block's maximum, the lazy gate transposed / with a sign slip /
                      1-based, P and A swapped, delta without keepdim, a returned mask inverted,
                      a one-sided window ignored, the LSE reshaped; a factor 1/GROUP_SIZE or 1/L;
                      a grid short of blocks or of the batch; an extra trailing axis, an apply
                      indexed [0]; exceptions traced to their origin: an accumulator's zeros,
                      a loop one long, a caller's slice, delta refused by the launcher
                      (exception_origins.py, launch_rules.py, runtime.validate_row_stats)
  blind set N         a cast down on the line named as the odd operand, a head-dim tile narrower
                      than D, the LSE or delta scaled once more (substitutions.py), the lazy
                      forward recomputed with scale 1.0, dTau's column sums quoted, a position
                      vector on the wrong axis, a mask shaped like i, the cu_seqlens swapped, Z
                      applied again on dQ, a returned transpose quoted, 02o's mask bottom-right
  classes             one operand of the lazy chain in another's place, a window edge written
                      with another formula (searched, not listed); the online softmax's sums,
                      maximum and scale value
  blind set O         K/V expanded for GQA, a float dTau, float32 buffers, a shape unpacked out
                      of order, a mask from one length twice, the causal comparison reversed,
                      exp(S + LSE), the gate's value, dBias reversed, 1/p, & before <=,
                      cdiv(BLOCK, S), ctx set after return, a method without (), an LSE loaded as a column,
                      0-d tensors for ints, a copy launched with the original's strides
  blind set P         exercise 09: 1 / (1 - p) rounded to float32 or fp16, a mask drawn at the
                      longest lengths and cut down, O where dO belongs in dV or dP, the rescale
                      put on dS or on delta's sum (delta divided by 1 - p), an LSE made a row
                      with [:, None] (exception_ideas.py; no longer "check that slice" for q @ k^T)
"""
import pytest
import torch

from conftest import SOLUTION_CHECKS, assert_clean, assert_hint, solution

CHECKS = SOLUTION_CHECKS


def _load(tmp_path, exercise, edit=None):
    return solution(tmp_path, exercise[:2] if exercise[:2] in ("09", "11") else exercise, edit)


@pytest.mark.parametrize("exercise", ["01", "02p", "02o", "07", "09m", "09b", "11m", "11r"])
def test_the_solutions_pass(tmp_path, exercise):
    assert_clean(CHECKS[exercise](_load(tmp_path, exercise)))


EDITS = [
    # ---- 01: the PyTorch backward
    ("01", "P = torch.softmax(S, dim=-1)", "P = torch.exp(S - S.amax(-1, keepdim=True))",
     "softmax_unnormalised", "without the division by the row sum"),
    ("01", "dP = do @ v.transpose(-1, -2)", "dP = do @ v.transpose(-1, -2) * scale", "dp_scaled", "dP carries"),
    ("01", "S = (q @ k.transpose(-1, -2)) * scale", "S = (q @ k.transpose(-1, -2)) * scale * scale",
     "scale_twice", "scale^2"),
    ("01", "delta = (do * o).sum(dim=-1, keepdim=True)", "delta = (do * o).sum(dim=-2, keepdim=True)",
     "exception", "from `delta = (do * o).sum(dim=-2, keepdim=True)`"),
    ("01", "dS = P * (dP - delta)", "dS = P @ (dP - delta).transpose(-1, -2)", "exception",
     "dS is made by `dS = P @ (dP - delta).transpose(-1, -2)`"),
    # ---- 02: rebuilding P, the online softmax
    ("02p", "S = (q @ k.transpose(-1, -2)) * scale", "S = (q * scale) @ (k * scale).transpose(-1, -2)",
     "scale_twice", "scale^2"),
    ("02p", "~causal_mask(S.shape[-2], S.shape[-1], S.device)",
     "~torch.tril(torch.ones(S.shape[-2], S.shape[-1], dtype=torch.bool, device=S.device), diagonal=1)",
     "mask_shifted", "also sees key i + 1"),
    ("02p", '    if causal:\n        S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))\n'
            '    return torch.exp(S - lse[..., None])',
     '    P = torch.exp(S - lse[..., None])\n    if causal:\n'
     '        P = P.masked_fill(~causal_mask(P.shape[-2], P.shape[-1], P.device), float("-inf"))\n    return P',
     "p_hidden_neg_inf", "-inf belongs on S"),
    ("02p", "torch.exp(S - lse[..., None])", "torch.exp(S - lse.expand_as(S))", "exception", "trailing"),
    # blind set P: calls that do something else than they look like
    ('03', 'q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,\n                mask=row_ok[:, None] & d_ok[None, :], other=0.0)',
     'q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,\n                mask=row_ok[:, None] | d_ok[None, :], other=0.0)', 'mask_or', 'mask_or'),
    ('03', 'k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,\n                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)',
     'k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,\n                    mask=col_ok[:, None] & d_ok[None, :], other=float("-inf"))', 'operand_other_inf', 'operand_other_inf'),
    ('01', 'dv = P.transpose(-1, -2) @ do',
     'dv = P.transpose_(-1, -2) @ do', 'inplace_transpose', 'inplace_transpose'),
    ('01', 'dv = P.transpose(-1, -2) @ do',
     'dv = P.reshape(*P.shape[:-2], P.shape[-1], P.shape[-2]) @ do', 'reshape_for_transpose', 'reshape_for_transpose'),
    ('09m', 'i = torch.arange(S_q)[:, None]',
     'i = torch.arange(S_q).T', 'transpose_of_vector', 'transpose_of_vector'),
    ('05', 'return dq, dk, dv, None, None',
     'return [dq, dk, dv, None, None]', 'gradients_as_list', 'gradients_as_list'),
    ('02p', 'return torch.exp(S - lse[..., None])',
     'return torch.expm1(S - lse[..., None])', 'expm1_for_exp', 'expm1_for_exp'),
    ('09m', 'seen &= j >= i - left',
     'seen &= ~j < i - left', 'invert_before_compare', 'invert_before_compare'),
    ('03', 'p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)',
     'p = tl.where(visible, 0.0, tl.exp(s - lse[:, None]))', 'where_swapped', 'where_swapped'),
    ('05', 'delta = flashattn.attention_backward_delta(o, do)           # rowsum(dO * O)',
     'delta = o.mul_(do).sum(dim=-1)                              # rowsum(dO * O)', 'inplace_on_input', 'inplace_on_input'),
    # blind set P: float32 inside float64, a bare squeeze, an output copied, strides borrowed
    ("09b", "lse[qs].T, keep, dropout_p, seen, scale)", "lse[qs].T.float(), keep, dropout_p, seen, scale)",
     "float32_rounding", "`lse[qs].T.float()"),
    ("02p", "return torch.exp(S - lse[..., None])", "return torch.exp(S - lse.squeeze()[..., None])", "shape",
     "squeezes without naming an axis"),
    ("03", "    B, H, S_q, D = q.shape\n    H_kv, S_k = k.shape[1], k.shape[2]\n",
     "    dq = dq.contiguous()\n    B, H, S_q, D = q.shape\n    H_kv, S_k = k.shape[1], k.shape[2]\n",
     "output_copy", "not the one handed in"),
    ("04", "*lse.stride(), *delta.stride(), *dk.stride(), *dv.stride(),",
     "*lse.stride(), *delta.stride(), *dk.stride(), *dk.stride(),", "borrowed_strides", "which are dK's"),
    ("03", "        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,\n"
           "                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)",
     "        k = tl.trans(tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,\n"
     "                    mask=col_ok[:, None] & d_ok[None, :], other=0.0))", "tile_transposed_at_load",
     "k = tl.trans(tl.load("),
    ("04", "            dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)",
     "        dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)", "accumulation_after_loop",
     "dk += tl.dot(dsT.to(q.dtype), q"),
    ("02o", "for start in range(0, S_k, block_n):", "for start in range(0, S_k - block_n + 1, block_n):",
     "online_drop_partial", "only full blocks"),
    ("02o", "(m + torch.log(l)).squeeze(-1)", "(m + torch.log(l)).squeeze()", "shape", "squeeze(-1)"),
    # blind set Q: named since its run
    ('09m', 'i = torch.arange(S_q)[:, None]', 'i = torch.arange(S_q, dtype=torch.uint8)[:, None]',
     'unsigned_positions', 'wraps around'),
    ('01', 'S.device), float("-inf"))',
     'S.device), float("inf"))', 'hidden_plus_inf', 'hidden_plus_inf'),
    ('01', 'delta = (do * o).sum(dim=-1, keepdim=True)',
     'delta = do * o', 'delta_not_summed', 'delta_not_summed'),
    ('01', 'delta = (do * o).sum(dim=-1, keepdim=True)',
     'delta = do @ o.transpose(-1, -2)', 'delta_as_matmul', 'delta_as_matmul'),
    ('02p', 'S = (q @ k.transpose(-1, -2)) * scale',
     'S = torch.bmm(q.view(-1, q.shape[-2], q.shape[-1]),\n                  k.view(-1, k.shape[-2], k.shape[-1]).transpose(-1, -2)).view(*q.shape[:-1], k.shape[-2]) * scale', 'exception', 'batch of 2'),
    ('02p', 'S = (q @ k.transpose(-1, -2)) * scale',
     'S = (q @ k.T) * scale', 'T_of_4d', 'T_of_4d'),
    ('02p', 'return torch.exp(S - lse[..., None])',
     'return torch.exp(S - torch.logsumexp(S, dim=-2, keepdim=True))', 'lse_recomputed', 'lse_recomputed'),
    ('02p', 'causal_mask(S.shape[-2], S.shape[-1], S.device)',
     'causal_mask(S.shape[-2], S.shape[-1], S.dtype)', 'mask_given_dtype', 'mask_given_dtype'),
    ('02p', '~causal_mask(S.shape[-2], S.shape[-1], S.device)',
     '~torch.ones(S.shape[-2], S.shape[-1], dtype=torch.uint8, device=S.device).tril()', 'uint8_mask', 'uint8_mask'),
    ('02o', '        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))\n',
     '        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))\n        m = m_new\n', 'max_overwritten_before_alpha', 'max_overwritten_before_alpha'),
    ('02o', 'for start in range(0, S_k, block_n):',
     'for start in range(0, S_k + 1, block_n):', 'range_past_end', 'range_past_end'),
    ('03', 'for start_n in range(0, kv_end, BLOCK_N):',
     'for start_n in range(pid_m * BLOCK_M, kv_end, BLOCK_N):', 'dq_keys_from_diagonal', 'dq_keys_from_diagonal'),
    ('03', '    dq_kernel[grid](\n',
     '    dq_kernel(grid)(\n', 'launch_call_syntax', 'launch_call_syntax'),
    ('03', 'offs_d = tl.arange(0, BLOCK_D)',
     'offs_d = tl.arange(0, HEAD_DIM)', 'arange_runtime_size', 'arange_runtime_size'),
    ('04', 'h = h_kv * GROUP_SIZE + g',
     'h = g * H_KV + h_kv', 'gqa_head_map', 'g * H_kv + h_kv'),
    ('04', '    d_ok = offs_d < HEAD_DIM\n',
     '    d_ok = offs_d < HEAD_DIM\n    if CAUSAL and pid_n * BLOCK_N >= S_q:     # no query row sees these keys: skip them\n        return\n', 'early_return', 'early_return'),
    ('05', 'q, k, v, o, lse = ctx.saved_tensors',
     'q, k, v, lse, o = ctx.saved_tensors', 'saved_order', 'unpacks in another order'),
    ('05', '    return FlashAttention.apply(q, k, v, causal, scale)',
     '    with torch.no_grad():                            # the kernels do not need autograd\n        return FlashAttention.apply(q, k, v, causal, scale)', 'apply_under_no_grad', 'apply_under_no_grad'),
    ('05', 'return dq, dk, dv, None, None',
     'return dq, dk, dv, 0, 0', 'zero_for_none', 'zero_for_none'),
    ('05', '    return FlashAttention.apply(q, k, v, causal, scale)',
     '    return FlashAttention.apply(q.detach(), k, v, causal, scale)   # the kernel reads raw data', 'input_detached', 'input_detached'),
    ('05', 'ctx.save_for_backward(q, k, v, o, lse)',
     'ctx.save_for_backward(q, k, v, o, lse, causal, scale)', 'save_non_tensors', 'save_non_tensors'),
    ('07', 'dtau = (dP.sum(-1) / (i + 1)).sum()',
     'dtau = (dP.sum(-1) * c).sum()', 'lazy_dtau_times_tau', 'lazy_dtau_times_tau'),
    ('07', 'torch.diagonal(dS, offset=-d).sum()',
     'torch.tril(dS, -d).sum()', 'lazy_dbias_cumulative', 'lazy_dbias_cumulative'),
    ('09m', 'seen &= j >= i - left',
     'seen = seen.tril(-left)', 'window_edge_formula', 'triu(-left)'),
    ('09m', 'seen = torch.ones(S_q, S_k, dtype=torch.bool)',
     'seen = torch.empty(S_q, S_k, dtype=torch.bool)', 'mask_from_empty', 'mask_from_empty'),
    ('09b', 'lse[qs].T, keep',
     'lse.T, keep', 'packed_lse_unsliced', 'packed_lse_unsliced'),
    ('09b', 'seen = visible_mask(S_q, S_k, window).to(q.device)',
     'seen = (visible_mask(S_q, S_k, window) & causal_mask(S_q, S_k)).to(q.device)', 'causal_in_packed', 'causal_in_packed'),
    ('09b', 'cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()',
     'cu_q, cu_k = cu_seqlens_q.cumsum(0).tolist(), cu_seqlens_k.cumsum(0).tolist()', 'offsets_summed_again', 'offsets_summed_again'),
    # blind set P, second round: named since stop 27
    ('02o', 'rows = torch.arange(S_q, device=q.device)[:, None]',
     'rows = torch.arange(S_q, device=q.device)', 'positions_not_column', 'rows = torch.arange(S_q'),
    ('02o', 'for start in range(0, S_k, block_n):',
     'for start in range(0, S_q, block_n):', 'key_loop_over_queries', 'range(0, S_q, block_n)'),
    ('02o', 'return (acc / l).to(q.dtype), (m + torch.log(l)).squeeze(-1)',
     'return (acc / torch.exp(m + torch.log(l))).to(q.dtype), (m + torch.log(l)).squeeze(-1)', 'divides_by_exp_lse', 'acc / torch.exp'),
    ('02o', 'for start in range(0, S_k, block_n):',
     'for start in reversed(range(0, S_k, block_n)):', 'key_blocks_reversed', 'reversed(range'),
    ('04', '    tl.store(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :] * stride_dk_d,\n             dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])',
     '    tl.atomic_add(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :] * stride_dk_d,\n                  dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])', 'atomic_add_store', 'tl.atomic_add(dk_base'),
    ('04', 'dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)  # dV += P^T dO',
     'dv += tl.dot(pT.to(do.dtype), do, acc=dv, input_precision=DOT_PRECISION)  # dV += P^T dO', 'dot_acc_and_add', 'acc=dv'),
    ('05', 'o, lse = flashattn.attention_forward(q, k, v, causal, scale)',
     'o, lse = flashattn.attention_forward(q.half(), k.half(), v.half(), causal, scale)', 'forward_half', 'q.half()'),
    ('05', 'delta = flashattn.attention_backward_delta(o, do)           # rowsum(dO * O)',
     'delta = flashattn.attention_backward_delta(o, torch.ones_like(o))', 'wrong_argument', 'ones in place of dO in delta'),
    ('05', 'ctx.causal, ctx.scale = causal, scale        # not tensors: plain attributes',
     'ctx.causal = ctx.scale = causal, scale       # not tensors: plain attributes', 'chained_tuple_assignment', 'ctx.causal = ctx.scale'),
    ('05', 'dq = flashattn.attention_backward_dq(q, k, v, do, lse, delta, ctx.causal, ctx.scale)',
     'dq = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, ctx.causal, ctx.scale)[0]', 'dq_from_dkdv', 'attention_backward_dkdv'),
    ('07', '    dbias = torch.stack([torch.diagonal(dS, offset=-d).sum() if d < L else dS.new_zeros(())\n                         for d in range(W + 1)])',
     '    dist = (i[:, None] - i[None, :]).clamp(0, W)\n    dbias = dS.new_zeros(W + 1).index_add_(0, dist[causal], dS[causal])', 'lazy_dbias_clamped', 'lazy_dbias_clamped'),
    ('07', 'if d < L else dS.new_zeros(())',
     'if d < L - 1 else dS.new_zeros(())', 'lazy_dbias_corner_zero', 'lazy_dbias_corner_zero'),
    ('09m', 'seen = torch.ones(S_q, S_k, dtype=torch.bool)',
     'seen = torch.ones(1, 1, dtype=torch.bool).expand(S_q, S_k)', 'inplace_on_expanded', '.expand(S_q, S_k)'),
    ('09m', 'seen = torch.ones(S_q, S_k, dtype=torch.bool)',
     'seen = torch.ones(S_q, S_k)', 'mask_made_float', 'torch.ones(S_q, S_k)'),
    ('09m', 'seen &= j <= i + right',
     'seen &= j <= (i + right).clamp(max=S_q - 1)', 'window_edge_formula', 'min(i + right, S_q - 1)'),
    ('09m', 'seen &= j >= i - left',
     'seen &= j >= i.sub_(left)', 'window_edge_formula', 'j <= i + right - left'),
    ('09b', 'g = sequence_backward(heads(q[qs]), heads(k[ks]), heads(v[ks]), heads(o[qs]), heads(do[qs]),',
     'g = sequence_backward(heads(q[qs]), heads(k[ks]), heads(v[ks]), heads(do[qs]), heads(o[qs]),', 'o_do_swapped', 'o_do_swapped'),
    ('09b', 'seen = visible_mask(S_q, S_k, window).to(q.device)',
     'seen = visible_mask(S_q, S_k, window).to(q)', 'to_other_tensor', '.to(q)'),
    ('09b', 'dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)',
     'for buf, t in zip((dq[qs], dk[ks], dv[ks]), g):\n            buf = heads(t)', 'loop_name_rebound', 'buf = heads(t)'),
    ('09b', 'ds = P * (dp - delta)',
     'ds = P * (dp - delta * z)', 'delta_dropped', 'delta_dropped'),
    ('09b', '    P = P.masked_fill(~seen, 0.0)\n    z = keep.to(q.dtype) / (1.0 - dropout_p)\n    dv = (P * z).transpose(-1, -2) @ do',
     '    z = keep.to(q.dtype) / (1.0 - dropout_p)\n    dv = (P * z).transpose(-1, -2) @ do\n    P = P.masked_fill(~seen, 0.0)', 'mask_after_dv', 'mask_after_dv'),
    ("02o", "for start in range(0, S_k, block_n):", "for start in range(0, S_k + 1, block_n):", "range_past_end",
     "one past the length"),
    ("02o", "rows = torch.arange(S_q, device=q.device)[:, None]", "rows = torch.arange(S_k, device=q.device)[:, None]",
     "positions_from_other_length", "`rows = torch.arange(S_k, device=q.device)[:, None]`"),
    ("02o", "l = l * alpha + p.sum(dim=-1, keepdim=True)", "l = (l + p.sum(dim=-1, keepdim=True)) * alpha",
     "online_l_rescales_new", "rescaled too"),
    ("02o", "vb = v[:, :, start:start + block_n].float()", "vb = k[:, :, start:start + block_n].float()",
     "online_v_from_k", "sliced from k"),
    # ---- 03: the dQ kernel
    ("03", "        q, k, v, do, lse, delta, dq,\n", "        q, k, v, do, delta, lse, dq,\n", "launch_tensor",
     "parameter LSE received delta"),
    ("03", "s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale",
     "s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale", "exception", "tl.dot(q, tl.trans(k))"),
    ("03", "q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,",
     "q = tl.load(q_base + offs_m[:, None] * stride_q_d + offs_d[None, :] * stride_q_s,", "stride_axes",
     "offs_m[:, None] * stride_q_d"),
    ("03", "v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h",
     "v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_k_h", "address_terms",
     "v's address uses stride_k_h"),
    ("03", "dq_base = DQ + b.to(tl.int64) * stride_dq_b + h.to(tl.int64) * stride_dq_h",
     "dq_base = DQ + b.to(tl.int64) * stride_dq_b + h_kv.to(tl.int64) * stride_dq_h", "address_terms",
     "addressed at h_kv, the K/V head"),
    ("03", "    dq = dq * scale                                  # S",
     "        dq = dq * scale                                  # S", "scale_in_loop", "inside the loop"),
    ("03", "row_ok = offs_m < S_q", "row_ok = offs_m <= S_q", "bound_inclusive", "row_ok = offs_m <= S_q"),
    # ---- 04: the dK/dV kernel
    ("04", "        q, k, v, do, lse, delta, dk, dv,\n", "        q, v, k, do, lse, delta, dk, dv,\n",
     "launch_tensor", "parameter K received V"),
    ("04", "delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)",
     "delta = tl.load(delta_base + offs_n * stride_delta_s, mask=col_ok, other=0.0)", "address_terms",
     "addressed at the key positions offs_n"),
    ("04", "dk_base = DK + b.to(tl.int64) * stride_dk_b + h_kv.to(tl.int64) * stride_dk_h",
     "dk_base = DK + b.to(tl.int64) * stride_dk_b + h.to(tl.int64) * stride_dk_h", "address_terms",
     "dk belongs to the K/V head but is addressed at h"),
    ("04", "    m_start = 0\n    if CAUSAL:\n        m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M\n",
     "    m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M\n", "causal_bounds_unguarded", "without the causal mask"),
    ("04", "dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)",
     "dv += tl.dot(tl.trans(pT).to(do.dtype), do, input_precision=DOT_PRECISION)", "tile_transposed_again",
     "transposed once more"),
    ("04", "pT = tl.where(visible, tl.exp(sT - lse[None, :]), 0.0)",
     "pT = tl.where(visible, tl.exp(sT * scale - lse[None, :]), 0.0)", "scale_twice", "scale^2"),
    ("04", "visible = visible & (offs_n[:, None] <= offs_m[None, :])", "visible & (offs_n[:, None] <= offs_m[None, :])",
     "discarded_value", "is never used afterwards"),
    ("04", "dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)",
     "dv += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)", "accumulated_into_other",
     "added into the other's accumulator"),
    ("04", "dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])",
     "dv.to(DV.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])", "address_terms",
     "masked with row_ok, the query rows' mask"),
    ("04", "    dk = dk * scale\n", "", "scale", "scale"),
    # ---- 05: the autograd.Function
    ("05", "ctx.causal, ctx.scale = causal, scale", "ctx.causal = causal", "exception",
     "your forward never assigns it"),
    ("05", "return dq, dk, dv, None, None", "return dq, dk, dv, None, ctx.scale", "exception",
     "forward's input 5 is scale"),
    ("05", "scale = 1.0 / math.sqrt(q.shape[-1])", "scale = math.sqrt(q.shape[-1])", "scale_value", "sqrt(D)"),
    ("05", "o, lse = flashattn.attention_forward(q, k, v, causal, scale)",
     "lse, o = flashattn.attention_forward(q, k, v, causal, scale)", "saved_order", "in the other order"),
    ("05", "        delta = flashattn.attention_backward_delta(o, do)           # rowsum(dO * O)\n        dq = None\n"
           "        if ctx.needs_input_grad[0]:\n",
     "        dq = None\n        if ctx.needs_input_grad[0]:\n            delta = flashattn.attention_backward_delta(o, do)\n",
     "exception", "never assigned"),
    ("05", "ctx.save_for_backward(q, k, v, o, lse)", "ctx.save_for_backward(q, k, v, o)", "exception",
     "Save everything backward unpacks"),
    ("05", "scale = 1.0 / math.sqrt(q.shape[-1])", "scale = 1.0 // math.sqrt(q.shape[-1])",
     "default_scale_value", "only the call with scale=None fails"),
    ("05", "            dq = flashattn.attention_backward_dq(", "            d_q = flashattn.attention_backward_dq(",
     "none_gradient", "never used afterwards"),
    ("05", "        q, k, v, o, lse = ctx.saved_tensors\n        delta = flashattn.attention_backward_delta(o, do)",
     "        delta = flashattn.attention_backward_delta(o, do)\n        q, k, v, o, lse = ctx.saved_tensors\n"
     "        delta = delta", "exception", "before it is assigned"),
    # ---- 07: lazy attention
    ("07", "dtau = (dP.sum(-1) / (i + 1)).sum()", "dtau = (dP.sum(-1) / i).sum()", "divide_by_index",
     "dtau = (dP.sum(-1) / i).sum()"),
    ("07", "dP = dA * gate", "dP = dA.masked_fill(gate, 0.0)", "lazy_gate_inverted", "gate is inverted"),
    ("07", "for d in range(W + 1)])", "for d in range(1, W + 2)])", "lazy_dbias_shifted", "one further"),
    # ---- 09: the window's mask, the packed backward
    ("09m", "seen &= j <= i + right", "seen &= j <= i + left", "window_other_side", "other side's width"),
    ("09m", "seen &= j >= i - left", "seen &= j >= i + left", "window_edge_sign", "sign slip"),
    ("09m", "seen &= j <= i + right", "seen |= j <= i + right", "window_or", "| (or)"),
    ("09m", "if right >= 0:", "if right:", "window_truthiness", "`if right:`"),
    ("09m", "seen = torch.ones(S_q, S_k, dtype=torch.bool)", "seen = torch.zeros(S_q, S_k, dtype=torch.bool)",
     "window_empty", "starts empty"),
    ("09m", "    if right >= 0:\n", "    elif right >= 0:\n", "window_elif", "elif"),
    ("09m", "seen &= j <= i + right", "seen = j <= i + right", "window_side_lost", "the other edge alone"),
    ("09m", "if right >= 0:", "if left >= 0:", "window_guard_other", "guarded by the other side's test"),
    ("09m", "        seen &= j <= i + right\n    return seen\n", "        seen &= j <= i + right\n        return seen\n",
     "shape", "returned None"),
    ("09b", "        S_q, S_k = qs.stop - qs.start, ks.stop - ks.start\n",
     "        S_q, S_k = qs.stop - qs.start, ks.stop - ks.start\n        if S_q == 0:\n            break\n",
     "stops_at_empty", "stops at an empty one"),
    ("09b", "z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = keep.to(q.dtype) / 1.0 - dropout_p",
     "rescale_precedence", "parentheses"),
    ("09b", "keep = dropout_mask(seed, H, S_q, S_k, dropout_p, q.device, first_seq_head=b * H)",
     "keep = dropout_mask(seed, 1, S_q, S_k, dropout_p, q.device, first_seq_head=b * H)", "mask_one_head",
     "one head"),
    ("09b", "S_q, S_k = qs.stop - qs.start, ks.stop - ks.start", "S_q, S_k = cu_q[b + 1], cu_k[b + 1]", "exception",
     "end offsets"),
    ("09b", "qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])",
     "qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1] - 1)", "exception",
     "cu_seqlens[b + 1] - 1 as a slice's end"),   # the batch with an empty sequence raises first
    ("09b", "keep = dropout_mask(seed, H, S_q, S_k, dropout_p, q.device, first_seq_head=b * H)",
     "keep = dropout_mask(seed, H, S_q, S_k, 1 - dropout_p, q.device, first_seq_head=b * H)",
     "keep_probability", "keep probability 1 - p"),
    ("09b", "lse[qs].T, keep, dropout_p, seen, scale)", "lse[qs].T, seen, dropout_p, keep, scale)",
     "masks_swapped", "in each other's place"),
    # ---- set K's misses: the line that says it, shapes by their sizes' names
    ("02p", "S = (q @ k.transpose(-1, -2)) * scale", "S = (q @ k.transpose(-1, -2)) / scale",
     "scale_divides", "S = (q @ k.transpose(-1, -2)) / scale"),
    ("09b", "P = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])",
     "P = torch.exp((q @ k.transpose(-1, -2) - lse[..., None]) * scale)", "scale_on_lse", "scales the LSE a second time"),
    ("07", "causal = i[None, :] <= i[:, None]", "causal = i[None, :] < i[:, None]", "causal_strict",
     "the keys seen are j < i"),
    ("07", "delta = (P * dP).sum(-1, keepdim=True)", "delta = (P * dP).sum(-2, keepdim=True)", "delta_axis",
     "delta = (P * dP).sum(-2, keepdim=True)"),
    ("02o", "for start in range(0, S_k, block_n):", "for start in range(S_k // block_n):",
     "block_numbers_as_positions", "with `kb = k[:, :, start:start + block_n].float()`"),
    ("05", "return FlashAttention.apply(q, k, v, causal, scale)", "return FlashAttention.apply(q, k, v, False, scale)",
     "apply_constant", "passes False where forward takes causal"),
    ("03", "lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h",
     "lse_base = LSE + b.to(tl.int64) * stride_lse_h + h.to(tl.int64) * stride_lse_b", "address_terms",
     "the batch index goes with the batch stride, stride_lse_b"),
    ("03", "offs_n = start_n + tl.arange(0, BLOCK_N)", "offs_n = tl.arange(0, BLOCK_N)", "loop_variable_unused",
     "the body never reads start_n"),
    ("04", "h = h_kv * GROUP_SIZE + g", "h = h_kv + g", "group_head_index", "`h = h_kv + g`"),
    ("04", "visible = row_ok[None, :] & col_ok[:, None]", "visible = row_ok[:, None] & col_ok[None, :]", "mask_axes",
     "`row_ok[:, None]` lines the query rows up with the other axis"),
    ("01", "dv = P.transpose(-1, -2) @ do", "dv = do.transpose(-1, -2) @ P", "shape", "dV comes out transposed"),
    ("09m", "    return seen\n", "    return seen.T\n", "shape", "The mask comes out transposed"),
    ("09b", "torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)",
     "torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(v)", "shape",
     "dk is [total_q, H, D], the shape of q, where [total_k, H, D] belongs"),
    ("07", "for d in range(W + 1)])", "for d in range(min(W, L - 1) + 1)])", "shape",
     "dBias is [H, L] where [H, W + 1] belongs"),
    ("01", "causal_mask(S.shape[-2], S.shape[-1], S.device)", "causal_mask(S.shape[-1], S.shape[-1], S.device)",
     "exception", "is given the same length twice"),
    ("01", "dP = do @ v.transpose(-1, -2)", "dP = v @ do.transpose(-1, -2)", "exception",
     "dP [1, H, S_k, S_q], from `dP = v @ do.transpose(-1, -2)`, is the transpose"),
    ("01", "dk = (dS.transpose(-1, -2) @ q) * scale", "dk = (dS @ q) * scale", "exception",
     "It chains with dS with a transpose: dS^T @ q"),
    ("02o", "vb = v[:, :, start:start + block_n].float()", "vb = v[:, :, start:start + block_n]", "exception",
     "vb is torch.float16"),
    ("09b", "heads = lambda t: t.transpose(0, 1)", "heads = lambda t: t.transpose(1, 2)", "exception",
     "has the heads last, [S, D, H]"),
    # ---- blind set L's slips
    ("01", "P = torch.softmax(S, dim=-1)", "P = torch.nn.functional.softmax(S)", "softmax_no_dim",
     "`P = torch.nn.functional.softmax(S)`"),
    ("01", "delta = (do * o).sum(dim=-1, keepdim=True)", "delta = (do * o).sum(dim=(-2, -1), keepdim=True)",
     "delta_per_head", "one number per head"),
    ("02p", "return torch.exp(S - lse[..., None])", "return torch.exp(S - S.amax(dim=-1, keepdim=True))",
     "p_max_not_lse", "the row's maximum where the LSE belongs"),
    ("02p", "torch.exp(S - lse[..., None])", "torch.exp(S) - torch.exp(lse[..., None])", "exp_difference",
     "a difference where a quotient belongs"),
    ("02o", "p = torch.exp(s - m_new)", "p = torch.softmax(s, dim=-1)", "online_block_softmax", "its own softmax"),
    ("02o", "alpha = torch.exp(m - m_new)", "alpha = torch.exp(m - s.amax(dim=-1, keepdim=True))",
     "online_alpha_block_max", "not the new running maximum"),
    ("02o", "(m + torch.log(l)).squeeze(-1)", "(m + torch.log(l))", "shape", "an extra trailing axis of size 1"),
    ("02o", "S_k = k.shape[2]", "S_k = k.shape[-1]", "length_from_head_dim", "`S_k = k.shape[-1]`"),
    ("03", "CAUSAL=causal, BLOCK_M=BLOCK, BLOCK_N=BLOCK,", "CAUSAL=causal, BLOCK_M=16, BLOCK_N=BLOCK,",
     "grid_short", "while the kernel's BLOCK_M is 16"),
    ("03", "dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=LSE.dtype.element_ty)",
     "dq = tl.zeros([BLOCK_M, BLOCK_N], dtype=LSE.dtype.element_ty)", "exception",
     "dq is made by `dq = tl.zeros([BLOCK_M, BLOCK_N], dtype=LSE.dtype.element_ty)`"),
    ("04", "    dk = dk * scale\n", "    dk = dk * scale / GROUP_SIZE\n    dv = dv / GROUP_SIZE\n", "group_factor",
     "averaged over the group"),
    ("04", "grid = (triton.cdiv(S_k, BLOCK), B * H_kv)", "grid = (triton.cdiv(S_k, BLOCK), H_kv)", "grid_short",
     "counts the heads of one batch element only"),
    ("05", "delta = flashattn.attention_backward_delta(o, do)", "delta = (do * o).sum(dim=-1, keepdim=True)",
     "exception", "The package refused the LSE or delta"),
    ("05", "return FlashAttention.apply(q, k, v, causal, scale)",
     "return FlashAttention.apply(q, k, v, causal, scale)[0]", "shape", "indexes a result with [0]"),
    ("07", "dtau = (dP.sum(-1) / (i + 1)).sum()", "dtau = (dP.sum(-1) / (i + 1)).mean()", "factor",
     "a mean where the sum belongs"),
    ("07", "causal = i[None, :] <= i[:, None]", "causal = i[:, None] <= i[None, :]", "lazy_gate_causal_transposed",
     "transposed"),
    ("07", "gate = causal & (P + c[:, None] > 0)", "gate = causal & (P - c[:, None] > 0)", "lazy_gate_sign",
     "a sign slip"),
    ("07", "    i = torch.arange(L, device=q.device)\n    causal = ",
     "    i = torch.arange(1, L + 1, device=q.device)\n    causal = ", "lazy_positions_one_based", "the positions start at 1"),
    ("07", "P, A, O = forward_one_head(q, k, v, bias, tau, scale)",
     "A, P, O = forward_one_head(q, k, v, bias, tau, scale)", "lazy_p_a_swapped", "unpacked in the wrong order"),
    ("07", "delta = (P * dP).sum(-1, keepdim=True)", "delta = (P * dP).sum(-1)", "lazy_delta_columns",
     "the sum without keepdim"),
    ("09m", "    return seen\n", "    return ~seen\n", "window_returned_inverted", "True where the key is hidden"),
    ("09m", "    if left >= 0:\n        seen &= j >= i - left\n    if right >= 0:\n        seen &= j <= i + right\n",
     "    if left >= 0 and right >= 0:\n        seen &= (j >= i - left) & (j <= i + right)\n", "window_both_required",
     "only when both sides are given"),
    ("09b", "lse[qs].T, keep", "lse[qs].reshape(H, -1), keep", "lse_reshape", "not transposed"),
    ("09b", "for b in range(len(cu_q) - 1):", "for b in range(len(cu_q)):", "exception",
     "runs b up to the last index of cu_q"),
    ("09b", "heads(o[qs])", "heads(o[ks])", "exception", "packed_backward passes `heads(o[ks])`"),
    # ---- probes of this session
    ("03", "offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)", "offs_m = pid_m + tl.arange(0, BLOCK_M)",
     "block_offset_step", "rows starting one row apart"),
    ("07", "c = tau / (i + 1)", "c = tau / i", "divide_by_index", "`c = tau / i`"),
    ("02p", "    if causal:\n", "    if not causal:\n", "causal_inverted", "causal cases match attention without"),
    ("03", "for start_n in range(0, kv_end, BLOCK_N):", "for start_n in range(0, kv_end - BLOCK_N, BLOCK_N):",
     "loop_one_block_short", "its last block is never visited"),
    ("05", "return FlashAttention.apply(q, k, v, causal, scale)", "return FlashAttention.forward(None, q, k, v, causal, scale)",
     "exception", "forward was called directly"),
    ("07", "dA = do @ v.T", "dA = do @ v", "exception", "It chains with v with a transpose: do @ v^T"),
    ("09b", "P = P.masked_fill(~seen, 0.0)", "P = P.masked_fill(seen == 0, float('-inf'))", "p_filled_neg_inf",
     "after the exponential"),
    ("02o", "rows = torch.arange(S_q, device=q.device)[:, None]", "rows = torch.arange(S_q, device=q.device)[None, :]",
     "exception", "from `rows = torch.arange(S_q, device=q.device)[None, :]`"),
    # ---- blind set N's checker faults (/work/eval_n)
    ("02p", "S = (q @ k.transpose(-1, -2)) * scale", "S = (q @ k.transpose_(-1, -2)) * scale", "input_modified",
     "its shape changed from"),
    ("04", "delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)",
     "delta = tl.load(delta_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)", "address_terms", "stride_lse_s"),
    ("09b", "seen = visible_mask(S_q, S_k, window).to(q.device)", "seen = visible_mask(S_k, S_q, window).to(q.device)",
     "exception", "the mask is [S_k, S_q], its two lengths the other way round"),
    # ---- blind set O's misses
    ("05", "        o, lse = flashattn.attention_forward(q, k, v, causal, scale)\n",
     "        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)\n"
     "        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)\n"
     "        o, lse = flashattn.attention_forward(q, k, v, causal, scale)\n", "shape", "K and V expanded"),
    ("07", "dtau = (dP.sum(-1) / (i + 1)).sum()", "dtau = float((dP.sum(-1) / (i + 1)).sum())", "shape",
     "came back as a Python float"),
    ("09b", "dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)",
     "dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)", "dtype",
     "torch's default: float32"),
    ("02o", "B, H, S_q, D = q.shape", "B, S_q, H, D = q.shape", "shape_unpack_order", "`B, S_q, H, D = q.shape`"),
    ("09m", "seen = torch.ones(S_q, S_k, dtype=torch.bool)", "seen = torch.ones(S_k, S_k, dtype=torch.bool)",
     "exception", "is given the same length twice"),
    ("02o", 's = s.masked_fill(cols > rows, float("-inf"))', 's = s.masked_fill(cols < rows, float("-inf"))',
     "online_mask_reversed", "the past is hidden"),
    ("04", "pT = tl.where(visible, tl.exp(sT - lse[None, :]), 0.0)", "pT = tl.where(visible, tl.exp(sT + lse[None, :]), 0.0)",
     "lse_added", "P = exp(S + LSE)"),
    ("07", "gate = causal & (P + c[:, None] > 0)", "gate = causal * torch.relu(P + c[:, None])", "lazy_gate_value",
     "not its derivative"),
    ("07", "for d in range(W + 1)])", "for d in reversed(range(W + 1))])", "lazy_dbias_reversed", "reverse order"),
    ("09b", "z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = keep.to(q.dtype) / dropout_p", "divides_by_p",
     "divides by p"),
    ("03", "visible = visible & (offs_n[None, :] <= offs_m[:, None])", "visible = visible & offs_n[None, :] <= offs_m[:, None]",
     "bitwise_precedence", "& binds before the comparison"),
    ("04", "grid = (triton.cdiv(S_k, BLOCK), B * H_kv)", "grid = (triton.cdiv(BLOCK, S_k), B * H_kv)", "cdiv_swapped",
     "cdiv(BLOCK, S) is 1"),
    ("05", "        ctx.causal, ctx.scale = causal, scale        # not tensors: plain attributes\n        return o",
     "        return o\n        ctx.causal, ctx.scale = causal, scale", "exception", "*after* its `return`"),
    ("09m", "seen = torch.ones(S_q, S_k, dtype=torch.bool)", "seen = torch.ones(S_q, S_k).bool", "shape",
     "names the method without calling it"),
    ("03", "lse = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)",
     "lse = tl.load(lse_base + offs_m[:, None] * stride_lse_s, mask=row_ok[:, None], other=0.0)",
     "row_vector_as_column", "loaded as a column"),
    ("09b", "cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()", "cu_q, cu_k = cu_seqlens_q, cu_seqlens_k",
     "exception", "0-d tensors, not Python ints"),
    ("03", "        q, k, v, do, lse, delta, dq,\n",
     "        q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(), lse, delta, dq,\n", "copy_strides",
     "a tensor that is not the one handed in"),
    ("02o", "l = l * alpha + p.sum(dim=-1, keepdim=True)", "l = l * alpha + p.sum(dim=-2, keepdim=True)", "shape",
     "reduces over axis -2, the query rows"),
    ("05", "ctx.save_for_backward(q, k, v, o, lse)", "ctx.save_for_backward([q, k, v, o, lse])", "exception",
     "hands save_for_backward one list"),
    # ---- a window edge written with another formula (window_edges.py: the class, not a list)
    ("09m", "seen &= j <= i + right", "seen &= j >= i + right", "window_edge_formula",
     "right edge `j >= i + right` where `j <= i + right` belongs"),
    ("09m", "seen &= j >= i - left", "seen &= j >= i - left - right", "window_edge_formula",
     "left edge `j >= i - left - right`"),
    # ---- one operand of the lazy chain in another's place (check/lazy.py: the class, not a list)
    ("07", "dv = A.T @ do", "dv = A.T @ v", "lazy_wrong_operand", "V in place of dO in dV = A^T dO"),
    ("07", "gate = causal & (P + c[:, None] > 0)", "gate = causal & (A + c[:, None] > 0)", "lazy_wrong_operand",
     "A in place of P in gate"),
    ("07", "dA = do @ v.T", "dA = o @ v.T", "exception", "o is not defined here; `O` is"),
    # ---- the online softmax's running sums, maximum and scale (fingerprints.py's _online)
    ("02o", "acc = acc * alpha + p @ vb", "acc = acc + p @ vb", "online_acc_not_rescaled", "acc is not rescaled"),
    ("02o", "l = l * alpha + p.sum(dim=-1, keepdim=True)", "l = l + p.sum(dim=-1, keepdim=True)",
     "online_l_not_rescaled", "l is not rescaled"),
    ("02o", "m = m_new", "m = s.amax(dim=-1, keepdim=True)", "online_m_block", "not kept as the running maximum"),
    ("02o", "l = l * alpha + p.sum(dim=-1, keepdim=True)", "l = l * alpha + torch.exp(s).sum(dim=-1, keepdim=True)",
     "online_l_unshifted", "l adds exp(s)"),
    ("02o", "s = (q.float() @ kb.transpose(-1, -2)) * scale", "s = (q.float() @ kb.transpose(-1, -2)) * scale ** 0.5",
     "scale_value", "The scale used is sqrt(scale)"),
    ("02o", "alpha = torch.exp(m - m_new)", "alpha = torch.exp(m_new - m)", "alpha", "is exp(m_new - m_old)"),
    ("02o", "p = torch.exp(s - m_new)", "p = torch.exp(s - m)", "alpha", "uses the old one"),
    # ---- blind set N's misses
    ("02o", "acc = acc * alpha + p @ vb", "acc = acc * alpha + p.to(v.dtype) @ vb", "exception", "casts p down"),
    ("02o", 's = s.masked_fill(cols > rows, float("-inf"))', 's = s.masked_fill(cols - (S_k - S_q) > rows, float("-inf"))',
     "online_bottom_right", "aligned bottom-right"),
    ("02p", "return torch.exp(S - lse[..., None])", "return torch.exp(S - lse[..., None]).mT", "shape",
     "turns the result round"),
    ("03", "BLOCK_D=flashattn.runtime.head_dim_block(D),", "BLOCK_D=32,", "head_dim_tile", "the tile is 32 columns wide"),
    ("01", "delta = (do * o).sum(dim=-1, keepdim=True)", "delta = (do * o).sum(dim=-1, keepdim=True) / scale",
     "scaled_statistic", "delta / scale in place of delta"),
    ("05", "delta = flashattn.attention_backward_delta(o, do)", "delta = flashattn.attention_backward_delta(o, do) * ctx.scale",
     "scaled_statistic", "delta * scale in place of delta"),
    ("07", "P, A, O = forward_one_head(q, k, v, bias, tau, scale)", "P, A, O = forward_one_head(q, k, v, bias, tau, 1.0)",
     "lazy_recompute_unscaled", "recomputed without the scale"),
    ("07", "dtau = (dP.sum(-1) / (i + 1)).sum()", "dtau = (dP.sum(dim=0) / (i + 1)).sum()", "lazy_dtau_broadcast",
     "sums dP over the query rows"),
    ("09m", "j = torch.arange(S_k)[None, :]", "j = torch.arange(S_k)[:, None]", "exception", "is a column where a row belongs"),
    ("09m", "seen = torch.ones(S_q, S_k, dtype=torch.bool)", "seen = torch.ones_like(i, dtype=torch.bool)", "shape",
     "the shape of i, the query positions"),
    ("09b", "cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()",
     "cu_k, cu_q = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()", "exception", "The two offset lists are swapped"),
    ("09b", "dq = ds @ k * scale", "dq = (ds * z) @ k * scale", "dq_dropped", "dQ multiplies dS by the dropout mask again"),
    ("02p", "torch.exp(S - lse[..., None])", "torch.exp(S - lse[..., None] * scale)", "scale_on_difference",
     "the LSE is multiplied by the scale"),
    ("02p", "    if causal:\n", "    if causal and S.shape[-2] == S.shape[-1]:\n", "no_mask",
     "a condition on the shape"),
    ("02o", "p = torch.exp(s - m_new)", "p = torch.exp(s - m_new) * alpha", "online_p_times_alpha", "multiplied by alpha"),
    ("02o", "for start in range(0, S_k, block_n):", "for start in range(0, S_k, block_n - 1):",
     "online_overlapping_blocks", "the blocks overlap"),
    ("07", "dk = dS.T @ q * scale", "dk = dS.T @ k * scale", "lazy_dk_operand_k", "K where Q belongs"),
    ("07", "torch.diagonal(dS, offset=-d)", "torch.diagonal(dA, offset=-d)", "lazy_dbias_from_da", "dBias sums dA"),
    ("07", "delta = (P * dP).sum(-1, keepdim=True)", "delta = (P * dP).sum(-1, keepdim=True).T", "lazy_delta_columns",
     "a row vector where a column belongs"),
    ("09m", "left, right = window", "left, right = window[0], window[0]", "window_one_side_twice",
     "used for both sides"),
    ("09m", "seen &= j >= i - left", "seen &= j >= i + (S_k - S_q) - left", "window_one_edge_bottom_right",
     "aligned bottom-right"),
    ("09m", "seen &= j <= i + right", "seen &= j <= right", "window_absolute", "an absolute key position"),
    ("09b", "dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)", "dq[qs], dk[ks], dv[ks] = g", "exception",
     "the same sizes in another order"),
    # ---- blind set M's slips (/work/eval_m: judged there, then fixed)
    ('01', 'dS = P * (dP - delta)',
     'dS = S * (dP - delta)',
     'ds_from_s', 'dS is built from the scores S where P belongs'),
    ('01', 'P = torch.softmax(S, dim=-1)',
     'P = torch.log_softmax(S, dim=-1)',
     'log_softmax', 'log-probabilities where the probabilities belong'),
    ('01', 'dP = do @ v.transpose(-1, -2)',
     'dP = do @ dv.transpose(-1, -2)',
     'wrong_operand', 'yours equals dP = dO dV^T'),
    ('02p', 'return torch.exp(S - lse[..., None])',
     'return torch.exp(S - S.amax(dim=-1, keepdim=True) - lse[..., None])',
     'p_max_and_lse', 'subtracted on top of the LSE'),
    ('02p', '    S = (q @ k.transpose(-1, -2)) * scale\n    if causal:\n        S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))\n',
     '    S = q @ k.transpose(-1, -2)\n    if causal:\n        S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf")) * scale\n',
     'scale_in_scores', 'inside the `if causal:` branch'),
    ('02o', 'acc = acc * alpha + p @ vb',
     'acc = acc * alpha + (p @ vb) / l',
     'online_normalise_in_loop', 'O is normalised twice'),
    ('02o', 's = s.masked_fill(cols > rows, float("-inf"))',
     's = s.masked_fill(cols > rows, 0.0)',
     'online_mask_zero', 'hidden scores are set to 0, not -inf'),
    ('02o', 'acc = acc * alpha + p @ vb',
     'acc *= alpha + p @ vb',
     'augmented_precedence', '`acc *= alpha + p @ vb`'),
    ('03', 'k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,',
     'k = tl.load(k_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :],',
     'contiguous_assumed', 'as if its tensor were contiguous'),
    ('03', 'q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h',
     'q_base = Q + pid_bh.to(tl.int64) * stride_q_h',
     'flat_batch_head', '`q_base = Q + pid_bh.to(tl.int64) * stride_q_h`'),
    ('03', 'offs_n = start_n + tl.arange(0, BLOCK_N)',
     'offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)',
     'positions_times_block', '`offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)`'),
    ('04', 'grid = (triton.cdiv(S_k, BLOCK), B * H_kv)',
     'grid = (triton.cdiv(S_k, BLOCK) * B * H_kv,)',
     'grid_missing_axis', 'the kernel reads tl.program_id(1)'),
    ('04', 'pT = tl.where(visible, tl.exp(sT - lse[None, :]), 0.0)',
     'pT = tl.where(visible, tl.exp(sT - lse[None, :]), float("-inf"))',
     'p_filled_neg_inf', 'filled with -inf after the exponential'),
    ('04', 'dsT = pT * (dpT - delta[None, :])',
     'dsT = tl.exp(sT - lse[None, :]) * (dpT - delta[None, :])',
     'no_mask', 'Only dK is wrong'),
    ('05', '        ctx.causal, ctx.scale = causal, scale        # not tensors: plain attributes\n',
     '        ctx.causal, ctx.scale = causal, scale        # not tensors: plain attributes\n        ctx.mark_non_differentiable(o)               # o comes from a kernel, not from autograd\n',
     'exception', 'ctx.mark_non_differentiable(o)'),
    ('05', '        ctx.save_for_backward(q, k, v, o, lse)       # O(S) per row: no S_q x S_k matrix\n',
     '        ctx.save_for_backward(q, k, v)               # the inputs\n        ctx.save_for_backward(o, lse)                # the outputs\n',
     'exception', 'save_for_backward is called 2 times'),
    ('07', 'dS = P * (dP - delta)',
     'dS = P * (dP - delta) * gate',
     'lazy_ds_gated', "the ReLU's gate is applied to dS too"),
    ('07', 'dS = P * (dP - delta)',
     'dS = P * dP.sub_(delta)',
     'lazy_dp_modified', 'dP is changed in place'),
    ('07', 'dtau = (dP.sum(-1) / (i + 1)).sum()',
     'dtau = (dP.sum(-1) // (i + 1)).sum()',
     'lazy_dtau_floor', 'floor division'),
    ('07', 'delta = (P * dP).sum(-1, keepdim=True)',
     'delta = (P * dP).sum()',
     'lazy_delta_scalar', 'one number for the whole head'),
    ('07', 'torch.diagonal(dS, offset=-d).sum() if d < L else dS.new_zeros(())',
     'torch.diagonal(dS, offset=-d).sum() if d < W else dS.new_zeros(())',
     'lazy_dbias_last_zero', 'its guard stops one diagonal early'),
    ('09m', 'seen = torch.ones(S_q, S_k, dtype=torch.bool)',
     'seen = torch.ones(S_q, S_k, dtype=torch.bool).tril()',
     'window_starts_causal', 'starts from the causal triangle'),
    ('09m', '    if right >= 0:\n        seen &= j <= i + right\n',
     '        if right >= 0:\n            seen &= j <= i + right\n',
     'window_right_nested', "tested inside the left side's if"),
    ('09m', 'seen &= j <= i + right',
     'seen = seen & j <= i + right',
     'window_and_precedence', '& binds before <='),
    ('09m', 'j = torch.arange(S_k)[None, :]',
     'j = torch.arange(1, S_k + 1)[None, :]',
     'window_one_based', 'counted from 1 on one axis'),
    ('09m', 'left, right = window',
     'left, right = (max(w, 0) for w in window)',
     'window_sentinel_clamped', 'clamped to 0'),
    # blind set S: S_k and S_q swapped in causal_mask and dropout_mask, positions from the other
    # length, m + l for the LSE, a loop over full blocks only, V dO^T for dP, an inverted guard,
    # a term computed and left out of its formula
    ('01', 'causal_mask(S.shape[-2], S.shape[-1], S.device)', 'causal_mask(S.shape[-1], S.shape[-2], S.device)',
     'lengths_swapped_in_call', '`S = S.masked_fill(~causal_mask(S.shape[-1], S.shape[-2]'),
    ('09b', 'dropout_mask(seed, H, S_q, S_k, dropout_p', 'dropout_mask(seed, H, S_k, S_q, dropout_p',
     'lengths_swapped_in_call', 'dropout_mask(seed, H, S_k, S_q'),
    ('09m', 'i = torch.arange(S_q)[:, None]', 'i = torch.arange(S_k)[:, None]',
     'positions_from_other_length', '`i = torch.arange(S_k)[:, None]`'),
    ('02o', '(m + torch.log(l)).squeeze(-1)', '(m + l).squeeze(-1)', 'lse_without_log', 'the log of the sum is missing'),
    ('03', 'for start_n in range(0, kv_end, BLOCK_N):', 'for start_n in range(0, kv_end - BLOCK_N + 1, BLOCK_N):',
     'loop_stops_before_partial_block', 'range(0, kv_end - BLOCK_N + 1, BLOCK_N)'),
    ('07', 'dA = do @ v.T', 'dA = v @ do.T', 'dp_transposed', '`dA = v @ do.T`'),
    ('05', 'if ctx.needs_input_grad[0]:', 'if not ctx.needs_input_grad[0]:', 'none_gradient', 'The guard is inverted'),
    ('07', 'gate = causal & (P + c[:, None] > 0)', 'gate = causal & (P > 0)', 'discarded_value',
     '`c` is computed and then never read'),
    # blind set U: the LSE's base from a length, a bottom-right causal mask in the kernel, the
    # group loop from 1, dTau divided by L
    ('03', 'lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h',
     'lse_base = LSE + pid_bh.to(tl.int64) * S_q', 'offset_from_length', '`lse_base = LSE + pid_bh.to(tl.int64) * S_q`'),
    ('03', 'visible = visible & (offs_n[None, :] <= offs_m[:, None])',
     'visible = visible & (offs_n[None, :] <= offs_m[:, None] + S_k - S_q)', 'kernel_mask_bottom_right', 'S_k - S_q'),
    ('04', 'for g in range(0, GROUP_SIZE):', 'for g in range(1, GROUP_SIZE + 1):', 'group_loop_from_one',
     'range(1, GROUP_SIZE + 1)'),
    ('07', 'dtau = (dP.sum(-1) / (i + 1)).sum()', 'dtau = (dP.sum(-1) / L).sum()', 'lazy_dtau_by_length',
     '`dtau = (dP.sum(-1) / L).sum()`'),
    # blind set T: delta loaded through the LSE's pointer (its own base pointer left unused)
    ('03', 'delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)',
     'delta = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)', 'discarded_value',
     'loads delta through another tensor\'s pointer'),
    # blind set S: batch and heads merged by .view (B = 2 in [B, S, H, D] memory)
    ('01', '    S = (q @ k.transpose(-1, -2)) * scale\n',
     '    B, H, S_q, D = q.shape\n    S = torch.bmm(q.view(B * H, S_q, D), k.view(B * H, -1, D).transpose(1, 2))'
     '.view(B, H, S_q, -1) * scale\n', 'exception', '.view needs memory laid out for it'),
    # blind set R: exp(S) / exp(LSE) (only the large-score case overflows), a frozen q's guard
    # around the dK/dV call
    ('02p', 'return torch.exp(S - lse[..., None])', 'return torch.exp(S) / torch.exp(lse[..., None])',
     'exp_overflow', '`return torch.exp(S) / torch.exp(lse[..., None])`'),
    ('05', '        dq = None\n        if ctx.needs_input_grad[0]:\n'
           '            dq = flashattn.attention_backward_dq(q, k, v, do, lse, delta, ctx.causal, ctx.scale)\n'
           '        dk, dv = flashattn.attention_backward_dkdv(',
     '        dq = dk = dv = None\n        if ctx.needs_input_grad[0]:\n'
     '            dq = flashattn.attention_backward_dq(q, k, v, do, lse, delta, ctx.causal, ctx.scale)\n'
     '            dk, dv = flashattn.attention_backward_dkdv(',
     'none_gradient', 'sits inside `if ctx.needs_input_grad[0]:`'),
    # (the line rule divides_by_p takes a bare `/ dropout_p`; guarded against p = 0, the outputs tell)
    ('09b', 'z = keep.to(q.dtype) / (1.0 - dropout_p)',
     'z = keep.to(q.dtype) / (dropout_p if dropout_p > 0 else 1.0)',
     'rescale_by_p', 'divides by p'),
    ('09b', 'dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)',
     'dq = dk = dv = torch.zeros_like(q)',
     'shape', 'makes *one* tensor and gives it 3 names'),
    ('09b', '        dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)\n    return dq, dk, dv\n',
     '        dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)\n        return dq, dk, dv\n',
     'return_in_loop', 'a return inside the loop'),
    ('09b', 'qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])',
     'qs, ks = slice(cu_q[b], cu_q[b] + 1), slice(cu_k[b], cu_k[b + 1])',
     'boundary_plus_one', 'cu[b] + 1 for cu[b + 1]'),
    ('09b', 'H = q.shape[1]',
     'H = q.shape[-1]',
     'heads_from_head_dim', '`H = q.shape[-1]`'),
    ('09b', 'heads(k[ks]), heads(v[ks])',
     'heads(k[ks]), heads(k[ks])',
     'same_argument_twice', 'gets `heads(k[ks])` both as k and as v'),
    # ---- blind set P (a newcomer's pass over exercise 09)
    ('09b', 'z = keep.to(q.dtype) / (1.0 - dropout_p)', 'z = keep / (1.0 - dropout_p)',
     'rescale_rounded', "float32's rounding of it"),
    ('09b', 'z = keep.to(q.dtype) / (1.0 - dropout_p)', 'z = keep * (1.0 / (1.0 - dropout_p))',
     'rescale_rounded', "float32's rounding of it"),
    ('09b', 'z = keep.to(q.dtype) / (1.0 - dropout_p)', 'z = keep.half() / (1 - dropout_p)',
     'rescale_rounded', "float16's rounding of it"),
    ('09b', 'keep = dropout_mask(seed, H, S_q, S_k, dropout_p, q.device, first_seq_head=b * H)',
     'longest = [max(b - a for a, b in zip(cu[:-1], cu[1:])) for cu in (cu_q, cu_k)]\n'
     '        keep = dropout_mask(seed, H, *longest, dropout_p, q.device, first_seq_head=b * H)[:, :S_q, :S_k]',
     'mask_drawn_at_longest', 'drawn at the longest lengths'),
    ('09b', 'dv = (P * z).transpose(-1, -2) @ do', 'dv = (P * z).transpose(-1, -2) @ o',
     'dv_uses_o', 'dV multiplies by O where dO belongs'),
    ('09b', 'dp = (do @ v.transpose(-1, -2)) * z', 'dp = (o @ v.transpose(-1, -2)) * z',
     'dp_uses_o', 'dP multiplies by O where dO belongs'),
    ('09b', 'dp = (do @ v.transpose(-1, -2)) * z\n    delta = (do * o).sum(-1, keepdim=True)\n    ds = P * (dp - delta)',
     'dp = (do @ v.transpose(-1, -2)) * keep\n    delta = (do * o).sum(-1, keepdim=True)\n'
     '    ds = P * (dp - delta) / (1.0 - dropout_p)',
     'delta_rescaled', 'the rescale reaches more than dP'),
    ('09b', 'delta = (do * o).sum(-1, keepdim=True)', 'delta = ((P * z) * dp).sum(-1, keepdim=True)',
     'delta_rescaled', 'the rescale reaches more than dP'),
    ('09b', 'lse[..., None]', 'lse[:, None]', 'exception', '`lse[:, None]` puts the new axis second'),
    # ---- blind set Q (a newcomer's pass over exercise 05)
    ('05', 'dk, dv = flashattn.attention_backward_dkdv(', 'dv, dk = flashattn.attention_backward_dkdv(',
     'grad_order', "names the call's results the other way round"),
    ('04', 'dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)',
     'dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=K.dtype.element_ty)',
     'accumulator_precision', 'dtype K.dtype.element_ty'),
    ('04', 'dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)',
     'dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float16)',
     'accumulator_precision', 'dtype tl.float16'),
    ('05', 'o, lse = flashattn.attention_forward(q, k, v, causal, scale)',
     'q.mul_(scale)\n        o, lse = flashattn.attention_forward(q, k, v, causal, 1.0)',
     'inplace_on_input', 'q.mul_(scale) the caller'),
    # ---- a loop bound one short: only a length one past a block multiple (S 65) shows it
    ('03', 'for start_n in range(0, kv_end, BLOCK_N):', 'for start_n in range(0, kv_end - 1, BLOCK_N):',
     'first_block_only', 'rows 0-63 right, wrong rows 64'),
    ('04', 'for start_m in range(m_start, S_q, BLOCK_M):', 'for start_m in range(m_start, S_q - 1, BLOCK_M):',
     'loop_one_block_short', 'match that computation exactly'),
    ('02o', 'for start in range(0, S_k, block_n):', 'for start in range(0, S_k - 1, block_n):',
     'online_drop_partial', 'match that computation exactly'),
    # ---- exercise 11: the merge of two partial results, and the ring's backward in one process
    ('11m', "    o = o_a.float() * torch.sigmoid(d)[..., None] + o_b.float() * torch.sigmoid(-d)[..., None]\n"
            "    lse = torch.maximum(lse_a, lse_b) + torch.log1p(torch.exp(-d.abs()))",
     "    lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))\n"
     "    o = o_a.float() * torch.exp(lse_a - lse)[..., None] + o_b.float() * torch.exp(lse_b - lse)[..., None]",
     'merge_overflow', 'match that computation exactly'),
    ('11m', "    d = torch.nan_to_num(d, nan=0.0)", "    pass", 'merge_masked_rows', 'match that computation exactly'),
    ('11m', "torch.sigmoid(d)[..., None] + o_b.float() * torch.sigmoid(-d)[..., None]",
     "torch.sigmoid(-d)[..., None] + o_b.float() * torch.sigmoid(d)[..., None]",
     'merge_weights_swapped', 'O wrong in'),
    ('11m', "lse = torch.maximum(lse_a, lse_b) + torch.log1p(torch.exp(-d.abs()))", "lse = torch.maximum(lse_a, lse_b)",
     'merge_lse_max', 'LSE wrong in'),
    ('11m', "torch.log1p(torch.exp(-d.abs()))", "torch.log1p(torch.exp(-d))", 'merge_lse_signed', 'LSE wrong in'),
    ('11m', "lse = torch.maximum(lse_a, lse_b) + torch.log1p(torch.exp(-d.abs()))", "lse = lse_a + lse_b",
     'merge_lse_added', 'LSE wrong in'),
    ('11m', "o = o_a.float() * torch.sigmoid(d)[..., None] + o_b.float() * torch.sigmoid(-d)[..., None]",
     "o = (o_a.float() + o_b.float()) / 2", 'merge_average', 'O wrong in'),
    ('11m', "o = o_a.float() * torch.sigmoid(d)[..., None] + o_b.float() * torch.sigmoid(-d)[..., None]",
     "o = (o_a * torch.sigmoid(d)[..., None].to(o_a.dtype) + o_b * torch.sigmoid(-d)[..., None].to(o_b.dtype)).float()",
     'merge_low_precision', 'O wrong in 1 of 6 cases'),
    ('11m', "return o, lse", "return o.to(o_a.dtype), lse", 'dtype', 'torch.float16'),
    ('11m', "o = o_a.float() * torch.sigmoid(d)[..., None] + o_b.float() * torch.sigmoid(-d)[..., None]",
     "o = o_a.float() * torch.exp(d)[..., None] + o_b.float() * torch.exp(-d)[..., None]",
     'merge_exp_weights', 'match that computation exactly'),
    ('11m', "d = torch.nan_to_num(d, nan=0.0)", "d = torch.where(torch.isinf(lse_a) | torch.isinf(lse_b), 0.0, d)",
     'merge_one_empty', 'match that computation exactly'),
    ('11m', "torch.log1p(torch.exp(-d.abs()))", "torch.log(torch.exp(-d.abs()))", 'merge_log_for_log1p',
     'LSE wrong in'),
    ('11r', "        if step + 1 < W:                                 # every block has visited every rank: no last pass\n"
            "            k_here, v_here = ring_pass(k_here), ring_pass(v_here)\n", "",
     'ring_stale_kv', 'match that computation exactly'),
    ('11r', "s = (r - step) % W", "s = (r + step) % W", 'ring_source_index', 'match that computation exactly'),
    ('11r', "positions[r], positions[s], causal, scale)", "positions[r], positions[r], causal, scale)",
     'ring_key_positions', 'match that computation exactly'),
    ('11r', "lse[r], delta[r],", "lse[s], delta[r],", 'ring_lse_of_source', 'match that computation exactly'),
    ('11r', "lse[r], delta[r],", "lse[r], delta[s],", 'ring_delta_of_source', 'match that computation exactly'),
    ('11r', "        dk_here, dv_here = ring_pass(dk_here), ring_pass(dv_here)   # the last pass brings them home",
     "            dk_here, dv_here = ring_pass(dk_here), ring_pass(dv_here)",
     'ring_dkdv_not_home', 'match that computation exactly'),
    ('11r', "        dk_here, dv_here = ring_pass(dk_here), ring_pass(dv_here)   # the last pass brings them home\n", "",
     'ring_dkdv_kept', 'match that computation exactly'),
    ('11r', "    for step in range(W):\n        for r in range(W):",
     "    for step in range(W):\n"
     "        dk_here = [torch.zeros_like(k[r], dtype=torch.float32) for r in range(W)]\n"
     "        dv_here = [torch.zeros_like(v[r], dtype=torch.float32) for r in range(W)]\n"
     "        for r in range(W):",
     'ring_dkdv_reset', 'match that computation exactly'),
    ('11r', "dq[r] += dq_b", "dq[r] = dq_b", 'ring_dq_overwritten', 'match that computation exactly'),
    ('11r', "k_here[r], v_here[r]", "v_here[r], k_here[r]", 'ring_kv_swapped', 'match that computation exactly'),
    ('11r', "for step in range(W):", "for step in range(W - 1):", 'ring_one_step_short', 'match that computation exactly'),
    ('11r', "dk_here[r] += dk_b", "dk_here[s] += dk_b", 'ring_dkdv_by_source', 'dK wrong in'),
    # delta summed in fp16: only the fp16 case, by rounding (the 'scale' rule read its ratio of 1 as
    # the factor 1/sqrt(D) / scale of a default scale)
    ('11r', "delta = [(do[r].float() * o[r].float()).sum(-1) for r in range(W)]",
     "delta = [(do[r] * o[r]).sum(-1).float() for r in range(W)]", 'low_precision', "'W=3 contiguous causal 1x2x12 fp16'"),
    ('11r', "dk_here = [torch.zeros_like(k[r], dtype=torch.float32) for r in range(W)]",
     "dk_here = [torch.zeros_like(k[r]) for r in range(W)]", 'dtype', 'torch.float16'),
]


@pytest.mark.parametrize("exercise,old,new,hint,phrase", EDITS,
                         ids=[f"{e[0]}-{e[3]}-{i}" for i, e in enumerate(EDITS)])
def test_slips_are_named(tmp_path, exercise, old, new, hint, phrase):
    r = CHECKS[exercise](_load(tmp_path, exercise, (old, new)))
    assert_hint(r, hint)
    assert phrase in " ".join(r.diagnosis().split()), r.diagnosis()


@pytest.mark.parametrize("kept", ["q, k, v, o, lse", "o"])
def test_tensors_kept_as_ctx_attributes_are_named(tmp_path, kept):
    """Blind set Q (exercise 05): forward keeps tensors as ctx attributes instead of
    save_for_backward. The gradients come out right, but autograd neither checks them for
    in-place changes nor frees them after the backward: the checker fails it, by name."""
    names = [n.strip() for n in kept.split(",")]
    rest = [n for n in ("q", "k", "v", "o", "lse") if n not in names]
    attrs = ", ".join(f"ctx.{n}" for n in names)
    edit = [("ctx.save_for_backward(q, k, v, o, lse)",
             (f"ctx.save_for_backward({', '.join(rest)})\n        " if rest else "") + f"{attrs} = {kept}"),
            ("q, k, v, o, lse = ctx.saved_tensors",
             (f"{', '.join(rest)}, = ctx.saved_tensors\n        " if rest else "") + f"{kept} = {attrs}")]
    r = CHECKS["05"](_load(tmp_path, "05", edit))
    assert_hint(r, "ctx_attributes")
    assert f"forward put {attrs} on ctx" in r.diagnosis(), r.diagnosis()


def test_a_kernel_error_shows_the_kernel_line(tmp_path):
    """Triton's interpreter re-raises a kernel's error at the launch; the line shown is the
    kernel's own (and the tiles on it, with their shapes), not the launch."""
    import flashattn

    m = _load(tmp_path, "03", ("s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale",
                               "s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale"))
    text = " ".join(CHECKS["03"](m).failure_text().split())
    assert "s = tl.dot(q, k, input_precision=DOT_PRECISION)" in text, text
    if flashattn.INTERPRET:
        assert "q [32, 16]; k [32, 16]" in text, text


def test_the_codes_warnings_come_with_the_diagnosis(tmp_path):
    """A warning the learner's code raised (softmax's implicit dim) is recorded, not printed once
    per case, and shown with the failure; the package's and torch's own warnings are not."""
    r = CHECKS["01"](_load(tmp_path, "01", ("P = torch.softmax(S, dim=-1)", "P = torch.nn.functional.softmax(S)")))
    warned = [w for w in r.code_warnings if "Implicit dimension choice for softmax" in w]
    assert len(warned) == 1 and "P = torch.nn.functional.softmax(S)" in warned[0], r.code_warnings
    assert "Your code warned: UserWarning: Implicit dimension choice" in " ".join(r.diagnosis().split())
    assert CHECKS["01"](_load(tmp_path, "01")).code_warnings == []


def test_a_gpu_run_keeps_a_float32_case(tmp_path, monkeypatch):
    """On a GPU the autograd checker's cases are float16, where ``q.half()`` changes nothing; the
    float32 case it adds there still shows the forward run on half-precision copies."""
    import flashattn.check as check

    monkeypatch.setattr(check, "_default_kernel_dtype", lambda: torch.float16)
    r = CHECKS["05"](_load(tmp_path, "05", (
        'o, lse = flashattn.attention_forward(q, k, v, causal, scale)',
        'o, lse = flashattn.attention_forward(q.half(), k.half(), v.half(), causal, scale)')))
    assert_hint(r, "forward_half")
    assert "float32 inputs" in r.table()


def test_a_16_bit_accumulator_is_named_where_only_the_fp32_case_compiles(tmp_path):
    """On a GPU, ``tl.zeros(..., dtype=K.dtype.element_ty)`` compiles for exercise 04's fp32 case
    (and passes there) but not for its fp16 ones (tl.dot's fp32 result changes the loop-carried
    type). An H200 named that 'exception'. Every case either passed or did not compile: the rule
    reads the code and names the accumulator; a case that failed otherwise leaves it to others."""
    from types import SimpleNamespace

    from flashattn.check.mistakes.did_not_run import _accumulator_precision

    m = _load(tmp_path, "04", ('dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)',
                               'dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=K.dtype.element_ty)'))

    class CompilationError(Exception):
        pass

    passed = SimpleNamespace(ok=True, error=None, launch_args=[])
    refused = SimpleNamespace(ok=False, error=CompilationError("loop-carried type changed"), launch_args=[])
    story = _accumulator_precision(SimpleNamespace(results=[refused] * 27 + [passed], subject=m.launch_dkdv))
    assert story is not None and "K.dtype.element_ty" in story and "27 of 28 cases" in story, story
    wrong = SimpleNamespace(ok=False, error=ValueError("a wrong value"), launch_args=[])
    assert _accumulator_precision(SimpleNamespace(results=[refused, wrong, passed], subject=m.launch_dkdv)) is None
