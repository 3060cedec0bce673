"""The battery: the cases a checker runs, and inputs built so that mistakes cannot hide.

Every input is a view into a larger buffer. The memory a kernel could wrongly read -- the
tail after the whole tensor, and in the padded layouts the rows after each head -- holds NaN
(the *guard*), so an unmasked load turns into NaN in the output instead of plausible numbers.
Every output starts filled with a NaN of a bit pattern of its own (the *poison*), with a
poisoned guard after it, so an element never written and a write past the end both show,
and the two kinds of NaN can be told apart.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import runtime
from ..reference import AttentionReference, attention_reference

LAYOUTS = ("contiguous", "bshd", "sliced", "padded_heads", "padded_seq")

#: block sizes a learner's kernel may use: the "more than one block" properties are tried at each
BLOCKS = (16, 32, 64)


@dataclass(frozen=True)
class Case:
    """One input configuration of the battery.

    ``layout``: the memory layouts of q, k, v (see :func:`make_input`); ``do_layout`` that of
    dO (``"stride0"``: one number expanded to the full shape, like the dO autograd hands over
    after ``out.sum()``; ``"sum"``, for the autograd checker only: call ``out.sum()``).
    ``stats_padded``: LSE and delta with a NaN gap after each head's rows ("lse" or "delta":
    that one only, so that their strides differ; "strided": a last-axis stride of 2 for the LSE
    and 3 for delta, so that a load with the other's stride shows).
    ``repeat``: run twice and compare the bits (catches run-to-run differences).
    ``block_n``: for the online-softmax checker, the key block size handed to the function.
    ``requires``: for the autograd checker, which of q, k, v require grad.
    ``out_layout``: for the kernel checkers, the layout of the output handed to the launcher
    (dQ; dV, while dK stays contiguous, so that their strides differ).
    """

    name: str
    B: int
    H: int
    S_q: int
    S_k: int
    D: int
    causal: bool
    layout: tuple = ("contiguous", "contiguous", "contiguous")
    do_layout: str = "contiguous"
    scale: Optional[float] = None
    H_kv: Optional[int] = None
    stats_padded: object = False           # True, False, "lse", "delta" or "strided"
    repeat: bool = False
    block_n: Optional[int] = None
    requires: str = "qkv"
    dtype: Optional[torch.dtype] = None      # overrides the checker's dtype for this case
    scale_none: bool = False                 # autograd: call fn(..., scale=None), the default scale
    out_layout: str = "contiguous"           # kernels: dQ (dV) handed as a "bshd" view, dK contiguous

    @property
    def heads_kv(self) -> int:
        return self.H if self.H_kv is None else self.H_kv

    @property
    def scale_value(self) -> float:
        return 1.0 / math.sqrt(self.D) if self.scale is None else float(self.scale)

    @property
    def contiguous(self) -> bool:
        return all(l == "contiguous" for l in self.layout) and self.do_layout in ("contiguous", "sum")

    @property
    def multi_block(self) -> bool:
        return self.block_n is not None and self.block_n < self.S_k

    def shape_text(self) -> str:
        heads = f"H{self.H}" if self.H_kv in (None, self.H) else f"H{self.H}/{self.H_kv}"
        return f"B{self.B} {heads} S{self.S_q}x{self.S_k} D{self.D}"

    def output_strides(self, like: str) -> tuple:
        """The strides of the output shaped like ``like`` (q, k or v) that a kernel checker hands
        over: contiguous, but dQ and dV as [B, S, H, D] views where ``out_layout`` is "bshd"."""
        H, S = (self.H, self.S_q) if like == "q" else (self.heads_kv, self.S_k)
        alloc, view = _alloc_shape((self.B, H, S, self.D), "contiguous" if like == "k" else self.out_layout)
        return tuple(view(torch.empty(alloc, device="meta")).stride())

    def strides(self) -> dict:
        """name -> (b, h, s, d) strides of q, k, v, do in this case's layouts (no memory used)."""
        shapes = {"q": (self.B, self.H, self.S_q, self.D), "k": (self.B, self.heads_kv, self.S_k, self.D),
                  "v": (self.B, self.heads_kv, self.S_k, self.D), "do": (self.B, self.H, self.S_q, self.D)}
        layouts = dict(zip("qkv", self.layout), do=self.do_layout)
        out = {}
        for name, shape in shapes.items():
            layout = layouts[name]
            if layout in ("stride0", "sum"):
                out[name] = (0, 0, 0, 0)
                continue
            alloc, view = _alloc_shape(shape, layout)
            out[name] = tuple(view(torch.empty(alloc, device="meta")).stride())
        return out


def aligned(case) -> bool:
    """Every length a multiple of the largest block: no load needs a mask."""
    return case.S_q % BLOCKS[-1] == 0 and case.S_k % BLOCKS[-1] == 0


def padded_head_dim(D: int) -> bool:
    """Whether a kernel pads head dim D (to a power of two, at least 16): the head-dim mask matters."""
    return D < runtime.head_dim_block(D)


def _c(name, B, H, S_q, S_k, D, causal, **kw) -> Case:
    return Case(name, B, H, S_q, S_k, D, causal, **kw)


#: The backward checkers' battery. Built so that each property a mistake can hinge on --
#: causal or not, ragged lengths, S_q > S_k or S_q < S_k, one block or several (at 16, 32 or
#: 64 rows), layouts, a stride-0 dO, a custom scale -- has cases with and without it that
#: differ in little else.
BATTERY: tuple[Case, ...] = (
    _c("aligned", 1, 2, 64, 64, 32, False, repeat=True),
    _c("aligned, causal", 1, 2, 64, 64, 32, True, repeat=True),
    _c("one block", 1, 2, 16, 16, 16, False),
    _c("one block, causal", 1, 2, 16, 16, 16, True),
    _c("odd lengths", 2, 2, 21, 21, 16, False, layout=("padded_seq",) * 3, do_layout="padded_seq",
       stats_padded=True),
    _c("odd lengths, causal", 1, 2, 37, 37, 16, True),
    _c("S_q < S_k, causal", 1, 2, 23, 50, 16, True, layout=("padded_seq",) * 3,
       do_layout="padded_seq", stats_padded=True),
    _c("S_q > S_k", 1, 2, 50, 23, 64, False),
    _c("S_q > S_k, causal", 1, 2, 48, 32, 32, True),
    _c("S_q < S_k", 1, 2, 32, 48, 32, False),
    _c("strided q/k/v", 1, 3, 40, 40, 32, True, layout=("bshd", "sliced", "padded_heads")),
    # one tensor laid out unlike the other two: tells "V with K's strides" from "K with Q's"
    _c("strided q only", 1, 2, 24, 24, 16, False, layout=("bshd", "contiguous", "contiguous")),
    _c("strided v only", 1, 2, 24, 24, 16, False, layout=("contiguous", "contiguous", "bshd")),
    _c("dO of stride 0", 1, 2, 24, 24, 32, False, do_layout="stride0"),
    # delta padded, the LSE not: the two row vectors have different strides (each its own)
    _c("strided dO", 1, 3, 40, 40, 32, False, do_layout="sliced", stats_padded="delta"),
    _c("custom scale 0.3", 1, 2, 32, 32, 16, False, scale=0.3),
    _c("long, several blocks", 1, 1, 130, 96, 16, False, layout=("padded_seq",) * 3,
       do_layout="padded_seq", stats_padded=True),
    _c("long, causal", 1, 1, 100, 130, 16, True),
    _c("S_q < S_k, odd lengths", 1, 2, 21, 45, 32, False, layout=("padded_seq",) * 3,
       do_layout="padded_seq", stats_padded=True),
    _c("fp16 inputs", 1, 2, 40, 40, 32, True, dtype=torch.float16),
    # two sequences of one head each: a size-1 axis that is not the batch's (.squeeze() drops it)
    _c("two sequences, one head", 2, 1, 20, 28, 16, False),
)

#: 65 = 64 + 1 rows and keys: a last block of one row, one key, whatever the block (16, 32, 64). A
#: loop or grid bound one short (range(0, S_k - 1, BLOCK_N), cdiv(S - 1, BLOCK)) misses exactly
#: that block, and only a length one past a block multiple shows it. In fp32 on a GPU too, where
#: the other cases are fp16: one wrong row of 65 moves a head's relative error by about a tenth of
#: that row's, under fp16's tolerance in some heads (an H200 named the bug 'heads' for it).
LAST_BLOCK_OF_ONE = _c("last block of one (S 65)", 1, 2, 65, 65, 16, True, dtype=torch.float32)

#: The kernel checkers' battery: a head dim that is not a power of two as well. Kernels pad D
#: to BLOCK_D = next_power_of_2(D), so only here does a load or store without the head-dim mask
#: (offs_d < HEAD_DIM) reach past each row -- into the next row, or the guard after the last.
KERNEL_BATTERY: tuple[Case, ...] = BATTERY + (
    _c("head dim 24 (BLOCK_D 32)", 1, 2, 64, 64, 24, False),
    # a kernel that steps LSE and delta by 1 instead of their own stride reads the gaps
    _c("LSE and delta strided", 1, 2, 24, 24, 16, False, stats_padded="strided"),
    # the output handed as a non-contiguous view: written through its own strides, not a copy
    _c("strided outputs", 1, 2, 24, 24, 16, False, out_layout="bshd"),
    LAST_BLOCK_OF_ONE,
)

#: [B, S, H, D] memory with B = 2: batch and heads cannot be merged by .view (with B = 1 they can)
BATCH_OF_TWO_BSHD = _c("[B, S, H, D] memory, batch of 2", 2, 2, 24, 24, 16, True, layout=("bshd", "bshd", "bshd"))

#: The PyTorch backward exercise (01) in the dtype it asks for: every case but the fp16 one.
BACKWARD_BATTERY: tuple[Case, ...] = tuple(c for c in BATTERY if c.dtype is None) + (BATCH_OF_TWO_BSHD,)

#: Cases with grouped-query attention, added with ``gqa=True``.
GQA_CASES: tuple[Case, ...] = (
    _c("GQA 4 heads / 2 kv", 1, 4, 40, 40, 16, True, H_kv=2),
    _c("MQA 3 heads / 1 kv", 1, 3, 37, 45, 32, False, H_kv=1, layout=("bshd", "contiguous", "sliced")),
    # two batch elements, laid out unlike each other: a batch index decoded with H where H_kv belongs
    # is exact at B = 1, and lands on the next batch element's heads when the tensors are contiguous
    # (and GROUP_SIZE = 3 != H_kv = 2: h % H_kv and h % GROUP_SIZE tell apart)
    _c("GQA 6 / 2, batch of 2", 2, 6, 24, 24, 16, False, H_kv=2, layout=("bshd", "padded_heads", "contiguous")),
)

#: Forward-only battery (rebuild_p, online_softmax): dO plays no part.
FORWARD_BATTERY: tuple[Case, ...] = tuple(
    c for c in BATTERY if c.do_layout in ("contiguous", "padded_seq") and c.S_q <= 64) + (
    _c("strided q/k/v, not causal", 1, 2, 40, 24, 32, False, layout=("sliced", "bshd", "padded_heads")),
    BATCH_OF_TWO_BSHD,
    # scores up to ~150, past float32 exp's range (88.7): exp(S) overflows unless a row's
    # maximum (or its LSE) is subtracted first, as the lessons do
    _c("large scores (scale 12)", 1, 2, 24, 24, 16, False, scale=12.0),
    LAST_BLOCK_OF_ONE,)

#: Smaller battery for the autograd checker: every case runs the forward and both backward kernels.
AUTOGRAD_BATTERY: tuple[Case, ...] = (
    _c("aligned", 1, 2, 64, 64, 16, False),
    _c("odd lengths, causal", 1, 2, 37, 37, 16, True),
    _c("S_q > S_k", 2, 2, 50, 23, 32, False),
    _c("S_q < S_k", 1, 2, 24, 40, 16, False),
    _c("strided q/k/v, out.sum()", 1, 3, 40, 40, 32, True,
       layout=("bshd", "sliced", "padded_heads"), do_layout="sum"),
    _c("custom scale, strided dO", 1, 2, 32, 24, 16, False, scale=0.3, do_layout="sliced"),
    _c("only q needs grad", 1, 2, 24, 24, 32, False, requires="q"),
    # dK and dV are asked for separately (needs_input_grad[1] and [2]): a frozen k, a trained v
    _c("v needs grad, k does not", 1, 2, 24, 24, 32, True, requires="qv"),
    # q frozen (a cross-attention's queries from a frozen encoder): dK, dV without dQ
    _c("q frozen, k and v trained", 1, 2, 24, 24, 32, False, requires="kv"),
    # scale=None, as SDPA allows: the default 1/sqrt(D) must be filled in (not 1/D, not 1)
    _c("scale=None (default)", 1, 2, 24, 24, 32, True, scale_none=True),
)

#: Added to the autograd checker's cases on a GPU, where the other cases are float16: a model
#: trained in float32 must get float32 back (a forward that calls ``.half()`` on its inputs
#: is exact when they are float16 already). On the CPU every case is float32.
AUTOGRAD_FLOAT32_CASE = _c("float32 inputs", 1, 2, 24, 40, 32, True, dtype=torch.float32)


# --------------------------------------------------------------------------------------
# poison and guard values
# --------------------------------------------------------------------------------------
#: Bit patterns of two quiet NaNs per dtype: POISON fills outputs (an element still holding
#: it was never written), GUARD fills the memory around inputs.
_NAN_BITS = {
    torch.float16: (torch.int16, 0x7E5A, 0x7E2B),
    torch.bfloat16: (torch.int16, 0x7FDA, 0x7FAB),
    torch.float32: (torch.int32, 0x7FC0DEAD, 0x7FC0BAD0),
    torch.float64: (torch.int64, 0x7FF8DEADBEEF0001, 0x7FF8BAD0BAD00001),
}


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(_NAN_BITS[t.dtype][0])


def fill_poison(t: torch.Tensor) -> torch.Tensor:
    _int_view(t).fill_(_NAN_BITS[t.dtype][1])
    return t


def is_poison(t: torch.Tensor) -> torch.Tensor:
    """True where ``t`` still holds the poison bits (never written)."""
    return _int_view(t) == _NAN_BITS[t.dtype][1]


def guard_bits(dtype: torch.dtype) -> int:
    """The bit pattern of the NaN that fills the memory around inputs of ``dtype``."""
    return _NAN_BITS[dtype][2]


def _guard_value(dtype: torch.dtype) -> torch.Tensor:
    int_dtype, _, bits = _NAN_BITS[dtype]
    return torch.tensor(bits, dtype=int_dtype).view(dtype)


# --------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------
#: Rows of guard after each head in the padded layouts: more than any block can overshoot.
PAD_ROWS = 128


def _alloc_shape(shape, layout):
    B, H, S, D = shape
    if layout == "contiguous":
        return (B, H, S, D), lambda t: t
    if layout == "bshd":      # the usual projection output [B, S, H, D], transposed
        return (B, S, H, D), lambda t: t.transpose(1, 2)
    if layout == "sliced":    # every other element of a wider last dim: stride_d = 2
        return (B, H, S, 2 * D), lambda t: t[..., ::2]
    if layout == "padded_heads":  # some heads of a tensor with more heads
        return (B, H + 2, S, D), lambda t: t[:, 1:H + 1]
    if layout == "padded_seq":    # the first S rows of a longer sequence (a KV-cache slice)
        return (B, H, S + PAD_ROWS, D), lambda t: t[:, :, :S]
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def _guard_len(numel: int) -> int:
    return numel + 8192


def make_input(shape, layout, dtype, device, gen: torch.Generator, guard: float = math.nan) -> torch.Tensor:
    """A random ``[B, H, S, D]`` tensor in ``layout`` whose surroundings hold ``guard``: the
    tail after it, and for ``padded_seq`` the rows after each head's S rows."""
    if layout == "stride0":
        # One value expanded to the whole shape (all strides 0), like the dO of out.sum(). The
        # memory behind it holds other finite values: a kernel that steps through it with some
        # other tensor's strides reads wrong numbers, not NaN and not the same value.
        n = math.prod(shape)
        buf = torch.randn(n + _guard_len(n), generator=gen).to(dtype=dtype, device=device)
        buf[0] = float(torch.empty(()).uniform_(0.5, 1.5, generator=gen))
        return buf[0].expand(*shape)
    alloc, view = _alloc_shape(shape, layout)
    n = math.prod(alloc)
    data = torch.randn(alloc, generator=gen).to(dtype)
    buf = torch.empty(n + _guard_len(n), dtype=dtype)
    fill = _guard_value(dtype) if math.isnan(guard) else torch.tensor(guard, dtype=dtype)
    buf[:] = fill
    if layout == "padded_seq":
        data[:, :, shape[2]:] = fill
    buf[:n] = data.flatten()
    return view(buf.to(device)[:n].view(alloc))


def make_stats(values: torch.Tensor, padded: bool, guard: float = math.nan, step: int = 1) -> torch.Tensor:
    """LSE or delta ``[B, H, S_q]`` inside a buffer whose tail (and, if ``padded``, a gap after
    each head's rows) holds ``guard``; ``step``: every step-th element (a last-axis stride of
    ``step``, guard in between)."""
    B, H, S = values.shape
    rows = (S + PAD_ROWS if padded else S) * step
    n = B * H * rows
    buf = torch.empty(n + _guard_len(n), dtype=values.dtype, device=values.device)
    buf[:] = _guard_value(values.dtype).to(values.device) if math.isnan(guard) else guard
    out = buf[:n].view(B, H, rows)[:, :, :S * step:step]
    out.copy_(values)
    return out


class Output:
    """An output tensor filled with the poison, followed in memory by a poisoned guard."""

    def __init__(self, shape, dtype, device, layout: str = "contiguous"):
        n = math.prod(shape)      # (layouts that fill their buffer: "contiguous", "bshd")
        self.n = n
        self.buf = fill_poison(torch.empty(n + 4096, dtype=dtype, device=device))
        alloc, view = _alloc_shape(shape, layout)      # "bshd": a [B, S, H, D] buffer, transposed
        self.tensor = view(self.buf[:n].view(alloc))

    def guard_touched(self) -> int:
        return int((~is_poison(self.buf[self.n:])).sum())


#: Names of the inputs that have a guard, in the order the NaN-origin search tries them.
GUARDED = ("q", "k", "v", "do", "lse", "delta")


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: Optional[torch.Tensor]
    ref: AttentionReference          # float64
    lse: torch.Tensor                # forward's LSE, stats dtype, guarded
    delta: Optional[torch.Tensor]    # rowsum(dO * O), stats dtype, guarded
    o: torch.Tensor                  # forward's O in the input dtype
    guards: dict = field(default_factory=dict)


def make_inputs(case: Case, dtype, device, seed: int, with_do: bool = True,
                guards: Optional[dict] = None) -> Inputs:
    """The inputs of one case. ``guards``: name -> value to put around that input instead of
    NaN (the NaN-origin search re-runs a case with some guards finite)."""
    guards = guards or {}
    g = lambda name: guards.get(name, math.nan)  # noqa: E731
    gen = torch.Generator().manual_seed(seed + zlib.crc32(case.name.encode()))
    Hk = case.heads_kv
    q = make_input((case.B, case.H, case.S_q, case.D), case.layout[0], dtype, device, gen, g("q"))
    k = make_input((case.B, Hk, case.S_k, case.D), case.layout[1], dtype, device, gen, g("k"))
    v = make_input((case.B, Hk, case.S_k, case.D), case.layout[2], dtype, device, gen, g("v"))
    do = None
    if with_do:
        do_layout = "stride0" if case.do_layout == "sum" else case.do_layout
        do = make_input((case.B, case.H, case.S_q, case.D), do_layout, dtype, device, gen, g("do"))
        if case.do_layout == "sum":
            do = torch.ones_like(q)      # what out.sum().backward() sends
    ref = attention_reference(q, k, v, do, causal=case.causal, scale=case.scale_value)
    stats = runtime.stats_dtype(dtype)
    strided = case.stats_padded == "strided"       # steps of 2 and 3: their strides differ too
    lse = make_stats(ref.LSE.to(stats), case.stats_padded in (True, "lse"), g("lse"), 2 if strided else 1)
    delta = None if do is None else make_stats(ref.delta.to(stats), case.stats_padded in (True, "delta"),
                                               g("delta"), 3 if strided else 1)
    return Inputs(q, k, v, do, ref, lse, delta, ref.O.to(dtype), dict(guards))
