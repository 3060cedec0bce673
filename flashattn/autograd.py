"""The lesson kernels wired into PyTorch's autograd: ``FlashAttentionFunction``.

Forward saves Q, K, V, O and LSE (O(S) extra memory: no S_q x S_k matrix). Backward gets dO
from autograd, rebuilds P tile by tile from LSE, and returns one gradient per forward input
(None for ``causal`` and ``scale``, which are not tensors).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import runtime
from .backward import attention_backward
from .forward import attention_forward


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = attention_forward(q, k, v, causal, scale)
        # What backward needs: Q, K, V to rebuild S; O for delta; LSE to rebuild P.
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        needs_q, needs_k, needs_v = ctx.needs_input_grad[:3]
        # dO is passed with its own strides, whatever they are: a view, a transpose, or the
        # stride-0 expansion autograd hands over after ``out.sum()``. No .contiguous() copy.
        dq, dk, dv = attention_backward(
            q, k, v, o, do, lse, ctx.causal, ctx.scale,
            needs_dq=needs_q, needs_dkdv=needs_k or needs_v,
        )
        return (dq if needs_q else None, dk if needs_k else None, dv if needs_v else None,
                None, None)


def teaching_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """The lesson kernels as a differentiable function: like
    ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``.

    q ``[B, H, S_q, D]``; k, v ``[B, H_kv, S_k, D]`` with ``H % H_kv == 0`` (GQA/MQA);
    ``causal``: query i sees keys j <= i; ``scale`` defaults to 1/sqrt(D). Any strides.
    (``flashattn.flash_attention`` runs this, or the tuned kernels of ``flashattn.fast``.)
    """
    runtime.validate_qkv(q, k, v, allow_bf16_fallback=True)
    causal = runtime.validate_causal(causal)
    scale = runtime.validate_scale(scale, q.shape[-1])
    return runtime.in_kernel_dtype(
        lambda q_, k_, v_: FlashAttentionFunction.apply(q_, k_, v_, causal, scale), q, k, v)
