"""flashattn.distributed: ring attention (context parallelism) on ``torch.distributed``.

One sequence too long for one GPU is spread over the ranks of a process group (NCCL between
GPUs, gloo between CPU processes): each rank holds a shard of Q, K and V, the K/V shards travel
around the ring, and the partial results merge through the log-sum-exp (lesson 02). The
backward reuses the dQ and dK/dV kernels of lessons 03 and 04 with the global LSE and delta.
Lesson 11 (``notebooks/11_ring_attention.ipynb``) tells the story.

    layout    where each rank's tokens lie ("contiguous", "zigzag"), which part of a block a
              causal mask leaves; pure Python
    checks    input checks: local ones, then one small all-gather so that every rank raises
    ring      the ring: forward, backward, RingAttentionFunction, ring_attention
    shards    shard / unshard: a whole tensor to this rank's shard and back
    simulate  the ring in one process (shards as lists): exercise 11 and its checker
    workers   spawn processes with a process group each (tests, the notebook) and the checks
              they run against single-process attention
    selftest  python -m flashattn.distributed.selftest: NCCL on 2 and 4 GPUs against one GPU
    bench     python -m flashattn.distributed.bench: 1, 2, 4 GPUs next to PyTorch's context_parallel
"""
from .layout import LAYOUTS, block_plan, positions, work_per_rank
from .ring import RingAttentionFunction, merge_, ring_attention
from .shards import shard, unshard

__all__ = ["ring_attention", "RingAttentionFunction", "shard", "unshard", "merge_", "LAYOUTS", "block_plan",
           "positions", "work_per_rank"]
