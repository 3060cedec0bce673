"""Running one problem of each kernel family, and its float64 oracle.

Every family returns an :class:`Outcome`: the kernels' outputs and gradients; the float64
reference of each (autograd through a materialised formula, one head at a time so that a
9,000 x 9,000 score matrix fits); the floor, the error of a plain implementation in the
problem's own dtype on the same inputs (PyTorch's SDPA where it computes the same function),
row by row; and for O, dQ, dK and dV the size of the terms that add up to each row, which bounds
what rounding alone can do where those terms cancel. :func:`battery.judge` reads them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import runtime
from ..beyond.kernels import dropout_mask
from ..beyond.reference import attention_reference, varlen_reference, window_mask
from .problems import Problem

GRADS = ("dQ", "dK", "dV")
#: the outputs whose terms' sizes are counted (term_sizes), and which of them have a row per query
SIZED = ("O", "dQ", "dK", "dV")
PER_QUERY = ("O", "dQ")


@dataclasses.dataclass
class Outcome:
    got: dict                               # name -> the kernels' tensor
    ref: dict                               # name -> float64 reference
    floor: dict = dataclasses.field(default_factory=dict)   # name -> SDPA's error per row (a norm)
    size: dict = dataclasses.field(default_factory=dict)    # name -> the terms' size per row
    per_head_param: tuple = ()              # names shaped [H, ...] (lazy attention's parameters): per head
    dtype: Optional[torch.dtype] = None     # the precision to judge by (default: the problem's)
    logits: float = 1.0                     # a bound on |S| = |q.k| * scale: large logits amplify rounding
    kink: dict = dataclasses.field(default_factory=dict)    # name -> what flipped ReLU gates may move
    #                                                         (per row; per head for the parameters)


#: where a row's terms cancel to ~0, the error allowed is this many units of the products' rounding
#: times the size of the terms that make them up, in quadrature (families.term_sizes)
ROUNDING_UNITS = 4.0
#: the rounding unit of the kernels' products: half precision's epsilon; for fp32 inputs the
#: coarsest default GPU products (tf32x3: three TF32 products, about 1e-6 relative error each)
PRODUCT_UNIT = {torch.float16: torch.finfo(torch.float16).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps,
                torch.float32: 1e-6, torch.float64: 1e-15}
#: the rounding unit of S = Q K^T: fp32 accumulation of exact products for fp16/bf16 inputs, the
#: split products' (tf32x3, bf16x6) for fp32 ones
SCORE_UNIT = {torch.float16: 2.0 ** -23, torch.bfloat16: 2.0 ** -23, torch.float32: 1e-6, torch.float64: 1e-15}
#: float32's epsilon: P = exp(S - LSE) and the shift tau/(i+1) are computed in fp32 by the kernels
F32_EPS = torch.finfo(torch.float32).eps


def logit_bound(q, k, scale: Optional[float]) -> float:
    """max_i |q_i| * max_j |k_j| * scale >= every |S_ij|: P = exp(S - LSE) carries S's absolute
    rounding as its relative error, so large logits amplify the products' rounding that much."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return max(1.0, float(q.detach().double().norm(dim=-1).max() * k.detach().double().norm(dim=-1).max() * scale))


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """The norm of every row of a ``[B, H, S, D]`` tensor: ``[B, H, S]``, in float64."""
    return x.detach().double().norm(dim=-1)


def head_norms(x: torch.Tensor, head_dims: int = 2) -> torch.Tensor:
    """The Frobenius norm of every head: ``[B, H]`` (``head_dims=1``: ``[H]``), in float64."""
    x = x.detach().double()
    return x.reshape(*x.shape[:head_dims], -1).norm(dim=-1)


# --------------------------------------------------------------------------------------
# the float64 oracle, one query head at a time
# --------------------------------------------------------------------------------------
def _leaves(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def per_head_reference(p: Problem, q, k, v, do, keep_for: Optional[Callable] = None,
                       computed_in: Optional[torch.dtype] = None) -> tuple[dict, dict]:
    """O, dQ, dK, dV in float64 by autograd through ``beyond.reference.attention_reference``
    (causal, window, dropout with the kernels' own mask from ``keep_for(b, h)``), one (batch,
    query head) at a time; dK and dV summed over each GQA group. Also returns, per row of O,
    dQ, dK and dV, the size of the terms that make it up (:func:`term_sizes`; ``computed_in``: the
    dtype the kernels computed in, where not the inputs', as under autocast)."""
    B, H, S_q, D = q.shape
    group = H // k.shape[1]
    f64 = dict(dtype=torch.float64, device=q.device)
    out = {"O": torch.empty(q.shape, **f64), "dQ": torch.empty(q.shape, **f64),
           "dK": torch.zeros(k.shape, **f64), "dV": torch.zeros(k.shape, **f64)}
    size = {n: torch.zeros((q if n in PER_QUERY else k).shape[:3], **f64) for n in SIZED}
    for b in range(B):
        for h in range(H):
            g = h // group
            qh, kh, vh = _leaves(q[b:b + 1, h:h + 1], k[b:b + 1, g:g + 1], v[b:b + 1, g:g + 1])
            doh = do[b:b + 1, h:h + 1].double()
            keep = keep_for(b, h)[None, None] if keep_for is not None else None
            o, lse = attention_reference(qh, kh, vh, p.causal, p.scale, p.window, keep, p.dropout_p)
            dq, dk, dv = torch.autograd.grad(o, (qh, kh, vh), doh)
            out["O"][b, h], out["dQ"][b, h] = o[0, 0].detach(), dq[0, 0]
            out["dK"][b, g] += dk[0, 0]
            out["dV"][b, g] += dv[0, 0]
            sizes = term_sizes(p, qh.detach(), kh.detach(), vh.detach(), doh, o.detach(), lse, keep, computed_in)
            _add_head_sizes(size, sizes, (b, h), (b, g))
    return out, _group_norms(size)


def _add_head_sizes(size: dict, sizes: dict, query_rows: tuple, key_rows: tuple) -> None:
    """One query head's :func:`term_sizes` into the whole problem's: rows of O and dQ as they are
    (at ``query_rows``), rows of dK and dV summed in squares over the GQA group (at ``key_rows``:
    a group's heads add up, their rounding too; :func:`_group_norms` takes the root)."""
    for n in SIZED:
        if n in PER_QUERY:
            size[n][query_rows] = sizes[n]
        else:
            size[n][key_rows] += sizes[n] ** 2


def _group_norms(size: dict) -> dict:
    return {n: s if n in PER_QUERY else s.sqrt() for n, s in size.items()}


@torch.no_grad()
def term_sizes(p: Problem, q, k, v, do, o, lse, keep=None,
               computed_in: Optional[torch.dtype] = None) -> dict:
    """How large the terms are that add up to each row of O, dQ, dK and dV of one head (float64
    ``[1, 1, S, D]`` inputs; returns ``{"O": [S_q], "dQ": [S_q], "dK": [S_k], "dV": [S_k]}``), in
    units of the rounding of one term: where the terms cancel the result is 0 up to rounding, and
    rounding is all its error can be judged against.

    dQ_i = scale * sum_j dS_ij K_j with dS_ij = P_ij (dP_ij - delta_i) (a row that sees one key has
    dS = 0 exactly). Each dS_ij rounds on its own, so the sizes add in quadrature: scale *
    sqrt(sum_j (P_ij (|dP_ij| + |delta_i|))^2 |K_j|^2). dP_ij = dO_i . V_j may cancel too: its own
    rounding is counted in (:func:`dp_rounding`, at the unit of ``computed_in``, default the
    problem's dtype). delta_i = dO_i . O_i is read from the stored O: its error, common to a whole
    row of dQ, adds scale * err(delta_i) * |(P K)_i|; in dK, each row's delta error is a term of its
    own. O_i = sum_j P~_ij V_j and dV_j = sum_i P~_ij dO_i (P~ = P with the dropout mask and its
    1/(1-p)) round P~ before the product: their terms are P~_ij |V_j| and P~_ij |dO_i|.

    Near 0, fp16 rounds on its fixed subnormal grid, not relative to the value
    (:func:`rounding_magnitude`): dS, P~ (the fast kernels round P * mask and divide by 1 - p
    after), the stored O and the forward's P~ V that delta reads (seed 12, problems 436 and 586 on
    an H200: an O of 7e-6 whose dominant key was dropped). Where every value is a normal number
    those extras are 0."""
    dtype = computed_in or p.torch_dtype
    scale = q.shape[-1] ** -0.5 if p.scale is None else p.scale
    visible = window_mask(q.shape[2], k.shape[2], p.causal, p.window, q.device)
    s = q @ k.transpose(-1, -2) * scale
    P = torch.where(visible & torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
    dp = (do @ v.transpose(-1, -2)).abs() + dp_rounding(dtype, do, v)
    kept, kept_rounding = P, rounding_magnitude(P, dtype)         # P~, and what its rounding is relative to
    if keep is not None:
        dp = dp * keep / (1.0 - p.dropout_p)
        kept = P * keep / (1.0 - p.dropout_p)
        kept_rounding = rounding_magnitude(P * keep, dtype) / (1.0 - p.dropout_p)
    delta_size = (do * o).abs().sum(-1, keepdim=True)
    # delta's error: O's relative rounding, and on the subnormal grid O's storage and the forward's P~
    o_abs = o.abs()
    stored = ((do * (rounding_magnitude(o_abs, dtype) - o_abs)) ** 2).sum(-1, keepdim=True).sqrt()
    forward = do.norm(dim=-1, keepdim=True) * (((kept_rounding - kept) ** 2) @ (v * v)).sum(-1, keepdim=True).sqrt()
    delta_error = delta_size + stored + forward
    ds_terms = rounding_magnitude(P * (dp + delta_size), dtype)
    rows_dq = ((ds_terms ** 2) @ (k * k)).sum(-1).sqrt() + delta_error[..., 0] * (P @ k).norm(dim=-1)
    rows_dk = (((ds_terms + P * (delta_error - delta_size)) ** 2).transpose(-1, -2) @ (q * q)).sum(-1).sqrt()
    rows_o = ((kept_rounding ** 2) @ (v * v)).sum(-1).sqrt()
    rows_dv = ((kept_rounding ** 2).transpose(-1, -2) @ (do * do)).sum(-1).sqrt()
    return {"O": rows_o[0, 0], "dQ": scale * rows_dq[0, 0], "dK": scale * rows_dk[0, 0], "dV": rows_dv[0, 0]}


def rounding_magnitude(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What rounding ``t >= 0`` to ``dtype`` is relative to, in units of half its epsilon: ``t``
    itself above the smallest normal number (``tiny``); below it, the fixed subnormal spacing
    eps * tiny, whose half may be lost (fp16: 3e-8, relative error 3% at 1e-6) -- though never more
    than ``t`` itself, which is what rounding to 0 loses. So the rounding error is at most
    eps / 2 times max(t, min(tiny, 2 t / eps)); for bf16 and fp32 the floor lies below 1e-38."""
    info = torch.finfo(dtype)
    return torch.maximum(t, torch.clamp(t * (2.0 / info.eps), max=info.tiny))


def dp_rounding(dtype: torch.dtype, do: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The size of dP = dO V^T's own rounding, in units of the products' (``PRODUCT_UNIT``): dP is
    accumulated at S's unit (``SCORE_UNIT``) over the terms dO_id V_jd, which round on their own
    and so add in quadrature: sqrt(sum_d (dO_id V_jd)^2). Where dO_i . V_j cancels (seed 7, problem
    99 on an H200: dA = 7.7e-5 from terms of size ~1, fp32) that rounding is all dS has. For
    fp16/bf16 inputs (exact products, fp32 sums) it is ~1e-4 of the terms' size; for fp32 all of it."""
    return (SCORE_UNIT[dtype] / PRODUCT_UNIT[dtype]) * ((do * do) @ (v * v).transpose(-1, -2)).sqrt()


def _dense_keep(p: Problem, H: int, device) -> Optional[Callable]:
    if not p.dropout_p:
        return None
    seed = dropout_seed(p)
    return lambda b, h: dropout_mask(seed, 1, p.S_q, p.S_k, p.dropout_p, device, first_seq_head=b * H + h)[0]


def dropout_seed(p: Problem) -> int:
    return (p.seed * 7919 + p.index) % (2 ** 31 - 1)


# --------------------------------------------------------------------------------------
# the floor: SDPA in the problem's dtype, where it computes the same function
# --------------------------------------------------------------------------------------
def sdpa_floor(p: Problem, q, k, v, do, ref: dict) -> dict:
    """SDPA's error per row and tensor on these very inputs (the window as a boolean mask; a
    window that leaves a row with no key has no SDPA twin: no floor then)."""
    from ..verify import grads

    mask = None
    if p.window is not None:
        mask = window_mask(p.S_q, p.S_k, p.causal, p.window, q.device)
        if not bool(mask.any(dim=1).all()):
            return {}
    group = q.shape[1] // k.shape[1]

    def sdpa(q_, k_, v_):
        with torch.autocast(q.device.type, enabled=False):
            return F.scaled_dot_product_attention(q_, k_.repeat_interleave(group, dim=1),
                                                  v_.repeat_interleave(group, dim=1), attn_mask=mask,
                                                  is_causal=p.causal and mask is None, scale=p.scale)

    o, (dq, dk, dv) = grads(sdpa, q, k, v, do)
    got = {"O": o, "dQ": dq, "dK": dk, "dV": dv}
    return {n: row_norms(got[n].double() - ref[n]) for n in got}


# --------------------------------------------------------------------------------------
# the families
# --------------------------------------------------------------------------------------
def kernel_grads(fn, q, k, v, do) -> dict:
    """O, dQ, dK, dV of ``fn(q, k, v)`` on leaves that keep the inputs' strides and storage (a
    clone, as ``verify.grads`` makes, would hand the kernels contiguous copies of odd layouts)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    o.backward(do)
    return {"O": o.detach(), "dQ": leaves[0].grad, "dK": leaves[1].grad, "dV": leaves[2].grad}


def _dense(p: Problem, t: dict, fn) -> Outcome:
    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    got = kernel_grads(fn, q, k, v, do)
    ref, size = per_head_reference(p, q, k, v, do, _dense_keep(p, q.shape[1], q.device))
    plain = dataclasses.replace(p, dropout_p=0.0)     # SDPA has no twin of the kernels' mask:
    floor = sdpa_floor(plain, q, k, v, do,              # its error without dropout stands in
                       ref if not p.dropout_p else per_head_reference(plain, q, k, v, do)[0])
    return Outcome(got, ref, floor, size, logits=logit_bound(q, k, p.scale))


def run_lesson(p: Problem, t: dict) -> Outcome:
    from ..api import flash_attention
    return _dense(p, t, lambda q, k, v: flash_attention(q, k, v, causal=p.causal, scale=p.scale, impl="teaching"))


def run_fast(p: Problem, t: dict) -> Outcome:
    from ..api import flash_attention
    return _dense(p, t, lambda q, k, v: flash_attention(q, k, v, causal=p.causal, scale=p.scale, impl="fast"))


def run_fp32(p: Problem, t: dict) -> Outcome:
    """fp32 on the fast path: by default the fused backward on bf16 pieces; the "deterministic"
    variant under ``torch.use_deterministic_algorithms`` (the two-kernel backward)."""
    from ..api import flash_attention

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(p.variant == "deterministic", warn_only=True)
    try:
        return _dense(p, t, lambda q, k, v: flash_attention(q, k, v, causal=p.causal, scale=p.scale, impl="fast"))
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def run_window(p: Problem, t: dict) -> Outcome:
    """Lesson 09's dense entry point, with the variant's kernels ("teaching" or "fast")."""
    from ..beyond import flash_attention
    return _dense(p, t, lambda q, k, v: flash_attention(q, k, v, causal=p.causal, scale=p.scale, window=p.window,
                                                        dropout_p=p.dropout_p, seed=dropout_seed(p), impl=p.variant))


run_dropout = run_window


def run_varlen(p: Problem, t: dict) -> Outcome:
    from ..beyond import flash_attention_varlen

    q, k, v, do = (x[0].permute(1, 0, 2) for x in (t["q"], t["k"], t["v"], t["do"]))   # [total, H, D]
    lens_q, lens_k = p.seqlens
    starts_q, starts_k = [0, *itertools.accumulate(lens_q)], [0, *itertools.accumulate(lens_k)]
    cu_q = torch.tensor(starts_q, dtype=torch.int32, device=q.device)
    cu_k = torch.tensor(starts_k, dtype=torch.int32, device=q.device)
    seed = dropout_seed(p)
    got = kernel_grads(lambda q_, k_, v_: flash_attention_varlen(
        q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k), causal=p.causal, scale=p.scale, window=p.window,
        dropout_p=p.dropout_p, seed=seed, impl=p.variant), q, k, v, do)
    qd, kd, vd = _leaves(q, k, v)
    o, lse = varlen_reference(qd, kd, vd, cu_q, cu_k, p.causal, p.scale, p.window, p.dropout_p, seed,
                              return_lse=True)
    ref = dict(zip(("O",) + GRADS, (o.detach(),) + torch.autograd.grad(o, (qd, kd, vd), do.double())))
    # the terms' sizes, sequence by sequence ([1, 1, S, D] slices of one head), row by row
    H, group = q.shape[1], q.shape[1] // k.shape[1]
    rows_of = {"O": q, "dQ": q, "dK": k, "dV": k}
    size = {n: torch.zeros(1, rows_of[n].shape[1], rows_of[n].shape[0], dtype=torch.float64, device=q.device)
            for n in SIZED}
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        rows, keys = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        for h in range(H):
            def one(x, s, head):
                return x[s, head].double()[None, None]
            keep = None if not p.dropout_p else dropout_mask(
                seed, 1, sq, sk, p.dropout_p, q.device, first_seq_head=b * H + h)[0][None, None]
            sizes = term_sizes(dataclasses.replace(p, S_q=sq, S_k=sk), one(q, rows, h),
                               one(k, keys, h // group), one(v, keys, h // group), one(do, rows, h),
                               o.detach()[rows, h][None, None], lse[rows, h][None, None], keep)
            _add_head_sizes(size, sizes, (0, h, rows), (0, h // group, keys))
    size = _group_norms(size)
    floor = {} if p.dropout_p else varlen_floor(p, q, k, v, do, ref, zip(lens_q, lens_k, starts_q, starts_k))
    as4 = {n: x.permute(1, 0, 2)[None] for n, x in got.items()}      # [1, H, total, D], as judged
    return Outcome(as4, {n: x.permute(1, 0, 2)[None] for n, x in ref.items()}, floor, size=size,
                   logits=logit_bound(q, k, p.scale))


def varlen_floor(p: Problem, q, k, v, do, ref: dict, sequences) -> dict:
    """SDPA's error per row on a packed batch: each sequence as the dense problem it is
    (``[1, H, s, D]``), laid out as the packed rows are judged (``[1, H, total]``). Empty where a
    sequence has no SDPA twin (rows that see no key). ``sequences``: (s_q, s_k, start_q, start_k)."""
    rows_of = {"O": q, "dQ": q, "dK": k, "dV": k}
    floor = {n: torch.zeros(1, t.shape[1], t.shape[0], dtype=torch.float64, device=q.device) for n, t in rows_of.items()}

    def dense(x, start, length):
        return x[start:start + length].permute(1, 0, 2)[None]

    for sq, sk, a_q, a_k in sequences:
        if sq == 0:
            continue
        if sk == 0:
            return {}
        span = {n: (a_q, sq) if t is q else (a_k, sk) for n, t in rows_of.items()}    # each output's rows
        part = sdpa_floor(dataclasses.replace(p, S_q=sq, S_k=sk), dense(q, a_q, sq), dense(k, a_k, sk),
                          dense(v, a_k, sk), dense(do, a_q, sq), {n: dense(ref[n], *span[n]) for n in rows_of})
        if not part:
            return {}
        for n, rows in part.items():
            start, length = span[n]
            floor[n][..., start:start + length] = rows
    return floor


def run_lazy(p: Problem, t: dict) -> Outcome:
    from ..lazy import lazy_attention
    from ..lazy.reference import lazy_gradients_per_batch

    q, k, v, do, bias, tau = (t[n] for n in ("q", "k", "v", "do", "bias", "tau"))
    leaves = [x.detach().requires_grad_() for x in (q, k, v, bias, tau)]     # the inputs' own strides
    o = lazy_attention(*leaves, scale=p.scale)
    o.backward(do)
    got = dict(zip(("O", "dQ", "dK", "dV", "dBias", "dTau"), [o.detach()] + [x.grad for x in leaves]))
    ref = lazy_gradients_per_batch(q, k, v, bias, tau, do, scale=p.scale)
    # The floor: the same formula in the problem's dtype (there is no SDPA for it).
    floor = {}
    if q.dtype != torch.float32:
        low = lazy_gradients_per_batch(q, k, v, bias, tau, do, scale=p.scale, dtype=q.dtype)
        floor = {n: (head_norms(low[n].double() - ref[n], 1) if n in ("dBias", "dTau")
                     else row_norms(low[n].double() - ref[n])) for n in got}
    size, kink = lazy_term_sizes(q, k, v, bias, tau, do, p.scale)
    return Outcome(got, ref, floor, size, per_head_param=("dBias", "dTau"),
                   logits=logit_bound(q, k, p.scale) + float(bias.abs().max()), kink=kink)


@torch.no_grad()
def lazy_term_sizes(q, k, v, bias, tau, do, scale) -> tuple[dict, dict]:
    """(sizes, kink): :func:`term_sizes` for lazy attention, whose dS = P (dP - delta) has
    dP = dO V^T where the ReLU lets A through; per batch element, every head at once.
    dTau = sum_i rowsum(dP_i) / (i+1) and dBias[h, d] = the sum of dS along diagonal d add up
    many terms of both signs (and a gate that flips on a last bit moves a whole term): their
    sizes are those terms' in quadrature.

    ``kink``, per row of dQ and of dK: where P + tau/(i+1) lies within rounding of 0 (S's
    rounding carried into P, and fp32's own), the gate is a coin toss for any finite precision,
    and flipping it moves dP_ij by dA_ij: dQ_i by scale * P_ij |dA_ij| (|k_j| + |sum_l P_il k_l|)
    (the term and its share of delta), dK_j likewise, dTau by dA_ij / (i+1), dBias by up to
    2 P_ij |dA_ij|. Those are allowed on top, twice over (rows and heads with no gate near its
    kink get 0). On H200s, two problems of seed 3 (dQ, dK) and one of seed 5 (dTau) met such gates."""
    from ..lazy.reference import diagonal_sums, lazy_attention_reference

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    W, L = bias.shape[1] - 1, q.shape[2]
    i = torch.arange(L, device=q.device)
    sizes = {"dQ": [], "dK": [], "dTau": 0.0, "dBias": 0.0}
    kink = {"dQ": [], "dK": [], "dTau": 0.0, "dBias": 0.0}
    unit = SCORE_UNIT[q.dtype]
    for b in range(q.shape[0]):
        qb, kb, vb, dob = (x[b:b + 1].double() for x in (q, k, v, do))
        parts = lazy_attention_reference(qb, kb, vb, bias, tau, scale=scale, return_parts=True)
        shift = tau.double()[:, None, None] / (i + 1).double()[:, None]
        causal = i[None, :] <= i[:, None]
        gate = (parts.P + shift > 0) & causal
        da = dob @ vb.transpose(-1, -2)
        dp = torch.where(gate, da, 0.0)
        # the gates on their kink, and what flipping each would move
        s_err = unit * (qb.abs() @ kb.abs().transpose(-1, -2)) * scale       # S's rounding, bounded
        margin = ROUNDING_UNITS * (parts.P * s_err + F32_EPS * (parts.P + shift.abs()))
        near = causal & ((parts.P + shift).abs() <= margin)
        moved = 2.0 * torch.where(near, parts.P * da.abs(), 0.0)            # twice what a flip moves: headroom
        q_norm, k_norm = qb.norm(dim=-1), kb.norm(dim=-1)
        mixed_k = (parts.P @ kb).norm(dim=-1)                                # |sum_l P_il k_l|
        kink["dQ"].append(scale * (moved * (k_norm[..., None, :] + mixed_k[..., :, None])).sum(-1))
        kink["dK"].append(scale * ((moved * q_norm[..., :, None]).sum(-2)
                                   + (parts.P * (moved.sum(-1) * q_norm)[..., :, None]).sum(-2)))
        # dTau moves by the flipped dA_ij / (i+1); dBias by P_ij dA_ij on its diagonal plus the
        # row's delta spread over the row (at most as much again)
        kink["dTau"] = kink["dTau"] + 2.0 * torch.where(near, da.abs() / (i + 1).double()[:, None], 0.0).sum((-1, -2))[0]
        kink["dBias"] = kink["dBias"] + 2.0 * moved.sum((-1, -2))[0]
        rounding = torch.where(gate, dp_rounding(q.dtype, dob, vb), 0.0)     # dP's own (dp_rounding)
        delta = (parts.P * dp).sum(-1, keepdim=True).abs() + (parts.P * rounding).sum(-1, keepdim=True)
        t2 = (parts.P * (dp.abs() + rounding + delta)) ** 2
        sizes["dQ"].append(scale * (t2 @ (kb * kb)).sum(-1).sqrt())
        sizes["dK"].append(scale * (t2.transpose(-1, -2) @ (qb * qb)).sum(-1).sqrt())
        sizes["dTau"] = sizes["dTau"] + ((dp / (i + 1).double()[:, None]) ** 2).sum((-1, -2))[0]
        sizes["dBias"] = sizes["dBias"] + diagonal_sums(t2[0], min(W, L - 1)).sum(-1)
    return ({"dQ": torch.cat(sizes["dQ"]), "dK": torch.cat(sizes["dK"]), "dTau": sizes["dTau"].sqrt(),
             "dBias": torch.as_tensor(sizes["dBias"]).sqrt()},
            {"dQ": torch.cat(kink["dQ"]), "dK": torch.cat(kink["dK"]), "dTau": torch.as_tensor(kink["dTau"]),
             "dBias": torch.as_tensor(kink["dBias"])})


def run_sdpa(p: Problem, t: dict) -> Outcome:
    """The drop-in, as a model calls it: the variant names the rank (3-D, 4-D or 5-D tensors)
    and "+autocast" (fp32 inputs under bf16 autocast, on a GPU); ``enable_gqa`` where H != H_kv."""
    from ..api import scaled_dot_product_attention

    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    rank = int(p.variant[4])                 # "rank3", "rank4+autocast", ...
    autocast = p.variant.endswith("+autocast")

    def shaped(x):
        return x[0] if rank == 3 else (x if rank == 4 else x[None])

    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def fn(q_, k_, v_):
        with ctx:
            o = scaled_dot_product_attention(shaped(q_), shaped(k_), shaped(v_), is_causal=p.causal,
                                             scale=p.scale, enable_gqa=q.shape[1] != k.shape[1])
        if autocast:
            assert o.dtype == torch.bfloat16, f"under bf16 autocast the drop-in returned {o.dtype}"
        return o.reshape(q_.shape).float() if autocast else o.reshape(q_.shape)

    got = kernel_grads(fn, q, k, v, do)
    ref, size = per_head_reference(p, q, k, v, do, computed_in=torch.bfloat16 if autocast else None)
    if autocast:             # the floor: SDPA itself under the same autocast
        lo = [x.to(torch.bfloat16) for x in (q, k, v, do)]
        return Outcome(got, ref, sdpa_floor(p, *lo, ref), size, dtype=torch.bfloat16,
                       logits=logit_bound(q, k, p.scale))
    return Outcome(got, ref, sdpa_floor(p, q, k, v, do, ref), size, logits=logit_bound(q, k, p.scale))


def run_cuda(p: Problem, t: dict) -> Outcome:
    """Lesson 10's CUDA kernels: forward, delta, then dQ and dK/dV written into guarded outputs."""
    from .. import cuda_appendix

    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    scale = 1.0 / math.sqrt(p.D) if p.scale is None else p.scale
    o, lse = cuda_appendix.forward(q, k, v, p.causal, scale)
    delta = cuda_appendix.build().delta(o, do)
    dq, dk, dv = (runtime.new_output(x.shape, x.dtype, x.device) for x in (q, k, v))
    cuda_appendix.launch_dq(q, k, v, do, lse, delta, dq, p.causal, scale)
    cuda_appendix.launch_dkdv(q, k, v, do, lse, delta, dk, dv, p.causal, scale)
    got = {"O": o, "dQ": dq, "dK": dk, "dV": dv}
    ref, size = per_head_reference(p, q, k, v, do)
    return Outcome(got, ref, sdpa_floor(p, q, k, v, do, ref), size, logits=logit_bound(q, k, scale))


RUNNERS = {"lesson": run_lesson, "fast": run_fast, "fp32": run_fp32, "window": run_window,
           "dropout": run_dropout, "varlen": run_varlen, "lazy": run_lazy, "sdpa": run_sdpa,
           "cuda": run_cuda}


def unavailable(family: str) -> Optional[str]:
    """Why a family cannot run here (None: it can)."""
    if family == "cuda":
        if runtime.INTERPRET:
            return "the CUDA appendix needs a GPU"
        from .. import cuda_appendix
        return cuda_appendix.why_unavailable()
    return None
