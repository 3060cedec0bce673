"""Cut a whole tensor into this rank's shard of the sequence, and gather the shards back.

``shard`` is local (every rank holds the same whole tensor and keeps its part); ``unshard`` is
one all-gather. Neither is differentiable: cut the inputs before the model, gather results to
look at them or to check them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import checks
from .layout import check_layout, cut, n_chunks, paste


def _dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
          dim: int = 2) -> torch.Tensor:
    """This rank's shard of the whole tensor ``x`` along ``dim`` (the sequence axis of
    ``[B, H, S, D]`` by default): with W ranks, the r-th of W chunks ("contiguous"), or chunks r and
    2W-1-r of 2W ("zigzag"). A new contiguous tensor; no communication."""
    group = checks.process_group(group)
    check_layout(layout)
    dim = _dim(x, dim)
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = n_chunks(W, layout)
    if x.shape[dim] % chunks:
        raise ValueError(f"layout {layout!r} over {W} ranks cuts the sequence into {chunks} equal chunks: its length "
                         f"must be divisible by {chunks}, got {x.shape[dim]} (dim {dim} of shape {tuple(x.shape)})")
    return cut(x, rank, W, layout, dim)


def unshard(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
            dim: int = 2) -> torch.Tensor:
    """The whole tensor, on every rank, from each rank's shard ``x`` (the inverse of :func:`shard`;
    one all-gather). Every rank's shard must have the same shape."""
    group = checks.process_group(group)
    check_layout(layout)
    dim = _dim(x, dim)
    W = dist.get_world_size(group)
    x = x.contiguous()
    # the shapes first (a few numbers), so that unequal shards give an error, not a hang
    shape = torch.tensor(list(x.shape), dtype=torch.int64, device=x.device)
    shapes = [torch.empty_like(shape) for _ in range(W)]
    dist.all_gather(shapes, shape, group=group)
    shapes = [tuple(s.tolist()) for s in shapes]
    if len(set(shapes)) > 1:
        raise ValueError("every rank's shard must have the same shape, got "
                         + ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes)))
    if layout == "zigzag" and x.shape[dim] % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: its length must be even, got {x.shape[dim]}")
    parts = [torch.empty_like(x) for _ in range(W)]
    dist.all_gather(parts, x, group=group)
    return paste(parts, W, layout, dim)
