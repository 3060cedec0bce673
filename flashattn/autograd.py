"""``flash_attention``: the kernels wired into PyTorch's autograd.

Forward saves Q, K, V, O and LSE (O(S) extra memory: no S_q x S_k matrix). Backward gets dO
from autograd, rebuilds P tile by tile from LSE, and returns one gradient per forward input
(None for ``causal`` and ``scale``, which are not tensors).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import fast, runtime
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


IMPLEMENTATIONS = ("auto", "fast", "teaching")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    causal: bool = False, scale: Optional[float] = None,
                    impl: str = "auto") -> torch.Tensor:
    """Drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``.

    q ``[B, H, S_q, D]``; k, v ``[B, H_kv, S_k, D]`` with ``H % H_kv == 0`` (GQA/MQA);
    ``causal``: query i sees keys j <= i; ``scale`` defaults to 1/sqrt(D). Any strides.
    Gradients flow to whichever of q, k, v require them.

    ``impl``: ``"teaching"`` runs the kernels of ``forward.py`` / ``backward.py``;
    ``"fast"`` the tuned ones of ``flashattn.fast`` (fp16/bf16, power-of-two head dims);
    ``"auto"`` (default) the fast ones on a GPU where they apply, else the teaching ones.

    bf16 where it cannot be multiplied (the CPU interpreter, GPUs before sm 8.0) runs in fp32
    and is cast back, with a :class:`~flashattn.runtime.BF16FallbackWarning`.
    """
    runtime.check_qkv(q, k, v, allow_bf16_fallback=True)
    causal = runtime.check_causal(causal)
    scale = runtime.check_scale(scale, q.shape[-1])
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    input_dtype = q.dtype
    kernel_dtype = runtime.compute_dtype(input_dtype, q.device)
    if kernel_dtype != input_dtype:
        # .to() is differentiable: autograd casts the gradients back to bf16 for us.
        q, k, v = q.to(kernel_dtype), k.to(kernel_dtype), v.to(kernel_dtype)
    if impl == "auto":
        impl = "fast" if not runtime.INTERPRET and fast.supports(q, k, v)[0] else "teaching"
    if impl == "fast":
        out = fast.flash_attention_fast(q, k, v, causal=causal, scale=scale)
    else:
        out = FlashAttentionFunction.apply(q, k, v, causal, scale)
    return out.to(input_dtype)
