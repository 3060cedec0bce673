"""flash_attention as users call it: autograd, SDPA parity, gradcheck, dtypes, realistic sizes."""
import warnings

import pytest
import torch

import flashattn
from flashattn import flash_attention

from conftest import DEVICE, DTYPES, ON_GPU, TOL, assert_close_per_head, rand, reference


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _run(fn, q, k, v, do):
    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    out = fn(q, k, v)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 4, 37, 37, 64), (1, 6, 2, 29, 45, 48), (2, 4, 1, 45, 29, 32)],
                         ids=lambda s: "B{}H{}Hkv{}Sq{}Sk{}D{}".format(*s))
def test_matches_sdpa(shape, causal):
    B, H, H_kv, S_q, S_k, D = shape
    q, k, v, do = rand(B, H, S_q, D), rand(B, H_kv, S_k, D), rand(B, H_kv, S_k, D), rand(B, H, S_q, D)
    ours = _run(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, do)
    sdpa = _run(lambda a, b, c: flashattn.sdpa(a, b, c, causal=causal), q, k, v, do)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), ours, sdpa):
        assert_close_per_head(name, a, b, 2 * TOL[torch.float32])


def test_sum_backward_gives_stride0_grad():
    """out.sum().backward() hands the backward a dO whose strides are all 0."""
    q, k, v = rand(2, 3, 31, 32, layout="bshd"), rand(2, 3, 31, 32), rand(2, 3, 31, 32)
    seen = {}
    names = ("attention_backward", "fast_attention_backward")     # whichever kernels run here
    originals = {n: getattr(flashattn.ops, n) for n in names}

    def spy(name):
        def call(q_, k_, v_, o_, do_, *args, **kwargs):
            seen.setdefault("stride", do_.stride())
            return originals[name](q_, k_, v_, o_, do_, *args, **kwargs)
        return call

    def seen_first(do_):      # the fast path copies a stride-0 dO before its kernels (contiguous_do)
        seen.setdefault("stride", do_.stride())
        return originals["contiguous_do"](do_)

    names += ("contiguous_do",)
    originals["contiguous_do"] = flashattn.ops.contiguous_do
    for n in names[:2]:
        setattr(flashattn.ops, n, spy(n))
    flashattn.ops.contiguous_do = seen_first
    try:
        ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
        flash_attention(ql, kl, vl, causal=True).sum().backward()
    finally:
        for n in names:
            setattr(flashattn.ops, n, originals[n])
    assert seen["stride"] == (0, 0, 0, 0)
    ref = reference(q, k, v, torch.ones_like(q), causal=True)
    for name, got in (("dQ", ql.grad), ("dK", kl.grad), ("dV", vl.grad)):
        assert_close_per_head(name, got, ref[name], TOL[torch.float32])


@pytest.mark.parametrize("which", ["q", "k", "v", "kv"])
def test_grads_only_for_inputs_that_require_them(which):
    q, k, v = (rand(1, 2, 20, 16) for _ in range(3))
    leaves = {n: (_leaf(t) if n in which else t) for n, t in zip("qkv", (q, k, v))}
    flash_attention(leaves["q"], leaves["k"], leaves["v"]).sum().backward()
    ref = reference(q, k, v, torch.ones_like(q))
    for n, key in zip("qkv", ("dQ", "dK", "dV")):
        if n in which:
            assert_close_per_head(key, leaves[n].grad, ref[key], TOL[torch.float32])
        else:
            assert leaves[n].grad is None


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    """Finite differences in float64 agree with the kernels' analytic gradients (GQA too)."""
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 1, 9, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 1, 9, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: flash_attention(a, b, c, causal=causal),
                                    (q, k, v), fast_mode=True)


def test_gradcheck_catches_a_wrong_gradient():
    """The check above can fail: a backward with dQ 10% off is rejected."""
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return flashattn.attention_forward(q, k, v)[0]

        @staticmethod
        def backward(ctx, do):
            q, k, v = ctx.saved_tensors
            o, lse = flashattn.attention_forward(q, k, v)
            dq, dk, dv = flashattn.attention_backward(q, k, v, o, do, lse)
            return dq * 1.1, dk, dv

    q = torch.randn(1, 1, 4, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 1, 4, 8, dtype=torch.float64, device=DEVICE) for _ in range(2))
    assert not torch.autograd.gradcheck(lambda a: Wrong.apply(a, k, v), (q,), fast_mode=True,
                                        raise_exception=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_end_to_end(dtype):
    q, k, v, do = (rand(2, 4, 40, 64, dtype=dtype) for _ in range(4))
    out, dq, dk, dv = _run(lambda a, b, c: flash_attention(a, b, c, causal=True), q, k, v, do)
    ref = reference(q, k, v, do, causal=True)
    for name, got in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)):
        assert got.dtype == dtype
        assert_close_per_head(name, got, ref[name], TOL[dtype])


def test_bfloat16():
    """Native on a GPU (sm 8.0+); on the CPU interpreter it runs in fp32, with a warning."""
    q, k, v, do = (rand(1, 2, 33, 32, dtype=torch.bfloat16) for _ in range(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, dq, dk, dv = _run(lambda a, b, c: flash_attention(a, b, c), q, k, v, do)
    fell_back = any(issubclass(w.category, flashattn.BF16FallbackWarning) for w in caught)
    assert fell_back == (not ON_GPU or torch.cuda.get_device_capability()[0] < 8)
    ref = reference(q, k, v, do)
    for name, got in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)):
        assert got.dtype == torch.bfloat16
        assert_close_per_head(name, got, ref[name], TOL[torch.bfloat16])


def test_bf16_raw_launcher():
    """The raw launchers never cast behind your back: bf16 runs natively or is refused."""
    q = rand(1, 1, 8, 16, dtype=torch.bfloat16)
    if torch.bfloat16 in flashattn.runtime.supported_dtypes():
        o, _ = flashattn.attention_forward(q, q, q)
        assert o.dtype == torch.bfloat16
    else:
        with pytest.raises(TypeError, match="bfloat16"):
            flashattn.attention_forward(q, q, q)


def test_check_attention_report_passes_and_lists_tensors(capsys):
    q, k, v = (rand(1, 2, 24, 32) for _ in range(3))
    report = flashattn.check_attention(q, k, v, causal=True)
    assert report.ok
    assert [r.name for r in report.rows] == ["O", "LSE", "dQ", "dK", "dV"]
    assert "PASS" in capsys.readouterr().out


def test_compare_names_the_broken_head():
    ref = torch.randn(2, 4, 10, 8)
    bad = ref.clone()
    bad[1, 2] += 0.5
    c = flashattn.compare("dQ", bad, ref, dtype=torch.float32)
    assert not c.ok and c.worst_head == (1, 2)
    nan = ref.clone()
    nan[0, 0, 3, 3] = float("nan")
    assert not flashattn.compare("dQ", nan, ref, dtype=torch.float32).ok


# Realistic sizes on a GPU (B=4, H=16, S=4096); on the CPU the same test at a size the
# interpreter can do in a second or two.
REALISTIC = [(4, 16, 4096, 64), (4, 16, 4096, 128)] if ON_GPU else [(1, 2, 96, 64)]
REAL_DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", REALISTIC, ids=lambda s: "B{}H{}S{}D{}".format(*s))
def test_realistic_size(size, causal, dtype):
    B, H, S, D = size
    q, k, v, do = (rand(B, H, S, D, dtype=dtype, layout="bshd") for _ in range(4))
    out, dq, dk, dv = _run(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, do)
    ref = reference(q, k, v, do, causal=causal)
    for name, got in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)):
        assert_close_per_head(name, got, ref[name], TOL[dtype])
