"""flashattn's switches: every ``FLASHATTN_*`` environment variable, in one table, read once.

They are read when flashattn is imported, so set them before starting Python (or before the
first ``import flashattn``). The code reads ``settings.current`` (never the environment), and
:func:`override` changes them for a block, as the tests and the benchmark's ablation do.

| variable | default | what it does |
| --- | --- | --- |
| ``FLASHATTN_TMA=0`` | on | the fast kernels load K, V (forward) and Q, dO (dK/dV) by pointers, not the copy engine |
| ``FLASHATTN_TMA_STATS=0`` | on | the dK/dV kernel loads the LSE and delta by pointers, not 1-D descriptors |
| ``FLASHATTN_SPLIT_D=0`` | on | the backward pads 128 < D <= 192 to 256 columns instead of 128 + a tail |
| ``FLASHATTN_SPLIT_DKDV=0`` | on | above D = 192, dK and dV in one launch instead of a launch each |
| ``FLASHATTN_FP32_PIECES=0`` | on | fp32's backward as two kernels, not the fused kernel on bf16 pieces |
| ``FLASHATTN_FP32_PRECISION`` | bf16x6 | fp32 products: ``bf16x6``, ``tf32x3``, ``bf16x3`` or ``ieee`` |
| ``FLASHATTN_AUTOTUNE=1`` | off | time the candidate tiles on first use instead of the per-device defaults |
| ``FLASHATTN_DIRECT_LAUNCH=0`` | on | every launch through ``kernel[grid]`` (Triton's own binding); no launch plans either |
| ``FLASHATTN_PLANS=0`` | on | no launch plans: every fp16/bf16 call redoes its host work (``fast/plans.py``) |
| ``FLASHATTN_NATIVE=0`` | on | planned calls keep the Python autograd node, not the C++ one (``fast/native.py``) |
| ``FLASHATTN_MAX_SHARED_MEMORY`` | the GPU's | cap the shared memory tiles may use (bytes; ``64K`` works): a T4's limit on a big GPU |
| ``FLASHATTN_POISON=1`` | off | every output starts as NaN (an element never written shows) |
| ``FLASHATTN_GLUON=0`` | on | no Gluon kernels (``flashattn/hopper/``): the ``tl`` fast path on Hopper too |

(``TRITON_INTERPRET=1`` is Triton's own: the kernels run in its interpreter; without a GPU
flashattn sets it.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Mapping, Optional

FP32_PRECISIONS = ("bf16x6", "tf32x3", "bf16x3", "ieee")


def parse_bytes(name: str, raw: str) -> Optional[int]:
    """``65536`` or ``64K`` -> bytes (None for an empty value); at least 16 KB."""
    raw = raw.strip()
    if not raw:
        return None
    scale = 1024 if raw[-1] in "kK" else 1
    try:
        value = int(raw[:-1] if scale == 1024 else raw) * scale
    except ValueError:
        raise ValueError(f"{name} must be a number of bytes such as 65536 or 64K, got {raw!r}") from None
    if value < 16 * 1024:
        raise ValueError(f"{name}={raw} is below 16 KB, the smallest tile's need")
    return value


def parse_precision(name: str, raw: str) -> Optional[str]:
    """One of FP32_PRECISIONS (case and spaces forgiven), or None for an empty value."""
    choice = raw.strip().lower()
    if not choice:
        return None
    if choice not in FP32_PRECISIONS:
        raise ValueError(f"{name} must be one of {FP32_PRECISIONS}, got {choice!r}")
    return choice


def _off_if_zero(raw: str) -> bool:
    return raw.strip() != "0"


def _on_if_set(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes")


@dataclasses.dataclass(frozen=True)
class Settings:
    tma: bool = True
    tma_stats: bool = True
    split_d: bool = True
    split_dkdv: bool = True
    fp32_pieces: bool = True
    fp32_precision: Optional[str] = None      # None: the default for this GPU and Triton
    autotune: bool = False
    direct_launch: bool = True
    plans: bool = True
    native: bool = True                       # the C++ autograd node for planned calls
    max_shared_memory: Optional[int] = None   # None: the GPU's own limit
    poison: bool = False
    gluon: bool = True                        # flashattn.hopper's Gluon kernels where they run


#: field -> (environment variable, parser of its raw text)
VARIABLES = {
    "tma": ("FLASHATTN_TMA", _off_if_zero),
    "tma_stats": ("FLASHATTN_TMA_STATS", _off_if_zero),
    "split_d": ("FLASHATTN_SPLIT_D", _off_if_zero),
    "split_dkdv": ("FLASHATTN_SPLIT_DKDV", _off_if_zero),
    "fp32_pieces": ("FLASHATTN_FP32_PIECES", _off_if_zero),
    "fp32_precision": ("FLASHATTN_FP32_PRECISION", lambda raw: parse_precision("FLASHATTN_FP32_PRECISION", raw)),
    "autotune": ("FLASHATTN_AUTOTUNE", _on_if_set),
    "direct_launch": ("FLASHATTN_DIRECT_LAUNCH", _off_if_zero),
    "plans": ("FLASHATTN_PLANS", _off_if_zero),
    "native": ("FLASHATTN_NATIVE", _off_if_zero),
    "max_shared_memory": ("FLASHATTN_MAX_SHARED_MEMORY",
                          lambda raw: parse_bytes("FLASHATTN_MAX_SHARED_MEMORY", raw)),
    "poison": ("FLASHATTN_POISON", lambda raw: raw.strip() == "1"),
    "gluon": ("FLASHATTN_GLUON", _off_if_zero),
}


def read(environ: Mapping[str, str] = os.environ) -> Settings:
    """The settings an environment asks for (unset variables keep the defaults)."""
    values = {field: parse(environ[name]) for field, (name, parse) in VARIABLES.items() if name in environ}
    return Settings(**values)


#: what the code reads: the environment at import, or an :func:`override` in force
current: Settings = read()


@contextlib.contextmanager
def override(**changes):
    """Inside this block the named settings take these values (``override(tma=False)``)."""
    global current
    before, current = current, dataclasses.replace(current, **changes)
    try:
        yield current
    finally:
        current = before


#: fields that choose how a call is made, not which kernels run or with what: two settings that
#: differ only in these launch the same kernels the same way (launch plans stay valid across them)
NOT_KERNELS = ("native",)


def same_kernels(a: Settings, b: Settings) -> bool:
    """Do ``a`` and ``b`` run the same kernels with the same arguments (every field but ``NOT_KERNELS``)?"""
    return a is b or dataclasses.replace(a, **{name: getattr(b, name) for name in NOT_KERNELS}) == b


def set_values(**changes) -> None:
    """Change settings for the rest of the process (``tuning.set_autotune``, ``launch.set_direct``)."""
    global current
    current = dataclasses.replace(current, **changes)
