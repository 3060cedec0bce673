"""How the fast kernels are launched: tiles, tuning on request, and the constants they share.
A leaf: it imports no kernel.

By default every fast kernel runs with its per-device default tile: the first of its
candidates (``flashattn.configs``: ``fast_fwd``, ``fast_dq``, ``fast_dkdv``, best first, from an
exhaustive H100 sweep) that fits the GPU's shared memory, stepping down if the compiler still
runs out of resources. One compile per kernel, no timing: a first call costs seconds, not the
tens of seconds an autotuner spends compiling and timing every candidate.

Tuning on request (``FLASHATTN_AUTOTUNE=1`` in the environment, or ``set_autotune(True)``):
``triton.autotune`` over the same candidates, keyed on (S_q, S_k) buckets, the causal flag and
the head dim (the dtype is part of every kernel's signature). Sequence lengths are bucketed to
powers of two, so a model trained on varying lengths tunes once per bucket; results are cached
on disk by Triton (``cache_results=True``), so a second process does not re-tune.
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from .. import configs, runtime, settings
from ..configs import KernelConfig
from . import plans
from .launch import DirectLaunch

#: exp(x) = exp2(x * LOG2E): the fast kernels work in base 2 (exp2 is the GPU's native unit)
LOG2E = tl.constexpr(1.4426950408889634)
#: log(x) = log2(x) * LN2: back to the natural-log LSE the rest of the package uses
LN2 = tl.constexpr(0.6931471805599453)

#: kernel name used by the launchers -> key of ``configs.CANDIDATES``
KERNELS = {"fwd": "fast_fwd", "dq": "fast_dq", "dkdv": "fast_dkdv", "fused": "fast_dkdv",
           "dk": "fast_dk", "dv": "fast_dv",      # dK and dV by two launches (``dkdv_parts``)
           "pieces": "fast_pieces"}               # fused, fp32 as bf16 pieces (``fp32_pieces``)


class ArgSpec:
    """What compiling a kernel needs of a tensor argument -- dtype, shape, strides, device and
    the address's alignment -- without the tensor (like Triton's ``MockTensor``, with real
    strides). Warm-ups run on these so they allocate nothing and hold no tensor: a warm-up in a
    background thread must not take memory from a CUDA graph's pool being recorded."""

    def __init__(self, shape, dtype, device, stride=None, data_ptr: int = 0):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        if stride is None:   # contiguous
            stride, step = [], 1
            for size in reversed(self.shape):
                stride.insert(0, step)
                step *= size
        self._stride, self._data_ptr = tuple(stride), data_ptr % 16   # alignment is all that counts

    @classmethod
    def like(cls, t) -> "ArgSpec":
        return t if isinstance(t, cls) else cls(t.shape, t.dtype, t.device, t.stride(), t.data_ptr())

    def stride(self, dim: int | None = None):
        return self._stride if dim is None else self._stride[dim]

    def data_ptr(self) -> int:
        return self._data_ptr

    def element_size(self) -> int:
        return self.dtype.itemsize


def tma_ready(*tensors) -> bool:
    """Whether tiles of these tensors may come through the copy engine (TMA, tensor descriptors
    made on the device; the forward's K and V, the dK/dV kernel's Q and dO): a Hopper or newer
    GPU, a Triton with tensor descriptors, fp16/bf16 data (what was measured), unit last stride,
    every other stride and the address 16-byte aligned (TMA's rules). ``FLASHATTN_TMA=0`` turns it
    off (notebook 06's ablation). Anything else takes the pointer loads, with the same results."""
    import torch

    if runtime.INTERPRET or not hasattr(tl, "make_tensor_descriptor") or not settings.current.tma:
        return False
    device = tensors[0].device
    if device.type != "cuda" or _major(device.index if device.index is not None else torch.cuda.current_device()) < 9:
        return False
    for t in tensors:
        size = t.element_size()
        if t.dtype not in (torch.float16, torch.bfloat16) or t.stride(-1) != 1 or t.data_ptr() % 16 or \
                any(s * size % 16 for s in t.stride()[:-1]):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    """The GPU's major compute capability, asked once per device (a query costs ~3 us per launch)."""
    import torch

    return torch.cuda.get_device_capability(index)[0]


def tma_stats_ready(lse) -> bool:
    """Whether the LSE (and delta, allocated like it) may be loaded through 1-D descriptors too:
    unit last stride, the other strides and the address 16-byte aligned. ``FLASHATTN_TMA_STATS=0``
    turns it off (the ablation)."""
    if not settings.current.tma_stats or lse.stride(-1) != 1:
        return False
    size = lse.dtype.itemsize
    return lse.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in lse.stride()[:-1])


def _scratch(size: int, alignment: int, stream):
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Descriptors made on the device need a small global scratch buffer per launch, which
    Triton asks of the allocator set with ``triton.set_allocator``: a torch allocation (CUDA
    graphs and the caching allocator see it), unless the program set its own. The setting
    lives in a context variable, so it is made in the thread that launches (autograd runs the
    backward in a thread of its own)."""
    try:
        from triton.runtime import _allocation
    except ImportError:        # a Triton without runtime allocation has no device descriptors either
        return
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def output(shape, dtype, device, warmup: bool):
    """A new output tensor, or for a warm-up its ``ArgSpec``."""
    return ArgSpec(shape, dtype, device) if warmup else runtime.new_output(shape, dtype, device)


def outputs_and_strides(layout, warmup: bool):
    """(new, strides) for a launcher: ``new(shape, dtype, device)`` makes an output (a spec for a
    warm-up), ``strides(t)`` gives a tensor's strides as the kernels take them. ``layout``: None
    for dense ``[B, H, S, D]`` tensors, or lesson 09's ``beyond.kernels.Layout`` (packed batches:
    outputs stored as ``[total, H, D]``, batch strides 0)."""
    if layout is None:
        return (lambda shape, dtype, device: output(shape, dtype, device, warmup)), (lambda t: tuple(t.stride()))
    if warmup:
        return (lambda shape, dtype, device: layout.spec(shape, dtype, device)), layout.strides
    return layout.new, layout.strides


def bucket(S_q: int, S_k: int) -> int:
    """One integer naming the (S_q, S_k) bucket: next powers of two, packed."""
    return runtime.next_power_of_2(S_q) * (1 << 24) + runtime.next_power_of_2(S_k)


def _prune(name: str):
    kernel = KERNELS[name]

    def prune(candidates, named_args, **kwargs):
        head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        tail = kwargs.get("BLOCK_D_TAIL", named_args.get("BLOCK_D_TAIL", 0))
        q = named_args.get("Q")
        elem = q.element_size() if hasattr(q, "element_size") else 2
        fits = set(configs.fitting(kernel, head_dim, elem, configs.device_shared_memory(), tail=tail))
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
    key = ["S_BUCKET", "CAUSAL", "HEAD_DIM", "DOT_PRECISION", "WINDOW", "VARLEN", "DROPOUT"]
    key += ["BLOCK_D_TAIL"] if "BLOCK_D_TAIL" in kernel.arg_names else []     # the backward's split head dim
    kwargs = dict(configs=candidates, key=key,
                  prune_configs_by={"early_config_prune": _prune(name)},
                  reset_to_zero=reset_to_zero, do_bench=_quick_bench)
    try:
        return triton.autotune(cache_results=True, **kwargs)(kernel)
    except TypeError:  # older Triton without on-disk autotune cache
        return triton.autotune(**kwargs)(kernel)


def set_autotune(enabled: bool | None) -> None:
    """Tune the fast kernels' tiles on first use (True), use the defaults (False), or follow
    ``FLASHATTN_AUTOTUNE`` as it was at import (None)."""
    settings.set_values(autotune=settings.read().autotune if enabled is None else bool(enabled))


def autotune_requested() -> bool:
    return settings.current.autotune


#: Environment variable: ``FLASHATTN_SPLIT_D=0`` turns the backward's split head dim off (the ablation).
SPLIT_D_ENV = "FLASHATTN_SPLIT_D"


def head_dim_tail(head_dim: int) -> int:
    """``BLOCK_D_TAIL`` of the two backward kernels: 128 < D <= 192 runs as a main tile of 128
    columns plus a tail of next_power_of_2(D - 128) (at least 16, ``tl.dot``'s least): 144 to
    192 columns of work where padding takes 256. 0 (no split) for every other head dim, and
    where ``FLASHATTN_SPLIT_D=0`` (``settings.split_d``)."""
    if not 128 < head_dim <= 192 or not settings.current.split_d:
        return 0
    return max(16, runtime.next_power_of_2(head_dim - 128))


#: Environment variable: ``FLASHATTN_SPLIT_DKDV=0`` keeps dK and dV in one launch at every head dim.
SPLIT_DKDV_ENV = "FLASHATTN_SPLIT_DKDV"

#: The dK/dV kernel's ``DKDV_PART`` for each launch name: both gradients, dK only, dV only.
DKDV_PART = {"dkdv": 0, "fused": 0, "dk": 1, "dv": 2, "pieces": 0}


def dkdv_parts(head_dim: int, fused: bool) -> tuple[str, ...]:
    """The launches of the dK/dV kernel: one, or where the tile is 256 columns wide (D > 192, or
    a padded 128 < D <= 192 with the split head dim turned off) two, ("dk", "dv").
    One launch holds two [BLOCK_N, 256] fp32 accumulators, which leaves registers for 32 x 32
    tiles only; one accumulator each runs tiles of 64 x 128 (dK) and 32 x 64 (dV), and pays for
    it with S = Q K^T recomputed once more (8 products per tile pair instead of 7). On an H100
    (bf16, B=4, H=8, S=4096) dK + dV went from 5.2 to 3.4 ms, 2.8 to 2.1 causal. At D <= 192 the
    split was slower (the split head dim keeps the accumulators small already)."""
    wide = runtime.head_dim_block(head_dim) == 256 and not head_dim_tail(head_dim)
    if fused or not wide or not settings.current.split_dkdv:
        return ("fused",) if fused else ("dkdv",)
    return ("dk", "dv")


#: Environment variable: ``FLASHATTN_FP32_PIECES=0``: fp32's default backward as before the pieces
#: (two kernels, each splitting its operands in registers with Triton's bf16x6).
FP32_PIECES_ENV = "FLASHATTN_FP32_PIECES"


def _fp32_fusable(q, plain: bool) -> bool:
    """fp32 inputs the fused backward may take by default: a tile of at most 128 columns and none
    of lesson 09's features (``plain``)."""
    import torch

    return plain and q.dtype == torch.float32 and runtime.head_dim_block(q.shape[-1]) <= 128


def fp32_pieces(q, plain: bool) -> bool:
    """Whether the fused backward may run fp32 inputs as bf16 pieces (``fast/pieces.py``): fp32
    whose products are six bf16 ones (``runtime.fast_dot_precision``'s default; the interpreter,
    which multiplies exactly, too), a tile of at most 128 columns, none of lesson 09's features
    (``plain``), and ``FLASHATTN_FP32_PIECES`` not 0."""
    return (_fp32_fusable(q, plain) and (runtime.INTERPRET or runtime.fast_dot_precision(q.dtype) == "bf16x6")
            and settings.current.fp32_pieces)


def fused_by_default(q, plain: bool) -> bool:
    """The backward's default form: two kernels, except fp32 inputs with head dims up to 128 and
    none of lesson 09's features (``plain``), where the fused kernel measured faster on an H100
    -- on bf16 pieces (:func:`fp32_pieces`), or with TF32 or the bf16x3 opt-in as Triton
    multiplies -- unless ``torch.use_deterministic_algorithms`` is on (the fused kernel adds dQ
    with atomics, in an order that changes from run to run). At fp32's cost of several 16-bit
    products per product, recomputing S and dP in a dQ kernel of its own costs more than the
    atomics. H100, ms, B2 H16 S4096 D128, causal / not: pieces 7.37 / 14.04, two kernels 13.61 /
    25.03, SDPA's fp32 kernel 10.09 / 18.91; causal, two kernels against fused: TF32 6.70 / 4.79,
    bf16x3 7.67 / 5.50 (B2 H8 S2048 D64: TF32 0.416 / 0.351, bf16x3 0.516 / 0.538). tf32x3 and
    ieee keep the two kernels (the fused one measured slower with tf32x3's small tiles)."""
    import torch

    if not _fp32_fusable(q, plain) or torch.are_deterministic_algorithms_enabled():
        return False
    return fp32_pieces(q, plain) or (not runtime.INTERPRET and runtime.fast_dot_precision(q.dtype) in ("tf32", "bf16x3"))


def constants(q, causal: bool, backward: bool = False) -> dict:
    """The compile-time arguments every fast kernel takes, for inputs like ``q`` (``backward``:
    for the two backward kernels, dQ and dK/dV)."""
    D = q.shape[-1]
    block_d = runtime.head_dim_block(D)
    precision = runtime.fast_dot_precision(q.dtype)
    if precision.startswith("bf16") and (block_d <= 32 or backward):
        # Triton 3.6 on Hopper miscompiles the bf16 splits (bf16x6, bf16x3) of fp32 products in the
        # backward kernels: the randomized battery (flashattn.fuzz) found illegal shared-memory
        # accesses under compute-sanitizer in fast_dq_kernel and fast_dkdv_kernel (H200; e.g. fp32
        # S_q = S_k = 1, D = 24 or 128; S = 3520, D = 72 with a window), at every pipeline depth
        # (one stage: NaN / garbage instead), and clean runs with tf32x3 and ieee. (An earlier
        # sign: at 16 columns with a stride-0 dO the split of dP^T = V dO^T came out NaN / 1e36 in
        # dK, on an H100.) The forward too, at 32 columns: fp32 with K read every other element
        # (stride 2), D = 24 or 32, gave NaN in O, then an illegal memory access, on an H200
        # (battery seed 6, problem 2038; D = 64, fp16 and a contiguous K passed). So the backward's
        # kernels -- dQ, dK/dV (and its dK, dV split), the fused one where it is not on pieces --
        # and any kernel at 32 columns or fewer multiply fp32 with three TF32 products: the same
        # fp32 accuracy class, about 20% slower. The fused backward on bf16 pieces (pieces.py)
        # multiplies bf16 tiles and is not affected.
        precision = "tf32x3"
    return dict(CAUSAL=causal, HEAD_DIM=D, BLOCK_D=block_d, PAD_D=block_d != D, DOT_PRECISION=precision)


def _check_divisibility(name: str, cfg: KernelConfig) -> None:
    if name in ("dkdv", "fused", "dk", "dv", "pieces") and cfg.BLOCK_N % cfg.BLOCK_M:
        raise ValueError(f"{name}: BLOCK_M must divide BLOCK_N, got {cfg}")
    if name == "dq" and cfg.BLOCK_M % cfg.BLOCK_N:
        raise ValueError(f"{name}: BLOCK_N must divide BLOCK_M, got {cfg}")


def warm(raw, *args, **kwargs):
    """Compile ``raw`` for these arguments without launching it -- and load it: Triton loads a
    kernel's binary and builds its launcher (a C compile, about half a second) only at the first
    launch, so a warm-up that stops at compiling leaves that for the first real call. (Under
    ``triton.AsyncCompileMode`` the warm-up returns a future, loaded at its first launch.)"""
    compiled = raw.warmup(*args, **kwargs)
    load = getattr(compiled, "_init_handles", None)
    if callable(load):
        load()
    return compiled


#: (kernel name, tile class, dtype, device, shared memory, meta's values) -> (tile, DirectLaunch): what a
#: default launch chose, so that the next call of the same kind goes straight to the kernel
_plans: dict = {}


def run(name: str, raw, tuned, grid, args, meta: dict, *, config: KernelConfig | None = None,
        warmup: bool = False, tile_class: str | None = None) -> None:
    """Launch (or with ``warmup`` only compile) fast kernel ``name`` -- ``raw`` the jitted kernel,
    ``tuned`` its autotuner -- with ``config``, else the interpreter's tile, else the autotuner if
    tuning was asked for, else the per-device default (stepping down on OutOfResources).
    ``grid(meta) -> tuple`` gets the tile as ``{"BLOCK_M": .., "BLOCK_N": ..}``. ``tile_class``:
    a first choice for a shape that ``meta`` does not name (``configs.PREFERRED_WITH``: the
    forward's "short"); lesson 09's features, which ``meta`` names, take precedence.
    A default launch is remembered (``_plans``): the next call with the same kernel variant skips
    the choice and launches directly (``launch.DirectLaunch``)."""
    q = args[0]
    if not warmup:
        plans.count_launch()
    if config is not None or runtime.INTERPRET:
        mode = "fixed"
    elif tuned is not None and autotune_requested():
        mode = "tuned"
    else:
        mode = "default"
    if mode == "default" and not warmup:
        # (the shared-memory limit too: FLASHATTN_MAX_SHARED_MEMORY changes which tiles fit)
        plan_key = (name, tile_class, q.dtype, q.device, configs.device_shared_memory(q.device), *meta.values())
        plan = _plans.get(plan_key)
        if plan is not None:
            cfg, direct = plan
            direct(grid({"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N}), args)
            return

    def kwargs_of(cfg: KernelConfig) -> dict:
        return dict(meta, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, **cfg.launch_options())

    def launch(cfg: KernelConfig) -> None:
        if warmup:
            warm(raw, *args, grid=(1,), **kwargs_of(cfg))
        else:
            raw[grid({"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N})](*args, **kwargs_of(cfg))

    if mode == "fixed":
        cfg = config or configs.INTERPRETER_FAST_CONFIGS[KERNELS[name]]
        _check_divisibility(name, cfg)
        launch(cfg)
    elif mode == "tuned":
        if warmup:   # an autotuner's warmup compiles each candidate that survives pruning
            tuned.warmup(*args, grid=(1,), **meta)
        else:
            tuned[grid](*args, **meta)
    else:
        feature = next((f.lower() for f in ("DROPOUT", "VARLEN", "WINDOW") if meta.get(f)), tile_class)
        tail = meta.get("BLOCK_D_TAIL", 0)
        candidates = configs.candidates(KERNELS[name], meta["HEAD_DIM"], q.dtype, q.device, feature=feature, tail=tail)
        key = (name, meta["HEAD_DIM"], q.dtype, q.device, meta.get("FUSED_DQ", False),
               meta.get("WINDOW"), meta.get("VARLEN"), meta.get("DROPOUT"), feature, tail, meta.get("DOT_PRECISION"))
        cfg = configs.launch(key, candidates, launch)
        if not warmup:
            _plans[plan_key] = (cfg, DirectLaunch(raw, kwargs_of(cfg)))
