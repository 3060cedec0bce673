"""flashattn.fast: the tuned kernels (exp2, split causal loops, autotuning, a fused backward
to compare with).

The lesson kernels in ``flashattn.forward`` / ``flashattn.backward`` stay simple; this is what
``flash_attention`` uses on a GPU for fp16/bf16 and power-of-two head dims. Both pass the same
correctness suite.
"""
from .autograd import HEAD_DIMS, precompile, supports
from .backward import fast_attention_backward
from .forward import fast_attention_forward

__all__ = ["supports", "precompile", "fast_attention_forward", "fast_attention_backward", "HEAD_DIMS"]
