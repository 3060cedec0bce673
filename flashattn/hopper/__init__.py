"""flashattn.hopper: FlashAttention-3's forward for Hopper GPUs, in Gluon (issue 44, first step).

``attention_forward(q, k, v, causal, scale) -> (o, lse)`` has the conventions of
``flashattn.fast.forward.fast_attention_forward`` (O like q; LSE natural log, fp32, [B, H, S_q]),
so that it can stand in as the fast path's forward. ``supports(q, k, v, causal, scale)`` says
whether it may run, and why not: it runs only

* where ``available()``: Triton's Gluon is the API the kernels were written for (checked once, at
  import: ``gluon_api``), not the interpreter, ``FLASHATTN_GLUON=0`` not set, and the tensors'
  GPU has compute capability 9.0 (Hopper: wgmma, setmaxnreg and the copy engine as used here);
* on fp16/bf16 [B, H, S, D] tensors, D = 64 or 128, H a multiple of K and V's heads (GQA), a
  positive finite scale;
* where the copy engine's rules hold: unit last stride, every other stride (of a dim longer than 1)
  a positive multiple of 16 bytes, every base address 16-byte aligned.

Anything else belongs to the ``tl`` fast path. ``fast.fast_attention_forward`` runs it for a plain
fp16/bf16 call where ``preferred`` names a variant (where it measured faster) and ``supports``
agrees. The backward is the ``tl`` one, on this forward's O and LSE, except where
``BACKWARD_PREFERRED`` names a Gluon variant (D 64 causal from 4k keys: ``fast_attention_backward``
asks ``preferred_backward``). The kernel is in ``forward.py``; ``offline.py`` compiles it for sm_90
without a GPU and prints its registers, spills and shared memory.
"""
from __future__ import annotations

import functools
import math

import torch

from .. import runtime, settings
from . import gluon_api
from .host import descriptor_strides, layout_problem

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
#: grid dimension 1 holds B * H (CUDA's limit for grid y)
MAX_BATCH_HEADS = 65535


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


def availability(device=None) -> tuple:
    """(True, "") where the Gluon kernels may run on ``device`` (default: the current CUDA
    device), else (False, why)."""
    if not settings.current.gluon:
        return False, "FLASHATTN_GLUON=0"
    if not gluon_api.ok():
        return False, f"Gluon API: {gluon_api.ERROR}"
    if runtime.INTERPRET:
        return False, "Triton's interpreter runs no Gluon kernels (TRITON_INTERPRET=1 or no GPU)"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return False, f"tensors on {device.type}, not a CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capability(index)
    if cap != (9, 0):
        return False, f"compute capability {cap[0]}.{cap[1]}, not 9.0 (Hopper)"
    return True, ""


def available(device=None) -> bool:
    return availability(device)[0]


def supports(q, k, v, causal=False, scale=None) -> tuple:
    """(True, "") if ``attention_forward`` may run these inputs, else (False, why)."""
    ok, why = availability(q.device if isinstance(q, torch.Tensor) else None)
    if not ok:
        return False, why
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False, "q, k, v must be tensors"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False, "q, k, v must be [B, H, S, D]"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False, f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: fp16 or bf16, all alike"
    if not (q.device == k.device == v.device):
        return False, "q, k, v on different devices"
    B, H, S_q, D = q.shape
    if tuple(k.shape) != tuple(v.shape) or k.shape[0] != B or k.shape[3] != D:
        return False, f"k {list(k.shape)} and v {list(v.shape)} must be [B, H_kv, S_k, D] with q's B and D"
    if D not in HEAD_DIMS:
        return False, f"head dim {D}: the Gluon forward has tiles for {HEAD_DIMS} only"
    H_kv, S_k = k.shape[1], k.shape[2]
    if H_kv == 0 or H % H_kv:
        return False, f"{H} query heads are not a multiple of {H_kv} K/V heads"
    if min(B, H, S_q, S_k) == 0:
        return False, "an empty dimension"
    if B * H > MAX_BATCH_HEADS:
        return False, f"B * H = {B * H} > {MAX_BATCH_HEADS} (the grid's second dimension)"
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        return False, f"scale {scale}: the kernel takes row maxima of raw scores, so it needs a positive scale"
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        problem = layout_problem(t, name)
        if problem:
            return False, problem
    return True, ""


#: Where the Gluon forward measured faster than the ``tl`` one, and with which variant (H200, torch
#: 2.11, triton 3.6, bf16, B*S = 16k, H*D = 2048, ``python -m flashattn.hopper.bench``,
#: ``results/gluon_forward_h200.json``): from 4k keys on, every shape (ws2 / pingpong at 1.06-1.26x
#: the ``tl`` forward's TFLOP/s), and D = 128 without the mask from 1k keys (1.26x); at 1k keys
#: otherwise the ``tl`` forward led (the Gluon one at 0.75-0.95x), so it keeps those.
MIN_KEYS = 4096


def preferred(q, k, causal: bool):
    """The Gluon variant to run for inputs of these shapes, or None where the ``tl`` forward
    measured faster. (``supports`` still decides whether it may run.)"""
    S_k, D = k.shape[2], q.shape[-1]
    if S_k >= MIN_KEYS or (D == 128 and not causal and S_k >= 1024):
        return "pingpong" if causal else "ws2"      # the faster of the two in that run, per mask
    return None


#: Where the Gluon backward measured as fast as the ``tl`` one or faster: (head dim, causal) -> (fewest
#: keys, variant of ``backward.VARIANTS``). On the H200 (``results/gluon_backward_h200.txt``): D 64 with
#: the causal mask, "ws_tma" (a producer warp, the mask on diagonal and edge tiles only), on par at 4k
#: keys (0.997-1.02x over three runs) and 1.05-1.09x at 16k. Elsewhere ``tl`` stays: the best variant is
#: 0.98-1.03x at D 64 without the mask (within run-to-run spread) and 0.79-0.92x at D 128. Measured on
#: an H200 only; other sm_90 parts (H100, H20) take the same table.
BACKWARD_PREFERRED: dict = {(64, True): (4096, "ws_tma")}


def preferred_backward(q, k, causal: bool):
    """The Gluon backward variant to run for inputs of these shapes, or None where the ``tl``
    backward is faster, or where ``torch.use_deterministic_algorithms`` is on (the Gluon backward
    adds dQ with atomics). (``supports`` still decides whether it may run.)"""
    entry = BACKWARD_PREFERRED.get((q.shape[-1], bool(causal)))
    if entry is None or torch.are_deterministic_algorithms_enabled():
        return None
    fewest_keys, variant = entry
    return variant if k.shape[2] >= fewest_keys else None


class tl_backward_only:
    """``with hopper.tl_backward_only():`` the fast path's backward runs the ``tl`` kernels, whatever
    ``BACKWARD_PREFERRED`` says (a benchmark's baseline: the Gluon backward against the ``tl`` one)."""

    def __enter__(self):
        self._saved = dict(BACKWARD_PREFERRED)
        BACKWARD_PREFERRED.clear()

    def __exit__(self, *exc):
        BACKWARD_PREFERRED.update(self._saved)


def launch_backward(q, k, v, o, do, lse, causal: bool, scale: float, variant: str, delta=None):
    """dQ, dK, dV by ``variant`` of the Gluon backward (``backward.py``), inputs accepted by
    ``supports`` (the fast path's call). ``delta`` = rowsum(dO * O) where the caller has it."""
    from . import backward
    return backward.launch(q, k, v, o, do, lse, causal, scale, variant=variant, delta=delta)


def launch_forward(q, k, v, causal: bool, scale: float, variant: str):
    """O and LSE by ``variant``, inputs already accepted by ``supports`` (the fast path's call).
    The kernels' module is imported here, where Gluon is known to be the API it was written for:
    importing flashattn never depends on this Triton's Gluon."""
    from . import forward
    return forward.launch(q, k, v, causal, scale, variant=variant)


def attention_forward(q, k, v, causal: bool, scale: float, *, variant=None):
    """O and LSE by the Gluon kernel (``forward.py``); ValueError naming the reason where
    ``supports`` refuses (callers take the ``tl`` fast path instead). ``variant``: one of
    ``forward.VARIANTS`` ("ws", "ws2", "pingpong", "inline"), by default ``forward.DEFAULT_VARIANT``."""
    ok, why = supports(q, k, v, causal, scale)
    if not ok:
        raise ValueError(f"flashattn.hopper cannot run this: {why}")
    from . import forward
    return forward.launch(q, k, v, causal, scale, variant=variant or forward.DEFAULT_VARIANT)


__all__ = ["attention_forward", "launch_forward", "launch_backward", "preferred", "preferred_backward", "tl_backward_only",
           "supports", "available", "availability", "layout_problem", "descriptor_strides", "HEAD_DIMS", "DTYPES"]
