"""Lazy attention, the capstone (notebook 07): causal attention with a learnable per-head
distance bias and a per-head tau, ReLU(softmax + tau/(i+1)).

    kernels    forward, backward preprocess, dQ and dK/dV kernels with their launchers,
               LazyAttentionFunction and lazy_attention(q, k, v, bias, tau)
    reference  the float64 oracle and the explicit backward formulas
    bench      python -m flashattn.lazy.bench: Triton against materialised PyTorch

The exercise checker is ``flashattn.check.lazy_backward``.
"""
from .kernels import (LazyAttentionFunction, check_lazy_inputs, lazy_attention,
                      lazy_attention_backward, lazy_attention_forward)
from .reference import lazy_attention_reference

__all__ = ["lazy_attention", "LazyAttentionFunction", "lazy_attention_forward",
           "lazy_attention_backward", "check_lazy_inputs", "lazy_attention_reference"]
