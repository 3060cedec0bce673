"""Where each rank's slice of the sequence lies, and which part of a K/V block it must attend to.

A sequence of S tokens is spread over W ranks in one of two layouts:

* ``"contiguous"``: cut into W chunks; rank r holds chunk r.
* ``"zigzag"``: cut into 2W chunks; rank r holds chunk r and chunk 2W-1-r (one from the front,
  one from the back). Under a causal mask the early chunks have little to do and the late ones
  a lot; pairing them gives every rank the same amount of work.

The ring visits, on rank r, the K/V block of every rank s once. Under a causal mask (query i
sees key j <= i) only part of the (r, s) block can be visible, and the layout decides which
part; :func:`block_plan` names it. This module is plain Python and torch: no communication.
"""
from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")

# What rank r's queries do with rank s's keys (see block_plan)
FULL = "full"                   # every query sees every key
DIAGONAL = "diagonal"           # the block on the diagonal: causal, top-left aligned (S_q = S_k)
NOTHING = "nothing"             # no query sees any key: skipped
LATE_QUERIES = "late queries"   # zigzag: only the second half of the queries, all keys
EARLY_KEYS = "early keys"       # zigzag: all queries, only the first half of the keys
PLANS = (FULL, DIAGONAL, NOTHING, LATE_QUERIES, EARLY_KEYS)


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def chunks_of(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in the order it holds them: (r,) of W chunks, or
    (r, 2W-1-r) of 2W chunks for zigzag."""
    check_layout(layout)
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def n_chunks(world: int, layout: str) -> int:
    return world if check_layout(layout) == "contiguous" else 2 * world


def positions(rank: int, world: int, seq_len: int, layout: str) -> torch.Tensor:
    """The global token positions of rank ``rank``'s shard, in its order (a 1-D int64 tensor)."""
    size = seq_len // n_chunks(world, layout)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of(rank, world, layout)])


def block_plan(rank: int, source: int, world: int, layout: str, causal: bool) -> str:
    """Which part of the (rank's queries) x (source's keys) block a causal mask leaves visible.

    contiguous: chunk r against chunk s is the diagonal (s = r), entirely visible (s < r) or
    entirely hidden (s > r).
    zigzag: rank r holds chunks (r, 2W-1-r), rank s holds (s, 2W-1-s). For s < r, both of r's
    chunks come after chunk s and before chunk 2W-1-s: all queries see the first half of the
    keys, none sees the second. For s > r, r's first chunk comes before both of s's chunks and
    r's second chunk after both: only the second half of the queries sees anything, and it sees
    every key. Either way half the block: the same work for every rank at every step.
    """
    if not causal:
        return FULL
    if source == rank:
        return DIAGONAL
    if check_layout(layout) == "contiguous":
        return FULL if source < rank else NOTHING
    return EARLY_KEYS if source < rank else LATE_QUERIES


def visible_pairs(rank: int, source: int, world: int, layout: str, causal: bool, seq_len: int) -> int:
    """How many (query, key) pairs of the (rank, source) block the mask leaves visible, counted
    from the global positions (a check on :func:`block_plan`, and the work figure's numbers)."""
    q_pos = positions(rank, world, seq_len, layout)
    k_pos = positions(source, world, seq_len, layout)
    if not causal:
        return len(q_pos) * len(k_pos)
    return int((k_pos[None, :] <= q_pos[:, None]).sum())


def computed_pairs(rank: int, source: int, world: int, layout: str, causal: bool, seq_len: int) -> int:
    """How many pairs the kernels compute for this block under :func:`block_plan`. A diagonal
    block counts its triangle, n (n + 1) / 2: the causal kernels skip the tiles above it (in
    zigzag too: the shard's two chunks are in increasing order, so top-left causal on the whole
    shard is exactly the global mask)."""
    n = seq_len // world
    return {FULL: n * n, DIAGONAL: n * (n + 1) // 2, NOTHING: 0,
            LATE_QUERIES: n * n // 2, EARLY_KEYS: n * n // 2}[block_plan(rank, source, world, layout, causal)]


def work_per_rank(world: int, layout: str, causal: bool, seq_len: int) -> list[int]:
    """Pairs each rank computes over a whole ring pass: the load a layout puts on each rank."""
    return [sum(computed_pairs(r, s, world, layout, causal, seq_len) for s in range(world))
            for r in range(world)]


def cut(x: torch.Tensor, rank: int, world: int, layout: str, dim: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the whole tensor ``x`` along ``dim`` (a new, contiguous tensor)."""
    chunks = x.chunk(n_chunks(world, layout), dim)
    return torch.cat([chunks[c] for c in chunks_of(rank, world, layout)], dim).contiguous()


def paste(shards: list[torch.Tensor], world: int, layout: str, dim: int) -> torch.Tensor:
    """The whole tensor from every rank's shard (``shards[r]`` is rank r's): the inverse of :func:`cut`."""
    pieces: dict[int, torch.Tensor] = {}
    for rank, part in enumerate(shards):
        owned = chunks_of(rank, world, layout)
        for chunk, piece in zip(owned, part.chunk(len(owned), dim)):
            pieces[chunk] = piece
    return torch.cat([pieces[c] for c in range(n_chunks(world, layout))], dim)
