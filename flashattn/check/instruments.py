"""Instruments the runner puts around the learner's code: which kernels a launcher starts (and with
what arguments and grid), loads and stores outside every tensor the kernel was given (fenced off
in the interpreter), and loads that returned the NaN guard past an input's end.

The counting patches Triton's own launch path (``GridExecutor.__call__`` in the interpreter,
``JITFunction.run`` on a GPU) and, because the package's fast kernels skip that path, observes
theirs through ``flashattn.fast.launch.OBSERVERS``; each is undone when its block ends.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from .. import runtime
from .battery import guard_bits


# --------------------------------------------------------------------------------------
# did the launcher start a kernel?
# --------------------------------------------------------------------------------------
@dataclass
class Launch:
    """One Triton launch as the kernel saw it: its scalar arguments by parameter name, the grid,
    and which of the handed tensors each tensor parameter received, so a rule can compare them
    with what the case needs."""

    kernel: str
    args: dict
    grid: Optional[tuple]
    fn: object = None                 # the kernel's Python function (its source, for the rules)
    pointers: dict = None             # tensor parameter -> its data_ptr()
    tensors: dict = None              # tensor parameter -> the name of the handed tensor it got
    strides: dict = None              # tensor parameter -> the strides of the tensor it got


def _record(fn, grid, args, kwargs) -> Optional[Launch]:
    import inspect

    try:
        signature = inspect.signature(fn)
        bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    except (TypeError, ValueError):
        return None
    scalars = {n: v for n, v in bound.arguments.items()
               if isinstance(v, (bool, int, float, np.integer, np.floating))}
    pointers = {n: v.data_ptr() for n, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
    strides = {n: tuple(v.stride()) for n, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
    if callable(grid):
        try:
            grid = grid(dict(bound.arguments))
        except Exception:             # noqa: BLE001 -- a grid function of the learner's: leave it out
            grid = None
    try:
        grid = tuple(int(g) for g in grid) if grid is not None else None
    except (TypeError, ValueError):
        grid = None
    return Launch(getattr(fn, "__name__", "?"), scalars, grid, fn, pointers, strides=strides)


@contextlib.contextmanager
def count_triton_launches(record: Optional[list] = None):
    """Yields a one-element list counting the Triton kernels launched inside the block (the fast
    kernels' direct launches too); each launch through Triton's own path has its :class:`Launch`
    appended to ``record`` if one is given."""
    count = [0]
    if runtime.INTERPRET:
        from triton.runtime import interpreter

        cls, attr = interpreter.GridExecutor, "__call__"
    else:
        from triton.runtime.jit import JITFunction

        cls, attr = JITFunction, "run"
    original = getattr(cls, attr)

    def counting(self, *args, **kwargs):
        if not kwargs.get("warmup", False):
            count[0] += 1
            if record is not None:
                grid = self.grid if runtime.INTERPRET else kwargs.get("grid")
                launch = _record(self.fn, grid, args, kwargs)
                if launch is not None:
                    record.append(launch)
        return original(self, *args, **kwargs)

    from ..fast import launch     # the fast kernels' direct launches skip JITFunction.run: observed

    def counting_direct(direct, grid, args):
        count[0] += 1

    setattr(cls, attr, counting)
    launch.OBSERVERS.append(counting_direct)
    try:
        yield count
    finally:
        setattr(cls, attr, original)
        launch.OBSERVERS.remove(counting_direct)


@contextlib.contextmanager
def fence_wild_access():
    """In the interpreter: loads and stores that fall outside every tensor the kernel was given
    (each argument's whole storage, guards included) are masked off -- a wild store there would
    corrupt the Python process's own memory and kill the learner's kernel -- and counted. Yields
    ``{"loads": n, "stores": n}``. Elsewhere it counts nothing (a GPU reports its own fault)."""
    found = {"loads": 0, "stores": 0}
    if not runtime.INTERPRET:
        yield found
        return
    from triton.runtime import interpreter

    spans: list = []
    launch_cls, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    call, load, store = launch_cls.__call__, builder.create_masked_load, builder.create_masked_store

    def recording_call(self, *args, **kwargs):
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                lo = a.untyped_storage().data_ptr()
                spans.append((lo, lo + a.untyped_storage().nbytes()))
        return call(self, *args, **kwargs)

    def fenced(kind, ptrs, mask):
        addrs = ptrs.data
        inside = np.zeros(addrs.shape, dtype=bool)
        for lo, hi in spans:
            inside |= (addrs >= lo) & (addrs < hi)
        wanted = np.broadcast_to(mask.data, addrs.shape)
        wild = wanted & ~inside
        if not wild.any():
            return mask
        found[kind] += int(wild.sum())
        return interpreter.TensorHandle(wanted & inside, mask.dtype)

    def fenced_load(self, ptrs, mask, *rest):
        return load(self, ptrs, fenced("loads", ptrs, mask), *rest)

    def fenced_store(self, ptrs, value, mask, *rest):
        return store(self, ptrs, value, fenced("stores", ptrs, mask), *rest)

    launch_cls.__call__, builder.create_masked_load, builder.create_masked_store = recording_call, fenced_load, fenced_store
    try:
        yield found
    finally:
        launch_cls.__call__, builder.create_masked_load, builder.create_masked_store = call, load, store


_TORCH_KERNEL = re.compile(r"at::|at_cuda_detail|elementwise|vectorized|reduce_kernel|fill|copy|"
                           r"cutlass|cublas|gemm|Memcpy|Memset", re.IGNORECASE)


@contextlib.contextmanager
def count_cuda_launches():
    """Yields a one-element list that, after the block, counts the CUDA kernels launched in it
    that are not PyTorch's own (a CUDA C++ extension's kernels)."""
    count = [None]                       # None: cannot be counted here (no CUDA: an emulation)
    if not torch.cuda.is_available():
        yield count
        return
    count[0] = 0
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():    # torch's notice that each profiling cycle starts afresh
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield count
            torch.cuda.synchronize()
    count[0] = sum(1 for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not _TORCH_KERNEL.search(e.name))


@contextlib.contextmanager
def watch_guard_reads(inputs: dict):
    """In the interpreter: yields a set that collects the names of the inputs (``name ->
    tensor``) whose guard memory a load returned -- a read past the end, seen even when the
    value read is thrown away afterwards by a ``tl.where``. Elsewhere it stays empty."""
    found: set = set()
    if not runtime.INTERPRET:
        yield found
        return
    from triton.runtime import interpreter

    spans = []
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.float32, torch.float64):
            start = t.untyped_storage().data_ptr()
            spans.append((name, start, start + t.untyped_storage().nbytes(), guard_bits(t.dtype), t.element_size()))
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}
    cls = interpreter.InterpreterBuilder
    original = cls.create_masked_load

    def load(self, ptrs, mask, *rest):
        ret = original(self, ptrs, mask, *rest)
        data = ret.data
        if data.dtype.kind == "f" and data.itemsize in uint:
            bits = data.view(uint[data.itemsize])
            hit = np.broadcast_to(mask.data, bits.shape)
            for name, lo, hi, guard, size in spans:
                if name in found or size != data.itemsize:
                    continue
                addrs = ptrs.data[hit & (bits == np.array(guard, dtype=bits.dtype))]
                if addrs.size and ((addrs >= lo) & (addrs < hi)).any():
                    found.add(name)
        return ret

    cls.create_masked_load = load
    try:
        yield found
    finally:
        cls.create_masked_load = original


def launched(launch: Callable, kernel_language: str, *args, record: Optional[list] = None,
             names: Optional[dict] = None) -> Optional[int]:
    """Call ``launch(*args)``; return how many kernels it started (Triton's, or for ``"cuda"``
    CUDA kernels other than PyTorch's own; None where that cannot be counted). Triton launches
    are appended to ``record`` (a list) when one is given; ``names`` (name -> handed tensor)
    then labels each launch's tensor parameters with the handed tensor they received."""
    if kernel_language == "cuda":
        with count_cuda_launches() as count:
            launch(*args)
    else:
        with count_triton_launches(record) as count:
            launch(*args)
    if record and names:
        by_pointer = {}
        for name, t in names.items():          # a tensor and a view of it at the same address: the first
            by_pointer.setdefault(t.data_ptr(), name)
        for one in record:
            one.tensors = {p: by_pointer[ptr] for p, ptr in (one.pointers or {}).items() if ptr in by_pointer}
    return count[0]
