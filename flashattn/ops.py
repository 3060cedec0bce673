"""The kernels as PyTorch operators, so that PyTorch's machinery can see them.

``torch.library.custom_op`` registers two operators, ``flashattn::attention_forward`` and
``flashattn::attention_backward``, each with a *fake* implementation (what it returns, in shape
and dtype, without running: how ``torch.compile`` and ``torch.export`` trace through them) and
the forward with its autograd formula (the backward operator). What that buys:

* ``torch.compile(fullgraph=True)`` compiles a model that calls them with no graph break (the
  operators stay opaque: inductor calls them, and fuses everything around them);
* CUDA graphs capture them (nothing in them synchronises, and the tiles are fixed once warm);
* ``torch.library.opcheck`` checks the registrations.

Which kernels run is an argument of the operators (``impl``: "fast" or "teaching"), chosen by
``pick_impl`` from the inputs; a gradient nobody asked for is not computed (the operator
returns an empty tensor in its place, which autograd turns back into None).

Eager calls skip the operators and run the same two functions (or lesson 09's, for windows,
dropout and packed batches) through a plain ``torch.autograd.Function`` -- or, once a call of the
fast path has launch plans for both halves, through the C++ node that replays them
(``fast/native.py``; the same kernels, the same tensors saved): PyTorch wraps a custom
operator's body so that TorchDynamo stays out of it, and the first call of such a body imports
TorchDynamo (sympy and all: 1-2 s with Python's bytecode cached, 5 s without), a price an eager
training loop need not pay.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from . import runtime
from .backward import attention_backward
from .fast import fast_attention_backward, fast_attention_forward, native, supports
from .fast.autograd import contiguous_do, prepare_backward, wait_prepared, wants_gradient
from .forward import attention_forward

IMPLS = ("fast", "teaching")
IMPLEMENTATIONS = ("auto", *IMPLS)          # what a caller may ask for
#: ``flash_attention_fast``'s ``backward`` -> the operators' impl: the fast path with its backward named
FAST_BACKWARDS = {"auto": "fast", "two-kernel": "fast:two-kernel", "fused": "fast:fused"}
#: fast impl -> ``fast_attention_backward``'s ``fused`` (None: its default, two kernels but for fp32)
_FUSED = {"fast": None, "fast:two-kernel": False, "fast:fused": True}


def pick_impl(impl: str, dtype: torch.dtype, head_dim: int) -> str:
    """Which kernels run, "fast" or "teaching", for inputs the kernels see in ``dtype``: ``impl``
    itself, or for "auto" the fast ones on a GPU where they take the inputs. ValueError for an
    unknown impl, or "fast" where it does not apply. ``flashattn.api`` and ``flashattn.beyond``
    both ask here, so they cannot choose differently."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl == "teaching":
        return impl
    ok, why = supports(dtype, head_dim)
    if impl == "fast":
        if not ok:
            raise ValueError(why)
        return impl
    return "fast" if ok and not runtime.INTERPRET else "teaching"


def run_forward(q, k, v, causal: bool, scale: float, impl: str, prepare: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE) by the ``impl`` kernels; ``prepare``: a backward will follow (fast: its kernels
    are compiled in the background)."""
    if impl in _FUSED:
        o, lse = fast_attention_forward(q, k, v, causal, scale)
        if prepare and impl == "fast":       # (the default backward's kernels; a named one compiles when called)
            # The backward's kernels compile (and load) in background threads, once per kind of
            # input, while the caller computes its loss. Started before the forward's compile they
            # would overlap it more, but with a warm disk cache the threads' loads then slowed the
            # forward's own at random (a first call of 0.6-2.7 s against 0.55-0.64 s; H100).
            prepare_backward(q, k, v, o, lse, causal, scale)
        return o, lse
    return attention_forward(q, k, v, causal, scale)


def forward_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE) of attention; inputs validated and in a dtype the kernels take (``flashattn.api``)."""
    return run_forward(q, k, v, causal, scale, impl, prepare=True)


attention_forward_op = custom_op("flashattn::attention_forward", forward_kernels, mutates_args=())


@attention_forward_op.register_fake
def _(q, k, v, causal, scale, impl):
    B, H, S_q, D = q.shape
    return q.new_empty(B, H, S_q, D), q.new_empty(B, H, S_q, dtype=runtime.stats_dtype(q.dtype))


def backward_kernels(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, impl: str,
                          needs_dq: bool, needs_dkdv: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV); a gradient not asked for comes back as an empty tensor."""
    if impl in _FUSED:
        wait_prepared(q, k, causal)
        dq, dk, dv = fast_attention_backward(q, k, v, o, contiguous_do(do), lse, causal, scale,
                                             needs_dq=needs_dq, needs_dkdv=needs_dkdv, fused=_FUSED[impl])
    else:
        dq, dk, dv = attention_backward(q, k, v, o, do, lse, causal, scale,
                                        needs_dq=needs_dq, needs_dkdv=needs_dkdv)
    def given(t):     # a fresh empty tensor for each gradient not asked for (returns must not alias)
        return t if t is not None else q.new_empty(0)
    return given(dq), given(dk), given(dv)


attention_backward_op = custom_op("flashattn::attention_backward", backward_kernels, mutates_args=())


@attention_backward_op.register_fake
def _(do, q, k, v, o, lse, causal, scale, impl, needs_dq, needs_dkdv):
    return (q.new_empty(q.shape if needs_dq else (0,)), k.new_empty(k.shape if needs_dkdv else (0,)),
            v.new_empty(v.shape if needs_dkdv else (0,)))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, impl = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)       # O(S) per row: no S_q x S_k matrix
    ctx.causal, ctx.scale, ctx.impl = causal, scale, impl


def _gradients(ctx, do, backward, saved=None):
    """The six gradients autograd wants, from ``backward`` (the operator or its body); ``saved``:
    ``ctx.saved_tensors``, if the caller has unpacked them already."""
    q, k, v, o, lse = ctx.saved_tensors if saved is None else saved
    needs_q, needs_k, needs_v = ctx.needs_input_grad[:3]
    dq, dk, dv = backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.impl, needs_q, needs_k or needs_v)
    return (dq if needs_q else None, dk if needs_k else None, dv if needs_v else None,
            None, None, None)


def _backward(ctx, do, dlse):
    return _gradients(ctx, do, attention_backward_op)


attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """The operators' bodies for eager calls (see the module's docstring): the Python autograd node
    of softmax attention on one device (the C++ one of ``fast/native.py`` replays its plans; lesson 05's ``FlashAttentionFunction``, which the lesson
    prints, aside; lazy attention and the ring are other operations, with nodes of their own).
    ``kernels``, when given, is lesson 09's pair of calls (windows, dropout, packed batches:
    ``flashattn.beyond.attention.Lesson09Kernels``), run in place of the plain ones; what the
    node saves and which gradients it returns are the same."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, impl: str, kernels=None):
        if kernels is None:
            o, lse = forward_kernels(q, k, v, causal, scale, impl)
        else:
            o, lse = kernels.forward(q, k, v, causal, scale, impl)
        _setup_context(ctx, (q, k, v, causal, scale, impl), (o, lse))
        ctx.kernels = kernels
        return o

    @staticmethod
    def backward(ctx, do):
        saved = ctx.saved_tensors     # unpacked once: non-reentrant checkpointing allows no second unpack
        offered = ctx.impl == "fast" and ctx.kernels is None and native.ready()
        if offered:
            do = contiguous_do(do)    # (what backward_kernels would make of it; it is then left as it is)
        backward = backward_kernels if ctx.kernels is None else ctx.kernels.backward
        grads = _gradients(ctx, do, backward, saved)
        if offered:
            # the Python path has now run (and planned) both halves: from the next call of this
            # signature on, the C++ node replays them (``fast/native.py``)
            q, k, v, o, lse = saved
            needs_q, needs_k, needs_v = ctx.needs_input_grad[:3]
            native.offer(q, k, v, o, do, lse, ctx.causal, ctx.scale, needs_q, needs_k or needs_v)
        return (*grads, None)


#: tensor types of eager calls; anything else (FakeTensor, FunctionalTensor: tracing) takes the operators
_EAGER_TYPES = (torch.Tensor, torch.nn.Parameter)


def traced(*tensors) -> bool:
    """Is this call being compiled or traced (fake or functional tensors), not run eagerly?"""
    return torch.compiler.is_compiling() or any(type(t) not in _EAGER_TYPES for t in tensors)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
              impl: str) -> torch.Tensor:
    """O of attention (differentiable): through the operators when traced or compiled. An eager
    call that no gradient will flow through (inference, ``torch.no_grad``) runs the forward
    kernel alone: no autograd node, no backward prepared (each costs host time per call)."""
    if traced(q, k, v):
        return attention_forward_op(q, k, v, causal, scale, impl)[0]
    if not wants_gradient(q, k, v):
        return run_forward(q, k, v, causal, scale, impl, prepare=False)[0]
    if impl == "fast" and not torch.jit.is_tracing():   # (a trace would record the node's allocations only)
        o = native.attention(q, k, v, causal, scale)    # the C++ node, where a plan is kept for this call
        if o is not None:
            return o
    return EagerAttention.apply(q, k, v, causal, scale, impl)
