"""The fast path's autograd node in C++, for calls that have a launch plan (``plans.py``).

Why: at a training loop's small shapes the host, not the GPU, sets the pace. On an H200 at B8 H12
S256 D64 the kernels of a forward + backward take 39 us of GPU time, and the Python autograd node
alone costs 81 us of host time (``results/host_gap_h200.md``). Its backward also runs on
autograd's device thread under Python's GIL. Trimming Python cannot close that gap.

What: ``native.cpp`` is a ``torch::autograd::Function`` whose forward and backward replay a
call's plans from C++: the forward's one launch and the backward's (delta, dQ, dK/dV: three at
most head dims). Each launch is handed over as words: the CUfunction Triton loaded, the grid, and
every kernel parameter as an 8-byte word in the order of Triton's launcher (``_launch_spec``).
Tensors' addresses fill their slots at each call. The kernels, their arguments and so their
results are the Python path's, and the node saves the same five tensors as ``ops.EagerAttention``.

When it runs:

* The module is built by ``torch.utils.cpp_extension.load`` in a background thread. That starts at
  the first eager fast call that wants a gradient: about 40 s with one core, once per machine
  (torch caches it). Until it is ready, and wherever it cannot be built, calls take the Python path.
* A signature gets a C++ plan after the Python path has recorded both halves: the forward's plan
  and the backward's, by the end of its third call in a fresh process (the first compiles). The
  backward's plan holds dO's layout (contiguous, or the transposed view a model's
  ``o.transpose(1, 2)`` hands back); a later dO laid out otherwise is copied into that layout.
* From then on ``attention`` finds the plan in C++ (shapes, strides, dtypes, alignment, which
  inputs are one tensor, causal, scale, which inputs require a gradient). The call's front
  (``api``, ``ops.attention``: argument checks cached per signature) is still Python; the node,
  its backward and every launch are not.
* Whatever turns plans off when the forward runs turns this off too (``plans.enabled``: a launch
  hook, the checkers' launch counting, guarded or poisoned outputs), as do ``FLASHATTN_NATIVE=0``
  (``settings.native``), a Triton whose launcher is not the one the words follow
  (``WRITTEN_FOR``), tracing and compiling (``ops.traced``, ``torch.jit.is_tracing``). A forward
  made by the C++ node has its backward replayed by it, whatever changed in between. Settings
  that change the kernels clear the kept plans.
* Models that recompute their forward under non-reentrant activation checkpointing keep the
  Python node: the recomputed inputs do not require gradients, so no plan is offered for them.
  Compiled autograd over an eager forward is untested with this node.
"""
from __future__ import annotations

import os
import struct
import threading
import time

import torch

from .. import runtime, settings
from . import plans

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.cpp")
#: Triton releases whose launcher passes parameters as ``_launch_spec`` lays them out (every
#: non-constexpr parameter, then the global and the profile scratch pointers)
WRITTEN_FOR = ((3, 6), (3, 7))
#: bits of each integer parameter type Triton's launcher passes
_INT_BITS = {"i1": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64, "u1": 8, "u8": 8, "u16": 16, "u32": 32, "u64": 64}
#: a build lock older than this belongs to a build that died (a process killed mid-build)
STALE_LOCK_S = 300

_module = None      # the built extension, once ready
_error = None       # why the C++ node is off, once known
_thread = None      # the background build
_settings = None    # the settings the kept plans were made under
_refused = None     # why the last plan offered was not kept (``status``)


def _triton_version() -> tuple:
    import triton

    return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in triton.__version__.split(".")[:2])


def status() -> str:
    """One line: is the C++ node in use, building, or off and why."""
    if _module is not None:
        line = f"the C++ autograd node is ready ({_module.kept()} plans kept, {_module.calls()} calls)"
        return line + (f"; the last plan refused: {_refused}" if _refused else "")
    if _error is not None:
        return f"the C++ autograd node is off: {_error}"
    if _thread is not None:
        return "the C++ autograd node is building (calls take the Python node meanwhile)"
    return "the C++ autograd node is not built yet (it builds at the first eager GPU call with a gradient)"


def start() -> None:
    """Build the module (or load it from torch's extension cache) in a background thread, once."""
    global _thread, _error
    if _thread is not None or _module is not None or _error is not None:
        return
    if runtime.INTERPRET or not torch.cuda.is_available():
        _error = "no GPU: Triton's interpreter runs the kernels"
        return
    version = _triton_version()
    if version not in WRITTEN_FOR:
        _error = (f"triton {'.'.join(map(str, version))}: its launcher is not the one the plans' words follow "
                  f"({', '.join('%d.%d' % v for v in WRITTEN_FOR)})")
        return
    _thread = threading.Thread(target=_build, name="flashattn-native-build", daemon=True)
    _thread.start()


def build():
    """Compile ``native.cpp`` (or load it from torch's extension cache, ``TORCH_EXTENSIONS_DIR``)
    and return the module, here and now, GPU or not (the CPU tests check its host logic)."""
    from torch.utils import cpp_extension

    if runtime.ninja_on_path() is None:
        raise RuntimeError("ninja is missing (torch's extension builder needs it): pip install ninja")
    _clear_stale_lock(cpp_extension)
    return cpp_extension.load(name="flashattn_native", sources=[SOURCE], extra_cflags=["-O2"], verbose=False)


def _clear_stale_lock(cpp_extension) -> None:
    """torch waits without end for the lock file of a build in progress, and a process killed
    mid-build (a notebook's kernel restarted) leaves its lock behind: wait for a lock at most
    until it is ``STALE_LOCK_S`` old, then take it as dead and remove it."""
    try:
        lock = os.path.join(cpp_extension._get_build_directory("flashattn_native", verbose=False), "lock")
        while os.path.exists(lock) and time.time() - os.path.getmtime(lock) < STALE_LOCK_S:
            time.sleep(1.0)        # another process is building: its build will be loaded
        if os.path.exists(lock):
            os.remove(lock)
    except (AttributeError, OSError):   # a torch that keeps its builds elsewhere: its own wait
        pass


def _build() -> None:
    global _module, _error
    try:
        module = build()
    except Exception as exc:   # noqa: BLE001 -- no compiler, no ninja, ...: the Python node stays
        first = str(exc).strip().splitlines()
        _error = f"it did not build ({type(exc).__name__}: {first[0] if first else ''})"
        return
    _module = module


def wait(timeout: float | None = 600) -> bool:
    """Start the build if needed and wait for it (at most ``timeout`` seconds); True if the C++
    node is ready."""
    start()
    if _thread is not None:
        _thread.join(timeout)
    return _module is not None


def calls() -> int:
    """How many forwards the C++ node has run in this process (0 before it is built)."""
    return 0 if _module is None else _module.calls()


def ready() -> bool:
    """Is the C++ module built (whatever the settings say now)?"""
    return _module is not None


def _active():
    """The module, if C++ plans may be used (and kept) now; else None."""
    global _settings
    module = _module
    if module is None or not settings.current.native or not plans.enabled():
        return None
    if settings.current is not _settings:
        if _settings is None or not settings.same_kernels(_settings, settings.current):
            module.clear()        # plans recorded under other settings are not these
        _settings = settings.current
    return module


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """O through the C++ node where a plan is kept for this signature, else None. Starts the
    build on the first call."""
    if _module is None:
        if _thread is None and _error is None:
            start()
        return None
    module = _active()
    return None if module is None else module.attention(q, k, v, causal, scale)


def offer(q, k, v, o, do, lse, causal: bool, scale: float, needs_dq: bool, needs_dkdv: bool) -> bool:
    """After a Python-node backward: keep a C++ plan for this call's signature if the Python path
    has recorded both its halves (``ops.EagerAttention``). True if one was kept. Never raises: a
    plan that cannot be made leaves the Python node in place, and ``status`` says why."""
    global _refused
    module = _active()
    if module is None:
        return False
    try:
        why = _refusal(q, k, v, o, do, lse, needs_dq, needs_dkdv)
        if why is None:
            forward = plans.find(plans.signature((q, k, v), ("fwd", causal, scale)))
            backward = plans.find(plans.signature((q, k, v, o, do, lse), ("bwd", causal, scale, needs_dq, needs_dkdv)))
            if forward is None or backward is None:
                return False      # not recorded yet (a first call compiles): the next call offers again
            forward_spec, backward_spec = _half_spec(forward), _half_spec(backward)
            if forward_spec is None or backward_spec is None:
                why = "a launch whose parameters are not laid out as the words assume"
            elif len(forward_spec[2]) != 2 or None in forward.returns:
                why = "a forward that does not return O and LSE"
            else:
                why = module.keep(q, k, v, causal, scale, forward_spec, backward_spec, list(do.stride())) or None
    except Exception as exc:   # noqa: BLE001 -- an optional speed-up must not fail a training step
        why = f"{type(exc).__name__}: {exc}"
    _refused = why
    return why is None


def _refusal(q, k, v, o, do, lse, needs_dq: bool, needs_dkdv: bool):
    """Why this call's plans cannot be kept for the C++ node, or None."""
    if not _dense(do.shape, do.stride()) or do.data_ptr() % 16:
        return "dO laid out with gaps, overlaps or misaligned"   # (the C++ backward copies dO into the kept layout)
    storage = do.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in (q, k, v, o, lse)):
        return "dO shares memory with an input or output (o.backward(o)): its slot would be theirs"
    if needs_dq != q.requires_grad or needs_dkdv != (k.requires_grad or v.requires_grad):
        return "the gradients asked for are not those the inputs require"   # (the C++ key holds requires_grad)
    return None


def _dense(shape, strides) -> bool:
    """Do these strides lay the elements out without gaps or overlap, in some order of the axes
    (contiguous, or a transposed view of a contiguous tensor: what a model's dO usually is)?"""
    step = 1
    for size, stride in sorted((pair for pair in zip(shape, strides) if pair[0] != 1), key=lambda p: p[1]):
        if stride != step:
            return False
        step *= size
    return True


def _half_spec(plan):
    """A Python plan as native.cpp's ``HalfSpec``: (launches, fresh outputs, result slots), or
    None if a launch cannot be replayed from C++."""
    launches = []
    kernels = plan.kernels or (None,) * len(plan.launches)
    for launch_entry, kernel in zip(plan.launches, kernels):
        spec = None if kernel is None else _launch_spec(launch_entry, kernel)
        if spec is None:
            return None
        launches.append(spec)
    fresh = [(list(shape), str(dtype).removeprefix("torch.")) for shape, dtype in plan.fresh]
    return launches, fresh, [-1 if slot is None else slot for slot in plan.returns]


def _launch_spec(entry, kernel):
    """One recorded launch as the words of its parameters, laid out as Triton's launcher lays
    them out (``triton/backends/nvidia/driver.py``: every parameter whose type is not
    "constexpr", then the global and the profile scratch pointers). None where that layout is
    not certain: clusters, cooperative or PDL launches, profiling scratch, host tensor
    descriptors (the Gluon kernels'), tuples."""
    launcher, grid, function, metadata, constants, tensor_slots, constexprs = entry
    meta = kernel.metadata
    types = list(kernel.src.signature.values())
    values = list(constants) + list(constexprs)
    num_warps, num_ctas, shared = metadata
    if (len(types) != len(values) or num_ctas != 1 or getattr(meta, "launch_cooperative_grid", False)
            or getattr(meta, "launch_pdl", False) or getattr(meta, "profile_scratch_size", 0)
            or getattr(meta, "tensordesc_meta", None)):
        return None
    slot_at = dict(tensor_slots)
    words, tensors = [], []
    for position, (ty, value) in enumerate(zip(types, values)):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            return None
        if ty.startswith("*"):
            if position in slot_at:
                tensors.append((len(words), slot_at[position]))
            elif value is not None:
                return None
            words.append(0)
        elif ty in _INT_BITS:
            words.append(int(value) & ((1 << _INT_BITS[ty]) - 1))
        elif ty in ("fp32", "f32"):
            words.append(struct.unpack("<I", struct.pack("<f", float(value)))[0])
        elif ty == "fp64":
            words.append(struct.unpack("<Q", struct.pack("<d", float(value)))[0])
        else:
            return None
    scratch = getattr(meta, "global_scratch_size", 0) or 0
    programs = grid[0] * grid[1] * grid[2]
    scratch_param = len(words)
    words += [0, 0]          # the global and the profile scratch pointers
    return (int(function), list(grid), 32 * num_warps, shared, programs * num_ctas * scratch,
            max(1, getattr(meta, "global_scratch_align", 1) or 1), scratch_param, words, tensors)
