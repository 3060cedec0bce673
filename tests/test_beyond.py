"""Lesson 09's kernels (flashattn.beyond): sliding windows, dropout by recomputation, packed
variable-length batches, each against the float64 oracle head by head, forward and backward.

On the CPU (Triton interpreter) small odd shapes with 16 x 16 tiles, so that windows cross tile
boundaries; on a GPU the same tests at larger sizes and in fp16/bf16. Outputs start as NaN
(conftest), so an element a kernel skips shows.
"""
import warnings

import numpy as np
import pytest
import torch

import flashattn
import triton
import triton.language as tl
from flashattn import KernelConfig, beyond
from flashattn.beyond.kernels import dropout_mask_kernel
from flashattn.features import DROPOUT_LEVELS, dropout_apply, dropout_threshold

from conftest import DEVICE, ON_GPU, TOL, assert_close_per_head, rand

SMALL = None if ON_GPU else KernelConfig(16, 16)
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32]
SCALE_UP = 8 if ON_GPU else 1            # GPU: longer sequences
#: both kernel families take the three features: the lesson's (beyond.kernels) and the tuned ones
#: (flashattn.fast); in the interpreter the fast ones run with their fixed small tiles
IMPLS = ["teaching", "fast"]


def tol(dtype):
    return {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype] if ON_GPU else TOL[dtype] * 5


def run_and_reference(q, k, v, *, do_layout="contiguous", impl="teaching", **kw):
    """``{name: (kernels', oracle's)}`` for O, dQ, dK, dV."""
    do = None
    if do_layout == "stride0":                      # the gradient of o.sum(): every element 1
        do = torch.ones(1, 1, 1, 1, dtype=q.dtype, device=q.device).expand(*q.shape[:3], v.shape[-1])
    return beyond.kernels_and_reference(q, k, v, do, impl=impl, config=SMALL, **kw)


def assert_all_close(pairs, dtype):
    """Per head: packed [total, H, D] tensors are compared as [1, H, total, D]."""
    for name, (a, b) in pairs.items():
        if a.dim() == 3:
            a, b = (t.permute(1, 0, 2)[None] for t in (a, b))
        assert_close_per_head(name, a, b, tol(dtype))


# --------------------------------------------------------------------------------------
# sliding windows
# --------------------------------------------------------------------------------------
WINDOWS = [((8, 0), False), ((5, 3), False), ((0, 0), False), ((-1, 6), False), ((12, -1), True), ((3, 9), True)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window, causal", WINDOWS)
@pytest.mark.parametrize("shape", [(1, 2, 2, 37, 37, 16), (2, 4, 2, 33, 50, 32), (1, 2, 1, 50, 23, 16)],
                         ids=["odd", "sq<sk gqa", "sq>sk mqa"])
def test_window_matches_reference(window, causal, shape, impl):
    B, H, H_kv, S_q, S_k, D = shape
    dtype = DTYPES[0]
    q = rand(B, H, S_q * SCALE_UP, D, dtype=dtype, layout="bshd")
    k = rand(B, H_kv, S_k * SCALE_UP, D, dtype=dtype)
    v = rand(B, H_kv, S_k * SCALE_UP, D, dtype=dtype, layout="sliced")
    assert_all_close(run_and_reference(q, k, v, causal=causal, window=window, impl=impl), dtype)


def test_causal_is_the_window_minus_one_zero():
    q, k, v = (rand(1, 2, 41, 16) for _ in range(3))
    a = beyond.flash_attention(q, k, v, causal=True, config=SMALL)
    b = beyond.flash_attention(q, k, v, window=(-1, 0), config=SMALL)
    c = flashattn.flash_attention(q, k, v, causal=True)
    assert torch.equal(a, b)
    assert_close_per_head("O", a, c, tol(q.dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_that_see_no_key_are_zero_with_zero_gradients(impl):
    """S_q > S_k with a narrow window: rows from S_k + left on see no key."""
    q, k, v = rand(1, 2, 40, 16), rand(1, 2, 12, 16), rand(1, 2, 12, 16)
    pairs = run_and_reference(q, k, v, window=(2, 2), impl=impl)
    assert_all_close(pairs, q.dtype)
    for name in ("O", "dQ"):
        got = pairs[name][0]
        assert torch.equal(got[:, :, 15:], torch.zeros_like(got[:, :, 15:])), name


@pytest.mark.skipif(ON_GPU, reason="tile sizes are chosen by the GPU's config policy; the CPU test pins them")
@pytest.mark.parametrize("impl", IMPLS)
def test_tiles_outside_the_window_are_never_visited(impl):
    """NaN in V's first key tile: with window (4, 0), rows 32-63 need keys 28-63 only, so the
    blocks that own them must not even load that tile (0 * NaN = NaN would show). (The fast
    kernels' interpreter tiles: forward 32 x 16, dK/dV 16 x 32.)"""
    q, k = rand(1, 1, 64, 16), rand(1, 1, 64, 16)
    v = rand(1, 1, 64, 16)
    v[:, :, :16] = float("nan")
    o = beyond.flash_attention(q, k, v, window=(4, 0), impl=impl, config=KernelConfig(16, 16))
    assert torch.isfinite(o[:, :, 32:]).all()
    assert not torch.isfinite(o[:, :, :16]).all()            # the tile is read where it is needed
    # the dK/dV kernel: NaN in the last query tile's dO, which keys 0-31 cannot reach
    q, k, v = (t.requires_grad_() for t in (rand(1, 1, 64, 16), rand(1, 1, 64, 16), rand(1, 1, 64, 16)))
    o = beyond.flash_attention(q, k, v, window=(4, 0), impl=impl, config=KernelConfig(16, 16))
    do = torch.randn_like(o)
    do[:, :, 48:] = float("nan")
    o.backward(do)
    assert torch.isfinite(k.grad[:, :, :32]).all() and torch.isfinite(v.grad[:, :, :32]).all()


# --------------------------------------------------------------------------------------
# dropout
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (6, 6))])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_gradients_match_the_reference_with_the_same_mask(causal, window, p, impl):
    dtype = DTYPES[0]
    q = rand(2, 2, 35 * SCALE_UP, 16, dtype=dtype)
    k, v = rand(2, 1, 29 * SCALE_UP, 16, dtype=dtype), rand(2, 1, 29 * SCALE_UP, 16, dtype=dtype, layout="bshd")
    assert_all_close(run_and_reference(q, k, v, causal=causal, window=window, dropout_p=p, seed=1234, impl=impl),
                     dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_with_a_stride_zero_gradient(impl):
    q, k, v = (rand(1, 2, 33, 16) for _ in range(3))
    assert_all_close(run_and_reference(q, k, v, dropout_p=0.3, do_layout="stride0", impl=impl), q.dtype)


def test_both_kernel_families_draw_the_same_mask():
    """The same seed gives the same Z in the lesson kernels and the fast ones, whatever their
    tiles: the two outputs agree as closely as two dropout-free runs do."""
    q, k, v = (rand(1, 2, 45, 16, dtype=DTYPES[0]) for _ in range(3))
    a = beyond.flash_attention(q, k, v, causal=True, dropout_p=0.4, seed=11, impl="teaching", config=SMALL)
    b = beyond.flash_attention(q, k, v, causal=True, dropout_p=0.4, seed=11, impl="fast")
    c = beyond.flash_attention(q, k, v, causal=True, dropout_p=0.4, seed=12, impl="fast")
    assert_close_per_head("O", b, a, tol(q.dtype))
    assert (b - c).abs().max() > 10 * tol(q.dtype)           # another seed is another mask


def test_dropout_is_reproducible_and_seeded():
    q, k, v = (rand(1, 2, 40, 16) for _ in range(3))
    a = beyond.flash_attention(q, k, v, dropout_p=0.2, seed=5, config=SMALL)
    b = beyond.flash_attention(q, k, v, dropout_p=0.2, seed=5, config=SMALL)
    c = beyond.flash_attention(q, k, v, dropout_p=0.2, seed=6, config=SMALL)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(3)
    d = beyond.flash_attention(q, k, v, dropout_p=0.2, config=SMALL)
    torch.manual_seed(3)
    e = beyond.flash_attention(q, k, v, dropout_p=0.2, config=SMALL)
    assert torch.equal(d, e)


def test_dropout_zero_is_no_dropout():
    q, k, v = (rand(1, 2, 40, 16) for _ in range(3))
    assert torch.equal(beyond.flash_attention(q, k, v, dropout_p=0.0, config=SMALL),
                       beyond.flash_attention(q, k, v, config=SMALL))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_mask_statistics(p):
    """The kept fraction is 1 - p within 5 standard errors, per head and overall, and no
    (sequence, head) repeats another's mask (p as the kernels use it: a multiple of 1/256)."""
    heads, S = 4, 96
    keep = beyond.dropout_mask(11, heads, S, S, p, DEVICE).float()
    p = dropout_threshold(p) / DROPOUT_LEVELS
    n = S * S
    sigma = ((p * (1 - p)) / n) ** 0.5
    per_head = keep.mean(dim=(1, 2))
    assert ((per_head - (1 - p)).abs() < 5 * sigma).all(), per_head
    assert abs(float(keep.mean()) - (1 - p)) < 5 * sigma / heads ** 0.5
    assert all(not torch.equal(keep[i], keep[j]) for i in range(heads) for j in range(i))
    rows, cols = keep.mean(dim=2), keep.mean(dim=1)             # no row or column pattern
    assert ((rows - (1 - p)).abs() < 6 * (p * (1 - p) / S) ** 0.5).all()
    assert ((cols - (1 - p)).abs() < 6 * (p * (1 - p) / S) ** 0.5).all()


def _philox4x32_7(c0, k0, k1):
    """Philox-4x32 with 7 rounds in numpy (Salmon et al. 2011; the rounds of triton.language.random),
    counters (c0, 0, 0, 0)."""
    low = 0xFFFFFFFF
    c = [c0, np.zeros_like(c0), np.zeros_like(c0), np.zeros_like(c0)]
    for _ in range(7):
        a, b = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(b >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), b & np.uint64(low),
             (a >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), a & np.uint64(low)]
        k0, k1 = (k0 + 0x9E3779B9) & low, (k1 + 0xBB67AE85) & low
    return c


def test_dropout_mask_is_the_documented_philox_layout():
    """Z, element by element, is what features.dropout_draws' docstring says: call (P, G, t) with
    P = 8 R + r for rows 16 R + 8 h + r, keys 32 G + 8 g + 2 t + e; word g, byte 2 h + e; kept
    when the byte is >= round(256 p). Checked against Philox written out in numpy."""
    seed, seq_head, S_q, S_k, p = 2 ** 33 + 1234, 3, 40, 70, 0.3
    keep = beyond.dropout_mask(seed, 1, S_q, S_k, p, DEVICE, first_seq_head=seq_head)[0].cpu().numpy()
    i, j = np.meshgrid(np.arange(S_q), np.arange(S_k), indexing="ij")
    pair, h = (i // 16) * 8 + i % 8, (i // 8) % 2
    G, g, t, e = j // 32, (j % 32) // 8, (j % 8) // 2, j % 2
    counter = (pair * ((S_k + 31) // 32 * 4) + G * 4 + t).astype(np.uint64)
    words = _philox4x32_7(counter, seed & 0xFFFFFFFF, (seed >> 32) + seq_head)
    word = np.choose(g, words)
    draws = (word >> (8 * (2 * h + e)).astype(np.uint64)) & np.uint64(0xFF)
    assert (keep == (draws >= dropout_threshold(p))).all()


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (16, 64), (64, 32), (64, 64)])
def test_dropout_mask_does_not_depend_on_the_tile(block_m, block_n):
    """Every kernel regenerates Z with its own tiles: any tile must draw the same bits."""
    def mask(bm, bn, S_q=48, S_k=80):
        keep = torch.zeros(2, S_q, S_k, dtype=torch.int8, device=DEVICE)
        grid = (triton.cdiv(S_q, bm), triton.cdiv(S_k, bn), 2)
        dropout_mask_kernel[grid](keep, S_q, S_k, 5, dropout_threshold(0.4), 99, BLOCK_M=bm, BLOCK_N=bn)
        return keep
    assert torch.equal(mask(block_m, block_n), mask(32, 32))


@pytest.mark.parametrize("causal, window", [(True, None), (False, (20, 5))])
def test_fast_dropout_with_query_major_tiles(causal, window):
    """The fast dK/dV kernel turns its 64 x 64 tiles round under dropout (queries down the rows,
    no transposed Z): the same gradients as the reference, GQA and odd lengths included."""
    dtype = DTYPES[0]
    q = rand(1, 4, 70 * SCALE_UP, 32, dtype=dtype)
    k, v = rand(1, 2, 90 * SCALE_UP, 32, dtype=dtype), rand(1, 2, 90 * SCALE_UP, 32, dtype=dtype, layout="bshd")
    pairs = beyond.kernels_and_reference(q, k, v, None, impl="fast", config=KernelConfig(64, 64), causal=causal,
                                         window=window, dropout_p=0.2, seed=8)
    assert_all_close(pairs, dtype)


# --------------------------------------------------------------------------------------
# packed variable-length batches
# --------------------------------------------------------------------------------------
def packed(lens_q, lens_k, H, H_kv, D, dtype):
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lens_q), H, D, dtype=dtype, device=DEVICE)
    k = torch.randn(sum(lens_k), H_kv, D, dtype=dtype, device=DEVICE)
    v = torch.randn(sum(lens_k), H_kv, 2 * D, dtype=dtype, device=DEVICE)[..., ::2]      # strided
    return q, k, v, cu_q, cu_k


VARLEN_CASES = [
    ([5, 17, 1, 30], [5, 17, 1, 30], 2, 1, True, None, 0.0),
    ([20, 7, 33], [11, 40, 33], 2, 2, False, (4, 2), 0.0),
    ([9, 0, 24], [9, 3, 24], 4, 2, True, (6, -1), 0.25),
    ([31, 16], [31, 16], 2, 2, False, None, 0.5),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lens_q, lens_k, H, H_kv, causal, window, p", VARLEN_CASES)
def test_varlen_matches_each_sequence_alone(lens_q, lens_k, H, H_kv, causal, window, p, impl):
    dtype = DTYPES[0]
    lens_q, lens_k = [n * SCALE_UP for n in lens_q], [n * SCALE_UP for n in lens_k]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, H, H_kv, 16, dtype)
    pairs = run_and_reference(q, k, v, causal=causal, window=window, dropout_p=p, seed=99,
                              varlen=(cu_q, cu_k, max(lens_q), max(lens_k)), impl=impl)
    o = pairs["O"][0]
    assert o.shape == q.shape and o.is_contiguous()
    assert_all_close(pairs, dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_varlen_never_attends_across_sequences(impl):
    """Changing the second sequence's keys leaves the first sequence's output bit-identical."""
    q, k, v, cu_q, cu_k = packed([19, 21], [19, 21], 2, 2, 16, DTYPES[0])
    a = beyond.flash_attention_varlen(q, k, v, cu_q, cu_k, 21, 21, impl=impl, config=SMALL)
    k2, v2 = k.clone(), v.clone()
    k2[19:], v2[19:] = 100.0, -100.0
    b = beyond.flash_attention_varlen(q, k2, v2, cu_q, cu_k, 21, 21, impl=impl, config=SMALL)
    assert torch.equal(a[:19], b[:19]) and not torch.equal(a[19:], b[19:])


# --------------------------------------------------------------------------------------
# the fast backward's split head dim (128 < D <= 192: a 128-column tile and a tail)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("D, causal, window, p, do_layout", [
    (184, False, (5, 3), 0.0, "contiguous"), (160, True, None, 0.3, "stride0"), (136, False, (6, 6), 0.5, "contiguous"),
    (192, True, (12, -1), 0.2, "stride0"),
], ids=["window D184", "dropout causal D160 dO-stride0", "window dropout D136", "causal window dropout D192"])
def test_fast_split_head_dim_with_window_and_dropout(D, causal, window, p, do_layout):
    """The switches touch only the [rows, keys] tiles, so they come along with the split."""
    from flashattn.fast import tuning

    assert tuning.head_dim_tail(D) > 0
    dtype = DTYPES[0]
    q = rand(2, 4, 37 * SCALE_UP, D, dtype=dtype, layout="bshd")
    k, v = rand(2, 2, 45 * SCALE_UP, D, dtype=dtype), rand(2, 2, 45 * SCALE_UP, D, dtype=dtype, layout="sliced")
    assert_all_close(run_and_reference(q, k, v, causal=causal, window=window, dropout_p=p, seed=5,
                                       do_layout=do_layout, impl="fast"), dtype)


def test_fast_split_head_dim_varlen():
    """Packed batches at D=152 (a tail of 32 columns, 24 of them real), GQA, window and dropout."""
    dtype = DTYPES[0]
    lens_q, lens_k = [20 * SCALE_UP, 7, 33 * SCALE_UP], [11 * SCALE_UP, 40, 33 * SCALE_UP]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, 152, dtype)
    pairs = run_and_reference(q, k, v, causal=False, window=(9, 2), dropout_p=0.25, seed=3,
                              varlen=(cu_q, cu_k, max(lens_q), max(lens_k)), impl="fast")
    assert_all_close(pairs, dtype)


@pytest.mark.parametrize("cu, message", [
    ([0, 10, 5, 20], "must not decrease"), ([2, 10, 20], "must start at 0"), ([0, 10, 19], "must end at the packed length 20"),
])
def test_varlen_rejects_bad_cu_seqlens(cu, message):
    q, k, v, _, _ = packed([10, 10], [10, 10], 2, 2, 16, DTYPES[0])
    bad = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    good = torch.tensor([0, 10, 20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        beyond.flash_attention_varlen(q, k, v, bad, good, 10, 10)


def test_varlen_reads_cu_seqlens_again_after_an_in_place_change():
    """cu_seqlens are read once per tensor (reading waits for the GPU), and again once written to."""
    q, k, v, cu_q, cu_k = packed([10, 10], [10, 10], 2, 2, 16, DTYPES[0])
    beyond.flash_attention_varlen(q, k, v, cu_q, cu_k, 10, 10)
    cu_q[1] = 12                                     # now the first sequence is longer than max_seqlen_q
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= the longest sequence \\(12\\)"):
        beyond.flash_attention_varlen(q, k, v, cu_q, cu_k, 10, 10)


def test_varlen_rejects_a_short_max_seqlen_and_mismatched_batches():
    q, k, v, cu_q, cu_k = packed([10, 14], [10, 14], 2, 2, 16, DTYPES[0])
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= the longest sequence \\(14\\)"):
        beyond.flash_attention_varlen(q, k, v, cu_q, cu_k, 12, 14)
    with pytest.raises(ValueError, match="describes 2 sequences and cu_seqlens_k 1"):
        beyond.flash_attention_varlen(q, k, v, cu_q, torch.tensor([0, 24], dtype=torch.int32, device=DEVICE), 14, 24)
    with pytest.raises(ValueError, match="packed 3-D"):
        beyond.flash_attention_varlen(q[None], k, v, cu_q, cu_k, 14, 14)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(window=(-2, 3)), ValueError, "window sides must be >= 0, or -1"),
    (dict(window=(1.5, 3)), TypeError, "pair of ints"),
    (dict(window=4), TypeError, "pair of ints"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=0.1, seed=-1), ValueError, "seed must be an int"),
])
def test_bad_arguments_say_what_was_expected(kwargs, error, message):
    q, k, v = (rand(1, 2, 16, 16) for _ in range(3))
    with pytest.raises(error, match=message):
        beyond.flash_attention(q, k, v, **kwargs)


def test_a_dropout_below_the_masks_resolution_warns():
    """p <= 1/512 rounds to a threshold of 0 (8-bit draws): nothing would be dropped, silently.
    It warns, saying why; p = 1/256 draws a real mask and does not warn."""
    q, k, v = (rand(1, 2, 40, 16) for _ in range(3))
    with pytest.warns(UserWarning, match="below the dropout mask's resolution.*nothing is dropped"):
        beyond.flash_attention(q, k, v, dropout_p=1 / 512, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        beyond.flash_attention(q, k, v, dropout_p=1 / 256, seed=3)
    assert not beyond.dropout_mask(3, 2, 40, 40, 1 / 256, DEVICE).all()


def test_sdpa_entry_point_takes_dropout():
    """flashattn.scaled_dot_product_attention(dropout_p=p) runs these kernels: same seed, same
    result as beyond.flash_attention; gradients flow."""
    q, k, v = (rand(1, 2, 24, 16).requires_grad_() for _ in range(3))
    torch.manual_seed(21)
    a = flashattn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    torch.manual_seed(21)
    b = beyond.flash_attention(q, k, v, causal=True, dropout_p=0.3)
    assert torch.equal(a, b)
    a.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@triton.jit
def _dropout_apply_kernel(P, DRAWS, OUT, threshold, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(OUT + offs, dropout_apply(tl.load(P + offs), tl.load(DRAWS + offs), threshold))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dropout_apply_keeps_exactly_the_draws_at_or_above_the_threshold(dtype):
    """The fast kernels' P * Z (on a GPU: inline PTX on packed registers, features.dropout_apply)
    against torch.where, bit for bit, for every draw and every threshold (CPU: a spread of them;
    the interpreter runs the plain tl.where, so there this guards the fallback)."""
    g = torch.Generator().manual_seed(5)
    draws = torch.randperm(1024, generator=g) % 256                       # every byte, four times
    p = torch.randn(1024, generator=g).to(dtype)
    p[::7] = -p[::7].abs()                                                # sign bits set too
    draws_dev, p_dev = draws.to(torch.uint8).to(DEVICE), p.to(DEVICE)
    thresholds = range(257) if ON_GPU else [0, 1, 25, 26, 127, 128, 129, 230, 255, 256]
    for threshold in thresholds:
        out = torch.full_like(p_dev, float("nan"))
        _dropout_apply_kernel[(1,)](p_dev, draws_dev, out, threshold, N=1024)
        expected = torch.where(draws >= threshold, p, torch.zeros((), dtype=dtype))
        assert torch.equal(out.cpu().view(torch.int16 if dtype != torch.float32 else torch.int32),
                           expected.view(torch.int16 if dtype != torch.float32 else torch.int32)), threshold
