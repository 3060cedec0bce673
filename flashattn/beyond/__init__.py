"""Lesson 09, beyond the basics (notebook 09): sliding windows, dropout by recomputation, and
packed variable-length batches, on the lesson kernels' design.

    kernels    forward, dQ and dK/dV kernels with WINDOW / DROPOUT / VARLEN switches, their
               launchers, and ``dropout_mask`` (the mask Z, for tests and figures)
    attention  ``flash_attention(..., window=, dropout_p=)`` and ``flash_attention_varlen``, on the
               lesson kernels or the fast ones (``impl``), and ``precompile`` for the fast ones
    reference  the float64 oracle, and ``kernels_and_reference`` (both on the same inputs)
"""
from .attention import Lesson09Kernels, flash_attention, flash_attention_varlen, precompile
from .kernels import dropout_mask
from .reference import attention_reference, kernels_and_reference, packed_mask, varlen_reference, window_mask

__all__ = ["flash_attention", "flash_attention_varlen", "Lesson09Kernels", "dropout_mask", "precompile",
           "attention_reference", "varlen_reference", "window_mask", "packed_mask",
           "kernels_and_reference"]
