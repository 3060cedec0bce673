"""The Gluon backward (flashattn.hopper.backward: the fast path's backward at D 64 causal from 4k keys) on a Hopper GPU: dQ, dK, dV
against the float64 reference per head, allowed twice SDPA's own error on the same inputs (at most
the dtype's tolerance). Skips wherever ``flashattn.hopper.available()`` is false."""
import pytest
import torch
import torch.nn.functional as F

from flashattn import hopper

from conftest import HEAD_NORM_FLOOR, TOL, per_head_error, rand, reference

_OK, _WHY = hopper.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=f"the Gluon kernels do not run here: {_WHY}")

#: (B, H, H_kv, S_q, S_k): odd lengths, S_q != S_k, GQA 1, 2 and 4
SHAPES = [(1, 2, 2, 1, 1), (2, 4, 2, 65, 65), (1, 8, 2, 127, 300), (2, 2, 2, 1000, 1000), (1, 4, 1, 517, 333),
          (1, 2, 2, 2048, 2048), (2, 16, 4, 4096, 4096)]


VARIANTS = ["inline", "ws", "prefetch", "prefetch_lag", "tma", "tma3", "tma3_lag", "ws_tma", "ws_tma3"]     # backward.VARIANTS (checked below)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}/{}Sq{}Sk{}".format(*s))
def test_gradients_match_the_reference(shape, variant, D, causal, dtype):
    from flashattn.hopper import backward as bwd

    B, H, H_kv, S_q, S_k = shape
    q, k, v, do = rand(B, H, S_q, D, dtype=dtype), rand(B, H_kv, S_k, D, dtype=dtype), \
        rand(B, H_kv, S_k, D, dtype=dtype), rand(B, H, S_q, D, dtype=dtype)
    scale = D ** -0.5
    o, lse = hopper.attention_forward(q, k, v, causal, scale)
    dq, dk, dv = bwd.launch(q, k, v, o, do, lse, causal, scale, variant=variant)
    again = bwd.launch(q, k, v, o, do, lse, causal, scale, variant=variant)     # dK, dV take no atomics: bit for bit
    assert torch.equal(dk, again[1]) and torch.equal(dv, again[2]), "dK / dV differ between two runs (a race?)"
    ref = reference(q, k, v, do, causal=causal, scale=scale)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    rep = H // H_kv
    sdpa = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(rep, 1),
                                          leaves[2].repeat_interleave(rep, 1), is_causal=causal, scale=scale)
    sdpa.backward(do)
    for name, got, theirs in zip(("dQ", "dK", "dV"), (dq, dk, dv), (t.grad for t in leaves)):
        assert torch.isfinite(got).all(), f"{name}: {int((~torch.isfinite(got)).sum())} NaN/inf"
        err, floor = (per_head_error(x, ref[name], HEAD_NORM_FLOOR) for x in (got, theirs))
        allowed = torch.maximum(2.0 * floor, torch.full_like(floor, 0.2 * TOL[dtype])).clamp_max(TOL[dtype])
        assert (err <= allowed).all(), f"{name}: ours\n{err}\nSDPA's\n{floor}"


def test_variant_list_is_every_variant():
    from flashattn.hopper import backward as bwd

    from flashattn.hopper import lesson

    assert VARIANTS == list(bwd.VARIANTS) and set(bwd.BEST.values()) <= set(VARIANTS)
    assert lesson.BACKWARD_BEST == bwd.BEST, "lesson 12 names another best variant than the kernel's module"


def test_bad_arguments_are_refused_with_the_choices():
    from flashattn.hopper import backward as bwd

    q = rand(1, 2, 64, 64, dtype=torch.bfloat16)
    o, lse = hopper.attention_forward(q, q, q, False, 0.125)
    with pytest.raises(ValueError, match="the variants are inline, ws"):
        bwd.launch(q, q, q, o, q, lse, False, 0.125, variant="pair")
    with pytest.raises(ValueError, match="the modes are"):
        bwd.launch(q, q, q, o, q, lse, False, 0.125, dq_mode="red")
    with pytest.raises(ValueError, match="measured with the 'inline' and 'prefetch' variants"):
        bwd.launch(q, q, q, o, q, lse, False, 0.125, variant="ws", dq_mode="none")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_training_through_the_drop_in_with_a_preferred_gluon_backward(monkeypatch, causal):
    """A row of ``hopper.BACKWARD_PREFERRED`` (here one set by the test) sends the fast path's backward to
    that Gluon variant ("prefetch", one that has passed its battery): SDPA's drop-in trains through
    it, K and V as a slice of a wider tensor's heads (GQA 2:1), gradients per head against float64."""
    import flashattn
    from flashattn.hopper import backward as bwd

    calls = []
    real = bwd.launch
    monkeypatch.setattr(bwd, "launch", lambda *a, **kw: calls.append(kw["variant"]) or real(*a, **kw))
    monkeypatch.setitem(hopper.BACKWARD_PREFERRED, (64, causal), (1, "prefetch"))
    q, k, v, do = (rand(2, 4, 1000, 64, dtype=torch.bfloat16) for _ in range(4))
    leaves = [q.detach().requires_grad_(True)] + [t[:, :2].detach().requires_grad_(True) for t in (k, v)]
    assert not leaves[1].is_contiguous()
    out = flashattn.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(do)
    assert calls == ["prefetch"], calls
    ref = reference(q, k[:, :2], v[:, :2], do, causal=causal)
    for name, got in (("dQ", leaves[0].grad), ("dK", leaves[1].grad), ("dV", leaves[2].grad)):
        err = per_head_error(got, ref[name], HEAD_NORM_FLOOR)
        assert float(err.max()) < TOL[torch.bfloat16], f"{name}: worst head rel err {float(err.max()):.2e}"
    with hopper.tl_backward_only():                 # the benchmarks' baseline: the tl kernels
        leaves[0].grad = None
        flashattn.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True).backward(do)
    assert calls == ["prefetch"] and hopper.BACKWARD_PREFERRED[(64, causal)] == (1, "prefetch")


def test_the_committed_row_runs_in_training_with_the_right_gradients():
    """As committed, ``BACKWARD_PREFERRED`` sends a causal D 64 backward of 4k keys to "ws_tma":
    SDPA's drop-in trains through it (odd query count, GQA 2:1), gradients per head against float64;
    the same call with fewer keys than the row's stays on the tl kernels."""
    import flashattn
    from flashattn.hopper import backward as bwd

    fewest, variant = hopper.BACKWARD_PREFERRED[(64, True)]
    calls = []
    real = bwd.launch
    bwd_launch = lambda *a, **kw: calls.append(kw["variant"]) or real(*a, **kw)      # noqa: E731
    for S_q, S_k, expected in ((fewest - 3, fewest, [variant]), (fewest - 3, fewest - 64, [])):
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bwd, "launch", bwd_launch)
            q, do = rand(1, 4, S_q, 64, dtype=torch.bfloat16), rand(1, 4, S_q, 64, dtype=torch.bfloat16)
            k, v = rand(1, 2, S_k, 64, dtype=torch.bfloat16), rand(1, 2, S_k, 64, dtype=torch.bfloat16)
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            flashattn.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(do)
        assert calls == expected, (S_k, calls)
        ref = reference(q, k, v, do, causal=True)
        for name, got in (("dQ", leaves[0].grad), ("dK", leaves[1].grad), ("dV", leaves[2].grad)):
            err = per_head_error(got, ref[name], HEAD_NORM_FLOOR)
            assert float(err.max()) < TOL[torch.bfloat16], f"{name} (S_k {S_k}): worst head rel err {float(err.max()):.2e}"
