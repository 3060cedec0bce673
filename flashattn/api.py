"""The public entry point: ``flash_attention`` picks the kernels that run.

Two implementations pass the same correctness suite: the lesson kernels (``forward.py``,
``backward.py``, wired into autograd by ``autograd.py``), written to be read, and the tuned
kernels of ``flashattn.fast``, written to be fast. On a GPU, where the fast ones take the
inputs (fp16/bf16, a head dim they were built for), they run; everywhere else the lesson ones.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import fast, runtime
from .autograd import FlashAttentionFunction

IMPLEMENTATIONS = ("auto", "fast", "teaching")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    causal: bool = False, scale: Optional[float] = None,
                    impl: str = "auto") -> torch.Tensor:
    """Attention like ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``.

    q ``[B, H, S_q, D]``; k, v ``[B, H_kv, S_k, D]`` with ``H % H_kv == 0`` (GQA/MQA);
    ``causal``: query i sees keys j <= i; ``scale`` defaults to 1/sqrt(D). Any strides.
    Gradients flow to whichever of q, k, v require them.

    ``impl``: ``"teaching"`` runs the lesson kernels of ``forward.py`` / ``backward.py``;
    ``"fast"`` the tuned ones of ``flashattn.fast`` (fp16/bf16, power-of-two head dims);
    ``"auto"`` (default) the fast ones on a GPU where they apply, else the lesson ones.

    bf16 where it cannot be multiplied (the CPU interpreter, GPUs before sm 8.0) runs in fp32
    and is cast back, with a :class:`~flashattn.runtime.BF16FallbackWarning`.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    runtime.validate_qkv(q, k, v, allow_bf16_fallback=True)
    causal = runtime.validate_causal(causal)
    scale = runtime.validate_scale(scale, q.shape[-1])
    kernel_dtype = runtime.compute_dtype(q.dtype, q.device)   # warns if bf16 must run in fp32
    if impl == "auto":
        fits = fast.supports(kernel_dtype, q.shape[-1])[0]
        impl = "fast" if fits and not runtime.INTERPRET else "teaching"
    q_, k_, v_ = (t.to(kernel_dtype) for t in (q, k, v))     # no copy when the dtype is right
    if impl == "teaching":
        out = FlashAttentionFunction.apply(q_, k_, v_, causal, scale)
    else:
        out = fast.flash_attention_fast(q_, k_, v_, causal=causal, scale=scale)
    return out.to(q.dtype)
