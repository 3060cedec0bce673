"""Lesson 09's dense entry point as PyTorch operators, so that ``torch.compile`` sees through a
model that calls ``flashattn.scaled_dot_product_attention(..., dropout_p > 0)`` or
``beyond.flash_attention`` with a window or dropout (``flashattn.ops`` does the same for plain
attention; its docstring says what registering buys).

``flashattn::beyond_forward`` and ``flashattn::beyond_backward`` take the dropout seed as a 0-d
int64 tensor on the CPU. A compiled call draws it inside the graph (``torch.randint``), so each
step gets a new mask without a graph break, and the operators read it with ``.item()``, which
on a CPU tensor waits for nothing. Under CUDA graphs (``mode="reduce-overhead"``) the part of
the graph that draws on the CPU is not captured, so replays keep drawing fresh masks. Packed
batches (``flash_attention_varlen``) stay eager.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from .. import runtime
from ..fast import fast_attention_backward, fast_attention_forward
from .kernels import Layout, beyond_backward, beyond_forward


def forward_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor, causal: bool,
                    window: list[int], scale: float, dropout_p: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE); ``window`` = [WINDOW, LEFT, RIGHT] as ``kernels.window_bounds`` gives them."""
    window_args, s = (bool(window[0]), window[1], window[2]), int(seed.item())
    if impl == "fast":
        return fast_attention_forward(q, k, v, causal, scale, layout=Layout(q, k), window_args=window_args,
                                      dropout_p=dropout_p, seed=s)
    return beyond_forward(q, k, v, Layout(q, k), scale, window_args, dropout_p, s)


forward_op = custom_op("flashattn::beyond_forward", forward_kernels, mutates_args=())


@forward_op.register_fake
def _(q, k, v, seed, causal, window, scale, dropout_p, impl):
    B, H, S_q, D = q.shape
    return q.new_empty(B, H, S_q, D), q.new_empty(B, H, S_q, dtype=runtime.stats_dtype(q.dtype))


def backward_kernels(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, seed: torch.Tensor, causal: bool, window: list[int], scale: float,
                     dropout_p: float, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV), the mask regenerated from the same seed."""
    window_args, s = (bool(window[0]), window[1], window[2]), int(seed.item())
    if impl == "fast":
        return fast_attention_backward(q, k, v, o, do, lse, causal, scale, layout=Layout(q, k),
                                       window_args=window_args, dropout_p=dropout_p, seed=s)
    return beyond_backward(q, k, v, o, do, lse, Layout(q, k), scale, window_args, dropout_p, s)


backward_op = custom_op("flashattn::beyond_backward", backward_kernels, mutates_args=())


@backward_op.register_fake
def _(do, q, k, v, o, lse, seed, causal, window, scale, dropout_p, impl):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, seed, causal, window, scale, dropout_p, impl = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], seed)
    ctx.args = (causal, window, scale, dropout_p, impl)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, seed = ctx.saved_tensors
    dq, dk, dv = backward_op(do, q, k, v, o, lse, seed, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


forward_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, seed, mask, scale: float, dropout_p: float, impl: str) -> torch.Tensor:
    """O through the operators; ``seed`` an int or None (drawn in the graph)."""
    seed_t = torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64) if seed is None else \
        torch.tensor(seed, dtype=torch.int64)
    causal, (windowed, left, right) = mask
    return forward_op(q, k, v, seed_t, causal, [int(windowed), left, right], scale, dropout_p, impl)[0]
