"""The tuned path's helpers for autograd: what it takes (``supports``), whether a gradient will
flow, the backward's kernels compiled in the background during the first forward, and
``precompile``. The autograd node itself is ``flashattn.ops``' (``flash_attention``'s and
``flash_attention_fast``'s alike).

It takes fp16, bf16 and fp32 inputs with any head dim that is a multiple of 8 up to 256, GQA and
any strides. The backward is the two-kernel design (dQ kernel + dK/dV kernel, no atomics); the
fused one (dQ by fp32 atomic adds) is there to compare with, on request
(``flash_attention_fast(..., backward="fused")``),
and is the default for fp32 inputs (``backward="auto"``), at fp32's accuracy on bf16 pieces
(``pieces.py``): there every product costs several, and recomputing S and dP for dQ costs more
than the atomics (``tuning.fused_by_default``; not under ``torch.use_deterministic_algorithms``).

Why two kernels by default, measured on an H100 (fp16 and bf16, B*S = 16k, H*D = 2048;
``results/`` and ``notebooks/06_performance.ipynb``): across the benchmark grid (2026-11-25)
the two-kernel backward is 1.10-1.30x the fused one's speed at D=64 and 1.7-2.9x at D=128.
Not because of the fused kernel's fp32 atomic adds (with dQ stored instead, for timing only, it
was as slow): one program holding dK, dV and a dQ tile through five matrix products spills
registers, and recomputing P and dS in a dQ kernel of its own costs less. And the two-kernel
result is bit-reproducible, the atomic one is not.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import runtime
from .backward import fast_attention_backward
from .forward import fast_attention_forward
from .tuning import ArgSpec, fused_by_default, warm

#: head dims the fast kernels take: multiples of 8 up to 256 (padded to a power of two inside)
HEAD_DIMS = tuple(range(8, 257, 8))


def supports(dtype: torch.dtype, head_dim: int) -> tuple[bool, str]:
    """(True, "") if the fast kernels take inputs of this dtype and head dim, else (False, why)."""
    dtypes = (torch.float16, torch.float32) if runtime.INTERPRET else (torch.float16, torch.bfloat16, torch.float32)
    if dtype not in dtypes:
        return False, f"the fast path takes {', '.join(map(str, dtypes))}, got {dtype}"
    if head_dim not in HEAD_DIMS:
        return False, f"the fast path takes head dims that are multiples of 8 up to 256, got {head_dim}"
    return True, ""


def wants_gradient(q, k, v) -> bool:
    """Will a gradient flow through attention of these inputs? Not under ``torch.no_grad`` /
    inference mode, nor when none of them requires one: then the forward kernel runs alone,
    without the autograd node and the backward's preparation (host time on every call)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def precompile(dtypes, head_dims, causals, workers: int | None = None) -> float:
    """Compile every fast kernel variant for these dtypes / head dims / causal flags in
    parallel threads (Triton's AsyncCompileMode), before any timing. Returns seconds spent.
    Without it, the autotuner compiles its candidates one after another on first use."""
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    import triton

    if runtime.INTERPRET:
        return 0.0
    t0 = time.perf_counter()
    with triton.AsyncCompileMode(ThreadPoolExecutor(workers or os.cpu_count() or 4)):
        for dtype in dtypes:
            for D in head_dims:
                # short and long: the dK/dV kernel's TMA variant is for long S, the causal forward's
                # tile of its own for short S
                for S in (128, 4096):
                    q, k, v, o, do = (ArgSpec((1, 2, S, D), dtype, torch.device("cuda")) for _ in range(5))
                    lse = ArgSpec((1, 2, S), torch.float32, torch.device("cuda"))
                    for causal in causals:       # (a short causal forward has a tile of its own)
                        fast_attention_forward(q, k, v, causal, D ** -0.5, warmup=True)
                        for fused in (False, True):
                            fast_attention_backward(q, k, v, o, do, lse, causal, D ** -0.5,
                                                    fused=fused, warmup=True)
    return time.perf_counter() - t0


_prepared: dict = {}     # what prepare_backward was asked for -> its compiles (futures)
_pool = None


def _prepare_key(q, k, causal: bool) -> tuple:
    return (q.dtype, q.shape[-1], causal, q.shape[1] == k.shape[1], q.device)


def wait_prepared(q, k, causal: bool) -> None:
    """Wait for the background compiles of the backward for inputs like these, if any are still
    running: compiling the same kernel again in this thread would only compete with them for
    the CPU. (A compile that failed there is left to fail here, with its error.)"""
    key = _prepare_key(q, k, causal)
    futures = _prepared.get(key)
    if not futures:
        return
    for future in futures:
        try:
            future.result()
        except Exception:   # noqa: BLE001 -- the real launch raises it again, where it belongs
            pass
    _prepared[key] = ()     # done: later backwards need not ask the futures again (a lock each)


def _triton_key() -> None:
    """Triton hashes its own sources once per process for its cache keys (about 0.4 s): do it
    here, once, rather than in four threads at once."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:      # it lives elsewhere in other Triton versions: then each thread does it
        return
    triton_key()


def _on(device, fn, *args, **kwargs):
    """fn(*args, **kwargs) with ``device`` current (a new thread starts on device 0, and Triton
    compiles and loads for the current device)."""
    with torch.cuda.device(device):
        return fn(*args, **kwargs)


def contiguous_do(do: torch.Tensor) -> torch.Tensor:
    """dO as the backward's kernels read it fastest: ``out.sum().backward()`` hands over one
    number expanded to O's shape (every stride 0). The kernels read that too, but as another
    kernel variant (compiled apart, without the copy engine's loads); one copy of O's size makes
    it the layout the background warm-up prepared."""
    return do.contiguous() if 0 in do.stride() else do


def prepare_backward(q, k, v, o, lse, causal: bool, scale: float) -> None:
    """Compile and load the backward's kernels for inputs like these in background threads, the
    first time such inputs come, so that a first forward + backward costs about two compiles
    instead of four in a row. (Triton spends its compile time in C++ passes and ptxas, so the
    threads really overlap: on an H100 the forward, dQ and dK/dV kernels at D = 128 take 3.1,
    2.1 and 2.4 s alone, 3.0 s together.) The backward waits for them (:func:`wait_prepared`)."""
    global _pool
    if runtime.INTERPRET or torch.cuda.is_current_stream_capturing():
        return
    key = _prepare_key(q, k, causal)
    if key in _prepared:
        return
    from concurrent.futures import ThreadPoolExecutor

    from ..backward import attn_bwd_delta_kernel

    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="flashattn-compile")
    # Compiling needs what the arguments look like, not their values: specs, no tensors (no
    # memory taken, none held; see ``tuning.ArgSpec``). dO is taken to be laid out like O.
    q, k, v, o, lse = (ArgSpec.like(t) for t in (q, k, v, o, lse))
    do, delta = o, ArgSpec(lse.shape, lse.dtype, lse.device)
    D = q.shape[-1]
    _triton_key()
    if fused_by_default(q, True):   # fp32: one fused kernel (and the split into pieces)
        kernels = [_pool.submit(_on, q.device, fast_attention_backward, q, k, v, o, do, lse, causal, scale,
                                warmup=True)]
    else:                           # the dQ kernel and the dK/dV kernel, side by side
        kernels = [_pool.submit(_on, q.device, fast_attention_backward, q, k, v, o, do, lse, causal, scale,
                                needs, not needs, warmup=True) for needs in (True, False)]
    _prepared[key] = kernels + [
        _pool.submit(_on, q.device, warm, attn_bwd_delta_kernel, o, do, delta, *o.stride(), *do.stride(),
                     *delta.stride(), q.shape[1], q.shape[2], D, BLOCK_M=64, BLOCK_D=runtime.head_dim_block(D),
                     grid=(1,), num_warps=4, num_stages=1),
    ]
