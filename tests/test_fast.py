"""The tuned path (flashattn.fast) against the float64 reference: the same battery as the
teaching kernels. On the CPU the fast kernels run in the interpreter with small fixed tiles
(fp16/fp32); on a GPU with their default tiles in fp16/bf16/fp32 at realistic sizes, every head
dim that is a multiple of 8 (padded ones too)."""
import pytest
import torch

import flashattn
from flashattn import fast

from conftest import DEVICE, ON_GPU, TOL, assert_close_per_head, rand, reference

FAST_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float32, torch.float16]

SHAPES = [  # (B, H, H_kv, S_q, S_k, D)
    (2, 4, 2, 37, 53, 32),
    (2, 4, 2, 53, 37, 32),
    (1, 2, 1, 70, 70, 64),
    (1, 3, 3, 1, 5, 16),
    (1, 2, 2, 45, 100, 16),
    (1, 2, 1, 33, 33, 128),
    (1, 2, 1, 29, 40, 24),       # head dims that are not powers of two: padded, masked
    (1, 2, 2, 40, 29, 80),
    (1, 2, 1, 45, 70, 160),      # the backward's split head dim: 128 columns + a tail of 32
    (1, 2, 2, 70, 45, 136),      # a tail of 16 columns, 8 of them past D (masked)
    (1, 4, 2, 40, 40, 184),      # a tail of 64 columns, 56 of them real
    (1, 2, 1, 45, 38, 200),      # padded to 256: dK and dV by a launch each (DKDV_PART)
]
if ON_GPU:
    SHAPES += [(2, 8, 2, 1000, 1000, 64), (1, 4, 4, 777, 1500, 128), (2, 4, 2, 1000, 999, 128), (1, 2, 2, 300, 300, 256),
               (2, 4, 2, 1000, 900, 96), (1, 4, 1, 513, 1025, 80), (1, 2, 2, 300, 257, 160),
               (1, 2, 1, 257, 300, 192), (1, 2, 2, 100, 100, 8)]


def _run(q, k, v, do, causal, backward):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flashattn.flash_attention_fast(*leaves, causal=causal, backward=backward)
    out.backward(do)
    return {"O": out.detach(), "dQ": leaves[0].grad, "dK": leaves[1].grad, "dV": leaves[2].grad}


@pytest.mark.parametrize("backward", ["auto", "two-kernel", "fused"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}Sq{}Sk{}D{}".format(*s))
def test_fast_matches_reference(shape, causal, backward):
    """(On the CPU the dtype is fp32: "auto" and "fused" run the fused kernel on bf16 pieces
    there, for head dims up to 128.)"""
    B, H, H_kv, S_q, S_k, D = shape
    dtype = FAST_DTYPES[0]
    q, k, v = rand(B, H, S_q, D, dtype=dtype), rand(B, H_kv, S_k, D, dtype=dtype), rand(B, H_kv, S_k, D, dtype=dtype)
    do = rand(B, H, S_q, D, dtype=dtype, layout="bshd")
    got = _run(q, k, v, do, causal, backward)
    ref = reference(q, k, v, do, causal=causal)
    for name in ("O", "dQ", "dK", "dV"):
        if name in ("dQ", "dK") and S_q == 1 and causal:
            # row 0 sees key 0 only: softmax of one element is constant, these gradients are 0
            assert got[name].abs().max() < 1e-6
            continue
        assert_close_per_head(name, got[name], ref[name], TOL[dtype])


@pytest.mark.parametrize("D", [64, 136], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("do_layout", ["stride0", "padded_heads"])
def test_fast_strides_and_dtypes(dtype, do_layout, D):
    """(fp32 on a GPU: bf16x6 products, fp32's accuracy, while torch's TF32 switch is off.
    D=136: the backward's split head dim, its tail masked; K's last stride is 2.)"""
    B, H, S = 2, 4, 48
    q, k, v = rand(B, H, S, D, dtype=dtype, layout="bshd"), rand(B, 2, S, D, dtype=dtype, layout="sliced"), \
        rand(B, 2, S, D, dtype=dtype, layout="padded_heads")
    if do_layout == "stride0":
        do = torch.ones((), dtype=dtype, device=q.device).expand(B, H, S, D)
    else:
        do = rand(B, H, S, D, dtype=dtype, layout=do_layout)
    got = _run(q, k, v, do, True, "auto")      # fp32 at D=64: the fused kernel on bf16 pieces
    ref = reference(q, k, v, do, causal=True)
    for name in ("O", "dQ", "dK", "dV"):
        assert got[name].dtype == dtype
        assert_close_per_head(name, got[name], ref[name], TOL[dtype])


def test_split_head_dim_only_where_it_saves_columns(monkeypatch, setenv):
    """128 < D <= 192: a 128-column tile and a tail of the next power of two (>= 16), so 144 to 192
    columns of work instead of 256; nothing to save elsewhere; FLASHATTN_SPLIT_D=0: off."""
    from flashattn.fast import tuning

    assert [tuning.head_dim_tail(D) for D in (136, 144, 152, 160, 168, 184, 192)] == [16, 16, 32, 32, 64, 64, 64]
    assert [tuning.head_dim_tail(D) for D in (8, 64, 120, 128, 200, 256)] == [0] * 6
    setenv(tuning.SPLIT_D_ENV, "0")
    assert tuning.head_dim_tail(160) == 0


@pytest.mark.parametrize("D, switch, tail", [(160, None, 32), (184, None, 64), (136, None, 16), (128, None, 0),
                                             (256, None, 0), (160, "0", 0)])
def test_backward_launches_the_split_where_chosen(monkeypatch, D, switch, tail, setenv):
    """What the launcher hands the kernels: the two kernels split (main tile BLOCK_D = 128,
    unmasked), the fused one never does."""
    from flashattn.fast import backward, tuning

    launched = {}
    monkeypatch.setattr(tuning, "run", lambda name, raw, tuned, grid, args, meta, **kw: launched.update({name: meta}))
    if switch is not None:
        setenv(tuning.SPLIT_D_ENV, switch)
    q, k, v, o, do = (rand(1, 2, 8, D, dtype=FAST_DTYPES[0]) for _ in range(5))
    lse = torch.randn(1, 2, 8, device=q.device)
    for fused in (False, True):
        backward.fast_attention_backward(q, k, v, o, do, lse, True, D ** -0.5, fused=fused)
    dkdv = "dkdv" if tail or D <= 128 else "dk"      # a 256-column tile: dK and dV apart (next test)
    fused = "pieces" if q.dtype == torch.float32 and D <= 128 else "fused"   # fp32: on bf16 pieces
    assert launched["dq"]["BLOCK_D_TAIL"] == launched[dkdv]["BLOCK_D_TAIL"] == tail
    assert launched[fused]["BLOCK_D_TAIL"] == 0 and launched[fused]["BLOCK_D"] >= D
    if tail:
        assert all(launched[n]["BLOCK_D"] == 128 and not launched[n]["PAD_D"] for n in ("dq", "dkdv"))


@pytest.mark.parametrize("D, switch, launches", [(256, None, ["dk", "dv"]), (200, None, ["dk", "dv"]),
                                                 (192, None, ["dkdv"]), (128, None, ["dkdv"]),
                                                 (256, "0", ["dkdv"])])
def test_dk_and_dv_launched_apart_at_head_dim_256(monkeypatch, D, switch, launches, setenv):
    """A padded head dim of 256: the dK/dV kernel runs twice, DKDV_PART 1 (dK) then 2 (dV), each
    with its own tiles; one launch of both elsewhere, with FLASHATTN_SPLIT_DKDV=0, and fused."""
    from flashattn.fast import backward, tuning

    launched = []
    monkeypatch.setattr(tuning, "run", lambda name, raw, tuned, grid, args, meta, **kw: launched.append((name, meta)))
    if switch is not None:
        setenv(tuning.SPLIT_DKDV_ENV, switch)
    q, k, v, o, do = (rand(1, 2, 8, D, dtype=FAST_DTYPES[0]) for _ in range(5))
    lse = torch.randn(1, 2, 8, device=q.device)
    backward.fast_attention_backward(q, k, v, o, do, lse, True, D ** -0.5, needs_dq=False)
    assert [name for name, _ in launched] == launches
    assert [meta["DKDV_PART"] for _, meta in launched] == [tuning.DKDV_PART[n] for n in launches]
    launched.clear()
    backward.fast_attention_backward(q, k, v, o, do, lse, True, D ** -0.5, fused=True)
    fused = "pieces" if q.dtype == torch.float32 and D <= 128 else "fused"   # fp32: on bf16 pieces
    assert [(name, meta["DKDV_PART"]) for name, meta in launched] == [(fused, 0)]


@pytest.mark.parametrize("causal", [False, True])
def test_dk_and_dv_apart_agree_with_one_launch(monkeypatch, causal, setenv):
    """D = 232 (padded to 256): the two launches (dK only, dV only) against one launch of both
    (FLASHATTN_SPLIT_DKDV=0), GQA, S_q != S_k, outputs poisoned with NaN: each launch writes every
    element of its gradient, and the same sums come out (on a GPU in other tiles' order)."""
    from flashattn import runtime
    from flashattn.fast import fast_attention_backward, fast_attention_forward, tuning

    monkeypatch.setattr(runtime, "_poison", True)
    dtype = FAST_DTYPES[0]
    q, do = rand(1, 4, 37, 232, dtype=dtype, layout="bshd"), rand(1, 4, 37, 232, dtype=dtype)
    k, v = rand(1, 2, 50, 232, dtype=dtype), rand(1, 2, 50, 232, dtype=dtype, layout="sliced")
    o, lse = fast_attention_forward(q, k, v, causal, 232 ** -0.5)
    assert tuning.dkdv_parts(232, False) == ("dk", "dv")
    apart = fast_attention_backward(q, k, v, o, do, lse, causal, 232 ** -0.5, needs_dq=False)
    setenv(tuning.SPLIT_DKDV_ENV, "0")
    together = fast_attention_backward(q, k, v, o, do, lse, causal, 232 ** -0.5, needs_dq=False)
    for name, a, b in zip(("dK", "dV"), apart[1:], together[1:]):
        assert torch.isfinite(a).all(), name
        assert_close_per_head(name, a, b, TOL[dtype])     # (on a GPU each launch has its own tiles)


@pytest.mark.parametrize("causal", [False, True])
def test_split_and_padded_backward_agree(monkeypatch, causal, setenv):
    """The split (D=152: 128 + a tail of 32, 8 columns masked) against the padded kernels
    (FLASHATTN_SPLIT_D=0), GQA, S_q != S_k: the same sums in another order."""
    from flashattn.fast import fast_attention_backward, fast_attention_forward

    dtype = FAST_DTYPES[0]
    q, do = rand(1, 4, 50, 152, dtype=dtype, layout="bshd"), rand(1, 4, 50, 152, dtype=dtype)
    k, v = rand(1, 2, 61, 152, dtype=dtype), rand(1, 2, 61, 152, dtype=dtype, layout="sliced")
    o, lse = fast_attention_forward(q, k, v, causal, 152 ** -0.5)
    split = fast_attention_backward(q, k, v, o, do, lse, causal, 152 ** -0.5)
    setenv("FLASHATTN_SPLIT_D", "0")
    padded = fast_attention_backward(q, k, v, o, do, lse, causal, 152 ** -0.5)
    for name, a, b in zip(("dQ", "dK", "dV"), split, padded):
        assert_close_per_head(name, a, b, TOL[dtype])


def test_fast_refuses_what_it_cannot_do():
    q = rand(1, 2, 16, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="the fast path takes"):
        flashattn.flash_attention_fast(q, q, q)
    assert fast.supports(torch.float16, 24)[0] and not fast.supports(torch.float16, 260)[0]


@pytest.mark.skipif(not ON_GPU, reason="TF32 is a GPU matter: the interpreter multiplies fp32 exactly")
def test_fp32_uses_tf32_only_when_torch_allows_it(monkeypatch, setenv):
    """Every fp32 precision this Triton offers, at the accuracy the package promises for it:
    bf16x6 (the default), tf32x3 and ieee at fp32's, the opt-in bf16x3 at ~1e-5, TF32 only with
    torch's switch on."""
    from flashattn import runtime

    q, k, v, do = (rand(1, 4, 512, 64) for _ in range(4))
    ref = reference(q, k, v, do)
    bound = {"bf16x6": 2e-5, "tf32x3": 2e-5, "ieee": 2e-5, "bf16x3": 2e-4}
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        setenv(runtime.FP32_PRECISION_ENV)
        assert runtime.fast_dot_precision(torch.float32) == runtime.fp32_precision_choice()
        if torch.cuda.get_device_capability()[0] >= 8 and runtime.triton_knows_precision("bf16x6"):
            assert runtime.fp32_precision_choice() == "bf16x6"
        for precision in runtime.FP32_PRECISIONS:
            if not runtime.triton_knows_precision(precision):
                continue
            setenv(runtime.FP32_PRECISION_ENV, precision)
            assert runtime.fast_dot_precision(torch.float32) == precision
            got = _run(q, k, v, do, False, "two-kernel")
            for name in ("O", "dQ", "dK", "dV"):
                assert_close_per_head(f"{name} ({precision})", got[name], ref[name], bound[precision])
        setenv(runtime.FP32_PRECISION_ENV)
        torch.backends.cuda.matmul.allow_tf32 = True
        assert runtime.fast_dot_precision(torch.float32) == "tf32"
        fast_tf32 = _run(q, k, v, do, False, "two-kernel")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    for name in ("O", "dQ", "dK", "dV"):
        assert_close_per_head(name, fast_tf32[name], ref[name], 5e-3)    # TF32's (10 mantissa bits)


def test_fp32_precision_choice_says_what_it_takes(monkeypatch, setenv):
    """FLASHATTN_FP32_PRECISION: one of four names, case and spaces forgiven; anything else is
    refused with the list; unset, the most accurate this Triton and GPU offer."""
    from flashattn import runtime

    setenv(runtime.FP32_PRECISION_ENV)
    assert runtime.fp32_precision_choice() in ("bf16x6", "tf32x3")
    setenv(runtime.FP32_PRECISION_ENV, " TF32X3 ")
    assert runtime.fp32_precision_choice() == "tf32x3"
    from flashattn import settings
    with pytest.raises(ValueError, match=r"one of \('bf16x6', 'tf32x3', 'bf16x3', 'ieee'\), got 'tf32'"):
        settings.read({runtime.FP32_PRECISION_ENV: "tf32"})       # refused where it is read: at import
    monkeypatch.setattr(runtime, "triton_knows_precision", lambda p: p in ("tf32", "tf32x3", "ieee"))
    setenv(runtime.FP32_PRECISION_ENV)
    assert runtime.fp32_precision_choice() == "tf32x3"
    setenv(runtime.FP32_PRECISION_ENV, "bf16x6")
    with pytest.raises(ValueError, match="does not offer that input_precision"):
        runtime.fp32_precision_choice()


def test_auto_uses_fast_path_on_gpu_only(monkeypatch):
    calls = []
    real = flashattn.ops.fast_attention_forward        # what the custom op runs for the fast path
    monkeypatch.setattr(flashattn.ops, "fast_attention_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    dtype = torch.float16
    q = rand(1, 2, 32, 64, dtype=dtype)
    flashattn.flash_attention(q, q, q)
    assert bool(calls) == ON_GPU


def test_fused_backward_refused_in_deterministic_mode():
    """The fused backward adds dQ with atomics (order varies run to run): asking for it while
    torch.use_deterministic_algorithms(True) is on is an error, as for PyTorch's own ops."""
    q = rand(1, 2, 32, 64, dtype=torch.float16 if ON_GPU else torch.float32)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="deterministic"):
            flashattn.flash_attention_fast(q, q, q, backward="fused")
        flashattn.flash_attention_fast(q, q, q)  # the default, two kernels, is fine
    finally:
        torch.use_deterministic_algorithms(False)


def _hopper_with_descriptors() -> bool:
    import triton.language as tl
    return ON_GPU and torch.cuda.get_device_capability()[0] >= 9 and hasattr(tl, "make_tensor_descriptor")


def test_tma_loads_only_where_their_rules_hold(monkeypatch, setenv):
    """The kernels load tiles through tensor descriptors (the forward K and V, the dK/dV kernel
    Q and dO) only on a Hopper-class GPU, for 16-bit data with unit last stride and 16-byte aligned strides and address."""
    from flashattn.fast import tuning

    def spec(dtype=torch.float16, stride=None, ptr=0):
        return tuning.ArgSpec((2, 4, 64, 128), dtype, torch.device("cuda"), stride, ptr)

    assert tuning.tma_ready(spec(), spec()) == _hopper_with_descriptors()
    assert not tuning.tma_ready(spec(ptr=2), spec())                                   # address 2 bytes off
    assert not tuning.tma_ready(spec(), spec(stride=(64 * 256, 64 * 256, 256, 2)))    # last stride 2
    assert not tuning.tma_ready(spec(stride=(4 * 67 * 128, 67 * 128, 131, 1)), spec())  # a row of 262 bytes
    assert not tuning.tma_ready(spec(torch.float32), spec(torch.float32))
    setenv("FLASHATTN_TMA", "0")
    assert not tuning.tma_ready(spec(), spec())


@pytest.mark.parametrize("S_k, causal, dtype, dropout_p, short", [
    (1024, True, torch.float16, 0.0, True), (300, True, torch.bfloat16, 0.0, True),
    (1025, True, torch.float16, 0.0, False), (1024, False, torch.float16, 0.0, False),
    (1024, True, torch.float32, 0.0, False), (1024, True, torch.float16, 0.1, False)])
def test_short_causal_forward_takes_its_own_tile(monkeypatch, S_k, causal, dtype, dropout_p, short):
    """A causal forward over at most SHORT_CAUSAL_KEYS keys, 16-bit, no dropout, asks for the
    "short" tile (two programs per SM: 128 x 64 tiles, at most 128 registers a thread); a longer
    one, a non-causal one, fp32 and dropout keep their own."""
    from flashattn import configs
    from flashattn.fast import forward, tuning

    asked = {}
    monkeypatch.setattr(tuning, "run", lambda name, raw, tuned, grid, args, meta, **kw: asked.update(kw))
    q = tuning.ArgSpec((1, 2, 64, 128), dtype, torch.device("cuda"))
    k = tuning.ArgSpec((1, 2, S_k, 128), dtype, torch.device("cuda"))
    forward.fast_attention_forward(q, k, k, causal, 128 ** -0.5, warmup=True, dropout_p=dropout_p)
    assert asked["tile_class"] == ("short" if short else None)
    big = 227 * 1024                       # an H100's shared memory per program
    assert configs.fitting("fast_fwd", 128, 2, big, "short")[0] == configs.KernelConfig(128, 64, 8, 2, maxnreg=128)
    assert configs.fitting("fast_fwd", 128, 2, big)[0] == configs.PREFERRED[("fast_fwd", 128)]
    assert configs.fitting("fast_fwd", 64, 2, big, "short")[0] == configs.PREFERRED[("fast_fwd", 64)]


def test_lse_and_delta_descriptors_only_where_aligned(monkeypatch, setenv):
    """With TMA on, the LSE and delta vectors come through 1-D descriptors too -- only where the
    address and every stride but the last (which must be 1) are 16-byte aligned."""
    from flashattn.fast import tuning

    def spec(stride=None, ptr=0):
        return tuning.ArgSpec((2, 4, 64), torch.float32, torch.device("cuda"), stride, ptr)

    assert tuning.tma_stats_ready(spec())
    assert not tuning.tma_stats_ready(spec(ptr=4))                        # address 4 bytes off
    assert not tuning.tma_stats_ready(spec(stride=(4 * 66, 66, 1)))      # rows of 66 values: 264 bytes
    assert not tuning.tma_stats_ready(spec(stride=(4 * 128, 128, 2)))    # every other value
    setenv("FLASHATTN_TMA_STATS", "0")
    assert not tuning.tma_stats_ready(spec())


@pytest.mark.skipif(not _hopper_with_descriptors(), reason="tensor-descriptor loads need a Hopper-class GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 8, 2, 2100, 1777, 128), (1, 4, 4, 2048, 3001, 128)],
                         ids=lambda s: "B{}H{}Hkv{}Sq{}Sk{}D{}".format(*s))
def test_tma_loads_give_the_pointer_loads_bits(monkeypatch, shape, causal, setenv):
    """Same tiles, same values loaded (rows past S_q or S_k arrive as zeros either way): the
    forward (K and V by TMA at D = 128) and the backward (Q and dO at D = 128, S_q >= 2048)
    equal the ones with pointer loads bit for bit, Q in the [B, S, H, D] layout."""
    from flashattn.fast.backward import fast_attention_backward
    from flashattn.fast.forward import fast_attention_forward

    B, H, H_kv, S_q, S_k, D = shape
    q = rand(B, H, S_q, D, dtype=torch.float16, layout="bshd")
    k, v = (rand(B, H_kv, S_k, D, dtype=torch.float16) for _ in range(2))
    do = rand(B, H, S_q, D, dtype=torch.float16)
    from flashattn.fast import tuning

    assert tuning.tma_ready(q, do) and tuning.tma_ready(k, v)
    o, lse = fast_attention_forward(q, k, v, causal, D ** -0.5)
    with_tma = fast_attention_backward(q, k, v, o, do, lse, causal, D ** -0.5)
    setenv("FLASHATTN_TMA", "0")
    o_ptr, lse_ptr = fast_attention_forward(q, k, v, causal, D ** -0.5)
    without = fast_attention_backward(q, k, v, o, do, lse, causal, D ** -0.5)
    assert torch.equal(o, o_ptr) and torch.equal(lse, lse_ptr), "forward"
    for name, a, b in zip(("dQ", "dK", "dV"), with_tma, without):
        assert torch.equal(a, b), name


def test_fp32_pieces_add_up_to_the_input():
    """fast.pieces.split_pieces: three bf16 planes whose sum is the fp32 input, for values across
    fp32's range and for inputs of any strides (a [B, S, H, D] layout, a stride-0 dO)."""
    from flashattn.fast.pieces import split_pieces

    scales = torch.logspace(-20, 20, 24, device=DEVICE).repeat_interleave(2)     # 48 columns
    x = rand(2, 3, 37, 48, layout="bshd") * scales
    ones = torch.full((), -1.2345678, device=DEVICE).expand(2, 3, 37, 48)
    planes = split_pieces(x, ones)
    assert planes.shape == (3, 2, 2, 3, 37, 48) and planes.dtype == torch.bfloat16
    for i, t in enumerate((x, ones)):
        total = planes[0, i].double() + planes[1, i].double() + planes[2, i].double()
        rel = ((total - t.double()).abs() / t.double().abs()).max().item()
        assert rel <= 2.0 ** -24, f"tensor {i}: pieces miss the input by {rel:.1e} (relative)"
    with pytest.raises(ValueError, match="two fp32 tensors of one shape"):
        split_pieces(x, x.half())


def test_fp32_backward_runs_fused_on_pieces_by_default(monkeypatch, setenv):
    """What the launcher runs: fp32 with head dims up to 128 and none of lesson 09's features, the
    fused kernel on bf16 pieces (one launch, after the split); fp16, wider heads, a window,
    FLASHATTN_FP32_PIECES=0 and torch.use_deterministic_algorithms, the two kernels."""
    from flashattn.fast import backward, tuning

    def launched(dtype=torch.float32, D=64, **kw):
        names = []
        with monkeypatch.context() as m:
            m.setattr(tuning, "run", lambda name, raw, tuned, grid, args, meta, **k: names.append(
                (name, meta.get("PIECES", False))))
            q, k, v, o, do = (rand(1, 2, 8, D, dtype=dtype) for _ in range(5))
            lse = torch.randn(1, 2, 8, device=q.device)
            backward.fast_attention_backward(q, k, v, o, do, lse, True, D ** -0.5, **kw)
        return names

    assert launched() == launched(D=128) == [("pieces", True)]
    assert launched(fused=False) == [("dq", False), ("dkdv", False)]
    assert launched(dtype=torch.float16) == [("dq", False), ("dkdv", False)]
    assert launched(dtype=torch.float16, fused=True) == [("fused", False)]
    assert launched(D=136) == [("dq", False), ("dkdv", False)]            # a 256-column tile
    assert launched(window_args=(True, 3, 0)) == [("dq", False), ("dkdv", False)]
    assert launched(needs_dq=False) == [("dkdv", False)]
    setenv(tuning.FP32_PIECES_ENV, "0")
    assert launched() == [("dq", False), ("dkdv", False)]
    setenv(tuning.FP32_PIECES_ENV)
    torch.use_deterministic_algorithms(True)
    try:
        assert launched() == [("dq", False), ("dkdv", False)]
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 4, 2, 45, 70, 64), (1, 2, 1, 37, 29, 40)] + (
    [(2, 8, 2, 1000, 900, 64), (1, 4, 4, 777, 1500, 128), (1, 2, 1, 513, 300, 40), (2, 4, 4, 2048, 2048, 128)]
    if ON_GPU else []), ids=lambda s: "B{}H{}Hkv{}Sq{}Sk{}D{}".format(*s))
def test_fp32_pieces_keep_fp32_accuracy(shape, causal):
    """The fused kernel on bf16 pieces (fp32's default backward) at fp32's accuracy: 2e-6 per
    head against float64 (measured 3-4e-7 on an H100; SDPA's fp32 kernel 6-9e-7). Adding each
    six-product sum into dK's running sum on the tensor cores, as it first did, truncated its
    way to 8.5e-6; this bound catches that."""
    B, H, H_kv, S_q, S_k, D = shape
    q, k, v = rand(B, H, S_q, D), rand(B, H_kv, S_k, D, layout="bshd"), rand(B, H_kv, S_k, D)
    do = rand(B, H, S_q, D)
    got = _run(q, k, v, do, causal, "auto")
    ref = reference(q, k, v, do, causal=causal)
    for name in ("O", "dQ", "dK", "dV"):
        assert_close_per_head(name, got[name], ref[name], 2e-6)


def test_the_backward_kernels_multiply_fp32_with_tf32x3_not_bf16_splits(monkeypatch):
    """Triton 3.6 miscompiles the bf16 splits of fp32 products in the two backward kernels on
    Hopper (illegal shared-memory accesses found by flashattn.fuzz under compute-sanitizer): the
    backward takes tf32x3 there, the forward keeps the default; the fused kernel on bf16 pieces is
    not concerned."""
    from flashattn.fast import tuning

    q = torch.empty(1, 1, 8, 64, dtype=torch.float32)
    for choice in ("bf16x6", "bf16x3"):
        monkeypatch.setattr(flashattn.runtime, "fast_dot_precision", lambda dtype, c=choice: c)
        assert tuning.constants(q, False)["DOT_PRECISION"] == choice
        assert tuning.constants(q, False, backward=True)["DOT_PRECISION"] == "tf32x3"
    monkeypatch.setattr(flashattn.runtime, "fast_dot_precision", lambda dtype: "tf32")
    assert tuning.constants(q, True, backward=True)["DOT_PRECISION"] == "tf32"      # TF32 allowed: kept
    # and the forward at 32 columns or fewer (the next test's failure on an H200)
    monkeypatch.setattr(flashattn.runtime, "fast_dot_precision", lambda dtype: "bf16x6")
    for D, expected in ((16, "tf32x3"), (24, "tf32x3"), (32, "tf32x3"), (40, "bf16x6"), (64, "bf16x6")):
        assert tuning.constants(torch.empty(1, 1, 8, D), False)["DOT_PRECISION"] == expected, D


@pytest.mark.parametrize("D", [24, 32])
def test_fp32_with_k_read_every_other_element(D):
    """Found by flashattn.fuzz on an H200 (seed 6, problem 2038): fp32, K a view of every other
    element of a wider last dim (stride 2) whose other elements are NaN, D = 24 or 32: the forward's
    bf16-split products read outside K (NaN in O, then an illegal memory access). Per head against
    float64, forward and backward."""
    torch.manual_seed(0)
    S_q, S_k = (253, 384) if ON_GPU else (37, 45)
    q, v, do = (torch.randn(1, 2, S, D, device=DEVICE) for S in (S_q, S_k, S_q))
    wide = torch.full((1, 2, S_k, 2 * D), float("nan"), device=DEVICE)
    wide[..., ::2] = torch.randn(1, 2, S_k, D, device=DEVICE)
    k = wide[..., ::2]
    leaves = [t.requires_grad_() for t in (q.clone(), k, v.clone())]
    out = flashattn.flash_attention(*leaves, causal=False, impl="fast")
    out.backward(do)
    ref = reference(q, k.detach(), v, do, causal=False)
    for name, got in zip(("O", "dQ", "dK", "dV"), (out, *(t.grad for t in leaves))):
        assert_close_per_head(name, got, ref[name], TOL[torch.float32])


def test_the_fused_backward_has_no_nan_from_padded_keys_at_large_logits():
    """Found by flashattn.fuzz: in the fused backward (fp32's default) the padded key rows of the
    last tile (K = 0, so S = 0) had P = exp2(-LSE) = +inf for a query row whose scores were all
    below about -88, and dQ = dS^T K took inf * 0 = NaN from them. S_k = 1, scale 1, large q."""
    torch.manual_seed(0)
    q = 12 * torch.randn(1, 2, 9, 32, device=DEVICE)
    k, v = torch.randn(1, 2, 1, 32, device=DEVICE), torch.randn(1, 2, 1, 32, device=DEVICE)
    q[0, 0, 0] = -4.0 * k[0, 0, 0] / k[0, 0, 0].norm() * 40      # a row whose one score is about -160
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashattn.flash_attention_fast(*leaves, causal=False, scale=1.0, backward="fused")
    out.backward(torch.randn_like(out))
    for t in leaves:
        assert torch.isfinite(t.grad).all()
    assert torch.allclose(leaves[0].grad, torch.zeros_like(q), atol=1e-4)     # one key: dS = 0 exactly


def test_the_dq_kernel_takes_the_forwards_key_ranges():
    """fast_dq_kernel's unmasked/masked key ranges are fast_fwd_kernel's, copied on purpose (lesson 06
    prints the forward whole, so they stay inline there): the copies stay equal, line for line."""
    import inspect
    from flashattn.fast import backward, forward

    def ranges(kernel):
        lines = [line.strip() for line in inspect.getsource(kernel.fn).splitlines()]
        start = lines.index("free_end = tl.minimum(start_m, S_k)") - 1
        end = lines.index("unmasked_end = (free_end // BLOCK_N) * BLOCK_N")
        return [line for line in lines[start:end + 1] if not line.startswith("#")]

    fwd, dq = ranges(forward.fast_fwd_kernel), ranges(backward.fast_dq_kernel)
    assert fwd[0] == "if CAUSAL:" and len(fwd) == 10, fwd
    assert dq == fwd
