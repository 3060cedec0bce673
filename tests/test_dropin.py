"""flashattn.scaled_dot_product_attention as a drop-in for SDPA: the signature and its
semantics, the PyTorch operators (opcheck, fake tensors), torch.compile with no graph break,
autocast, and on a GPU CUDA graphs and inductor."""
import inspect

import pytest
import torch
import torch.nn.functional as F

import flashattn
from flashattn import ops

from conftest import DEVICE, ON_GPU, TOL, assert_close_per_head, rand, reference

DTYPE = torch.float16 if ON_GPU else torch.float32


def test_signature_is_sdpas():
    ours = inspect.signature(flashattn.scaled_dot_product_attention)
    theirs = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    assert list(ours.parameters) == theirs
    assert [ours.parameters[n].default for n in theirs[3:]] == [None, 0.0, False, None, False]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 4, 37, 37, 32), (1, 8, 2, 23, 50, 64), (2, 3, 1, 50, 23, 16)],
                         ids=lambda s: "B{}H{}Hkv{}Sq{}Sk{}D{}".format(*s))
def test_matches_sdpa_forward_and_backward(shape, causal):
    B, H, H_kv, S_q, S_k, D = shape
    q, k, v = rand(B, H, S_q, D, dtype=DTYPE), rand(B, H_kv, S_k, D, dtype=DTYPE), rand(B, H_kv, S_k, D, dtype=DTYPE)
    do = rand(B, H, S_q, D, dtype=DTYPE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashattn.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=H != H_kv)
    out.backward(do)
    ref = reference(q, k, v, do, causal=causal)
    for name, got in zip(("O", "dQ", "dK", "dV"), (out, *[t.grad for t in leaves])):
        assert_close_per_head(name, got, ref[name], TOL[DTYPE])


def test_leading_dimensions_and_custom_scale_like_sdpa():
    q, k, v = (rand(6, 4, 21, 16, dtype=DTYPE).reshape(2, 3, 4, 21, 16) for _ in range(3))
    out = flashattn.scaled_dot_product_attention(q, k, v, scale=0.3)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.3)
    assert out.shape == q.shape and torch.allclose(out.float(), ref, atol=TOL[DTYPE] * 3)
    q3 = rand(1, 4, 21, 16, dtype=DTYPE)[0]                     # [H, L, E]: no batch dimension
    assert flashattn.scaled_dot_product_attention(q3, q3, q3).shape == q3.shape


def test_what_is_not_supported_says_so():
    q = rand(1, 2, 8, 16, dtype=DTYPE)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        flashattn.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        flashattn.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    kv = rand(1, 1, 8, 16, dtype=DTYPE)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flashattn.scaled_dot_product_attention(q, kv, kv)


def test_operators_pass_opcheck():
    q, k, v = (rand(1, 2, 20, 16, dtype=DTYPE).requires_grad_() for _ in range(3))
    impl = "fast" if ON_GPU else "teaching"
    torch.library.opcheck(ops.attention_forward_op, (q, k, v, True, 0.25, impl))
    o, lse = ops.attention_forward_op(q, k, v, True, 0.25, impl)
    do = torch.randn_like(o)
    torch.library.opcheck(ops.attention_backward_op, (do, q.detach(), k.detach(), v.detach(), o.detach(),
                                                       lse.detach(), True, 0.25, impl, True, True))


def test_eager_call_does_not_import_dynamo():
    """Eager calls run the kernels through a plain autograd.Function: a custom operator's first
    call would import TorchDynamo (seconds of a first step) -- see flashattn.ops."""
    import subprocess
    import sys
    code = ("import sys, torch, flashattn\n"
            f"q, k, v = (torch.randn(1, 2, 16, 32, device='{DEVICE}', requires_grad=True) for _ in range(3))\n"
            "flashattn.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()\n"
            "print('torch._dynamo' in sys.modules, q.grad is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout


def _block(x, qkv, attention):
    B, S, _ = x.shape
    q, k, v = qkv(x).view(B, S, 3, 4, 16).permute(2, 0, 3, 1, 4)
    return attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, 64)


@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if ON_GPU else []))
def test_torch_compile_fullgraph_no_graph_break(backend):
    torch._dynamo.reset()
    qkv = torch.nn.Linear(64, 192, device=DEVICE, dtype=DTYPE)
    x = torch.randn(2, 24, 64, device=DEVICE, dtype=DTYPE, requires_grad=True)
    model = lambda x: _block(x, qkv, flashattn.scaled_dot_product_attention)  # noqa: E731
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert "flashattn.attention_forward" in str(explained.graphs[0].graph)   # the operator, traced
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    grad_compiled, x.grad = x.grad, None
    ref = _block(x, qkv, F.scaled_dot_product_attention)
    ref.sum().backward()
    assert torch.allclose(out.float(), ref.float(), atol=3 * TOL[DTYPE], rtol=3 * TOL[DTYPE])
    assert torch.allclose(grad_compiled.float(), x.grad.float(), atol=5 * TOL[DTYPE], rtol=5 * TOL[DTYPE])


def test_autocast_casts_like_sdpa():
    device_type = "cuda" if ON_GPU else "cpu"
    low = torch.bfloat16 if ON_GPU else torch.float16
    q, k, v = (rand(1, 2, 33, 32, dtype=torch.float32) for _ in range(3))
    with torch.autocast(device_type, dtype=low):
        ours = flashattn.scaled_dot_product_attention(q, k, v, is_causal=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ours.dtype == theirs.dtype == low
    assert_close_per_head("O", ours, reference(q, k, v, causal=True)["O"], TOL[low])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_captures_forward_and_backward():
    q, k, v = (rand(2, 8, 256, 64, dtype=torch.float16).requires_grad_() for _ in range(3))
    do = rand(2, 8, 256, 64, dtype=torch.float16)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = flashattn.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(do)
        return out

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):                   # warm up: compile, pick tiles
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    for t in (q, k, v):
        t.grad = None
    with torch.cuda.graph(graph):
        static_out = step()
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(q.detach(), k.detach(), v.detach(), do, causal=True)
    assert_close_per_head("O", static_out, ref["O"], TOL[torch.float16])
    assert_close_per_head("dQ", q.grad, ref["dQ"], TOL[torch.float16])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_compile_reduce_overhead():
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c: flashattn.scaled_dot_product_attention(a, b, c, is_causal=True),
                      mode="reduce-overhead", fullgraph=True)
    q, k, v = (rand(2, 8, 128, 64, dtype=torch.float16) for _ in range(3))
    for _ in range(3):
        out = f(q, k, v)
    assert_close_per_head("O", out, reference(q, k, v, causal=True)["O"], TOL[torch.float16])


# --------------------------------------------------------------------------------------
# dropout and windows (lesson 09's entry point) through the operators of flashattn.beyond.ops
# --------------------------------------------------------------------------------------
def test_dropout_operators_pass_opcheck():
    from flashattn.beyond import ops as beyond_ops
    impl = "fast" if ON_GPU else "teaching"
    q, k, v = (rand(1, 2, 40, 16, dtype=DTYPE).requires_grad_() for _ in range(3))
    seed = torch.tensor(5, dtype=torch.int64)
    args = (q, k, v, seed, False, [1, 9, 0], 0.25, 0.2, impl)
    torch.library.opcheck(beyond_ops.forward_op, args)
    o, lse = beyond_ops.forward_op(*args)
    do = torch.randn_like(o)
    torch.library.opcheck(beyond_ops.backward_op, (do, q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(),
                                                   seed, False, [1, 9, 0], 0.25, 0.2, impl))


@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if ON_GPU else []))
def test_torch_compile_with_dropout_and_window(backend):
    """No graph break, the compiled gradients equal eager's for a fixed seed, and without a seed
    each compiled call draws a new mask (the seed is drawn inside the graph)."""
    from flashattn import beyond
    torch._dynamo.reset()
    q, k, v = (rand(1, 2, 48, 16, dtype=DTYPE).requires_grad_() for _ in range(3))
    do = torch.randn_like(q)
    seeded = lambda q, k, v: beyond.flash_attention(q, k, v, causal=True, window=(9, 0), dropout_p=0.2, seed=11)  # noqa: E731
    eager = [seeded(q, k, v)]
    eager += torch.autograd.grad(eager[0], (q, k, v), do)
    compiled_fn = torch.compile(seeded, backend=backend, fullgraph=True)
    compiled = [compiled_fn(q, k, v)]
    compiled += torch.autograd.grad(compiled[0], (q, k, v), do)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), eager, compiled):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), f"{name}: compiled differs from eager with the same seed"

    sdpa = lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)  # noqa: E731
    explained = torch._dynamo.explain(sdpa)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert "flashattn.beyond_forward" in str(explained.graphs[0].graph)
    compiled_sdpa = torch.compile(sdpa, backend=backend, fullgraph=True)
    first, second = compiled_sdpa(q, k, v), compiled_sdpa(q, k, v)
    assert not torch.equal(first, second), "each compiled call must draw a new dropout mask"
    first.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_compile_reduce_overhead_with_dropout():
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c: flashattn.scaled_dot_product_attention(a, b, c, dropout_p=0.1, is_causal=True),
                      mode="reduce-overhead", fullgraph=True)
    q, k, v = (rand(2, 8, 128, 64, dtype=torch.float16).requires_grad_() for _ in range(3))
    outs = [f(q, k, v) for _ in range(4)]
    assert not torch.equal(outs[-1], outs[-2]), "replays must draw new dropout masks"
    outs[-1].sum().backward()
    assert torch.isfinite(q.grad).all()


def test_both_entry_points_cast_alike_under_autocast():
    """flash_attention, lesson 09's flash_attention and the drop-in all cast fp32 inputs to the
    autocast dtype, as SDPA does, and return that dtype with the same values (issue 42: the
    lessons' entry point used to return fp32, 2.3x slower than SDPA on a GPU)."""
    import warnings

    from flashattn import beyond

    device_type = DEVICE.type
    q, k, v = (torch.randn(1, 2, 40, 32, device=DEVICE) for _ in range(3))
    with torch.autocast(device_type, dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore", flashattn.BF16FallbackWarning)
        outs = [flashattn.flash_attention(q, k, v, causal=True),
                beyond.flash_attention(q, k, v, causal=True),
                flashattn.scaled_dot_product_attention(q, k, v, is_causal=True)]
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert want.dtype == torch.bfloat16
    for out in outs:
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, outs[0])
    assert float((outs[0].float() - want.float()).abs().max()) < 3e-2
