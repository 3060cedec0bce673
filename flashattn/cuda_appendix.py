"""Lesson 10 (appendix): the forward with LSE, delta, dQ and dK/dV kernels in plain CUDA C++.

The kernels are in ``flashattn/cuda/attention.cu`` (with ``attention.h``): plain CUDA without
torch, so ``nvcc`` compiles them on their own. This module

* assembles that source (the header inlined, optionally with planted edits, like
  :mod:`flashattn.planted` does for the Triton kernels: one source, exact text edits);
* builds it with ``torch.utils.cpp_extension.load_inline``, adding a small torch binding
  (tensors -> pointers and strides, output allocation), one cached build per source text;
* exposes launchers with the call shapes of the course's checkers::

      launch_dq(q, k, v, do, lse, delta, dq, causal, scale) -> None
      launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale) -> None
      forward(q, k, v, causal=False, scale=None) -> (o, lse)

  fp32 tensors on a CUDA device, any strides, S_q != S_k, 1 <= D <= 128, GQA.

Importing this module needs neither a GPU nor ``nvcc``; building without them raises a
``RuntimeError`` that says what is missing. On a GPU machine, one command checks everything:
``python -m flashattn.cuda_appendix --selftest`` (see :mod:`flashattn.cuda_selftest`).
"""
from __future__ import annotations

import difflib
import hashlib
import html
import inspect
import math
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import runtime
from .planted import Edit, apply_edits

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
KERNEL_FILE = CUDA_DIR / "attention.cu"
HEADER_FILE = CUDA_DIR / "attention.h"
MAX_HEAD_DIM = 128

# --------------------------------------------------------------------------------------------
# The planted bug of the CUDA log (lab 08, bug 3): the dK loop steps through its rows by 1 instead of by the
# number of thread rows, so thread row y adds into rows y, y+1, ..., and row n of every key
# tile is added min(n + 1, blockDim.y) times -- several threads on the same addresses.
# --------------------------------------------------------------------------------------------
DK_LOOP = "for (int n = threadIdx.y; n < BN; n += blockDim.y)   // the rows of dK this thread owns"
RACE_EDIT = Edit(DK_LOOP, DK_LOOP.replace("n += blockDim.y)", "n++)"))


@dataclass(frozen=True)
class Tiling:
    """Tiles of ``block_m`` query rows x ``block_n`` keys; thread blocks of 32 x ``threads_y``."""

    block_m: int = 32
    block_n: int = 32
    threads_y: int = 4


def kernel_text(edits: Sequence[Edit] = ()) -> str:
    """attention.cu as it is on disk, with ``edits`` applied (fails loudly if a text is gone)."""
    return apply_edits(KERNEL_FILE.read_text(), list(edits), "attention.cu")


def cuda_source(edits: Sequence[Edit] = ()) -> str:
    """The whole CUDA translation unit: attention.cu (with ``edits``), attention.h inlined."""
    header = HEADER_FILE.read_text().replace("#pragma once\n", "")
    text = kernel_text(edits)
    include = '#include "attention.h"\n'
    if text.count(include) != 1:
        raise ValueError('attention.cu must include "attention.h" exactly once')
    return text.replace(include, header)


def diff(edits: Sequence[Edit]) -> str:
    """A unified diff of attention.cu, real -> planted, with the file's line numbers."""
    before, after = kernel_text().splitlines(), kernel_text(edits).splitlines()
    return "\n".join(difflib.unified_diff(before, after, "attention.cu (real)",
                                          "attention.cu (planted bug)", n=1, lineterm=""))


def smem_bytes(kernel: str, tiling: Tiling, head_dim: int) -> int:
    """Dynamic shared memory of one launch, as attention.h carves it (floats, odd row pitch)."""
    M, N, D = tiling.block_m, tiling.block_n, head_dim
    pd, pn, pm = D | 1, N | 1, M | 1
    floats = {"forward": 2 * M * pd + 2 * N * pd + M * pn + 3 * M,
              "delta": 0,
              "dq": 3 * M * pd + 2 * N * pd + M * pn + 2 * M,
              "dkdv": 4 * N * pd + 2 * M * pd + 2 * N * pm + 2 * M}[kernel]
    return 4 * floats


# --------------------------------------------------------------------------------------------
# building
# --------------------------------------------------------------------------------------------
def why_unavailable() -> Optional[str]:
    """None if the CUDA kernels can be built and run here, else the reason in one sentence."""
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False): "
                "the CUDA kernels need an NVIDIA GPU and a CUDA build of torch")
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc (the CUDA toolkit) was not found: set CUDA_HOME or put nvcc on PATH"
    if runtime.ninja_dir() is None:
        return "ninja is missing (torch's extension builder needs it): pip install ninja"
    return None


BINDING = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <vector>
@HEADER@
namespace fa = flashattn_cuda;

// Tensors -> what the kernels take: a pointer and every tensor's own strides, in elements.
static fa::View<const float> in(const torch::Tensor& t) {
    return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2), t.dim() == 4 ? t.stride(3) : 0};
}
static fa::View<float> out(const torch::Tensor& t) {
    return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2), t.dim() == 4 ? t.stride(3) : 0};
}
static fa::Problem problem(const torch::Tensor& q, const torch::Tensor& k, bool causal, double scale) {
    return {int(q.size(0)), int(q.size(1)), int(k.size(1)), int(q.size(2)), int(k.size(2)),
            int(q.size(3)), float(scale), causal};
}
static fa::Tiling tiling(std::vector<int64_t> t) { return {int(t.at(0)), int(t.at(1)), int(t.at(2))}; }
static void check(cudaError_t err, const char* kernel) {
    TORCH_CHECK(err == cudaSuccess, kernel, ": launch failed: ", cudaGetErrorString(err));
}

std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                   double scale, std::vector<int64_t> t) {
    const c10::cuda::CUDAGuard guard(q.device());
    auto o = torch::empty(q.sizes(), q.options());
    auto lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
    check(fa::launch_forward(in(q), in(k), in(v), out(o), out(lse), problem(q, k, causal, scale),
                             tiling(t), c10::cuda::getCurrentCUDAStream()), "attn_fwd_kernel");
    return {o, lse};
}

torch::Tensor delta(torch::Tensor o, torch::Tensor dO, std::vector<int64_t> t) {
    const c10::cuda::CUDAGuard guard(o.device());
    auto d = torch::empty({o.size(0), o.size(1), o.size(2)}, o.options());
    check(fa::launch_delta(in(o), in(dO), out(d), problem(o, o, false, 1.0), tiling(t),
                           c10::cuda::getCurrentCUDAStream()), "attn_bwd_delta_kernel");
    return d;
}

void dq(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor dO, torch::Tensor lse,
        torch::Tensor delta, torch::Tensor dq, bool causal, double scale, std::vector<int64_t> t) {
    const c10::cuda::CUDAGuard guard(q.device());
    check(fa::launch_dq(in(q), in(k), in(v), in(dO), in(lse), in(delta), out(dq),
                        problem(q, k, causal, scale), tiling(t), c10::cuda::getCurrentCUDAStream()),
          "attn_bwd_dq_kernel");
}

void dkdv(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor dO, torch::Tensor lse,
          torch::Tensor delta, torch::Tensor dk, torch::Tensor dv, bool causal, double scale,
          std::vector<int64_t> t) {
    const c10::cuda::CUDAGuard guard(q.device());
    check(fa::launch_dkdv(in(q), in(k), in(v), in(dO), in(lse), in(delta), out(dk), out(dv),
                          problem(q, k, causal, scale), tiling(t), c10::cuda::getCurrentCUDAStream()),
          "attn_bwd_dkdv_kernel");
}

int64_t smem_bytes(int64_t kernel, std::vector<int64_t> t, int64_t head_dim) {
    return fa::smem_bytes(static_cast<fa::Kernel>(kernel), tiling(t), int(head_dim));
}
"""
FUNCTIONS = ["forward", "delta", "dq", "dkdv", "smem_bytes"]

_builds: dict = {}
_build_lock = threading.Lock()


def binding_source() -> str:
    return BINDING.replace("@HEADER@", HEADER_FILE.read_text().replace("#pragma once\n", ""))


def build(edits: Sequence[Edit] = (), *, verbose: bool = False) -> "Kernels":
    """Compile attention.cu (with ``edits``) and its binding; one cached build per source text
    (in torch's extension cache, ~/.cache/torch_extensions: the first build takes ~30-60 s)."""
    edits = tuple(edits)
    source = cuda_source(edits)            # fails loudly, GPU or not, if an edit no longer applies
    binding = binding_source()
    key = hashlib.sha1((source + binding).encode()).hexdigest()[:12]
    with _build_lock:
        if key in _builds:
            return _builds[key]
    reason = why_unavailable()
    if reason:
        raise RuntimeError(f"cannot build the CUDA kernels here: {reason}.")
    from torch.utils.cpp_extension import load_inline
    runtime.ninja_on_path()     # torch runs `ninja` from PATH
    kwargs = {}
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:
        kwargs["no_implicit_headers"] = True   # keeps torch's headers out of the .cu (fast nvcc)
    module = load_inline(
        name=f"flashattn_cuda_{key}", cpp_sources=[binding], cuda_sources=[source],
        functions=FUNCTIONS, extra_cflags=["-O2"], extra_cuda_cflags=["-O3", "-lineinfo"],
        verbose=verbose, **kwargs)
    kernels = Kernels(module, edits)
    with _build_lock:
        return _builds.setdefault(key, kernels)


def build_many(edit_lists: Sequence[Sequence[Edit]], *, verbose: bool = False) -> list:
    """Build several variants at once (each build is mostly one single-threaded compile); if the
    parallel builds fail, build them again one after the other (that error is the one raised)."""
    from concurrent.futures import ThreadPoolExecutor
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(edit_lists))) as pool:
            return list(pool.map(lambda e: build(e, verbose=verbose), edit_lists))
    except Exception:           # noqa: BLE001 -- retried below, where a real error surfaces again
        return [build(e, verbose=verbose) for e in edit_lists]


# --------------------------------------------------------------------------------------------
# input validation: clear errors before anything reaches the GPU
# --------------------------------------------------------------------------------------------
def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a tensor of shape {list(t.shape)}, {t.dtype}, on {t.device}"
    return f"a {type(t).__name__}"


def _tensor(where: str, name: str, t, shape) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {_describe(t)}")
    if t.dtype != torch.float32:
        raise TypeError(f"{where}: {name} must be float32 (the CUDA kernels are fp32), got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where}: {name} must have shape {list(shape)}, got {list(t.shape)}")


def _validate(where: str, q, k, v, tensors: dict, causal, scale, tiling: Optional[Tiling]):
    """Check everything; return (scale, tiling)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise (TypeError if not isinstance(t, torch.Tensor) else ValueError)(
                f"{where}: {name} must be a 4-D tensor "
                f"{'[B, H, S_q, D]' if name == 'q' else '[B, H_kv, S_k, D]'}, got {_describe(t)}")
    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    _tensor(where, "q", q, (B, H, S_q, D))
    _tensor(where, "k", k, (B, H_kv, S_k, D))
    _tensor(where, "v", v, (B, H_kv, S_k, D))
    if min(B, H, S_q, D, H_kv, S_k) < 1:
        raise ValueError(f"{where}: every size must be >= 1, got q {list(q.shape)}, k {list(k.shape)}")
    if H % H_kv:
        raise ValueError(f"{where}: H = {H} query heads is not a multiple of H_kv = {H_kv} K/V heads")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"{where}: head dim D = {D} > {MAX_HEAD_DIM}, the most these kernels take")
    if B * H > 65535:
        raise ValueError(f"{where}: B * H = {B * H} > 65535 (gridDim.y): split the batch")
    for name, (t, shape) in tensors.items():
        _tensor(where, name, t, shape)
    if not isinstance(causal, bool):
        raise TypeError(f"{where}: causal must be a bool, got {_describe(causal)}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"{where}: scale must be a finite float or None, got {scale!r}")
    tiling = tiling or default_tiling(D, q.device)
    if not (1 <= tiling.block_m <= 128 and 1 <= tiling.block_n <= 128 and 1 <= tiling.threads_y <= 32):
        raise ValueError(f"{where}: {tiling} out of range (tiles 1..128, threads_y 1..32)")
    _check_device(where, {"q": q, "k": k, "v": v, **{n: t for n, (t, _) in tensors.items()}}, tiling, D)
    return float(scale), tiling


def _check_device(where: str, tensors: dict, tiling: Tiling, D: int) -> None:
    devices = {n: t.device for n, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"{where}: all tensors must be on one device, got " +
                         ", ".join(f"{n} on {d}" for n, d in devices.items()))
    device = next(iter(devices.values()))
    if device.type != "cuda":
        raise ValueError(f"{where}: the CUDA kernels need CUDA tensors, got tensors on {device}")
    limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    for kernel in ("forward", "dq", "dkdv"):
        if smem_bytes(kernel, tiling, D) > limit:
            raise ValueError(f"{where}: {tiling} needs {smem_bytes(kernel, tiling, D)} bytes of shared "
                             f"memory in the {kernel} kernel at D = {D}; this GPU allows {limit}")


def default_tiling(head_dim: int, device=None) -> Tiling:
    """32 x 32 tiles where they fit the GPU's shared memory (A100, H100: always), else 16 x 16."""
    big = Tiling(32, 32, 4)
    if device is None or getattr(device, "type", "cuda") != "cuda" or not torch.cuda.is_available():
        return big
    limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    fits = all(smem_bytes(k, big, head_dim) <= limit for k in ("forward", "dq", "dkdv"))
    return big if fits else Tiling(16, 16, 4)


def _tile_list(t: Tiling) -> list:
    return [t.block_m, t.block_n, t.threads_y]


def _shape(t, n=4):
    return tuple(t.shape[:n]) if isinstance(t, torch.Tensor) and t.dim() == 4 else ()


def _check_dq(q, k, v, do, lse, delta, dq, causal, scale, tiling):
    return _validate("launch_dq", q, k, v, {
        "do": (do, _shape(q)), "lse": (lse, _shape(q, 3)), "delta": (delta, _shape(q, 3)),
        "dq": (dq, _shape(q))}, causal, scale, tiling)


def _check_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, tiling):
    return _validate("launch_dkdv", q, k, v, {
        "do": (do, _shape(q)), "lse": (lse, _shape(q, 3)), "delta": (delta, _shape(q, 3)),
        "dk": (dk, _shape(k)), "dv": (dv, _shape(k))}, causal, scale, tiling)


class Kernels:
    """The kernels of one build of attention.cu: the real one, or one with planted ``edits``."""

    def __init__(self, module, edits: Sequence[Edit] = ()):
        self.module, self.edits = module, tuple(edits)

    def __repr__(self) -> str:
        return f"<CUDA kernels {self.module.__name__}{' (planted edits)' if self.edits else ''}>"

    def forward(self, q, k, v, causal: bool = False, scale: Optional[float] = None, *,
                tiling: Optional[Tiling] = None):
        """O [B, H, S_q, D] (contiguous) and LSE [B, H, S_q], both fp32."""
        scale, tiling = _validate("forward", q, k, v, {}, causal, scale, tiling)
        o, lse = self.module.forward(q, k, v, causal, scale, _tile_list(tiling))
        return o, lse

    def delta(self, o, do, *, tiling: Optional[Tiling] = None):
        """delta = rowsum(dO * O), [B, H, S_q] fp32."""
        _, tiling = _validate("delta", o, o, o, {"do": (do, _shape(o))}, False, 1.0, tiling)
        return self.module.delta(o, do, _tile_list(tiling))

    def launch_dq(self, q, k, v, do, lse, delta, dq, causal, scale, *,
                  tiling: Optional[Tiling] = None) -> None:
        """Write dQ into ``dq`` (the course's dq_kernel checker calls exactly this)."""
        scale, tiling = _check_dq(q, k, v, do, lse, delta, dq, causal, scale, tiling)
        self.module.dq(q, k, v, do, lse, delta, dq, causal, scale, _tile_list(tiling))

    def launch_dkdv(self, q, k, v, do, lse, delta, dk, dv, causal, scale, *,
                    tiling: Optional[Tiling] = None) -> None:
        """Write dK and dV into ``dk``, ``dv`` (the dkdv_kernel checker calls exactly this)."""
        scale, tiling = _check_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, tiling)
        self.module.dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, _tile_list(tiling))

    def backward(self, q, k, v, o, do, lse, causal: bool = False, scale: Optional[float] = None, *,
                 tiling: Optional[Tiling] = None):
        """The whole backward: delta, then dQ, then dK/dV. Returns (dq, dk, dv)."""
        delta = self.delta(o, do, tiling=tiling)
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        self.launch_dq(q, k, v, do, lse, delta, dq, causal, scale, tiling=tiling)
        self.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, tiling=tiling)
        return dq, dk, dv


# The real kernels, built on first use, after the inputs passed validation: bad input is named
# even where nothing can be built.
def forward(q, k, v, causal: bool = False, scale: Optional[float] = None, *, tiling=None):
    """The CUDA forward: (O, LSE)."""
    _validate("forward", q, k, v, {}, causal, scale, tiling)
    return build().forward(q, k, v, causal, scale, tiling=tiling)


def launch_dq(q, k, v, do, lse, delta, dq, causal, scale, *, tiling=None) -> None:
    """The CUDA dQ kernel, with the call shape ``check.dq_kernel`` expects."""
    _check_dq(q, k, v, do, lse, delta, dq, causal, scale, tiling)
    build().launch_dq(q, k, v, do, lse, delta, dq, causal, scale, tiling=tiling)


def launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, *, tiling=None) -> None:
    """The CUDA dK/dV kernel, with the call shape ``check.dkdv_kernel`` expects."""
    _check_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, tiling)
    build().launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, tiling=tiling)


def backward(q, k, v, o, do, lse, causal: bool = False, scale: Optional[float] = None, *, tiling=None):
    """The CUDA backward: (dQ, dK, dV)."""
    _validate("backward", q, k, v, {"o": (o, _shape(q)), "do": (do, _shape(q)),
                                    "lse": (lse, _shape(q, 3))}, causal, scale, tiling)
    return build().backward(q, k, v, o, do, lse, causal, scale, tiling=tiling)


# --------------------------------------------------------------------------------------------
# reading the source: numbered excerpts, and Triton next to CUDA
# --------------------------------------------------------------------------------------------
def _excerpt(lines: list, first: int, start: Optional[str], stop: Optional[str], what: str):
    lo, hi = 0, len(lines)
    if start is not None:
        found = [n for n, line in enumerate(lines) if start in line]
        if not found:
            raise ValueError(f"{start!r} does not occur in {what}")
        lo = found[0]
    if stop is not None:
        found = [n for n, line in enumerate(lines) if n >= lo and stop in line]
        if not found:
            raise ValueError(f"{stop!r} does not occur after {start!r} in {what}")
        hi = found[0] + 1
    return [(first + n, lines[n].rstrip("\n")) for n in range(lo, hi)]


def cuda_excerpt(start: Optional[str] = None, stop: Optional[str] = None, edits: Sequence[Edit] = (),
                 file: str = "attention.cu"):
    """[(line number, text)] of ``file`` (attention.cu, with ``edits``, or attention.h) from the
    first line containing ``start`` to the next containing ``stop`` (both included)."""
    text = kernel_text(edits) if file == "attention.cu" else (CUDA_DIR / file).read_text()
    return _excerpt(text.splitlines(), 1, start, stop, file)


def triton_excerpt(obj, start: Optional[str] = None, stop: Optional[str] = None):
    fn = getattr(obj, "fn", obj)
    lines, first = inspect.getsourcelines(fn)
    return _excerpt(lines, first, start, stop, fn.__name__)


def show_source(start: Optional[str] = None, stop: Optional[str] = None, edits: Sequence[Edit] = (),
                file: str = "attention.cu") -> None:
    """Print attention.cu or attention.h (or a passage) with line numbers, like
    viz.show_numbered_source does for Python objects."""
    rows = cuda_excerpt(start, stop, edits, file)
    print(f"# flashattn/cuda/{file}, lines {rows[0][0]}-{rows[-1][0]}")
    for n, text in rows:
        print(f"{n:4d} | {text}")


def side_by_side(left: list, right: list, titles=("Triton", "CUDA")):
    """Two numbered excerpts in two columns (an IPython HTML object)."""
    from IPython.display import HTML

    def column(rows):
        body = "\n".join(f"{n:4d} | {html.escape(t)}" for n, t in rows)
        return f"<pre style='font-size:11px;line-height:1.25;margin:0'>{body}</pre>"
    cells = "".join(f"<th style='text-align:left'>{html.escape(t)}</th>" for t in titles)
    return HTML(f"<table><tr>{cells}</tr><tr><td style='vertical-align:top'>{column(left)}</td>"
                f"<td style='vertical-align:top'>{column(right)}</td></tr></table>")


if __name__ == "__main__":
    # `python -m flashattn.cuda_appendix --selftest` is cuda_selftest's command line. It is run, not
    # imported: cuda_selftest imports this module, and this module does not depend on it.
    import runpy

    runpy.run_module("flashattn.cuda_selftest", run_name="__main__", alter_sys=True)
