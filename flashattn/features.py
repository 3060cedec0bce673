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
    """How many Philox counters one (sequence, head) uses: four per row and group of 32 keys."""
    return S_q * triton.cdiv(S_k, 32) * 4


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

    Philox is keyed by (seed, sequence * H + head). One call returns 4 x 32 random bits, i.e.
    eight 16-bit draws (a call per element would cost ~8x the arithmetic, more than the tile's
    matrix products). Which eight elements share a call is chosen for the tensor cores' register
    layout, in which a thread holds two neighbouring keys out of every eight: call (i, G, t)
    serves row i and keys ``32 G + 8 g + 2 t + e`` (word g = 0..3, half e = 0..1), so its eight
    draws land in one thread's registers and need no shuffle (on an H100 this halved the
    mask's cost against eight *consecutive* keys per call). Element (i, j) survives when its
    draw is >= ``threshold`` (p * 65536). The result depends on (seed, seq_head, i, j) only,
    never on the tile sizes, so every kernel that needs Z regenerates the same bits.
    ``start_n`` must be a multiple of 32, or of 16 when ``BLOCK_N`` is 16.
    """
    tl.static_assert(BLOCK_N % 16 == 0, "dropout tiles need BLOCK_N a multiple of 16")
    key = seed + seq_head.to(tl.int64) * 4294967296          # seq_head in Philox's high key word
    calls_per_row = ((S_k + 31) // 32) * 4
    low = 0xFFFF
    if BLOCK_N >= 32:
        # counters [M, N/8]: (32-key group G, t) with t fastest, i.e. start_n // 8 + 0, 1, 2, ...
        counter = rows[:, None] * calls_per_row + (start_n // 8 + tl.arange(0, BLOCK_N // 8))[None, :]
        r0, r1, r2, r3 = tl.randint4x(key, counter, n_rounds=PHILOX_ROUNDS)
        words = tl.join(tl.join(r0, r2), tl.join(r1, r3))       # [M, N/8, a, b]: word g = 2a + b
        draws = tl.join(words & low, words >> 16)                 # [M, N/8, a, b, e]
        draws = tl.reshape(draws, [BLOCK_M, BLOCK_N // 32, 4, 4, 2])   # [M, G, t, g, e]
        draws = tl.permute(draws, [0, 1, 3, 2, 4])               # [M, G, g, t, e]: key 32G + 8g + 2t + e
    else:
        # 16 keys: half of a 32-key group, words g = 2h and 2h + 1 of the group's four calls
        counter = rows[:, None] * calls_per_row + ((start_n // 32) * 4 + tl.arange(0, 4))[None, :]
        r0, r1, r2, r3 = tl.randint4x(key, counter, n_rounds=PHILOX_ROUNDS)
        upper = (start_n % 32) == 16
        words = tl.join(tl.where(upper, r2, r0), tl.where(upper, r3, r1))   # [M, t, g - 2h]
        draws = tl.join(words & low, words >> 16)                 # [M, t, g - 2h, e]
        draws = tl.permute(draws, [0, 2, 1, 3])                   # [M, g - 2h, t, e]
    draws = tl.reshape(draws, [BLOCK_M, BLOCK_N])
    return draws.to(tl.int32) >= threshold
