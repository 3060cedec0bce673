"""The tuned path wired into autograd: what ``flash_attention`` runs on a GPU by default.

It takes fp16/bf16 inputs with a power-of-two head dim (16..256), GQA and any strides; for
anything else ``flash_attention`` falls back to the teaching kernels. The backward is either
the two-kernel design or the fused one (dQ by atomics); ``choose_backward`` says which, from
measurements on an H100 (see ``notebooks/06_performance.ipynb``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import runtime
from .backward import fast_attention_backward
from .forward import fast_attention_forward
from .fused import fused_attention_backward

HEAD_DIMS = (16, 32, 64, 128, 256)
BACKWARDS = ("two-kernel", "fused")


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[bool, str]:
    """(True, "") if the fast kernels take these inputs, else (False, why not)."""
    dtypes = (torch.float16, torch.float32) if runtime.INTERPRET else (torch.float16, torch.bfloat16)
    if q.dtype not in dtypes:
        return False, f"the fast path takes {' and '.join(map(str, dtypes))}, got {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return False, f"the fast path takes head dims {HEAD_DIMS}, got {q.shape[-1]}"
    return True, ""


def choose_backward(head_dim: int, causal: bool, S_q: int, S_k: int) -> str:
    """Which backward to run, from H100 measurements (fp16, B*S = 16k, H*D = 2048; see
    ``results/`` and notebook 06). The two-kernel design wins at D=64 at every length (by 10-25%:
    at D=64 a tile's matrix products are cheap, so the fused kernel's BLOCK_M x D atomic adds
    per tile cost more than the dQ kernel's recomputation of P and dS). At D=128 and long
    sequences the recomputation costs more and the fused kernel wins by ~5%. The fused kernel's
    dQ is not bit-reproducible (atomic adds in varying order), so it is never chosen when
    ``torch.use_deterministic_algorithms(True)`` is on."""
    if torch.are_deterministic_algorithms_enabled():
        return "two-kernel"
    if head_dim >= 128 and min(S_q, S_k) >= 8192:
        return "fused"
    return "two-kernel"


class FastFlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, backward: str):
        o, lse = fast_attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.backward = causal, scale, backward
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        needs_q, needs_k, needs_v = ctx.needs_input_grad[:3]
        which = ctx.backward
        if which == "auto":
            which = choose_backward(q.shape[-1], ctx.causal, q.shape[2], k.shape[2])
        if which == "fused" and needs_q and (needs_k or needs_v):
            dq, dk, dv = fused_attention_backward(q, k, v, o, do, lse, ctx.causal, ctx.scale)
        else:
            dq, dk, dv = fast_attention_backward(q, k, v, o, do, lse, ctx.causal, ctx.scale,
                                                 needs_dq=needs_q, needs_dkdv=needs_k or needs_v)
        return (dq if needs_q else None, dk if needs_k else None, dv if needs_v else None,
                None, None, None)


def flash_attention_fast(q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                         backward: str = "auto") -> torch.Tensor:
    """The tuned kernels only (raises ValueError where they do not apply)."""
    runtime.check_qkv(q, k, v)
    causal = runtime.check_causal(causal)
    scale = runtime.check_scale(scale, q.shape[-1])
    ok, why = supports(q, k, v)
    if not ok:
        raise ValueError(why)
    if backward not in ("auto",) + BACKWARDS:
        raise ValueError(f"backward must be 'auto', 'two-kernel' or 'fused', got {backward!r}")
    return FastFlashAttentionFunction.apply(q, k, v, causal, scale, backward)
