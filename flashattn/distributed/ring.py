"""Ring attention: one sequence spread over the ranks of a process group, K and V passed around.

Each rank holds a shard of Q, K and V (``layout.py`` says which tokens). W steps: at step t rank
r holds the K/V block of rank s = r - t (mod W), computes its queries against it with the
package's forward kernel, and meanwhile sends that block on to rank r + 1 and receives the next
one from rank r - 1 (``torch.distributed.batch_isend_irecv``: the transfer overlaps the kernel).

**Forward.** Every block gives a partial result: the output of softmax over *its* keys, O_b, and
the log-sum-exp of its scores, LSE_b (lesson 02). Two partial results merge exactly::

    LSE = log(e^LSE_1 + e^LSE_2)        = max + log1p(exp(min - max))
    O   = O_1 e^(LSE_1 - LSE) + O_2 e^(LSE_2 - LSE)
        = O_1 sigmoid(LSE_1 - LSE_2) + O_2 sigmoid(LSE_2 - LSE_1)

(each weight is a block's share of the row's total exp-sum). Neither form exponentiates a
positive number, so nothing overflows however far apart the LSEs are. The merge runs in fp32.

**Backward.** With the *global* O and LSE of its rows, a rank rebuilds P = exp(S - LSE) of any
block exactly, and delta = rowsum(dO * O) needs only its own rows of dO and O: no communication.
Then every visiting K/V block's share is lesson 03's dQ kernel and lesson 04's dK/dV kernel: dQ
adds up here, and dK, dV (in fp32) travel on around the ring with their K/V block, collecting
every rank's share, until a last pass brings them home to their owner.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import runtime
from ..ops import pick_impl
from ..fast.autograd import wants_gradient
from ..backward import attention_backward_delta, attention_backward_dkdv, attention_backward_dq
from ..fast.backward import fast_attention_backward
from ..fast.forward import fast_attention_forward
from ..forward import attention_forward
from . import checks
from .layout import DIAGONAL, EARLY_KEYS, LATE_QUERIES, NOTHING, block_plan

# --------------------------------------------------------------------------------------
# the ring: who sends to whom
# --------------------------------------------------------------------------------------
class Ring:
    """This rank's place in the ring of ``group``: it sends to rank + 1 and receives from rank - 1."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # P2POp takes global ranks
        self.send_to = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.recv_from = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def pass_on(self, tensors):
        """Start sending each tensor to the next rank and receiving the previous rank's into new
        buffers. Returns (buffers, requests): wait on the requests before reading the buffers, and
        do not write the sent tensors until then."""
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, buf in zip(tensors, received):
            ops.append(dist.P2POp(dist.isend, t, self.send_to, self.group))
            ops.append(dist.P2POp(dist.irecv, buf, self.recv_from, self.group))
        return received, dist.batch_isend_irecv(ops)


def wait(requests) -> None:
    for request in requests or ():
        request.wait()


# --------------------------------------------------------------------------------------
# one block: the package's kernels (the fast ones on a GPU, the lesson's in the interpreter)
# --------------------------------------------------------------------------------------
def pick_kernels(impl: str, dtype: torch.dtype, head_dim: int) -> str:
    """"fast" or "teaching": the choice ``flash_attention`` and lesson 09 make (``ops.pick_impl``)."""
    return pick_impl(impl, dtype, head_dim)


def block_forward(q, k, v, causal: bool, scale: float, kernels: str):
    """(O, LSE) of q's rows against one block of keys: O in q's dtype, LSE in fp32."""
    if kernels == "fast":
        return fast_attention_forward(q, k, v, causal, scale)
    return attention_forward(q, k, v, causal, scale)


def block_backward(q, k, v, o, do, lse, delta, causal: bool, scale: float, kernels: str):
    """(dQ, dK, dV) of one block, given the *global* O, LSE and delta of q's rows."""
    if kernels == "fast":
        # the fast path computes delta = rowsum(dO * O) itself, from the same (global) O and dO
        return fast_attention_backward(q, k, v, o, do, lse, causal, scale)
    dq = attention_backward_dq(q, k, v, do, lse, delta, causal, scale)
    dk, dv = attention_backward_dkdv(q, k, v, do, lse, delta, causal, scale)
    return dq, dk, dv


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's partial result (``block_out``, ``block_lse``) into the running one (``out``,
    ``lse``, fp32), in place; the safe forms of the module's docstring."""
    d = lse - block_lse                                    # LSE_1 - LSE_2
    out.mul_(torch.sigmoid(d).unsqueeze(-1)).addcmul_(block_out, torch.sigmoid(-d).unsqueeze(-1))
    lse.copy_(torch.maximum(lse, block_lse) + torch.log1p(torch.exp(-d.abs())))   # min - max = -|d|


def _parts(plan: str, half: int):
    """(rows of the queries, keys of the block) a plan computes, as slices of the S axis."""
    every = slice(None)
    if plan == LATE_QUERIES:
        return slice(half, None), every
    if plan == EARLY_KEYS:
        return every, slice(0, half)
    return every, every


# --------------------------------------------------------------------------------------
# the forward and backward passes around the ring
# --------------------------------------------------------------------------------------
def ring_forward(ring: Ring, q, k, v, causal: bool, scale: float, layout: str, kernels: str, *,
                 communicate: bool = True, compute: bool = True):
    """This rank's O (q's dtype) and LSE ([B, H, S_local], fp32; fp64 for fp64 inputs). ``communicate=False`` (every
    step uses this rank's own K/V) and ``compute=False`` (the transfers alone) exist to measure
    how much the two overlap (``flashattn.distributed.bench``); the result is then meaningless."""
    W, r, half = ring.world, ring.rank, q.shape[2] // 2
    acc = runtime.stats_dtype(q.dtype)                     # fp32 (fp64 for fp64 inputs)
    out = lse = None
    for step in range(W):
        source = (r - step) % W                             # whose K/V block is here now
        passing = communicate and step + 1 < W
        if passing:                                         # send it on while we work on it
            (k_next, v_next), requests = ring.pass_on([k, v])
        plan = block_plan(r, source, W, layout, causal)
        if compute and plan != NOTHING:
            rows, keys = _parts(plan, half)
            o_b, lse_b = block_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], plan == DIAGONAL, scale,
                                       kernels)
            if out is None:                                 # step 0 covers every row: nothing to merge yet
                out, lse = o_b.to(acc), lse_b.to(acc)
            else:
                merge_(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
        if passing:
            wait(requests)
            k, v = k_next, v_next
    if out is None:                                         # compute=False
        out, lse = torch.zeros(q.shape, dtype=acc, device=q.device), torch.zeros(q.shape[:3], dtype=acc, device=q.device)
    return out.to(q.dtype), lse


def ring_backward(ring: Ring, do, q, k, v, out, lse, causal: bool, scale: float, layout: str, kernels: str, *,
                  communicate: bool = True, compute: bool = True):
    """(dQ, dK, dV) of this rank's shards. The schedule of the forward, plus dK/dV's trip: at
    step t the dK/dV of the block held here (fp32) is received from rank r - 1, this rank's
    share is added, and it goes on to rank r + 1 with the block; after W steps one more pass
    brings each rank its own. ``communicate`` / ``compute`` as in :func:`ring_forward`."""
    W, r, half = ring.world, ring.rank, q.shape[2] // 2
    # delta = rowsum(dO * O): one number per query row, from this rank's rows alone
    delta = attention_backward_delta(out, do) if kernels == "teaching" and compute else None
    acc = runtime.stats_dtype(q.dtype)                     # fp32 (fp64 for fp64 inputs)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_in = dv_in = dkv_requests = None                 # dK/dV arriving from rank r - 1
    for step in range(W):
        source = (r - step) % W
        passing = communicate and step + 1 < W
        if passing:
            (k_next, v_next), kv_requests = ring.pass_on([k, v])
        plan = block_plan(r, source, W, layout, causal)
        shares = None
        if compute and plan != NOTHING:
            rows, keys = _parts(plan, half)
            shares = block_backward(q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], do[:, :, rows],
                                    lse[:, :, rows], None if delta is None else delta[:, :, rows],
                                    plan == DIAGONAL, scale, kernels)
            dq[:, :, rows] += shares[0]
        if step == 0:                                       # our own block: its dK/dV start here
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        elif communicate:                                   # the block's dK/dV so far, from rank r - 1
            wait(dkv_requests)
            dk, dv = dk_in, dv_in
        if shares is not None:
            dk[:, :, keys] += shares[1]
            dv[:, :, keys] += shares[2]
        if passing:
            wait(kv_requests)
            k, v = k_next, v_next
        if communicate and W > 1:                           # dK/dV follow their block (the last pass: home)
            (dk_in, dv_in), dkv_requests = ring.pass_on([dk, dv])
    if communicate and W > 1:
        wait(dkv_requests)
        dk, dv = dk_in, dv_in
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention in autograd. Every rank of the group must run the backward too (as with
    any collective): give every rank's output a gradient."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, causal: bool, scale: float, layout: str, kernels: str):
        out, lse = ring_forward(ring, q, k, v, causal, scale, layout, kernels)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.layout, ctx.kernels = ring, causal, scale, layout, kernels
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        # one copy if autograd handed a broadcast (out.sum().backward(): every stride 0)
        do = do.contiguous()
        dq, dk, dv = ring_backward(ctx.ring, do, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.layout, ctx.kernels)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                   is_causal: bool = False, scale: Optional[float] = None, layout: str = "zigzag", *,
                   impl: str = "auto") -> torch.Tensor:
    """Attention over one sequence whose tokens are spread over the ranks of ``group``.

    q ``[B, H, S_local, D]``, k and v ``[B, H_kv, S_local, D]`` (``H % H_kv == 0``: GQA): this
    rank's shard of the sequence, laid out by ``layout`` (``"zigzag"``: chunks r and 2W-1-r of
    2W, which balances causal work; ``"contiguous"``: the r-th of W slices; cut a whole tensor
    with :func:`flashattn.distributed.shard`). Every rank of ``group`` (default: the default
    process group) calls this with shards of the same shape. Returns this rank's shard of
    ``softmax(Q K^T * scale) V`` over the *whole* sequence (``is_causal``: query i sees keys
    j <= i, by global position), in q's dtype; differentiable in q, k, v (every rank must then
    run the backward).

    fp16, bf16 (computed in fp32 where bf16 cannot be multiplied, with a BF16FallbackWarning),
    fp32. ``impl``: the kernels each block runs: "auto" (the fast ones on a GPU, the lesson's in
    the CPU interpreter), "fast" or "teaching". NCCL moves CUDA tensors, gloo CPU tensors.

    Raises ValueError / TypeError naming what was expected and what came: no initialized
    process group, a group this process is not in or whose backend cannot carry these tensors,
    inputs on different devices, shards of unequal lengths across ranks (checked by one small
    all-gather per call), an odd shard length for zigzag.
    """
    group = checks.process_group(group)

    def kernels_here():
        kernel_dtype = runtime.compute_dtype(q.dtype, q.device)  # warns if bf16 must run in fp32
        return kernel_dtype, pick_kernels(impl, kernel_dtype, q.shape[-1])

    causal, scale, (kernel_dtype, kernels) = checks.validate_shards(q, k, v, group, is_causal, scale, layout,
                                                                     also=kernels_here)
    ring = Ring(group)
    q_, k_, v_ = (t.to(kernel_dtype) for t in (q, k, v))
    k_, v_ = k_.contiguous(), v_.contiguous()                   # what is sent must be dense
    if wants_gradient(q_, k_, v_):
        out = RingAttentionFunction.apply(q_, k_, v_, ring, causal, scale, layout, kernels)
    else:
        out = ring_forward(ring, q_, k_, v_, causal, scale, layout, kernels)[0]
    return out.to(q.dtype)
