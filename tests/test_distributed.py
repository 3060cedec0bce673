"""Ring attention (flashattn.distributed) on the CPU: 2 and 3 gloo processes against single-process
attention in float64, per head, forward and gradients; the layouts' bookkeeping; the merge; the
errors. The processes are spawned once per group size (a few seconds each to start) and run every
case; each case is reported as a test of its own.

The GPU twin, NCCL on 2 and 4 GPUs at realistic sizes, is tests/test_distributed_gpu.py
(``python -m flashattn.distributed.selftest``).
"""
import json

import pytest
import torch
import torch.distributed as dist

from flashattn import runtime
from flashattn.distributed import layout, merge_, ring_attention, shard, unshard, workers
from flashattn.distributed.checks import backend_carries
from flashattn.distributed.workers import case, case_name

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch has no torch.distributed with gloo")

# Whole sequences of S tokens. Odd-ish lengths where the layout allows: a contiguous shard of 7 or
# 5 tokens, zigzag chunks of 5, 3 or 7 tokens; one case longer than the interpreter's 32-row tiles.
# fp64 shows the exactness (~1e-15); impl="fast" runs the GPU path's kernels in the interpreter.
F32, F16, F64 = torch.float32, torch.float16, torch.float64
CASES = {
    2: [case(S=14, causal=c, layout="contiguous") for c in (False, True)]
       + [case(S=20, H=4, H_kv=2, causal=c, layout="zigzag") for c in (False, True)]
       + [case(S=12, H=4, H_kv=2, causal=True, layout="zigzag", dtype=F64, seed=1),
          case(S=76, B=2, causal=True, layout="zigzag", dtype=F16, seed=2),
          case(S=20, causal=True, layout="zigzag", dtype=torch.bfloat16, seed=3),
          case(S=20, H=4, H_kv=2, causal=True, layout="zigzag", dtype=F16, impl="fast", seed=4),
          case(S=14, D=24, causal=True, layout="contiguous", impl="fast", seed=5)],
    3: [case(S=15, H=4, H_kv=2, causal=c, layout="contiguous") for c in (False, True)]
       + [case(S=18, causal=c, layout="zigzag") for c in (False, True)]
       + [case(S=42, H=4, H_kv=2, causal=True, layout="zigzag", dtype=F64, seed=1),
          case(S=21, causal=True, layout="contiguous", dtype=F16, impl="fast", seed=2)],
}
PARAMS = [(world, c) for world, cases in CASES.items() for c in cases]


@pytest.fixture(scope="module")
def ring_results():
    """{world: {case name: {tensor: worst head's error over the ranks}}}, one spawn per world."""
    return {world: workers.worst(workers.spawn(workers.check_cases, world, cases)) for world, cases in CASES.items()}


@pytest.mark.parametrize("world, c", PARAMS, ids=[f"W{w}-{case_name(c)}" for w, c in PARAMS])
def test_ring_matches_single_process_attention(ring_results, world, c):
    errors = ring_results[world][case_name(c)]
    tol = workers.tolerance(c["dtype"])
    assert set(errors) == {"O", "dQ", "dK", "dV", "O gathered"}
    bad = {t: e for t, e in errors.items() if not e <= tol}
    assert not bad, f"worst head rel err above {tol:.0e}: {bad} (all: {errors})"


def test_pass_line_reads_the_results():
    cases = [case(S=8)]
    fine = [{case_name(cases[0]): {"O": torch.full((1, 2), 1e-7)}}]
    assert workers.pass_line(fine, cases).splitlines()[-1].startswith("PASS")
    bad = [{case_name(cases[0]): {"O": torch.tensor([[1e-7, float("nan")]])}}]
    assert workers.pass_line(bad, cases).splitlines()[-1].startswith("FAIL")


# --------------------------------------------------------------------------------------
# errors: every rank raises, none hangs, and the group still works afterwards
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def refusals():
    return workers.spawn(workers.refusals, 2)


@pytest.mark.parametrize("what, kind, words", [
    ("unequal lengths", "ValueError", "same length"),
    ("odd zigzag shard", "ValueError", "even length"),
    ("shard: S not divisible by 2W", "ValueError", "divisible by 4"),
    ("group not a group", "TypeError", "ProcessGroup"),
    ("inputs on two devices", "ValueError", "one device"),
    ("backend cannot move them", "ValueError", "cannot move tensors on meta"),
    ("unknown layout", "ValueError", "'zigzag'"),
    ("causal on one rank only", "ValueError", "same is_causal"),
    ("unshard: unequal shards", "ValueError", "same shape"),
    ("bf16 in the interpreter", "BF16FallbackWarning", "fp32"),
])
def test_every_rank_gets_the_error(refusals, what, kind, words):
    for rank, outcomes in enumerate(refusals):
        got_kind, message = outcomes[what]
        assert got_kind == kind and words in message, f"rank {rank}, {what}: {got_kind}: {message}"


def test_one_rank_refusing_stops_the_others_too(refusals):
    assert refusals[1]["one rank's bad dtype"][0] == "TypeError"      # its own error
    kind, message = refusals[0]["one rank's bad dtype"]                 # and rank 0 is told, not left waiting
    assert kind == "ValueError" and "rank(s) [1]" in message, message


def test_a_bad_impl_on_one_rank(refusals):
    assert refusals[0]["unknown impl"][0] == "ValueError" and "impl must be" in refusals[0]["unknown impl"][1]
    assert "rank(s) [0]" in refusals[1]["unknown impl"][1]


def test_a_group_this_process_is_not_in(refusals):
    kind, message = refusals[1]["not a member"]
    assert kind == "ValueError" and "not a member" in message, message
    assert float(refusals[0]["ring of one"][1]) < 1e-5               # the group of rank 0 alone: plain attention


def test_the_group_survives_the_errors(refusals):
    for outcomes in refusals:
        assert float(outcomes["good call after the errors"][1]) < 1e-5


def test_no_process_group():
    assert not dist.is_initialized()
    q = torch.randn(1, 2, 8, 16)
    for call in (lambda: ring_attention(q, q, q), lambda: shard(q), lambda: unshard(q)):
        with pytest.raises(ValueError, match="init_process_group"):
            call()


def test_backends_and_devices():
    assert backend_carries("nccl", "cuda") and not backend_carries("nccl", "cpu")
    assert backend_carries("gloo", "cpu") and not backend_carries("gloo", "cuda")
    assert backend_carries("cpu:gloo,cuda:nccl", "cuda") and backend_carries("cpu:gloo,cuda:nccl", "cpu")
    assert backend_carries("ucc", "cuda")            # unknown backends: no verdict


# --------------------------------------------------------------------------------------
# the layouts' bookkeeping (no processes)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("lay", layout.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_plans_compute_exactly_the_visible_pairs(lay, world):
    """block_plan's part of every (rank, source) block holds every visible pair, and the kernels'
    count of computed pairs equals the visible ones: nothing skipped that a query sees."""
    S = 2 * world * 3
    for causal in (False, True):
        total = 0
        for r in range(world):
            for s in range(world):
                visible = layout.visible_pairs(r, s, world, lay, causal, S)
                assert layout.computed_pairs(r, s, world, lay, causal, S) == visible, (r, s, causal)
                total += visible
        assert total == (S * (S + 1) // 2 if causal else S * S)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(world):
    S = 2 * world * 16
    zigzag = layout.work_per_rank(world, "zigzag", True, S)
    contiguous = layout.work_per_rank(world, "contiguous", True, S)
    assert len(set(zigzag)) == 1 and sum(zigzag) == sum(contiguous) == S * (S + 1) // 2
    assert contiguous == sorted(contiguous) and contiguous[-1] > contiguous[0] * (2 * world - 2)


@pytest.mark.parametrize("lay", layout.LAYOUTS)
def test_cut_and_paste_are_inverse(lay):
    world, S = 3, 18
    x = torch.arange(2 * S * 4).reshape(2, 1, S, 4)
    shards = [layout.cut(x, r, world, lay, 2) for r in range(world)]
    assert torch.equal(layout.paste(shards, world, lay, 2), x)
    for r, part in enumerate(shards):     # each shard holds exactly its positions
        assert torch.equal(part[0, 0, :, 0] // 4, layout.positions(r, world, S, lay))
    assert layout.chunks_of(1, 3, "zigzag") == (1, 4)


# --------------------------------------------------------------------------------------
# the merge of partial results (lesson 02's identity), in one process
# --------------------------------------------------------------------------------------
def test_merge_equals_attention_over_all_keys():
    torch.manual_seed(0)
    s = torch.randn(2, 3, 5, 40, dtype=torch.float64)          # scores of 40 keys
    v = torch.randn(2, 3, 40, 8, dtype=torch.float64)
    whole = torch.softmax(s, -1) @ v
    out, lse = None, None
    for keys in (slice(0, 13), slice(13, 31), slice(31, 40)):  # three blocks of keys
        o_b = torch.softmax(s[..., keys], -1) @ v[:, :, keys]
        lse_b = torch.logsumexp(s[..., keys], -1)
        if out is None:
            out, lse = o_b.clone(), lse_b.clone()
        else:
            merge_(out, lse, o_b, lse_b)
    assert torch.allclose(out, whole, atol=1e-14) and torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-14)


def test_merge_is_safe_far_apart():
    """LSEs 1e4 apart: exp(LSE) overflows in any dtype, the sigmoid / log1p forms do not."""
    out = torch.ones(1, 1, 2, 4)
    lse = torch.tensor([[[1e4, -1e4]]])
    merge_(out, lse, torch.full((1, 1, 2, 4), 3.0), torch.tensor([[[0.0, 0.0]]]))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.allclose(out[0, 0, 0], torch.ones(4)) and torch.allclose(out[0, 0, 1], torch.full((4,), 3.0))
    assert lse[0, 0, 0] == 1e4 and lse[0, 0, 1] == 0.0


# --------------------------------------------------------------------------------------
# the GPU side's plumbing, on the CPU: the benchmark (gloo, the interpreter), its arithmetic,
# the self-test's report
# --------------------------------------------------------------------------------------
@pytest.mark.skipif(not runtime.INTERPRET, reason="--dry-run-cpu is the bench's plumbing on a machine without a GPU; "
                    "on GPUs, python -m flashattn.distributed.bench --quick runs the bench itself")
def test_bench_runs_end_to_end_on_the_cpu(tmp_path):
    from flashattn.distributed import bench

    assert bench.main(["--dry-run-cpu", "--quick", "--out", str(tmp_path), "--name", "dry"]) == 0
    result = json.loads((tmp_path / "dry.json").read_text())
    measured = {(r["world"], r["provider"], r["S"]) for r in result["rows"] if "ms" in r}
    assert measured == {(1, "ring", 32), (1, "flashattn", 32), (1, "ring", 64), (1, "flashattn", 64),
                        (2, "ring", 32), (2, "ring", 64)}, result["rows"]
    assert {(o["world"], o["S"]) for o in result["overlap"]} == {(2, 32), (2, 64)}
    assert all("efficiency" in r for r in result["rows"] if "ms" in r)
    assert result["environment"]["command"].startswith("python -m flashattn.distributed.bench")
    assert "device" in result["environment"] and not result["errors"]


def test_search_longest():
    from flashattn.distributed.bench import search_longest

    fits_below = lambda limit: (lambda S: (S < limit, 1000.0 * (S / 1024) ** 2 / 64))   # noqa: E731
    found = search_longest(fits_below(600 * 1024), 128 * 1024, 4096, limit_s=1e9)
    assert [t["S"] // 1024 for t in found["tried"]] == [128, 256, 512, 1024, 768]
    assert found["longest_S"] == 512 * 1024 and "out of memory at S = 786432" in found["stopped_by"]
    found = search_longest(fits_below(10 ** 9), 128 * 1024, 4096, limit_s=2000)
    assert found["longest_S"] == 256 * 1024 and found["stopped_by"].startswith("time limit")
    assert search_longest(fits_below(1), 1024, 1024, 1e9)["longest_S"] is None


def test_bench_arithmetic():
    from flashattn.distributed.bench import efficiency, format_table, memory_fit

    rows = [dict(world=w, provider=p, S=S, S_local=S // w, ms=ms, peak_gb=1 + S / w / 1e4, tokens_per_s_per_gpu=1.0,
                 tflops_per_gpu=1.0)
            for w, p, S, ms in [(1, "ring", 8192, 100.0), (2, "ring", 8192, 55.0), (2, "cp-cudnn", 8192, 44.0),
                                (1, "ring", 16384, 400.0), (2, "ring", 16384, 205.0)]]
    rows = efficiency(rows)
    two = {(r["S"], r["provider"]): r for r in rows if r["world"] == 2}
    assert two[8192, "ring"]["efficiency"] == pytest.approx(100 / 110)
    assert two[8192, "ring"]["speed_vs_cp-cudnn"] == pytest.approx(44 / 55)
    fit = {f["world"]: f for f in memory_fit(rows, gpu_memory_gb=80)}
    assert fit[1]["gb_fixed"] == pytest.approx(1) and fit[1]["estimated_longest_S"] == int((76 - 1) * 1e4)
    table = format_table({"rows": rows, "memory_fit": list(fit.values())})
    assert "91%" in table and "0.80x" in table and "estimated longest" in table


def test_selftest_report():
    from flashattn.distributed import selftest

    cases = [case(S=16, dtype=torch.bfloat16)]
    errors = {t: torch.full((1, 2), 1e-3) for t in ("O", "dQ", "dK", "dV", "O gathered")}
    errors.update({f"one device: {t}": torch.full((1, 2), 2e-3) for t in ("O", "dQ", "dK", "dV")})
    good = selftest.report(2, cases, [{case_name(cases[0]): errors}] * 2, 1.0, "GPU")
    assert good.ok and good.text.splitlines()[-1].startswith("PASS")
    errors["dK"] = torch.tensor([[1e-3, 0.5]])
    bad = selftest.report(2, cases, [{case_name(cases[0]): errors}] * 2, 1.0, "GPU")
    assert not bad.ok and "FAIL" in bad.text.splitlines()[1]
