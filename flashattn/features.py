"""Jit helpers for lesson 09's three features -- packed variable-length batches, sliding windows,
dropout -- shared by its teaching kernels (``flashattn.beyond``) and the fast kernels
(``flashattn.fast``), so that both read a packed batch the same way and draw the *same* dropout
mask from the same seed. A leaf: it imports no kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: a dropout draw is a 16-bit number; element (i, j) is dropped when it is < round(p * 2**16)
DROPOUT_LEVELS = 65536
#: Philox-4x32 rounds per call: 7, as FlashAttention's dropout uses (Salmon et al., "Parallel
#: random numbers: as easy as 1, 2, 3", SC 2011: Philox4x32-7 passes TestU01's BigCrush; 10,
#: Triton's default, adds a safety margin). On an H100 the mask's arithmetic, not the matrix
#: products, set the price of dropout; 7 rounds cut it by 30%.
PHILOX_ROUNDS = tl.constexpr(7)


def dropout_threshold(dropout_p: float) -> int:
    """The integer the kernels compare a 16-bit draw with: p rounded to a multiple of 1/65536."""
    return int(round(dropout_p * DROPOUT_LEVELS))


def dropout_counters(S_q: int, S_k: int) -> int:
    """How many Philox counters one (sequence, head) uses: one per row and group of 8 keys."""
    return S_q * triton.cdiv(S_k, 8)


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
def dropout_keep(seed, seq_head, rows, start_n, S_k, threshold,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Z for query positions ``rows`` ([BLOCK_M]) and keys ``start_n ... start_n + BLOCK_N - 1``:
    a [BLOCK_M, BLOCK_N] tile, True where the element survives dropout.

    Philox is keyed by (seed, sequence * H + head) and counted by ``i * ceil(S_k / 8) + j // 8``:
    one call returns 4 x 32 random bits, i.e. eight 16-bit draws, one for each of eight
    neighbouring keys (a call per element would cost ~8x the arithmetic, more than the tile's
    matrix products). Element (i, j) survives when its draw is >= ``threshold`` (p * 65536).
    The result depends on (seed, seq_head, i, j) only, never on the tile sizes, so every kernel
    that needs Z -- forward, dQ, dK/dV, whatever their tiles -- regenerates the same bits.
    ``start_n`` must be a multiple of 8.
    """
    key = seed + seq_head.to(tl.int64) * 4294967296          # seq_head in Philox's high key word
    groups = (S_k + 7) // 8
    counter = rows[:, None] * groups + (start_n // 8 + tl.arange(0, BLOCK_N // 8))[None, :]
    r0, r1, r2, r3 = tl.randint4x(key, counter, n_rounds=PHILOX_ROUNDS)
    # each 32-bit word is two 16-bit draws; keys 8g ... 8g + 7 take counter g's eight draws
    # in a fixed order (tl.join adds a trailing axis of 2; the reshape folds the three into 8)
    low = 0xFFFF
    words01 = tl.join(tl.join(r0 & low, r0 >> 16), tl.join(r1 & low, r1 >> 16))
    words23 = tl.join(tl.join(r2 & low, r2 >> 16), tl.join(r3 & low, r3 >> 16))
    draws = tl.reshape(tl.join(words01, words23), [BLOCK_M, BLOCK_N])
    return draws.to(tl.int32) >= threshold
