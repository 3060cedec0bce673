"""fp32 as three bf16 pieces: what the fused backward runs on for fp32 inputs.

An fp32 number x (24 significant bits) is the sum of three bf16 numbers (8 bits each):

    hi = bf16(x),   mid = bf16(x - hi),   lo = bf16(x - hi - mid),   x = hi + mid + lo

(to fp32's last bit: each piece takes the next 8 bits of the remainder). A product of two such
sums has nine terms; the three smallest (mid*lo, lo*mid, lo*lo) fall below fp32's rounding, so a
matrix product is six bf16 products, added smallest first:

    a b ~ a_mid b_mid + a_lo b_hi + a_hi b_lo + a_mid b_hi + a_hi b_mid + a_hi b_hi

That is Triton's ``input_precision="bf16x6"`` written out by hand. Triton's version splits each
operand in registers inside every program, every time it meets it; a tile of Q that 64 key
blocks read is split 64 times. Here the streamed operands (Q and dO in the dK/dV loop) are split
once, by :func:`split_pieces`, into bf16 planes in global memory, and so are K and V; the loop
loads the pieces straight into shared memory for the tensor cores, and only what the loop
computes (P, dS) is split in registers. (K and V split in registers instead, once per program,
cost 48 KB more shared memory -- K was then staged twice, once per product it enters -- and the
best tile, 64 x 64, no longer fit.)

One trap, measured on an H100: the tensor cores add a product into an fp32 accumulator with
truncation, so adding six small products at a time into the large running sum of dK (64 query
blocks of them) lost bits: dK's error was 8.5e-6 instead of 4.6e-7. Each six-product sum
therefore starts from zero (:func:`dot6`) and is added to the running sum by an ordinary fp32
addition, which rounds to nearest.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from .. import runtime
from .forward import load_tile

#: Triton's interpreter cannot multiply bf16 matrices (triton issue 11584): there the pieces are
#: widened to fp32 before each product, which changes nothing (bf16 x bf16 is exact in fp32)
UPCAST = tl.constexpr(runtime.INTERPRET)


@triton.jit
def split3(x):
    """(hi, mid, lo): three bf16 tensors whose sum is the fp32 tensor ``x``."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def trans3(x):
    """The pieces of x^T."""
    return tl.trans(x[0]), tl.trans(x[1]), tl.trans(x[2])


@triton.jit
def _dot(a, b, acc):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def dot6(a, b):
    """a @ b in fp32 from the pieces ``a = (hi, mid, lo)``, ``b`` likewise: six bf16 products,
    smallest first, into a fresh fp32 accumulator (see the module's docstring for why fresh)."""
    acc = tl.zeros([a[0].shape[0], b[0].shape[1]], dtype=tl.float32)
    acc = _dot(a[1], b[1], acc)
    acc = _dot(a[2], b[0], acc)
    acc = _dot(a[0], b[2], acc)
    acc = _dot(a[1], b[0], acc)
    acc = _dot(a[0], b[1], acc)
    return _dot(a[0], b[0], acc)


@triton.jit
def mm(a, b, DOT_PRECISION: tl.constexpr, PIECES: tl.constexpr):
    """a @ b: from pieces (``PIECES``) or as ``tl.dot`` with ``DOT_PRECISION``."""
    # (if / else both returning: code after a constexpr if's return is still compiled by triton 3.6)
    if PIECES:
        return dot6(a, b)
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def trans(x, PIECES: tl.constexpr):
    """x^T, piece by piece where x is pieces."""
    if PIECES:
        return trans3(x)
    else:
        return tl.trans(x)


@triton.jit
def operand(x, like, PIECES: tl.constexpr):
    """An fp32 tensor the loop computed (P, dS), made a ``tl.dot`` operand: its pieces, or x
    in the dtype of ``like`` (the kernel's inputs)."""
    if PIECES:
        return split3(x)
    else:
        return x.to(like.dtype)


@triton.jit
def load3(ptrs, rows, d_ok, stride_piece, PAD_D: tl.constexpr):
    """The three pieces of a ``[rows, BLOCK_D]`` tile, planes ``stride_piece`` elements apart
    (rows past the end read as 0)."""
    return (load_tile(ptrs, rows, d_ok, True, PAD_D), load_tile(ptrs + stride_piece, rows, d_ok, True, PAD_D),
            load_tile(ptrs + 2 * stride_piece, rows, d_ok, True, PAD_D))


@triton.jit
def split_kernel(X, Y, PIECES, stride_x_b, stride_x_h, stride_x_s, stride_x_d,
                 stride_y_b, stride_y_h, stride_y_s, stride_y_d, stride_piece, H, S, D,
                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """X and Y [B, H, S, D] (any strides; ``program_id(2)`` picks one) -> three contiguous bf16
    planes each: piece p of tensor i at ``PIECES + p * stride_piece + i * B * H * S * D``."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    which = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < S)[:, None] & (cols < D)[None, :]
    if which == 0:
        src = X + b * stride_x_b + h * stride_x_h + rows[:, None] * stride_x_s + cols[None, :] * stride_x_d
    else:
        src = Y + b * stride_y_b + h * stride_y_h + rows[:, None] * stride_y_s + cols[None, :] * stride_y_d
    hi, mid, lo = split3(tl.load(src, mask=mask, other=0.0))
    plane = tl.num_programs(1).to(tl.int64) * S * D                # B * H * S * D
    out = PIECES + which * plane + (pid_bh.to(tl.int64) * S + rows[:, None]) * D + cols[None, :]
    tl.store(out, hi, mask=mask)
    tl.store(out + stride_piece, mid, mask=mask)
    tl.store(out + 2 * stride_piece, lo, mask=mask)


def split_pieces(x: torch.Tensor, y: torch.Tensor, *, warmup: bool = False):
    """The bf16 pieces of two fp32 tensors of one shape ``[B, H, S, D]``, in one launch: a buffer
    of shape ``[3, 2, B, H, S, D]``, piece first (``buffer[p, 0]`` is piece p of x, ``buffer[p, 1]``
    of y). ``warmup``: compile only, return an ``ArgSpec`` of the buffer."""
    from .tuning import ArgSpec, warm

    shape = tuple(x.shape)
    for t in (x, y):
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"split_pieces takes two fp32 tensors of one shape {shape}, "
                             f"got {t.dtype} of shape {tuple(t.shape)}")
    B, H, S, D = shape
    full = (3, 2) + shape
    buffer = ArgSpec(full, torch.bfloat16, x.device) if warmup else \
        torch.empty(full, dtype=torch.bfloat16, device=x.device)
    BLOCK_S, BLOCK_D = 16 if runtime.INTERPRET else 32, runtime.head_dim_block(D)
    args = (x, y, buffer, *x.stride(), *y.stride(), buffer.stride(0), H, S, D)
    if warmup:
        warm(split_kernel, *args, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, grid=(1,), num_warps=4)
    else:
        split_kernel[(triton.cdiv(S, BLOCK_S), B * H, 2)](*args, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, num_warps=4)
    return buffer
