"""Lesson 09's checkers: the worked solution passes, and every diagnosis is proven by a planted
mistake -- a one-line edit of the solution -- that triggers exactly it."""
import linecache

import pytest

from flashattn import check
from conftest import assert_clean, assert_hint, run_checker

SOLUTION = '''
import torch
from flashattn.beyond import dropout_mask

def visible_mask(S_q, S_k, window):
    left, right = window
    i = torch.arange(S_q)[:, None]
    j = torch.arange(S_k)[None, :]
    seen = torch.ones(S_q, S_k, dtype=torch.bool)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    return seen

def sequence_backward(q, k, v, o, do, lse, keep, dropout_p, seen, scale):
    P = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])
    P = P.masked_fill(~seen, 0.0)
    z = keep.to(q.dtype) / (1.0 - dropout_p)
    dv = (P * z).transpose(-1, -2) @ do
    dp = (do @ v.transpose(-1, -2)) * z
    delta = (do * o).sum(-1, keepdim=True)
    ds = P * (dp - delta)
    dq = ds @ k * scale
    dk = ds.transpose(-1, -2) @ q * scale
    return dq, dk, dv

def packed_backward(q, k, v, o, do, lse, cu_seqlens_q, cu_seqlens_k, window, dropout_p, seed, scale):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    H = q.shape[1]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        S_q, S_k = qs.stop - qs.start, ks.stop - ks.start
        keep = dropout_mask(seed, H, S_q, S_k, dropout_p, q.device, first_seq_head=b * H)
        seen = visible_mask(S_q, S_k, window).to(q.device)
        heads = lambda t: t.transpose(0, 1)
        g = sequence_backward(heads(q[qs]), heads(k[ks]), heads(v[ks]), heads(o[qs]), heads(do[qs]),
                              lse[qs].T, keep, dropout_p, seen, scale)
        dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)
    return dq, dk, dv
'''


def solution(old=None, new=None):
    """The worked solution's functions, with ``old`` replaced by ``new`` (exactly once)."""
    src = SOLUTION
    if old is not None:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    namespace = {}
    name = f"<exercise 09 {abs(hash(src))}>"     # registered as a notebook cell is: the checker reads its lines
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    exec(compile(src, name, "exec"), namespace)
    return namespace


def test_the_solution_passes_both_checkers():
    ns = solution()
    assert_clean(run_checker(check.window_mask, ns["visible_mask"]))
    assert_clean(run_checker(check.beyond_backward, ns["packed_backward"]))


WINDOW_SLIPS = [
    ("seen &= j >= i - left", "seen &= j > i - left", "window_left_off"),
    ("seen &= j <= i + right", "seen &= j < i + right", "window_right_off"),
    ("    left, right = window\n    i =", "    right, left = window\n    i =", "window_swapped"),
    ("    if left >= 0:\n        seen &= j >= i - left", "    seen &= j >= i - left", "window_minus_one"),
    ("i = torch.arange(S_q)[:, None]", "i = torch.arange(S_q)[:, None] + S_k - S_q", "window_bottom_right"),
    ("    if left >= 0:\n", "    if left > 0:\n", "window_zero_unlimited"),
    ("    if left >= 0:\n        seen &= j >= i - left\n    if right >= 0:",
     "    if left > 0:\n        seen &= j >= i - left\n    if right > 0:", "window_zero_unlimited"),
    ("seen &= j >= i - left", "seen &= (i - j).abs() <= left", "window_abs_distance"),
    ("seen &= j <= i + right", "seen &= (j - i).abs() <= right", "window_abs_distance"),
]


@pytest.mark.parametrize("old,new,hint", WINDOW_SLIPS, ids=[f"{s[2]}-{i}" for i, s in enumerate(WINDOW_SLIPS)])
def test_window_slips_are_named_by_both_checkers(old, new, hint):
    ns = solution(old, new)
    assert_hint(run_checker(check.window_mask, ns["visible_mask"]), hint)
    assert_hint(run_checker(check.beyond_backward, ns["packed_backward"]), hint)


BACKWARD_SLIPS = [
    ("z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = keep.to(q.dtype)", "no_rescale"),
    ("dv = (P * z).transpose", "dv = (P * keep).transpose", "no_rescale_dv"),
    ("dp = (do @ v.transpose(-1, -2)) * z", "dp = (do @ v.transpose(-1, -2)) * keep", "no_rescale_dp"),
    ("dv = (P * z).transpose", "dv = P.transpose", "dv_no_mask"),
    ("dp = (do @ v.transpose(-1, -2)) * z", "dp = do @ v.transpose(-1, -2)", "dp_no_mask"),
    ("ds = P * (dp - delta)", "ds = P * z * (dp - delta)", "ds_dropped_p"),
    ("delta = (do * o).sum(-1, keepdim=True)", "delta = (P * (do @ v.transpose(-1, -2))).sum(-1, keepdim=True)",
     "delta_unmasked_dp"),
    ("first_seq_head=b * H", "first_seq_head=0", "mask_same_for_all"),
    ("first_seq_head=b * H", "first_seq_head=b", "mask_numbered_by_b"),
    ("keep = dropout_mask(seed, H, S_q, S_k, dropout_p, q.device, first_seq_head=b * H)",
     "keep = torch.rand(H, S_q, S_k, device=q.device) >= dropout_p", "dropout_mask_differs"),
    ("dropout_mask(seed, H,", "dropout_mask(seed + 1, H,", "dropout_mask_differs"),
    ("    P = P.masked_fill(~seen, 0.0)\n", "", "no_visible"),
    ("for b in range(len(cu_q) - 1):\n        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])",
     "for b in range(1):\n        qs, ks = slice(0, cu_q[-1]), slice(0, cu_k[-1])", "leak"),
    ("seen = visible_mask(S_q, S_k, window).to(q.device)",
     "seen = visible_mask(cu_q[b + 1], cu_k[b + 1], window)[cu_q[b]:, cu_k[b]:].to(q.device)", "global_positions"),
    ("P = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])\n    P = P.masked_fill(~seen, 0.0)",
     "P = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(~seen, float('-inf')), dim=-1)",
     "beyond_empty_rows"),
    ("dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)", "dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)\n"
     "        break", "sequences"),
    ("delta = (do * o).sum(-1, keepdim=True)", "delta = (do * o).sum(-1, keepdim=True) / (1.0 - dropout_p)",
     "delta_rescaled"),
    ("z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = keep.to(q.dtype) * (1.0 - dropout_p)", "rescale_inverted"),
    ("z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = keep.to(q.dtype) / (1.0 - dropout_p) ** 2", "rescale_twice"),
    ("z = keep.to(q.dtype) / (1.0 - dropout_p)", "z = (~keep).to(q.dtype) / (1.0 - dropout_p)", "keep_inverted"),
    ("P = P.masked_fill(~seen, 0.0)", "P = P.masked_fill(seen, 0.0)", "window_inverted"),
    ("P = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])",
     "P = torch.exp(q @ k.transpose(-1, -2) - lse[..., None])", "unscaled_scores"),
    ("P = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])",
     "P = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)", "softmax_then_mask"),
    ("g = sequence_backward(", "scale = q.shape[-1] ** -0.5\n        g = sequence_backward(", "scale_ignored"),
    ("for b in range(len(cu_q) - 1):", "for b in range(len(cu_q) - 2):", "last_sequence"),
    ("keep = dropout_mask(seed, H, S_q, S_k, dropout_p, q.device, first_seq_head=b * H)",
     "keep = dropout_mask(seed, H, cu_q[-1], cu_k[-1], dropout_p, q.device)[:, qs, ks]", "mask_sliced_from_whole"),
    ("dv = (P * z).transpose(-1, -2) @ do", "dv = (P * keep.to(q.dtype) * (1.0 + dropout_p)).transpose(-1, -2) @ do",
     "dropout_rescale"),     # 1 / (1 - p) "approximated" by 1 + p: no classic slip, a constant factor
    ("heads = lambda t: t.transpose(0, 1)", "heads = lambda t: t.reshape(t.shape[1], t.shape[0], t.shape[2])",
     "heads_reshape"),
    ("P = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])",
     "P = torch.exp(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 - lse[..., None])", "beyond_custom_scale"),
]


@pytest.mark.parametrize("old,new,hint", BACKWARD_SLIPS, ids=[f"{s[2]}-{i}" for i, s in enumerate(BACKWARD_SLIPS)])
def test_backward_slips_are_named(old, new, hint):
    ns = solution(old, new)
    assert_hint(run_checker(check.beyond_backward, ns["packed_backward"]), hint)


def test_input_written_in_place_is_named():
    """The gradients right, but the caller's q doubled on the way out."""
    ns = solution("        dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)\n    return dq, dk, dv",
                  "        dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)\n    q.mul_(2.0)\n    return dq, dk, dv")
    r = run_checker(check.beyond_backward, ns["packed_backward"])
    assert_hint(r, "input_modified")
    text = " ".join(r.diagnosis().split())
    assert "wrote into its input Q in" in text and "scaled by 2)" in text, text


@pytest.mark.parametrize("old, new, says", [
    ("qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])", "qs = ks = slice(cu_q[b], cu_q[b + 1])",
     "key-side ones (k, v) with cu_seqlens_k[b]:cu_seqlens_k[b + 1]"),
    ("lse[qs].T, keep", "lse[qs], keep", "is in the packed layout, heads last"),
])
def test_packed_layout_slips_raise_with_their_story(old, new, says):
    """Shape errors of the packed loop: keys sliced with the queries' offsets, a sequence's LSE
    left [S_q, H]. The exception's idea says which slice or layout."""
    r = run_checker(check.beyond_backward, solution(old, new)["packed_backward"])
    assert_hint(r, "exception")
    assert says in " ".join(r.diagnosis().split()), r.diagnosis()
