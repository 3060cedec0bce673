"""Lesson 11's exercise checkers (solutions/11): the merge of two partial results, and the ring's
backward simulated in one process.

* :func:`merge_partials` -- ``fn(o_a, lse_a, o_b, lse_b) -> (o, lse)``: two partial attention
  results over disjoint key blocks (o ``[B, H, S, D]`` fp16 or fp32, lse ``[B, H, S]`` fp32, -inf
  and o = 0 on a row that saw no key of its block) merged into one, both fp32.
* :func:`ring_backward` -- ``fn(q, k, v, o, do, lse, positions, causal, scale) -> (dq, dk, dv)``:
  every argument but the last two a list of W per-rank shards (``flashattn.distributed.simulate``
  plays the ring in one process), positions the global token positions of each rank's shard;
  returns each rank's own gradients, fp32.

Both compare with float64: the merged (O, LSE) with the attention over both blocks' keys, the
gradients (the shards pasted back into whole tensors, so a table's rows are the sequence's
positions) with the backward of the whole sequence. The classic mistakes are fingerprinted by
running the merge or the ring with the slip put in (:func:`merge_slips`, :func:`simulate`); the
diagnoses are in :mod:`flashattn.check.mistakes.ring_formulas`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..distributed.layout import cut, paste, positions
from ..distributed.simulate import block_grads, ring_pass
from ..reference import attention_reference
from .battery import Case
from .checkers import MERGE, RING
from .errors import DtypeError, ShapeError
from .runner import inputs_changed, run_battery, snapshot_inputs

#: the outputs are fp32 whatever the inputs' dtype: held to fp32's tolerance in every case, so
#: that a merge or an accumulation in fp16 shows
TOL = 1e-4


# --------------------------------------------------------------------------------------
# the merge
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MergeCase(Case):
    spread: float = 3.0           # the LSEs' spread: large values overflow exp() in fp32
    masked: str = ""              # rows with LSE = -inf: "a" in the first partial, "both" some in each and in both
    o_dtype: torch.dtype = torch.float32


def _merge_case(name, B, H, S, D, **kw) -> MergeCase:
    return MergeCase(name, B, H, S, S, D, False, **kw)


MERGE_CASES = (
    _merge_case("2x3x13, fp32", 2, 3, 13, 8),
    _merge_case("1x2x7, o in fp16", 1, 2, 7, 16, o_dtype=torch.float16),
    _merge_case("1x2x9, LSEs near 200 (exp overflows)", 1, 2, 9, 8, spread=60.0),
    _merge_case("2x2x11, rows masked in a", 2, 2, 11, 8, masked="a"),
    _merge_case("1x3x12, rows masked in a, b, both", 1, 3, 12, 8, masked="both"),
    _merge_case("1x1x1, one row", 1, 1, 1, 4),
)


def _merge_make(case: MergeCase, dtype, device, seed, with_do):
    """Two partial results of real attention: one set of keys cut into blocks a and b, each
    block's (O, LSE) computed in float64 (then O in the case's dtype, the LSE in fp32); masked
    rows see no key of their block."""
    g = torch.Generator().manual_seed(seed + 7 * case.S_q + 101 * case.B + 13 * case.H + int(case.spread))
    B, H, S, D = case.B, case.H, case.S_q, case.D
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, 10, D, generator=g, dtype=torch.float64) for _ in range(2))
    # a per-row shift of each block's scores: the LSEs then lie far apart, in both directions
    shift = torch.randn(2, B, H, S, 1, generator=g, dtype=torch.float64) * case.spread
    if case.spread > 10:
        shift = shift + 3 * case.spread
    seen = torch.ones(2, S, dtype=torch.bool)
    if case.masked:
        seen[0, ::3] = False                               # rows 0, 3, 6, ... see nothing of block a
        if case.masked == "both":
            seen[1, 1::3] = False                          # rows 1, 4, ... nothing of block b
            seen[1, ::6] = False                           # rows 0, 6, ...: nothing at all
    parts = []
    for i, keys in enumerate((slice(0, 4), slice(4, 10))):
        s = q @ k[:, :, keys].transpose(-1, -2) / math.sqrt(D) + shift[i]
        s = s.masked_fill(~seen[i][:, None], -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # a row with no key: P = 0, so O = 0
        parts.append((p @ v[:, :, keys], lse))
    (o_a, lse_a), (o_b, lse_b) = parts
    x = SimpleNamespace(o_a=o_a.to(case.o_dtype), lse_a=lse_a.float(), o_b=o_b.to(case.o_dtype), lse_b=lse_b.float())
    # the reference: the exact merge of the partials as handed over (o in fp16 rounded, the LSEs
    # in fp32), in float64 -- the merge itself adds no error beyond fp32's rounding
    la, lb = x.lse_a.double(), x.lse_b.double()
    lse = torch.logaddexp(la, lb)
    share = lambda l: torch.exp(l - lse).nan_to_num(0.0)[..., None]     # noqa: E731 -- a row that saw nothing: 0
    o = x.o_a.double() * share(la) + x.o_b.double() * share(lb)
    x.expected = {"O": o, "LSE": lse}
    return x


def _finite_lse(lse: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """The LSE as compared: -inf where -inf belongs (a row that saw no key) counts as 0 there,
    and anything else there (NaN, a number) stays and fails. (A relative error of -inf against
    -inf is NaN: the comparison could not tell right from wrong.)"""
    lse = lse.detach().to("cpu", torch.float64)
    return torch.where(torch.isneginf(expected) & torch.isneginf(lse), 0.0, lse)


def merge_slips(x, case: MergeCase) -> dict:
    """Name -> {"O", "LSE"} of each classic slip, computed in fp32 as a learner's merge runs."""
    a, b = x.o_a.float(), x.o_b.float()
    la, lb = x.lse_a, x.lse_b
    d = la - lb
    d0 = torch.nan_to_num(d, nan=0.0)
    right_lse = torch.maximum(la, lb) + torch.log1p(torch.exp(-d0.abs()))
    w, w_b = torch.sigmoid(d0)[..., None], torch.sigmoid(-d0)[..., None]
    out = {}

    def add(name, o, lse):
        out[name] = {"O": o, "LSE": _finite_lse(lse, x.expected["LSE"])}

    naive_lse = torch.log(torch.exp(la) + torch.exp(lb))                # exp of a large LSE is inf
    add("merge_overflow", a * torch.exp(la - naive_lse)[..., None] + b * torch.exp(lb - naive_lse)[..., None],
        naive_lse)
    # the safe form with d = -inf - (-inf) = NaN left in, on the rows both partials missed
    add("merge_masked_rows", a * torch.sigmoid(d)[..., None] + b * torch.sigmoid(-d)[..., None],
        torch.maximum(la, lb) + torch.log1p(torch.exp(-d.abs())))
    add("merge_exp_weights", a * torch.exp(d0)[..., None] + b * torch.exp(-d0)[..., None], right_lse)
    # a row empty in one partial (d = +-inf) treated like one empty in both: weights 1/2 each
    one = torch.where(torch.isinf(la) | torch.isinf(lb), 0.0, d0)
    w1 = torch.sigmoid(one)[..., None]
    add("merge_one_empty", a * w1 + b * torch.sigmoid(-one)[..., None],
        torch.maximum(la, lb) + torch.log1p(torch.exp(-one.abs())))
    add("merge_weights_swapped", a * w_b + b * w, right_lse)
    add("merge_lse_max", a * w + b * w_b, torch.maximum(la, lb))
    add("merge_lse_signed", a * w + b * w_b, torch.maximum(la, lb) + torch.log1p(torch.exp(-d0)))
    add("merge_lse_added", a * w + b * w_b, la + lb)
    add("merge_log_for_log1p", a * w + b * w_b, torch.maximum(la, lb) + torch.log(torch.exp(-d0.abs())))
    add("merge_average", (a + b) / 2, right_lse)
    if case.o_dtype != torch.float32:                                    # the merge in o's own dtype
        dt = case.o_dtype
        add("merge_low_precision", (x.o_a * w.to(dt) + x.o_b * w_b.to(dt)).float(), right_lse)
    return out


def merge_partials(fn, *, seed: int = 0, raise_on_fail: bool = True, show: bool = True):
    """Check ``fn(o_a, lse_a, o_b, lse_b) -> (o, lse)``, the merge of two partial results.

    o_a, o_b ``[B, H, S, D]`` (fp32, or fp16 in one case), lse_a, lse_b ``[B, H, S]`` fp32: the
    output and log-sum-exp of attention over two disjoint blocks of keys. A row that saw no key of
    a block has LSE = -inf and O = 0 there. Returns O and LSE of attention over both blocks, fp32.
    The cases: several batches and heads, o in fp16, LSEs near 200 (exp() overflows in fp32),
    rows masked in one partial, in the other, in both, one row.
    """
    def run_case(case, x):
        handed = {n: getattr(x, n).clone() for n in ("o_a", "lse_a", "o_b", "lse_b")}
        before = snapshot_inputs(handed)
        got = fn(*handed.values())
        modified = inputs_changed(before, handed)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise ShapeError(f"fn must return a tuple (o, lse), got {type(got).__name__}")
        o, lse = got
        for name, t in (("o", o), ("lse", lse)):
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise DtypeError(f"{name} has dtype {t.dtype}, expected torch.float32 (the merge runs in fp32, "
                                 f"whatever o's dtype)")
        return ({"O": o, "LSE": _finite_lse(lse, x.expected["LSE"]) if lse.shape == x.expected["LSE"].shape else lse},
                {"O": x.expected["O"], "LSE": _finite_lse(x.expected["LSE"], x.expected["LSE"])},
                {"inputs_modified": modified})

    return run_battery("check.merge_partials", fn, MERGE_CASES, run_case, checker=MERGE, dtype=torch.float32,
                       seed=seed, with_do=False, raise_on_fail=raise_on_fail, show=show,
                       variants=lambda case, x: merge_slips(x, case), make=_merge_make, tol=TOL)


# --------------------------------------------------------------------------------------
# the ring's backward, in one process
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingCase(Case):
    W: int = 2
    ring_layout: str = "contiguous"


def _ring_case(W, ring_layout, causal, n, B=1, H=2, H_kv=None, D=8, dtype=None, scale=None) -> RingCase:
    """W ranks of n tokens each (S = W n)."""
    name = (f"W={W} {ring_layout} {'causal' if causal else 'not causal'} {B}x{H}x{W * n}"
            + (f" GQA {H}/{H_kv}" if H_kv else "") + (" fp16" if dtype == torch.float16 else "")
            + (f" scale {scale}" if scale else ""))
    return RingCase(name, B, H, W * n, W * n, D, causal, scale=scale, H_kv=H_kv, dtype=dtype, W=W,
                    ring_layout=ring_layout)


RING_CASES = (
    _ring_case(2, "contiguous", True, 5),                       # shards of 5: odd
    _ring_case(3, "zigzag", True, 6),                           # chunks of 3
    _ring_case(4, "contiguous", False, 3, B=2),
    _ring_case(2, "zigzag", True, 6, H=4, H_kv=2),              # GQA: dK, dV sum a group's query heads
    _ring_case(3, "contiguous", True, 4, dtype=torch.float16),  # fp16 inputs, fp32 gradients
    _ring_case(1, "contiguous", True, 7),                       # a ring of one
    _ring_case(4, "zigzag", True, 4, B=2, scale=0.3),
    _ring_case(3, "zigzag", False, 4),
)


def _ring_make(case: RingCase, dtype, device, seed, with_do):
    """Whole tensors in the case's dtype, O and LSE of the whole sequence (the float64 forward,
    then O in the inputs' dtype, LSE fp32), each cut into the W ranks' shards."""
    g = torch.Generator().manual_seed(seed + 1009 * case.W + 31 * case.S_q + 7 * case.H + int(case.causal))
    B, H, Hk, S, D = case.B, case.H, case.heads_kv, case.S_q, case.D
    q, do = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, Hk, S, D, generator=g).to(dtype) for _ in range(2))
    ref = attention_reference(q.to(device), k.to(device), v.to(device), do.to(device), causal=case.causal,
                              scale=case.scale_value)
    whole = {"q": q, "k": k, "v": v, "o": ref.O.to(dtype).cpu(), "do": do, "lse": ref.LSE.float().cpu()}
    W, lay = case.W, case.ring_layout
    x = SimpleNamespace(**{n: [cut(t, r, W, lay, 2).to(device) for r in range(W)] for n, t in whole.items()})
    x.positions = [positions(r, W, S, lay) for r in range(W)]
    # the reference: the backward of the whole sequence, in float64, from the inputs as handed
    # over (O in fp16 is rounded, and delta = rowsum(dO * O) with it): no ring, one block
    f64 = {n: t.double() for n, t in whole.items()}
    every = torch.arange(S)
    dq, dk, dv = block_grads(f64["q"], f64["k"], f64["v"], f64["do"], f64["lse"],
                             (f64["do"] * f64["o"]).sum(-1), every, every, case.causal, case.scale_value)
    x.expected = {"dQ": dq, "dK": dk, "dV": dv}
    return x


def simulate(x, case: RingCase, slip: str = "") -> dict:
    """The ring's backward in float64, as the exercise's solution runs it -- or with one classic
    ``slip`` put in -- pasted into whole dQ, dK, dV."""
    W = case.W
    f = lambda ts: [t.to("cpu", torch.float64) for t in ts]       # noqa: E731
    q, k, v, o, do, lse = (f(getattr(x, n)) for n in ("q", "k", "v", "o", "do", "lse"))
    pos = x.positions
    delta = [(do[r] * o[r]).sum(-1) for r in range(W)]
    dq = [torch.zeros_like(q[r]) for r in range(W)]
    k_here, v_here = list(k), list(v)
    kept_k, kept_v = [torch.zeros_like(k[r]) for r in range(W)], [torch.zeros_like(v[r]) for r in range(W)]
    dk_here, dv_here = [torch.zeros_like(k[r]) for r in range(W)], [torch.zeros_like(v[r]) for r in range(W)]
    steps = W - 1 if slip == "ring_one_step_short" else W
    for step in range(steps):
        if slip == "ring_dkdv_reset":
            dk_here, dv_here = [torch.zeros_like(k[r]) for r in range(W)], [torch.zeros_like(v[r]) for r in range(W)]
        for r in range(W):
            s = (r - step) % W
            if slip == "ring_source_index":
                s = (r + step) % W
            lse_r = lse[s] if slip == "ring_lse_of_source" else lse[r]
            delta_r = delta[s] if slip == "ring_delta_of_source" else delta[r]
            k_pos = pos[r] if slip == "ring_key_positions" else pos[s]
            kv = (v_here[r], k_here[r]) if slip == "ring_kv_swapped" else (k_here[r], v_here[r])
            dq_b, dk_b, dv_b = block_grads(q[r], *kv, do[r], lse_r, delta_r, pos[r], k_pos, case.causal,
                                           case.scale_value)
            dq[r] = dq_b if slip == "ring_dq_overwritten" else dq[r] + dq_b
            if slip == "ring_dkdv_kept":
                kept_k[r], kept_v[r] = kept_k[r] + dk_b, kept_v[r] + dv_b
            else:
                at = s if slip == "ring_dkdv_by_source" else r        # the slot of the rank the block came from
                dk_here[at], dv_here[at] = dk_here[at] + dk_b, dv_here[at] + dv_b
        if step + 1 < W and slip != "ring_stale_kv":
            k_here, v_here = ring_pass(k_here), ring_pass(v_here)
        if step + 1 < W or slip != "ring_dkdv_not_home":
            dk_here, dv_here = ring_pass(dk_here), ring_pass(dv_here)
    if slip == "ring_dkdv_kept":
        dk_here, dv_here = kept_k, kept_v
    whole = lambda ts: paste([t.cpu() for t in ts], W, case.ring_layout, 2)     # noqa: E731
    return {"dQ": whole(dq), "dK": whole(dk_here), "dV": whole(dv_here)}


RING_SLIPS = ("ring_stale_kv", "ring_source_index", "ring_key_positions", "ring_kv_swapped", "ring_lse_of_source",
              "ring_delta_of_source", "ring_one_step_short", "ring_dkdv_not_home", "ring_dkdv_kept",
              "ring_dkdv_by_source", "ring_dkdv_reset", "ring_dq_overwritten")


def ring_backward(fn, *, seed: int = 0, raise_on_fail: bool = True, show: bool = True):
    """Check ``fn(q, k, v, o, do, lse, positions, causal, scale) -> (dq, dk, dv)``, the ring's
    backward over W ranks simulated in one process.

    q, k, v, o, do, lse: lists of W shards, rank r's at index r (q, o, do ``[B, H, n, D]``; k, v
    ``[B, H_kv, n, D]``; lse ``[B, H, n]`` fp32, the *global* LSE of the rows); positions: W int64
    tensors ``[n]``, the global positions of each rank's tokens; ``causal`` a bool, ``scale`` a
    float. Returns three lists of W fp32 shards: each rank's own dQ, dK, dV.
    The cases: W = 1 to 4, contiguous and zigzag layouts, causal and not, odd shard lengths,
    GQA, fp16 inputs, two batches, a custom scale. In the table, the gradients are the whole
    sequence's (the shards pasted back in order).
    """
    def run_case(case, x):
        handed = {n: [t.clone() for t in getattr(x, n)] for n in ("q", "k", "v", "o", "do", "lse")}
        before = {f"{n}[{r}]": t.clone() for n, ts in handed.items() for r, t in enumerate(ts)}
        got = fn(*handed.values(), [p.clone() for p in x.positions], case.causal, case.scale_value)
        modified = inputs_changed(before, {f"{n}[{r}]": t for n, ts in handed.items() for r, t in enumerate(ts)})
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise ShapeError(f"fn must return a tuple (dq, dk, dv), got {type(got).__name__}")
        outs = {}
        for name, shards, like in zip(("dQ", "dK", "dV"), got, (x.q, x.k, x.v)):
            listed = isinstance(shards, (tuple, list))
            if not listed or len(shards) != case.W:
                raise ShapeError(f"{name.lower()} must be a list of the W = {case.W} ranks' shards, got "
                                 f"{type(shards).__name__}" + (f" of {len(shards)}" if listed else ""))
            for r, (t, want) in enumerate(zip(shards, like)):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(want.shape):
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ShapeError(f"{name.lower()}[{r}] has shape {shape}, expected {tuple(want.shape)} "
                                     f"(like {name[1].lower()}[{r}])")
                if t.dtype != torch.float32:
                    raise DtypeError(f"{name.lower()}[{r}] has dtype {t.dtype}, expected torch.float32 (the "
                                     f"gradients add up in fp32 whatever the inputs' dtype)")
            outs[name] = paste([t.detach().cpu() for t in shards], case.W, case.ring_layout, 2)
        return outs, x.expected, {"inputs_modified": modified}

    def variants(case, x):
        return {slip: simulate(x, case, slip) for slip in RING_SLIPS}

    return run_battery("check.ring_backward", fn, RING_CASES, run_case, checker=RING, dtype=torch.float32,
                       seed=seed, with_do=True, raise_on_fail=raise_on_fail, show=show, variants=variants,
                       make=_ring_make, tol=TOL)
