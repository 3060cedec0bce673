"""Jit helpers for lesson 09's three features -- packed variable-length batches, sliding windows,
dropout -- shared by its teaching kernels (``flashattn.beyond``) and the fast kernels
(``flashattn.fast``), so that both read a packed batch the same way and draw the *same* dropout
mask from the same seed. A leaf: it imports no kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import runtime

#: a dropout draw is an 8-bit number; element (i, j) is dropped when it is < round(p * 2**8)
#: (FlashAttention's dropout draws 8 bits too: the drop probability is rounded to a multiple of
#: 1/256, while the survivors keep the nominal 1 / (1 - p))
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
    return dropout_survives(dropout_draws(seed, seq_head, start_m, start_n, S_k, BLOCK_M, BLOCK_N), threshold)


@triton.jit
def dropout_survives(draws, threshold):
    """Z from a tile of draws: True where the draw is >= ``threshold`` (p * 256, rounded)."""
    return draws.to(tl.int32) >= threshold


#: On a GPU, P * Z for a half-precision P runs as inline PTX on packed registers; Triton's
#: interpreter cannot run PTX and takes the plain ``tl.where`` (the same result, bit for bit)
PACKED_MASK = tl.constexpr(not runtime.INTERPRET)


@triton.jit
def dropout_apply(p, draws, threshold):
    """P * Z: ``p`` where its 8-bit ``draws`` (uint8, ``dropout_draws``) are >= ``threshold``, else 0.

    For a half-precision ``p`` (fp16, bf16) the GPU does it four elements at a time, on the
    registers as the tensor cores take them: two of P's (two 16-bit halves each) and one of draws
    (four bytes). Per four elements that is 7 instructions instead of ~16 (a byte extracted,
    compared, selected and multiplied per element). With x a draw, t = threshold and everything
    per byte (no carry can cross a byte):

        d = (x & 0x7F) + (c - t)          c = 128 for t < 128, else 256 (t <= 256)
        keep = x >= t  is the top bit of   t < 128:  x | d      t >= 128:  x & d

    (t < 128: x >= t when x's top bit is set or x's low 7 bits reach t; t >= 128: x's top bit
    must be set and its low 7 bits reach t - 128). One LOP3 computes either form, selected by a
    mask m (0x80 per byte when t >= 128): (x & d) | ((x | d) & ~m), lookup table 0xD4. PRMT then
    spreads each byte's top bit over the 16 bits of its element (selectors 0x9988, 0xBBAA) and an
    AND clears the dropped halves.
    """
    if PACKED_MASK and p.dtype.primitive_bitwidth == 16:
        threshold = threshold + tl.zeros([], tl.int32)       # a tensor even where Triton made it a constant
        high = (threshold >= 128).to(tl.uint32)
        offset = ((128 + 128 * high) - threshold).to(tl.uint32)
        offset = offset | (offset << 8)                      # (c - t) in every byte (shifts, not a multiply
        offset = offset | (offset << 16)                     # that ptxas would fold into an IMAD per word)
        high_mask = high * 0x80808080
        # operands: $0, $1 the four halves out; $2, $3 P's four halves; $4 the four draws; at
        # pack=4 a 32-bit argument takes four registers: $5-$8 (c - t) per byte, $9-$12 m
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 d, keep, lo, hi;
            and.b32 d, $4, 0x7F7F7F7F;
            add.u32 d, d, $5;
            lop3.b32 keep, $4, d, $9, 0xD4;
            prmt.b32 lo, keep, 0, 0x9988;
            prmt.b32 hi, keep, 0, 0xBBAA;
            and.b32 $0, $2, lo;
            and.b32 $1, $3, hi;
            }""",
            "=r,=r,r,r,r,r,r,r,r,r,r,r,r",
            [p, draws, offset, high_mask], dtype=p.dtype, is_pure=True, pack=4)
    else:
        return tl.where(dropout_survives(draws, threshold), p, 0.0).to(p.dtype)


@triton.jit
def dropout_draws(seed, seq_head, start_m, start_n, S_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dropout draws for query positions ``start_m ... start_m + BLOCK_M - 1`` and keys
    ``start_n ... start_n + BLOCK_N - 1``: a [BLOCK_M, BLOCK_N] uint8 tile (numbers 0 ... 255).

    Philox is keyed by (seed, sequence * H + head). One call returns 4 x 32 random bits, i.e.
    sixteen 8-bit draws (a call per element would cost ~16x the arithmetic, more than the tile's
    matrix products). Which sixteen elements share a call is chosen for the tensor cores' register
    layout, in which a thread holds rows i and i + 8 of every 16 and two neighbouring keys out of
    every eight: call (P, G, t) serves rows ``16 R + 8 h + r`` (P = 8 R + r, h = 0..1) and keys
    ``32 G + 8 g + 2 t + e`` (g = 0..3, e = 0..1); word g of the call, byte 2 h + e. Its sixteen
    draws land in one thread's registers and need no shuffle. Element (i, j) survives when its
    draw is >= ``threshold`` (p * 256). The result depends on (seed, seq_head, i, j) and the row
    length S_k (the counters count its 32-key groups: a mask drawn for another S_k and cut down is
    another mask), never on the tile sizes, so every kernel that needs Z regenerates the same bits. ``start_m`` must
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
    return tl.reshape(draws, [BLOCK_M, BLOCK_N]).to(tl.uint8)


@triton.jit
def _bytes(words):
    """The four bytes of each 32-bit word as two new trailing dims [h, e] (byte 2 h + e)."""
    low = 0xFF
    return tl.join(tl.join(words & low, (words >> 16) & low), tl.join((words >> 8) & low, words >> 24))
