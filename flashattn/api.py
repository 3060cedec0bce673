"""The public entry points: ``scaled_dot_product_attention`` (SDPA's signature, for models) and
``flash_attention`` (the lessons' signature). Both pick the kernels that run.

Two implementations pass the same correctness suite: the lesson kernels (``forward.py``,
``backward.py``), written to be read, and the tuned kernels of ``flashattn.fast``, written to be
fast. On a GPU the fast ones run (fp16, bf16, fp32; any head dim that is a multiple of 8 up to
256); in the CPU interpreter, the lesson ones. Either way the call goes through the PyTorch
operators of ``flashattn.ops``, so ``torch.compile``, CUDA graphs and autocast see one operator.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import beyond, ops, runtime


def _run(q, k, v, causal: bool, scale: float, impl: str, key=None) -> torch.Tensor:
    """Validated 4-D inputs -> O, in the inputs' dtype, through the operators. ``key``: the
    call's signature, kept (``_checked``) when the kernels take the inputs as they are."""
    kernel_dtype = runtime.compute_dtype(q.dtype, q.device)   # warns if bf16 must run in fp32
    impl = ops.pick_impl(impl, kernel_dtype, q.shape[-1])
    if kernel_dtype == q.dtype:     # (each .to() costs a microsecond of host time even when it copies nothing)
        if key is not None:
            if len(_checked) >= 1024:     # a model fed ever new shapes must not grow it unbounded
                _checked.clear()
            _checked[key] = (scale, impl)
        return ops.attention(q, k, v, causal, scale, impl)
    q_, k_, v_ = (t.to(kernel_dtype) for t in (q, k, v))
    return ops.attention(q_, k_, v_, causal, scale, impl).to(q.dtype)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    causal: bool = False, scale: Optional[float] = None,
                    impl: str = "auto") -> torch.Tensor:
    """Attention like ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``.

    q ``[B, H, S_q, D]``; k, v ``[B, H_kv, S_k, D]`` with ``H % H_kv == 0`` (GQA/MQA);
    ``causal``: query i sees keys j <= i; ``scale`` defaults to 1/sqrt(D). Any strides.
    Gradients flow to whichever of q, k, v require them.

    ``impl``: ``"teaching"`` runs the lesson kernels of ``forward.py`` / ``backward.py``;
    ``"fast"`` the tuned ones of ``flashattn.fast``; ``"auto"`` (default) the fast ones on a
    GPU, the lesson ones in the CPU interpreter.

    bf16 where it cannot be multiplied (the CPU interpreter, GPUs before sm 8.0) runs in fp32
    and is cast back, with a :class:`~flashattn.runtime.BF16FallbackWarning`. Under
    ``torch.autocast`` the inputs are cast to the autocast dtype, as SDPA's are.
    """
    q, k, v = runtime.autocast_inputs(q, k, v)
    key = _signature(q, k, v, causal, scale, impl)
    try:
        known = _checked.get(key) if key is not None else None
    except TypeError:                  # an unhashable argument: validation says what is wrong with it
        key = known = None
    if known is not None:              # inputs like these passed validation before
        return ops.attention(q, k, v, causal, *known)
    runtime.validate_qkv(q, k, v, allow_bf16_fallback=True)
    causal = runtime.validate_causal(causal)
    scale_value = runtime.validate_scale(scale, q.shape[-1])
    return _run(q, k, v, causal, scale_value, impl, key)


def flash_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                         scale: Optional[float] = None, backward: str = "auto") -> torch.Tensor:
    """``flash_attention(..., impl="fast")`` with the backward named: the tuned kernels only
    (ValueError where they do not apply). ``backward``: "auto" (two kernels; the fused one for
    fp32), "two-kernel", or "fused" (one dK/dV kernel that also adds dQ with atomics: there to
    compare with, and refused under ``torch.use_deterministic_algorithms``). One autograd node for
    both entry points: ``ops``'."""
    runtime.validate_qkv(q, k, v)
    causal = runtime.validate_causal(causal)
    scale = runtime.validate_scale(scale, q.shape[-1])
    ok, why = ops.supports(q.dtype, q.shape[-1])
    if not ok:
        raise ValueError(why)
    if backward not in ops.FAST_BACKWARDS:
        raise ValueError(f"backward must be one of {', '.join(map(repr, ops.FAST_BACKWARDS))}, got {backward!r}")
    if backward == "fused" and torch.are_deterministic_algorithms_enabled():
        raise RuntimeError("backward='fused' adds dQ with atomics, in a different order every run; "
                           "torch.use_deterministic_algorithms(True) is on: use backward='two-kernel'")
    return ops.attention(q, k, v, causal, scale, ops.FAST_BACKWARDS[backward])


#: Validation and the choice of kernels depend only on what ``_signature`` holds, so a training
#: loop pays for them once per kind of call, not at every call (~25 us of host time each).
#: Signature -> (scale, kernels to run); calls that warn (the bf16 fallback) are never kept.
_checked: dict = {}


def _signature(q, k, v, causal, scale, impl):
    """What validation and dispatch read of a call, or None for inputs that are not plain
    tensors (subclasses, fakes while tracing: those are validated every time). The types of
    ``causal`` and ``scale`` are part of it, so that 1 is not taken for True."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            type(causal), causal, type(scale), scale, impl)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention``: the same parameters,
    in the same order, with the same meaning.

    query ``[..., H, L, E]``, key and value ``[..., H_kv, S, E]`` (any leading dimensions, the
    same for all three; any strides). ``is_causal``: query i sees keys j <= i (top-left aligned,
    as SDPA's). ``scale`` defaults to 1/sqrt(E). ``enable_gqa=True`` lets H be a multiple of
    H_kv (grouped-query attention); without it the head counts must match, as in SDPA.
    Under ``torch.autocast`` the inputs are cast to the autocast dtype, as SDPA's are.

    ``dropout_p > 0`` runs through lesson 09's entry point (``flashattn.beyond``; the fast kernels
    on a GPU): the dropout mask is drawn from torch's generator and regenerated in the backward,
    never stored. Under ``torch.compile`` it runs as the operators of ``flashattn.beyond.ops``, the
    seed drawn inside the graph (no graph break; a new mask each step). Pass ``dropout_p=0.0``
    outside training, as with SDPA.

    Not supported yet, with a ``NotImplementedError`` that says so: ``attn_mask`` (arbitrary
    masks), a value head dim unlike the query's.
    """
    shapes = (query.shape, key.shape, value.shape, enable_gqa) if attn_mask is None and \
        type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor else None
    try:
        checked = shapes is not None and shapes in _sdpa_checked
    except TypeError:                  # an unhashable enable_gqa (an array): checked every call
        shapes, checked = None, False
    if not checked:
        _check_sdpa(query, key, value, attn_mask, enable_gqa)
        if shapes is not None:
            if len(_sdpa_checked) >= 1024:
                _sdpa_checked.clear()
            _sdpa_checked.add(shapes)
    if dropout_p == 0.0 and query.dim() == 4:       # what a model calls: straight through
        return flash_attention(query, key, value, causal=is_causal, scale=scale)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    lead = query.shape[:-3]

    def four_d(t):  # [..., H, L, E] -> [B, H, L, E]
        if t.dim() == 2:
            return t[None, None]
        if t.dim() == 3:
            return t[None]
        return t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:])

    if dropout_p != 0.0:     # lesson 09's kernels: the mask regenerated in the backward, never stored
        out = beyond.flash_attention(four_d(query), four_d(key), four_d(value), causal=is_causal, scale=scale,
                                     dropout_p=dropout_p)
    else:
        out = flash_attention(four_d(query), four_d(key), four_d(value), causal=is_causal, scale=scale)
    if query.dim() == 4:
        return out
    return out.reshape(*lead, *query.shape[-3:]) if query.dim() > 4 else out.reshape(query.shape)


#: (query, key, value shapes, enable_gqa) of plain-tensor calls whose arguments passed ``_check_sdpa``
#: (it reads nothing else): a training loop checks them once per kind of call
_sdpa_checked: set = set()


def _check_sdpa(query, key, value, attn_mask, enable_gqa) -> None:
    """The drop-in's own checks (shapes, heads, what is not supported), with SDPA's meaning."""
    if attn_mask is not None:
        raise NotImplementedError("flashattn.scaled_dot_product_attention does not take attn_mask yet "
                                  "(only is_causal); use torch's SDPA for arbitrary masks")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dimensions [..., L, E], got shape {tuple(t.shape)}")
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"a value head dim ({value.shape[-1]}) unlike the query's "
                                  f"({query.shape[-1]}) is not supported yet")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key, value must have the same number of dimensions, got "
                         f"{query.dim()}, {key.dim()}, {value.dim()}")
    if query.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"query has {query.shape[-3]} heads and key {key.shape[-3]}: pass "
                         "enable_gqa=True for grouped-query attention (as SDPA requires)")
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"the leading dimensions must match: query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}")
