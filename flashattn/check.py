"""Checkers for the exercises: run your code on a battery of cases and name the bug it looks like.

Each checker takes the function (or kernel launcher) an exercise asks you to write, runs it on
a battery of small cases -- several batches and heads, causal and not, lengths that are not
block multiples, S_q != S_k, non-contiguous q/k/v, a dO of stride 0 and a strided dO, a custom
scale, memory past the end of every tensor filled with garbage -- and compares every output
with the float64 reference (:mod:`flashattn.reference`), head by head.

It prints where your function came from (a notebook cell or a file: editing a copy that Python
does not import is a classic way to lose an afternoon), one table with a row per case and
tensor, and, when something is wrong, the one classic bug the error pattern fits best:

=================  ======================================================================
hint id            pattern in the table  ->  the usual cause
=================  ======================================================================
``heads``          only some (batch, head) pairs right -> a stride borrowed from another tensor
``causal``         only causal cases wrong, first rows worst -> mask on the wrong quantity
``scale``          output = reference x sqrt(D) or / sqrt(D) -> scale missing or doubled
``padding``        only lengths that are not block multiples wrong -> padding not masked
``race``           two runs on the same input differ -> several programs add into one address
``overcount``      output = reference x whole numbers >= 1 -> several threads add one value
``delta``          dV right, dK / dQ wrong -> delta = rowsum(dO * O) or dS wrong
``lse``            everything off -> P not rebuilt with the forward's LSE
``unwritten``      NaN in the output (outputs start as NaN) -> elements never stored
``strides``        only non-contiguous inputs wrong -> offsets from shapes, not strides
``lse_output``     O right, LSE wrong -> LSE is not m + log(l)
``rescale``        wrong only with several key blocks -> running sums not rescaled
``grad_order``     dK holds dV and vice versa -> gradients returned in the wrong order
``oob_write``      memory just past the output changed -> a store without its mask
=================  ======================================================================

When every case passes the checker prints one ``PASS`` line. When any case fails, or your code
still raises ``NotImplementedError``, it prints the table and the diagnosis and raises an
``AssertionError`` (pass ``raise_on_fail=False`` to get the :class:`CheckResult` instead).

The checkers and what they call
-------------------------------
* :func:`attention_backward` -- ``fn(q, k, v, o, do, lse, causal, scale) -> (dq, dk, dv)``
* :func:`rebuild_p` -- ``fn(q, k, lse, causal, scale) -> P``
* :func:`online_softmax` -- ``fn(q, k, v, causal, scale, block_n) -> (o, lse)``
* :func:`dq_kernel` -- ``launch(q, k, v, do, lse, delta, dq, causal, scale) -> None``
* :func:`dkdv_kernel` -- ``launch(q, k, v, do, lse, delta, dk, dv, causal, scale) -> None``
* :func:`autograd_function` -- ``fn(q, k, v, causal=..., scale=...) -> o`` (differentiable)

Inputs are float32 on the CPU (Triton interpreter) and float16 on a GPU, unless ``dtype=`` says
otherwise; ``scale`` is always a float (never None); ``causal`` a bool.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import traceback
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from . import runtime
from .reference import attention_reference, repeat_kv
from .verify import per_head_relative_error, tolerance

__all__ = [
    "Case", "CheckResult", "Hint", "HINTS", "BATTERY",
    "attention_backward", "rebuild_p", "online_softmax", "dq_kernel", "dkdv_kernel",
    "autograd_function", "describe_origin",
]


# --------------------------------------------------------------------------------------
# the battery
# --------------------------------------------------------------------------------------
#: Lengths that are multiples of this count as "aligned" (a whole number of blocks for any
#: block size up to 64, which is what the exercises' launchers use).
ALIGN = 64

LAYOUTS = ("contiguous", "bshd", "sliced", "padded_heads", "padded_seq")
DO_LAYOUTS = LAYOUTS + ("stride0", "sum")


@dataclass(frozen=True)
class Case:
    """One input configuration of the battery.

    ``layout`` gives the memory layout of q, k, v (see :func:`make_input`), ``do_layout`` that of
    dO (``"stride0"``: one number expanded to the full shape, like the dO autograd hands over
    after ``out.sum()``; ``"sum"``, for :func:`autograd_function` only: call ``out.sum()``).
    ``repeat``: run twice and compare the bits (catches run-to-run differences).
    ``block_n``: for :func:`online_softmax`, the key block size handed to the function.
    ``requires``: for :func:`autograd_function`, which of q, k, v require grad.
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
    repeat: bool = False
    block_n: Optional[int] = None
    requires: str = "qkv"

    @property
    def heads_kv(self) -> int:
        return self.H if self.H_kv is None else self.H_kv

    @property
    def scale_value(self) -> float:
        return 1.0 / math.sqrt(self.D) if self.scale is None else float(self.scale)

    @property
    def aligned(self) -> bool:
        return self.S_q % ALIGN == 0 and self.S_k % ALIGN == 0

    @property
    def contiguous(self) -> bool:
        return (all(l == "contiguous" for l in self.layout)
                and self.do_layout in ("contiguous",))

    @property
    def multi_block(self) -> bool:
        return self.block_n is not None and self.block_n < self.S_k

    def shape_text(self) -> str:
        heads = f"H{self.H}" if self.H_kv in (None, self.H) else f"H{self.H}/{self.H_kv}"
        return f"B{self.B} {heads} S{self.S_q}x{self.S_k} D{self.D}"


def _c(name, B, H, S_q, S_k, D, causal, **kw) -> Case:
    return Case(name, B, H, S_q, S_k, D, causal, **kw)


#: The default battery of the backward checkers (PyTorch and kernels).
BATTERY: tuple[Case, ...] = (
    _c("aligned", 1, 2, 64, 64, 32, False, repeat=True),
    _c("aligned, causal", 1, 2, 64, 64, 32, True, repeat=True),
    _c("odd lengths", 2, 2, 21, 21, 16, False),
    _c("odd lengths, causal", 1, 2, 37, 37, 16, True),
    _c("S_q < S_k, causal", 1, 2, 23, 50, 16, True),
    _c("S_q > S_k", 1, 2, 50, 23, 64, False),
    _c("strided q/k/v", 1, 3, 40, 40, 32, True, layout=("bshd", "sliced", "padded_heads")),
    _c("dO of stride 0", 1, 2, 24, 24, 32, False, do_layout="stride0"),
    _c("strided dO", 1, 3, 40, 24, 32, False, do_layout="sliced"),
    _c("custom scale 0.3", 1, 2, 32, 32, 16, False, scale=0.3),
    _c("garbage past the end", 1, 2, 21, 45, 32, False,
       layout=("padded_seq",) * 3, do_layout="padded_seq"),
)

#: Cases with grouped-query attention, added with ``gqa=True``.
GQA_CASES: tuple[Case, ...] = (
    _c("GQA 4 heads / 2 kv", 1, 4, 40, 40, 16, True, H_kv=2),
    _c("MQA 3 heads / 1 kv", 1, 3, 37, 45, 32, False, H_kv=1, layout=("bshd", "contiguous", "sliced")),
)

#: Forward-only battery (rebuild_p, online_softmax): dO plays no part.
FORWARD_BATTERY: tuple[Case, ...] = tuple(
    c for c in BATTERY if c.do_layout in ("contiguous", "padded_seq"))

#: Smaller battery for autograd_function: every case runs the forward and both backward kernels.
AUTOGRAD_BATTERY: tuple[Case, ...] = (
    _c("aligned", 1, 2, 64, 64, 16, False),
    _c("odd lengths, causal", 1, 2, 37, 37, 16, True),
    _c("S_q > S_k", 2, 2, 50, 23, 32, False),
    _c("strided q/k/v, out.sum()", 1, 3, 40, 40, 32, True,
       layout=("bshd", "sliced", "padded_heads"), do_layout="sum"),
    _c("custom scale, strided dO", 1, 2, 32, 24, 16, False, scale=0.3, do_layout="sliced"),
    _c("only q needs grad", 1, 2, 24, 24, 32, False, requires="q"),
)


# --------------------------------------------------------------------------------------
# inputs: every tensor is a view into a larger buffer whose tail is garbage, so reading past
# the end of a tensor gives nonsense (not zeros that hide a missing mask) and stays in memory
# --------------------------------------------------------------------------------------
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
        return (B, H, S + 19, D), lambda t: t[:, :, :S]
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def _guard_len(numel: int) -> int:
    return numel + 8192


def make_input(shape, layout, dtype, device, gen: torch.Generator) -> torch.Tensor:
    """A random ``[B, H, S, D]`` tensor in ``layout``, inside a buffer with a garbage tail."""
    if layout == "stride0":
        # One value expanded to the whole shape (all strides 0). The buffer behind it holds the
        # same value, so a kernel that wrongly steps through it still reads sensible numbers.
        value = float(torch.empty(()).uniform_(0.5, 1.5, generator=gen))
        n = math.prod(shape)
        buf = torch.full((n + _guard_len(n),), value, dtype=dtype, device=device)
        return buf[0].expand(*shape)
    alloc, view = _alloc_shape(shape, layout)
    n = math.prod(alloc)
    buf = torch.randn(n + _guard_len(n), generator=gen).to(dtype=dtype, device=device)
    return view(buf[:n].view(alloc))


def _with_garbage_tail(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A contiguous copy of ``t`` followed (in memory) by garbage."""
    n = t.numel()
    buf = torch.randn(n + _guard_len(n), generator=gen).to(dtype=t.dtype, device=t.device)
    out = buf[:n].view(t.shape)
    out.copy_(t)
    return out


class _Output:
    """An output tensor poisoned with NaN, with a NaN guard zone after it in memory."""

    def __init__(self, shape, dtype, device):
        n = math.prod(shape)
        self.n = n
        self.buf = torch.full((n + 4096,), float("nan"), dtype=dtype, device=device)
        self.tensor = self.buf[:n].view(shape)

    def guard_touched(self) -> int:
        return int((~torch.isnan(self.buf[self.n:])).sum())


@dataclass
class _Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: Optional[torch.Tensor]
    ref: object                      # AttentionReference (float64)
    lse: torch.Tensor                # forward's LSE, stats dtype, with a garbage tail
    delta: Optional[torch.Tensor]    # rowsum(dO * O), stats dtype, with a garbage tail
    o: torch.Tensor                  # forward's O in the input dtype


def _make_inputs(case: Case, dtype, device, seed: int, with_do: bool = True) -> _Inputs:
    gen = torch.Generator().manual_seed(seed + zlib.crc32(case.name.encode()))
    Hk = case.heads_kv
    q = make_input((case.B, case.H, case.S_q, case.D), case.layout[0], dtype, device, gen)
    k = make_input((case.B, Hk, case.S_k, case.D), case.layout[1], dtype, device, gen)
    v = make_input((case.B, Hk, case.S_k, case.D), case.layout[2], dtype, device, gen)
    do = None
    if with_do:
        do_layout = "stride0" if case.do_layout == "sum" else case.do_layout
        do = make_input((case.B, case.H, case.S_q, case.D), do_layout, dtype, device, gen)
        if case.do_layout == "sum":
            do = torch.ones_like(q)      # what out.sum().backward() sends
    ref = attention_reference(q, k, v, do, causal=case.causal, scale=case.scale_value)
    stats = runtime.stats_dtype(dtype)
    lse = _with_garbage_tail(ref.LSE.to(stats), gen)
    delta = None if do is None else _with_garbage_tail(ref.delta.to(stats), gen)
    return _Inputs(q, k, v, do, ref, lse, delta, ref.O.to(dtype))


# --------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------
@dataclass
class TensorResult:
    """How far one output is from the reference."""

    name: str
    rel: float                 # whole tensor, ||a - e|| / ||e||
    per_head: torch.Tensor     # [B, H] relative errors (inf where not finite)
    row_err: torch.Tensor      # [rows]: max over (b, h) of ||a_i - e_i|| / rms row norm
    tol: float
    finite: bool
    ratio: float               # least-squares a ~ ratio * e
    ratio_resid: float         # ||a - ratio * e|| / ||ratio * e||
    guard_touched: int = 0     # elements written past the end of the output

    @property
    def worst(self) -> float:
        return float(self.per_head.max()) if self.per_head.numel() else self.rel

    @property
    def ok(self) -> bool:
        return self.finite and self.worst <= self.tol and self.guard_touched == 0

    @property
    def heads_ok(self) -> torch.Tensor:
        return self.per_head <= self.tol

    def bad_rows(self) -> list[int]:
        return [int(i) for i in torch.nonzero(self.row_err > self.tol).flatten()]


def _compare(name: str, actual, expected, tol: float, guard_touched: int = 0) -> TensorResult:
    if not isinstance(actual, torch.Tensor):
        raise TypeError(f"{name} should be a torch.Tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"{name} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    finite = bool(torch.isfinite(a).all())
    tiny = torch.finfo(torch.float64).tiny
    per_head = per_head_relative_error(a, e)
    per_head = torch.nan_to_num(per_head, nan=math.inf, posinf=math.inf)
    diff = torch.nan_to_num(a - e, nan=1e30, posinf=1e30, neginf=-1e30)
    rel = float(diff.norm() / e.norm().clamp_min(tiny))
    # per row (dim 2): error relative to the head's root-mean-square row norm
    rms = (e.flatten(2).norm(dim=-1) / math.sqrt(max(e.shape[2], 1))).clamp_min(tiny)   # [B, H]
    row = diff.norm(dim=-1) / rms[..., None]                                               # [B, H, S]
    row_err = row.amax(dim=(0, 1))
    if finite:
        ee = float((e * e).sum())
        ratio = float((a * e).sum()) / ee if ee > 0 else math.nan
        resid = float((a - ratio * e).norm()) / max(abs(ratio) * math.sqrt(ee), tiny)
    else:
        ratio, resid = math.nan, math.inf
    return TensorResult(name, rel, per_head, row_err, tol, finite, ratio, resid, guard_touched)


@dataclass
class CaseResult:
    case: Case
    tensors: dict = field(default_factory=dict)      # name -> TensorResult
    error: Optional[BaseException] = None
    error_where: str = ""
    nondeterministic: Optional[list] = None          # names of outputs whose bits changed
    fingerprints: set = field(default_factory=set)   # known wrong variants the output matches

    @property
    def ok(self) -> bool:
        return (self.error is None and not self.nondeterministic
                and all(t.ok for t in self.tensors.values()))

    def bad(self) -> list:
        return [t for t in self.tensors.values() if not t.ok]


@dataclass(frozen=True)
class Hint:
    id: str
    title: str
    explanation: str


HINTS: dict[str, Hint] = {h.id: h for h in [
    Hint("not_implemented", "not written yet",
         "Your code still raises NotImplementedError: replace the `raise NotImplementedError()` "
         "line (the `# YOUR CODE HERE` block) with your implementation, re-run that cell, then "
         "this one."),
    Hint("exception", "your code raised an exception",
         "The error and the line it came from are shown above. Shapes are q [B, H, S_q, D], "
         "k, v [B, H_kv, S_k, D], lse [B, H, S_q]; cases with S_q != S_k or non-contiguous "
         "tensors are the usual triggers (use .reshape rather than .view, and each tensor's own "
         "strides)."),
    Hint("shape", "an output has the wrong shape or type",
         "Return tensors shaped like the reference: dQ like q, dK and dV like k and v, "
         "P [B, H, S_q, S_k], LSE [B, H, S_q]."),
    Hint("race", "results change between runs on the same input: a race on a global accumulator",
         "Two runs on identical inputs gave different bits. Several programs (or threads) add "
         "into the same output addresses, and the order of those additions -- or whether an "
         "update is lost -- depends on scheduling. tl.atomic_add fixes lost updates but not the "
         "order, so the bits still change from run to run. Give every output block to exactly "
         "one program that accumulates in registers and stores once (the dK/dV kernel: one "
         "program per K/V block, looping over the query blocks). Story 001."),
    Hint("overcount", "too large by a factor >= 1: several threads add the same value into one address",
         "Every element is a whole multiple of the reference (1x, 2x, ...), many of them 2x or "
         "more: the same contribution was added more than once. Several threads (or programs) "
         "were mapped to the same output indices and each added the whole value -- a loop over "
         "rows that steps by 1 "
         "where it should step by the number of thread rows (blockDim.y), or a loop that ignores "
         "threadIdx.y. The factor follows the block shape, and can change from run to run when "
         "some of those unsynchronised additions are lost. Give each thread unique indices: every "
         "output element owned by exactly one thread, which accumulates it and stores it once. "
         "Story 001."),
    Hint("unwritten", "NaN in the output: some elements were never written",
         "Outputs start filled with NaN here, so an element your code never stores shows up. "
         "Check that the grid covers the last, partial block (triton.cdiv(S, BLOCK), not "
         "S // BLOCK), that the store mask is not stricter than `row < S`, and that your "
         "launcher writes into the output tensor it was given. (NaN can also come from exp of "
         "+inf: a missing mask on garbage rows.)"),
    Hint("scale", "the error is a constant factor tied to the softmax scale: scale missing or doubled",
         "S = Q K^T * scale, so the chain rule puts one factor `scale` into dQ = dS K * scale "
         "and dK = dS^T Q * scale -- exactly one, after the matrix product, and P must be "
         "rebuilt from S *with* the scale. A ratio of sqrt(D) = 1/scale means the factor is "
         "missing; 1/sqrt(D) = scale means it is applied twice. If only the custom-scale case "
         "fails, some step uses 1/sqrt(D) instead of the `scale` it was given."),
    Hint("heads", "only some (batch, head) pairs are right: a stride borrowed from another tensor",
         "Head 0 (or batch 0) is right and the others are not, so the offset of everything after "
         "the first head is wrong for some tensor -- typically that tensor's pointer is offset "
         "with another tensor's stride (dO with Q's head stride: story 004). Every tensor must "
         "use its own strides: q.stride(), k.stride(), v.stride(), do.stride(), ... The bug is "
         "invisible when all tensors happen to share a layout, which is why the battery mixes "
         "layouts and why per-head tests matter."),
    Hint("delta", "dV is right but dK / dQ are wrong: delta or dS is wrong",
         "dV = P^T dO needs only P, so P is fine. dK and dQ go through dS = P * (dP - delta) with "
         "dP = dO V^T and delta = rowsum(dO * O) (one number per query row, = rowsum(P * dP)). "
         "Check the subtraction of delta, its broadcasting (one value per *row*), and that "
         "delta comes from dO and O of the same row."),
    Hint("causal", "only causal cases are wrong (first rows worst): the mask is on the wrong quantity",
         "Hidden keys (j > i) must get P = 0: set S to -inf before the softmax, or P to 0 "
         "after rebuilding it -- not S to 0 (exp(0) = 1), not only dP or dS, not the normalised "
         "P after the softmax. Rows near the top (or the top of each diagonal tile) hide the "
         "most keys, so they are the most wrong. Note: under causal masking row 0 of dQ is "
         "zero up to rounding (it sees one key, and the softmax of one element is constant). If the "
         "function under test is your *reference*, test the test (story 000)."),
    Hint("padding", "only lengths that are not block multiples are wrong: padding not masked",
         "Cases whose lengths are multiples of the block pass, the others fail: the last, "
         "partial block is mishandled. Rows and keys past S_q / S_k must be masked in every "
         "load (other=0) and must get P = 0 (a padded row's LSE is garbage, so exp(S - LSE) is "
         "too, and it pollutes every row of dV and dK); loops must run over the partial last "
         "block. Here the memory past each tensor holds garbage, so a missing mask cannot pass "
         "by luck."),
    Hint("strides", "only non-contiguous inputs are wrong: offsets computed from shapes, not strides",
         "Contiguous inputs pass, strided ones (transposed [B, S, H, D] views, slices, a dO of "
         "stride 0) fail. Pass every tensor's own .stride() to the kernel and use it for every "
         "offset, including the last dimension's stride."),
    Hint("lse_output", "O is right but LSE is wrong",
         "LSE must be the natural log of the row's sum of exp(S): with the running maximum m "
         "and running sum l of exp(S - m), LSE = m + log(l) (not m, not log(l), not m + l)."),
    Hint("rescale", "wrong only when the keys come in several blocks: running sums not rescaled",
         "With one block everything is right, with several it is not. When the running maximum "
         "grows from m_old to m_new, everything accumulated so far (the sum l and the output "
         "accumulator) must be multiplied by exp(m_old - m_new) before the new block is added."),
    Hint("grad_order", "dK holds dV's values and dV dK's: gradients returned in the wrong order",
         "backward must return gradients in the order of forward's inputs: (dq, dk, dv, None, "
         "None) for forward(ctx, q, k, v, causal, scale)."),
    Hint("oob_write", "memory just past the output was written: a store without its mask",
         "The kernel stored elements beyond the end of the output tensor: the store's mask is "
         "missing the row (or column) condition, so the padded rows of the last block land in "
         "whatever follows in memory -- another head's rows, or another tensor."),
    Hint("lse", "everything is off: P is not rebuilt from the forward's LSE",
         "Every case and every head is wrong by a large amount. The backward rebuilds "
         "P = exp(S - LSE) with S = Q K^T * scale computed exactly as in the forward (same scale, "
         "same mask) and LSE the forward's natural-log log-sum-exp -- not log2 (exp2), not the "
         "row max alone, not a log-sum-exp recomputed without the scale."),
    Hint("unknown", "no classic pattern fits",
         "Compare the failing and the passing cases in the table: what do the failing ones "
         "share (causal? odd lengths? layout? S_q != S_k?)."),
]}


@dataclass
class CheckResult:
    """What a checker found: the cases, the diagnosis, and where your code came from."""

    title: str
    results: list
    hints: list
    origin: list            # lines describing where the function came from
    warnings: list          # origin warnings (editing the wrong copy?)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def hint_ids(self) -> list:
        return [h.id for h in self.hints]

    @property
    def failed(self) -> list:
        return [r for r in self.results if not r.ok]

    def table(self) -> str:
        head = f"{'#':>2}  {'case':<26}{'shape':<20}{'causal':<7}{'tensor':<7}{'rel err':>9}  {'heads ok':>8}  verdict"
        lines = [head, "-" * len(head)]
        for i, r in enumerate(self.results, 1):
            c = r.case
            prefix = f"{i:>2}  {c.name[:25]:<26}{c.shape_text():<20}{'yes' if c.causal else 'no':<7}"
            if r.error is not None:
                kind = "not implemented" if isinstance(r.error, NotImplementedError) else \
                    f"raised {type(r.error).__name__}"
                lines.append(prefix + f"{'-':<7}{'-':>9}  {'-':>8}  {kind}")
                continue
            for j, t in enumerate(r.tensors.values()):
                p = prefix if j == 0 else " " * len(prefix)
                heads = f"{int(t.heads_ok.sum())}/{t.heads_ok.numel()}"
                verdict = "ok" if t.ok else ("FAIL (NaN)" if not t.finite else "FAIL")
                if t.guard_touched:
                    verdict += f" (+{t.guard_touched} written past the end)"
                err = "inf" if not math.isfinite(t.worst) else f"{t.worst:.1e}"
                lines.append(p + f"{t.name:<7}{err:>9}  {heads:>8}  {verdict}")
            if r.nondeterministic:
                lines.append(" " * 4 + f"!! run twice on the same input: {', '.join(r.nondeterministic)} "
                             "changed between runs")
        return "\n".join(lines)

    def diagnosis(self) -> str:
        if self.ok:
            return ""
        lines = []
        for h in self.hints:
            lines.append(f"Diagnosis [{h.id}]: {h.title}.")
            lines += _wrap(h.explanation, "  ")
            ev = _evidence(h.id, self.results)
            if ev:
                lines.append("  Evidence: " + ev)
        errs = [r for r in self.results if r.error is not None
                and not isinstance(r.error, NotImplementedError)]
        if errs:
            r = errs[0]
            lines.append(f"  First error (case '{r.case.name}'): {type(r.error).__name__}: "
                         f"{_short(str(r.error))}")
            if r.error_where:
                lines.append(f"  at {r.error_where}")
        return "\n".join(lines)

    def report(self) -> str:
        parts = [self.title] + [f"  {l}" for l in self.origin] + [f"  WARNING: {w}" for w in self.warnings]
        parts += [self.table()]
        if self.ok:
            parts.append(self.pass_line())
        else:
            n, m = len(self.failed), len(self.results)
            parts.append(f"FAIL: {n} of {m} cases wrong.")
            parts.append(self.diagnosis())
        return "\n".join(parts)

    def pass_line(self) -> str:
        worst = max((t.worst for r in self.results for t in r.tensors.values()), default=0.0)
        tol = max((t.tol for r in self.results for t in r.tensors.values()), default=0.0)
        return (f"PASS {self.title}: all {len(self.results)} cases within tolerance "
                f"(worst head rel err {worst:.1e}, tol {tol:.0e}).")

    def plot(self, ax=None):
        """A heat map of the error of every (batch, head) pair in every case: a stride bug shows
        as a column of green (head 0) next to red, a causal bug as red rows for the causal cases."""
        import matplotlib.pyplot as plt

        rows = [r for r in self.results if r.tensors]
        width = max((t.per_head.numel() for r in rows for t in r.tensors.values()), default=1)
        grid = torch.full((len(rows), width), float("nan"), dtype=torch.float64)
        for i, r in enumerate(rows):
            worst = None
            for t in r.tensors.values():          # the worst tensor, head by head
                e = t.per_head.flatten().clamp_min(1e-12)
                worst = e if worst is None or worst.numel() != e.numel() else torch.maximum(worst, e)
            grid[i, :worst.numel()] = worst.log10()
        if ax is None:
            _, ax = plt.subplots(figsize=(1.6 + 0.45 * width, 0.8 + 0.32 * len(rows)), dpi=90)
        tol = max((t.tol for r in rows for t in r.tensors.values()), default=1e-4)
        img = ax.imshow(grid.numpy(), cmap="RdYlGn_r", vmin=math.log10(tol) - 4,
                        vmax=math.log10(tol) + 4, aspect="auto")
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not math.isnan(float(grid[i, j])) and float(grid[i, j]) > math.log10(tol):
                    ax.text(j, i, "x", ha="center", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [r.case.name for r in rows], fontsize=8)
        ax.set_xticks(range(width), [str(j) for j in range(width)], fontsize=8)
        ax.set_xlabel("(batch, head) pair, flattened  (x: over tolerance)")
        ax.figure.colorbar(img, ax=ax, label="log10 rel. error")
        ax.set_title(self.title, fontsize=9)
        ax.figure.tight_layout()
        return ax.figure

    def assertion_message(self) -> str:
        h = self.hints[0] if self.hints else HINTS["unknown"]
        n, m = len(self.failed), len(self.results)
        if h.id == "not_implemented":
            return f"{self.title}: not implemented yet -- {h.explanation}"
        return f"{self.title}: {n} of {m} cases wrong. Likely: {h.title}. (See the table and diagnosis above.)"


def _wrap(text: str, indent: str, width: int = 96) -> list:
    import textwrap
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent)


def _short(s: str, n: int = 300) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[:n] + " ..."


# --------------------------------------------------------------------------------------
# the diagnosis: the first rule that fits wins, so each pattern maps to one hint
# --------------------------------------------------------------------------------------
def _fits_scale(failing, results) -> bool:
    bad = [(r, t) for r in failing for t in r.bad()]
    if not bad:
        return False

    def factor(r, t):
        s = r.case.scale_value
        if not (math.isfinite(t.ratio) and t.ratio_resid < 1e-2):
            return None
        for f in (1.0 / s, s, (1.0 / math.sqrt(r.case.D)) / s, s * math.sqrt(r.case.D)):
            if abs(t.ratio / f - 1.0) < 2e-2:
                return f
        return None

    if all(factor(r, t) is not None for r, t in bad):
        return True
    # only the custom-scale cases fail: 1/sqrt(D) used instead of the scale given
    custom = [r for r in results if r.case.scale is not None]
    return bool(custom) and all(r.case.scale is not None for r in failing) and \
        len(failing) == len(custom)


def _fits_heads(failing) -> bool:
    seen = 0
    for r in failing:
        for t in r.bad():
            ok = t.heads_ok
            if ok.numel() < 2:
                continue
            if not bool(ok.any()):
                return False
            seen += 1
    return seen > 0


def _fits_delta(failing, results) -> bool:
    if any("delta" in r.fingerprints for r in failing) and all("delta" in r.fingerprints for r in failing):
        return True
    with_dv = [r for r in results if "dV" in r.tensors]
    if not with_dv:
        return False
    dv_ok = all(r.tensors["dV"].ok for r in with_dv)
    others_bad = all(any(t.name in ("dK", "dQ") for t in r.bad()) for r in failing)
    return dv_ok and others_bad


def _diagnose(results) -> list:
    failing = [r for r in results if not r.ok]
    if not failing:
        return []
    if any(isinstance(r.error, NotImplementedError) for r in failing):
        return [HINTS["not_implemented"]]
    if any(r.error is not None and getattr(r.error, "_flashattn_shape", False) for r in failing):
        return [HINTS["shape"]]
    if any(r.error is not None for r in failing):
        return [HINTS["exception"]]
    if any(r.nondeterministic for r in results):
        return [HINTS["race"]]
    if any(not t.finite for r in failing for t in r.bad()):
        return [HINTS["unwritten"]]
    if any(t.guard_touched for r in failing for t in r.bad()):
        return [HINTS["oob_write"]]
    if _fits_scale(failing, results):
        return [HINTS["scale"]]
    if all("overcount" in r.fingerprints for r in failing):
        return [HINTS["overcount"]]
    if _fits_heads(failing):
        return [HINTS["heads"]]
    if all("grad_order" in r.fingerprints for r in failing):
        return [HINTS["grad_order"]]
    if _fits_delta(failing, results):
        return [HINTS["delta"]]
    non_causal = [r for r in results if not r.case.causal]
    if all(r.case.causal for r in failing) and non_causal:
        return [HINTS["causal"]]
    aligned_pass = [r for r in results if r.case.aligned and r.ok]
    if (all(not r.case.aligned for r in failing) and aligned_pass
            and any(not r.case.causal for r in failing)):
        return [HINTS["padding"]]
    contiguous_pass = [r for r in results if r.case.contiguous and r.ok]
    if all(not r.case.contiguous for r in failing) and contiguous_pass:
        return [HINTS["strides"]]
    if all("O" in r.tensors and r.tensors["O"].ok and "LSE" in r.tensors and not r.tensors["LSE"].ok
           for r in failing):
        return [HINTS["lse_output"]]
    single = [r for r in results if r.case.block_n is not None and not r.case.multi_block]
    if single and all(r.ok for r in single) and all(r.case.multi_block for r in failing):
        return [HINTS["rescale"]]
    if len(failing) == len(results) and all(not bool(t.heads_ok.any()) for r in failing for t in r.bad()):
        return [HINTS["lse"]]
    return [HINTS["unknown"]]


def _ranges(idx: Sequence[int], limit: int = 6) -> str:
    if not idx:
        return "none"
    out, start, prev = [], idx[0], idx[0]
    for i in list(idx[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    text = ", ".join(out[:limit])
    return text + (", ..." if len(out) > limit else "")


def _evidence(hint_id: str, results) -> str:
    failing = [r for r in results if not r.ok]
    names = ", ".join(f"'{r.case.name}'" for r in failing[:4]) + (", ..." if len(failing) > 4 else "")
    if hint_id == "heads":
        r = failing[0]
        t = r.bad()[0]
        per = ", ".join(f"({b},{h}) {'ok' if t.heads_ok[b, h] else f'{float(t.per_head[b, h]):.0e}'}"
                        for b in range(t.per_head.shape[0]) for h in range(t.per_head.shape[1]))
        return f"case '{r.case.name}', {t.name} per (batch, head): {per}."
    if hint_id == "scale":
        parts = []
        for r in failing[:3]:
            for t in r.bad()[:2]:
                if math.isfinite(t.ratio):
                    parts.append(f"'{r.case.name}' {t.name}: yours / reference = {t.ratio:.4g} "
                                 f"(sqrt(D) = {math.sqrt(r.case.D):.4g}, scale = {r.case.scale_value:.4g})")
        return "; ".join(parts) + "." if parts else f"failing cases: {names}."
    if hint_id in ("causal", "padding", "unwritten", "unknown", "lse"):
        r = failing[0]
        t = r.bad()[0] if r.bad() else None
        if t is None:
            return f"failing cases: {names}."
        rows = t.bad_rows()
        n = t.row_err.numel()
        what = "keys" if t.name in ("dK", "dV") else "rows"
        return (f"failing cases: {names}. In '{r.case.name}', {t.name}: wrong {what} {_ranges(rows)} "
                f"of 0-{n - 1}.")
    if hint_id == "race":
        r = next(r for r in results if r.nondeterministic)
        return f"case '{r.case.name}': {', '.join(r.nondeterministic)} differed between two runs."
    if hint_id == "delta":
        return f"failing cases: {names}; dV passes in every case."
    if hint_id == "overcount":
        r = next(r for r in failing if "overcount" in r.fingerprints)
        parts = [f"{t.name} / reference ~ {t.ratio:.3g}" for t in r.bad() if math.isfinite(t.ratio)]
        return (f"case '{r.case.name}': {', '.join(parts)} (least-squares factor); "
                f"failing cases: {names}.")
    return f"failing cases: {names}."


# --------------------------------------------------------------------------------------
# where did the function come from?
# --------------------------------------------------------------------------------------
def _unwrap(fn):
    for _ in range(5):
        if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
            fn = fn.backward
        elif hasattr(fn, "func") and not hasattr(fn, "__code__"):      # functools.partial
            fn = fn.func
        elif hasattr(fn, "__func__"):                                  # bound method
            fn = fn.__func__
        elif _is_kernel(fn):
            fn = fn.fn
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            break
    return fn


def _is_kernel(obj) -> bool:
    return (hasattr(obj, "fn") and callable(getattr(obj, "fn")) and hasattr(obj, "__getitem__")
            and hasattr(obj, "run"))


def _kernels_used(fn) -> list:
    fn = _unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    glb = getattr(fn, "__globals__", {})
    out = []
    names = set(code.co_names)
    for const in code.co_consts:             # nested functions (a launcher's run(cfg) closure)
        if inspect.iscode(const):
            names |= set(const.co_names)
    for name in sorted(names):
        obj = glb.get(name)
        if _is_kernel(obj):
            out.append((name, obj))
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            obj = cell.cell_contents
        except ValueError:          # an empty cell
            continue
        if _is_kernel(obj):
            out.append((name, obj))
    return out


def _in_notebook(path: str) -> bool:
    return ("ipykernel_" in path or path.startswith("<ipython-input") or
            (path.startswith("<") and path.endswith(">")))


def _project_root(start: Path) -> Path:
    for p in [start, *start.parents]:
        if (p / ".git").exists() or (p / "pyproject.toml").exists() or (p / "setup.py").exists():
            return p
    return start


def _same_name_elsewhere(path: Path, limit: int = 4000) -> list:
    """Other files named like ``path`` in the project around the working directory and in the
    project the file itself belongs to."""
    roots = []
    for start in (Path.cwd().resolve(), path.resolve().parent):
        root = _project_root(start)
        if root not in roots:
            roots.append(root)
    skip = {".git", ".venv", "venv", "node_modules", "__pycache__", "site-packages",
            ".ipynb_checkpoints", ".pytest_cache", "build", "dist"}
    found, seen = [], 0
    target = path.name
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
            if dirpath[len(str(root)):].count(os.sep) >= 4:
                dirnames[:] = []
            seen += len(filenames)
            if target in filenames:
                p = (Path(dirpath) / target).resolve()
                if p != path.resolve() and p not in found:
                    found.append(p)
            if seen > limit:
                break
    return found


def _code_matches(code, fresh) -> bool:
    if code.co_code != fresh.co_code or code.co_names != fresh.co_names:
        return False
    a = [c for c in code.co_consts if not inspect.iscode(c)]
    b = [c for c in fresh.co_consts if not inspect.iscode(c)]
    return a == b


def _stale(fn, path: Path, kernel=None) -> bool:
    """True if the file on disk no longer holds the code that is running."""
    try:
        text = path.read_text()
    except OSError:
        return False
    if kernel is not None and hasattr(kernel, "src"):
        return kernel.src.strip() not in text
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    try:
        module_code = compile(text, str(path), "exec")
    except SyntaxError:
        return True
    stack = [module_code]
    while stack:
        c = stack.pop()
        if c.co_name == code.co_name and _code_matches(code, c):
            return False
        stack += [k for k in c.co_consts if inspect.iscode(k)]
    return True


def describe_origin(fn, role: str = "your function") -> tuple[list, list]:
    """Lines saying where ``fn`` (and the Triton kernels it launches) came from, and warnings
    when that is probably not the copy you are editing."""
    lines, warnings = [], []
    items = [(role, fn, None)] + [("kernel", k.fn, k) for _, k in _kernels_used(fn)]
    pkg_dir = Path(__file__).resolve().parent
    for label, f, kernel in items:
        f = _unwrap(f)
        name = getattr(f, "__qualname__", getattr(f, "__name__", repr(f)))
        try:
            path = inspect.getsourcefile(f) or f.__code__.co_filename
        except (TypeError, AttributeError):
            lines.append(f"{label} `{name}`: defined in C or unknown")
            continue
        if _in_notebook(path):
            lines.append(f"{label} `{name}`: defined in a notebook cell (edited it? re-run that cell first)")
            continue
        p = Path(path).resolve()
        mod = sys.modules.get(getattr(f, "__module__", ""), None)
        mod_file = getattr(mod, "__file__", None)
        lines.append(f"{label} `{name}`: from {p}" +
                     (f" (module {f.__module__})" if mod_file else ""))
        if pkg_dir in p.parents:
            warnings.append(f"{label} `{name}` is flashattn's own implementation ({p.name}), not yours.")
            continue
        if "site-packages" in p.parts or "dist-packages" in p.parts:
            warnings.append(f"{label} `{name}` comes from an installed copy in {p.parent}: edits to "
                            "your checkout will not be seen (pip install -e . installs it editable).")
        if _stale(f, p, kernel):
            warnings.append(f"{p} has changed since it was imported: the code running is the old "
                            "one. Restart the kernel or importlib.reload() the module "
                            f"({getattr(f, '__module__', '?')}), then re-run.")
        others = _same_name_elsewhere(p)
        if others:
            listed = ", ".join(str(o) for o in others[:3])
            warnings.append(f"another file named {p.name} exists: {listed}. Python imported {p} "
                            "(print(module.__file__) to see it); make sure that is the one you edit.")
    return lines, warnings


# --------------------------------------------------------------------------------------
# running the learner's code
# --------------------------------------------------------------------------------------
def _default_kernel_dtype():
    return torch.float32 if runtime.INTERPRET else torch.float16


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    mine = Path(__file__).resolve()
    frames = [f for f in frames if Path(f.filename).resolve() != mine]
    if not frames:
        return ""
    f = frames[-1]
    src = f" -> {f.line.strip()}" if f.line else ""
    where = "a notebook cell" if _in_notebook(f.filename) else f.filename
    return f"{where}, line {f.lineno}{src}"


class _ShapeError(Exception):
    _flashattn_shape = True


def _kernel_not_written(launch) -> bool:
    for _, k in _kernels_used(launch):
        try:
            src = inspect.getsource(k.fn)
        except (OSError, TypeError):
            continue
        if "raise NotImplementedError" in src:
            return True
    return False


def _not_implemented(e: BaseException) -> bool:
    """NotImplementedError, possibly wrapped by Triton's interpreter or compiler."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, NotImplementedError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _bits(t) -> torch.Tensor:
    return t.detach().clone()


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))) \
        and bool(torch.equal(torch.isnan(a), torch.isnan(b)))


@contextlib.contextmanager
def _one_thread():
    """The battery's tensors are tiny: one CPU thread is faster than a thread pool (much faster
    when the cores are shared), and the learner's code runs in the same setting every time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_battery(title: str, fn, cases: Sequence[Case], run_case: Callable, **kw) -> CheckResult:
    with _one_thread():
        return _run_battery_impl(title, fn, cases, run_case, **kw)


def _run_battery_impl(title: str, fn, cases: Sequence[Case], run_case: Callable, *,
                 dtype, seed: int, with_do: bool, fingerprints: Optional[Callable] = None,
                 raise_on_fail: bool = True, show: bool = True, role: str = "your function",
                 precheck: Optional[Callable] = None) -> CheckResult:
    origin, warnings = describe_origin(fn, role)
    results = []
    device = runtime.default_device()
    tol = tolerance(dtype)
    not_written = precheck() if precheck else False
    for case in cases:
        res = CaseResult(case)
        results.append(res)
        if not_written:
            res.error = NotImplementedError("kernel body not written")
            break
        inputs = _make_inputs(case, dtype, device, seed, with_do=with_do)
        try:
            outs, expected, guards = run_case(case, inputs)
            if case.repeat:
                again, _, _ = run_case(case, inputs)
                changed = [n for n in outs if not _same_bits(outs[n], again[n])]
                res.nondeterministic = changed or None
            for name, out in outs.items():
                try:
                    res.tensors[name] = _compare(name, out, expected[name], tol, guards.get(name, 0))
                except (TypeError, ValueError) as e:
                    raise _ShapeError(str(e)) from None
            if fingerprints is not None and not res.ok:
                res.fingerprints = fingerprints(case, inputs, outs, tol)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:          # noqa: BLE001 -- report any error of the learner's code
            if _not_implemented(e):
                res.error = NotImplementedError(str(e))
                break                   # every other case would say the same
            res.error = e
            res.error_where = _where(e)
    hints = _diagnose(results)
    result = CheckResult(title, results, hints, origin, warnings)
    if show:
        if result.ok:
            extra = [f"  {l}" for l in origin] + [f"  WARNING: {w}" for w in warnings]
            print("\n".join(extra + [result.pass_line()]))
        else:
            print(result.report())
    if raise_on_fail and not result.ok:
        raise AssertionError(result.assertion_message())
    return result


def _gqa_cases(cases, gqa):
    return tuple(cases) + (GQA_CASES if gqa else ())


# --------------------------------------------------------------------------------------
# fingerprints: known wrong variants the learner's output may match exactly
# --------------------------------------------------------------------------------------
def _matches(a, e, tol) -> bool:
    a = a.detach().to("cpu", torch.float64)
    e = e.detach().to("cpu", torch.float64)
    if a.shape != e.shape or not bool(torch.isfinite(a).all()):
        return False
    return float(per_head_relative_error(a, e).max()) <= max(tol, 1e-6) * 10


def _backward_fingerprints(case: Case, inputs: _Inputs, outs: dict, tol: float) -> set:
    found = set()
    ref = inputs.ref
    H, Hk = case.H, case.heads_kv
    k_full = repeat_kv(inputs.k.to(torch.float64), H)
    q64 = inputs.q.to(torch.float64)
    ds_nodelta = ref.P * ref.dP                          # forgot "- delta"
    candidates = {
        "dQ": (ds_nodelta @ k_full) * case.scale_value,
        "dK": _sum_groups(ds_nodelta.transpose(-1, -2) @ q64, Hk) * case.scale_value,
    }
    checked = [n for n in ("dQ", "dK") if n in outs]
    if checked and all(_matches(outs[n], candidates[n], tol) for n in checked):
        found.add("delta")
    if "dK" in outs and "dV" in outs and _matches(outs["dK"], ref.dV, tol) and _matches(outs["dV"], ref.dK, tol):
        found.add("grad_order")
    expected = {"dQ": ref.dQ, "dK": ref.dK, "dV": ref.dV}
    if any(n in expected and _overcounted(t, expected[n], tol) for n, t in outs.items()):
        found.add("overcount")
    return found


def _overcounted(actual, expected, tol) -> bool:
    """actual = c * expected elementwise with whole numbers c >= 1, c >= 2 on a good share of the
    elements: the signature of one value added by several threads (deterministically: lost
    updates, which change from run to run, are the two-run comparison's to catch)."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape or not bool(torch.isfinite(a).all()) or e.numel() == 0:
        return False
    big = e.abs() > 1e-3 * float(e.abs().max())
    if int(big.sum()) < 8:
        return False
    r = a[big] / e[big]
    c = r.round()
    whole = ((c >= 1) & (c <= 64) & ((r - c).abs() <= max(10 * tol, 1e-4) * c)).double().mean()
    return float(whole) >= 0.95 and float((c >= 2).double().mean()) >= 0.05


def _sum_groups(x, n_kv):
    B, H, S, D = x.shape
    return x.reshape(B, n_kv, H // n_kv, S, D).sum(dim=2)


# --------------------------------------------------------------------------------------
# the checkers
# --------------------------------------------------------------------------------------
def attention_backward(fn, *, dtype: torch.dtype = torch.float32, gqa: bool = False,
                       cases: Optional[Sequence[Case]] = None, seed: int = 0,
                       raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check a PyTorch attention backward written by hand.

    ``fn(q, k, v, o, do, lse, causal, scale) -> (dq, dk, dv)``: q ``[B, H, S_q, D]``, k, v
    ``[B, H_kv, S_k, D]`` (H_kv = H unless ``gqa=True``), o and do like q, lse ``[B, H, S_q]``
    (the forward's log-sum-exp, fp32), ``causal`` a bool, ``scale`` a float. The tensors may be
    non-contiguous and dO may have stride 0. Returns gradients shaped like q, k, v.
    """
    cases = _gqa_cases(BATTERY if cases is None else cases, gqa)

    def run_case(case, x):
        out = fn(x.q, x.k, x.v, x.o, x.do, x.lse, case.causal, case.scale_value)
        if not (isinstance(out, (tuple, list)) and len(out) == 3):
            raise _ShapeError(f"fn must return a tuple (dq, dk, dv), got {type(out).__name__}")
        dq, dk, dv = out
        return {"dQ": dq, "dK": dk, "dV": dv}, {"dQ": x.ref.dQ, "dK": x.ref.dK, "dV": x.ref.dV}, {}

    return _run_battery("check.attention_backward", fn, cases, run_case, dtype=dtype, seed=seed,
                        with_do=True, fingerprints=_backward_fingerprints,
                        raise_on_fail=raise_on_fail, show=show)


def rebuild_p(fn, *, dtype: torch.dtype = torch.float32, gqa: bool = False,
              cases: Optional[Sequence[Case]] = None, seed: int = 0,
              raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check rebuilding the softmax from the forward's log-sum-exp.

    ``fn(q, k, lse, causal, scale) -> P`` with ``P = exp(S - LSE)`` ``[B, H, S_q, S_k]``,
    S = Q K^T * scale (hidden keys j > i get P = 0 when ``causal``), lse ``[B, H, S_q]`` fp32.
    """
    cases = _gqa_cases(FORWARD_BATTERY if cases is None else cases, gqa)

    def run_case(case, x):
        p = fn(x.q, x.k, x.lse, case.causal, case.scale_value)
        return {"P": p}, {"P": x.ref.P}, {}

    return _run_battery("check.rebuild_p", fn, cases, run_case, dtype=dtype, seed=seed,
                        with_do=False, raise_on_fail=raise_on_fail, show=show)


def _online_cases(cases):
    out = []
    for c in cases:
        out.append(replace(c, block_n=16))
    # the same shapes in one block: rescaling never happens there
    for c in cases[:2]:
        out.append(replace(c, name=c.name + ", one block", block_n=c.S_k))
    return tuple(out)


def online_softmax(fn, *, dtype: torch.dtype = torch.float32, gqa: bool = False,
                   cases: Optional[Sequence[Case]] = None, seed: int = 0,
                   raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check a forward written with the online softmax, block by block over the keys.

    ``fn(q, k, v, causal, scale, block_n) -> (o, lse)``: o like q, lse ``[B, H, S_q]`` the
    natural-log log-sum-exp of each row of S = Q K^T * scale. ``block_n`` is the number of keys
    per block (16, or all keys at once for the "one block" cases).
    """
    base = FORWARD_BATTERY if cases is None else cases
    cases = _online_cases(_gqa_cases(base, gqa))

    def run_case(case, x):
        out = fn(x.q, x.k, x.v, case.causal, case.scale_value, case.block_n)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise _ShapeError(f"fn must return a tuple (o, lse), got {type(out).__name__}")
        o, lse = out
        return {"O": o, "LSE": lse}, {"O": x.ref.O, "LSE": x.ref.LSE}, {}

    return _run_battery("check.online_softmax", fn, cases, run_case, dtype=dtype, seed=seed,
                        with_do=False, raise_on_fail=raise_on_fail, show=show)


def dq_kernel(launch, *, dtype: Optional[torch.dtype] = None, gqa: bool = False,
              cases: Optional[Sequence[Case]] = None, seed: int = 0,
              raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check a dQ kernel through its launcher.

    ``launch(q, k, v, do, lse, delta, dq, causal, scale) -> None`` must launch your kernel and
    write dQ into ``dq`` (allocated here, ``[B, H, S_q, D]`` like q, filled with NaN so that
    unwritten elements show). ``lse`` and ``delta`` ``[B, H, S_q]`` are the forward's LSE and
    rowsum(dO * O) in fp32; every tensor may be non-contiguous (dO even of stride 0), so pass
    each one's own ``.stride()``. Inputs are fp32 in the interpreter, fp16 on a GPU.
    """
    dtype = dtype or _default_kernel_dtype()
    cases = _gqa_cases(BATTERY if cases is None else cases, gqa)

    def run_case(case, x):
        out = _Output(x.q.shape, x.q.dtype, x.q.device)
        launch(x.q, x.k, x.v, x.do, x.lse, x.delta, out.tensor, case.causal, case.scale_value)
        return {"dQ": _bits(out.tensor)}, {"dQ": x.ref.dQ}, {"dQ": out.guard_touched()}

    return _run_battery("check.dq_kernel", launch, cases, run_case, dtype=dtype, seed=seed,
                        with_do=True, fingerprints=_backward_fingerprints, role="your launcher",
                        raise_on_fail=raise_on_fail, show=show,
                        precheck=lambda: _kernel_not_written(launch))


def dkdv_kernel(launch, *, dtype: Optional[torch.dtype] = None, gqa: bool = False,
                cases: Optional[Sequence[Case]] = None, seed: int = 0,
                raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check a dK/dV kernel through its launcher.

    ``launch(q, k, v, do, lse, delta, dk, dv, causal, scale) -> None`` must launch your kernel
    and write dK and dV into ``dk`` and ``dv`` (allocated here like k and v, filled with NaN).
    Same inputs as :func:`dq_kernel`. The two repeated cases are run twice and must give the
    same bits: accumulate in registers, not into global memory from several programs.
    """
    dtype = dtype or _default_kernel_dtype()
    cases = _gqa_cases(BATTERY if cases is None else cases, gqa)

    def run_case(case, x):
        dk = _Output(x.k.shape, x.k.dtype, x.k.device)
        dv = _Output(x.v.shape, x.v.dtype, x.v.device)
        launch(x.q, x.k, x.v, x.do, x.lse, x.delta, dk.tensor, dv.tensor, case.causal, case.scale_value)
        return ({"dK": _bits(dk.tensor), "dV": _bits(dv.tensor)}, {"dK": x.ref.dK, "dV": x.ref.dV},
                {"dK": dk.guard_touched(), "dV": dv.guard_touched()})

    return _run_battery("check.dkdv_kernel", launch, cases, run_case, dtype=dtype, seed=seed,
                        with_do=True, fingerprints=_backward_fingerprints, role="your launcher",
                        raise_on_fail=raise_on_fail, show=show,
                        precheck=lambda: _kernel_not_written(launch))


_GRAD_COUNT_HELP = ("backward must return one value per input of forward(ctx, q, k, v, causal, "
                    "scale): (dq, dk, dv, None, None) -- None for the non-tensor arguments.")


def autograd_function(fn, *, dtype: Optional[torch.dtype] = None, gqa: bool = False,
                      cases: Optional[Sequence[Case]] = None, seed: int = 0,
                      raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check attention wired into autograd, forward and backward.

    ``fn(q, k, v, causal=..., scale=...) -> o`` (typically ``MyFunction.apply(q, k, v, causal,
    scale)``). The checker makes q, k, v leaves that require grad (in one case only q does),
    runs ``fn`` and ``torch.autograd.grad`` with a dO that may be strided, or calls
    ``o.sum().backward()`` (autograd then hands backward a dO of stride 0), and compares O,
    dQ, dK, dV with the float64 reference.
    """
    dtype = dtype or _default_kernel_dtype()
    cases = _gqa_cases(AUTOGRAD_BATTERY if cases is None else cases, gqa)

    def run_case(case, x):
        leaves = {}
        for name, t in (("q", x.q), ("k", x.k), ("v", x.v)):
            leaves[name] = t.detach().requires_grad_(name in case.requires)
        o = fn(leaves["q"], leaves["k"], leaves["v"], causal=case.causal, scale=case.scale_value)
        if not isinstance(o, torch.Tensor):
            raise _ShapeError(f"fn must return the output tensor, got {type(o).__name__}")
        wanted = [leaves[n] for n in "qkv" if n in case.requires]
        try:
            if case.do_layout == "sum":
                for t in wanted:
                    t.grad = None
                o.sum().backward()
                grads = [t.grad for t in wanted]
            else:
                grads = torch.autograd.grad(o, wanted, x.do, allow_unused=True)
        except RuntimeError as e:
            if "incorrect number of gradients" in str(e):
                raise RuntimeError(f"{e}. {_GRAD_COUNT_HELP}") from None
            raise
        names = {"q": "dQ", "k": "dK", "v": "dV"}
        outs = {"O": o.detach()}
        refs = {"O": x.ref.O, "dQ": x.ref.dQ, "dK": x.ref.dK, "dV": x.ref.dV}
        for n, g in zip([n for n in "qkv" if n in case.requires], grads):
            if g is None:
                raise _ShapeError(f"no gradient reached {n}: backward returned None for it")
            outs[names[n]] = g
        return outs, refs, {}

    return _run_battery("check.autograd_function", fn, cases, run_case, dtype=dtype, seed=seed,
                        with_do=True, fingerprints=_backward_fingerprints,
                        raise_on_fail=raise_on_fail, show=show)
