"""Run the CUDA kernels of flashattn/cuda/attention.cu on the CPU: a test-only emulator.

No GPU is needed to test the *logic* of the kernels (indices, masks, loop bounds, strides,
the online softmax, which thread owns what, where the barriers are). This module takes the
very source the GPU build compiles (``cuda_appendix.cuda_source(edits)``), rewrites the three
CUDA-only constructs it uses, and compiles it with g++ into a shared library:

* ``kernel<<<grid, block, bytes, stream>>>(args)`` becomes ``emu::launch(kernel, grid, ...)``,
  which runs the blocks one after the other, each with one OS thread per CUDA thread;
* ``__syncthreads()`` is a ``std::barrier`` of the block's threads; every thread must pass the
  same number of them (a barrier in divergent code is reported, not a hang);
* ``extern __shared__ float smem[]`` is one buffer, filled with NaN before every block, so a
  read of shared memory that no thread wrote shows up as NaN in the output.

Shared-memory tiles are bounds-checked (``FLASHATTN_EMULATION`` in attention.h). What this does
not check: anything about the real GPU -- warp scheduling, the memory model, timing, occupancy,
register or shared-memory limits. Those only an H100 run can tell.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

from flashattn import cuda_appendix
from flashattn.cuda_appendix import Tiling

PRELUDE = r"""
#define FLASHATTN_EMULATION 1
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <math.h>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 4 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <class F> inline cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }

namespace emu {
inline thread_local dim3 thread_idx, block_idx;
inline thread_local long syncs = 0;
inline dim3 block_dim, grid_dim;
inline std::barrier<>* bar = nullptr;
inline std::mutex error_mutex;
inline std::string error_text;
inline cudaError_t last_error = cudaSuccess;
alignas(64) inline float shared_buf[1 << 20];
inline float dummy;

inline void fail(const std::string& msg) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (error_text.empty()) error_text = msg;
}
inline float* shared() { return shared_buf; }

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t bytes, cudaStream_t, Args... args) {
    if (bytes > sizeof(shared_buf) || block.x * block.y * block.z > 1024) {
        fail("launch: too much shared memory or too many threads");
        last_error = cudaErrorInvalidValue;
        return;
    }
    block_dim = block;
    grid_dim = grid;
    const int n = block.x * block.y * block.z;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                std::fill(shared_buf, shared_buf + bytes / sizeof(float),
                          std::numeric_limits<float>::quiet_NaN());
                std::barrier<> b(n);
                bar = &b;
                std::vector<long> counts(n, 0);
                std::vector<std::thread> threads;
                threads.reserve(n);
                for (int t = 0; t < n; ++t)
                    threads.emplace_back([&, t] {
                        thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
                        block_idx = dim3(bx, by, bz);
                        syncs = 0;
                        kernel(args...);
                        counts[t] = syncs;
                        bar->arrive_and_drop();
                    });
                for (auto& th : threads) th.join();
                for (int t = 1; t < n; ++t)
                    if (counts[t] != counts[0]) {
                        fail("__syncthreads reached " + std::to_string(counts[t]) + " times by thread " +
                             std::to_string(t) + " but " + std::to_string(counts[0]) + " times by thread 0");
                        return;
                    }
            }
}
}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
inline void __syncthreads() { ++emu::syncs; emu::bar->arrive_and_wait(); }
inline cudaError_t cudaGetLastError() { cudaError_t e = emu::last_error; emu::last_error = cudaSuccess; return e; }
inline const char* cudaGetErrorString(cudaError_t) { return "emulated launch error"; }
"""

EPILOGUE = r"""
namespace flashattn_cuda {
float& emulation_out_of_bounds(int r, int c, int rows, int cols) {
    emu::fail("shared-memory tile read/written out of bounds: (" + std::to_string(r) + ", " +
              std::to_string(c) + ") in a " + std::to_string(rows) + " x " + std::to_string(cols) + " tile");
    return emu::dummy;
}
}  // namespace flashattn_cuda

namespace fa = flashattn_cuda;
static fa::View<const float> cv(const float* p, const int64_t* s) { return {p, s[0], s[1], s[2], s[3]}; }
static fa::View<float> mv(float* p, const int64_t* s) { return {p, s[0], s[1], s[2], s[3]}; }
static fa::Problem prob(const int* z, float scale, int causal) {
    return {z[0], z[1], z[2], z[3], z[4], z[5], scale, causal != 0};
}
static fa::Tiling til(const int* t) { return {t[0], t[1], t[2]}; }
static int done(cudaError_t e) { return !emu::error_text.empty() ? 2 : int(e); }

extern "C" {
const char* emu_error() { return emu::error_text.c_str(); }
void emu_clear() { emu::error_text.clear(); }
long long emu_smem_bytes(int kernel, const int* t, int D) {
    return fa::smem_bytes(static_cast<fa::Kernel>(kernel), til(t), D);
}
int emu_forward(const float* q, const int64_t* sq, const float* k, const int64_t* sk, const float* v,
                const int64_t* sv, float* o, const int64_t* so, float* lse, const int64_t* sl,
                const int* z, float scale, int causal, const int* t) {
    return done(fa::launch_forward(cv(q, sq), cv(k, sk), cv(v, sv), mv(o, so), mv(lse, sl),
                                   prob(z, scale, causal), til(t), nullptr));
}
int emu_delta(const float* o, const int64_t* so, const float* d, const int64_t* sd, float* out,
              const int64_t* sout, const int* z, const int* t) {
    return done(fa::launch_delta(cv(o, so), cv(d, sd), mv(out, sout), prob(z, 1.f, 0), til(t), nullptr));
}
int emu_dq(const float* q, const int64_t* sq, const float* k, const int64_t* sk, const float* v,
           const int64_t* sv, const float* d, const int64_t* sd, const float* lse, const int64_t* sl,
           const float* de, const int64_t* sde, float* dq, const int64_t* sdq,
           const int* z, float scale, int causal, const int* t) {
    return done(fa::launch_dq(cv(q, sq), cv(k, sk), cv(v, sv), cv(d, sd), cv(lse, sl), cv(de, sde),
                              mv(dq, sdq), prob(z, scale, causal), til(t), nullptr));
}
int emu_dkdv(const float* q, const int64_t* sq, const float* k, const int64_t* sk, const float* v,
             const int64_t* sv, const float* d, const int64_t* sd, const float* lse, const int64_t* sl,
             const float* de, const int64_t* sde, float* dk, const int64_t* sdk, float* dv,
             const int64_t* sdv, const int* z, float scale, int causal, const int* t) {
    return done(fa::launch_dkdv(cv(q, sq), cv(k, sk), cv(v, sv), cv(d, sd), cv(lse, sl), cv(de, sde),
                                mv(dk, sdk), mv(dv, sdv), prob(z, scale, causal), til(t), nullptr));
}
}
"""

LAUNCH = re.compile(r"(\w+)<<<([^>]*)>>>\(([^;]*)\);")


def emulation_source(edits: Sequence = ()) -> str:
    """The GPU build's translation unit, rewritten for g++ (see the module docstring)."""
    src = cuda_appendix.cuda_source(edits)
    src = src.replace("#include <cuda_runtime.h>\n", "")
    shared = "extern __shared__ float smem[];"
    assert shared in src, "the kernels no longer declare their shared memory as the emulator expects"
    src = src.replace(shared, "float* smem = emu::shared();")
    src, n = LAUNCH.subn(r"emu::launch(\1, \2, \3);", src)
    assert n == 4, f"expected 4 kernel launches in attention.cu, found {n}"
    assert "<<<" not in src
    return PRELUDE + src + EPILOGUE


def compiler() -> Optional[str]:
    return shutil.which("g++")


_libs: dict = {}


#: "thread" or "address": build the emulator with that sanitizer (the process must preload it).
SANITIZE = os.environ.get("FLASHATTN_EMULATION_SANITIZE", "")


def _library(edits: Sequence = ()) -> ctypes.CDLL:
    text = emulation_source(edits)
    flags = ["-O2"] if not SANITIZE else ["-O1", "-g", f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer"]
    key = hashlib.sha1((text + " ".join(flags)).encode()).hexdigest()[:16]
    if key not in _libs:
        folder = Path(tempfile.gettempdir()) / "flashattn_cuda_emulation"
        folder.mkdir(exist_ok=True)
        lib = folder / f"emu_{key}.so"
        if not lib.exists():
            cpp = folder / f"emu_{key}.cpp"
            cpp.write_text(text)
            tmp = folder / f"emu_{key}.{id(text)}.so"
            subprocess.run([compiler(), "-std=c++20", *flags, "-pthread", "-shared", "-fPIC", "-Wall",
                            "-Wno-unused-function", "-o", str(tmp), str(cpp)], check=True,
                           capture_output=True, text=True)
            tmp.replace(lib)
        so = ctypes.CDLL(str(lib))
        so.emu_error.restype = ctypes.c_char_p
        so.emu_smem_bytes.restype = ctypes.c_longlong
        _libs[key] = so
    return _libs[key]


def _strides(t: torch.Tensor):
    s = list(t.stride()) + [0] * (4 - t.dim())
    return (ctypes.c_int64 * 4)(*s)


def _ptr(t: torch.Tensor):
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    return ctypes.c_void_p(t.data_ptr())


def _ints(*xs):
    return (ctypes.c_int * len(xs))(*xs)


class EmulatedKernels:
    """The kernels of attention.cu (with ``edits``) on the CPU, with the package's call shapes."""

    def __init__(self, edits: Sequence = (), tiling: Tiling = Tiling(16, 16, 4)):
        self.lib = _library(tuple(edits))
        self.tiling = tiling

    def _run(self, fn, *args):
        self.lib.emu_clear()
        rc = fn(*args)
        if rc != 0:
            raise RuntimeError(f"emulated kernel failed ({rc}): {self.lib.emu_error().decode()}")

    @staticmethod
    def _sizes(q, k):
        B, H, S_q, D = q.shape
        return _ints(B, H, k.shape[1], S_q, k.shape[2], D)

    def _tiling(self, tiling):
        t = tiling or self.tiling
        return _ints(t.block_m, t.block_n, t.threads_y)

    def smem_bytes(self, kernel: int, tiling: Tiling, head_dim: int) -> int:
        return self.lib.emu_smem_bytes(kernel, self._tiling(tiling), head_dim)

    def forward(self, q, k, v, causal=False, scale=None, *, tiling=None):
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        o = torch.full(q.shape, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"))
        self._run(self.lib.emu_forward, _ptr(q), _strides(q), _ptr(k), _strides(k), _ptr(v), _strides(v),
                  _ptr(o), _strides(o), _ptr(lse), _strides(lse), self._sizes(q, k),
                  ctypes.c_float(scale), int(causal), self._tiling(tiling))
        return o, lse

    def delta(self, o, do, *, tiling=None):
        out = torch.full(o.shape[:3], float("nan"))
        self._run(self.lib.emu_delta, _ptr(o), _strides(o), _ptr(do), _strides(do), _ptr(out),
                  _strides(out), self._sizes(o, o), self._tiling(tiling))
        return out

    def launch_dq(self, q, k, v, do, lse, delta, dq, causal, scale, *, tiling=None):
        self._run(self.lib.emu_dq, _ptr(q), _strides(q), _ptr(k), _strides(k), _ptr(v), _strides(v),
                  _ptr(do), _strides(do), _ptr(lse), _strides(lse), _ptr(delta), _strides(delta),
                  _ptr(dq), _strides(dq), self._sizes(q, k), ctypes.c_float(scale), int(causal),
                  self._tiling(tiling))

    def launch_dkdv(self, q, k, v, do, lse, delta, dk, dv, causal, scale, *, tiling=None):
        self._run(self.lib.emu_dkdv, _ptr(q), _strides(q), _ptr(k), _strides(k), _ptr(v), _strides(v),
                  _ptr(do), _strides(do), _ptr(lse), _strides(lse), _ptr(delta), _strides(delta),
                  _ptr(dk), _strides(dk), _ptr(dv), _strides(dv), self._sizes(q, k),
                  ctypes.c_float(scale), int(causal), self._tiling(tiling))


class EmulatedBinding:
    """Stands in for the extension ``load_inline`` builds: the same functions, with the same
    arguments, as the torch binding in cuda_appendix.BINDING (so that the package's own Python
    launchers -- validation, tiling, allocation -- can be tested on the CPU end to end)."""

    __name__ = "emulated_binding"

    def __init__(self, edits: Sequence = ()):
        self.emu = EmulatedKernels(edits)

    def forward(self, q, k, v, causal, scale, t):
        return list(self.emu.forward(q, k, v, causal, scale, tiling=Tiling(*t)))

    def delta(self, o, do, t):
        return self.emu.delta(o, do, tiling=Tiling(*t))

    def dq(self, q, k, v, do, lse, delta, dq, causal, scale, t):
        self.emu.launch_dq(q, k, v, do, lse, delta, dq, causal, scale, tiling=Tiling(*t))

    def dkdv(self, q, k, v, do, lse, delta, dk, dv, causal, scale, t):
        self.emu.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, tiling=Tiling(*t))

    def smem_bytes(self, kernel, t, head_dim):
        return self.emu.smem_bytes(kernel, Tiling(*t), head_dim)
