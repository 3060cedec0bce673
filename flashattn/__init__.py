"""flashattn: FlashAttention forward and backward in Triton, built to be read and taught.

The pieces, in the order data flows through them::

    runtime    device / interpreter / dtype policy and input validation (imported first: it
               decides whether Triton runs compiled on a GPU or in its CPU interpreter)
    configs    tile sizes that fit the device's shared memory, for every kernel
    reference  plain PyTorch that materialises S, P, LSE: the oracle
    forward    forward kernel -> O, LSE                          } the lesson kernels,
    backward   delta preprocess, dQ kernel, dK/dV kernel         } what the notebooks
    autograd   FlashAttentionFunction                            } print
    ops        the kernels as PyTorch operators (torch.compile, CUDA graphs, opcheck)
    api        scaled_dot_product_attention (SDPA's signature) and flash_attention: the
               lesson or the fast kernels
    verify     comparisons with SDPA / the reference, per head, as a table

and beside them: ``fast`` (the tuned kernels flash_attention uses on a GPU), ``bench``
(python -m flashattn.bench), ``planted`` (named one-line bugs and ablations made from the real
kernels), ``viz`` (figures), ``check`` (exercise checkers), ``exercises``
(python -m flashattn.exercises), ``lazy`` (the capstone: lazy attention), ``beyond`` (lesson 09:
sliding windows, dropout by recomputation, packed variable-length batches).
"""
from . import runtime  # first: sets TRITON_INTERPRET=1 when there is no GPU
from .runtime import (BF16FallbackWarning, INTERPRET, default_device, device_summary,
                      where)
from .configs import KernelConfig
from .reference import AttentionReference, attention_reference, attention_autograd
from .forward import attention_forward
from .backward import (attention_backward, attention_backward_delta, attention_backward_dq,
                       attention_backward_dkdv)
from .autograd import FlashAttentionFunction, teaching_flash_attention
from .api import flash_attention, flash_attention_fast, scaled_dot_product_attention
from .verify import Report, check_attention, compare, sdpa, verify_attention
from .lazy import LazyAttentionFunction, lazy_attention
from . import beyond
from .beyond import flash_attention_varlen

__version__ = "0.1.0"

__all__ = [
    "scaled_dot_product_attention", "flash_attention", "flash_attention_fast", "FlashAttentionFunction", "teaching_flash_attention",
    "attention_forward", "attention_backward", "attention_backward_delta",
    "attention_backward_dq", "attention_backward_dkdv",
    "attention_reference", "attention_autograd", "AttentionReference",
    "verify_attention", "check_attention", "compare", "sdpa", "Report",
    "KernelConfig", "BF16FallbackWarning", "INTERPRET", "default_device", "device_summary",
    "where", "runtime",
    "lazy_attention", "LazyAttentionFunction", "beyond", "flash_attention_varlen",
]
