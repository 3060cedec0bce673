"""Compare outputs and gradients with SDPA or the float64 reference, head by head.

The measure is the relative error ``||out - ref|| / ||ref||`` (Frobenius norm), computed for
every (batch, head) separately: a bug that breaks only some heads (a stride borrowed from
another tensor, say) cannot hide inside a good average. The verdict passes when the *worst*
head is under a tolerance that depends on the dtype the kernels ran in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from . import runtime
from .reference import attention_reference

#: Largest acceptable relative error of the worst head, by the dtype the kernels ran in.
#: fp16 keeps 11 significant bits (~5e-4 per rounding), bf16 8 bits (~4e-3); a backward chains
#: several roundings (P and dS are rounded to the input dtype before each matrix product).
TOLERANCES = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCES[dtype]


@dataclass
class Comparison:
    """How far one tensor is from its reference."""

    name: str
    max_abs: float
    rel: float                # over the whole tensor
    worst_head: tuple         # (batch, head) with the largest relative error
    worst_rel: float          # that head's relative error
    tol: float
    finite: bool              # False if the output holds NaN or inf (e.g. unwritten, poisoned)

    @property
    def ok(self) -> bool:
        return self.finite and self.worst_rel <= self.tol

    @property
    def verdict(self) -> str:
        if not self.finite:
            return "FAIL (NaN/inf)"
        return "ok" if self.ok else "FAIL"


def per_head_relative_error(actual: torch.Tensor, expected: torch.Tensor, *, head_dims: int = 2,
                            floor: float = 0.0) -> torch.Tensor:
    """Relative error ``||a - e|| / ||e||`` of every head: ``[B, H]`` for tensors shaped
    ``[B, H, ...]``; with ``head_dims=1``, ``[H]`` for per-head parameters shaped ``[H, ...]``
    (or ``[H]``). ``floor`` bounds the denominator from below (a head whose reference is ~0)."""
    a, e = actual.double(), expected.double()
    if a.dim() == head_dims:
        a, e = a.unsqueeze(-1), e.unsqueeze(-1)
    err = (a - e).flatten(head_dims).norm(dim=-1)
    ref = e.flatten(head_dims).norm(dim=-1)
    return err / ref.clamp_min(max(floor, torch.finfo(torch.float64).tiny))


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, *,
            tol: Optional[float] = None, dtype: Optional[torch.dtype] = None,
            floor: float = 0.0) -> Comparison:
    """Compare ``actual`` with ``expected``; ``tol`` defaults to the tolerance of ``dtype``
    (itself defaulting to ``actual.dtype``). ``floor`` bounds each norm of the reference from
    below, for references that are 0 up to rounding (see :func:`per_head_relative_error`)."""
    if actual.shape != expected.shape:
        raise ValueError(f"{name}: shape {tuple(actual.shape)} differs from the reference's "
                         f"{tuple(expected.shape)}")
    tol = tolerance(dtype or actual.dtype) if tol is None else tol
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    finite = bool(torch.isfinite(a).all())
    diff = (a - e).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    rel = float((a - e).norm() / e.norm().clamp_min(max(floor, torch.finfo(torch.float64).tiny)))
    if a.dim() >= 3:
        heads = per_head_relative_error(a, e, floor=floor)
        flat = int(torch.nan_to_num(heads, nan=math.inf).argmax())
        worst = divmod(flat, heads.shape[1])
        worst_rel = float(heads.flatten()[flat])
    else:
        worst, worst_rel = (), rel
    if not finite:
        worst_rel = math.inf
    return Comparison(name, max_abs, rel, worst, worst_rel, tol, finite)


@dataclass
class Report:
    """A table of comparisons with a single verdict."""

    title: str
    rows: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def __getitem__(self, name: str) -> Comparison:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def table(self) -> str:
        head = f"{'tensor':<8}{'max abs err':>13}{'rel err':>11}{'worst (b,h)':>13}{'its rel err':>13}{'tol':>9}  verdict"
        lines = [self.title, head, "-" * len(head)]
        for r in self.rows:
            worst = ",".join(map(str, r.worst_head)) if r.worst_head else "-"
            lines.append(f"{r.name:<8}{r.max_abs:>13.3e}{r.rel:>11.2e}{worst:>13}"
                         f"{r.worst_rel:>13.2e}{r.tol:>9.0e}  {r.verdict}")
        lines.append(f"=> {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def assert_ok(self) -> "Report":
        if not self.ok:
            bad = ", ".join(r.name for r in self.rows if not r.ok)
            raise AssertionError(f"{bad} outside tolerance\n{self.table()}")
        return self


def sdpa(q, k, v, *, causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """PyTorch's scaled_dot_product_attention with GQA handled by repeating K/V heads."""
    H, H_kv = q.shape[1], k.shape[1]
    if H != H_kv:
        k = k.repeat_interleave(H // H_kv, dim=1)
        v = v.repeat_interleave(H // H_kv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def grads(fn, q, k, v, do):
    """``(out, (dq, dk, dv))`` of ``fn(q, k, v)`` for the output gradient ``do``, on fresh
    leaves (q, k, v themselves are not touched)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, do)


def sdpa_grads(q, k, v, do, causal: bool = False, scale: Optional[float] = None):
    """``(out, dq, dk, dv)`` of PyTorch's SDPA for the output gradient ``do`` (GQA handled by
    :func:`sdpa`; q, k, v themselves are not touched)."""
    out, (dq, dk, dv) = grads(lambda a, b, c: sdpa(a, b, c, causal=causal, scale=scale), q, k, v, do)
    return out, dq, dk, dv


def verify_attention(q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                     do: Optional[torch.Tensor] = None, against: str = "float64",
                     show: bool = True) -> Report:
    """Run ``flash_attention`` forward and backward and compare O, dQ, dK, dV (and LSE when
    ``against="float64"``) with SDPA (``against="sdpa"``, same dtype) or with the float64
    reference. Prints the table when ``show``; returns the :class:`Report`."""
    from .api import flash_attention
    from .forward import attention_forward

    if against not in ("float64", "sdpa"):
        raise ValueError(f"against must be 'float64' or 'sdpa', got {against!r}")
    if do is None:
        do = torch.randn_like(q)
    out, (dq, dk, dv) = grads(lambda a, b, c: flash_attention(a, b, c, causal=causal, scale=scale),
                              q, k, v, do)
    kernel_dtype = runtime.compute_dtype(q.dtype, q.device)
    if against == "sdpa":
        ref_out, rq, rk, rv = sdpa_grads(q, k, v, do, causal=causal, scale=scale)
        title = f"flashattn vs SDPA ({q.dtype}, causal={causal})"
        ref_lse = None
    else:
        ref = attention_reference(q, k, v, do, causal=causal, scale=scale)
        ref_out, rq, rk, rv, ref_lse = ref.O, ref.dQ, ref.dK, ref.dV, ref.LSE
        title = f"flashattn vs float64 reference ({q.dtype}, causal={causal})"
    # SDPA in low precision carries its own rounding error: allow for both sides.
    slack = 2.0 if against == "sdpa" else 1.0
    tol = tolerance(kernel_dtype) * slack
    report = Report(title + f", B,H,S_q,S_k,D = {q.shape[0]},{q.shape[1]},{q.shape[2]},{k.shape[2]},{q.shape[3]}")
    report.rows.append(compare("O", out, ref_out, tol=tol))
    if ref_lse is not None:
        _, lse = attention_forward(q.detach().to(kernel_dtype), k.detach().to(kernel_dtype),
                                   v.detach().to(kernel_dtype), causal, scale)
        report.rows.append(compare("LSE", lse, ref_lse, tol=tol))
    report.rows += [compare("dQ", dq, rq, tol=tol), compare("dK", dk, rk, tol=tol),
                    compare("dV", dv, rv, tol=tol)]
    if show:
        print(report)
    return report


def check_attention(*args, **kwargs) -> Report:
    """Old name of :func:`verify_attention`, kept for old code."""
    return verify_attention(*args, **kwargs)
