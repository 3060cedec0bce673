"""The ring in one process: W ranks' shards as lists, for exercise 11 and its checker.

A real ring (``ring.py``) runs one process per rank and passes blocks with ``torch.distributed``.
Here ``x[r]`` is rank r's shard of tensor x, and one Python loop plays every rank at one step,
then :func:`ring_pass` moves every rank's block to rank r + 1, as the real ring's
send-and-receive does. Same schedule, same arithmetic, no processes: deterministic and fast, so
a mistake in the schedule shows as wrong numbers instead of a hang.

    ring_pass     the list after every rank sent its item to rank r + 1
    block_grads   one visiting K/V block's share of dQ, dK, dV (PyTorch, fp32), masked by the
                  global positions of the rows and of the keys (any layout: contiguous, zigzag);
                  O enters only through delta = rowsum(dO * O), which the caller computes
"""
from __future__ import annotations

import torch


def ring_pass(items: list) -> list:
    """Every rank sends its item to rank r + 1 and receives rank r - 1's: the new list holds,
    at index r, what rank r - 1 held (rank 0 gets rank W - 1's)."""
    W = len(items)
    return [items[(r - 1) % W] for r in range(W)]


def block_grads(q, k, v, do, lse, delta, q_pos, k_pos, causal: bool, scale: float):
    """One K/V block's share of the gradients, in fp32 (lesson 01's formulas on one block).

    q, do ``[B, H, n, D]`` (this rank's rows), k, v ``[B, H_kv, m, D]`` (the visiting block;
    GQA: H a multiple of H_kv), lse and delta ``[B, H, n]``: the rows' *global* LSE (over every
    key of the sequence) and delta = rowsum(dO * O). ``q_pos`` ``[n]``, ``k_pos`` ``[m]``: the
    global positions of the rows and of the keys; ``causal``: query i sees key j when
    j <= i, compared by those positions. Returns (dq ``[B, H, n, D]``, dk, dv ``[B, H_kv, m, D]``).
    A row that sees no key of this block gets zeros: P = 0 there.
    """
    H, H_kv = q.shape[1], k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32     # fp32 math for fp16/fp32 inputs
    q, do = (t.to(acc) for t in (q, do))
    k, v = (t.to(acc).repeat_interleave(H // H_kv, dim=1) for t in (k, v))  # each K/V head serves its group
    s = q @ k.transpose(-1, -2) * scale
    p = torch.exp(s - lse.to(acc)[..., None])          # exact: the LSE is the whole row's
    if causal:
        hidden = k_pos.to(q.device)[None, :] > q_pos.to(q.device)[:, None]
        p = p.masked_fill(hidden, 0.0)
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - delta.to(acc)[..., None])
    dq = ds @ k * scale
    group = lambda t: t.unflatten(1, (H_kv, H // H_kv)).sum(2)     # noqa: E731 -- a group's query heads add up
    dk = group(ds.transpose(-1, -2) @ q * scale)
    dv = group(p.transpose(-1, -2) @ do)
    return dq, dk, dv
