"""Host-side rules of the copy engine, plain torch (no Triton): which tensors a descriptor may
cover, and with which strides. Shared by ``flashattn.hopper`` (``supports``) and the launcher."""
from __future__ import annotations

import torch


def layout_problem(t: torch.Tensor, name: str) -> str:
    """Why the copy engine cannot read (or write) ``t`` as a [B, H, S, D] tensor, or ""."""
    if t.stride(-1) != 1:
        return f"{name}'s last stride is {t.stride(-1)}, not 1"
    size = t.element_size()
    for dim in range(t.dim() - 2, -1, -1):      # innermost first: the first one to go wrong
        if t.shape[dim] == 1:
            continue           # never stepped over: the launcher gives it a dense stride
        stride = t.stride(dim)
        if stride <= 0:
            return f"{name}'s stride {stride} in dim {dim} (broadcast or negative)"
        if stride * size % 16:
            return f"{name}'s stride {stride} in dim {dim} is not a multiple of 16 bytes"
    if t.data_ptr() % 16:
        return f"{name}'s address is not 16-byte aligned"
    return ""


def descriptor_strides(t: torch.Tensor) -> list:
    """``t``'s strides as the copy engine takes them. A dim of size 1 is never stepped over, so its
    stride is free: it gets the dense value (torch may report anything there, 1 or unaligned)."""
    strides = list(t.stride())
    for i in range(t.dim() - 2, -1, -1):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * t.shape[i + 1]
    return strides


def padded_rows(x: torch.Tensor, block_m: int) -> torch.Tensor:
    """LSE or delta ([B, H, S_q], fp32) as one flat vector with each head's rows padded to a whole
    number of tiles, as the copy engine reads them (PREFETCH 2): every box then starts on a tile, in
    the head's own rows, at a 16-byte aligned address. A copy only where S_q is not a whole number
    of tiles (or ``x`` not dense)."""
    B, H, S_q = x.shape
    S_rows = -(-S_q // block_m) * block_m
    if B * H * S_rows >= 2 ** 31:
        raise ValueError(f"LSE and delta as flat vectors need 32-bit coordinates: B * H * padded S_q = "
                         f"{B * H * S_rows} >= 2**31; take a variant without the copy engine's rows ('prefetch')")
    if S_rows == S_q and x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x.view(-1)
    flat = torch.zeros((B, H, S_rows), dtype=torch.float32, device=x.device)
    flat[..., :S_q] = x
    return flat.view(-1)
