"""Tiles and launch options: one policy for every kernel of the package.

A kernel launch needs a tile shape (``BLOCK_M`` query rows by ``BLOCK_N`` key rows), a number
of warps and a software-pipelining depth (``num_stages``). This module holds, for every
kernel (the lesson kernels, the fast ones, lazy attention's):

* the candidate configs, best first (``CANDIDATES``);
* how much shared memory each needs (``shared_memory_estimate``) and how much the GPU has
  (``device_shared_memory``, which ``FLASHATTN_MAX_SHARED_MEMORY`` can cap: set it to 65536
  to make the package pick tiles as for a 64 KB GPU such as Colab's T4);
* the candidates that fit (``candidates``), and a launch that steps down to the next one when
  the compiler still runs out of resources (``launch``).

One config type, :class:`KernelConfig`; the fast kernels' autotuner gets the same configs as
``triton.Config`` objects (:meth:`KernelConfig.to_triton`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from . import runtime, settings


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of one kernel launch."""

    BLOCK_M: int  # query rows per tile
    BLOCK_N: int  # key/value rows per tile
    num_warps: int = 4
    num_stages: int = 2
    #: registers per thread the compiler may use (None: as many as it likes, up to 255). A cap
    #: of 128 lets two programs of 8 warps share an SM (65536 registers), where the shared
    #: memory lets them too: while one waits on its loads or stores its tile, the other computes.
    maxnreg: Optional[int] = None

    def launch_options(self) -> dict:
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options

    def to_triton(self):
        import triton

        return triton.Config({"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N},
                             num_warps=self.num_warps, num_stages=self.num_stages, maxnreg=self.maxnreg)

    @classmethod
    def from_triton(cls, config) -> "KernelConfig":
        return cls(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps,
                   config.num_stages, getattr(config, "maxnreg", None))


def _c(m, n, w, s, maxnreg=None) -> KernelConfig:
    return KernelConfig(m, n, w, s, maxnreg)


#: What the interpreter uses: block size barely matters for correctness there, and 32 keeps
#: the number of Python-level steps small.
INTERPRETER_CONFIG = _c(32, 32, 1, 1)

#: The fast kernels in the interpreter (CPU tests): small unequal tiles, so that the causal
#: diagonal logic is exercised, with the divisibility each backward kernel needs.
INTERPRETER_FAST_CONFIGS = {"fast_fwd": _c(32, 16, 1, 1), "fast_dq": _c(32, 16, 1, 1),
                            "fast_dkdv": _c(16, 32, 1, 1), "fast_dk": _c(16, 32, 1, 1), "fast_dv": _c(16, 32, 1, 1),
                            "fast_pieces": _c(16, 32, 1, 1)}

# Candidates per kernel, best first. The last of each list is small enough for D = 256 or a
# 64 KB-shared-memory GPU. (fp32 at D = 256 needs the fast kernels' 16 x 16 tail: its split products
# -- bf16x6 in the forward, tf32x3 in the backward -- hold 2.5x the estimate below in shared memory;
# the randomized battery found every larger tile refused on an H200, "Required: 245760, Hardware
# limit: 232448".)
CANDIDATES: dict[str, list[KernelConfig]] = {
    # the lesson kernels: the two-kernel backward anchor of the course is 64 x 64, 4 warps,
    # 3 stages; the forward likes a taller Q tile
    "fwd": [_c(128, 64, 8, 3), _c(64, 64, 4, 3), _c(64, 32, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
    "dq": [_c(64, 64, 4, 3), _c(64, 32, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
    "dkdv": [_c(64, 64, 4, 3), _c(32, 64, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
    "delta": [_c(64, 64, 4, 1)],
    # the fast kernels (an exhaustive H100 sweep picked these; notebook 06). The backward
    # kernels need the inner tile to divide the outer one (dq: BLOCK_N | BLOCK_M; dkdv:
    # BLOCK_M | BLOCK_N) so that the causal diagonal falls on whole inner tiles.
    "fast_fwd": [_c(128, 64, 4, 3), _c(128, 64, 8, 3), _c(128, 128, 8, 3), _c(128, 128, 8, 2),
                 _c(64, 64, 4, 3), _c(128, 32, 8, 3), _c(64, 32, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
    "fast_dq": [_c(128, 64, 8, 3), _c(128, 64, 8, 2), _c(128, 32, 4, 3), _c(64, 64, 4, 3),
                _c(128, 64, 4, 3), _c(128, 64, 8, 1), _c(32, 32, 4, 3), _c(64, 32, 4, 1), _c(16, 16, 2, 1)],
    "fast_dkdv": [_c(64, 128, 8, 2), _c(32, 128, 4, 3), _c(64, 64, 4, 2), _c(32, 64, 4, 3),
                  _c(64, 64, 4, 3), _c(64, 128, 4, 3), _c(64, 128, 8, 3), _c(32, 32, 4, 3), _c(32, 32, 4, 2),
                  _c(32, 64, 4, 1), _c(16, 16, 2, 1)],
    # dK and dV by a launch each, at a padded head dim of 256 (``fast.tuning.dkdv_parts``): one
    # fp32 accumulator of [BLOCK_N, 256] leaves room for taller tiles with one stage
    "fast_dk": [_c(64, 128, 8, 1), _c(16, 64, 4, 3), _c(64, 64, 4, 2), _c(32, 64, 4, 2), _c(32, 32, 4, 2),
                _c(32, 64, 4, 1), _c(16, 16, 2, 1)],
    "fast_dv": [_c(32, 64, 4, 2), _c(16, 64, 4, 3), _c(64, 128, 8, 1), _c(64, 64, 4, 2), _c(32, 32, 4, 2),
                _c(32, 64, 4, 1), _c(16, 16, 2, 1)],
    # the fused dK/dV + dQ kernel on fp32 inputs as bf16 pieces (``fast/pieces.py``): three
    # planes of every tile it keeps or streams
    "fast_pieces": [_c(64, 64, 4, 1), _c(64, 128, 8, 1), _c(64, 64, 4, 2), _c(128, 128, 8, 1), _c(32, 64, 4, 1),
                    _c(32, 64, 4, 2), _c(32, 32, 4, 2), _c(16, 32, 4, 1)],
    # lazy attention (its dQ kernel sums dBias along the diagonals of square tiles)
    "lazy_fwd": [_c(128, 64, 8, 3), _c(64, 64, 4, 3), _c(64, 32, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
    "lazy_pre": [_c(64, 64, 4, 3), _c(64, 32, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
    "lazy_dq": [_c(64, 64, 4, 3), _c(32, 32, 4, 2), _c(16, 16, 2, 1)],
    "lazy_dkdv": [_c(64, 64, 4, 3), _c(32, 64, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
}

#: The fast kernels' first choice by head-dim class (padded D of 64, 128, 256; 160 and 192 for
#: the backward's split head dim): the best geometric mean over the benchmark grid (S = 1k, 4k, 16k;
#: causal or not; fp16; D=160 and 256 at S=4k) in an H100 sweep of every candidate (2026-11-23;
#: D=160 was then padded to 256). The others follow in the order above. At D=256 the backward
#: keeps dK, dV (or dQ) of 256 columns in registers: one pipeline stage, or few rows, or it spills.
PREFERRED: dict[tuple[str, int], KernelConfig] = {
    ("fast_fwd", 64): _c(128, 64, 8, 3), ("fast_fwd", 128): _c(128, 128, 8, 3),
    ("fast_dq", 64): _c(64, 64, 4, 3), ("fast_dq", 128): _c(128, 64, 8, 3), ("fast_dq", 256): _c(128, 64, 8, 1),
    ("fast_dkdv", 64): _c(32, 128, 4, 3), ("fast_dkdv", 128): _c(64, 64, 4, 2), ("fast_dkdv", 256): _c(32, 32, 4, 2),
    # the split head dim (128 + a tail of 32 or 64 columns: classes 160 and 192), from an H100
    # sweep of the split kernels (2026-11-24, bf16, B=2 H=16 S=4096, causal or not): dQ 128 x 64 / 8
    # warps / 2 stages at both; dK/dV 32 x 64 / 4 / 3 at D=160 (1.03 ms causal against 1.35 for
    # 64 x 128 / 8 / 2), 64 x 128 / 8 / 2 at D=192 (1.55 against 1.94 for 32 x 64)
    ("fast_dq", 160): _c(128, 64, 8, 2), ("fast_dkdv", 160): _c(32, 64, 4, 3),
    ("fast_dq", 192): _c(128, 64, 8, 2), ("fast_dkdv", 192): _c(64, 128, 8, 2),
    # dK and dV by a launch each at D = 256, from an H100 sweep (2026-11-24, bf16, B=4 H=8 S=4096,
    # ms with delta, causal or not): dK 64 x 128 / 8 / 1 stage (1.98, 1.31; 32 x 32: 4.34, 2.44),
    # dV 32 x 64 / 4 / 2 (1.43, 0.80)
    ("fast_dk", 256): _c(64, 128, 8, 1), ("fast_dv", 256): _c(32, 64, 4, 2),
    # the fused backward on fp32's bf16 pieces, from an H100 sweep (2026-11-25, ms, causal / not):
    # D=128 (B2 H16 S4096) 32 x 32 / 4 / 2: 7.37 / 14.04, 64 x 64 / 4 / 1: 11.68 / 13.70,
    # 32 x 64 / 4 / 1: 9.88 / 16.75; D=64 (B2 H8 S2048) 64 x 64 / 4 / 1: 0.51 / 0.59,
    # 128 x 128 / 8 / 1: 0.75 / 0.66; the taller tiles and a second stage do not fit at D=128
    ("fast_pieces", 64): _c(64, 64, 4, 1), ("fast_pieces", 128): _c(32, 32, 4, 2),
}

#: The fast kernels with fp32 inputs (``runtime.fast_dot_precision``: six bf16 products per
#: product by default, fp32 tiles of twice fp16's bytes): H100 sweeps per kernel (B=4, H=16,
#: S=4096; D=128 causal, ms). bf16x6, 2026-11-24: forward 128 x 64 / 8 / 2: 4.45 (128 x 32 / 8 /
#: 3: 4.97); dQ 64 x 32 / 4 / 3: 10.2 (32 x 32 / 4 / 3: 18.0); dK/dV 32 x 32 / 4 / 2: 15.8 (3
#: stages: 25.5; 32 x 64: 19.5); at D=64 (B=2, H=8, S=2048) the tf32x3 choices below stayed best.
#: Tried and kept out: dK and dV by a launch each, 10.9 + 4.4 ms against 15.8 for one launch (3%
#: of the backward); the fused kernel (tf32x3: 37 ms). Earlier, with tf32x3 (2026-11-23), the fp16
#: choices ran up to 1.6x slower. TF32 products alone (torch's switch on) take 12.5 ms for the
#: whole backward; SDPA's fp32 backward (efficient, 3xTF32) 19.4.
PREFERRED_FP32: dict[tuple[str, int], KernelConfig] = {
    ("fast_fwd", 128): _c(128, 64, 8, 2), ("fast_dq", 64): _c(128, 64, 8, 3), ("fast_dq", 128): _c(64, 32, 4, 3),
    ("fast_dkdv", 64): _c(64, 128, 8, 3), ("fast_dkdv", 128): _c(32, 32, 4, 2),
}

#: The fast kernels with lesson 09's features, at D=128 (an H100 sweep of the candidates on the
#: benchmark's workloads, 2026-11-23): packed batches of short sequences prefer small tiles.
#: Where no entry is given the dense choice above stands -- dropout's too since its draws are
#: 8 bits (2026-11-25, fp16 B4 H16 S4096 causal, ms: forward 128 x 128 / 8 / 3: 0.900, 128 x 64:
#: 0.914; dK/dV 64 x 64 / 4 / 2, which turns its tiles round under dropout: 1.61, 32 x 64: 1.78).
#: At D=64 the dense dK/dV tile (32 x 128, S^T) does not suit dropout: its draws cross threads
#: (2026-11-25, same workload at D=64, ms: 32 x 128 / 4 / 3: 1.58 against 0.82 without dropout;
#: 64 x 64 / 4 / 3, turned round: 0.89; 64 x 64 / 4 / 2: 0.90; 32 x 64 / 4 / 3: 1.54).
#: Re-swept under dropout (2026-11-25, torch 2.11, triton 3.6, same workload, fp16 / bf16, ms): the
#: choices above stayed best. D=128: forward 128 x 128 / 8 / 3 0.735 / 0.719 (128 x 64 / 8 / 3: 0.744
#: / 0.738, 64 x 64 / 4 / 3: 0.757 / 0.723); dQ 128 x 64 / 8 / 3 0.98 / 0.95 (128 x 64 / 8 / 2: 1.10);
#: dK/dV 64 x 64 / 4 / 2 1.38 / 1.35 against 1.69 / 1.69 for 128 x 64 / 8 / 2 turned round, a tile
#: with half the accumulator registers a thread and no spill (sm_90 compile), which needs the causal
#: loop's diagonal generalised to BLOCK_M > BLOCK_N and was not kept. D=64: dQ 64 x 64 / 4 / 3 0.59 /
#: 0.58 (64 x 32: 0.61 / 0.59). The one change it made: the D=64 forward under dropout takes 64 x 64
#: / 4 / 3, 0.498 / 0.497 ms fp16 and 0.480 / 0.487 bf16 (two rounds) against 0.514 / 0.513 and 0.511 /
#: 0.509 for the dense 128 x 64 / 8 / 3 (0.39 without dropout).
#: "short": the causal forward over at most ``fast.forward.SHORT_CAUSAL_KEYS`` keys (fp16/bf16, none of
#: lesson 09's features), where each program's loop is 1 to 8 key tiles long and its set-up and
#: store weigh as much as its work. 128 x 64 tiles in two stages (98 KB) with at most 128 registers a
#: thread put two programs on each SM, so one computes while the other loads or stores (H100,
#: 2026-11-25, fp16 B16 H16 S1024 D128, one process, two rounds, ms: 0.235 / 0.234 against 0.257 /
#: 0.259 for 128 x 128 / 8 / 3 with one program per SM; without the register cap 128 x 64 / 8 / 2 takes
#: 157 registers, one program per SM, 0.335). Not kept longer: at S = 4096 it was 5% slower (0.663 /
#: 0.669 against 0.632 / 0.624), at 16384 10% (2.41 against 2.18); not for the non-causal forward at
#: S = 1024 either (0.341 / 0.339 against 0.332 / 0.344, even).
PREFERRED_WITH: dict[tuple[str, int, str], KernelConfig] = {
    ("fast_fwd", 128, "varlen"): _c(64, 64, 4, 2), ("fast_dq", 128, "varlen"): _c(64, 32, 4, 3),
    ("fast_dkdv", 128, "varlen"): _c(32, 64, 4, 3), ("fast_dkdv", 128, "window"): _c(64, 128, 8, 2),
    ("fast_dkdv", 64, "dropout"): _c(64, 64, 4, 3), ("fast_fwd", 64, "dropout"): _c(64, 64, 4, 3),
    ("fast_fwd", 128, "short"): _c(128, 64, 8, 2, maxnreg=128),
}

#: The lesson kernels with fp32 inputs: fp32 tiles take twice the memory and tf32x3 products
#: three passes, so smaller tiles win (an H100 sweep: 32 x 64 and 64 x 32 were best at D=128,
#: 128 x 64 at D=64, where it fits).
FP32_CANDIDATES: dict[str, list[KernelConfig]] = {
    "fwd": [_c(128, 64, 8, 3), _c(32, 64, 4, 2), _c(64, 32, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
    "dq": [_c(128, 64, 8, 3), _c(32, 64, 4, 2), _c(64, 32, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
    "dkdv": [_c(64, 32, 4, 2), _c(32, 64, 4, 2), _c(32, 32, 4, 1), _c(16, 16, 2, 1)],
}

#: What each kernel keeps in shared memory looks like one of three layouts (see below).
LAYOUT = {"fwd": "fwd", "dq": "dq", "dkdv": "dkdv", "delta": "delta",
          "fast_fwd": "fwd", "fast_dq": "dq", "fast_dkdv": "dkdv", "fast_dk": "dkdv", "fast_dv": "dkdv",
          "lazy_fwd": "fwd", "lazy_pre": "dq", "lazy_dq": "dq", "lazy_dkdv": "dkdv", "fast_pieces": "pieces"}


def shared_memory_estimate(kernel: str, cfg: KernelConfig, block_d: int, elem_bytes: int) -> int:
    """Bytes of shared memory a launch of ``kernel`` (a key of ``LAYOUT``) needs, its tiles
    ``block_d`` columns wide (the padded head dim, or 128 + tail where the backward splits it).

    Calibrated on compiled kernels (``CompiledKernel.metadata.shared``, triton 3.6, H100): tiles
    streamed through the loop are buffered ``num_stages`` deep, tiles held for the whole program
    once; P and dS stay in registers as ``tl.dot`` operands; the dK/dV loop also buffers its
    LSE and delta rows (fp32). 1 KB covers the reductions' scratch. The estimate is tight on
    purpose: an over-estimate threw away the best H100 forward tile at D=128 (128 x 128, 3
    stages: 224 of 227 KB). Where another GPU generation needs more, the launch fails with
    OutOfResources, which :func:`launch` and the autotuner catch and step past: the estimate
    only spares compiling configs that cannot fit.
    """
    layout = LAYOUT.get(kernel, kernel)
    M, N, D, st = cfg.BLOCK_M, cfg.BLOCK_N, block_d, max(cfg.num_stages, 1)
    vectors = 0
    if layout == "fwd":  # holds Q; streams K, V
        elems = M * D + st * 2 * N * D
    elif layout == "dq":  # holds Q, dO; streams K, V
        elems = 2 * M * D + st * 2 * N * D
    elif layout == "dkdv":  # holds K, V; streams Q, dO and their LSE and delta rows
        elems = 2 * N * D + st * 2 * M * D
        vectors = (st - 1) * M * 2 * 4
    elif layout == "pieces":  # the dkdv layout with three bf16 planes of each tile
        elems = 3 * (2 * N * D + st * 2 * M * D)
    elif layout == "delta":
        elems = 0
    else:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {sorted(LAYOUT)}")
    return elems * elem_bytes + vectors + 1024


#: Environment variable capping the shared memory the config policy believes in (bytes).
SHARED_MEMORY_ENV = "FLASHATTN_MAX_SHARED_MEMORY"


def shared_memory_cap() -> Optional[int]:
    """The cap set by ``FLASHATTN_MAX_SHARED_MEMORY`` (bytes; ``64K`` and ``65536`` both work;
    read at import, ``flashattn.settings``), or None."""
    return settings.current.max_shared_memory


def device_shared_memory(device: Optional[torch.device] = None) -> int:
    """Largest shared memory one program may use on this GPU (opt-in limit), in bytes, or the
    ``FLASHATTN_MAX_SHARED_MEMORY`` cap if that is lower."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    limit = _shared_memory_of(index)
    cap = shared_memory_cap()
    return limit if cap is None else min(limit, cap)


@functools.lru_cache(maxsize=None)
def _shared_memory_of(index: int) -> int:
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # pragma: no cover - depends on the Triton build
        return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def head_dim_class(head_dim: int, tail: int = 0) -> tuple[int, int]:
    """(columns a tile really holds, class of ``PREFERRED``): the padded head dim and 64, 128 or
    256; for the backward's split head dim (``tail`` > 0, ``fast.tuning.head_dim_tail``) the
    128 + tail columns of its two tiles and the class 160 (tails of 16 or 32) or 192 (64)."""
    if tail:
        return 128 + tail, 128 + max(tail, 32)
    block_d = runtime.head_dim_block(head_dim)
    return block_d, min(max(block_d, 64), 256)


@functools.lru_cache(maxsize=None)
def fitting(kernel: str, head_dim: int, elem_bytes: int, limit: int,
            feature: Optional[str] = None, tail: int = 0) -> tuple[KernelConfig, ...]:
    """The candidates for ``kernel`` whose shared-memory estimate is within ``limit`` bytes,
    best first (the smallest candidate if none fits: let the compiler have the last word).
    ``feature``: "dropout", "varlen" or "window" for lesson 09's variants, "short" for the short
    causal forward (``PREFERRED_WITH``).
    ``tail``: the backward's split head dim (``BLOCK_D_TAIL``; 0: padded to a power of two)."""
    block_d, d_class = head_dim_class(head_dim, tail)
    base = FP32_CANDIDATES.get(kernel, CANDIDATES[kernel]) if elem_bytes == 4 else CANDIDATES[kernel]
    first = (PREFERRED_FP32.get((kernel, d_class)) if elem_bytes == 4 else None) or PREFERRED.get((kernel, d_class))
    cands = [first] + [c for c in base if c != first] if first is not None else list(base)
    if (kernel, d_class, feature) in PREFERRED_WITH:
        first = PREFERRED_WITH[(kernel, d_class, feature)]
        cands = [first] + [c for c in cands if c != first]
    fits = [c for c in cands if shared_memory_estimate(kernel, c, block_d, elem_bytes) <= limit]
    return tuple(fits or base[-1:])


def candidates(kernel: str, head_dim: int, dtype: torch.dtype, device: torch.device,
               config: Optional[KernelConfig] = None, feature: Optional[str] = None,
               tail: int = 0) -> tuple[KernelConfig, ...]:
    """Configs to try, best first: the user's if given, the interpreter's small one on the CPU,
    else those that fit this device's shared memory."""
    if config is not None:
        return (config,)
    if runtime.INTERPRET:
        return (INTERPRETER_FAST_CONFIGS.get(kernel, INTERPRETER_CONFIG),)
    return fitting(kernel, head_dim, dtype.itemsize, device_shared_memory(device), feature, tail)


_chosen: dict = {}


def launch(key: tuple, configs: Iterable[KernelConfig], run: Callable[[KernelConfig], None]) -> KernelConfig:
    """Run ``run(cfg)`` with the first config that compiles within the device's resources.

    The estimate above picks the candidates; if Triton still reports OutOfResources (the
    estimate was optimistic for this compiler), or ptxas cannot fit a config's code in the
    registers it allows (``KernelConfig.maxnreg``), the next config is tried and the choice is
    remembered for ``key``.
    """
    from triton.runtime.errors import OutOfResources

    configs = tuple(configs)
    if key in _chosen and _chosen[key] in configs:
        configs = configs[configs.index(_chosen[key]):]
    last_error = None
    for cfg in configs:
        try:
            run(cfg)
        except OutOfResources as err:
            last_error = err
            continue
        except Exception as err:   # Triton's PTXASError: "Insufficient registers (128) to compile ..."
            if cfg.maxnreg is None or "Insufficient registers" not in str(err):
                raise
            last_error = err
            continue
        _chosen[key] = cfg
        return cfg
    raise RuntimeError(f"no kernel config fits this device's resources (last error: {last_error})")
