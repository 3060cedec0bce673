"""Lesson 09's entry points: ``flash_attention`` with windows and dropout on ``[B, H, S, D]``
tensors, and ``flash_attention_varlen`` on packed ``[total, H, D]`` batches (FlashAttention's
``cu_seqlens`` layout, as ``torch.nn.attention.varlen.varlen_attn`` takes it). Both go through the
package's one autograd node (``flashattn.ops.EagerAttention``, with ``Lesson09Kernels`` as its
kernels) to either of two kernel families with the same three switches: the lesson's kernels of
``kernels.py`` (``impl="teaching"``, what the CPU interpreter runs) or the tuned kernels of
``flashattn.fast`` (``impl="fast"``, what a GPU runs by default). Both draw the same dropout mask
from the same seed (``flashattn.features.dropout_keep``).
"""
from __future__ import annotations

import numbers
import warnings
import weakref
from typing import NamedTuple, Optional

import torch

from .. import runtime
from ..configs import KernelConfig
from ..features import DROPOUT_LEVELS, dropout_counters, dropout_threshold
from ..fast import fast_attention_backward, fast_attention_forward
from ..ops import EagerAttention, pick_impl, traced
from . import ops
from .kernels import Layout, beyond_backward, beyond_forward, window_bounds

class Lesson09Kernels(NamedTuple):
    """Lesson 09's kernel calls for ``ops.EagerAttention``: its forward and backward with the
    features given once here. ``window_args`` = (on, LEFT, RIGHT): the fast kernels take causal
    apart from a window (they have a cheaper causal path: the node's ``causal``); the lesson
    kernels take causal folded into the window (the node's ``causal`` is then False)."""
    layout: Layout
    window_args: tuple
    dropout_p: float
    seed: int
    config: Optional[KernelConfig]

    def forward(self, q, k, v, causal: bool, scale: float, impl: str):
        """(O, LSE); the backward regenerates P from LSE and the dropout mask from the seed."""
        if impl == "fast":
            return fast_attention_forward(q, k, v, causal, scale, layout=self.layout, window_args=self.window_args,
                                          dropout_p=self.dropout_p, seed=self.seed, config=self.config)
        return beyond_forward(q, k, v, self.layout, scale, self.window_args, self.dropout_p, self.seed,
                              config=self.config)

    def backward(self, do, q, k, v, o, lse, causal: bool, scale: float, impl: str, needs_dq: bool, needs_dkdv: bool):
        """(dQ, dK, dV), all three (the node drops those not asked for)."""
        if impl == "fast":
            return fast_attention_backward(q, k, v, o, do, lse, causal, scale, layout=self.layout,
                                           window_args=self.window_args, dropout_p=self.dropout_p, seed=self.seed,
                                           config=self.config)
        return beyond_backward(q, k, v, o, do, lse, self.layout, scale, self.window_args, self.dropout_p,
                               self.seed, config=self.config)


def _kernels(dtype: torch.dtype, head_dim: int, impl: str, window, causal: bool, S_q: int, S_k: int):
    """(impl, (causal, window_args)): which family runs, and how it takes the mask."""
    impl = pick_impl(impl, dtype, head_dim)
    window_args = window_bounds(window, causal, S_q, S_k)
    if impl == "teaching":
        return impl, (False, window_args)            # causal is the window (-1, 0)
    if window is None:
        return impl, (causal, (False, 0, 0))         # plain (or causal) attention: the fast causal path
    return impl, (False, window_args)                # a window, causal folded into its right side


def validate_window(window) -> Optional[tuple[int, int]]:
    """None, or (left, right) with each an int >= 0, or -1 for "no limit" on that side."""
    if window is None:
        return None
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window must be a pair of ints (left, right), got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"window sides must be >= 0, or -1 for no limit, got {tuple(window)}")
    return int(window[0]), int(window[1])


def validate_dropout(dropout_p, seed, S_q: int, S_k: int, draw: bool = True) -> tuple[float, Optional[int]]:
    """(dropout_p, seed): p in [0, 1); without a seed one is drawn from torch's default generator,
    so ``torch.manual_seed`` makes a run reproducible (``draw=False``: left None, for a compiled
    graph to draw)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if 0 < dropout_p and dropout_threshold(dropout_p) == 0:
        warnings.warn(f"dropout_p={dropout_p} is below the dropout mask's resolution: each element's draw "
                      f"is 8 bits and p is rounded to a multiple of 1/{DROPOUT_LEVELS}, so nothing is "
                      f"dropped (the output is only scaled by 1 / (1 - p)); use p > 1/{2 * DROPOUT_LEVELS}",
                      UserWarning, stacklevel=3)
    if dropout_p > 0 and dropout_counters(S_q, S_k) > 2 ** 32:
        raise ValueError(f"dropout numbers one head's Philox calls with 32 bits: S_q * ceil(S_k / 32) * 4 "
                         f"must be at most 2**32, got {S_q} * ceil({S_k} / 32) * 4")
    if seed is None and not draw:
        return float(dropout_p), None
    if seed is None:
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,)).item()) if dropout_p > 0 else 0
    elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2 ** 31:
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
    return float(dropout_p), int(seed)


def _in_kernel_dtype(q, k, v):
    dtype = runtime.compute_dtype(q.dtype, q.device)      # bf16 without bf16 dots: fp32, warned
    return tuple(t.to(dtype) for t in (q, k, v))


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: Optional[float] = None, window=None, dropout_p: float = 0.0,
                    seed: Optional[int] = None, impl: str = "auto",
                    config: Optional[KernelConfig] = None) -> torch.Tensor:
    """``flashattn.flash_attention`` plus a sliding window and dropout.

    q ``[B, H, S_q, D]``, k and v ``[B, H_kv, S_k, D]``, any strides. ``window=(left, right)``:
    query i sees keys i - left ... i + right (-1: no limit on that side), aligned top-left like
    ``causal``, which is the window (-1, 0) and narrows any window's right side to 0. (FlashAttention
    aligns windows bottom-right when S_q != S_k; for S_q == S_k the two agree.) A row that sees no
    key gets O = 0. ``dropout_p``: each attention weight is dropped with probability p and the rest
    scaled by 1 / (1 - p), the mask drawn from ``seed`` (default: from torch's generator). Each
    element's draw is 8 bits, as in FlashAttention: the drop probability is rounded to a multiple
    of 1/256 (p = 0.1 drops 10.2%, p = 0.01 drops 1.2%, p <= 1/512 nothing, with a warning), and the
    survivors are scaled by the nominal 1 / (1 - p), as FlashAttention and SDPA scale them.
    ``impl``: "teaching" (lesson 09's kernels), "fast" (the tuned ones), "auto" (fast on a GPU).
    ``config``: one tile for every kernel (default: each kernel's own choice).
    """
    q, k, v = runtime.autocast_inputs(q, k, v)        # as SDPA (and flashattn.flash_attention) cast them
    runtime.validate_qkv(q, k, v, allow_bf16_fallback=True)
    causal = runtime.validate_causal(causal)
    scale = runtime.validate_scale(scale, q.shape[-1])
    window = validate_window(window)
    compiled = config is None and traced(q, k, v)        # torch.compile: through the operators
    dropout_p, seed = validate_dropout(dropout_p, seed, q.shape[2], k.shape[2], draw=not compiled)
    q_, k_, v_ = _in_kernel_dtype(q, k, v)
    impl, mask = _kernels(q_.dtype, q.shape[-1], impl, window, causal, q.shape[2], k.shape[2])
    if compiled:
        return ops.attention(q_, k_, v_, seed, mask, scale, dropout_p, impl).to(q.dtype)
    causal, window_args = mask
    kernels = Lesson09Kernels(Layout(q, k), window_args, dropout_p, seed, config)
    return EagerAttention.apply(q_, k_, v_, causal, scale, impl, kernels).to(q.dtype)


#: cu_seqlens already read: id -> (weak reference, version, offsets). Reading a GPU tensor's
#: values waits for the GPU (~0.1-0.2 ms that a training step would pay per attention layer);
#: a model passes the same cu_seqlens to every layer, so each is read once while it is alive
#: and unchanged (an in-place write bumps ``_version``).
_offsets_read: dict = {}


def _offsets(cu: torch.Tensor) -> list[int]:
    entry = _offsets_read.get(id(cu))
    if entry is not None and entry[0]() is cu and entry[1] == cu._version:
        return entry[2]
    offsets = [int(x) for x in cu.tolist()]
    if len(_offsets_read) >= 64:
        _offsets_read.clear()
    _offsets_read[id(cu)] = (weakref.ref(cu), cu._version, offsets)
    return offsets


def validate_cu_seqlens(cu, name: str, total: int, device) -> tuple[torch.Tensor, list[int]]:
    """cu_seqlens as the kernels read it (int32, contiguous) and the lengths it describes."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        got = f"shape {tuple(cu.shape)}, dtype {cu.dtype}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise TypeError(f"{name} must be a 1-D int32 tensor [n_sequences + 1], got {got}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must hold at least two offsets (one sequence), got {cu.tolist()}")
    offsets = _offsets(cu)
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]} ({name}={offsets})")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must not decrease (each entry is where a sequence starts), got {offsets}")
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {offsets[-1]}")
    return cu.to(device=device, dtype=torch.int32).contiguous(), [b - a for a, b in zip(offsets, offsets[1:])]


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                           scale: Optional[float] = None, window=None, dropout_p: float = 0.0,
                           seed: Optional[int] = None, impl: str = "auto",
                           config: Optional[KernelConfig] = None) -> torch.Tensor:
    """Attention over a packed batch: q ``[total_q, H, D]``, k and v ``[total_k, H_kv, D]``;
    sequence b holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and the matching rows of k, v,
    and attends only inside itself. ``max_seqlen_*``: the longest sequence (it sizes the grid).
    ``causal``, ``window``, ``dropout_p``, ``impl`` as in :func:`flash_attention`, in positions
    inside each sequence. Returns O ``[total_q, H, D]``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be packed 3-D [total, heads, D], got {got}")
    q4, k4, v4 = (t.permute(1, 0, 2)[None] for t in (q, k, v))        # [1, H, total, D] views
    runtime.validate_qkv(q4, k4, v4, allow_bf16_fallback=True)
    cu_q, lens_q = validate_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device)
    cu_k, lens_k = validate_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device)
    if len(lens_q) != len(lens_k):
        raise ValueError(f"cu_seqlens_q describes {len(lens_q)} sequences and cu_seqlens_k {len(lens_k)}")
    for name, given, lens in (("max_seqlen_q", max_seqlen_q, lens_q), ("max_seqlen_k", max_seqlen_k, lens_k)):
        if not isinstance(given, numbers.Integral) or given < max(lens):
            raise ValueError(f"{name} must be an int >= the longest sequence ({max(lens)}), got {given!r}")
    causal = runtime.validate_causal(causal)
    scale = runtime.validate_scale(scale, q.shape[-1])
    window = validate_window(window)
    dropout_p, seed = validate_dropout(dropout_p, seed, max(lens_q), max(lens_k))
    q_, k_, v_ = _in_kernel_dtype(q4, k4, v4)
    layout = Layout(q_, k_, cu_q, cu_k, max(max(lens_q), 1), max(max(lens_k), 1))
    impl, mask = _kernels(q_.dtype, q.shape[-1], impl, window, causal, layout.S_q, layout.S_k)
    causal, window_args = mask
    kernels = Lesson09Kernels(layout, window_args, dropout_p, seed, config)
    o = EagerAttention.apply(q_, k_, v_, causal, scale, impl, kernels)
    return o[0].permute(1, 0, 2).to(q.dtype)


def precompile(dtypes, head_dims, variants=None, workers: Optional[int] = None) -> float:
    """Compile the fast kernels for lesson 09's features in parallel threads before first use
    (as ``flashattn.fast.precompile`` does for plain attention); returns seconds spent.
    ``variants``: (causal, windowed, varlen, dropout) tuples, default every combination (a
    window takes causal folded in, so (True, True, ...) is not a separate kernel)."""
    import itertools
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    import triton

    from ..fast.tuning import ArgSpec

    if runtime.INTERPRET:
        return 0.0
    if variants is None:
        variants = [(c, w, vl, dr) for c, w, vl, dr in itertools.product((False, True), repeat=4)
                    if not (c and w) and (w or vl or dr)]
    device = torch.device("cuda")
    t0 = time.perf_counter()
    with triton.AsyncCompileMode(ThreadPoolExecutor(workers or os.cpu_count() or 4)):
        for dtype, D, (causal, windowed, varlen, dropout) in itertools.product(dtypes, head_dims, variants):
            H, T = 2, 128
            if varlen:     # [1, H, total, D] views of packed [total, H, D] tensors
                q, k, v, o, do = (ArgSpec((1, H, T, D), dtype, device, stride=(T * H * D, D, H * D, 1))
                                  for _ in range(5))
                cu = torch.zeros(2, dtype=torch.int32, device=device)
                layout = Layout(q, k, cu, cu, T, T)
            else:
                q, k, v, o, do = (ArgSpec((1, H, T, D), dtype, device) for _ in range(5))
                layout = Layout(q, k)
            lse = ArgSpec((1, H, T), torch.float32, device)
            kw = dict(layout=layout, window_args=(windowed, 16, 0), dropout_p=0.1 if dropout else 0.0, seed=1)
            fast_attention_forward(q, k, v, causal, D ** -0.5, warmup=True, **kw)
            fast_attention_backward(q, k, v, o, do, lse, causal, D ** -0.5, warmup=True, **kw)
    return time.perf_counter() - t0
