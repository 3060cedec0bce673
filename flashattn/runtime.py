"""Device, dtype and input-validation policy.

This module is imported before any kernel is defined, because Triton decides when a
``@triton.jit`` function is *defined* whether it will run compiled on a GPU or inside its
Python interpreter (``TRITON_INTERPRET=1``). The rule:

* ``TRITON_INTERPRET`` already set by the user: respect it.
* otherwise, no CUDA device: switch the interpreter on, so the very same kernels run on the
  CPU (slowly, but exactly), with nothing for the user to do.

Everything else here is policy the launchers share: which dtypes a kernel may see, how to
pad the head dimension, the ``validate_*`` input checks (a clear error naming what was
expected and what came), and how to allocate outputs (optionally poisoned with NaN, so a
kernel that forgets to write an element is caught). Tile sizes live in ``configs.py``.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from typing import Optional, Sequence


def _decide_interpret() -> bool:
    env = os.environ.get("TRITON_INTERPRET")
    if env is not None:
        return env.strip() not in ("", "0", "false", "False")
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def _interpret_triton_library() -> int:
    """Make Triton's own ``@triton.jit`` helpers interpretable when Triton was imported first.

    Triton decides compiled-or-interpreted when a function is *decorated*. ``tl.zeros``,
    ``tl.max``, ``tl.sum``... are ``@jit`` functions of ``triton.language`` itself, so a program
    that imported triton before flashattn switched the interpreter on (``import torch, triton,
    flashattn``) holds compiled ``JITFunction``s there, and an interpreted kernel calling one
    fails with "Cannot call @triton.jit'd outside of the scope of a kernel". Each such helper
    is wrapped once as the interpreter would have wrapped it (the same object for every module
    that imported it). Returns how many were wrapped. (Member calls such as ``x.sum(axis=0)`` inside
    a kernel reach the helpers another way and still fail then; no flashattn kernel uses them.)"""
    import sys

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, wrapped[id(value)])
    return len(wrapped)


#: True when the kernels run in Triton's CPU interpreter (decided once, at import).
INTERPRET: bool = _decide_interpret()
if INTERPRET and "triton" in __import__("sys").modules:
    _interpret_triton_library()   # triton came first: its own helpers were made compiled

import torch  # noqa: E402  (after the interpreter decision on purpose)
import triton  # noqa: E402

from . import settings  # noqa: E402


def _index_of_scalar(self) -> int:
    # A scalar in the interpreter is a NumPy array of one element, of shape () or (1,).
    return int(self.handle.data.reshape(()))


def _make_interpreter_index_numpy_proof() -> bool:
    """Triton 3.2-3.6's interpreter turns a scalar tensor into a Python int (a loop bound, say)
    with ``int(array([n]))``; NumPy 2.4 made that a TypeError, so every kernel with a loop
    failed on its first launch. Triton 3.7 reshapes first. For the older ones, wrap the
    function that patches ``tl.tensor`` for each interpreted launch so that ``__index__``
    reshapes too. Returns True if the wrap was needed."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_flashattn_wrapped", False):
        return False
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):  # pragma: no cover - source not shipped
        return False
    if "int(self.handle.data)" not in source:
        return False            # this Triton already converts safely

    @functools.wraps(original)
    def patch_lang_tensor(tensor, *scope):
        original(tensor, *scope)
        if scope:               # triton 3.6: changes go through a scope that restores them
            scope[0].set_attr(tensor, "__index__", _index_of_scalar)
        else:                   # triton 3.2-3.5: set for good
            tensor.__index__ = _index_of_scalar

    patch_lang_tensor._flashattn_wrapped = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


if INTERPRET:
    _make_interpreter_index_numpy_proof()


class BF16FallbackWarning(UserWarning):
    """bf16 was requested where Triton cannot multiply bf16; the kernels ran in fp32."""


# --------------------------------------------------------------------------------------
# devices and dtypes
# --------------------------------------------------------------------------------------
def device_summary() -> str:
    """A one-line description of where the kernels run, for notebooks and logs."""
    if INTERPRET:
        return f"CPU, Triton interpreter (triton {triton.__version__}, torch {torch.__version__})"
    name = torch.cuda.get_device_name()
    cc = ".".join(map(str, torch.cuda.get_device_capability()))
    return f"{name} (sm {cc}, triton {triton.__version__}, torch {torch.__version__})"


def where() -> str:
    """Old name of :func:`device_summary` (it read like a masked select); kept for old code."""
    return device_summary()


def default_device() -> torch.device:
    """The device tensors should live on: CUDA when kernels are compiled, CPU in the interpreter."""
    return torch.device("cpu") if INTERPRET else torch.device("cuda")


def autocast_inputs(q, k, v):
    """q, k, v as SDPA sees them under ``torch.autocast``: cast to the autocast dtype of their
    device type when an autocast region is active there (and they are floating point), else as
    they came. Both public entry points call it, so they behave alike."""
    if not isinstance(q, torch.Tensor) or not q.is_floating_point() or q.dtype == torch.float64:
        return q, k, v                     # (autocast leaves float64 alone, as SDPA sees it)
    device_type = q.device.type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:                      # torch < 2.4: one switch per device type
        enabled = torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()
    if not enabled:
        return q, k, v
    try:
        dtype = torch.get_autocast_dtype(device_type)
    except (AttributeError, TypeError):    # torch < 2.4
        dtype = torch.get_autocast_gpu_dtype() if device_type == "cuda" else torch.get_autocast_cpu_dtype()
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))


def _bf16_dot_supported(device: torch.device) -> bool:
    # The interpreter multiplies bf16 bit patterns as integers (triton issue 11584), and GPUs
    # before Ampere (a Colab T4 is sm 7.5) have no bf16 tensor cores.
    if INTERPRET:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def _triton_version() -> tuple[int, int]:
    return tuple(int(x) for x in triton.__version__.split(".")[:2])


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """Dtypes the kernels accept as they are, here. (The interpreter of Triton before 3.5
    has no fp64 ``tl.dot``.)"""
    if INTERPRET:
        fp64 = (torch.float64,) if _triton_version() >= (3, 5) else ()
        return (torch.float16, torch.float32) + fp64
    return (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the kernels will run in for inputs of ``dtype``.

    bf16 where bf16 matrix products are impossible (CPU interpreter, pre-Ampere GPU) is run in
    fp32 and the results are cast back to bf16, with a BF16FallbackWarning: loud, not silent.
    """
    if dtype == torch.bfloat16 and not _bf16_dot_supported(device):
        where_ = "the Triton CPU interpreter" if INTERPRET else "this GPU (bf16 needs sm 8.0+)"
        warnings.warn(
            f"bf16 is not supported by {where_}: the kernels run in fp32 and "
            "casts the results back to bf16. Use float16 or float32 to silence this.",
            BF16FallbackWarning,
            stacklevel=4,
        )
        return torch.float32
    return dtype


def in_kernel_dtype(fn, q: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(q, *tensors)`` in the dtype the kernels can run (see :func:`compute_dtype`), the
    result cast back to q's dtype. ``.to()`` is differentiable: autograd casts the gradients
    back for us."""
    kernel_dtype = compute_dtype(q.dtype, q.device)
    if kernel_dtype == q.dtype:
        return fn(q, *tensors)
    return fn(q.to(kernel_dtype), *(t.to(kernel_dtype) for t in tensors)).to(q.dtype)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of LSE, delta and the accumulators: fp32, or fp64 for fp64 inputs (so that
    ``torch.autograd.gradcheck`` sees float64 all the way through)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dot_precision(dtype: torch.dtype, head_dim: Optional[int] = None) -> str:
    """``input_precision`` of the lesson kernels' ``tl.dot``, fp32's accuracy for fp32 inputs:
    "tf32x3" on GPUs with TF32 tensor cores (sm 8.0+; three TF32 products per product, about
    1e-6 relative error), exact "ieee" products in the interpreter and on older GPUs. Not plain
    TF32 (Triton's default): its ~1e-3 error would fail the course's 1e-4 checks. Exact IEEE
    products on a GPU run on the CUDA cores and spill registers: an H100 sweep measured the
    fp32 lesson kernels 5-70x slower with them. Ignored for other dtypes.

    ``head_dim``: on Hopper, fp32 at a head dim that is not a multiple of 16 takes "ieee" too, a
    precaution. The randomized battery (``flashattn.fuzz``, seed 8, H200, Triton 3.6) found two
    such problems where tf32x3 went wrong: the lesson dK/dV kernel wrote outside its shared memory
    at D = 72 (problem 80; compute-sanitizer: ``dP^T = V dO^T``) and gave wrong dK, dV at D = 120
    with K read every other element (problem 370). The same inputs passed at D = 64 and 128, or
    with "ieee"; 37 other lesson problems at such head dims had passed with tf32x3, so the cause
    needs more than the head dim, and is not known."""
    if dtype != torch.float32:
        return "tf32"
    if INTERPRET:
        return "ieee"
    major = torch.cuda.get_device_capability()[0]
    if major < 8 or (major == 9 and head_dim is not None and head_dim % 16):
        return "ieee"
    return "tf32x3"


#: ``input_precision`` of the fast kernels' fp32 products when torch's TF32 switch is off, most
#: accurate first. Max relative error per head against float64 on an H100 (D=128, causal,
#: S=1000; O, dQ, dK, dV), next to SDPA's fp32 backends (math 4-8e-7, efficient 5-8e-7):
#: "bf16x6" (six bf16 products per product: fp32 split into three bf16 pieces) 2-4e-7;
#: "tf32x3" (three TF32 products) 4-8e-7; "bf16x3" (two pieces, three products) 6-8e-6, an
#: opt-in for speed; "ieee" exact fp32 products on the CUDA cores, slow. bf16's tensor cores run
#: twice TF32's rate, so six bf16 products cost what three TF32 ones do, and a bf16 tile takes
#: half the shared memory: on the H100, D=128 causal, bf16x6 ran the forward in 4.4 ms against
#: 7.1 with tf32x3, the backward in 26 against 31 (bf16x3: 3.0 and 14.6).
FP32_PRECISIONS = settings.FP32_PRECISIONS
FP32_PRECISION_ENV = "FLASHATTN_FP32_PRECISION"


@functools.lru_cache(maxsize=None)
def triton_knows_precision(precision: str) -> bool:
    """Whether this Triton's NVIDIA backend accepts ``input_precision=precision`` (the bf16
    emulations came with Triton 3.5's generation; older ones know "tf32", "tf32x3", "ieee")."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        return precision in CUDAOptions.__dataclass_fields__["allowed_dot_input_precisions"].default
    except Exception:   # no NVIDIA backend, or a Triton that keeps the list elsewhere
        return precision in ("tf32", "tf32x3", "ieee")


def _default_fp32_precision() -> str:
    bf16_cores = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    return "bf16x6" if bf16_cores and triton_knows_precision("bf16x6") else "tf32x3"


def fp32_precision_choice() -> str:
    """The fp32 products' precision when TF32 is not allowed: ``FLASHATTN_FP32_PRECISION`` if
    set (one of ``FP32_PRECISIONS``; ``settings.fp32_precision``), else "bf16x6" where this Triton
    offers it and the GPU has bf16 tensor cores (sm 8.0+), else "tf32x3"."""
    choice = settings.current.fp32_precision or _default_fp32_precision()
    if not triton_knows_precision(choice):
        raise ValueError(f"{FP32_PRECISION_ENV}={choice!r}: this Triton ({triton.__version__}) does not offer "
                         f"that input_precision; use 'tf32x3' or 'ieee', or a newer Triton")
    return choice


def fast_dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the fast kernels' ``tl.dot``. fp16/bf16: ignored. fp32: TF32 only
    when torch's own switch allows it (``torch.backends.cuda.matmul.allow_tf32``, i.e.
    ``torch.set_float32_matmul_precision("high")`` or ``"medium"``), as for torch's matmuls;
    otherwise fp32's accuracy (``fp32_precision_choice``: "bf16x6" by default).
    The interpreter multiplies exactly whatever this says."""
    if dtype != torch.float32 or INTERPRET:
        return "ieee" if INTERPRET else "tf32"
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return fp32_precision_choice()


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (n >= 1), as ``triton.next_power_of_2`` but by bit arithmetic:
    it runs on the launch path of every call, where Triton's costs about a microsecond."""
    return 1 << (n - 1).bit_length()


def head_dim_block(head_dim: int) -> int:
    """Head dims are padded to a power of two (at least 16, the smallest ``tl.dot``) and the
    padding is masked in every load and store."""
    return max(16, next_power_of_2(head_dim))


# --------------------------------------------------------------------------------------
# input validation, shared by the public function and the raw launchers
# --------------------------------------------------------------------------------------
def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"
    return f"{type(t).__name__}"


def validate_qkv(q, k, v, *, allow_bf16_fallback: bool = False) -> None:
    """Raise TypeError / ValueError naming what was expected and what came."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {_describe(t)}")
        if t.dim() != 4:
            layout = "[B, H, S_q, D]" if name == "q" else "[B, H_kv, S_k, D]"
            raise ValueError(f"{name} must be 4-D {layout}, got {t.dim()}-D shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): every dimension must be >= 1")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    ok = supported_dtypes() + ((torch.bfloat16,) if allow_bf16_fallback else ())
    if q.dtype not in ok:
        extra = (" (fp64 in the interpreter needs triton >= 3.5)"
                 if INTERPRET and q.dtype == torch.float64 else "")
        raise TypeError(
            f"dtype {q.dtype} is not supported here ({'interpreter' if INTERPRET else 'GPU'}); "
            f"expected one of {', '.join(str(d) for d in ok)}{extra}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if not INTERPRET and q.device.type != "cuda":
        raise ValueError(
            f"the kernels are compiled for the GPU, so q, k, v must be CUDA tensors, got {q.device}. "
            "(Set TRITON_INTERPRET=1 before importing flashattn to run them on the CPU.)"
        )
    B, H, S_q, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    Bk, H_kv, S_k, Dk = k.shape
    if Bk != B:
        raise ValueError(f"batch size differs: q has B={B}, k and v have B={Bk}")
    if Dk != D:
        raise ValueError(f"head dim differs: q has D={D}, k and v have D={Dk}")
    if H % H_kv != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of key/value heads "
            f"(GQA), got H={H} and H_kv={H_kv}"
        )
    if D % 8 != 0 or D > 256:
        raise ValueError(f"head dim D must be a multiple of 8 and at most 256, got D={D}")


def validate_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {_describe(scale)}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def validate_causal(causal) -> bool:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {_describe(causal)}")
    return causal


def validate_grad_output(do, o) -> None:
    if not isinstance(do, torch.Tensor):
        raise TypeError(f"dO must be a torch.Tensor, got {_describe(do)}")
    if do.shape != o.shape:
        raise ValueError(f"dO must have the output's shape {tuple(o.shape)}, got {tuple(do.shape)}")
    if do.device != o.device:
        raise ValueError(f"dO must be on {o.device}, got {do.device}")


def validate_row_stats(q, **stats) -> None:
    """The LSE and delta the backward kernels read: one number per query row, [B, H, S_q]."""
    want = tuple(q.shape[:3])
    for name, t in stats.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [B, H, S_q] = {list(want)}, got {_describe(t)}")
        if tuple(t.shape) != want:
            extra = (" -- a trailing axis of size 1: reduce without keepdim=True, or .squeeze(-1)"
                     if tuple(t.shape) == want + (1,) else "")
            raise ValueError(f"{name} must be [B, H, S_q] = {list(want)} (one number per query row), "
                             f"got {list(t.shape)}{extra}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")


# --------------------------------------------------------------------------------------
# outputs: optionally poisoned with NaN so that unwritten elements show up in tests
# --------------------------------------------------------------------------------------
_poison = settings.current.poison


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True):
    """Inside this block every output buffer starts as NaN instead of uninitialised memory."""
    global _poison
    before, _poison = _poison, enabled
    try:
        yield
    finally:
        _poison = before


#: Inside ``guarded_outputs()``: every output made since, as (buffer, first, last, shape), where
#: the output is buffer[first:last] and the rest of the buffer is a guard a kernel must not touch.
_guarded: Optional[list] = None
#: the guards' value: finite, exact in fp16, bf16 and fp32, and unlikely to be what a stray
#: store writes (NaN is the poison inside)
GUARD_VALUE = -1152.0
#: elements of guard on each side: 512 bytes of fp32, so the output stays 128-byte aligned
GUARD_ELEMENTS = 128


@contextlib.contextmanager
def guarded_outputs():
    """Inside this block every output buffer starts as NaN and sits between two guard regions
    of ``GUARD_VALUE``; :func:`guard_violations` names the outputs whose guards were written
    (a store past either end). Used by the randomized battery (``flashattn.fuzz``)."""
    global _guarded
    before, _guarded = _guarded, []
    try:
        with poisoned_outputs():
            yield _guarded
    finally:
        _guarded = before


def guard_violations(records: list) -> list[str]:
    """'shape dtype: N elements written before / after' for every guarded output touched."""
    bad = []
    for buffer, first, last, shape in records:
        before = int((buffer[:first] != GUARD_VALUE).sum())
        after = int((buffer[last:] != GUARD_VALUE).sum())
        if before or after:
            bad.append(f"output {list(shape)} {buffer.dtype}: {before} guard elements written before it, "
                       f"{after} after it")
    return bad


def new_output(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if _guarded is not None and dtype.is_floating_point:
        n = math.prod(shape)
        buffer = torch.full((n + 2 * GUARD_ELEMENTS,), GUARD_VALUE, dtype=dtype, device=device)
        buffer[GUARD_ELEMENTS:GUARD_ELEMENTS + n] = float("nan")
        _guarded.append((buffer, GUARD_ELEMENTS, GUARD_ELEMENTS + n, tuple(shape)))
        return buffer[GUARD_ELEMENTS:GUARD_ELEMENTS + n].view(tuple(shape))
    if _poison and dtype.is_floating_point:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def ninja_dir() -> Optional[str]:
    """Where a ninja executable is (torch.utils.cpp_extension builds with it: lesson 10's CUDA
    kernels, the fast path's C++ node): on PATH, beside this Python (a venv not activated), or in
    the pip package's folder. None if nowhere."""
    import shutil
    import sys

    found = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))
    if found:
        return os.path.dirname(found)
    try:
        import ninja
        return getattr(ninja, "BIN_DIR", None)
    except ImportError:
        return None


def ninja_on_path() -> Optional[str]:
    """Put ninja's folder on PATH if it is not there (torch runs ``ninja`` from PATH); its folder,
    or None where there is no ninja."""
    import shutil

    folder = ninja_dir()
    if folder and shutil.which("ninja") is None:
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
    return folder
