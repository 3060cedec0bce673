"""The lazy-attention exercise's checker (solutions/07): a learner's one-head backward.

``fn(q, k, v, bias, tau, do, scale) -> (dq, dk, dv, dbias, dtau)`` gets one head in float64
(q, k, v, do ``[L, D]``, bias ``[W+1]``, tau a 0-d tensor). The cases -- a window of 0, a window
longer than the sequence, tau positive and negative (sparse rows) -- run every head, and the
results go through the same table and diagnosis as the other checkers, with the classic lazy
mistakes as fingerprints (:func:`lazy_variants`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .battery import Case
from .checkers import LAZY
from .errors import ShapeError
from .runner import run_battery


@dataclass(frozen=True)
class LazyCase(Case):
    W: int = 0
    taus: tuple = ()


def _lazy_case(L, D, W, taus) -> LazyCase:
    return LazyCase(f"L={L} W={W} tau={','.join(f'{t:g}' for t in taus)}", 1, len(taus), L, L, D, True,
                    W=W, taus=tuple(taus))


#: several heads with their own bias and tau each
LAZY_CASES = (
    _lazy_case(13, 8, 4, (0.3, -0.4, 1.5)),
    _lazy_case(9, 8, 0, (0.5, -0.2)),          # W = 0: only the main diagonal is biased
    _lazy_case(7, 8, 12, (0.0, -2.0)),         # W >= L; tau strongly negative: sparse rows
)

NAMES = ("dQ", "dK", "dV", "dBias", "dTau")


def _make(case: LazyCase, dtype, device, seed, with_do):
    from ..lazy.reference import lazy_backward_formulas, lazy_gradients_autograd

    g = torch.Generator().manual_seed(seed + 1000 * case.S_q + case.W)
    H, L, D = case.H, case.S_q, case.D
    q, k, v, do = (torch.randn(1, H, L, D, generator=g, dtype=torch.float64) for _ in range(4))
    bias = torch.randn(H, case.W + 1, generator=g, dtype=torch.float64)
    tau = torch.tensor(case.taus, dtype=torch.float64)
    scale = 1.0 / math.sqrt(D)
    ref = lazy_gradients_autograd(q, k, v, bias, tau, do, scale=scale)
    f = lazy_backward_formulas(q, k, v, bias, tau, do, scale=scale)
    return SimpleNamespace(q=q, k=k, v=v, do=do, bias=bias, tau=tau, scale=scale, ref=ref,
                           formulas={n: t[0] if t.dim() >= 3 and t.shape[0] == 1 else t for n, t in f.items()})


def lazy_backward(fn, *, seed: int = 0, raise_on_fail: bool = True, show: bool = True, verbose=None):
    """Check a one-head lazy-attention backward against autograd, head by head.

    ``fn(q, k, v, bias, tau, do, scale) -> (dq, dk, dv, dbias, dtau)`` with q, k, v, do
    ``[L, D]``, bias ``[W+1]``, tau a 0-d tensor, all float64. (``verbose`` is accepted for
    old notebooks and ignored: a pass prints one line.)
    """
    def run_case(case, x):
        per_head = []
        for h in range(case.H):
            got = fn(x.q[0, h], x.k[0, h], x.v[0, h], x.bias[h], x.tau[h], x.do[0, h], x.scale)
            if not isinstance(got, (tuple, list)) or len(got) != 5:
                raise ShapeError(f"fn must return a tuple (dq, dk, dv, dbias, dtau), got {type(got).__name__}")
            for name, t in zip(NAMES, got):
                if not isinstance(t, torch.Tensor):   # .item(), float(): the value leaves torch
                    idea = (".item() or float() takes a value out of torch (off the device, out of autograd). "
                            "Return the 0-d tensor itself, like tau.")
                    raise ShapeError(f"{name} came back as a Python {type(t).__name__}, not a tensor: {idea}",
                                     idea=idea)
            per_head.append([torch.as_tensor(t, dtype=torch.float64) for t in got])
        outs = {}
        for j, name in enumerate(NAMES):
            parts = [p[j] for p in per_head]
            shapes = {tuple(t.shape) for t in parts}
            if len(shapes) != 1:
                raise ShapeError(f"{name} has different shapes for different heads: {sorted(shapes)}")
            stacked = torch.stack(parts)
            outs[name] = stacked[None] if name in ("dQ", "dK", "dV") else stacked
        expected = {"dQ": x.ref["dQ"], "dK": x.ref["dK"], "dV": x.ref["dV"],
                    "dBias": x.ref["dBias"], "dTau": x.ref["dTau"]}
        return outs, expected, {}

    def variants(case, x):
        v = lazy_variants(x.formulas, x.q[0], x.k[0], x.v[0], x.bias, x.tau, x.do[0], x.scale)
        v.update(lazy_substitutions(x.formulas, x.q[0], x.k[0], x.v[0], x.bias, x.tau, x.do[0], x.scale))
        return {n: {t: (val[None] if t in ("dQ", "dK", "dV") else val) for t, val in outs.items()}
                for n, outs in v.items()}

    return run_battery("check.lazy_backward", fn, LAZY_CASES, run_case, checker=LAZY,
                       dtype=torch.float64, seed=seed, with_do=True, raise_on_fail=raise_on_fail,
                       show=show, variants=variants, make=_make, tol=1e-8)


def lazy_variants(f: dict, q, k, v, bias, tau, do, scale) -> dict:
    """The classic mistakes of the lazy-attention backward, for the heads of one batch element
    (q, k, v, do ``[H, L, D]``, bias ``[H, W+1]``, tau ``[H]``; ``f``: the explicit formulas of
    ``lazy.reference.lazy_backward_formulas`` for them, batch dimension dropped)."""
    from ..lazy.reference import diagonal_sums, lazy_backward_formulas

    L = q.shape[-2]
    W = bias.shape[-1] - 1
    i = torch.arange(L)
    inv = 1.0 / (i + 1).double()
    causal = i[None, :] <= i[:, None]
    P, dP, dA, gate, dS = f["P"], f["dP"], f["dA"], f["gate"], f["dS"]
    dS_wrong_delta = P * (dP - f["delta_wrong"][..., None])
    dP_no_gate = dA * causal
    dS_from_dA = P * (dA - (P * dP).sum(-1, keepdim=True))        # dA where dP = dA * gate belongs
    dS_from_A = f["A"] * (dP - f["delta"][..., None])             # A where the softmax's P belongs
    dS_delta_da = P * (dP - (P * dA).sum(-1, keepdim=True))       # delta from the ungated dA
    lengths = (L - torch.arange(W + 1)).clamp_min(1).double()     # entries on diagonal d (0 past L)
    c = tau.double()[:, None] * inv                                # [H, L]: tau / (i + 1)

    A = f["A"]
    dP2 = dA * (causal & (P + (tau.double()[:, None] / (i + 2).double())[..., None] > 0))
    dPa = dA * (causal & (A + c[..., None] > 0))

    # the forward recomputed with scale 1.0 (the scale left out of its call), dQ and dK scaled after
    f1 = lazy_backward_formulas(q[None], k[None], v[None], bias, tau, do[None], scale=1.0)
    unscaled = {"dQ": f1["dQ"][0] * scale, "dK": f1["dK"][0] * scale, "dV": f1["dV"][0],
                "dBias": f1["dBias"], "dTau": f1["dTau"]}

    def from_ds(dS_):   # the gradients that follow from a (wrong) dS
        return {"dQ": dS_ @ k * scale, "dK": dS_.transpose(-1, -2) @ q * scale, "dBias": diagonal_sums(dS_, W)}

    def from_dp(dP_):   # every gradient that follows from a (wrong) dP, delta taken from it
        return {**from_ds(P * (dP_ - (P * dP_).sum(-1, keepdim=True))), "dTau": (dP_.sum(-1) * inv).sum(-1)}
    return {
        "lazy_delta": from_ds(dS_wrong_delta),
        "lazy_gate": from_dp(dP_no_gate),
        # no gate at all, not even the causal one (dP = dA): dTau sums dA over hidden keys too
        "lazy_gate:ungated": from_dp(dA),
        "lazy_scale": {"dQ": dS @ k, "dK": dS.transpose(-1, -2) @ q},
        "lazy_recompute_unscaled": unscaled,
        # the gate as the ReLU's value, relu(P + c), where its derivative (the indicator) belongs
        "lazy_gate_value": from_dp(dA * causal * torch.relu(P + c[..., None])),
        # bias[d] for d = W ... 0: the diagonals in reverse order
        "lazy_dbias_reversed": {"dBias": diagonal_sums(dS, W).flip(-1)},
        "lazy_dk_transpose": {"dK": dS @ q * scale},
        "lazy_dv": {"dV": P.transpose(-1, -2) @ do},
        "lazy_dbias_diagonals": {"dBias": diagonal_sums(dS.transpose(-1, -2), W)},
        "lazy_dtau_count": {"dTau": (dA * gate).sum((-2, -1))},
        "lazy_dtau_gate": {"dTau": ((dA * causal).sum(-1) * inv).sum(-1)},
        "lazy_dtau_causal": {"dTau": (dA.sum(-1) * inv).sum(-1)},
        "lazy_ds_from_da": from_ds(dS_from_dA),
        "lazy_ds_from_a": from_ds(dS_from_A),
        "lazy_dbias_from_dp": {"dBias": diagonal_sums(dP, W)},
        # the ReLU's gate without the causal condition: hidden entries (P = 0) pass where c > 0
        "lazy_gate_not_causal": {"dTau": ((dA * (P + c[..., None] > 0)).sum(-1) * inv).sum(-1)},
        # c = tau / (i + 1) lined up with the keys (columns) in the gate
        "lazy_gate_c_column": from_dp(dA * (causal & (P + c[:, None, :] > 0))),
        "lazy_delta_from_da": from_ds(dS_delta_da),
        "lazy_dbias_mean": {"dBias": diagonal_sums(dS, W) / lengths},
        # dP = dA.masked_fill(gate, 0): the gate the wrong way round
        "lazy_gate_inverted": from_dp(dA * ~gate),
        # diagonals 1 ... W + 1 where 0 ... W belong (range(1, W + 2))
        "lazy_dbias_shifted": {"dBias": diagonal_sums(dS, W + 1)[..., 1:]},
        # 1/(i+1) lined up with the columns: (dP / (i + 1)) divides column j by j + 1
        "lazy_dtau_broadcast": {"dTau": (dP * inv[None, :]).sum((-2, -1))},
        # the gate's causal mask transposed (i <= j): the future passes, the past is cut
        "lazy_gate_causal_transposed": from_dp(dA * (causal.T & (P + c[..., None] > 0))),
        # P - c > 0 where the ReLU's argument is P + c
        "lazy_gate_sign": from_dp(dA * (causal & (P - c[..., None] > 0))),
        # positions 1 ... L where the formulas already add 1: c = tau / (i + 2), dTau / (i + 2)
        "lazy_positions_one_based": {**from_ds(P * (dP2 - (P * dP2).sum(-1, keepdim=True))),
                                     "dTau": (dP2.sum(-1) / (i + 2).double()).sum(-1)},
        # (P, A, O) unpacked as (A, P, O): the ReLU's output where the softmax belongs, and back
        "lazy_p_a_swapped": {**from_ds(A * (dPa - (A * dPa).sum(-1, keepdim=True))),
                             "dV": P.transpose(-1, -2) @ do, "dTau": (dPa.sum(-1) * inv).sum(-1)},
        # delta without keepdim: [L] lines up with the columns, key j gets delta_j
        "lazy_delta_columns": from_ds(P * (dP - (P * dP).sum(-1)[..., None, :])),
        "lazy_dk_operand_k": {"dK": dS.transpose(-1, -2) @ k * scale},
        "lazy_dbias_from_da": {"dBias": diagonal_sums(dA, W)},
        # delta = (P * dP).sum(): one number for the head's whole matrix
        "lazy_delta_scalar": from_ds(P * (dP - (P * dP).sum((-2, -1), keepdim=True))),
        # the gate applied to dS too: dS = P * (dP - delta) * gate
        "lazy_ds_gated": from_ds(dS * gate),
        # dP - delta in place (dP.sub_(delta)) before dTau reads dP
        "lazy_dp_modified": {"dTau": ((dP - f["delta"][..., None]).sum(-1) * inv).sum(-1)},
        # // for /: each row's dP sum divided by i + 1 and rounded down
        "lazy_dtau_floor": {"dTau": torch.floor(dP.sum(-1) * inv).sum(-1)},
        # the last diagonal (d = W) left at 0: a guard d < W where d < L belongs
        "lazy_dbias_last_zero": {"dBias": torch.cat([diagonal_sums(dS, W)[..., :-1],
                                                     torch.zeros_like(diagonal_sums(dS, W)[..., -1:])], -1)},
        # the matrix's last diagonal (d = L - 1, one entry) left at 0: a guard d < L - 1 where d < L belongs
        "lazy_dbias_corner_zero": {"dBias": diagonal_sums(dS, W) * (torch.arange(W + 1) != L - 1)},
        # dTau with c = tau / (i + 1) where its derivative 1 / (i + 1) belongs: tau times the right one
        "lazy_dtau_times_tau": {"dTau": (dP.sum(-1) * inv).sum(-1) * tau.double()},
        # tril(dS, -d).sum(): every diagonal from d on, not diagonal d alone
        "lazy_dbias_cumulative": {"dBias": diagonal_sums(dS, max(W, L - 1)).flip(-1).cumsum(-1).flip(-1)[..., :W + 1]},
        # the diagonals past W added into dBias[W]: the forward's lookup bias[min(d, W)] without its d <= W
        "lazy_dbias_clamped": {"dBias": diagonal_sums(dS, W) + torch.nn.functional.pad(
            diagonal_sums(dS, max(W, L - 1))[..., W + 1:].sum(-1, keepdim=True), (W, 0))},
    }


#: the lazy backward's chain: slot -> (what it holds, the formula it sits in)
_LAZY_SLOTS = {
    "dV.A": ("A", "dV = A^T dO"), "dV.dO": ("dO", "dV = A^T dO"),
    "dA.dO": ("dO", "dA = dO V^T"), "dA.V": ("V", "dA = dO V^T"),
    "gate.P": ("P", "gate = causal & (P + c > 0)"), "dP.dA": ("dA", "dP = dA * gate"),
    "delta.P": ("P", "delta = rowsum(P * dP)"), "delta.dP": ("dP", "delta = rowsum(P * dP)"),
    "dS.P": ("P", "dS = P * (dP - delta)"), "dS.dP": ("dP", "dS = P * (dP - delta)"),
    "dQ.dS": ("dS", "dQ = dS K * scale"), "dQ.K": ("K", "dQ = dS K * scale"),
    "dK.dS": ("dS", "dK = dS^T Q * scale"), "dK.Q": ("Q", "dK = dS^T Q * scale"),
    "dBias.dS": ("dS", "dBias[d] = the sum of dS's d-th diagonal"),
    "dTau.dP": ("dP", "dTau = sum over i of rowsum(dP)_i / (i + 1)"),
}


def lazy_substitutions(f: dict, q, k, v, bias, tau, do, scale) -> dict:
    """The lazy backward with any ONE slot of its chain (the A in dV = A^T dO, the Q in dK = dS^T Q,
    the dS whose diagonals make dBias, ...) refilled with another tensor of the same shape, each
    later step computed from it: ``"lazy_subst:<label>"`` -> the outputs that change. The classic
    ones are fingerprints of their own (:func:`lazy_variants`); this names the rest of the class."""
    from ..lazy.reference import diagonal_sums

    L, W = q.shape[-2], bias.shape[-1] - 1
    i = torch.arange(L)
    inv = 1.0 / (i + 1).double()
    causal = i[None, :] <= i[:, None]
    c = tau.double()[:, None] * inv                                   # [H, L]: tau / (i + 1)
    fixed = {"Q": q, "K": k, "V": v, "dO": do, "O": f["O"], "P": f["P"], "A": f["A"],
             "dA": f["dA"], "dP": f["dP"], "dS": f["dS"]}       # recomputed below from the swap on
    shapes = {"Q": "row", "K": "row", "V": "row", "dO": "row", "O": "row",
              "P": "square", "A": "square", "dA": "square", "dP": "square", "dS": "square"}
    reaches = {"dV": ("dV",), "dA": ("dQ", "dK", "dBias", "dTau"), "gate": ("dQ", "dK", "dBias", "dTau"),
               "dP": ("dQ", "dK", "dBias", "dTau"), "delta": ("dQ", "dK", "dBias"), "dS": ("dQ", "dK", "dBias"),
               "dQ": ("dQ",), "dK": ("dK",), "dBias": ("dBias",), "dTau": ("dTau",)}

    def chain(slot, other):
        cur = dict(fixed)
        get = lambda s: cur[other if s == slot else _LAZY_SLOTS[s][0]]  # noqa: E731
        out = {"dV": get("dV.A").transpose(-1, -2) @ get("dV.dO")}
        cur["dA"] = get("dA.dO") @ get("dA.V").transpose(-1, -2)
        gate = causal & (get("gate.P") + c[..., None] > 0)
        cur["dP"] = get("dP.dA") * gate
        delta = (get("delta.P") * get("delta.dP")).sum(-1, keepdim=True)
        cur["dS"] = get("dS.P") * (get("dS.dP") - delta)
        out.update(dQ=get("dQ.dS") @ get("dQ.K") * scale, dK=get("dK.dS").transpose(-1, -2) @ get("dK.Q") * scale,
                   dBias=diagonal_sums(get("dBias.dS"), W), dTau=(get("dTau.dP").sum(-1) * inv).sum(-1))
        return {n: out[n] for n in reaches[slot.split(".")[0]]}

    found = {}
    for slot, (held, formula) in _LAZY_SLOTS.items():
        for other, kind in shapes.items():
            if other != held and kind == shapes[held]:
                found[f"lazy_subst:{other} in place of {held} in {formula}"] = chain(slot, other)
    return found
