"""Checkers for the exercises: run your code on a battery of cases and name the mistake.

Each checker takes the function (or kernel launcher) an exercise asks you to write, runs it on
a battery of small cases -- several batches and heads, causal and not, lengths that are not
block multiples, S_q != S_k, one block and several, non-contiguous q/k/v, a dO of stride 0 and
a strided dO, a custom scale; for kernels a head dim of 24, padded to 32 -- and compares every
output with the float64 reference (:mod:`flashattn.reference`), head by head. Around every input lies NaN, so a load past the end
shows; every output starts as a marked NaN, so an element never written shows; every input is
compared before and after the call, so one written in place shows.

A pass prints one line. A failure prints the diagnosis -- the mistake the pattern of errors
points at, with the evidence (which outputs, which cases, what factor, which rows) -- and the
table of cases, and raises ``AssertionError`` (``raise_on_fail=False`` returns the
:class:`CheckResult` instead: ``.report()``, ``.table()``, ``.plot()`` for the details).
The mistakes it can name, and the order each checker tries them in: :mod:`flashattn.check.checkers`
(``python -m flashattn.check --list dq_kernel``); how a run becomes a diagnosis: :mod:`flashattn.check.engine`.

The checkers and what they call
-------------------------------
* :func:`attention_backward` -- ``fn(q, k, v, o, do, lse, causal, scale) -> (dq, dk, dv)``
* :func:`rebuild_p` -- ``fn(q, k, lse, causal, scale) -> P``
* :func:`online_softmax` -- ``fn(q, k, v, causal, scale, block_n) -> (o, lse)``
* :func:`dq_kernel` -- ``launch(q, k, v, do, lse, delta, dq, causal, scale) -> None``
* :func:`dkdv_kernel` -- ``launch(q, k, v, do, lse, delta, dk, dv, causal, scale) -> None``
* :func:`autograd_function` -- ``fn(q, k, v, causal=..., scale=...) -> o`` (differentiable)
* :func:`lazy_backward` -- ``fn(q, k, v, bias, tau, do, scale) -> (dq, dk, dv, dbias, dtau)``
* :func:`window_mask` -- ``fn(S_q, S_k, window) -> bool [S_q, S_k]`` (lesson 09)
* :func:`beyond_backward` -- ``fn(q, k, v, o, do, lse, cu_seqlens_q, cu_seqlens_k, window, dropout_p,
  seed, scale) -> (dq, dk, dv)`` on a packed batch (lesson 09)
* :func:`merge_partials` -- ``fn(o_a, lse_a, o_b, lse_b) -> (o, lse)``, two partial results merged (lesson 11)
* :func:`ring_backward` -- ``fn(q, k, v, o, do, lse, positions, causal, scale) -> (dq, dk, dv)``, lists
  of W ranks' shards: the ring's backward in one process (lesson 11)

Inputs are float32 (the PyTorch exercises), or float32 on the CPU and float16 on a GPU (the
kernels), with one case in float16 everywhere (outputs must come back in the inputs' dtype);
``dtype=`` runs every case in that dtype instead. ``scale`` is a float (never None), except in
one case of :func:`autograd_function`, whose function takes ``scale=None`` like SDPA;
``causal`` a bool.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Optional, Sequence

import torch

from .. import runtime
from .battery import (AUTOGRAD_BATTERY, AUTOGRAD_FLOAT32_CASE, BACKWARD_BATTERY, BATTERY, FORWARD_BATTERY,
                      GQA_CASES, KERNEL_BATTERY, Case, Output)
from . import mistakes  # noqa: F401  (registers every mistake; the order is checkers.py's)
from .checkers import AUTOGRAD, BACKWARD, DKDV, DQ, EVERY, ONLINE, REBUILD_P, STAGES
from .engine import MISTAKES, verify
from .errors import CtxTensors, NoBackwardKernel, NoGradient, ShapeError
from .fingerprints import backward_variants, mask_variants, online_variants
from .beyond import beyond_backward, window_mask
from .lazy import lazy_backward
from .ring import merge_partials, ring_backward
from .origin import describe_origin
from .results import CheckFailed, CheckResult, Diagnosis
from .instruments import count_triton_launches, launched
from .runner import kernel_not_written, run_battery

verify(STAGES)      # every mistake registered has a place in the order, and every place a mistake

#: The result of the last checker call (pass or fail): ``check.last.report()``, ``.plot()``.
last: Optional[CheckResult] = None

__all__ = [
    "Case", "CheckResult", "CheckFailed", "Diagnosis", "MISTAKES", "BATTERY", "last", "orders",
    "attention_backward", "rebuild_p", "online_softmax", "dq_kernel", "dkdv_kernel",
    "autograd_function", "lazy_backward", "window_mask", "beyond_backward", "merge_partials", "ring_backward",
    "describe_origin",
]


def _with_gqa(cases, gqa):
    return tuple(cases) + (GQA_CASES if gqa else ())


def _variants(checker):
    return lambda case, x: backward_variants(case, x, checker)


def _default_kernel_dtype():
    return torch.float32 if runtime.INTERPRET else torch.float16


def attention_backward(fn, *, dtype: Optional[torch.dtype] = None, gqa: bool = False,
                       cases: Optional[Sequence[Case]] = None, seed: int = 0,
                       raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check a PyTorch attention backward written by hand.

    ``fn(q, k, v, o, do, lse, causal, scale) -> (dq, dk, dv)``: q ``[B, H, S_q, D]``, k, v
    ``[B, H_kv, S_k, D]`` (H_kv = H unless ``gqa=True``), o and do like q, lse ``[B, H, S_q]``
    (the forward's log-sum-exp, fp32), ``causal`` a bool, ``scale`` a float. The tensors may be
    non-contiguous and dO may have stride 0. Returns gradients shaped like q, k, v.
    """
    def run_case(case, x):
        out = fn(x.q, x.k, x.v, x.o, x.do, x.lse, case.causal, case.scale_value)
        if not (isinstance(out, (tuple, list)) and len(out) == 3):
            raise ShapeError(f"fn must return a tuple (dq, dk, dv), got {type(out).__name__}")
        dq, dk, dv = out
        return ({"dQ": dq, "dK": dk, "dV": dv}, {"dQ": x.ref.dQ, "dK": x.ref.dK, "dV": x.ref.dV},
                {"dtypes": {"dQ": x.q.dtype, "dK": x.k.dtype, "dV": x.v.dtype}})

    return run_battery("check.attention_backward", fn, _with_gqa(cases or BACKWARD_BATTERY, gqa), run_case,
                       checker=BACKWARD, dtype=dtype or torch.float32, dtype_given=dtype is not None, seed=seed, with_do=True,
                       variants=_variants(BACKWARD), raise_on_fail=raise_on_fail, show=show)


def rebuild_p(fn, *, dtype: Optional[torch.dtype] = None, gqa: bool = False,
              cases: Optional[Sequence[Case]] = None, seed: int = 0,
              raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check rebuilding the softmax from the forward's log-sum-exp.

    ``fn(q, k, lse, causal, scale) -> P`` with ``P = exp(S - LSE)`` ``[B, H, S_q, S_k]``,
    S = Q K^T * scale (hidden keys j > i get P = 0 when ``causal``), lse ``[B, H, S_q]`` fp32.
    """
    def run_case(case, x):
        p = fn(x.q, x.k, x.lse, case.causal, case.scale_value)
        return {"P": p}, {"P": x.ref.P}, {}

    def variants(case, x):
        ref, s = x.ref, case.scale_value
        lse = ref.LSE[..., None]
        k = x.k.to(torch.float64).repeat_interleave(case.H // case.heads_kv, dim=1)
        raw = x.q.to(torch.float64) @ k.transpose(-1, -2)
        hidden = ~torch.isfinite(ref.S)
        return {"unscaled_s": {"P": torch.exp(raw - lse).masked_fill(hidden, 0.0)},
                "exp2": {"P": torch.exp2(ref.S - lse)},
                "scale_twice": {"P": torch.exp(ref.S * s - lse).masked_fill(hidden, 0.0)},
                "p_hidden_neg_inf": {"P": torch.exp(ref.S - lse).masked_fill(hidden, float("-inf"))},
                "lse_divided": {"P": torch.exp(ref.S) / ref.LSE[..., None]},
                "lse_added": {"P": torch.exp(ref.S + lse)},
                "scale_on_difference": {"P": torch.exp((raw - lse) * case.scale_value).masked_fill(hidden, 0.0)},
                "exp2_lse": {"P": torch.exp2(ref.S * 1.4426950408889634 - lse)},
                **_transposed_scores(case, raw * s, lse, hidden),
                "p_sign": {"P": torch.exp(lse - ref.S)},
                "p_sign:masked": {"P": torch.exp(lse - ref.S).masked_fill(hidden, 0.0)},
                "log_p": {"P": ref.S - lse},
                "log_p:masked": {"P": (ref.S - lse).masked_fill(hidden, 0.0)},
                "exp_minus_lse:unmasked": {"P": torch.exp(ref.S) - lse},
                "exp_minus_lse:masked": {"P": (torch.exp(ref.S) - lse).masked_fill(hidden, 0.0)},
                # exp(S) - exp(LSE): the quotient exp(S) / exp(LSE) written as a difference
                "exp_difference": {"P": torch.exp(ref.S) - torch.exp(lse)},
                "exp_difference:masked": {"P": (torch.exp(ref.S) - torch.exp(lse)).masked_fill(hidden, 0.0)},
                # the row's maximum where the LSE belongs: the numerator of a stable softmax only
                "p_max_not_lse": {"P": torch.exp(ref.S - ref.S.amax(-1, keepdim=True))},
                # the row's maximum subtracted on top of the LSE, which already holds it
                "p_max_and_lse": {"P": torch.exp(ref.S - ref.S.amax(-1, keepdim=True) - lse)},
                **mask_variants(case, x, REBUILD_P)}

    return run_battery("check.rebuild_p", fn, _with_gqa(cases or FORWARD_BATTERY, gqa), run_case,
                       checker=REBUILD_P, dtype=dtype or torch.float32, dtype_given=dtype is not None, seed=seed,
                       with_do=False, variants=variants,
                       raise_on_fail=raise_on_fail, show=show)


def _transposed_scores(case, S, lse, hidden) -> dict:
    """P rebuilt from S^T = K Q^T (square cases only: elsewhere the shapes refuse)."""
    if case.S_q != case.S_k:
        return {}
    St = S.transpose(-1, -2)
    return {"scores_transposed": {"P": torch.exp(St.masked_fill(hidden, float("-inf")) - lse)}}


def _online_cases(cases):
    out = [replace(c, block_n=16) for c in cases]
    # the same shapes in one block: rescaling never happens there
    out += [replace(c, name=c.name + ", one block", block_n=c.S_k) for c in cases[:2]]
    return tuple(out)


def online_softmax(fn, *, dtype: Optional[torch.dtype] = None, gqa: bool = False,
                   cases: Optional[Sequence[Case]] = None, seed: int = 0,
                   raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check a forward written with the online softmax, block by block over the keys.

    ``fn(q, k, v, causal, scale, block_n) -> (o, lse)``: o like q, lse ``[B, H, S_q]`` the
    natural-log log-sum-exp of each row of S = Q K^T * scale. ``block_n`` is the number of keys
    per block (16, or all keys at once for the "one block" cases).
    """
    def run_case(case, x):
        out = fn(x.q, x.k, x.v, case.causal, case.scale_value, case.block_n)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ShapeError(f"fn must return a tuple (o, lse), got {type(out).__name__}")
        o, lse = out
        return ({"O": o, "LSE": lse}, {"O": x.ref.O, "LSE": x.ref.LSE},
                {"dtypes": {"O": x.q.dtype, "LSE": runtime.stats_dtype(x.q.dtype)}})

    return run_battery("check.online_softmax", fn, _online_cases(_with_gqa(cases or FORWARD_BATTERY, gqa)),
                       run_case, checker=ONLINE, dtype=dtype or torch.float32, dtype_given=dtype is not None,
                       seed=seed, with_do=False, variants=online_variants,
                       raise_on_fail=raise_on_fail, show=show)


def _check_language(kernel_language: str) -> str:
    if kernel_language not in ("triton", "cuda"):
        raise ValueError(f"kernel_language must be 'triton' or 'cuda', got {kernel_language!r}")
    return kernel_language


def _handed(x, **outputs) -> dict:
    """The tensors a kernel launcher is handed, by the names the lessons give them."""
    return {"Q": x.q, "K": x.k, "V": x.v, "dO": x.do, "LSE": x.lse, "delta": x.delta, **outputs}


def dq_kernel(launch, *, dtype: Optional[torch.dtype] = None, gqa: bool = False,
              cases: Optional[Sequence[Case]] = None, seed: int = 0,
              raise_on_fail: bool = True, show: bool = True,
              kernel_language: str = "triton") -> CheckResult:
    """Check a dQ kernel through its launcher.

    ``launch(q, k, v, do, lse, delta, dq, causal, scale) -> None`` must launch your kernel and
    write dQ into ``dq`` (allocated here, ``[B, H, S_q, D]`` like q, filled with a marked NaN so
    that unwritten elements show; in one case a non-contiguous view, written through its
    strides). ``lse`` and ``delta`` ``[B, H, S_q]`` are the forward's LSE and rowsum(dO * O) in
    fp32; every tensor may be non-contiguous (dO even of stride 0), so pass each one's own
    ``.stride()``. Inputs are fp32 in the interpreter, fp16 on a GPU.
    ``kernel_language="cuda"`` for a launcher of a CUDA C++ kernel (the check that a kernel
    ran then looks for CUDA kernels instead of Triton ones).
    """
    language = _check_language(kernel_language)

    def run_case(case, x):
        out = Output(x.q.shape, x.q.dtype, x.q.device, case.out_layout)
        record: list = []
        n = launched(launch, language, x.q, x.k, x.v, x.do, x.lse, x.delta, out.tensor, case.causal,
                     case.scale_value, record=record, names=_handed(x, dQ=out.tensor))
        return ({"dQ": out.tensor.clone()}, {"dQ": x.ref.dQ},
                {"guard_touched": {"dQ": out.guard_touched()}, "launches": n, "launch_args": record})

    return run_battery("check.dq_kernel", launch, _with_gqa(cases or KERNEL_BATTERY, gqa), run_case,
                       checker=DQ, dtype=dtype or _default_kernel_dtype(), dtype_given=dtype is not None, seed=seed, with_do=True,
                       variants=_variants(DQ), role="your launcher", raise_on_fail=raise_on_fail,
                       show=show, precheck=lambda: kernel_not_written(launch))


def dkdv_kernel(launch, *, dtype: Optional[torch.dtype] = None, gqa: bool = False,
                cases: Optional[Sequence[Case]] = None, seed: int = 0,
                raise_on_fail: bool = True, show: bool = True,
                kernel_language: str = "triton") -> CheckResult:
    """Check a dK/dV kernel through its launcher.

    ``launch(q, k, v, do, lse, delta, dk, dv, causal, scale) -> None`` must launch your kernel
    and write dK and dV into ``dk`` and ``dv`` (allocated here like k and v, filled with a
    marked NaN). Same inputs as :func:`dq_kernel`. Two cases run twice and must give the same
    bits: accumulate in registers, not into global memory from several programs.
    """
    language = _check_language(kernel_language)

    def run_case(case, x):
        dk = Output(x.k.shape, x.k.dtype, x.k.device)
        dv = Output(x.v.shape, x.v.dtype, x.v.device, case.out_layout)
        record: list = []
        n = launched(launch, language, x.q, x.k, x.v, x.do, x.lse, x.delta, dk.tensor, dv.tensor,
                     case.causal, case.scale_value, record=record,
                     names=_handed(x, dK=dk.tensor, dV=dv.tensor))
        return ({"dK": dk.tensor.clone(), "dV": dv.tensor.clone()}, {"dK": x.ref.dK, "dV": x.ref.dV},
                {"guard_touched": {"dK": dk.guard_touched(), "dV": dv.guard_touched()}, "launches": n,
                 "launch_args": record})

    return run_battery("check.dkdv_kernel", launch, _with_gqa(cases or KERNEL_BATTERY, gqa), run_case,
                       checker=DKDV, dtype=dtype or _default_kernel_dtype(), dtype_given=dtype is not None, seed=seed, with_do=True,
                       variants=_variants(DKDV), role="your launcher", raise_on_fail=raise_on_fail,
                       show=show, precheck=lambda: kernel_not_written(launch))


_GRAD_COUNT_HELP = ("backward must return one value per input of forward(ctx, q, k, v, causal, "
                    "scale): (dq, dk, dv, None, None) -- None for the non-tensor arguments.")
_BAD_GRAD = re.compile(r"invalid gradient at index (\d+) - got \[([\d, ]*)\] but expected shape "
                       r"compatible with \[([\d, ]*)\]")


def autograd_function(fn, *, dtype: Optional[torch.dtype] = None, gqa: bool = True,
                      cases: Optional[Sequence[Case]] = None, seed: int = 0,
                      raise_on_fail: bool = True, show: bool = True) -> CheckResult:
    """Check attention wired into autograd, forward and backward.

    ``fn(q, k, v, causal=..., scale=...) -> o`` (typically ``MyFunction.apply(q, k, v, causal,
    scale)``). The checker makes q, k, v leaves that require grad (in one case only q does),
    runs ``fn`` and ``torch.autograd.grad`` with a dO that may be strided, or calls
    ``o.sum().backward()`` (autograd then hands backward a dO of stride 0), and compares O,
    dQ, dK, dV with the float64 reference. One case passes ``scale=None`` (like SDPA: the
    default 1/sqrt(D)); the others a float. ``gqa``: three cases more where K and V have fewer
    heads than Q (the package's kernels take them as they are).
    """
    names = {"q": "dQ", "k": "dK", "v": "dV"}

    def run_case(case, x):
        leaves = {n: t.detach().requires_grad_(n in case.requires) for n, t in (("q", x.q), ("k", x.k), ("v", x.v))}
        scale = None if case.scale_none else case.scale_value
        o = fn(leaves["q"], leaves["k"], leaves["v"], causal=case.causal, scale=scale)
        if not isinstance(o, torch.Tensor):
            raise ShapeError(f"fn must return the output tensor, got {type(o).__name__}")
        wanted = [n for n in "qkv" if n in case.requires]
        try:
            with count_triton_launches() as backward_launches:
                if case.do_layout == "sum":
                    for n in wanted:
                        leaves[n].grad = None
                    o.sum().backward()
                    grads = [leaves[n].grad for n in wanted]
                else:
                    grads = torch.autograd.grad(o, [leaves[n] for n in wanted], x.do, allow_unused=True)
        except RuntimeError as e:
            if "incorrect number of gradients" in str(e):
                raise RuntimeError(f"{e}. {_GRAD_COUNT_HELP}") from None
            m = _BAD_GRAD.search(str(e))
            if m:
                got = tuple(int(s) for s in m.group(2).split(",") if s.strip())
                index = int(m.group(1))
                other = next((names[n] for n in "qkv" if tuple(leaves[n].shape) == got), None)
                H, H_kv = leaves["q"].shape[1], leaves["k"].shape[1]
                if index in (1, 2) and H != H_kv and len(got) == 4 and got[1] == H and \
                        got[2:] == tuple(leaves["k"].shape[2:]):     # one K/V gradient per *query* head
                    n = names["qkv"[index]]
                    idea = (f"{n} was computed for K and V expanded to one head per query head (repeat_interleave "
                            f"in forward, saved and handed to the kernels) or not summed over each group of "
                            f"{H // H_kv} query heads. The kernels take K and V with their own H_kv heads and return "
                            f"dK, dV that way: pass k and v on unchanged.")
                    raise ShapeError(f"{n} came back with {H} heads where {n[1:].lower()} has {H_kv} (GQA): {idea}",
                                     idea=idea) from None
                if other is not None and index < 3:
                    raise _Swapped(names["qkv"[index]], other) from None
            raise
        outs = {"O": o.detach()}
        refs = {"O": x.ref.O, "dQ": x.ref.dQ, "dK": x.ref.dK, "dV": x.ref.dV}
        missing = [n for n, g in zip(wanted, grads) if g is None]
        if missing:
            e = NoGradient(f"no gradient reached {', '.join(missing)}: backward returned None for "
                           f"{'it' if len(missing) == 1 else 'them'}")
            e.missing = missing
            raise e
        outs.update({names[n]: g for n, g in zip(wanted, grads)})
        if backward_launches[0] == 0:
            raise NoBackwardKernel("the backward launched no Triton kernel")
        node = o.grad_fn       # a custom Function's node is its ctx: attributes set on ctx live there
        kept = [n for n, t in vars(node).items() if isinstance(t, torch.Tensor)] if hasattr(node, "__dict__") else []
        if kept:
            raise CtxTensors(kept)
        return outs, refs, {}

    if cases is None:
        cases = AUTOGRAD_BATTERY
        if dtype is None and _default_kernel_dtype() != torch.float32:
            cases += (AUTOGRAD_FLOAT32_CASE,)
    return run_battery("check.autograd_function", fn, _with_gqa(cases, gqa),
                       run_case, checker=AUTOGRAD, dtype=dtype or _default_kernel_dtype(), dtype_given=dtype is not None, seed=seed,
                       with_do=True, variants=_variants(AUTOGRAD), raise_on_fail=raise_on_fail,
                       show=show)


def orders() -> dict:
    """checker name -> the ids of the mistakes it tries, first to last (checkers.py's tables)."""
    return {c.name: list(c.order) for c in EVERY}


class _Swapped(ShapeError):
    """autograd refused a gradient that has another input's shape: the order is wrong."""

    def __init__(self, got: str, wanted: str):
        super().__init__(f"the gradient returned for {got[1:].lower()} has {wanted[1:].lower()}'s shape")
        self.pair = (got, wanted)
