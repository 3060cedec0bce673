"""Fingerprints: known wrong computations, run in float64 on the case's own inputs.

When a learner's output equals one of these exactly (to rounding), the mistake is known: dS
without its "- delta", P rebuilt from unscaled scores or with exp2, only the last block's
share kept, two gradients swapped. Each entry maps a fingerprint name to the outputs that
mistake would produce; ``matching`` returns the names whose outputs the learner's match (with
the other outputs right).
"""
from __future__ import annotations

import torch

from ..reference import causal_mask, repeat_kv, sum_groups
from ..verify import per_head_relative_error
from .battery import BLOCKS, Case, Inputs


def _matches(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    """Equal up to rounding; NaN must stand exactly where the mistake puts NaN."""
    if actual is None or actual.shape != expected.shape:
        return False
    a, e = actual, expected.to("cpu", torch.float64)
    nan_a, nan_e = ~torch.isfinite(a), ~torch.isfinite(e)
    if not torch.equal(nan_a, nan_e):
        return False
    a, e = torch.where(nan_a, 0.0, a), torch.where(nan_e, 0.0, e)
    if a.dim() < 3:
        a, e = a.reshape(1, 1, -1), e.reshape(1, 1, -1)
    return float(per_head_relative_error(a, e).max()) <= max(tol, 1e-6) * 10


def _grads_from_p(case: Case, x: Inputs, P: torch.Tensor, dP=None, delta=None, dS=None) -> dict:
    """dQ, dK, dV of the backward formulas with a (wrong) P, dP, delta or dS put in, the rest right."""
    ref = x.ref
    H, Hk, s = case.H, case.heads_kv, case.scale_value
    q = x.q.to(torch.float64)
    k_full = repeat_kv(x.k.to(torch.float64), H)
    dP = ref.dP if dP is None else dP
    delta = ref.delta[..., None] if delta is None else delta
    dS = P * (dP - delta) if dS is None else dS
    # A kernel casts P and dS to the inputs' dtype for its tensor-core products (dV += P^T dO,
    # dQ += dS K): a wrong P (exp of unscaled scores, say) overflows there -- fp16 ends at
    # 65504 -- and turns inf and NaN, though it stays finite in fp64. Round the same way.
    P, dS = (t.to(x.q.dtype).to(torch.float64) for t in (P, dS))
    grads = {"dQ": dS @ k_full * s,
             "dK": sum_groups(dS.transpose(-1, -2) @ q, Hk) * s,
             "dV": sum_groups(P.transpose(-1, -2) @ ref.dO, Hk)}
    # stored in the inputs' dtype, where a gradient past 65504 is inf in fp16
    return {n: g.to(x.q.dtype).to(torch.float64) for n, g in grads.items()}


def _visited(case: Case, kind: str, block: int, device) -> torch.Tensor:
    """[S_q, S_k]: the (query, key) pairs a dQ (or dK/dV) kernel with square ``block`` tiles
    visits -- every pair of the tiles its loop bounds reach, visible or not."""
    i = torch.arange(case.S_q, device=device)[:, None]
    j = torch.arange(case.S_k, device=device)[None, :]
    if not case.causal:
        return torch.ones(case.S_q, case.S_k, dtype=torch.bool, device=device)
    if kind == "dq":                       # keys up to the end of the query block
        return j < (i // block + 1) * block
    return i >= (j // block) * block       # dkdv: query blocks from the key block's diagonal on


def _tile_transposed(values: torch.Tensor, case: Case, block: int) -> torch.Tensor:
    """[..., S_q, S_k]: a per-row vector broadcast along the wrong axis of a square tile
    (``v[None, :]`` where ``v[:, None]`` belongs): tile element (i, j) gets the value of row
    ``tile_start(i) + j % block`` (0 past the end: a masked load)."""
    i = torch.arange(case.S_q, device=values.device)[:, None]
    j = torch.arange(case.S_k, device=values.device)[None, :]
    idx = (i // block) * block + j % block
    ok = idx < case.S_q
    picked = values[..., idx.clamp_max(case.S_q - 1)]
    return torch.where(ok, picked, torch.zeros((), dtype=values.dtype, device=values.device))


def _mask(case: Case, P: torch.Tensor) -> torch.Tensor:
    if not case.causal:
        return P
    return P.masked_fill(~causal_mask(case.S_q, case.S_k, P.device), 0.0)


def backward_variants(case: Case, x: Inputs, kind: str) -> dict:
    """name -> {output name: tensor} for the backward checkers (backward, dq, dkdv, autograd)."""
    ref = x.ref
    H, Hk, s = case.H, case.heads_kv, case.scale_value
    q = x.q.to(torch.float64)
    k_full = repeat_kv(x.k.to(torch.float64), H)
    out = {}
    ds = ref.P * ref.dP                                          # "- delta" forgotten
    out["no_delta"] = {"dQ": ds @ k_full * s, "dK": sum_groups(ds.transpose(-1, -2) @ q, Hk) * s}
    raw = q @ k_full.transpose(-1, -2)                            # the scores without the scale
    lse = ref.LSE[..., None]
    out["unscaled_s:rebuilt"] = _grads_from_p(case, x, _mask(case, torch.exp(raw - lse)))
    masked = raw.masked_fill(~causal_mask(case.S_q, case.S_k, raw.device), float("-inf")) if case.causal else raw
    out["unscaled_s:softmax"] = _grads_from_p(case, x, torch.softmax(masked, dim=-1))
    out["exp2"] = _grads_from_p(case, x, torch.exp2(ref.S - lse))       # exp2(-inf) = 0 keeps the mask
    out["dp_operand"] = _grads_from_p(case, x, ref.P, dP=ref.dO @ k_full.transpose(-1, -2))
    if kind == "backward":                                               # a softmax over the queries
        out["softmax_axis"] = _grads_from_p(case, x, torch.softmax(ref.S, dim=-2))
    if kind in ("dkdv", "dq"):
        visible = torch.isfinite(ref.S)
        for block in BLOCKS:
            seen = _visited(case, kind, block, ref.S.device)
            out[f"ds_no_p:{block}"] = _grads_from_p(case, x, ref.P, dS=(ref.dP - ref.delta[..., None]) * seen)
            lse_t = _tile_transposed(ref.LSE, case, block)
            P_t = torch.where(visible, torch.exp(ref.S - lse_t), 0.0)
            out[f"lse_broadcast:{block}"] = _grads_from_p(case, x, P_t)
            out[f"delta_broadcast:{block}"] = _grads_from_p(case, x, ref.P, delta=_tile_transposed(ref.delta, case, block))
    names = ("dQ", "dK", "dV")
    refs = {"dQ": ref.dQ, "dK": ref.dK, "dV": ref.dV}
    for a in names:
        for b in names:
            if a < b and refs[a].shape == refs[b].shape:
                out[f"swapped:{a}{b}"] = {a: refs[b], b: refs[a]}
    if kind in ("dkdv", "dq"):
        for block in BLOCKS:
            out[f"last_block_{block}"] = _last_block(case, x, kind, block)
    return out


def _last_block(case: Case, x: Inputs, kind: str, block: int) -> dict:
    """The outputs if each program kept only the share of the last block its loop visited."""
    ref = x.ref
    H, Hk, s = case.H, case.heads_kv, case.scale_value
    q = x.q.to(torch.float64)
    k_full = repeat_kv(x.k.to(torch.float64), H)
    if kind == "dkdv":                     # a key-block program loops over the query blocks
        lo = (case.S_q - 1) // block * block
        P, dS = ref.P[..., lo:, :], ref.dS[..., lo:, :]
        return {"dK": sum_groups(dS.transpose(-1, -2) @ q[..., lo:, :], Hk) * s,
                "dV": sum_groups(P.transpose(-1, -2) @ ref.dO[..., lo:, :], Hk)}
    dq = torch.zeros_like(ref.dQ)          # a query-block program loops over the key blocks
    for m0 in range(0, case.S_q, block):
        end = min(case.S_k, m0 + block) if case.causal else case.S_k
        lo = (end - 1) // block * block
        rows = slice(m0, m0 + block)
        dq[..., rows, :] = ref.dS[..., rows, lo:end] @ k_full[..., lo:end, :] * s
    return {"dQ": dq}


def matching(variants: dict, tensors: dict, tol: float) -> set:
    """Fingerprint names (the part before ':') that explain every wrong output: each wrong
    output equals what that mistake computes (the right ones may or may not be touched by it)."""
    wrong = [n for n, t in tensors.items() if not t.ok]
    found = set()
    if not wrong:
        return found
    for name, outs in variants.items():
        if all(n in outs and _matches(tensors[n].actual, outs[n], tol) for n in wrong):
            found.add(name.split(":")[0])
    return found


def lazy_variants(f: dict, q, k, v, bias, tau, do, scale) -> dict:
    """The classic mistakes of the lazy-attention backward, for the heads of one batch element
    (q, k, v, do ``[H, L, D]``, bias ``[H, W+1]``, tau ``[H]``; ``f``: the explicit formulas of
    ``lazy.reference.lazy_backward_formulas`` for them, batch dimension dropped)."""
    from ..lazy.reference import diagonal_sums

    L = q.shape[-2]
    W = bias.shape[-1] - 1
    i = torch.arange(L)
    inv = 1.0 / (i + 1).double()
    causal = i[None, :] <= i[:, None]
    P, dP, dA, gate, dS = f["P"], f["dP"], f["dA"], f["gate"], f["dS"]
    dS_wrong_delta = P * (dP - f["delta_wrong"][..., None])
    dP_no_gate = dA * causal
    dS_no_gate = P * (dP_no_gate - (P * dP_no_gate).sum(-1, keepdim=True))
    return {
        "lazy_delta": {"dQ": dS_wrong_delta @ k * scale, "dK": dS_wrong_delta.transpose(-1, -2) @ q * scale,
                       "dBias": diagonal_sums(dS_wrong_delta, W)},
        "lazy_gate": {"dQ": dS_no_gate @ k * scale, "dK": dS_no_gate.transpose(-1, -2) @ q * scale,
                      "dBias": diagonal_sums(dS_no_gate, W), "dTau": (dP_no_gate.sum(-1) * inv).sum(-1)},
        "lazy_scale": {"dQ": dS @ k, "dK": dS.transpose(-1, -2) @ q},
        "lazy_dk_transpose": {"dK": dS @ q * scale},
        "lazy_dv": {"dV": P.transpose(-1, -2) @ do},
        "lazy_dbias_diagonals": {"dBias": diagonal_sums(dS.transpose(-1, -2), W)},
        "lazy_dtau_count": {"dTau": (dA * gate).sum((-2, -1))},
        "lazy_dtau_gate": {"dTau": ((dA * causal).sum(-1) * inv).sum(-1)},
        "lazy_dtau_causal": {"dTau": (dA.sum(-1) * inv).sum(-1)},
    }


def overcounted(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    """actual = c * expected elementwise with whole numbers c >= 1, c >= 2 on a good share of the
    elements: one value added by several threads (deterministically: lost updates, which change
    from run to run, are the two-run comparison's to catch). The CUDA log's dK."""
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
