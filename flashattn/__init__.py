"""flashattn: FlashAttention forward and backward in Triton, built to be read and taught.

The pieces, in the order data flows through them::

    runtime    device / interpreter / dtype / block-size policy (imported first: it decides
               whether Triton runs compiled on a GPU or in its CPU interpreter)
    reference  plain PyTorch that materialises S, P, LSE: the oracle
    forward    forward kernel -> O, LSE
    backward   delta preprocess, dQ kernel, dK/dV kernel
    autograd   FlashAttentionFunction and flash_attention(q, k, v, causal=, scale=)
    verify     comparisons with SDPA / the reference, per head, as a table

and beside them: ``fast`` (the tuned kernels flash_attention uses on a GPU), ``bench``
(python -m flashattn.bench), ``planted`` (buggy variants of the real kernels for lessons),
``viz`` (figures), ``check`` (exercise checkers), ``exercises`` (python -m flashattn.exercises),
``lazy`` / ``lazy_reference`` / ``lazy_bench`` (the capstone: lazy attention).
"""
from . import runtime  # first: sets TRITON_INTERPRET=1 when there is no GPU
from .runtime import BF16FallbackWarning, KernelConfig, INTERPRET, default_device, where
from .reference import AttentionReference, attention_reference, attention_autograd
from .forward import attention_forward
from .backward import (attention_backward, attention_backward_delta, attention_backward_dq,
                       attention_backward_dkdv)
from .autograd import FlashAttentionFunction, flash_attention
from .verify import Report, check_attention, compare, sdpa
from .lazy import LazyAttentionFunction, lazy_attention

__version__ = "0.1.0"

__all__ = [
    "flash_attention", "FlashAttentionFunction",
    "attention_forward", "attention_backward", "attention_backward_delta",
    "attention_backward_dq", "attention_backward_dkdv",
    "attention_reference", "attention_autograd", "AttentionReference",
    "check_attention", "compare", "sdpa", "Report",
    "KernelConfig", "BF16FallbackWarning", "INTERPRET", "default_device", "where", "runtime",
    "lazy_attention", "LazyAttentionFunction",
]
