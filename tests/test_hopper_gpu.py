"""The Gluon forward (flashattn.hopper) on a Hopper GPU: O and LSE against the float64 reference,
per head, and against SDPA's own error on the same inputs; every output starts as NaN (conftest's
poisoned outputs), so an element never written fails. Skips, with the reason, wherever
``flashattn.hopper.available()`` is false (no Hopper GPU, another Triton, FLASHATTN_GLUON=0)."""
import pytest
import torch
import torch.nn.functional as F

from flashattn import hopper, runtime, settings

from conftest import TOL, per_head_error, rand, reference

try:   # the variants' names (forward.py imports only where the Gluon API is the one it was written for)
    from flashattn.hopper.forward import DEFAULT_VARIANT, VARIANTS
except Exception:   # noqa: BLE001 -- every test skips then
    DEFAULT_VARIANT, VARIANTS = "ws", ("ws", "ws2", "pingpong", "inline")

_OK, _WHY = hopper.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=f"the Gluon forward does not run here: {_WHY}")

DTYPES = [torch.float16, torch.bfloat16]
LENGTHS = [1, 63, 64, 65, 127, 128, 129, 1000, 2048, 4097]
#: (B, H, H_kv): GQA ratios 1, 2 and 4
HEADS = [(1, 2, 2), (2, 4, 2), (1, 8, 2)]
#: LSE: fp32 row statistics of exact fp32 products; a per-head relative error far below O's
LSE_TOL = 1e-4


def _check(q, k, v, causal, variant=None, scale=None):
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    o, lse = hopper.attention_forward(q, k, v, causal, scale, variant=variant)
    ref = reference(q, k, v, causal=causal, scale=scale)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert torch.isfinite(o).all(), f"O: {int((~torch.isfinite(o)).sum())} NaN/inf (unwritten elements?)"
    assert torch.isfinite(lse).all(), f"LSE: {int((~torch.isfinite(lse)).sum())} NaN/inf"
    err = per_head_error(o, ref["O"])
    kv_rep = q.shape[1] // k.shape[1]
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(kv_rep, 1), v.repeat_interleave(kv_rep, 1),
                                          is_causal=causal, scale=scale)
    sdpa_err = per_head_error(sdpa, ref["O"])
    tol = TOL[q.dtype]
    # as good as SDPA's own rounding (P in 16 bits as ours), with room for a different order of sums
    allowed = torch.maximum(2.0 * sdpa_err, torch.full_like(sdpa_err, 0.2 * tol)).clamp_max(tol)
    assert (err <= allowed).all(), (f"O: worst head rel err {float(err.max()):.2e}; allowed per head (2x SDPA's, "
                                    f"at most {tol:.0e}):\nours\n{err}\nsdpa\n{sdpa_err}")
    lse_err = per_head_error(lse, ref["LSE"])
    assert float(lse_err.max()) <= LSE_TOL, f"LSE: worst head rel err {float(lse_err.max()):.2e}\n{lse_err}"
    return o, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("S", LENGTHS, ids=lambda s: f"S{s}")
def test_matches_the_reference(S, D, causal, dtype):
    B, H, H_kv = HEADS[LENGTHS.index(S) % len(HEADS)]
    _check(rand(B, H, S, D, dtype=dtype), rand(B, H_kv, S, D, dtype=dtype), rand(B, H_kv, S, D, dtype=dtype), causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("S_q, S_k", [(65, 1000), (1000, 65), (129, 4097), (2048, 127), (1, 129), (300, 1)],
                         ids=lambda s: str(s))
def test_query_and_key_lengths_differ(S_q, S_k, D, causal, dtype):
    _check(rand(2, 4, S_q, D, dtype=dtype), rand(2, 1, S_k, D, dtype=dtype), rand(2, 1, S_k, D, dtype=dtype), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D, dtype", [(64, torch.bfloat16), (128, torch.float16)], ids=["D64-bf16", "D128-fp16"])
@pytest.mark.parametrize("S_q, S_k", [(1, 1), (129, 129), (1000, 2048), (4097, 300)], ids=str)
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != DEFAULT_VARIANT])
def test_the_other_variants(variant, S_q, S_k, D, dtype, causal):
    """forward.VARIANTS besides the default: "ws2" (two consumer partitions of one warpgroup each),
    "pingpong" (the same, issuing their products in turn), "inline" (no producer warp: the consumers
    issue the copies)."""
    _check(rand(1, 4, S_q, D, dtype=dtype), rand(1, 2, S_k, D, dtype=dtype), rand(1, 2, S_k, D, dtype=dtype), causal,
           variant=variant)


@pytest.mark.parametrize("layout", ["bshd", "padded_heads"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
def test_strided_inputs(layout, D, causal):
    """[B, S, H, D] storage (a projection's output) and a slice of heads: the descriptors take
    the tensors' own strides; the output is dense either way."""
    q = rand(2, 4, 333, D, dtype=torch.bfloat16, layout=layout)
    k, v = (rand(2, 2, 517, D, dtype=torch.bfloat16, layout=layout) for _ in range(2))
    assert not q.is_contiguous()
    o, _ = _check(q, k, v, causal)
    assert o.is_contiguous()


def test_a_batch_of_one_with_odd_strides_in_its_size_one_dims():
    q = torch.randn(1, 1, 200, 128, device="cuda", dtype=torch.float16).as_strided((1, 1, 200, 128), (7, 3, 128, 1))
    k = torch.randn(1, 1, 90, 128, device="cuda", dtype=torch.float16)
    _check(q, k, torch.randn_like(k), causal=True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nothing_is_written_outside_the_outputs(causal, variant):
    """Guard regions around O and LSE (runtime.guarded_outputs): the TMA store drops rows past S_q,
    the LSE store is masked."""
    q, k, v = (rand(1, 2, 129, 64, dtype=torch.float16) for _ in range(3))
    with runtime.guarded_outputs() as records:
        hopper.attention_forward(q, k, v, causal, 0.125, variant=variant)
        torch.cuda.synchronize()
    assert len(records) == 2 and not runtime.guard_violations(records), runtime.guard_violations(records)


def test_scale_and_large_logits():
    """A large scale (peaked softmax, rows dominated by one key) and a small one (nearly flat)."""
    for scale in (2.0, 1e-3):
        q, k, v = (rand(1, 2, 300, 64, dtype=torch.bfloat16) for _ in range(3))
        _check(q, k, v, True, scale=scale)


def test_lse_matches_the_fast_forward():
    """The backward kernels read this LSE: the ``tl`` fast forward's, to fp32 rounding."""
    from flashattn.fast.forward import fast_attention_forward

    q, k, v = (rand(2, 4, 1000, 128, dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        o, lse = hopper.attention_forward(q, k, v, causal, 128 ** -0.5)
        with settings.override(gluon=False):
            o_tl, lse_tl = fast_attention_forward(q, k, v, causal, 128 ** -0.5)
        assert (lse - lse_tl).abs().max() < 1e-3
        assert (o.float() - o_tl.float()).abs().max() < 2e-2


def test_the_fast_path_runs_it_where_it_measured_faster(monkeypatch):
    """``fast_attention_forward`` takes the Gluon forward for long inputs (``hopper.preferred``),
    the ``tl`` one for short ones and with ``FLASHATTN_GLUON=0``; both give the same attention."""
    from flashattn.fast import forward as fast_forward
    from flashattn.hopper import forward as hopper_forward

    calls = []
    real = hopper_forward.launch
    monkeypatch.setattr(hopper_forward, "launch", lambda *a, **kw: calls.append(kw["variant"]) or real(*a, **kw))
    q, k, v = (rand(1, 4, 4096, 128, dtype=torch.bfloat16) for _ in range(3))
    o, lse = fast_forward.fast_attention_forward(q, k, v, True, 128 ** -0.5)
    assert calls == ["pingpong"]
    with settings.override(gluon=False):
        o_tl, lse_tl = fast_forward.fast_attention_forward(q, k, v, True, 128 ** -0.5)
    assert calls == ["pingpong"]
    assert (lse - lse_tl).abs().max() < 1e-3 and (o.float() - o_tl.float()).abs().max() < 3e-2
    short = [rand(1, 4, 1024, 64, dtype=torch.bfloat16) for _ in range(3)]
    fast_forward.fast_attention_forward(*short, True, 0.125)
    assert calls == ["pingpong"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_training_through_the_drop_in_on_the_gluon_forward(causal):
    """Forward by the Gluon kernel, backward by the ``tl`` kernels on its O and LSE: gradients
    per head against float64, as the fast path's own tests hold them."""
    import flashattn

    q, k, v = (rand(1, 4, 4100, 128, dtype=torch.bfloat16) for _ in range(3))
    k, v = k[:, :2], v[:, :2]                      # GQA 2:1 (a slice of heads: strides of a wider tensor)
    assert hopper.preferred(q, k, causal) is not None and hopper.supports(q, k, v, causal)[0]
    do = rand(1, 4, 4100, 128, dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flashattn.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(do)
    ref = reference(q, k, v, do, causal=causal)
    for name, got in (("O", out), ("dQ", leaves[0].grad), ("dK", leaves[1].grad), ("dV", leaves[2].grad)):
        err = per_head_error(got, ref[name])
        assert float(err.max()) < TOL[torch.bfloat16], f"{name}: worst head rel err {float(err.max()):.2e}"
