"""Lesson 09's exercise checkers (solutions/09): a sliding window's mask, and the backward of a
packed batch with a window and dropout, written in PyTorch.

* :func:`window_mask` -- ``fn(S_q, S_k, window) -> bool [S_q, S_k]``: True where query i sees
  key j, for ``window = (left, right)`` as FlashAttention's ``window_size`` (-1: no limit).
* :func:`beyond_backward` -- ``fn(q, k, v, o, do, lse, cu_seqlens_q, cu_seqlens_k, window,
  dropout_p, seed, scale) -> (dq, dk, dv)`` on a packed batch: q, o, do ``[total_q, H, D]``,
  k, v ``[total_k, H, D]``, lse ``[total_q, H]``, all float64; O and LSE come from the forward
  with sequence b's dropout mask drawn as ``beyond.dropout_mask(seed, H, S_q_b, S_k_b, p,
  device, first_seq_head=b * H)``.

The cases mix one sequence and several, S_q != S_k, windows with rows that see no key, and
dropout 0, 0.2 and 0.5. Outputs are compared per (sequence, head): they are unpacked into
``[sequences, H, longest, D]``, zero-padded, so "batch element b" in a table is sequence b.
The classic mistakes of the lesson are fingerprinted (:func:`_variants`); the diagnoses are
in :mod:`flashattn.check.mistakes.lesson09`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .. import runtime
from .battery import Case
from .checkers import BEYOND, WINDOW
from .errors import DtypeError, ShapeError
from .runner import inputs_changed, run_battery, snapshot_inputs
from .window_edges import edge_formulas


# --------------------------------------------------------------------------------------
# the window's mask, and its classic slips
# --------------------------------------------------------------------------------------
def visible(S_q: int, S_k: int, window, *, shift: int = 0, literal: str = "", left_off: int = 0,
            right_off: int = 0, device=None) -> torch.Tensor:
    """bool ``[S_q, S_k]``: query i sees key j when ``i - left <= j <= i + right`` (top-left
    aligned, -1: no limit). The keywords put in a classic slip: ``shift`` moves the queries'
    positions (``S_k - S_q`` aligns them bottom-right); ``literal`` ("left", "right", "both")
    takes a -1 on that side as a number; ``left_off`` / ``right_off`` move an edge by one."""
    left, right = window
    i = torch.arange(S_q, device=device)[:, None] + shift
    j = torch.arange(S_k, device=device)[None, :]
    seen = torch.ones(S_q, S_k, dtype=torch.bool, device=device)
    if left >= 0 or literal in ("left", "both"):
        seen &= j >= i - left + left_off
    if right >= 0 or literal in ("right", "both"):
        seen &= j <= i + right + right_off
    return seen


def window_slips(S_q: int, S_k: int, window) -> dict:
    """Name -> the mask a classic mistake builds (only those that differ from the right one)."""
    right_mask = visible(S_q, S_k, window)
    slips = {"window_swapped": visible(S_q, S_k, window[::-1]),
             "window_bottom_right": visible(S_q, S_k, window, shift=S_k - S_q)}
    if window[0] == 0:           # "if left > 0" where "if left >= 0" belongs: 0 read as no limit
        slips["window_zero_unlimited:left"] = visible(S_q, S_k, (-1, window[1]))
    if window[1] == 0:
        slips["window_zero_unlimited:right"] = visible(S_q, S_k, (window[0], -1))
    if 0 in window:              # both sides tested with > 0
        slips["window_zero_unlimited:both"] = visible(S_q, S_k, tuple(-1 if w == 0 else w for w in window))
    for side in ("left", "right", "both"):
        slips[f"window_minus_one:{side}"] = visible(S_q, S_k, window, literal=side)
    i, j = torch.arange(S_q)[:, None], torch.arange(S_k)[None, :]
    if window[0] >= 0:           # one side written as a distance, |i - j| <= left: it bounds both sides
        slips["window_abs_distance:left"] = visible(S_q, S_k, window) & (j <= i + window[0])
    if window[1] >= 0:
        slips["window_abs_distance:right"] = visible(S_q, S_k, window) & (j >= i - window[1])
    for off in (-1, 1):          # > for >=, < for <=, or an edge computed one further out
        slips[f"window_left_off:{off}"] = visible(S_q, S_k, window, left_off=off)
        slips[f"window_right_off:{off}"] = visible(S_q, S_k, window, right_off=off)
    slips.update(_edge_slips(i, j, *window))
    slips.update(_setup_slips(S_q, S_k, window))
    return {n: m for n, m in slips.items() if not torch.equal(m, right_mask)}


def _setup_slips(S_q: int, S_k: int, window) -> dict:
    """Slips around the two edges: a mask that starts causal (ones(...).tril()), the right edge
    tested only inside the left's if, positions counted from 1 on one axis, the -1 sentinel
    clamped to 0, and ``seen = seen & j <= i + right`` (& binds before <=)."""
    left, right = window
    i, j = torch.arange(S_q)[:, None], torch.arange(S_k)[None, :]
    right_mask = visible(S_q, S_k, window)
    ones = torch.ones(S_q, S_k, dtype=torch.bool)
    left_ok = (j >= i - left) if left >= 0 else ones
    right_ok = (j <= i + right) if right >= 0 else ones
    shift = S_k - S_q
    out = {"window_starts_causal": right_mask & (j <= i),
           "window_one_side_twice:left": visible(S_q, S_k, (left, left)),
           "window_one_side_twice:right": visible(S_q, S_k, (right, right)),
           "window_one_edge_bottom_right:left": ((j >= i + shift - left) if left >= 0 else ones) & right_ok,
           "window_one_edge_bottom_right:right": left_ok & ((j <= i + shift + right) if right >= 0 else ones),
           "window_absolute:right": left_ok & ((j <= right) if right >= 0 else ones),
           "window_sentinel_clamped": visible(S_q, S_k, tuple(max(w, 0) for w in window)),
           "window_one_based:keys": _shifted(i, j + 1, left, right),
           "window_one_based:queries": _shifted(i + 1, j, left, right)}
    if left < 0 and right >= 0:           # if right >= 0 nested in if left >= 0: never reached
        out["window_right_nested"] = torch.ones(S_q, S_k, dtype=torch.bool)
    if right >= 0:                        # seen = (seen & j) <= i + right: a bitwise and of positions
        before = (j >= i - left) if left >= 0 else torch.ones(S_q, S_k, dtype=torch.bool)
        out["window_and_precedence"] = (before.long() & j) <= i + right
    return out


def _shifted(i, j, left: int, right: int) -> torch.Tensor:
    seen = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    return seen


def _edge_slips(i, j, left: int, right: int) -> dict:
    """One edge written wrong: with the other side's width (copy-paste), with a sign slip, the
    two edges joined with |= (or), a side tested by truthiness (``if left:`` -- 0 read as no
    limit, -1 as a limit); or a mask that starts empty (all False), which &= never fills."""
    everything = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    left_ok = (j >= i - left) if left >= 0 else everything
    right_ok = (j <= i + right) if right >= 0 else everything
    out = {}
    if right >= 0:
        out["window_other_side:right"] = left_ok & (j <= i + left)
        out["window_edge_sign:right"] = left_ok & (j <= i - right)
        out["window_edge_sign:right_reversed"] = left_ok & (j <= right - i)
    if left >= 0:
        out["window_other_side:left"] = (j >= i - right) & right_ok
        out["window_edge_sign:left"] = (j >= i + left) & right_ok
        out["window_edge_sign:left_reversed"] = (j >= left - i) & right_ok
    if right >= 0:               # seen |= (right edge): the right edge hides nothing
        out["window_or:right"] = left_ok | (j <= i + right) if left >= 0 else everything
    if left >= 0:                # the left limit lost: seen = (right edge) overwrote it, or |= on ones
        out["window_side_lost:left"] = right_ok
    if right >= 0:
        out["window_side_lost:right"] = left_ok
    truthy_left = (j >= i - left) if left != 0 else everything
    truthy_right = (j <= i + right) if right != 0 else everything
    out["window_empty"] = torch.zeros_like(everything)     # torch.zeros to start, then &=: nothing is ever seen
    if left >= 0 and right >= 0:   # elif for the second side: it is skipped whenever the first applies
        out["window_elif"] = left_ok
    # one side's condition guarded by the other side's test (if left >= 0: ... j <= i + right)
    out["window_guard_other:right"] = left_ok & (((j <= i + right) if left >= 0 else everything))
    out["window_guard_other:left"] = (((j >= i - left) if right >= 0 else everything)) & right_ok
    out["window_truthiness:left"] = truthy_left & right_ok
    out["window_truthiness:right"] = left_ok & truthy_right
    out["window_truthiness:both"] = truthy_left & truthy_right
    if (left >= 0) != (right >= 0):   # if left >= 0 and right >= 0: a one-sided window gets no limit
        out["window_both_required"] = everything
    return out


@dataclass(frozen=True)
class WindowCase(Case):
    window: tuple = (-1, -1)


def _window_case(S_q, S_k, window) -> WindowCase:
    return WindowCase(f"{S_q}x{S_k} window {window[0]},{window[1]}", 1, 1, S_q, S_k, 1, tuple(window) == (-1, 0),
                      window=tuple(window))


WINDOW_CASES = (
    _window_case(7, 7, (-1, -1)), _window_case(7, 7, (-1, 0)), _window_case(9, 9, (3, 0)),
    _window_case(8, 8, (2, 2)), _window_case(6, 10, (1, 3)), _window_case(10, 6, (0, 0)),
    _window_case(9, 9, (4, -1)), _window_case(5, 8, (-1, 2)), _window_case(8, 8, (0, 5)),
    # S_q > S_k with no left limit: the late queries must still see key 0 ("no limit" is not S_k keys)
    _window_case(10, 4, (-1, 1)),
)


def _as_mask_tensor(m) -> torch.Tensor:
    return m.to(torch.float64).reshape(1, 1, *m.shape)


def window_mask(fn, *, raise_on_fail: bool = True, show: bool = True):
    """Check ``fn(S_q, S_k, window) -> bool [S_q, S_k]``, the window's mask (True: i sees j)."""
    def make(case, dtype, device, seed, with_do):
        return SimpleNamespace(expected=visible(case.S_q, case.S_k, case.window))

    def run_case(case, x):
        got = fn(case.S_q, case.S_k, case.window)
        if not isinstance(got, torch.Tensor):
            raise ShapeError(f"fn must return a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != (case.S_q, case.S_k):
            raise ShapeError(f"the mask has shape {tuple(got.shape)}, expected [S_q, S_k] = "
                             f"{[case.S_q, case.S_k]} (a row per query, a column per key)")
        if got.dtype != torch.bool:
            raise ShapeError(f"the mask has dtype {got.dtype}, expected torch.bool")
        return {"mask": _as_mask_tensor(got.cpu())}, {"mask": _as_mask_tensor(x.expected)}, {}

    def variants(case, x):
        slips = dict(window_slips(case.S_q, case.S_k, case.window), window_returned_inverted=~x.expected,
                     **edge_formulas(case.S_q, case.S_k, case.window))
        return {n: {"mask": _as_mask_tensor(m)} for n, m in slips.items()}

    return run_battery("check.window_mask", fn, WINDOW_CASES, run_case, checker=WINDOW, dtype=torch.float64,
                       seed=0, with_do=False, raise_on_fail=raise_on_fail, show=show, variants=variants,
                       make=make, tol=1e-12)


# --------------------------------------------------------------------------------------
# the packed backward
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BeyondCase(Case):
    lens_q: tuple = ()
    lens_k: tuple = ()
    window: tuple = (-1, -1)
    dropout_p: float = 0.0

    @property
    def packed(self) -> bool:
        return len(self.lens_q) > 1

    @property
    def empty_rows(self) -> bool:
        return any(not bool(visible(sq, sk, self.window).any(dim=1).all())
                   for sq, sk in zip(self.lens_q, self.lens_k))


def _beyond_case(lens_q, lens_k=None, window=(-1, -1), p=0.0, H=2, D=8, scale=None) -> BeyondCase:
    lens_k = tuple(lens_k or lens_q)
    listed = lambda lens: ",".join(map(str, lens))   # noqa: E731
    name = f"q{listed(lens_q)}" + (f" k{listed(lens_k)}" if lens_k != tuple(lens_q) else "") + \
        (f" w{window[0]},{window[1]}" if tuple(window) != (-1, -1) else "") + (f" p{p}" if p else "") + \
        (f" scale{scale}" if scale is not None else "")
    return BeyondCase(name, len(lens_q), H, max(lens_q), max(lens_k), D, tuple(window) == (-1, 0),
                      scale=scale, lens_q=tuple(lens_q), lens_k=lens_k, window=tuple(window), dropout_p=p)


BEYOND_CASES = (
    _beyond_case((13,)),
    _beyond_case((14,), window=(2, 3), scale=0.3),        # one sequence, a window, not D ** -0.5
    _beyond_case((9, 12), window=(0, 2)),                  # left = 0: no key before the query
    _beyond_case((5, 11, 7), window=(-1, 0)),
    _beyond_case((9, 6, 12), window=(3, 1)),
    _beyond_case((6, 9), (10, 4), window=(1, 0)),          # rows past S_k + 1 see no key
    _beyond_case((16,), p=0.2),
    _beyond_case((7, 10, 5), window=(-1, 0), p=0.5),
    _beyond_case((8, 11), (12, 7), window=(2, 2), p=0.3),
    _beyond_case((6, 0, 9), (5, 0, 8), window=(-1, 0), p=0.2),   # an empty sequence between two others
    _beyond_case((12, 7), (40, 9), p=0.3),                 # keys past 32: Z's counters count 32-key groups
)


def _cu(lens, device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _spans(lens):
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    return [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]


def _keep(x, b, S_q, S_k, first_seq_head=None, p=None) -> torch.Tensor:
    """Sequence b's dropout mask [H, S_q, S_k] as the forward drew it (or with another head
    number, or drawn with another probability ``p``)."""
    from ..beyond.kernels import dropout_mask

    H = x.q.shape[1]
    first = b * H if first_seq_head is None else first_seq_head
    p = x.p if p is None else p
    key = (S_q, S_k, first, p)
    if key not in x.masks:
        x.masks[key] = dropout_mask(x.seed, H, S_q, S_k, p, x.device, first_seq_head=first).cpu() \
            if p > 0 else torch.ones(H, S_q, S_k, dtype=torch.bool)
    return x.masks[key]


def _keep_heads(x, heads: int, first: int, S_q: int, S_k: int) -> torch.Tensor:
    """A dropout mask drawn for ``heads`` heads from head number ``first`` (a mistaken head count)."""
    from ..beyond.kernels import dropout_mask

    if x.p <= 0:
        return torch.ones(heads, S_q, S_k, dtype=torch.bool)
    return dropout_mask(x.seed, heads, S_q, S_k, x.p, x.device, first_seq_head=first).cpu()


def sequence_grads(q, k, v, o, do, lse, keep, p, seen, scale, slip: str = "") -> tuple:
    """dQ, dK, dV of one sequence (``[H, S, D]`` tensors, lse ``[H, S_q]``), float64, by the
    lesson's formulas -- or with one classic ``slip`` put in."""
    if slip == "o_do_swapped":               # sequence_backward(q, k, v, do, o, ...): each in the other's place
        o, do = do, o
    s = q @ k.transpose(-1, -2) * (1.0 if slip == "unscaled_scores" else scale)
    P = torch.exp(s - lse[..., None])
    P_before_mask = P
    if slip == "softmax_then_mask":          # a softmax over every key, the window applied after it
        P = torch.softmax(s, dim=-1)
    if slip == "window_inverted":
        P = P.masked_fill(seen, 0.0)
    elif slip != "no_visible":
        P = P.masked_fill(~seen, 0.0)
    if slip == "keep_inverted":
        keep = ~keep
    rescale = {"rescale_inverted": 1.0 - p, "rescale_twice": 1.0 / (1.0 - p) ** 2,
               "rescale_by_p": 1.0 / p if p else math.inf}.get(slip, 1.0 / (1.0 - p))
    z_dv = keep * (1.0 if slip in ("no_rescale", "no_rescale_dv") else rescale)
    z_dp = keep * (1.0 if slip in ("no_rescale", "no_rescale_dp") else rescale)
    if slip == "rescale_precedence":         # keep / 1.0 - p: the parentheses around 1 - p dropped
        z_dv = z_dp = keep.to(torch.float64) - p
    if slip == "dv_no_mask":
        z_dv = torch.ones_like(z_dv, dtype=torch.float64)
    if slip == "dp_no_mask":
        z_dp = torch.ones_like(z_dp, dtype=torch.float64)
    dv = ((P_before_mask if slip == "mask_after_dv" else P) * z_dv).transpose(-1, -2) @ \
        (o if slip == "dv_uses_o" else do)
    dp_raw = (o if slip == "dp_uses_o" else do) @ v.transpose(-1, -2)
    dp = dp_raw * z_dp
    delta = (do * o).sum(-1, keepdim=True)
    if slip == "delta_unmasked_dp":
        delta = (P * dp_raw).sum(-1, keepdim=True)
    if slip == "delta_rescaled":
        delta = delta / (1.0 - p)
    if slip == "delta_dropped":              # delta * Z / (1 - p): delta is a row's constant, not dropped
        delta = delta * z_dp
    ds = (P * z_dv if slip == "ds_dropped_p" else P) * (dp - delta)
    ds_for_dq = ds * z_dv if slip == "dq_dropped" else ds     # Z once more, in dQ's line only
    return ds_for_dq @ k * scale, ds.transpose(-1, -2) @ q * scale, dv


def _heads_first(t):
    return t.transpose(0, 1)


def packed_grads(x, slip: str = "", window_slip=None, mask_heads=None, whole=False, global_positions=False,
                 scale=None, sliced_mask=False, reshape_heads=False, mask_p=None,
                 masks_swapped=False, one_head_mask=False, stop_at_empty=False, lse_reshape=False,
                 longest_mask=False) -> dict:
    """The packed batch's gradients, unpacked per sequence (see :func:`unpack`), by the lesson's
    formulas with one mistake put in: ``slip`` (see :func:`sequence_grads`), ``window_slip``
    (a name of :func:`window_slips`), ``mask_heads(b, H)`` (the first_seq_head of sequence b's
    mask), ``whole`` (the packed batch taken as one sequence), ``global_positions`` (the window
    compares positions in the packed tensor), ``sliced_mask`` (each sequence's mask cut out of
    one mask drawn for the whole packed batch), ``reshape_heads`` ([S, H, D] <-> [H, S, D] by
    reshape, which reorders the elements, where a transpose belongs), ``mask_p`` (the dropout mask drawn
    with this probability), ``masks_swapped`` (the window's mask and the dropout mask handed to
    the per-sequence backward in each other's place), ``one_head_mask`` (each sequence's mask drawn
    for one head and broadcast over all), ``stop_at_empty`` (the loop leaves at the first empty
    sequence: ``break`` where ``continue`` belongs), ``lse_reshape`` (a sequence's [S_q, H] LSE
    reshaped to [H, S_q] where a transpose belongs), ``longest_mask`` (each sequence's mask drawn
    at the longest lengths and cut down to its own)."""
    case = x.case
    H = x.q.shape[1]
    heads = (lambda t: t.reshape(t.shape[1], t.shape[0], t.shape[2])) if reshape_heads else _heads_first
    if whole:
        spans_q, spans_k = [slice(0, sum(case.lens_q))], [slice(0, sum(case.lens_k))]
    else:
        spans_q, spans_k = _spans(case.lens_q), _spans(case.lens_k)
    dq, dk, dv = torch.zeros_like(x.q), torch.zeros_like(x.k), torch.zeros_like(x.v)
    for b, (qs, ks) in enumerate(zip(spans_q, spans_k)):
        S_q, S_k = qs.stop - qs.start, ks.stop - ks.start
        if stop_at_empty and (S_q == 0 or S_k == 0):
            break
        if window_slip is not None:
            seen = window_slips(S_q, S_k, case.window).get(window_slip)
            if seen is None:
                seen = visible(S_q, S_k, case.window)
        else:
            seen = visible(S_q, S_k, case.window, shift=(qs.start - ks.start) if global_positions else 0)
        if sliced_mask:
            keep = _keep(x, 0, sum(case.lens_q), sum(case.lens_k), 0)[:, qs, ks]
        elif longest_mask:                 # the counters count 32-key groups of the drawn length
            keep = _keep(x, b, max(case.lens_q), max(case.lens_k))[:, :S_q, :S_k]
        else:
            keep = _keep(x, b, S_q, S_k, mask_heads(b, H) if mask_heads else None, mask_p)
        if one_head_mask:                  # drawn for one head (the first of the sequence), broadcast
            keep = _keep_heads(x, 1, b * H, S_q, S_k).expand(H, S_q, S_k)
        if masks_swapped:
            seen, keep = keep, seen.expand(H, S_q, S_k)
        lse = x.lse[qs].reshape(H, -1) if lse_reshape else x.lse[qs].T
        g = sequence_grads(*(heads(t[s]) for t, s in ((x.q, qs), (x.k, ks), (x.v, ks), (x.o, qs), (x.do, qs))),
                           lse, keep, x.p, seen, x.scale if scale is None else scale, slip)
        dq[qs], dk[ks], dv[ks] = (heads(t) for t in g)
    return unpack(case, {"dQ": dq, "dK": dk, "dV": dv})


def unpack(case: BeyondCase, packed: dict) -> dict:
    """Packed ``[total, H, D]`` -> ``[sequences, H, longest, D]``, zero-padded."""
    out = {}
    for name, t in packed.items():
        lens = case.lens_q if name == "dQ" else case.lens_k
        full = torch.zeros(len(lens), t.shape[1], max(lens), t.shape[2], dtype=torch.float64)
        for b, s in enumerate(_spans(lens)):
            full[b, :, : s.stop - s.start] = _heads_first(t[s].detach().to("cpu", torch.float64))
        out[name] = full
    return out


def _make(case: BeyondCase, dtype, device, seed, with_do):
    from ..beyond.reference import attention_reference

    g = torch.Generator().manual_seed(seed + 7919 * sum(case.lens_q) + 31 * sum(case.lens_k))
    tq, tk, H, D = sum(case.lens_q), sum(case.lens_k), case.H, case.D
    q, do = (torch.randn(tq, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(tk, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    x = SimpleNamespace(case=case, q=q, k=k, v=v, do=do, scale=case.scale or 1.0 / math.sqrt(D), p=case.dropout_p,
                        seed=1234 + sum(case.lens_q), device=device, masks={})
    o, lse = torch.zeros_like(q), torch.zeros(tq, H, dtype=torch.float64)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    outs = []
    for b, (qs, ks) in enumerate(zip(_spans(case.lens_q), _spans(case.lens_k))):
        keep = _keep(x, b, qs.stop - qs.start, ks.stop - ks.start)[None]
        o_b, lse_b = attention_reference(*(_heads_first(t[s])[None] for t, s in ((qg, qs), (kg, ks), (vg, ks))),
                                         False, x.scale, case.window, keep, x.p)
        outs.append(_heads_first(o_b[0]))
        lse[qs] = lse_b[0].T.detach()
    o_all = torch.cat(outs)
    o_all.backward(do)
    x.o, x.lse = o_all.detach(), lse
    x.expected = unpack(case, {"dQ": qg.grad, "dK": kg.grad, "dV": vg.grad})
    x.cu_q, x.cu_k = _cu(case.lens_q, device), _cu(case.lens_k, device)
    return x


#: mistakes that change the result only with dropout on, and how each is put in
DROPOUT_SLIPS = ("no_rescale", "no_rescale_dv", "no_rescale_dp", "dv_no_mask", "dp_no_mask", "ds_dropped_p",
                 "dq_dropped", "rescale_by_p", "delta_unmasked_dp", "delta_rescaled", "rescale_inverted", "rescale_twice", "rescale_precedence",
                 "delta_dropped")


def _variants(case: BeyondCase, x) -> dict:
    found = {}
    if case.dropout_p > 0:
        for slip in DROPOUT_SLIPS:
            found[slip] = packed_grads(x, slip)
        if case.packed:
            found["mask_same_for_all"] = packed_grads(x, mask_heads=lambda b, H: 0)
            found["mask_numbered_by_b"] = packed_grads(x, mask_heads=lambda b, H: b)
            found["mask_sliced_from_whole"] = packed_grads(x, sliced_mask=True)
            found["mask_drawn_at_longest"] = packed_grads(x, longest_mask=True)
        if case.H > 1:                     # dropout_mask(seed, 1, ...): one head's mask for all
            found["mask_one_head"] = packed_grads(x, one_head_mask=True)
    for name in window_slips(case.S_q, case.S_k, case.window):
        found[name] = packed_grads(x, window_slip=name)
    if 0 in case.lens_q or 0 in case.lens_k:
        found["stops_at_empty"] = packed_grads(x, stop_at_empty=True)
    found["keep_probability"] = packed_grads(x, mask_p=1.0 - case.dropout_p)   # at p = 0: nothing survives
    found["masks_swapped"] = packed_grads(x, masks_swapped=True)
    found["unscaled_scores"] = packed_grads(x, "unscaled_scores")
    if case.scale is not None:
        found["scale_ignored"] = packed_grads(x, scale=case.D ** -0.5)
    found["window_inverted"] = packed_grads(x, "window_inverted")
    found["keep_inverted"] = packed_grads(x, "keep_inverted")     # at p = 0 too: then Z is all False
    found["swapped_o_do"] = packed_grads(x, "o_do_swapped")    # "swapped": every output it changes is wrong
    found["dv_uses_o"] = packed_grads(x, "dv_uses_o")
    found["dp_uses_o"] = packed_grads(x, "dp_uses_o")
    if case.window != (-1, -1):
        found["mask_after_dv"] = packed_grads(x, "mask_after_dv")
        found["no_visible"] = packed_grads(x, "no_visible")
        found["softmax_then_mask"] = packed_grads(x, "softmax_then_mask")
    if case.H > 1:
        found["heads_reshape"] = packed_grads(x, reshape_heads=True)
        found["lse_reshape"] = packed_grads(x, lse_reshape=True)
    if case.packed:
        found["leak"] = packed_grads(x, whole=True)     # with dropout: one mask for the whole batch
        if case.window != (-1, -1) and case.lens_q != case.lens_k:
            found["global_positions"] = packed_grads(x, global_positions=True)
    return found


def beyond_backward(fn, *, raise_on_fail: bool = True, show: bool = True):
    """Check ``fn(q, k, v, o, do, lse, cu_seqlens_q, cu_seqlens_k, window, dropout_p, seed, scale)
    -> (dq, dk, dv)``, the backward of a packed batch with a window and dropout, in float64.

    q, o, do ``[total_q, H, D]``; k, v ``[total_k, H, D]``; lse ``[total_q, H]`` (+inf on a row that
    sees no key); cu_seqlens int32 ``[n + 1]``; ``window`` a pair (left, right), -1 = no limit;
    ``dropout_p`` in [0, 1); ``seed`` an int; ``scale`` a float (not always D ** -0.5). Sequence b's
    dropout mask is ``beyond.dropout_mask(seed, H, S_q_b, S_k_b, dropout_p, device,
    first_seq_head=b * H)`` (all True when dropout_p is 0).

    The cases (a name lists the query lengths ``q``, the key lengths ``k`` where they differ, the
    window ``w``, the dropout ``p``): one sequence and several, S_q != S_k, windows with rows that
    see no key, left = 0, dropout 0 / 0.2 / 0.3 / 0.5, keys past 32, a scale of 0.3. In the table,
    batch element b is sequence b (outputs are unpacked into ``[sequences, H, longest, D]``).
    """
    device = runtime.default_device()

    def run_case(case, x):
        # copies on the device (x's own tensors feed the fingerprints), watched for writes
        handed = {n: getattr(x, n).to(device).clone() for n in ("q", "k", "v", "o", "do", "lse")}
        before = snapshot_inputs(handed)
        got = fn(*handed.values(), x.cu_q.clone(), x.cu_k.clone(), case.window, case.dropout_p, x.seed, x.scale)
        modified = inputs_changed(before, handed)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise ShapeError(f"fn must return a tuple (dq, dk, dv), got {type(got).__name__}")
        for name, t, like in zip(("dq", "dk", "dv"), got, (x.q, x.k, x.v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(like.shape):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ShapeError(f"{name} has shape {shape}, expected {tuple(like.shape)} "
                                 f"(packed like {'q' if name == 'dq' else name[1]})")
            if t.dtype != like.dtype:     # unpack() below turns everything into float64
                raise DtypeError(f"{name} has dtype {t.dtype}, expected {like.dtype} (like {name[1:]})")
        return unpack(case, dict(zip(("dQ", "dK", "dV"), got))), x.expected, {"inputs_modified": modified}

    return run_battery("check.beyond_backward", fn, BEYOND_CASES, run_case, checker=BEYOND, dtype=torch.float64,
                       seed=0, with_do=True, raise_on_fail=raise_on_fail, show=show,
                       variants=lambda case, x: _variants(case, x), make=_make)
