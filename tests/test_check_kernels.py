"""flashattn.check on kernels: each diagnosis proven by a one-line edit of the real dQ or dK/dV
kernel (flashattn.planted), and the real kernels trigger none.

The planted kernels run through launchers that write straight into the checker's outputs
(NaN-filled, with a guard zone after them), so a missing store mask or an incomplete grid
shows. The race needs a kernel of its own: several programs adding into the same dK rows
with tl.atomic_add, in a shuffled order.
"""
import pytest
import torch
import triton
import triton.language as tl

import flashattn
from flashattn import backward, check, planted, runtime

from conftest import assert_clean, assert_hint, run_checker, solution


# --------------------------------------------------------------------------------------
# kernels: the real dQ and dK/dV kernels with one line changed
# --------------------------------------------------------------------------------------
def launch_dq(q, k, v, do, lse, delta, dq, causal, scale):
    dq.copy_(flashattn.attention_backward_dq(q, k, v, do, lse, delta, causal, scale))


def launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale):
    a, b = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, causal, scale)
    dk.copy_(a)
    dv.copy_(b)


BLOCK = 32


def _common(q, k, scale, causal):
    D = q.shape[-1]
    return dict(CAUSAL=causal, BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_D=max(16, triton.next_power_of_2(D)),
                DOT_PRECISION=flashattn.runtime.dot_precision(q.dtype))


def launch_dq_direct(q, k, v, do, lse, delta, dq, causal, scale, rows=triton.cdiv):
    """The package's dQ kernel (looked up at call time, so a planted copy runs) writing straight
    into the checker's output."""
    B, H, S_q, D = q.shape
    grid = (rows(S_q, BLOCK), B * H)
    if grid[0] == 0:
        return
    backward.attn_bwd_dq_kernel[grid](
        q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *lse.stride(), *delta.stride(), *dq.stride(), H, 1, S_q, k.shape[2], D, scale,
        **_common(q, k, scale, causal))


def launch_dkdv_direct(q, k, v, do, lse, delta, dk, dv, causal, scale, grid_heads=None):
    """``grid_heads="query"``: a program per query head (the grid of a dQ kernel), wrong under GQA."""
    B, H, S_q, D = q.shape
    H_kv = k.shape[1]
    grid = (triton.cdiv(k.shape[2], BLOCK), B * (H if grid_heads == "query" else H_kv))
    backward.attn_bwd_dkdv_kernel[grid](
        q, k, v, do, lse, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *lse.stride(), *delta.stride(), *dk.stride(), *dv.stride(), H_kv, H // H_kv, S_q, k.shape[2], D,
        scale, **_common(q, k, scale, causal))


def launch_dq_lengths_swapped(q, k, v, do, lse, delta, dq, causal, scale):
    """The dQ kernel told S_k where S_q belongs and the reverse (the grid is right)."""
    B, H, S_q, D = q.shape
    backward.attn_bwd_dq_kernel[(triton.cdiv(S_q, BLOCK), B * H)](
        q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *lse.stride(), *delta.stride(), *dq.stride(), H, 1, k.shape[2], S_q, D, scale,
        **_common(q, k, scale, causal))


def past_the_end(names: str) -> str:
    """The evidence naming the tensors read past the end: seen as the loads happen in the
    interpreter; on a GPU, by which guard turns the output NaN."""
    return f"past the end of {names} in" if runtime.INTERPRET else f"NaN only around {names}, the output"


#: catalog entry (flashattn.planted.CATALOG) -> the diagnosis it must get, and a phrase the
#: evidence must contain. Every diagnosis a kernel can get is proven here by a planted bug.
DQ_BUGS = {
    "dq.do_head_stride": ("stride", "dO's head stride differs from Q's"),
    "dq.no_do_head_offset": ("heads", "(0,0) ok"),
    "dq.no_causal_element_mask": ("no_mask", "match that computation"),
    "dq.short_causal_loop": ("diag_tile_skipped", "match that computation"),
    "dq.causal_mask_on_S_with_0": ("mask_zero", "match that computation"),
    "dq.causal_strict": ("mask_strict", "match that computation"),
    "dq.causal_mask_transposed": ("mask_tile_transposed", "match that computation"),
    "dq.causal_off_by_one": ("mask_shifted", "also sees key i + 1"),
    "dq.v_with_k_strides": ("stride", "V's head stride differs from K's"),
    "dq.lse_as_row": ("lse_broadcast", "match that computation"),
    "dq.batch_head_swapped": ("wild_access", "outside every tensor"),
    "dq.delta_from_lse": ("delta_is_lse", "match that computation"),
    "dq.dq_from_v": ("wrong_operand", "yours equals dQ = dS V"),
    "dq.dp_transposed": ("dp_tile_transposed", "match that computation"),
    "dq.q_row_stride_typo": ("address_past_end", "past the end of Q"),
    # on square tiles the other way round hides every tile but the diagonal one: the same
    # outputs as a loop that starts there, and the diagnosis says both
    "dq.causal_mask_transposed_ge": ("only_diagonal_tile", "a mask transposed inside the tile"),
    "dq.loop_from_diagonal": ("only_diagonal_tile", "match that computation"),
    "dq.delta_with_lse_strides": ("stride", "delta's strides differ from LSE's"),
    "dq.delta_as_row": ("delta_broadcast", "match that computation"),
    "dq.ds_without_p": ("ds_missing_p", "match that computation"),
    "dq.dp_from_k": ("dp_operand", "match that computation"),
    "dq.causal_block_local": ("causal_global_index", "(causal)"),
    "dq.no_batch_offset": ("batch", "more than one batch element"),
    "dq.stored_with_q_strides": ("stride", "dQ is stored with Q's strides"),
    "dq.row_mask_uses_S_k": ("row_mask_length", "rows 23-49 of dQ never written"),
    "dq.no_scale": ("scale", "yours / reference"),
    "dq.keys_unmasked": ("read_past_end", past_the_end("K, V")),
    "dq.partial_key_block_skipped": ("padding", "not a multiple of 32"),
    "dq.no_delta": ("delta", "match that computation"),
    "dq.exp2": ("lse", "match that computation"),
    "dq.unscaled_scores": ("scale_in_scores", "match that computation"),
    "dq.store_without_row_mask": ("oob_write", "written after the end of dQ"),
    "dq.overwrite": ("accumulate", "last block's share alone (blocks of 32)"),
    "dq.key_loop_to_S_q": ("keys_bound", "S_q < S_k"),
    # only the case with D = 24 < BLOCK_D = 32 shows a missing head-dim mask
    "dq.k_without_d_mask": ("head_dim_mask", "read past the end of K (a load of K without the"),
    "dq.store_without_d_mask": ("head_dim_mask", "stores wrote past the end of dQ (its store without the"),
    "dq.stored_into_q": ("input_modified", "wrote into its input Q"),
}

DKDV_BUGS = {
    "dkdv.do_head_stride": ("stride", "dO's head stride differs from Q's"),
    "dkdv.causal_mask_on_S_with_0": ("mask_zero", "match that computation"),
    "dkdv.causal_ge": ("mask_ge", "match that computation"),
    "dkdv.row_mask_uses_S_k": ("row_mask_length", "and of nothing else"),
    "dkdv.dv_from_unmasked_p": ("no_mask", "Only dV is wrong, and it equals dV with P unmasked"),
    "dkdv.dv_from_q": ("wrong_operand", "yours equals dV = P^T Q"),
    "dkdv.dk_from_do": ("wrong_operand", "yours equals dK = dS^T dO"),
    "dkdv.diagonal_tile_skipped": ("diag_tile_skipped", "match that computation"),
    "dkdv.dpT_not_transposed": ("dp_tile_transposed", "dV right in every case"),
    "dkdv.query_tile_from_pid": ("query_block_from_pid", "match that computation"),
    "dkdv.scale_twice": ("scale", "dV right in every case"),
    "dkdv.do_rows_unmasked": ("read_past_end", past_the_end("dO")),
    "dkdv.q_rows_unmasked": ("read_past_end", past_the_end("Q")),
    "dkdv.key_mask_uses_S_q": ("key_mask_length", "keys 23-49 of dK never written"),
    "dkdv.rows_unmasked": ("read_past_end", past_the_end("Q, dO")),
    "dkdv.lse_unmasked": ("read_past_end", past_the_end("LSE")),
    "dkdv.no_delta": ("delta", "dV right in every case"),
    "dkdv.exp2": ("lse", "match that computation"),
    "dkdv.unscaled_scores": ("scale_in_scores", "match that computation"),
    "dkdv.dv_from_p": ("tile_transposed_again", "dK right in every case"),
    "dkdv.overwrite": ("accumulate", "last block's share alone (blocks of 32)"),
    "dkdv.same_query_tile": ("query_blocks", "more than one query block of 32"),
    "dkdv.query_loop_to_S_k": ("rows_bound", "S_q > S_k"),
}


def test_dq_kernel_correct_passes():
    assert_clean(run_checker(check.dq_kernel, launch_dq))
    assert_clean(run_checker(check.dq_kernel, launch_dq_direct))


@pytest.mark.parametrize("bug", list(DQ_BUGS))
def test_dq_kernel_planted(bug):
    hint, phrase = DQ_BUGS[bug]
    with planted.plant(bug):
        r = run_checker(check.dq_kernel, launch_dq_direct)
    assert_hint(r, hint)
    assert phrase in " ".join(r.diagnosis().split()), r.diagnosis()


@pytest.mark.parametrize("bug", ["dq.unscaled_scores", "dkdv.unscaled_scores"])
def test_unscaled_scores_named_in_fp16(bug):
    """On a GPU the kernel checkers run in fp16, where P from unscaled scores overflows (fp16
    ends at 65504) into inf and NaN: the fingerprint must overflow the same way."""
    checker, launch = (check.dq_kernel, launch_dq_direct) if bug.startswith("dq") else \
        (check.dkdv_kernel, launch_dkdv_direct)
    with planted.plant(bug):
        r = run_checker(checker, launch, dtype=torch.float16)
    assert any(not t.finite for c in r.results for t in c.tensors.values()), "no overflow: the test shows nothing"
    assert_hint(r, "scale_in_scores")


def test_dkdv_kernel_correct_passes():
    assert_clean(run_checker(check.dkdv_kernel, launch_dkdv))
    assert_clean(run_checker(check.dkdv_kernel, launch_dkdv_direct))


@pytest.mark.parametrize("bug", list(DKDV_BUGS))
def test_dkdv_kernel_planted(bug):
    hint, phrase = DKDV_BUGS[bug]
    with planted.plant(bug):
        r = run_checker(check.dkdv_kernel, launch_dkdv_direct)
    assert_hint(r, hint)
    assert phrase in r.diagnosis(), r.diagnosis()


@pytest.mark.parametrize("bug, hint", [("dkdv.gqa_first_head_only", "gqa_one_head"), ("dkdv.dk_overwrite", "accumulate"),
                                       ("dkdv.acc_reset_per_head", "gqa_last_head")])
def test_dkdv_kernel_planted_gqa(bug, hint):
    """Mistakes of the loop over a GQA group: the battery with its GQA cases."""
    with planted.plant(bug):
        r = run_checker(check.dkdv_kernel, launch_dkdv_direct, gqa=True)
    assert_hint(r, hint)


def launch_dq_gqa(q, k, v, do, lse, delta, dq, causal, scale):
    """The package's dQ kernel with GROUP_SIZE = H // H_kv (a planted copy runs)."""
    B, H, S_q, D = q.shape
    backward.attn_bwd_dq_kernel[(triton.cdiv(S_q, BLOCK), B * H)](
        q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *lse.stride(), *delta.stride(), *dq.stride(), H, H // k.shape[1], S_q, k.shape[2], D, scale,
        **_common(q, k, scale, causal))


def test_dq_kernel_wrong_kv_head_under_gqa():
    """h % H_kv where h // GROUP_SIZE belongs: the case with GROUP_SIZE != H_kv tells the two apart."""
    with planted.plant("dq.kv_head_is_query_head"):
        r = run_checker(check.dq_kernel, launch_dq_gqa, gqa=True)
    assert_hint(r, "kv_head")
    assert "it fits h_kv = h % H_kv" in " ".join(r.diagnosis().split()), r.diagnosis()


def test_dq_group_size_given_as_h_kv_is_named():
    """The launcher passes H_kv where GROUP_SIZE = H // H_kv belongs: named from the launch itself."""
    def launch(q, k, v, do, lse, delta, dq, causal, scale):
        B, H, S_q, D = q.shape
        backward.attn_bwd_dq_kernel[(triton.cdiv(S_q, BLOCK), B * H)](
            q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *lse.stride(), *delta.stride(), *dq.stride(), H, k.shape[1], S_q, k.shape[2], D, scale,
            **_common(q, k, scale, causal))
    r = run_checker(check.dq_kernel, launch, gqa=True)
    assert_hint(r, "launch_value")
    assert "GROUP_SIZE received 2 (= H or H_kv)" in " ".join(r.diagnosis().split()), r.diagnosis()


def test_dq_kv_offset_with_the_query_head_is_named():
    """K and V read with the query head h: heads h < H_kv read K/V head h, the others read past
    the last K/V head (NaN there); the evidence gives that map."""
    with planted.plant("dq.kv_offset_with_h"):
        r = run_checker(check.dq_kernel, launch_dq_gqa, gqa=True)
    assert_hint(r, "gqa")
    assert "K and V are offset with the query head h" in " ".join(r.diagnosis().split()), r.diagnosis()


@pytest.fixture(params=["interpreter", "gpu"])
def evidence(request, monkeypatch):
    """The evidence a checker gets where it runs: the interpreter records every load past the
    end; a GPU records none (only NaN in the outputs and the NaN-origin search show them)."""
    if request.param == "gpu":
        import contextlib

        from flashattn.check import runner

        monkeypatch.setattr(runner, "watch_guard_reads", lambda inputs: contextlib.nullcontext(set()))
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dkdv_grid_over_query_heads_is_named(dtype, evidence):
    """The values are right, dK/dV are written past their end: gqa_grid, in the dtype a GPU runs
    (fp16) too. With one query block 'the same query block every iteration' *is* the right
    computation: matching it proves nothing, so query_block_from_pid must not be claimed."""
    launch = lambda *a: launch_dkdv_direct(*a, grid_heads="query")  # noqa: E731
    r = run_checker(check.dkdv_kernel, launch, gqa=True, dtype=dtype)
    assert_hint(r, "gqa_grid")
    assert "every value right" in " ".join(r.diagnosis().split()), r.diagnosis()
    assert not any("query_block_from_pid" in c.fingerprints for c in r.results), r.report()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_solution_04_with_a_grid_over_query_heads_is_gqa_grid(tmp_path, dtype):
    """The blind evaluation's variant: exercise 04's launcher with grid (cdiv(S_k, BLOCK), B * H)."""
    assert_clean(run_checker(check.dkdv_kernel, solution(tmp_path, "04").launch_dkdv, gqa=True, dtype=dtype))
    launch = solution(tmp_path, "04", ("grid = (triton.cdiv(S_k, BLOCK), B * H_kv)",
                                       "grid = (triton.cdiv(S_k, BLOCK), B * H)")).launch_dkdv
    r = run_checker(check.dkdv_kernel, launch, gqa=True, dtype=dtype)
    assert_hint(r, "gqa_grid")


def test_the_memory_and_head_mistakes_come_before_the_fingerprints():
    """A merge once put query_block_from_pid before gqa_grid, and every memory rule: the kernels'
    orders (checkers.py's tables) keep the memory and head mistakes first."""
    dq, dkdv = check.orders()["dq_kernel"], check.orders()["dkdv_kernel"]
    for order, first, later in [(dkdv, "gqa_grid", "query_block_from_pid"), (dq, "kv_head", "no_mask"),
                                (dkdv, "unwritten", "delta"), (dq, "read_past_end", "mask_strict")]:
        assert order.index(first) < order.index(later), (first, later)


@pytest.mark.parametrize("exercise, old", [
    ("03", "dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=LSE.dtype.element_ty)"),
    ("04", "dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)"),
])
def test_an_fp32_accumulator_as_the_exercise_says_passes(tmp_path, exercise, old):
    """Exercises 03 and 04 say 'accumulate in fp32'; their solutions write the LSE's dtype (fp32,
    fp64 for fp64 inputs). Both are right: the learner who follows the text passes."""
    from conftest import SOLUTION_CHECKS
    new = old.replace("LSE.dtype.element_ty", "tl.float32")
    assert_clean(SOLUTION_CHECKS[exercise](solution(tmp_path, exercise, (old, new))))


def test_dq_lengths_swapped_are_named():
    assert_hint(run_checker(check.dq_kernel, launch_dq_lengths_swapped), "lengths_swapped")


def test_missing_row_mask_on_P_is_harmless_when_the_loads_are_masked():
    """What exercise 04 says: with Q, dO, LSE and delta loaded as 0 on padded rows, P = 1 there
    but dO = 0 and delta = 0 make those rows add nothing -- the checker rightly passes it."""
    with planted.plant("dkdv.no_p_zero"):
        assert_clean(run_checker(check.dkdv_kernel, launch_dkdv_direct))


def launch_dkdv_in_pytorch(q, k, v, do, lse, delta, dk, dv, causal, scale):
    """A launcher that computes dK and dV in PyTorch: no kernel at all."""
    from flashattn.reference import attention_reference
    ref = attention_reference(q, k, v, do, causal=causal, scale=scale)
    dk.copy_(ref.dK)
    dv.copy_(ref.dV)


def test_a_launcher_that_launches_no_kernel_is_refused():
    r = run_checker(check.dkdv_kernel, launch_dkdv_in_pytorch)
    assert_hint(r, "no_kernel")
    assert "without launching any kernel" in r.diagnosis()


def test_kernel_language_is_validated():
    with pytest.raises(ValueError, match="kernel_language"):
        check.dq_kernel(launch_dq, kernel_language="cuda++")


def launch_dq_rows_rounded_down(q, k, v, do, lse, delta, dq, causal, scale):
    """The grid's row blocks counted S_q // BLOCK, not cdiv: the partial last block gets no program."""
    launch_dq_direct(q, k, v, do, lse, delta, dq, causal, scale, rows=lambda a, b: a // b)


def test_dq_grid_rounded_down_leaves_nan_rows():
    r = run_checker(check.dq_kernel, launch_dq_rows_rounded_down)
    assert_hint(r, "unwritten")
    assert "never written" in r.diagnosis() and "S_q is not a multiple of 32" in r.diagnosis()


# A dK/dV kernel with one program per (key block, query block) tile that adds its share into
# dK and dV with tl.atomic_add. On a GPU the scheduler decides the order of those additions;
# the interpreter runs programs in order, so the launcher shuffles the tile order each call
# to play the scheduler's part. The sums come out right up to rounding, in different bits.
@triton.jit
def _tile_atomic_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, ORDER,
                             sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                             sob, soh, sos, sod, slb, slh, sls, sdb, sdh, sds,
                             H, S_q, S_k, HEAD_DIM, scale, N_M,
                             CAUSAL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                             DOT_PRECISION: tl.constexpr):
    t = tl.load(ORDER + tl.program_id(0))
    pid_n = t // N_M
    pid_m = t % N_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    rm = offs_m < S_q
    cn = offs_n < S_k
    dd = offs_d < HEAD_DIM
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=rm[:, None] & dd[None, :], other=0.0)
    do = tl.load(DO + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :] * sod, mask=rm[:, None] & dd[None, :], other=0.0)
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * sks + offs_d[None, :] * skd, mask=cn[:, None] & dd[None, :], other=0.0)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svs + offs_d[None, :] * svd, mask=cn[:, None] & dd[None, :], other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + offs_m * sls, mask=rm, other=0.0)
    delta = tl.load(DELTA + b * sdb + h * sdh + offs_m * sds, mask=rm, other=0.0)
    sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale
    vis = rm[None, :] & cn[:, None]
    if CAUSAL:
        vis = vis & (offs_n[:, None] <= offs_m[None, :])
    pT = tl.where(vis, tl.exp(sT - lse[None, :]), 0.0)
    dv = tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    dk = tl.dot((pT * (dpT - delta[None, :])).to(q.dtype), q, input_precision=DOT_PRECISION) * scale
    out = (b * H + h) * S_k * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.atomic_add(DK + out, dk, mask=cn[:, None] & dd[None, :])
    tl.atomic_add(DV + out, dv, mask=cn[:, None] & dd[None, :])


def launch_tile_atomic(q, k, v, do, lse, delta, dk, dv, causal, scale):
    B, H, S_q, D = q.shape
    S_k = k.shape[2]
    BLOCK = 16
    n_m, n_n = triton.cdiv(S_q, BLOCK), triton.cdiv(S_k, BLOCK)
    order = torch.randperm(n_m * n_n, device=q.device).to(torch.int32)
    acc_k = torch.zeros(B, H, S_k, D, dtype=torch.float32, device=q.device)
    acc_v = torch.zeros_like(acc_k)
    _tile_atomic_dkdv_kernel[(n_m * n_n, B * H)](
        q, k, v, do, lse, delta, acc_k, acc_v, order, *q.stride(), *k.stride(), *v.stride(),
        *do.stride(), *lse.stride(), *delta.stride(), H, S_q, S_k, D, scale, n_m,
        CAUSAL=causal, BLOCK=BLOCK, BLOCK_D=max(16, triton.next_power_of_2(D)),
        DOT_PRECISION=flashattn.runtime.dot_precision(q.dtype))
    dk.copy_(acc_k)
    dv.copy_(acc_v)


def test_dkdv_race_is_named():
    # the two repeated cases are what reveals the race; the others only cost time here
    cases = [c for c in check.BATTERY if c.repeat]
    # fp32 outputs: rounding the fp32 atomics' sums to fp16 could hide their last bits
    r = run_checker(check.dkdv_kernel, launch_tile_atomic, cases=cases, dtype=torch.float32)
    assert_hint(r, "race")


def test_origin_lists_the_kernels_a_launcher_uses():
    lines, _ = check.describe_origin(launch_tile_atomic, "your launcher")
    assert any("kernel `_tile_atomic_dkdv_kernel`" in l for l in lines)


def test_kernel_still_raising_not_implemented_is_not_run():
    @triton.jit
    def todo_kernel(X):
        # YOUR CODE HERE
        raise NotImplementedError()

    def launch(q, k, v, do, lse, delta, dq, causal, scale):
        todo_kernel[(1,)](dq)

    with pytest.raises(AssertionError, match="not implemented yet"):
        check.dq_kernel(launch, show=False)


@pytest.fixture
def gpu_evidence(monkeypatch):
    """What the checker sees on a GPU: no record of which loads went past the end, and no count of
    wild accesses (the interpreter still fences them off, so the process survives)."""
    import contextlib
    from flashattn.check import runner
    fence = runner.fence_wild_access

    @contextlib.contextmanager
    def unrecorded_fence():
        with fence():
            yield {"loads": 0, "stores": 0}

    @contextlib.contextmanager
    def no_read_record(inputs):
        yield set()

    monkeypatch.setattr(runner, "fence_wild_access", unrecorded_fence)
    monkeypatch.setattr(runner, "watch_guard_reads", no_read_record)


@pytest.mark.parametrize("bug", ["dq.batch_head_swapped", "dq.q_row_stride_typo"])
def test_memory_diagnoses_from_a_gpus_evidence(bug, gpu_evidence):
    """On a GPU the same planted bugs are named from what stores and NaN guards show."""
    hint, phrase = DQ_BUGS[bug]
    with planted.plant(bug):
        r = run_checker(check.dq_kernel, launch_dq_direct)
    assert_hint(r, hint)
    assert phrase in " ".join(r.diagnosis().split()), r.diagnosis()


def test_lengths_swapped_from_a_gpus_evidence(gpu_evidence):
    r = run_checker(check.dq_kernel, launch_dq_lengths_swapped)
    assert_hint(r, "lengths_swapped")
    assert "written past their end" in " ".join(r.diagnosis().split()), r.diagnosis()


# --------------------------------------------------------------------------------------
# generic diagnoses: the structure of the outputs, one tensor in another's place, slips
# --------------------------------------------------------------------------------------
GENERIC_BUGS = {
    "dq.dp_from_q": (check.dq_kernel, "wrong_argument", "Q in place of dO in dP = dO V^T"),
    "dq.ds_precedence": (check.dq_kernel, "ds_precedence", "match that computation"),
    "dq.exp_minus_lse": (check.dq_kernel, "exp_minus_lse", "match that computation"),
    "dkdv.ds_precedence": (check.dkdv_kernel, "ds_precedence", "match that computation"),
    "dkdv.dk_stored_to_dv": (check.dkdv_kernel, "never_stored", "dK never written, in any element"),
    "dkdv.dv_stored_to_dk": (check.dkdv_kernel, "never_stored", "dK holds the right dV instead"),
    "dkdv.dk_holds_dv": (check.dkdv_kernel, "equals_output", "dK equals your dV"),
}


@pytest.mark.parametrize("bug", list(GENERIC_BUGS))
def test_generic_diagnoses_kernels(bug):
    checker, hint, phrase = GENERIC_BUGS[bug]
    with planted.plant(bug):
        r = run_checker(checker, launch_dq_direct if checker is check.dq_kernel else launch_dkdv_direct)
    assert_hint(r, hint)
    assert phrase in " ".join(r.diagnosis().split()), r.diagnosis()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_head_modulo_group_is_named(dtype, evidence):
    """h % GROUP_SIZE: every head reads K/V head 0 without GQA, heads 0, 1, 0, 1 with a group of 2,
    and past the end of K/V with a group of 3 (the package's launcher passes GROUP_SIZE). On a GPU
    no load is recorded: the NaN-origin search names K and V instead."""
    with planted.plant("dq.kv_head_mod_group"):
        r = run_checker(check.dq_kernel, launch_dq, gqa=True, dtype=dtype)
    assert_hint(r, "kv_head")
    assert "it fits h_kv = h % GROUP_SIZE" in " ".join(r.diagnosis().split()), r.diagnosis()


def test_group_loop_stopping_early_is_named():
    """range(GROUP_SIZE - 1): dK = dV = 0 without GQA, part of each group with it."""
    with planted.plant("dkdv.group_loop_short"):
        r = run_checker(check.dkdv_kernel, launch_dkdv_direct, gqa=True)
    assert_hint(r, "output_zero")
    assert "of each group of 2 only" in " ".join(r.diagnosis().split()), r.diagnosis()


def test_dkdv_grid_sized_by_s_q_is_named():
    def launch(q, k, v, do, lse, delta, dk, dv, causal, scale):
        B, H, S_q, D = q.shape
        H_kv = k.shape[1]
        backward.attn_bwd_dkdv_kernel[(triton.cdiv(S_q, BLOCK), B * H_kv)](      # cdiv(S_k, ...) belongs
            q, k, v, do, lse, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *lse.stride(), *delta.stride(), *dk.stride(), *dv.stride(), H_kv, H // H_kv, S_q, k.shape[2], D,
            scale, **_common(q, k, scale, causal))
    r = run_checker(check.dkdv_kernel, launch)
    assert_hint(r, "grid_length")
    assert "a grid of cdiv(S_q, 32) blocks" in " ".join(r.diagnosis().split()), r.diagnosis()


def test_dkdv_group_of_interleaved_heads_is_named_with_its_map():
    """h = g * GROUP_SIZE + h_kv in the dK/dV loop: each K/V head sums the wrong query heads,
    and the evidence shows which (gqa, with the map)."""
    with planted.plant("dkdv.group_interleaved"):
        r = run_checker(check.dkdv_kernel, launch_dkdv_direct, gqa=True)
    assert_hint(r, "gqa")
    text = " ".join(r.diagnosis().split())
    assert "K/V head 0: query heads [0, 2]" in text and "g * GROUP_SIZE + h_kv" in text, r.diagnosis()


def launch_dq_grid_over_kv_heads(q, k, v, do, lse, delta, dq, causal, scale):
    """A dQ grid of B * H_kv programs: under GQA the query heads of the missing programs."""
    B, H, S_q, D = q.shape
    backward.attn_bwd_dq_kernel[(triton.cdiv(S_q, BLOCK), B * k.shape[1])](
        q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *lse.stride(), *delta.stride(), *dq.stride(), H, H // k.shape[1], S_q, k.shape[2], D, scale,
        **_common(q, k, scale, causal))


def test_dq_grid_over_kv_heads_is_named():
    """A dQ grid of B * H_kv programs under GQA: the query heads of the missing programs are
    never written, the others are right (grid_heads, not a wrong head index)."""
    r = run_checker(check.dq_kernel, launch_dq_grid_over_kv_heads, gqa=True)
    assert_hint(r, "grid_heads")
    assert "B * H_kv programs ran" in " ".join(r.diagnosis().split()), r.diagnosis()


def test_dq_loop_on_the_first_key_block_is_named():
    """Every iteration loads key block 0 (offsets not from the loop variable): key_blocks."""
    with planted.plant("dq.same_key_tile"):
        r = run_checker(check.dq_kernel, launch_dq_direct)
    assert_hint(r, "key_blocks")


def test_launcher_writing_into_its_input_is_named():
    """q scaled in place by the launcher: a second run would see other inputs (not a race)."""
    def launch(q, k, v, do, lse, delta, dq, causal, scale):
        q.mul_(scale)
        launch_dq_direct(q, k, v, do, lse, delta, dq, causal, 1.0)
    r = run_checker(check.dq_kernel, launch)
    assert_hint(r, "input_modified")
    text = " ".join(r.diagnosis().split())
    assert "scaled by 0.1768 = the softmax scale" in text, text
