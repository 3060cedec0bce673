"""Jit helpers for lesson 09's three features -- packed variable-length batches, sliding windows,
dropout -- shared by its teaching kernels (``flashattn.beyond``) and the fast kernels
(``flashattn.fast``), so that both read a packed batch the same way and draw the *same* dropout
mask from the same seed. A leaf: it imports no kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: a dropout draw is an 8-bit number; element (i, j) is dropped when it is < round(p * 2**8)
#: (FlashAttention's dropout draws 8 bits too: p is rounded to a multiple of 1/256)
DROPOUT_LEVELS = 256
#: Philox-4x32 rounds per call: 7, as FlashAttention's dropout uses (Salmon et al., "Parallel
#: random numbers: as easy as 1, 2, 3", SC 2011: Philox4x32-7 passes TestU01's BigCrush; 10,
#: Triton's default, adds a safety margin). On an H100 the mask's arithmetic, not the matrix
#: products, set the price of dropout; 7 rounds cut it by 30%.
PHILOX_ROUNDS = tl.constexpr(7)


def dropout_threshold(dropout_p: float) -> int:
    """The integer the kernels compare an 8-bit draw with: p rounded to a multiple of 1/256."""
    return int(round(dropout_p * DROPOUT_LEVELS))


def dropout_counters(S_q: int, S_k: int) -> int:
    """How many Philox counters one (sequence, head) uses: four per pair of rows and group of 32
    keys."""
    return triton.cdiv(S_q, 16) * 8 * triton.cdiv(S_k, 32) * 4


@triton.jit
def sequence_bounds(CU_SEQLENS, b, S, VARLEN: tl.constexpr):
    """(first row of sequence b in the tensor, its length). Dense batches: (0, S)."""
    if VARLEN:
        start = tl.load(CU_SEQLENS + b)
        return start, tl.load(CU_SEQLENS + b + 1) - start
    return tl.full([], 0, tl.int32), S


@triton.jit
def visible_in_window(rows, cols, S_q, S_k, LEFT, RIGHT, WINDOW: tl.constexpr):
    """True where query ``rows`` may see key ``cols`` (positions inside the sequence; the two
    index tensors broadcast to the tile's shape)."""
    visible = (rows < S_q) & (cols < S_k)
    if WINDOW:
        visible = visible & (cols >= rows - LEFT) & (cols <= rows + RIGHT)
    return visible


@triton.jit
def dropout_keep(seed, seq_head, start_m, start_n, S_k, threshold,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Z: True where the element survives (its draw, ``dropout_draws``, is >= ``threshold``)."""
    return dropout_draws(seed, seq_head, start_m, start_n, S_k, BLOCK_M, BLOCK_N).to(tl.int32) >= threshold


@triton.jit
def dropout_draws(seed, seq_head, start_m, start_n, S_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dropout draws for query positions ``start_m ... start_m + BLOCK_M - 1`` and keys
    ``start_n ... start_n + BLOCK_N - 1``: a [BLOCK_M, BLOCK_N] tile of numbers 0 ... 255.

    Philox is keyed by (seed, sequence * H + head). One call returns 4 x 32 random bits, i.e.
    sixteen 8-bit draws (a call per element would cost ~16x the arithmetic, more than the tile's
    matrix products). Which sixteen elements share a call is chosen for the tensor cores' register
    layout, in which a thread holds rows i and i + 8 of every 16 and two neighbouring keys out of
    every eight: call (P, G, t) serves rows ``16 R + 8 h + r`` (P = 8 R + r, h = 0..1) and keys
    ``32 G + 8 g + 2 t + e`` (g = 0..3, e = 0..1); word g of the call, byte 2 h + e. Its sixteen
    draws land in one thread's registers and need no shuffle. Element (i, j) survives when its
    draw is >= ``threshold`` (p * 256). The result depends on (seed, seq_head, i, j) only, never
    on the tile sizes, so every kernel that needs Z regenerates the same bits. ``start_m`` must
    be a multiple of 16, ``start_n`` of 32 (or of 16 when ``BLOCK_N`` is 16).
    """
    tl.static_assert(BLOCK_M % 16 == 0, "dropout tiles need BLOCK_M a multiple of 16")
    tl.static_assert(BLOCK_N % 16 == 0, "dropout tiles need BLOCK_N a multiple of 16")
    key = seed + seq_head.to(tl.int64) * 4294967296          # seq_head in Philox's high key word
    calls_per_pair = ((S_k + 31) // 32) * 4
    pairs = start_m // 2 + tl.arange(0, BLOCK_M // 2)         # row pair (16R + r, 16R + r + 8) is 8R + r
    if BLOCK_N >= 32:
        # counters [M/2, N/8]: (32-key group G, t) with t fastest, i.e. start_n // 8 + 0, 1, 2, ...
        counter = pairs[:, None] * calls_per_pair + (start_n // 8 + tl.arange(0, BLOCK_N // 8))[None, :]
        r0, r1, r2, r3 = tl.randint4x(key, counter, n_rounds=PHILOX_ROUNDS)
        words = tl.join(tl.join(r0, r2), tl.join(r1, r3))       # [M/2, N/8, g1, g0]: word g = 2 g1 + g0
        draws = _bytes(words)                                   # [M/2, N/8, g1, g0, h, e]
        draws = tl.reshape(draws, [BLOCK_M // 16, 8, BLOCK_N // 32, 4, 2, 2, 2, 2])   # [R, r, G, t, g1, g0, h, e]
        draws = tl.permute(draws, [0, 6, 1, 2, 4, 5, 3, 7])   # [R, h, r, G, g1, g0, t, e]
    else:
        # 16 keys: half of a 32-key group, words g = 2 g1 + g0 with g1 = the half
        counter = pairs[:, None] * calls_per_pair + ((start_n // 32) * 4 + tl.arange(0, 4))[None, :]
        r0, r1, r2, r3 = tl.randint4x(key, counter, n_rounds=PHILOX_ROUNDS)
        upper = (start_n % 32) == 16
        words = tl.join(tl.where(upper, r2, r0), tl.where(upper, r3, r1))   # [M/2, t, g0]
        draws = _bytes(words)                                   # [M/2, t, g0, h, e]
        draws = tl.reshape(draws, [BLOCK_M // 16, 8, 4, 2, 2, 2])   # [R, r, t, g0, h, e]
        draws = tl.permute(draws, [0, 4, 1, 3, 2, 5])          # [R, h, r, g0, t, e]
    return tl.reshape(draws, [BLOCK_M, BLOCK_N])


@triton.jit
def _bytes(words):
    """The four bytes of each 32-bit word as two new trailing dims [h, e] (byte 2 h + e)."""
    low = 0xFF
    return tl.join(tl.join(words & low, (words >> 16) & low), tl.join((words >> 8) & low, words >> 24))
