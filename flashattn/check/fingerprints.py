"""Fingerprints: known wrong computations, run in float64 on the case's own inputs.

When a learner's output equals one of these exactly (to rounding), the mistake is known: dS
without its "- delta", P rebuilt from unscaled scores or with exp2, only the last block's
share kept, two gradients swapped. Each entry maps a fingerprint name to the outputs that
mistake would produce; ``matching`` returns the names whose outputs the learner's match (with
the other outputs right).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..reference import causal_mask, repeat_kv, sum_groups
from ..verify import per_head_relative_error
from .battery import BLOCKS, Case, Inputs
from .checkers import AUTOGRAD, BACKWARD, DKDV, DQ, KERNELS, REBUILD_P


def _matches(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    """Equal up to rounding; NaN must stand exactly where the mistake puts NaN."""
    if actual is None or actual.shape != expected.shape:
        return False
    a, e = actual, expected.to("cpu", torch.float64)
    nan_a, nan_e = ~torch.isfinite(a), ~torch.isfinite(e)
    if not torch.equal(nan_a, nan_e):
        return False
    if bool(((a == float("inf")) & (e == float("-inf"))).any() | ((a == float("-inf")) & (e == float("inf"))).any()):
        return False            # +inf where the mistake gives -inf: another mistake
    a, e = torch.where(nan_a, 0.0, a), torch.where(nan_e, 0.0, e)
    if a.numel() and float(a.abs().max()) <= 1e-12 and float(e.abs().max()) <= 1e-12:
        return True             # both zero up to float64 rounding (a row sum of dS): no relative error to take
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


def _visited(case: Case, checker, block: int, device, causal: Optional[bool] = None) -> torch.Tensor:
    """[S_q, S_k]: the (query, key) pairs a dQ (or dK/dV) kernel with square ``block`` tiles
    visits -- every pair of the tiles its loop bounds reach, visible or not (``causal``: the
    loop bounds of that setting, whatever the case's)."""
    i = torch.arange(case.S_q, device=device)[:, None]
    j = torch.arange(case.S_k, device=device)[None, :]
    if not (case.causal if causal is None else causal):
        return torch.ones(case.S_q, case.S_k, dtype=torch.bool, device=device)
    if checker is DQ:                       # keys up to the end of the query block
        return j < (i // block + 1) * block
    return i >= (j // block) * block       # dkdv: query blocks from the key block's diagonal on


def _visited_one_short(case: Case, checker, block: int, device) -> torch.Tensor:
    """[S_q, S_k]: the pairs a loop reaches whose stop is one block short, range(start, end - BLOCK,
    BLOCK): the block that starts at or past end - BLOCK is never visited."""
    i = torch.arange(case.S_q, device=device)[:, None]
    j = torch.arange(case.S_k, device=device)[None, :]
    if checker is DQ:                       # key blocks of query block i // block
        end = torch.clamp((i // block + 1) * block, max=case.S_k) if case.causal else torch.full_like(i, case.S_k)
        return (j // block) * block < end - block
    start = (j // block) * block if case.causal else torch.zeros_like(j)     # query blocks of key block j
    return ((i - start) // block * block + start < case.S_q - block) & (i >= start)


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


def backward_variants(case: Case, x: Inputs, checker) -> dict:
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
    if checker is BACKWARD:                                               # a softmax over the queries
        # delta = (do * o).mean(-1): the row sum divided by D
        out["delta_mean"] = _grads_from_p(case, x, ref.P, delta=ref.delta[..., None] / case.D)
        # delta = (do * o).sum(): one number for the whole batch, not one per query row
        out["delta_scalar"] = _grads_from_p(case, x, ref.P, delta=ref.delta.sum())
        # delta = (do * o).sum((-2, -1), keepdim=True): summed over the query rows too, one per head
        out["delta_per_head"] = _grads_from_p(case, x, ref.P, delta=ref.delta.sum(-1, keepdim=True)[..., None])
        # dS = P (1 - P) dP: only the diagonal of the softmax's Jacobian
        out["ds_diagonal"] = _grads_from_p(case, x, ref.P, dS=ref.P * (1 - ref.P) * ref.dP)
        # dS = dP - delta: the factor P forgotten (hidden keys get dP - delta too)
        out["ds_no_p"] = _grads_from_p(case, x, ref.P, dS=ref.dP - ref.delta[..., None])
        out["softmax_axis"] = _grads_from_p(case, x, torch.softmax(ref.S, dim=-2))
        divided = raw / s                                                # scale taken for sqrt(D)
        if case.causal:
            divided = divided.masked_fill(~causal_mask(case.S_q, case.S_k, raw.device), float("-inf"))
        out["scale_divided"] = _grads_from_p(case, x, torch.softmax(divided, dim=-1))
        # a hand-written "stable softmax": exp(S - rowmax) never divided by the row sum
        out["softmax_unnormalised"] = _grads_from_p(case, x, torch.exp(ref.S - ref.S.amax(-1, keepdim=True)))
        out["ds_from_s"] = _grads_from_p(case, x, ref.P, dS=ref.S * (ref.dP - ref.delta[..., None]))   # S for P
        out["log_softmax"] = _grads_from_p(case, x, torch.log_softmax(ref.S, dim=-1))
        twice = ref.S * s                                                # the scale applied twice
        out["scale_twice"] = _grads_from_p(case, x, torch.softmax(twice, dim=-1))
    if checker in KERNELS:                                           # scores scaled again before exp
        out["scale_twice"] = _grads_from_p(case, x, torch.where(torch.isfinite(ref.S), torch.exp(ref.S * s - lse), 0.0))
    if checker in (BACKWARD, DQ, DKDV):                               # dP = dO V^T * scale
        out["dp_scaled"] = _grads_from_p(case, x, ref.P, dP=ref.dP * s)
    if checker in KERNELS:
        visible = torch.isfinite(ref.S)
        for block in BLOCKS:
            seen = _visited(case, checker, block, ref.S.device)
            out[f"ds_no_p:{block}"] = _grads_from_p(case, x, ref.P, dS=(ref.dP - ref.delta[..., None]) * seen)
            # range(start, end - BLOCK, BLOCK): the loop's last block never visited
            short = _visited_one_short(case, checker, block, ref.S.device)
            out[f"loop_one_block_short:{block}"] = _grads_from_p(case, x, ref.P * short, dS=ref.dS * short)
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
    if checker in KERNELS:
        out.update(_tile_variants(case, x, checker))
        for block in BLOCKS:
            out[f"last_block_{block}"] = _last_block(case, x, checker, block)
            out[f"scale_in_loop:{block}"] = _scale_in_loop(case, x, checker, block)
            if checker is DKDV and case.heads_kv != case.H:   # dk = ... in the loop over the group too
                out[f"last_block_{block}:last_head"] = _last_block(case, x, checker, block, last_head=True)
    out.update(_slip_variants(case, x, checker))
    out.update(mask_variants(case, x, checker))
    out.update(_argument_variants(case, x, checker))
    out.update(_operand_variants(case, x))
    return out


def _tile_variants(case: Case, x: Inputs, checker) -> dict:
    """Kernel slips tied to the tiles: the causal loop bounds applied without the causal mask
    (the dQ loop stopped at the query block's end, the dK/dV loop started at the key block's
    diagonal, in a case that is not causal); a tile transposed once more in the product (dK +=
    tl.trans(dsT) Q, dV += tl.trans(pT) dO, dQ += tl.trans(ds) K), which runs when the two
    block sizes agree."""
    ref = x.ref
    H, Hk, s = case.H, case.heads_kv, case.scale_value
    q = x.q.to(torch.float64)
    k_full = repeat_kv(x.k.to(torch.float64), H)
    dt = lambda t: t.to(x.q.dtype).to(torch.float64)  # noqa: E731
    out = {}
    for block in BLOCKS:
        if not case.causal:
            bounded = _visited(case, checker, block, ref.S.device, causal=True)
            out[f"causal_bounds_unguarded:{block}"] = _grads_from_p(case, x, _from_lse(case, x, bounded))
            if checker is DQ:         # the key loop run to S_q: with one query block, the same keys
                j = torch.arange(case.S_k, device=ref.S.device)[None, :]
                to_sq = (j < -(-case.S_q // block) * block).expand(case.S_q, case.S_k)
                out[f"key_loop_to_sq:{block}"] = _grads_from_p(case, x, _from_lse(case, x, to_sq))
        dS_t = _tile_transpose_matrix(ref.dS, case, block)
        if checker is DKDV and block == BLOCKS[0]:   # dK's product added into dV (or dV's into dK)
            dK_raw = sum_groups(ref.dS.transpose(-1, -2) @ q, Hk)
            out["accumulated_into_other:dV"] = {"dK": torch.zeros_like(ref.dK), "dV": dt(ref.dV + dK_raw)}
            out["accumulated_into_other:dK"] = {"dK": dt((dK_raw + ref.dV) * s), "dV": torch.zeros_like(ref.dV)}
        if checker is DKDV:
            P_t = _tile_transpose_matrix(ref.P, case, block)
            out[f"tile_transposed_again:{block}dK"] = {"dK": dt(sum_groups(dS_t.transpose(-1, -2) @ q, Hk) * s)}
            out[f"tile_transposed_again:{block}dV"] = {"dV": dt(sum_groups(P_t.transpose(-1, -2) @ ref.dO, Hk))}
        else:
            out[f"tile_transposed_again:{block}dQ"] = {"dQ": dt(dS_t @ k_full * s)}
    return out


def _slip_variants(case: Case, x: Inputs, checker) -> dict:
    """Precedence slips and a wrong scale value: dS = P * dP - delta (the parentheses dropped),
    P = exp(S) - LSE (the LSE subtracted after the exponential), everything computed with a
    scale of 1/D or 1 instead of the one given."""
    ref = x.ref
    out = {}
    if checker is AUTOGRAD:          # the package's own kernels run: only the scale can slip
        for label, value in (("1/D", 1.0 / case.D), ("1", 1.0), ("1/sqrt(S_q)", case.S_q ** -0.5),
                             ("1/sqrt(S_k)", case.S_k ** -0.5), ("sqrt(D)", case.D ** 0.5)):
            if abs(value - case.scale_value) <= 1e-9:
                continue
            r = _reference_at(case, x, value)
            out[f"scale_value:{label}"] = {n: getattr(r, n).to(x.q.dtype).to(torch.float64)
                                           for n in ("O", "dQ", "dK", "dV")}
        return out
    visible = torch.isfinite(ref.S)
    lse = ref.LSE[..., None]
    masked_s = ref.S                                       # -inf where hidden: exp gives 0 there
    # P = exp(S) - LSE: a function that masks S first leaves -LSE at hidden keys; a kernel that
    # masks P afterwards leaves 0 there
    out["exp_minus_lse:unmasked"] = _grads_from_p(case, x, torch.exp(masked_s) - lse)
    out["exp_minus_lse:masked"] = _grads_from_p(case, x, torch.where(visible, torch.exp(masked_s) - lse, 0.0))
    out["lse_added"] = _grads_from_p(case, x, torch.where(visible, torch.exp(masked_s + lse), 0.0))
    if checker is BACKWARD:
        out["ds_precedence"] = _grads_from_p(case, x, ref.P, dS=ref.P * ref.dP - ref.delta[..., None])
    else:                                                  # only the tiles a kernel visits subtract delta
        for block in BLOCKS:
            seen = _visited(case, checker, block, ref.S.device)
            out[f"ds_precedence:{block}"] = _grads_from_p(case, x, ref.P, dS=ref.P * ref.dP - ref.delta[..., None] * seen)
    for label, value in (("1/D", 1.0 / case.D), ("1", 1.0)):
        if abs(value - case.scale_value) > 1e-9:
            S = _scores(case, x) / case.scale_value * value
            P = torch.where(visible, torch.exp(S - lse), 0.0)
            g = _grads_from_p(case, x, P)
            out[f"scale_value:{label}"] = {"dQ": g["dQ"] * value / case.scale_value,
                                           "dK": g["dK"] * value / case.scale_value, "dV": g["dV"]}
    return out


def _reference_at(case: Case, x: Inputs, scale: float):
    from ..reference import attention_reference
    return attention_reference(x.q, x.k, x.v, x.ref.dO, causal=case.causal, scale=scale)


def _operand_variants(case: Case, x: Inputs) -> dict:
    """One product with the wrong operand: dQ = dS X, dK = dS^T X, dV = P^T X for an X that is
    not the right one, and dP = O V^T (O where dO belongs). Named ``operand:<what was computed>``."""
    ref = x.ref
    H, Hk, s = case.H, case.heads_kv, case.scale_value
    q = x.q.to(torch.float64)
    k_full = repeat_kv(x.k.to(torch.float64), H)
    v_full = repeat_kv(x.v.to(torch.float64), H)
    dt = lambda t: t.to(x.q.dtype).to(torch.float64)  # noqa: E731  (stored in the inputs' dtype)
    out = {}
    for name, X in (("V", v_full), ("Q", q), ("dO", ref.dO)):
        if X.shape == k_full.shape:
            out[f"operand:dQ = dS {name}"] = {"dQ": dt(ref.dS @ X * s)}
    for name, X in (("dO", ref.dO), ("K", k_full), ("V", v_full)):
        if X.shape == q.shape:
            out[f"operand:dK = dS^T {name}"] = {"dK": dt(sum_groups(ref.dS.transpose(-1, -2) @ X, Hk) * s)}
    for name, X in (("Q", q), ("O", ref.O), ("K", k_full), ("V", v_full)):
        if X.shape == ref.dO.shape:
            out[f"operand:dV = P^T {name}"] = {"dV": dt(sum_groups(ref.P.transpose(-1, -2) @ X, Hk))}
    out["operand:dP = O V^T"] = _grads_from_p(case, x, ref.P, dP=ref.O @ v_full.transpose(-1, -2))
    if ref.dV.shape == v_full.shape:          # the gradient dV, computed a line above, for V
        out["operand:dP = dO dV^T"] = _grads_from_p(case, x, ref.P, dP=ref.dO @ ref.dV.transpose(-1, -2))
    # dP (or P) where dS belongs in dK = dS^T Q, dQ = dS K
    for name, M in (("dP", ref.dP), ("P", ref.P)):
        out[f"operand:dK = {name}^T Q"] = {"dK": dt(sum_groups(M.transpose(-1, -2) @ q, Hk) * s)}
        out[f"operand:dQ = {name} K"] = {"dQ": dt(M @ k_full * s)}
    return out


def _scores(case: Case, x: Inputs) -> torch.Tensor:
    """[B, H, S_q, S_k]: Q K^T * scale with no mask at all."""
    k_full = repeat_kv(x.k.to(torch.float64), case.H)
    return x.q.to(torch.float64) @ k_full.transpose(-1, -2) * case.scale_value


def _from_lse(case: Case, x: Inputs, allowed: torch.Tensor, lse=None) -> torch.Tensor:
    """P = exp(S - LSE) where ``allowed`` ([S_q, S_k]), 0 elsewhere: what a kernel that rebuilds
    P from the forward's LSE computes with the mask ``allowed``."""
    lse = x.ref.LSE if lse is None else lse
    return torch.where(allowed, torch.exp(_scores(case, x) - lse[..., None]), 0.0)


def mask_variants(case: Case, x: Inputs, checker) -> dict:
    """The causal mask gone wrong: missing, inverted, hiding the diagonal, pointing the wrong
    way, transposed inside a tile, the diagonal tile skipped, S = 0 instead of -inf, applied
    after the softmax. Each as the kernel (or the PyTorch function) of ``checker`` computes it."""
    dev = x.ref.S.device
    i = torch.arange(case.S_q, device=dev)[:, None]
    j = torch.arange(case.S_k, device=dev)[None, :]
    visible = j <= i
    if not case.causal:         # `if not causal:`: the mask applied exactly where it does not belong
        if checker is REBUILD_P:
            return {"mask_applied": {"P": _from_lse(case, x, visible)}}
        if checker is BACKWARD:
            P = torch.softmax(_scores(case, x).masked_fill(~visible, float("-inf")), dim=-1)
            return {"mask_applied": _grads_from_p(case, x, P),
                    "mask_applied:own_delta": _grads_from_p(case, x, P, delta=(P * x.ref.dP).sum(-1, keepdim=True))}
        return {}
    S = _scores(case, x)
    out = {}
    if checker is REBUILD_P:
        out["no_mask"] = {"P": _from_lse(case, x, torch.ones_like(visible))}
        out["mask_inverted"] = {"P": _from_lse(case, x, ~visible)}
        out["mask_strict"] = {"P": _from_lse(case, x, j < i)}
        out["mask_shifted"] = {"P": _from_lse(case, x, j <= i + 1)}
        out["mask_zero"] = {"P": torch.exp(torch.where(visible, S, 0.0) - x.ref.LSE[..., None])}
        out["mask_ge"] = {"P": _from_lse(case, x, j >= i)}
        out["mask_bottom_right"] = {"P": _from_lse(case, x, j <= i + case.S_k - case.S_q)}
        return out
    if checker is BACKWARD:      # P from a softmax in the learner's function
        wrong = {"no_mask": torch.softmax(S, dim=-1),
                 "mask_zero": torch.softmax(torch.where(visible, S, 0.0), dim=-1),
                 "mask_after_softmax": torch.softmax(S, dim=-1) * visible,
                 "mask_inverted": torch.softmax(S.masked_fill(visible, float("-inf")), dim=-1),
                 "mask_ge": torch.softmax(S.masked_fill(j < i, float("-inf")), dim=-1),
                 "mask_shifted": torch.softmax(S.masked_fill(j > i + 1, float("-inf")), dim=-1),
                 # aligned bottom-right (FlashAttention's convention for S_q != S_k): rows that see
                 # no key are NaN, as in the learner's softmax
                 "mask_bottom_right": torch.softmax(S.masked_fill(j > i + case.S_k - case.S_q, float("-inf")), dim=-1)}
        for name, P in wrong.items():
            out[name] = _grads_from_p(case, x, P)
            # delta as rowsum(P * dP) from that same wrong P, instead of rowsum(dO * O)
            out[name + ":own_delta"] = _grads_from_p(case, x, P, delta=(P * x.ref.dP).sum(-1, keepdim=True))
        return out
    if checker is AUTOGRAD:
        out.update(_autograd_mask_variants(case, x, S, visible))
        return out
    out["mask_strict"] = _grads_from_p(case, x, _from_lse(case, x, j < i))
    for block in BLOCKS:
        seen = _visited(case, checker, block, dev)
        out[f"no_mask:{block}"] = _grads_from_p(case, x, _from_lse(case, x, seen))
        out[f"mask_ge:{block}"] = _grads_from_p(case, x, _from_lse(case, x, seen & (j >= i)))
        # one key further (j <= i + 1): the loop's bounds still stop at the tiles it visits
        out[f"mask_shifted:{block}"] = _grads_from_p(case, x, _from_lse(case, x, seen & (j <= i + 1)))
        zeroed = torch.exp(torch.where(visible, S, 0.0) - x.ref.LSE[..., None])     # S = 0, not -inf
        out[f"mask_zero:{block}"] = _grads_from_p(case, x, torch.where(seen, zeroed, 0.0))
        m0, n0 = (i // block) * block, (j // block) * block
        # offs_n[:, None] <= offs_m[None, :] in a [query, key] tile: row a, column b compare
        # key n0 + a with query m0 + b
        for direction, allowed in (("le", n0 + (i - m0) <= m0 + (j - n0)), ("ge", n0 + (i - m0) >= m0 + (j - n0))):
            out[f"mask_tile_transposed:{block}{direction}"] = _grads_from_p(case, x, _from_lse(case, x, seen & allowed))
        # the loop visits the diagonal tile only: dQ's key loop starts at its own block, dK/dV's
        # query loop stops after the key block's own tile
        only = (j >= m0) if checker is DQ else (i < n0 + block)
        out[f"only_diagonal_tile:{block}"] = _grads_from_p(case, x, _from_lse(case, x, visible & only))
        skip = (j < m0) if checker is DQ else (i >= n0 + block)     # the loop starts or ends one tile early
        out[f"diag_tile_skipped:{block}"] = _grads_from_p(case, x, _from_lse(case, x, visible & skip))
    out["no_mask:all"] = _grads_from_p(case, x, _from_lse(case, x, torch.ones_like(visible)))
    return out


def _autograd_mask_variants(case: Case, x: Inputs, S, visible) -> dict:
    """autograd: causal lost on the way to the forward, to the backward kernels, or to an LSE
    the backward recomputes."""
    ref = x.ref
    out = {"backward_not_causal": _grads_from_p(case, x, _from_lse(case, x, torch.ones_like(visible)))}
    lse_all = torch.logsumexp(S, dim=-1)
    out["lse_unmasked"] = _grads_from_p(case, x, _from_lse(case, x, visible, lse=lse_all))
    v_full = repeat_kv(x.v.to(torch.float64), case.H)
    o_all = torch.softmax(S, dim=-1) @ v_full                  # the forward without the mask
    delta_all = (ref.dO * o_all).sum(-1, keepdim=True)
    grads = _grads_from_p(case, x, _from_lse(case, x, visible, lse=lse_all), delta=delta_all)
    out["forward_not_causal"] = dict(grads, O=o_all)
    return out


def _tile_transpose_matrix(M: torch.Tensor, case: Case, block: int) -> torch.Tensor:
    """[..., S_q, S_k]: each square tile of ``M`` read transposed, as a [key, query] tile
    computed in the [query, key] orientation gives it (0 where that reads past the end)."""
    dev = M.device
    i = torch.arange(case.S_q, device=dev)[:, None]
    j = torch.arange(case.S_k, device=dev)[None, :]
    m0, n0 = (i // block) * block, (j // block) * block
    src_i, src_j = m0 + (j - n0), n0 + (i - m0)
    ok = (src_i < case.S_q) & (src_j < case.S_k)
    picked = M[..., src_i.clamp_max(case.S_q - 1), src_j.clamp_max(case.S_k - 1)]
    return torch.where(ok, picked, torch.zeros((), dtype=M.dtype, device=dev))


def _argument_variants(case: Case, x: Inputs, checker) -> dict:
    """Mistakes in what is handed to a kernel or where a kernel looks: LSE and delta swapped,
    dP's tile not transposed, the query block taken from the program id, one head per group."""
    ref = x.ref
    out = {}
    visible = torch.isfinite(ref.S)
    if checker in (DQ, AUTOGRAD, DKDV):
        swapped = torch.where(visible, torch.exp(_scores(case, x) - ref.delta[..., None]), 0.0)
        out["lse_delta_swapped"] = _grads_from_p(case, x, swapped, delta=ref.LSE[..., None])
        out["delta_is_lse"] = _grads_from_p(case, x, ref.P, delta=ref.LSE[..., None])
    if checker in (BACKWARD, DQ, DKDV):
        out["delta_rowsum_dp"] = _grads_from_p(case, x, ref.P, delta=ref.dP.sum(-1, keepdim=True))
    if checker in (DQ, AUTOGRAD) and x.k.shape == x.v.shape:      # the kernel called with (q, v, k, ...)
        k_full = repeat_kv(x.k.to(torch.float64), case.H)
        v_full = repeat_kv(x.v.to(torch.float64), case.H)
        S_vk = x.q.to(torch.float64) @ v_full.transpose(-1, -2) * case.scale_value
        P_vk = torch.where(visible, torch.exp(S_vk - ref.LSE[..., None]), 0.0)
        dS_vk = P_vk * (ref.dO @ k_full.transpose(-1, -2) - ref.delta[..., None])
        out["kv_swapped"] = {"dQ": (dS_vk @ v_full * case.scale_value).to(x.q.dtype).to(torch.float64)}
    if checker is DQ:
        for block in BLOCKS:
            out[f"dp_tile_transposed:{block}"] = _grads_from_p(case, x, ref.P, dP=_tile_transpose_matrix(ref.dP, case, block))
    if checker is not DKDV:
        return out
    H, Hk, s = case.H, case.heads_kv, case.scale_value
    q = x.q.to(torch.float64)
    for block in BLOCKS:
        dP_t = _tile_transpose_matrix(ref.dP, case, block)
        out[f"dp_tile_transposed:{block}"] = _grads_from_p(case, x, ref.P, dP=dP_t)
        out[f"query_block_from_pid:{block}"] = _query_block_from_pid(case, x, block)
    if Hk != H:                                   # only g = 0 (or the last g) of each group
        for name, g in (("gqa_one_head", 0), ("gqa_last_head", -1)):
            one = lambda t, g=g: t.unflatten(1, (Hk, H // Hk))[:, :, g]  # noqa: E731
            out[name] = {"dK": one(ref.dS).transpose(-1, -2) @ one(q) * s,
                         "dV": one(ref.P).transpose(-1, -2) @ one(ref.dO)}
    return out


def _query_block_from_pid(case: Case, x: Inputs, block: int) -> dict:
    """dK/dV if key-block program n loads query block n (offsets from the program id) in every
    iteration of its loop over the query blocks, instead of the block the loop stepped to."""
    ref = x.ref
    Hk, s = case.heads_kv, case.scale_value
    q = x.q.to(torch.float64)
    dk, dv = torch.zeros_like(ref.dK), torch.zeros_like(ref.dV)
    for n0 in range(0, case.S_k, block):
        start = n0 // block * block if case.causal else 0
        count = len(range(start, case.S_q, block))
        rows, keys = slice(n0, min(n0 + block, case.S_q)), slice(n0, n0 + block)
        if count == 0 or n0 >= case.S_q:
            continue
        dk[..., keys, :] = count * sum_groups(ref.dS[..., rows, keys].transpose(-1, -2) @ q[..., rows, :], Hk) * s
        dv[..., keys, :] = count * sum_groups(ref.P[..., rows, keys].transpose(-1, -2) @ ref.dO[..., rows, :], Hk)
    return {"dK": dk, "dV": dv}


def online_variants(case: Case, x: Inputs) -> dict:
    """The online-softmax forward (exercise 02) with its classic slips, simulated block by block
    in float64 exactly as the exercise's loop runs: scores without the scale, p with exp2."""
    return {"online_unscaled": _online(case, x, 1.0, torch.exp),
            "online_exp2": _online(case, x, case.scale_value, torch.exp2),
            "online_max_not_kept": _online(case, x, case.scale_value, torch.exp, slip="max_not_kept"),
            "online_alpha_on_new": _online(case, x, case.scale_value, torch.exp, slip="alpha_on_new"),
            "online_not_normalized": _online(case, x, case.scale_value, torch.exp, slip="not_normalized"),
            "online_block_max": _online(case, x, case.scale_value, torch.exp, slip="block_max"),
            "online_block_short": _online(case, x, case.scale_value, torch.exp, slip="block_short"),
            "online_drop_partial": _online(case, x, case.scale_value, torch.exp, slip="drop_partial"),
            "online_l_rescales_new": _online(case, x, case.scale_value, torch.exp, slip="l_rescales_new"),
            "online_v_from_k": _online(case, x, case.scale_value, torch.exp, slip="v_from_k"),
            "online_alpha_block_max": _online(case, x, case.scale_value, torch.exp, slip="alpha_block_max"),
            "online_block_softmax": _online(case, x, case.scale_value, torch.exp, slip="block_softmax"),
            "online_normalise_in_loop": _online(case, x, case.scale_value, torch.exp, slip="normalise_in_loop"),
            "online_mask_zero": _online(case, x, case.scale_value, torch.exp, slip="mask_zero"),
            "online_p_times_alpha": _online(case, x, case.scale_value, torch.exp, slip="p_times_alpha"),
            "online_overlapping_blocks": _online(case, x, case.scale_value, torch.exp, slip="overlap"),
            "online_bottom_right": _online(case, x, case.scale_value, torch.exp, slip="bottom_right"),
            "online_mask_reversed": _online(case, x, case.scale_value, torch.exp, slip="mask_reversed"),
            "online_acc_not_rescaled": _online(case, x, case.scale_value, torch.exp, slip="acc_no_alpha"),
            "online_l_not_rescaled": _online(case, x, case.scale_value, torch.exp, slip="l_no_alpha"),
            "online_m_block": _online(case, x, case.scale_value, torch.exp, slip="m_block"),
            "online_l_unshifted": _online(case, x, case.scale_value, torch.exp, slip="l_unshifted"),
            **{f"scale_value:{label}": _online(case, x, value, torch.exp)
               for label, value in (("1/D", 1.0 / case.D), ("sqrt(scale)", case.scale_value ** 0.5),
                                    ("scale ** 2", case.scale_value ** 2), ("sqrt(D)", case.D ** 0.5))
               if abs(value - case.scale_value) > 1e-9},
            # the scale only in p's exponent: the maximum, alpha and the LSE see unscaled scores
            "online_scale_in_p": _online(case, x, 1.0, lambda t: torch.exp(t * case.scale_value))}


def _online(case: Case, x: Inputs, scale: float, p_exp, slip: str = "") -> dict:
    q = x.q.to(torch.float64)
    k = repeat_kv(x.k.to(torch.float64), case.H)
    v = k if slip == "v_from_k" else repeat_kv(x.v.to(torch.float64), case.H)
    block = case.block_n or case.S_k
    rows = torch.arange(case.S_q, device=q.device)[:, None]
    m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=torch.float64, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    # drop_partial: range(0, S_k - block + 1, block) visits the full blocks only
    # overlap: the loop steps by block - 1 while each block takes block keys
    step = block - 1 if slip == "overlap" and block > 1 else block
    for n0 in range(0, case.S_k - block + 1 if slip == "drop_partial" else case.S_k, step):
        end = min(n0 + block - (slip == "block_short"), case.S_k)   # block_short: a slice one key short
        s = q @ k[..., n0:end, :].transpose(-1, -2) * scale
        if case.causal:
            cols = torch.arange(n0, end, device=q.device)[None, :]
            shift = case.S_k - case.S_q if slip == "bottom_right" else 0      # bottom_right: j <= i + S_k - S_q
            hidden = rows > cols if slip == "mask_reversed" else cols > rows + shift   # reversed: the past hidden
            s = s.masked_fill(hidden, 0.0 if slip == "mask_zero" else float("-inf"))   # mask_zero: S = 0
        m_new = s.amax(-1, keepdim=True) if slip == "block_max" else torch.maximum(m, s.amax(-1, keepdim=True))
        # alpha_block_max: the old sums rescaled against this block's maximum, not the new one
        alpha = torch.exp(m - (s.amax(-1, keepdim=True) if slip == "alpha_block_max" else m_new))
        # block_softmax: each block normalised on its own, p = softmax(s) (NaN for a hidden block)
        p = torch.softmax(s, dim=-1) if slip == "block_softmax" else p_exp(s - m_new)
        if slip == "p_times_alpha":         # the new block's p rescaled too
            p = p * alpha
        if slip == "l_rescales_new":        # l = (l + rowsum(p)) * alpha: the new block rescaled too
            l = (l + p.sum(-1, keepdim=True)) * alpha
            acc = acc * alpha + p @ v[..., n0:end, :]
        elif slip == "alpha_on_new":          # alpha multiplies the new block, not the running sums
            l = l + alpha * p.sum(-1, keepdim=True)
            acc = acc + alpha * (p @ v[..., n0:end, :])
        else:
            # l_unshifted: the block's sum of exp(s), not exp(s - m_new); *_no_alpha: one sum not rescaled
            added = torch.exp(s).sum(-1, keepdim=True) if slip == "l_unshifted" else p.sum(-1, keepdim=True)
            l = (l if slip == "l_no_alpha" else l * alpha) + added
            # normalise_in_loop: each block's p V divided by the running l too (and again at the end)
            acc = (acc if slip == "acc_no_alpha" else acc * alpha) + \
                p @ v[..., n0:end, :] / (l if slip == "normalise_in_loop" else 1.0)
        if slip == "m_block":               # m = this block's maximum: the running maximum forgotten
            m = s.amax(-1, keepdim=True)
        elif slip != "max_not_kept":
            m = m_new
    # O returned as the running sum acc, never divided by the normaliser l
    o = (acc if slip == "not_normalized" else acc / l).to(x.q.dtype).to(torch.float64)   # returned in q.dtype
    return {"O": o, "LSE": (m + torch.log(l))[..., 0]}


def _scale_in_loop(case: Case, x: Inputs, checker, block: int) -> dict:
    """The outputs if the final ``acc = acc * scale`` sat inside the loop: every iteration
    multiplies all that was accumulated so far, so the t-th of T contributions carries
    scale^(T - t + 1). dQ's loop runs over the key blocks; dK's over the group's heads, then
    the query blocks (dV has no scale)."""
    ref = x.ref
    H, Hk, s = case.H, case.heads_kv, case.scale_value
    q = x.q.to(torch.float64)
    k_full = repeat_kv(x.k.to(torch.float64), H)
    if checker is DQ:
        dq = torch.zeros_like(ref.dQ)
        for m0 in range(0, case.S_q, block):
            rows = slice(m0, m0 + block)
            end = min(case.S_k, m0 + block) if case.causal else case.S_k
            for n0 in range(0, end, block):
                keys = slice(n0, min(n0 + block, end))
                dq[..., rows, :] = (dq[..., rows, :] + ref.dS[..., rows, keys] @ k_full[..., keys, :]) * s
        return {"dQ": dq}
    group = H // Hk
    dk = torch.zeros_like(ref.dK)
    for n0 in range(0, case.S_k, block):
        keys = slice(n0, n0 + block)
        start = n0 // block * block if case.causal else 0
        for g in range(group):
            heads = [h_kv * group + g for h_kv in range(Hk)]       # query head g of every group
            for m0 in range(start, case.S_q, block):
                rows = slice(m0, m0 + block)
                part = ref.dS[:, heads][..., rows, keys].transpose(-1, -2) @ q[:, heads][..., rows, :]
                dk[..., keys, :] = (dk[..., keys, :] + part) * s
    return {"dK": dk}


def _last_block(case: Case, x: Inputs, checker, block: int, last_head: bool = False) -> dict:
    """The outputs if each program kept only the share of the last block its loop visited
    (``last_head``: and, under GQA, of the last query head of the group)."""
    ref = x.ref
    H, Hk, s = case.H, case.heads_kv, case.scale_value
    q = x.q.to(torch.float64)
    k_full = repeat_kv(x.k.to(torch.float64), H)
    if checker is DKDV:                     # a key-block program loops over the query blocks
        lo = (case.S_q - 1) // block * block
        P, dS = ref.P[..., lo:, :], ref.dS[..., lo:, :]
        group = (lambda t: t.unflatten(1, (Hk, H // Hk))[:, :, -1]) if last_head else \
            (lambda t: sum_groups(t, Hk))
        return {"dK": group(dS.transpose(-1, -2) @ q[..., lo:, :]) * s,
                "dV": group(P.transpose(-1, -2) @ ref.dO[..., lo:, :])}
    dq = torch.zeros_like(ref.dQ)          # a query-block program loops over the key blocks
    for m0 in range(0, case.S_q, block):
        end = min(case.S_k, m0 + block) if case.causal else case.S_k
        lo = (end - 1) // block * block
        rows = slice(m0, m0 + block)
        dq[..., rows, :] = ref.dS[..., rows, lo:end] @ k_full[..., lo:end, :] * s
    return {"dQ": dq}


def distinct(outs: dict, expected: Optional[dict], wrong, tol: float) -> bool:
    """Whether a mistake's outputs differ from the right ones, beyond the tolerance, in at least
    one wrong output. Where they do not (one query block, so 'the same block every iteration'
    is the right block), an output that is wrong for another reason -- right values written past
    the end, rounding just over the tolerance -- would 'match' the mistake and name it falsely."""
    if expected is None:
        return True
    return any(n in outs and n in expected and _fails(outs[n], expected[n].detach().to("cpu", torch.float64), tol)
               for n in wrong)


def _fails(mistake: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    """Whether the mistake's output would fail the check itself (the checker's own tolerance,
    not the looser one of a fingerprint match): then it can be told from the right one."""
    if mistake.shape != expected.shape:
        return True
    m, e = mistake.to("cpu", torch.float64), expected.to("cpu", torch.float64)
    if not torch.equal(torch.isfinite(m), torch.isfinite(e)):
        return True
    m, e = torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0), torch.nan_to_num(e, nan=0.0, posinf=0.0, neginf=0.0)
    if m.dim() < 3:
        m, e = m.reshape(1, 1, -1), e.reshape(1, 1, -1)
    return float(per_head_relative_error(m, e).max()) > tol


def matching(variants: dict, tensors: dict, tol: float, expected: Optional[dict] = None) -> set:
    """Fingerprint names (the part before ':') that explain every wrong output: each wrong
    output equals what that mistake computes (the right ones may or may not be touched by it),
    and the mistake's outputs are not the right ones (``expected``: the reference outputs)."""
    wrong = [n for n, t in tensors.items() if not t.ok]
    found = set()
    if not wrong:
        return found
    for name, outs in variants.items():
        if all(n in outs and not bool(torch.isfinite(outs[n]).any()) for n in wrong):
            continue            # NaN everywhere: it would match every mistake that ends in NaN
        if not distinct(outs, expected, wrong, tol):
            continue            # indistinguishable from the right answer here: proves nothing
        if name.startswith("swapped") and not set(outs) <= set(wrong):
            continue            # a swap makes both outputs wrong; one output equal to another is not one
        if all(n in outs and _matches(tensors[n].actual, outs[n], tol) for n in wrong):
            found.add(name.split(":")[0])
            if name.startswith(("operand:", "scale_value:", "edge:", "lazy_subst:")):      # which product, which value: the rule names it
                found.add(name)
    return found


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
    if float((c == c[0]).double().mean()) == 1.0:
        return False            # one factor everywhere: a constant factor, not threads adding over
    return float(whole) >= 0.95 and float((c >= 2).double().mean()) >= 0.05
