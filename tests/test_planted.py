"""planted: a one-line edit of a real kernel's source gives a working, buggy copy."""
import pytest
import torch

import flashattn
from flashattn import backward, planted

from conftest import TOL, per_head_error, rand, reference

DO_HEAD_STRIDE_BUG = planted.Edit("h.to(tl.int64) * stride_do_h", "h.to(tl.int64) * stride_q_h")


def test_planted_bug_breaks_heads_after_the_first_and_is_undone():
    # q laid out [B, S, H, D] (head stride D), dO contiguous (head stride S*D): the buggy offset
    # stays inside dO, reading the wrong rows for every head but head 0.
    B, H, S, D = 1, 3, 24, 16
    q, k, v = rand(B, H, S, D, layout="bshd"), rand(B, H, S, D), rand(B, H, S, D)
    do = rand(B, H, S, D)
    o, lse = flashattn.attention_forward(q, k, v, True)
    delta = flashattn.attention_backward_delta(o, do)
    ref = reference(q, k, v, do, causal=True)
    with planted.planted_bug(backward, "attn_bwd_dq_kernel", [DO_HEAD_STRIDE_BUG]):
        bad = flashattn.attention_backward_dq(q, k, v, do, lse, delta, True)
    err = per_head_error(bad, ref["dQ"])[0]
    assert err[0] < TOL[torch.float32] and (err[1:] > 1e-2).all()
    good = flashattn.attention_backward_dq(q, k, v, do, lse, delta, True)  # real kernel is back
    assert per_head_error(good, ref["dQ"]).max() < TOL[torch.float32]


def test_diff_shows_the_one_changed_line():
    text = planted.diff(backward.attn_bwd_dq_kernel, [DO_HEAD_STRIDE_BUG])
    changed = [l for l in text.splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert len(changed) == 2 and "stride_q_h" in changed[1]


def test_edit_that_no_longer_matches_fails_loudly():
    with pytest.raises(ValueError, match="Has the kernel changed"):
        planted.mutated_kernel(backward.attn_bwd_dq_kernel, [planted.Edit("no such text", "x")])
