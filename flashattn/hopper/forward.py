"""FlashAttention-3's forward for Hopper (sm_90), written in Gluon: the copy engine, mbarriers and
asynchronous warpgroup products by hand, where ``flashattn/fast/forward.py`` leaves them to Triton.

Same math as ``flashattn/forward.py`` (online softmax; O = acc / l, LSE = m + ln l, natural log,
fp32) and the same conventions as ``fast_attention_forward``, whose LSE the backward kernels read.
What is different is who waits for whom:

* **A ring of K and V slots.** ``STAGES`` shared-memory slots for K and as many for V, each with a
  "ready" mbarrier (the copy engine completes it when the tile's bytes have landed) and an "empty"
  one (the consumer arrives when no product reads the slot any more). Tile j lives in slot
  j % STAGES; its barriers are in their (j // STAGES)-th phase, so the parity waited on is
  (j // STAGES) & 1 (the producer waits for "empty" with the other parity: a fresh barrier counts
  as having completed the phase before its first, so the first STAGES loads go out at once).
* **The copy engine (TMA) fetches every tile** by 4-D descriptors over [B, H, S, D] with the
  tensors' own strides: no address per element, and rows past S_q or S_k arrive as zeros (a
  descriptor per head would be needed otherwise: the next head's rows are not zeros). The output
  leaves the same way, through Q's slot (Q is dead by then); the copy engine drops rows past S_q.
* **The softmax of tile j under the products of tile j - 1.** Both products are asynchronous
  (``warpgroup_mma(..., is_async=True)``). Each step issues S_j = Q K_j^T, then
  acc += P_{j-1} V_{j-1}, waits for S_j alone (``num_outstanding=1``: the PV product keeps the
  tensor cores busy), computes P_j's exponentials, and only then waits for the PV product and
  rescales acc by alpha_j = exp2(m_{j-1} - m_j). In log2 units with the scale folded in:
  m_j = max(m_{j-1}, rowmax(S_j) * scale * log2 e), P_j = exp2(S_j * scale * log2 e - m_j),
  l_j = l_{j-1} alpha_j + rowsum(P_j).
* **A producer warp** (``WARP_SPECIALIZE``): ``gl.warp_specialize`` gives the loads to one warp
  running on 24 registers (``setmaxnreg``), so the two consumer warpgroups (64 query rows each, as
  FA3's) get 240 and never stop to issue a copy. ``VARIANTS``: "ws", the two warpgroups as one
  partition of 8 warps (they arrive on a slot's "empty" barrier together, after a barrier of the
  partition: in step); "ws2", each warpgroup a partition of its own, its own Q rows and O store,
  each arriving on "empty" (count 2): nothing keeps them in step, so one's softmax can run under the
  other's products; "pingpong", as ws2 with FA3's explicit ordering (each step's products are issued
  by one warpgroup, then the other, through a pair of "turn" mbarriers); "inline", no producer: the
  consumers issue the loads themselves, STAGES - 2 tiles ahead of need (none at D = 128), per CTA barrier.
* Masks only where needed: a tile is masked (keys past S_k; causal: keys past the row) only when
  its last key is past ``free_end``; tiles above the causal diagonal are never loaded. Causal query
  blocks run longest first (program 0 takes the last block).

The host side here (``launch_args``, ``launch``) builds the descriptors and launches;
``flashattn.hopper.supports`` says when the copy engine's rules hold (unit last stride, 16-byte
aligned strides and base) and ``flashattn.hopper.attention_forward`` is the entry point.
"""
from __future__ import annotations

import torch

from . import gluon_api
from .host import descriptor_strides

gluon, gl = gluon_api.gluon, gluon_api.gl
mbarrier, tma = gluon_api.mbarrier, gluon_api.tma
warpgroup_mma, warpgroup_mma_wait = gluon_api.warpgroup_mma, gluon_api.warpgroup_mma_wait
fence_async_shared = gluon_api.fence_async_shared

LOG2E = 1.4426950408889634

#: (head dim) -> (BLOCK_M, BLOCK_N, STAGES): 128 query rows (two warpgroups of 64) by 128 keys;
#: shared memory at D = 128: Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB; D = 64: 16 + 3 x 32 = 112 KB.
TILES = {64: (128, 128, 3), 128: (128, 128, 2)}
NUM_WARPS = 8           # the consumer warpgroups (default partition)
PRODUCER_REGS = 24      # setmaxnreg of the producer warp: it only issues copies
CONSUMER_REGS = 240     # setmaxnreg of the second consumer partition (CONSUMERS=2)

#: variant -> (WARP_SPECIALIZE, CONSUMERS, PINGPONG, num_warps of the kernel's default partition):
#: "ws" one consumer partition of two warpgroups + the producer warp; "ws2" two consumer
#: partitions of one warpgroup each (nothing keeps them in step: one's softmax can run under the
#: other's products) + the producer warp; "pingpong" as ws2, the two issuing their products in
#: turn (FA3's ping-pong); "inline" no producer, the consumers issue the copies.
VARIANTS = {"ws": (True, 1, False, 8), "ws2": (True, 2, False, 4), "pingpong": (True, 2, True, 4),
            "inline": (False, 1, False, 8)}
DEFAULT_VARIANT = "ws"


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, h_kv, j):
    """Tile j of K and V into slot j % STAGES, once the consumers have emptied it."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    slot = j % STAGES
    parity = ((j // STAGES) & 1) ^ 1
    mbarrier.wait(k_empty.index(slot), parity)
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, h_kv, j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
    mbarrier.wait(v_empty.index(slot), parity)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [b, h_kv, j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _load_q(q_desc, q_smem, q_bar, b, h, start_m):
    """The block's query rows, one box per consumer (``q_smem.index(c)``), on one barrier."""
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    rows: gl.constexpr = q_desc.block_type.shape[2]
    mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m + c * rows, 0], q_bar, q_smem.index(c))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              b, h, h_kv, start_m, n_tiles):
    """The producer warp: Q once, then every K and V tile of this block as slots free up. (A worker
    partition's arguments arrive as tensors, constexprs too: tile sizes are read off the types.)"""
    _load_q(q_desc, q_smem, q_bar, b, h, start_m)
    for j in range(n_tiles):
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, h_kv, j)


@gluon.jit
def _softmax_step(s, m_i, l_i, start_n, offs_m, S_k, free_end, qk_scale,
                  CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One tile's online-softmax update: (P in fp32, m_j, l_j, alpha_j). The mask only on tiles
    that reach past ``free_end`` (keys past S_k, or causal keys some row of the block must not see)."""
    if start_n + BLOCK_N > free_end:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = offs_n[None, :] < S_k
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        s = gl.where(visible, s, float("-inf"))
    # Every row sees key 0 in tile 0 (causal: key 0 <= row), so m_j is finite from tile 0 on and
    # exp2(-inf - m_j) = 0 for masked keys; alpha_0 = exp2(-inf - m_0) = 0 multiplies zeros.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)      # scale > 0 (supports): max commutes
    p = gl.exp2(s * qk_scale - m_new[:, None])                 # one FMA and an exp2 per score
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _consumer(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
              v_empty, turn, pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale,
              CAUSAL: gl.constexpr, NUM_WARPS: gl.constexpr, LOADS: gl.constexpr, WG: gl.constexpr,
              PINGPONG: gl.constexpr):
    """A consumer: products, softmax, epilogue for ``ROWS`` query rows of the block, from row
    ``WG * ROWS`` on (all of it with one consumer partition of 8 warps; a half each with two
    partitions of one warpgroup, ``CONSUMERS=2``). ``LOADS``: also issue the copies (no producer
    warp), STAGES - 2 tiles ahead. ``PINGPONG`` (two consumers): each step's two products are issued
    in turn, first one warpgroup's, then the other's (``turn``: a barrier per warpgroup, arrived on
    by the other once it has issued its own), so that one's softmax runs under the other's products."""
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    STAGES: gl.constexpr = k_smem.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    if LOADS:
        _load_q(q_desc, q_smem, q_bar, b, h, start_m)
        for j in range(0, gl.minimum(n_tiles, STAGES - 1)):
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, h_kv, j)

    my_rows = q_smem.index(WG)            # [1, 1, ROWS, D]: this consumer's Q, later its O's staging
    q = my_rows.reshape([ROWS, HEAD_DIM])
    offs_m = start_m + WG * ROWS + gl.arange(0, ROWS, layout=row_s)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_init = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    # Tile 0 alone: its scores and softmax (nothing to overlap with yet).
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_init,
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, 0, offs_m, S_k, free_end, qk_scale, CAUSAL, BLOCK_N, s_layout)
    p = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_tiles):
        if LOADS:   # tile j + STAGES - 2 goes into the slot tile j - 2 left (every warp is past it)
            gl.thread_barrier()
            if j + STAGES - 2 < n_tiles:
                _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, h_kv,
                         j + STAGES - 2)
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (j - 1) & 1)
        s = warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_init,
                          use_acc=False, is_async=True)                                     # S_j = Q K_j^T
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)  # += P V
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))                              # S_j only
        mbarrier.arrive(k_empty.index(slot), count=1)
        p_next, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, j * BLOCK_N, offs_m, S_k, free_end, qk_scale,
                                                CAUSAL, BLOCK_N, s_layout)                 # under P V
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p = gl.convert_layout(p_next.to(dtype), p_layout)

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)

    # Epilogue: LSE = (m + log2 l) ln 2; O = acc / l through Q's slot and the copy engine.
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453          # ln 2 (a literal: kernels see no globals)
    gl.store(LSE + pid_bh.to(gl.int64) * S_q + offs_m, lse, mask=offs_m < S_q)
    o = acc / gl.convert_layout(l_i, row_o)[:, None]
    my_rows.reshape([ROWS, HEAD_DIM]).store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, start_m + WG * ROWS, 0], my_rows)
    tma.store_wait(0)


# A worker partition's arguments arrive as tensors (constexprs too), so the second consumer is a function
# of its own with its switches written in: (CAUSAL, NUM_WARPS, LOADS, WG, PINGPONG). The default
# partition (the first consumer) takes them as constexprs at the end of its argument tuple, written
# out in the call (a tuple of constexprs kept in a variable loses them).
@gluon.jit
def _second_causal(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem,
                   q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                   pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale):
    _consumer(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem,
              q_bar, k_ready, v_ready, k_empty, v_empty, turn,
              pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale,
              True, 4, False, 1, False)


@gluon.jit
def _second_full(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem,
                 q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                 pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale):
    _consumer(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem,
              q_bar, k_ready, v_ready, k_empty, v_empty, turn,
              pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale,
              False, 4, False, 1, False)


@gluon.jit
def _second_pingpong_causal(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem,
                            q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                            pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale):
    _consumer(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem,
              q_bar, k_ready, v_ready, k_empty, v_empty, turn,
              pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale,
              True, 4, False, 1, True)


@gluon.jit
def _second_pingpong_full(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem,
                          q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                          pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale):
    _consumer(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem,
              q_bar, k_ready, v_ready, k_empty, v_empty, turn,
              pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale,
              False, 4, False, 1, True)


@gluon.jit(do_not_specialize=["H", "GROUP_SIZE", "S_q", "S_k"])   # a new length compiles nothing
def hopper_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, H, GROUP_SIZE, S_q, S_k, qk_scale,
                      CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
                      CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, NUM_WARPS: gl.constexpr,
                      PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    num_m = (S_q + BLOCK_M - 1) // BLOCK_M
    pid_m = num_m - 1 - gl.program_id(0)     # longest (causal) blocks first
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP_SIZE                   # GQA: GROUP_SIZE query heads share a K/V head
    start_m = pid_m * BLOCK_M
    if CAUSAL:   # keys past the block's last row are never visited; the mask from the first row's key on
        kv_end = gl.minimum(start_m + BLOCK_M, S_k)
        free_end = gl.minimum(start_m + 1, S_k)
    else:
        kv_end = S_k
        free_end = S_k
    n_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    if PINGPONG:   # the first warpgroup's first turn
        mbarrier.arrive(turn.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)     # one arrive per consumer partition
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    common = (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
              v_empty, turn, pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale)
    producer_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     b, h, h_kv, start_m, n_tiles)
    if PINGPONG:         # two warpgroups, each its own partition (64 rows), issuing their products in turn
        if CAUSAL:
            gl.warp_specialize([(_consumer, common + (True, 4, False, 0, True)), (_second_pingpong_causal, common),
                                (_producer, producer_args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consumer, common + (False, 4, False, 0, True)), (_second_pingpong_full, common),
                                (_producer, producer_args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 2:   # two warpgroups, each its own partition (64 rows): nothing keeps them in step
        if CAUSAL:
            gl.warp_specialize([(_consumer, common + (True, 4, False, 0, False)), (_second_causal, common),
                                (_producer, producer_args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consumer, common + (False, 4, False, 0, False)), (_second_full, common),
                                (_producer, producer_args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif WARP_SPECIALIZE:
        if CAUSAL:
            gl.warp_specialize([(_consumer, common + (True, 8, False, 0, False)), (_producer, producer_args)],
                               [1], [PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consumer, common + (False, 8, False, 0, False)), (_producer, producer_args)],
                               [1], [PRODUCER_REGS])
    else:
        _consumer(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                  k_empty, v_empty, turn, pid_bh, b, h_kv, h, start_m, S_q, S_k, n_tiles, free_end, qk_scale,
                  CAUSAL, NUM_WARPS, True, 0, False)

    mbarrier.invalidate(q_bar)
    mbarrier.invalidate(turn.index(0))
    mbarrier.invalidate(turn.index(1))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))


# --------------------------------------------------------------------------------------
# host side: descriptors and the launch
# --------------------------------------------------------------------------------------
def gluon_dtype(dtype: torch.dtype):
    return {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]   # fp32: LSE, delta


def block_shapes(head_dim: int, consumers: int = 1) -> dict:
    """Descriptor boxes: Q's and O's rows of one consumer, K's and V's tiles."""
    BLOCK_M, BLOCK_N, _ = TILES[head_dim]
    return {"q": [1, 1, BLOCK_M // consumers, head_dim], "kv": [1, 1, BLOCK_N, head_dim],
            "o": [1, 1, BLOCK_M // consumers, head_dim]}


def make_descriptor(t: torch.Tensor, block_shape: list):
    """A 4-D descriptor over ``t`` ([B, H, S, D], any aligned strides): rows past S come as zeros,
    stores past S are dropped."""
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, gluon_dtype(t.dtype))
    return gluon_api.TensorDescriptor(t, list(t.shape), descriptor_strides(t), block_shape, layout)


def launch_args(q, k, v, causal: bool, scale: float, variant: str = DEFAULT_VARIANT):
    """(grid, arguments, options, o, lse) of one launch; ``o`` and ``lse`` fresh (poisoned or
    guarded where ``runtime`` says so)."""
    from .. import runtime

    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    BLOCK_M, BLOCK_N, STAGES = TILES[D]
    o = runtime.new_output((B, H, S_q, D), q.dtype, q.device)
    lse = runtime.new_output((B, H, S_q), torch.float32, q.device)
    warp_specialize, consumers, pingpong, num_warps = VARIANTS[variant]
    shapes = block_shapes(D, consumers)
    q_desc, o_desc = make_descriptor(q, shapes["q"]), make_descriptor(o, shapes["o"])
    k_desc, v_desc = make_descriptor(k, shapes["kv"]), make_descriptor(v, shapes["kv"])
    grid = (triton_cdiv(S_q, BLOCK_M), B * H)
    args = (q_desc, k_desc, v_desc, o_desc, lse, H, H // H_kv, S_q, S_k, scale * LOG2E)
    options = dict(CAUSAL=bool(causal), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D, STAGES=STAGES,
                   WARP_SPECIALIZE=warp_specialize, CONSUMERS=consumers, PINGPONG=pingpong, NUM_WARPS=num_warps,
                   PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS, num_warps=num_warps)
    return grid, args, options, o, lse


def launch(q, k, v, causal: bool, scale: float, *, variant: str = DEFAULT_VARIANT):
    """O and LSE (natural log, fp32, [B, H, S_q]) as ``fast_attention_forward`` returns them.
    Inputs checked by the caller (``flashattn.hopper.supports``)."""
    grid, args, options, o, lse = launch_args(q, k, v, causal, scale, variant)
    hopper_fwd_kernel[grid](*args, **options)
    return o, lse


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
