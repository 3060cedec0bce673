"""Autotuning for the fast kernels: candidate configs, pruned by shared memory, keyed on
(S_q, S_k) buckets, the causal flag, the head dim and the dtype.

Sequence lengths are bucketed to powers of two, so a model trained on varying lengths tunes
once per bucket instead of once per length. Results are also cached on disk by Triton
(``cache_results=True``), so a second process does not re-tune.
"""
from __future__ import annotations

import triton

from .. import runtime
from ..runtime import KernelConfig

# (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M is the query-row tile, BLOCK_N the key-row
# tile, in every kernel.
# The backward kernels need the inner tile to divide the outer one (dq: BLOCK_N | BLOCK_M;
# dkdv: BLOCK_M | BLOCK_N) so that the causal diagonal falls on whole inner tiles. The last
# candidate of each list is small enough for D=256 or a 64 KB-shared-memory GPU.
CANDIDATES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
            (64, 32, 4, 2)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3),
           (64, 32, 4, 1)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3), (64, 64, 4, 3),
             (64, 128, 4, 3), (32, 64, 4, 1)],
    "fused": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3), (64, 64, 4, 3),
              (32, 64, 4, 1)],
}

# What the interpreter (CPU tests of the fast kernels) uses: small tiles, unequal so that the
# diagonal logic is exercised, with the divisibility each backward kernel needs.
INTERPRETER_CONFIGS = {
    "fwd": KernelConfig(32, 16, 1, 1), "dq": KernelConfig(32, 16, 1, 1),
    "dkdv": KernelConfig(16, 32, 1, 1), "fused": KernelConfig(16, 32, 1, 1),
}


def bucket(S_q: int, S_k: int) -> int:
    """One integer naming the (S_q, S_k) bucket: next powers of two, packed."""
    return triton.next_power_of_2(S_q) * (1 << 24) + triton.next_power_of_2(S_k)


def _smem_kernel_name(name: str) -> str:
    return {"fwd": "fwd", "dq": "dq", "dkdv": "dkdv", "fused": "dkdv"}[name]


def _prune(name: str):
    def prune(configs, named_args, **kwargs):
        head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        q = named_args.get("Q")
        elem = q.element_size() if hasattr(q, "element_size") else 2
        limit = runtime.device_shared_memory()
        keep = []
        for c in configs:
            kc = KernelConfig(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            if runtime.shared_memory_estimate(_smem_kernel_name(name), kc, head_dim, elem) <= limit:
                keep.append(c)
        return keep or configs[-1:]

    return prune


def _quick_bench(fn, quantiles=None):
    # A median over ~60 ms per candidate. The best candidates are often within 3-8% of each
    # other (an exhaustive H100 sweep), so a short timing can keep the wrong one: with 25 ms
    # the tuner once kept a D=128 forward tile 10% slower than the best, and even 60 ms does not
    # separate tiles a few percent apart every time (notebook 06's ablation). The default, 25 ms
    # warm-up + 100 ms per candidate, makes first calls needlessly slow.
    return triton.testing.do_bench(fn, warmup=10, rep=60, quantiles=quantiles)


def autotuned(kernel, name: str, reset_to_zero=None):
    """``kernel`` wrapped in ``triton.autotune`` with this module's candidates (None in the
    interpreter, where the raw kernel runs with a fixed small config)."""
    if runtime.INTERPRET:
        return None
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in CANDIDATES[name]]
    kwargs = dict(configs=configs, key=["S_BUCKET", "CAUSAL", "HEAD_DIM"],
                  prune_configs_by={"early_config_prune": _prune(name)},
                  reset_to_zero=reset_to_zero, do_bench=_quick_bench)
    try:
        return triton.autotune(cache_results=True, **kwargs)(kernel)
    except TypeError:  # older Triton without on-disk autotune cache
        return triton.autotune(**kwargs)(kernel)


def pick(tuned, raw, config: KernelConfig | None, name: str):
    """(kernel, launch options): the autotuner, or the raw kernel with a given/fixed config."""
    if config is None and tuned is not None:
        return tuned, {}
    cfg = config or INTERPRETER_CONFIGS[name]
    if name in ("dkdv", "fused") and cfg.BLOCK_N % cfg.BLOCK_M:
        raise ValueError(f"{name}: BLOCK_M must divide BLOCK_N, got {cfg}")
    return raw, {"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N,
                 "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def launch(kernel, grid, args, kwargs, warmup: bool = False):
    """Launch, or with ``warmup`` only compile (every autotune candidate, for the autotuner)."""
    if warmup:  # an autotuner's warmup compiles each candidate that survives pruning
        kernel.warmup(*args, grid=(1, 1), **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def precompile(dtypes, head_dims, causals, workers: int | None = None) -> float:
    """Compile every fast kernel variant for these dtypes / head dims / causal flags in
    parallel threads (Triton's AsyncCompileMode), before any timing. Returns seconds spent.
    Without it, the autotuner compiles its candidates one after another on first use."""
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from .backward import fast_attention_backward
    from .forward import fast_attention_forward
    from .fused import fused_attention_backward

    if runtime.INTERPRET:
        return 0.0
    t0 = time.perf_counter()
    with triton.AsyncCompileMode(ThreadPoolExecutor(workers or os.cpu_count() or 4)):
        for dtype in dtypes:
            for D in head_dims:
                q, k, v, o, do = (torch.empty(1, 2, 128, D, dtype=dtype, device="cuda") for _ in range(5))
                lse = torch.empty(1, 2, 128, dtype=torch.float32, device="cuda")
                for causal in causals:
                    fast_attention_forward(q, k, v, causal, D ** -0.5, warmup=True)
                    fast_attention_backward(q, k, v, o, do, lse, causal, D ** -0.5, warmup=True)
                    fused_attention_backward(q, k, v, o, do, lse, causal, D ** -0.5, warmup=True)
    return time.perf_counter() - t0
