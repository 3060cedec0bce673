"""One tensor in another's place: the backward recomputed with any ONE operand (or argument)
replaced by another tensor of the same shape, or one product's transpose flipped.

The fingerprints of :mod:`flashattn.check.fingerprints` list classic mistakes one by one. This
module generates the whole class instead, so a mistake nobody listed still gets named: the
backward is one chain of products,

    S = Q K^T * scale      P = exp(S - LSE)       dP = dO V^T      delta = rowsum(dO * O)
    dS = P * (dP - delta)  dQ = dS K * scale      dK = dS^T Q * scale      dV = P^T dO

and every *slot* of it (the K in dQ = dS K, the dO in dP = dO V^T, the LSE in P, ...) is
refilled with each other tensor of the same shape. An *argument* fills all its slots of one
kernel (a kernel handed O where dO belongs uses it in dP and in dV). A learner's outputs that
equal one of these, in every case where that swap is possible, name the swap exactly.
"""
from __future__ import annotations

import torch

from ..reference import repeat_kv, sum_groups
from .battery import Case
from .checkers import AUTOGRAD, BACKWARD, DKDV, DQ, KERNELS

#: the slots of the chain: slot -> (the tensor it holds, the formula it sits in)
SLOTS = {
    "S.q": ("Q", "S = Q K^T"), "S.k": ("K", "S = Q K^T"),
    "dP.do": ("dO", "dP = dO V^T"), "dP.v": ("V", "dP = dO V^T"),
    "dQ.k": ("K", "dQ = dS K"), "dK.q": ("Q", "dK = dS^T Q"), "dV.do": ("dO", "dV = P^T dO"),
    "delta.do": ("dO", "delta = rowsum(dO * O)"), "delta.o": ("O", "delta = rowsum(dO * O)"),
    "P.lse": ("LSE", "P = exp(S - LSE)"), "dS.delta": ("delta", "dS = P * (dP - delta)"),
}

#: the outputs each slot reaches (what a swap there can change)
_REACHES = {"S.q": "QKV", "S.k": "QKV", "P.lse": "QKV", "dP.do": "QK", "dP.v": "QK", "delta.do": "QK",
            "delta.o": "QK", "dS.delta": "QK", "dQ.k": "Q", "dK.q": "K", "dV.do": "V"}

#: per checker: the arguments each kernel call takes, and the slots each fills
_CALLS = {
    DQ: {"the dQ kernel": {"Q": ["S.q"], "K": ["S.k", "dQ.k"], "V": ["dP.v"], "dO": ["dP.do"]}},
    DKDV: {"the dK/dV kernel": {"Q": ["S.q", "dK.q"], "K": ["S.k"], "V": ["dP.v"], "dO": ["dP.do", "dV.do"]}},
    BACKWARD: {"your function": {"Q": ["S.q", "dK.q"], "K": ["S.k", "dQ.k"], "V": ["dP.v"],
                                   "dO": ["dP.do", "dV.do", "delta.do"], "O": ["delta.o"]}},
}
_CALLS[AUTOGRAD] = {"the dQ call": _CALLS[DQ]["the dQ kernel"],
                    "the dK/dV call": _CALLS[DKDV]["the dK/dV kernel"],
                    "the delta call": {"dO": ["delta.do"], "O": ["delta.o"]}}
# slots a checker's own code computes (the kernels get delta ready-made)
_OWN_SLOTS = {DQ: ("S.q", "S.k", "dP.do", "dP.v", "dQ.k", "P.lse", "dS.delta"),
              DKDV: ("S.q", "S.k", "dP.do", "dP.v", "dK.q", "dV.do", "P.lse", "dS.delta"),
              BACKWARD: tuple(SLOTS), AUTOGRAD: tuple(SLOTS)}
_OUTPUTS = {DQ: ("dQ",), DKDV: ("dK", "dV"), BACKWARD: ("dQ", "dK", "dV"), AUTOGRAD: ("dQ", "dK", "dV")}
_CALL_OUTPUTS = {"the dQ call": ("dQ",), "the dK/dV call": ("dK", "dV"), "the delta call": ("dQ", "dK")}


def _pool(case: Case, x) -> dict:
    """The tensors a slot can be refilled with, in float64, K and V repeated to every query head,
    and whether each lives on the query side (rows S_q) or the key side (S_k)."""
    ref, H = x.ref, case.H
    f64 = lambda t: t.to(torch.float64)  # noqa: E731
    return {"Q": f64(x.q), "K": repeat_kv(f64(x.k), H), "V": repeat_kv(f64(x.v), H),
            "dO": ref.dO, "O": ref.O, "LSE": ref.LSE, "delta": ref.delta,
            "ones": torch.ones_like(ref.dO)}      # torch.ones_like(o) for dO: the loss out.sum()'s dO, assumed


def _fits(case: Case, a: str, b: str) -> bool:
    """Whether tensor ``b`` has the shape of ``a`` in this case (a kernel or function given b for
    a runs without error there): the same side, or S_q == S_k and H == H_kv."""
    if {a, b} <= {"LSE", "delta"}:
        return True
    if "LSE" in (a, b) or "delta" in (a, b):
        return False
    if b == "ones":
        return a == "dO"
    side = lambda n: "q" if n in ("Q", "dO", "O") else "k"  # noqa: E731
    return side(a) == side(b) or (case.S_q == case.S_k and case.H == case.heads_kv)


def chain(case: Case, T: dict, fill: dict, flip: str = "") -> dict:
    """dQ, dK, dV of the backward with slot -> tensor name ``fill`` (the rest as they belong),
    and ``flip`` the one product whose transpose is flipped ('dV', 'dK', 'dQ' or 'dP')."""
    get = lambda slot: T[fill.get(slot, SLOTS[slot][0])]  # noqa: E731
    s, Hk = case.scale_value, case.heads_kv
    visible = torch.isfinite(T["_S"])
    S = get("S.q") @ get("S.k").transpose(-1, -2) * s
    P = torch.where(visible, torch.exp(S - get("P.lse")[..., None]), 0.0)
    dP = get("dP.do") @ get("dP.v").transpose(-1, -2)
    if flip == "dP":
        dP = dP.transpose(-1, -2)
    if "delta.do" in fill or "delta.o" in fill:
        delta = (get("delta.do") * get("delta.o")).sum(-1)
    else:
        delta = get("dS.delta")
    dS = P * (dP - delta[..., None])
    t = lambda m, f: m if flip == f else m.transpose(-1, -2)  # noqa: E731   (the transposed product)
    dq = (dS.transpose(-1, -2) if flip == "dQ" else dS) @ get("dQ.k") * s
    return {"dQ": dq, "dK": sum_groups(t(dS, "dK") @ get("dK.q"), Hk) * s,
            "dV": sum_groups(t(P, "dV") @ get("dV.do"), Hk)}


def variants(case: Case, x, checker) -> list:
    """[(label, outputs it changes, {output: tensor})]: every one-slot swap, every one-argument
    swap of each kernel call, and every flipped transpose that the case's shapes allow."""
    if checker not in _CALLS or x.ref.dO is None:
        return []
    T = _pool(case, x)
    T["_S"] = x.ref.S
    out, seen = [], set()

    def add(label, fill, outputs, flip=""):
        key = (tuple(sorted(fill.items())), flip)
        if key in seen:
            return
        seen.add(key)
        got = chain(case, T, fill, flip)
        out.append((label, tuple(n for n in outputs if n in _OUTPUTS[checker]), got))

    for slot in _OWN_SLOTS[checker]:
        a, formula = SLOTS[slot]
        for b in T:
            if b != a and not b.startswith("_") and _fits(case, a, b):
                reach = tuple("d" + c for c in _REACHES[slot])
                add(f"{_pretty(reach, checker)} the formula with {b} in place of {a} in {formula}", {slot: b}, reach)
    for call, args in _CALLS[checker].items():
        outputs = _CALL_OUTPUTS.get(call, _OUTPUTS[checker])
        for a, slots in args.items():
            if len(slots) < 2 and checker is not AUTOGRAD:
                continue                      # one slot: the one-slot swap above says it
            for b in ("Q", "K", "V", "dO", "O"):
                if b != a and _fits(case, a, b) and not (b == "O" and checker in KERNELS):
                    add(f"{_pretty(outputs, checker)} what {call} computes when given {b} in place of {a}",
                        {slot: b for slot in slots}, outputs)
    # a per-row statistic with the scale put on it once more (or divided out): the LSE and
    # delta belong to the scaled scores already
    for slot in ("P.lse", "dS.delta"):
        if slot in _OWN_SLOTS[checker]:
            a, formula = SLOTS[slot]
            reach = tuple("d" + c for c in _REACHES[slot])
            for said, factor in ((f"{a} * scale", case.scale_value), (f"{a} / scale", 1 / case.scale_value)):
                T[said] = T[a] * factor
                add(f"{_pretty(reach, checker)} the formula with {said} in place of {a} in {formula}", {slot: said}, reach)
    if case.S_q == case.S_k:                  # a product without its transpose keeps its shape
        for flip, formula in (("dV", "dV = P dO (P where P^T belongs)"), ("dK", "dK = dS Q (dS where dS^T belongs)"),
                              ("dQ", "dQ = dS^T K (dS^T where dS belongs)"), ("dP", "dP = V dO^T (transposed)")):
            reach = {"dV": ("dV",), "dK": ("dK",), "dQ": ("dQ",), "dP": ("dQ", "dK")}[flip]
            add(f"{_pretty(reach, checker)} {formula}", {}, reach, flip)
    return out


def _pretty(outputs, checker) -> str:
    names = [n for n in outputs if n in _OUTPUTS[checker]]
    return (" and ".join(names) + (" equal" if len(names) > 1 else " equals")) if names else "nothing equals"


def matching(case: Case, x, checker, tensors: dict, tol: float, match, expected=None) -> set:
    """The labels (``subst:<label>``) of the swaps that explain this case exactly: every output
    the swap changes equals the swap's value, every other output is right, and the swap's value
    is not the right one (``expected``; two equal tensors swapped change nothing)."""
    from .fingerprints import distinct

    wrong = {n for n, t in tensors.items() if not t.ok}
    if not wrong:
        return set()
    found = set()
    for label, outputs, got in variants(case, x, checker):
        if not wrong <= set(outputs):
            continue
        got = {n: g.to(x.q.dtype).to(torch.float64) for n, g in got.items()}
        if not distinct(got, expected, wrong, tol):
            continue
        if all(match(tensors[n].actual, got[n], tol) for n in wrong):
            found.add("subst:" + label)
    return found


def possible(case: Case, label: str) -> bool:
    """Whether the swap named ``label`` can happen in this case (its tensors have equal shapes)."""
    names = [w for w in label.replace(",", " ").split() if w in ("Q", "K", "V", "dO", "O", "LSE", "delta")]
    if "transpose" in label or "where P^T" in label or "where dS" in label:
        return case.S_q == case.S_k
    if " in place of " not in label:
        return True
    b, a = label.split(" in place of ")[0].split()[-1], label.split(" in place of ")[1].split()[0]
    return _fits(case, a, b) if a in names and b in names else True
