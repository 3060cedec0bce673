"""FlashAttention's backward for Hopper (sm_90) in Gluon (issue 44): one kernel per block of keys
that computes dK and dV in registers and adds its share of dQ into an fp32 buffer.

The fast path takes it where ``hopper.BACKWARD_PREFERRED`` names a variant: D 64 with the causal
mask from 4k keys ("ws_tma": on par with the ``tl`` backward at 4k keys, 1.05-1.09x at 16k). On an H200 (2026-11-29,
``results/gluon_backward_h200.txt``), bf16, B*S = 16k, H*D = 2048, S 4k/16k, the best variant is
0.98-1.03x the ``tl`` fast backward at D 64 without the mask, 0.79-0.92x at D 128, and 0.65-0.82x
cuDNN's throughout. Every variant is correct there:
``tests/test_hopper_backward_gpu.py`` (per-head errors against float64 and SDPA, dK and dV bit for
bit across runs). What limits it is in ``results/gluon_backward_profile_h200.md``.

Same math as ``flashattn/backward.py``'s dK/dV kernel, turned round as FlashAttention-3 does it: a
program holds BLOCK_N = 128 keys (two warpgroups of 64 rows, the M side of every product but dQ's) and walks
the query tiles (BLOCK_M = 64 rows, the N side), for each query head of its GQA group:

    S^T  = K Q^T                    [BLOCK_N, BLOCK_M]   (wgmma: K and Q from shared memory)
    P^T  = exp2(S^T * scale * log2 e - LSE * log2 e)     (masked: keys past S_k, rows past S_q, causal)
    dV  += P^T dO                   [BLOCK_N, D]         (P^T from registers)
    dP^T = V dO^T                   [BLOCK_N, BLOCK_M]
    dS^T = P^T (dP^T - delta)
    dK  += dS^T Q                   [BLOCK_N, D]         (dS^T from registers)
    dQ  += dS K * scale             [BLOCK_M, D]         (dS^T through shared memory, fp32 atomics)

Q and dO tiles come by the copy engine (TMA) into a ring of ``STAGES`` slots: issued by the consumers
themselves one tile ahead ("inline", as the forward's variant), or by a producer warp on 24 registers
that keeps the ring full while the consumers get 240 (``setmaxnreg``; "ws"). dQ's product runs in two
column halves, so that half its accumulator is in registers at a time: offline for sm_90, D 128
spilled 168-188 bytes with it whole and none (8 causal) in halves. What the H200 said to add:

- ``PREFETCH`` ("prefetch"): each tile's LSE and delta come by cp.async one tile ahead into shared
  memory, instead of global loads waited for in the tile: +15-29% at D 128, +23-46% at D 64.
- ``DQ_LAG`` ("prefetch_lag", D 64): each tile's whole dQ product is left running behind the next
  tile's S^T and dP^T, and added under the next tile's dV product: +0-4% more at D 64. At D 128 its
  carried accumulator spills (232-292 bytes), and it is slower.
- ``PREFETCH`` 2 ("tma"): LSE and delta by the copy engine, one box each of a flat vector (each
  head's rows padded to whole tiles) on the tile's own Q / dO barrier: as fast as "prefetch"
  (0.97-1.01x). With three slots (``STAGES`` 3, "tma3", "tma3_lag") the tile's first explicit CTA
  barrier goes, but not from the compiled code: Triton's barrier pass puts a ``bar.sync`` before
  every copy into shared memory that threads also read, and before the slot's wait, since it cannot
  tell the slots apart (offline PTX, D 64: 6 per tile against 7). 2-6% slower at D 128, where it
  spills 44-60 bytes; with the lag at D 64, +5-6% on the causal shapes and -1-2% on the others.
  A producer warp in a partition of its own would take those copies' barriers out of the
  consumers (the barrier pass works within a partition). Their GPU test crashed until each head's
  rows were padded to whole tiles (a copy must start on 16 bytes); it passes since.
- ``WARP_SPECIALIZE`` with ``PREFETCH`` 2 ("ws_tma", "ws_tma3"): the producer warp brings LSE and
  delta with Q and dO, so no copy is issued by the consumers and their loop keeps 4 ``bar.sync``
  per tile ("ws_tma") or 3 ("ws_tma3": three slots, each released a tile late, after the next
  tile's barrier) against "tma"'s 7 (offline PTX, D 64; of the 3, the barrier pass adds one before
  dS^T's store and one before the arrive on "empty"). D 64: 168 registers, no spill; "ws_tma3" is
  the fastest variant without the mask (0.98-1.03x ``tl``), "ws_tma" with it (on par at 4k keys,
  1.05-1.09x at 16k, with the mask on edge tiles only, below). D 128 spills 56-60 bytes ("ws_tma") or 200-276
  ("ws_tma3") inside the consumers, which ptxas does give 240 registers (``setmaxnreg``, seen in
  the SASS): their live set is larger, and both are slower than "prefetch" there.

At D 64 with the causal mask only the tiles on the diagonal or an edge compute the mask: the others
skip 32 compares and selects per thread. On the H200 that bought 11-16% there ("ws_tma", "ws_tma3");
without the mask the same branch cost 1-14% (its few edge tiles do not pay for what the branch does
to the schedule), and at D 128 it spills, so those keep the mask on every tile.

delta = rowsum(dO * O) comes from the caller (the fast path's delta kernel), or from torch in
``launch``; dQ is converted from its fp32 buffer after it.
"""
from __future__ import annotations

import torch

from . import gluon_api
from .forward import gluon_dtype, triton_cdiv
from .host import descriptor_strides, layout_problem, padded_rows

gluon, gl = gluon_api.gluon, gluon_api.gl
mbarrier, tma = gluon_api.mbarrier, gluon_api.tma
warpgroup_mma, warpgroup_mma_wait = gluon_api.warpgroup_mma, gluon_api.warpgroup_mma_wait
warpgroup_mma_init = gluon_api.warpgroup_mma_init
fence_async_shared = gluon_api.fence_async_shared
async_copy = gluon_api.async_copy

LOG2E = 1.4426950408889634
#: (head dim) -> (BLOCK_M query rows, BLOCK_N keys)
TILES = {64: (64, 128), 128: (64, 128)}
NUM_WARPS = 8           # two warpgroups: 64 keys each
PRODUCER_REGS = 24      # setmaxnreg of the producer warp (WARP_SPECIALIZE): it only issues copies
#: variant -> (WARP_SPECIALIZE, PREFETCH, DQ_LAG, STAGES of the Q / dO ring); see the module's docstring.
#: PREFETCH: 0 LSE and delta loaded in the tile, 1 by cp.async a tile ahead, 2 by the copy engine with
#: the tile's Q and dO. STAGES 3 (with PREFETCH 2 only) lets the tile drop its first explicit CTA barrier.
VARIANTS = {"inline": (False, 0, False, 2), "ws": (True, 0, False, 2), "prefetch": (False, 1, False, 2),
            "prefetch_lag": (False, 1, True, 2), "tma": (False, 2, False, 2), "tma3": (False, 2, False, 3),
            "tma3_lag": (False, 2, True, 3), "ws_tma": (True, 2, False, 2), "ws_tma3": (True, 2, False, 3)}
#: the fastest variant at each head dim (results/gluon_backward_h200.txt): what ``launch`` runs unless told
BEST = {64: "ws_tma3", 128: "prefetch"}
#: what the kernel does with dQ (``DQ``), for measuring its cost (variants without DQ_LAG):
#: 2 the real thing; 1 plain stores in place of atomics; 0 no dQ product at all
DQ_MODES = {"atomics": 2, "stores": 1, "none": 0}


@gluon.jit
def _load_q_do(q_desc, do_desc, q_smem, do_smem, ready, b, h, start_m, t):
    """Query tile t (its Q and dO rows) into slot t % STAGES, on that slot's barrier."""
    STAGES: gl.constexpr = q_smem.shape[0]
    slot = t % STAGES
    mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], ready.index(slot), q_smem.index(slot))
    tma.async_copy_global_to_shared(do_desc, [b, h, start_m, 0], ready.index(slot), do_smem.index(slot))


@gluon.jit
def _load_q_do_rows(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, rows_smem, ready, b, h, row, start_m, t):
    """``_load_q_do``, and the tile's LSE and delta on the same barrier (PREFETCH 2): one box each of
    the flattened [B * H * S_rows] vectors (each head's rows padded to whole tiles, so that every box
    starts on a tile: the launcher's ``padded_rows``), from this head's first row ``row`` + start_m.
    One wait then gives every thread all four, with no thread barrier. (Rows past S_q: padding,
    masked where read.)"""
    STAGES: gl.constexpr = q_smem.shape[0]
    slot = t % STAGES
    mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                    + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], ready.index(slot), q_smem.index(slot))
    tma.async_copy_global_to_shared(do_desc, [b, h, start_m, 0], ready.index(slot), do_smem.index(slot))
    first = (row + start_m).to(gl.int32)
    tma.async_copy_global_to_shared(lse_desc, [first], ready.index(slot), rows_smem.index(slot))
    tma.async_copy_global_to_shared(delta_desc, [first], ready.index(slot), rows_smem.index(STAGES + slot))


@gluon.jit
def _prefetch_rows(LSE, DELTA, rows_smem, row, start_m, S_q, slot, NUM_WARPS: gl.constexpr):
    """A query tile's LSE and delta (rows start_m.. of the head whose rows start at ``row``) into
    slot ``slot`` of ``rows_smem`` ([2 * STAGES, BLOCK_M]: LSE's slots, then delta's) by cp.async, as one group:
    read a tile later, their latency is off the critical path. Rows past S_q are not read."""
    BLOCK_M: gl.constexpr = rows_smem.shape[1]
    STAGES: gl.constexpr = rows_smem.shape[0] // 2
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    offs = start_m + gl.arange(0, BLOCK_M, layout=flat)
    ok = offs < S_q
    async_copy.async_copy_global_to_shared(rows_smem.index(slot), LSE + row + offs, mask=ok)
    async_copy.async_copy_global_to_shared(rows_smem.index(STAGES + slot), DELTA + row + offs, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _tile_head_and_rows(t, n_m, m_start, h_kv, GROUP_SIZE, BLOCK_M: gl.constexpr):
    """Query tile t of the walk: (query head, first row). Every query head of the GQA group walks
    the same n_m tiles from m_start."""
    return h_kv * GROUP_SIZE + t // n_m, m_start + (t % n_m) * BLOCK_M


@gluon.jit
def _produce(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, rows_smem, ready, empty, b, h_kv, H,
             GROUP_SIZE, S_q, m_start, n_m, n_tiles, PREFETCH: gl.constexpr):
    """The producer warp: every query tile's Q and dO rows as the consumers free their slots, and
    with ``PREFETCH`` 2 its LSE and delta on the same barrier. (One warp issues every copy:
    Triton's barrier pass puts no CTA barrier between them, as it does where 8 warps run the loads.)"""
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    S_rows = (S_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M      # a head's padded rows of LSE and delta
    for t in range(n_tiles):
        h, start_m = _tile_head_and_rows(t, n_m, m_start, h_kv, GROUP_SIZE, BLOCK_M)
        mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)   # a fresh barrier: free
        if PREFETCH == 2:
            _load_q_do_rows(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, rows_smem, ready, b, h,
                            (b * H + h).to(gl.int64) * S_rows, start_m, t)
        else:
            _load_q_do(q_desc, do_desc, q_smem, do_smem, ready, b, h, start_m, t)


# The producer partition, with its switch written in: a worker partition's arguments cross into it as
# values, so a constexpr cannot travel with them (the consumers, the default partition, take theirs).
@gluon.jit
def _producer(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, rows_smem, ready, empty, b, h_kv, H,
              GROUP_SIZE, S_q, m_start, n_m, n_tiles):
    _produce(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, rows_smem, ready, empty, b, h_kv, H,
             GROUP_SIZE, S_q, m_start, n_m, n_tiles, 0)


@gluon.jit
def _producer_rows(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, rows_smem, ready, empty, b, h_kv, H,
                   GROUP_SIZE, S_q, m_start, n_m, n_tiles):
    _produce(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, rows_smem, ready, empty, b, h_kv, H,
             GROUP_SIZE, S_q, m_start, n_m, n_tiles, 2)


@gluon.jit
def _add_dq(dq, DQ_ACC, row, start_m, S_q, scale, col0, HEAD_DIM: gl.constexpr, DQ: gl.constexpr):
    """dQ's columns col0.. of one query tile (rows from start_m of the head whose rows start at
    ``row``) added into the fp32 buffer, whose rows are HEAD_DIM long; ``DQ`` 1 stores them instead (a wrong dQ, for timing)."""
    BLOCK_M: gl.constexpr = dq.shape[0]
    dq_r = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq.type.layout))
    dq_c = col0 + gl.arange(0, dq.shape[1], layout=gl.SliceLayout(0, dq.type.layout))
    dq_ptrs = DQ_ACC + row * HEAD_DIM + dq_r[:, None] * HEAD_DIM + dq_c[None, :]
    if DQ == 2:
        gl.atomic_add(dq_ptrs, dq * scale, mask=(dq_r < S_q)[:, None], sem="relaxed")
    else:
        gl.store(dq_ptrs, dq * scale, mask=(dq_r < S_q)[:, None])


@gluon.jit
def _masked(pt, row_ok, key_ok, offs_m, offs_n, CAUSAL: gl.constexpr):
    """P^T with zeros where a key lies past S_k, a query row past S_q, or (causal) a key after its query."""
    visible = row_ok[None, :] & key_ok[:, None]
    if CAUSAL:
        visible = visible & (offs_n[:, None] <= offs_m[None, :])
    return gl.where(visible, pt, 0.0)


@gluon.jit
def _consumer(q_desc, do_desc, LSE, DELTA, LSE_DESC, DELTA_DESC, DQ_ACC, DK, DV,
              stride_dk_b, stride_dk_h, stride_dk_s, stride_dv_b, stride_dv_h, stride_dv_s,
              k_smem, v_smem, q_smem, do_smem, ds_smem, rows_smem, kv_bar, ready, empty,
              b, h_kv, H, GROUP_SIZE, S_q, S_k, start_n, m_start, n_m, n_tiles, scale, qk_scale,
              CAUSAL: gl.constexpr, NUM_WARPS: gl.constexpr, LOADS: gl.constexpr, DQ: gl.constexpr,
              PREFETCH: gl.constexpr, DQ_LAG: gl.constexpr):
    """The two consumer warpgroups: every product, the softmax's recomputation, dQ's atomics, and
    dK, dV at the end. ``LOADS``: also issue the Q / dO copies, one tile ahead (no producer warp);
    else arrive on a slot's "empty" barrier once its tile's products are done (with three slots, a
    tile late: after the next tile's barrier, which every warp reaches only past that tile). ``DQ`` is for
    measuring what dQ costs (``DQ_MODES``): 2 computes it, 1 stores its tiles without atomics (a
    wrong dQ), 0 skips its product and dS^T's trip through shared memory (no dQ). ``PREFETCH`` (with
    ``LOADS``): each tile's LSE and delta come a tile ahead into shared memory, 1 by cp.async, 2 by
    the copy engine on the tile's own barrier; with 2 and three slots (``STAGES`` 3) the tile's first
    CTA barrier goes (see the loop).
    ``DQ_LAG``: tile t's whole dQ product is left running behind tile t + 1's S^T and dP^T and
    added under tile t + 1's dV product (dS^T then needs two buffers: tile t + 1 writes one while
    tile t's product reads the other)."""
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = q_smem.shape[0]
    # Layouts: the products' accumulators (two warpgroups stacked along the keys), P^T and dS^T as
    # register operands of the dV and dK products, and dQ's accumulator split along D.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                        instr_shape=[16, HEAD_DIM // 2 // (NUM_WARPS // 4), 16])
    dq_whole_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                              instr_shape=[16, HEAD_DIM // (NUM_WARPS // 4), 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    key_rows: gl.constexpr = gl.SliceLayout(1, st_layout)     # a vector along BLOCK_N
    query_cols: gl.constexpr = gl.SliceLayout(0, st_layout)   # a vector along BLOCK_M

    gl.static_assert(PREFETCH == 2 or STAGES == 2, "three slots drop a CTA barrier only where the copy engine brings LSE and delta")
    gl.static_assert(PREFETCH != 1 or LOADS, "cp.async rows are the consumers' own copies")
    gl.static_assert(STAGES == 2 or DQ > 0, "three slots lean on the barrier before dQ's product")
    S_rows = (S_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M      # PREFETCH 2: a head's rows of LSE and delta, padded
    if LOADS:
        if n_tiles > 0:
            h_first = h_kv * GROUP_SIZE
            if PREFETCH == 2:
                _load_q_do_rows(q_desc, do_desc, LSE_DESC, DELTA_DESC, q_smem, do_smem, rows_smem, ready, b, h_first,
                                (b * H + h_first).to(gl.int64) * S_rows, m_start, 0)
            else:
                _load_q_do(q_desc, do_desc, q_smem, do_smem, ready, b, h_first, m_start, 0)
            if PREFETCH == 1:
                _prefetch_rows(LSE, DELTA, rows_smem, (b * H + h_first).to(gl.int64) * S_q, m_start, S_q,
                               0, NUM_WARPS)
    k = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v = v_smem.reshape([BLOCK_N, HEAD_DIM])
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=key_rows)
    key_ok = offs_n < S_k
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
    mbarrier.wait(kv_bar, 0)
    if DQ_LAG:      # the lagging tile's dQ product, carried from one iteration to the next
        dq_lag = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_whole_layout))

    for t in range(n_tiles):
        h, start_m = _tile_head_and_rows(t, n_m, m_start, h_kv, GROUP_SIZE, q_smem.shape[3])
        # Two slots: every warp must be past tile t - 1 before its slot takes tile t + 1 (and dS^T's
        # buffer is reused). Three (STAGES 3, LSE and delta by the copy engine): tile t + 1 goes to
        # tile t - 2's slot (ws: the producer waits for it) and dS^T alternates between two buffers,
        # and every warp left tile t - 2 before the other warpgroup passed tile t - 1's barrier below,
        # so this one is not needed.
        # (Where these 8 warps issue the copies, Triton's barrier pass still puts a CTA barrier before
        # each copy and before the wait: it cannot tell the slots apart. The module's docstring has
        # what that costs.)
        if PREFETCH == 1:
            async_copy.wait_group(0)      # this tile's LSE and delta (this thread's copies) have landed
        if STAGES == 2:
            gl.thread_barrier()
        if LOADS:
            if t + 1 < n_tiles:
                h_next, m_next = _tile_head_and_rows(t + 1, n_m, m_start, h_kv, GROUP_SIZE, q_smem.shape[3])
                if PREFETCH == 2:
                    _load_q_do_rows(q_desc, do_desc, LSE_DESC, DELTA_DESC, q_smem, do_smem, rows_smem, ready, b,
                                    h_next, (b * H + h_next).to(gl.int64) * S_rows, m_next, t + 1)
                else:
                    _load_q_do(q_desc, do_desc, q_smem, do_smem, ready, b, h_next, m_next, t + 1)
                if PREFETCH == 1:
                    _prefetch_rows(LSE, DELTA, rows_smem, (b * H + h_next).to(gl.int64) * S_q, m_next, S_q,
                                   (t + 1) % STAGES, NUM_WARPS)
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        q = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])

        # (the accumulators' zeros are made where they are used: held across the loop they took registers)
        st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
        st = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)       # S^T = K Q^T
        dpt = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)     # dP^T = V dO^T
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=query_cols)
        row_ok = offs_m < S_q
        row = (b * H + h).to(gl.int64) * S_q          # this head's rows of LSE and delta
        if PREFETCH > 0:    # (rows past S_q: not copied by cp.async, or the copy engine's padding; masked here)
            lse2 = gl.where(row_ok, rows_smem.index(slot).load(query_cols), 0.0) * 1.4426950408889634   # log2 e
            delta = gl.where(row_ok, rows_smem.index(STAGES + slot).load(query_cols), 0.0)
        else:
            lse2 = gl.load(LSE + row + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634   # log2 e
            delta = gl.load(DELTA + row + offs_m, mask=row_ok, other=0.0)
        if DQ_LAG:      # tile t - 1's dQ product ran ahead of S^T and dP^T. (Waiting for all three:
            # ptxas serialises every wgmma if the loop's carried accumulator is read behind a partial wait.)
            dq_prev = warpgroup_mma_wait(num_outstanding=0, deps=(dq_lag, ))
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
        pt = gl.exp2(st * qk_scale - lse2[None, :])
        if CAUSAL and HEAD_DIM == 64:   # only tiles on the diagonal or an edge take the mask
            # Interior tiles skip 32 compares and selects per thread. On the H200 this bought 11-16% on D 64's
            # causal shapes; without the mask (few edge tiles) the branch cost 1-14%, and at D 128 it spills.
            edge = (start_m + BLOCK_M > S_q) | (start_n + BLOCK_N > S_k) | (start_n + BLOCK_N - 1 > start_m)
            if edge:
                pt = _masked(pt, row_ok, key_ok, offs_m, offs_n, CAUSAL)
        else:
            pt = _masked(pt, row_ok, key_ok, offs_m, offs_n, CAUSAL)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv = warpgroup_mma(pt_op, do, dv, is_async=True)                                     # dV += P^T dO
        if DQ_LAG:      # tile t - 1's dQ goes out while the dV product runs
            if t > 0:
                h_prev, m_prev = _tile_head_and_rows(t - 1, n_m, m_start, h_kv, GROUP_SIZE, BLOCK_M)
                _add_dq(dq_prev, DQ_ACC, (b * H + h_prev).to(gl.int64) * S_q, m_prev, S_q, scale, 0, HEAD_DIM, DQ)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
        ds = (pt * (dpt - delta[None, :])).to(dtype)                                         # dS^T
        ds_buf = 0
        if DQ_LAG or STAGES > 2:      # two buffers: tile t writes one while tile t - 1's dQ product may read the other
            ds_buf = t % 2
        if DQ > 0:
            ds_smem.index(ds_buf).store(ds)
        dv, pt_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, pt_op))   # P^T's registers free again
        ds_op = gl.convert_layout(ds, op_layout)
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)                                      # dK += dS^T Q
        if DQ > 0:
            fence_async_shared()
            gl.thread_barrier()               # both warpgroups' rows of dS^T are in shared memory
        if not LOADS and STAGES > 2:    # ws, three slots: every warp is past tile t - 1, so its slot is free
            # (the last tile's slot is never released: right for one pass over the tiles per program)
            if t > 0:
                mbarrier.arrive(empty.index((t - 1) % STAGES), count=1)
        dk, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds_op))
        if not LOADS and STAGES == 2:
            gl.thread_barrier()       # (ws: both warpgroups' products are done, not only the arriving thread's)
            mbarrier.arrive(empty.index(slot), count=1)           # Q and dO of this slot are read
        if DQ_LAG:      # dQ = dS K, left running (waited for in the next iteration, or after the loop)
            dq_lag = warpgroup_mma(ds_smem.index(ds_buf).permute((1, 0)), k, dq_lag, use_acc=False, is_async=True)
        elif DQ > 0:    # dQ = dS K in column halves: half the accumulator in registers at a time
            for half in gl.static_range(2):
                dq_zero = gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, layout=dq_layout)
                dq = warpgroup_mma(ds_smem.index(ds_buf).permute((1, 0)), k.slice(half * (HEAD_DIM // 2), HEAD_DIM // 2, dim=1),
                                   dq_zero, use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
                _add_dq(dq, DQ_ACC, row, start_m, S_q, scale, half * (HEAD_DIM // 2), HEAD_DIM, DQ)
    if DQ_LAG:
        if n_tiles > 0:
            dq_last = warpgroup_mma_wait(num_outstanding=0, deps=(dq_lag, ))
            h_last, m_last = _tile_head_and_rows(n_tiles - 1, n_m, m_start, h_kv, GROUP_SIZE, BLOCK_M)
            _add_dq(dq_last, DQ_ACC, (b * H + h_last).to(gl.int64) * S_q, m_last, S_q, scale, 0, HEAD_DIM, DQ)

    # dK = scale * sum dS^T Q; both stored where the keys exist.
    offs_nk = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    keep = (offs_nk < S_k)[:, None]
    dk_ptrs = DK + b.to(gl.int64) * stride_dk_b + h_kv.to(gl.int64) * stride_dk_h + offs_nk[:, None] * stride_dk_s
    dv_ptrs = DV + b.to(gl.int64) * stride_dv_b + h_kv.to(gl.int64) * stride_dv_h + offs_nk[:, None] * stride_dv_s
    gl.store(dk_ptrs + offs_d[None, :], (dk * scale).to(dtype), mask=keep)
    gl.store(dv_ptrs + offs_d[None, :], dv.to(dtype), mask=keep)


@gluon.jit(do_not_specialize=["H", "GROUP_SIZE", "S_q", "S_k"])
def hopper_bwd_kernel(q_desc, k_desc, v_desc, do_desc, LSE, DELTA, LSE_DESC, DELTA_DESC, DQ_ACC, DK, DV,
                      stride_dk_b, stride_dk_h, stride_dk_s, stride_dv_b, stride_dv_h, stride_dv_s,
                      H, GROUP_SIZE, S_q, S_k, scale, qk_scale,
                      CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                      WARP_SPECIALIZE: gl.constexpr, PRODUCER_REGS: gl.constexpr, DQ: gl.constexpr,
                      PREFETCH: gl.constexpr, DQ_LAG: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)             # (batch, K/V head)
    H_kv = H // GROUP_SIZE
    b = pid_bh // H_kv
    h_kv = pid_bh % H_kv
    start_n = pid_n * BLOCK_N

    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)   # two for DQ_LAG
    if PREFETCH == 2:       # LSE's slots, then delta's: the copy engine's boxes
        rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], LSE_DESC.layout)
    else:                   # (PREFETCH 1 by cp.async; 0 leaves it unused)
        rows_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], rows_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    # Causal: key j is seen by rows i >= j only, so the walk starts at the query tile holding row
    # start_n (BLOCK_N is a multiple of BLOCK_M).
    m_start = 0
    if CAUSAL:
        m_start = (start_n // BLOCK_M) * BLOCK_M
    n_m = gl.maximum((S_q - m_start + BLOCK_M - 1) // BLOCK_M, 0)
    n_tiles = n_m * GROUP_SIZE

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, h_kv, start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, h_kv, start_n, 0], kv_bar, v_smem)

    consumer_args = (q_desc, do_desc, LSE, DELTA, LSE_DESC, DELTA_DESC, DQ_ACC, DK, DV,
                     stride_dk_b, stride_dk_h, stride_dk_s, stride_dv_b, stride_dv_h, stride_dv_s,
                     k_smem, v_smem, q_smem, do_smem, ds_smem, rows_smem, kv_bar, ready, empty,
                     b, h_kv, H, GROUP_SIZE, S_q, S_k, start_n, m_start, n_m, n_tiles, scale, qk_scale)
    if WARP_SPECIALIZE:     # (the consumers' switches travel with their arguments, as constexprs)
        producer_args = (q_desc, do_desc, LSE_DESC, DELTA_DESC, q_smem, do_smem, rows_smem, ready, empty, b, h_kv, H,
                         GROUP_SIZE, S_q, m_start, n_m, n_tiles)
        # (written out in each call: a tuple of constexprs kept in a variable loses them)
        if PREFETCH == 2:
            gl.warp_specialize([(_consumer, consumer_args + (CAUSAL, NUM_WARPS, False, DQ, PREFETCH, DQ_LAG)),
                                (_producer_rows, producer_args)], [1], [PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consumer, consumer_args + (CAUSAL, NUM_WARPS, False, DQ, PREFETCH, DQ_LAG)),
                                (_producer, producer_args)], [1], [PRODUCER_REGS])
    else:
        _consumer(q_desc, do_desc, LSE, DELTA, LSE_DESC, DELTA_DESC, DQ_ACC, DK, DV,
                  stride_dk_b, stride_dk_h, stride_dk_s, stride_dv_b, stride_dv_h, stride_dv_s,
                  k_smem, v_smem, q_smem, do_smem, ds_smem, rows_smem, kv_bar, ready, empty,
                  b, h_kv, H, GROUP_SIZE, S_q, S_k, start_n, m_start, n_m, n_tiles, scale, qk_scale,
                  CAUSAL, NUM_WARPS, True, DQ, PREFETCH, DQ_LAG)

    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


# --------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------
def block_shapes(head_dim: int) -> dict:
    BLOCK_M, BLOCK_N = TILES[head_dim]
    return {"q": [1, 1, BLOCK_M, head_dim], "kv": [1, 1, BLOCK_N, head_dim], "rows": [BLOCK_M]}


def make_descriptor(t: torch.Tensor, block_shape: list):
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, gluon_dtype(t.dtype))
    return gluon_api.TensorDescriptor(t, list(t.shape), descriptor_strides(t), block_shape, layout)


def launch_args(q, k, v, do, lse, delta, causal: bool, scale: float, variant: str | None = None,
                dq_mode: str = "atomics"):
    """(grid, arguments, options, dq_acc, dk, dv) of one launch; dQ's fp32 buffer zeroed. ``variant``
    None: ``BEST`` at this head dim. ``dq_mode`` other than "atomics" gives a wrong dQ: it is for
    measuring (``DQ_MODES``)."""
    D = q.shape[-1]
    if D not in TILES:
        raise ValueError(f"the Gluon backward is written for head dims {sorted(TILES)}, not {D}")
    variant = variant or BEST[D]
    if variant not in VARIANTS:
        raise ValueError(f"no backward variant {variant!r}: the variants are {', '.join(VARIANTS)}")
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode={dq_mode!r}: the modes are {', '.join(DQ_MODES)}")
    if dq_mode != "atomics" and variant not in ("inline", "prefetch"):
        raise ValueError(f"dq_mode={dq_mode!r} is measured with the 'inline' and 'prefetch' variants, not {variant!r}")
    from .. import runtime

    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    BLOCK_M, BLOCK_N = TILES[D]
    warp_specialize, prefetch, dq_lag, stages = VARIANTS[variant]
    if warp_specialize and (prefetch == 1 or dq_lag):
        raise ValueError(f"variant {variant!r}: the warp-specialized consumers take no cp.async rows or DQ_LAG")
    dq_acc = torch.zeros((B, H, S_q, D), dtype=torch.float32, device=q.device)
    dk = runtime.new_output((B, H_kv, S_k, D), k.dtype, k.device)     # poisoned or guarded where asked
    dv = runtime.new_output((B, H_kv, S_k, D), v.dtype, v.device)
    shapes = block_shapes(D)
    descs = (make_descriptor(q, shapes["q"]), make_descriptor(k, shapes["kv"]), make_descriptor(v, shapes["kv"]),
             make_descriptor(do, shapes["q"]))
    rows = (lse, delta)         # PREFETCH 2: the copy engine reads them, as one flat vector each
    if prefetch == 2:
        rows = tuple(make_descriptor(padded_rows(x, BLOCK_M), shapes["rows"]) for x in (lse, delta))
    grid = (triton_cdiv(S_k, BLOCK_N), B * H_kv)
    args = (*descs, lse, delta, *rows, dq_acc, dk, dv, *dk.stride()[:3], *dv.stride()[:3], H, H // H_kv, S_q, S_k, scale, scale * LOG2E)
    options = dict(CAUSAL=bool(causal), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D, STAGES=stages,
                   NUM_WARPS=NUM_WARPS, WARP_SPECIALIZE=warp_specialize, PRODUCER_REGS=PRODUCER_REGS,
                   DQ=DQ_MODES[dq_mode], PREFETCH=prefetch, DQ_LAG=dq_lag, num_warps=NUM_WARPS)
    return grid, args, options, dq_acc, dk, dv


def launch(q, k, v, o, do, lse, causal: bool, scale: float, *, variant: str | None = None,
           dq_mode: str = "atomics", delta=None):
    """dQ, dK, dV as the ``tl`` fast backward returns them (inputs checked by the caller: the
    forward's ``flashattn.hopper.supports``; dO copied where the copy engine cannot read it).
    ``delta`` = rowsum(dO * O), [B, H, S_q] fp32: the fast path passes its delta kernel's; without
    it, torch computes it here (this module does not import the fast path, which imports its caller)."""
    if layout_problem(do, "dO"):          # the copy engine's rules (a stride-0 dO from .sum(), ...)
        do = do.contiguous()
    if delta is None:
        delta = (do.float() * o.float()).sum(-1)
    grid, args, options, dq_acc, dk, dv = launch_args(q, k, v, do, lse.contiguous(), delta.contiguous(),
                                                      causal, scale, variant, dq_mode)
    hopper_bwd_kernel[grid](*args, **options)
    return dq_acc.to(q.dtype), dk, dv
