"""Autotuning for the fast kernels, and the constants they share. A leaf: it imports no kernel.

The candidate tiles and the shared-memory pruning are the package's one policy
(``flashattn.configs``: ``fast_fwd``, ``fast_dq``, ``fast_dkdv``); here they become
``triton.autotune`` configs keyed on (S_q, S_k) buckets, the causal flag and the head dim
(the dtype is part of every kernel's signature, so Triton keys on it already).

Sequence lengths are bucketed to powers of two, so a model trained on varying lengths tunes
once per bucket instead of once per length. Results are also cached on disk by Triton
(``cache_results=True``), so a second process does not re-tune.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import configs, runtime
from ..configs import KernelConfig

#: exp(x) = exp2(x * LOG2E): the fast kernels work in base 2 (exp2 is the GPU's native unit)
LOG2E = tl.constexpr(1.4426950408889634)
#: log(x) = log2(x) * LN2: back to the natural-log LSE the rest of the package uses
LN2 = tl.constexpr(0.6931471805599453)

#: kernel name used by the launchers -> key of ``configs.CANDIDATES``
KERNELS = {"fwd": "fast_fwd", "dq": "fast_dq", "dkdv": "fast_dkdv", "fused": "fast_dkdv"}


def bucket(S_q: int, S_k: int) -> int:
    """One integer naming the (S_q, S_k) bucket: next powers of two, packed."""
    return triton.next_power_of_2(S_q) * (1 << 24) + triton.next_power_of_2(S_k)


def _prune(name: str):
    kernel = KERNELS[name]

    def prune(candidates, named_args, **kwargs):
        head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        q = named_args.get("Q")
        elem = q.element_size() if hasattr(q, "element_size") else 2
        fits = set(configs.fitting(kernel, head_dim, elem, configs.device_shared_memory()))
        keep = [c for c in candidates if KernelConfig.from_triton(c) in fits]
        return keep or candidates[-1:]

    return prune


def _quick_bench(fn, quantiles=None):
    # A median over ~60 ms per candidate. The best candidates are often within 3-8% of each
    # other (an exhaustive H100 sweep), so a short timing can keep the wrong one: with 25 ms
    # the tuner once kept a D=128 forward tile 10% slower than the best, and even 60 ms does not
    # separate tiles a few percent apart every time (notebook 06's ablation). The default, 25 ms
    # warm-up + 100 ms per candidate, makes first calls needlessly slow.
    return triton.testing.do_bench(fn, warmup=10, rep=60, quantiles=quantiles)


def autotuned(kernel, name: str, reset_to_zero=None):
    """``kernel`` wrapped in ``triton.autotune`` with the candidates of ``name`` (None in the
    interpreter, where the raw kernel runs with a fixed small config)."""
    if runtime.INTERPRET:
        return None
    candidates = [c.to_triton() for c in configs.CANDIDATES[KERNELS[name]]]
    kwargs = dict(configs=candidates, key=["S_BUCKET", "CAUSAL", "HEAD_DIM"],
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
    cfg = config or configs.INTERPRETER_FAST_CONFIGS[KERNELS[name]]
    if name in ("dkdv", "fused") and cfg.BLOCK_N % cfg.BLOCK_M:
        raise ValueError(f"{name}: BLOCK_M must divide BLOCK_N, got {cfg}")
    if name == "dq" and cfg.BLOCK_M % cfg.BLOCK_N:
        raise ValueError(f"{name}: BLOCK_N must divide BLOCK_M, got {cfg}")
    return raw, {"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N, **cfg.launch_options()}


def launch(kernel, grid, args, kwargs, warmup: bool = False):
    """Launch, or with ``warmup`` only compile (every autotune candidate, for the autotuner)."""
    if warmup:  # an autotuner's warmup compiles each candidate that survives pruning
        kernel.warmup(*args, grid=(1, 1), **kwargs)
    else:
        kernel[grid](*args, **kwargs)
