"""The Gluon names the Hopper kernels use, imported here once and checked against the API they
were written for. A Triton without Gluon, or whose Gluon differs (the API moves between releases),
leaves ``ERROR`` saying why and the names ``None``; nothing here raises on import.

Written and compiled against triton 3.6.0 (``WRITTEN_FOR``); another release is refused even when
the names exist, because Gluon's semantics (layouts, ``warp_specialize``) change under the same names.
"""
from __future__ import annotations

import inspect

#: the (major, minor) releases of Triton whose Gluon this code was written and compiled for
WRITTEN_FOR = ((3, 6),)

ERROR = None
VERSION = None
gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = warpgroup_mma_init = fence_async_shared = None
TensorDescriptor = async_copy = None


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _check_api() -> None:
    """Raise if the names this package calls are missing or take other parameters."""
    params = list(inspect.signature(gl.warp_specialize).parameters)
    if params[:3] != ["functions_and_args", "worker_num_warps", "worker_num_regs"]:
        raise ImportError(f"gl.warp_specialize takes {params}, not (functions_and_args, worker_num_warps, "
                          "worker_num_regs)")
    wgmma = list(inspect.signature(warpgroup_mma).parameters)
    if not {"use_acc", "is_async"} <= set(wgmma):
        raise ImportError(f"warpgroup_mma takes {wgmma}, without use_acc / is_async")
    for owner, names in ((tma, ("async_copy_global_to_shared", "async_copy_shared_to_global", "store_wait")),
                         (mbarrier, ("init", "expect", "wait", "arrive", "invalidate", "MBarrierLayout")),
                         (gl, ("NVMMADistributedLayout", "NVMMASharedLayout", "DotOperandLayout", "SliceLayout",
                               "allocate_shared_memory", "thread_barrier", "convert_layout"))):
        missing = [n for n in names if not hasattr(owner, n)]
        if missing:
            raise ImportError(f"{owner.__name__} lacks {missing}")


try:
    import triton

    VERSION = triton.__version__
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    if _version(VERSION) not in WRITTEN_FOR:      # first: the release is what a reader can act on
        raise ImportError(f"triton {VERSION}: the Gluon kernels were written for triton "
                          + " or ".join(f"{a}.{b}" for a, b in WRITTEN_FOR))
    _check_api()
except Exception as exc:   # ImportError, AttributeError, a signature that cannot be read ...
    ERROR = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ImportError) else str(exc)


def ok() -> bool:
    return ERROR is None
