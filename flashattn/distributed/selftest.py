"""python -m flashattn.distributed.selftest: ring attention with NCCL on 2 and 4 GPUs of one host, at
realistic sizes, against one GPU.

For each GPU count W (default: 2 and 4, those the host has), W processes (one per GPU, NCCL) run
every case: the same whole inputs on every rank, the float64 reference of the whole sequence
(one head at a time), ring attention forward and backward on the rank's shard, and
``flashattn.flash_attention`` on the whole sequence on that one GPU. A case passes when every
head of every rank's O, dQ, dK, dV is within the single-device tests' tolerance of the float64
reference (fp16 5e-3, bf16 3e-2, fp32 2e-5; tests/conftest.py); the one-GPU errors are printed
beside the ring's, so the two can be compared. Exit status 0 when all pass, 1 otherwise, 2 when
there are fewer than 2 GPUs. ``pytest -n 0 tests/test_distributed_gpu.py`` runs the same.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from . import workers
from .workers import case, case_name

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
TENSORS = ("O", "dQ", "dK", "dV")


def gpu_cases(world: int, quick: bool = False) -> list[dict]:
    """Realistic shapes (S is the whole sequence). Both layouts, causal and not, GQA, fp16 / bf16 /
    fp32, head dims 64, 96 (padded) and 128, shards of 1000 tokens (not a multiple of any tile),
    and the lesson kernels on the GPU once."""
    if quick:
        return [case(B=1, H=8, S=4096, D=128, causal=True, layout="zigzag", dtype=BF16),
                case(B=1, H=8, H_kv=2, S=world * 1000, D=64, causal=True, layout="contiguous", dtype=F16, seed=1)]
    return [
        case(B=1, H=16, S=16384, D=128, causal=True, layout="zigzag", dtype=BF16),
        case(B=1, H=16, H_kv=4, S=8192, D=128, causal=True, layout="zigzag", dtype=F16, seed=1),
        case(B=2, H=8, S=8192, D=64, causal=True, layout="contiguous", dtype=BF16, seed=2),
        case(B=1, H=16, S=8192, D=128, causal=False, layout="zigzag", dtype=BF16, seed=3),
        case(B=1, H=8, H_kv=2, S=4096, D=128, causal=False, layout="contiguous", dtype=F16, seed=4),
        case(B=1, H=8, S=4096, D=64, causal=True, layout="zigzag", dtype=F32, seed=5),
        case(B=1, H=4, S=world * 1000, D=128, causal=True, layout="contiguous", dtype=BF16, seed=6),
        case(B=1, H=4, S=world * 1000, D=128, causal=True, layout="zigzag", dtype=F16, seed=7),
        case(B=1, H=4, S=4096, D=96, causal=True, layout="zigzag", dtype=BF16, seed=8),
        case(B=1, H=8, S=4096, D=64, causal=True, layout="zigzag", dtype=F16, impl="teaching", seed=9),
    ]


def gpu_worker(rank: int, world: int, cases: list) -> tuple:
    """One rank of the self-test (run by ``workers.spawn`` with NCCL): every case, ring and one
    GPU. Returns (the GPU's name, {case: errors})."""
    out = {}
    for c in cases:
        out[case_name(c)] = workers.run_case(c, one_device=True)
        torch.cuda.empty_cache()          # the float64 reference of a long case is large
    return torch.cuda.get_device_name(), out


@dataclass
class Report:
    world: int
    ok: bool
    text: str
    seconds: float


def report(world: int, cases: list, results: list, seconds: float, device: str) -> Report:
    errors = workers.worst(results)
    lines = [f"ring attention, NCCL, {world} GPUs ({device}), worst head's relative error "
             f"against float64 over every rank: ring | one GPU (flash_attention on the whole sequence)"]
    ok = True
    for c in cases:
        e, tol = errors[case_name(c)], workers.tolerance(c["dtype"])
        ring_ok = all(e[t] <= tol for t in TENSORS) and e["O gathered"] <= tol
        ok &= ring_ok
        ring = " ".join(f"{t} {e[t]:.1e}" for t in TENSORS)
        one = " ".join(f"{t} {e['one device: ' + t]:.1e}" for t in TENSORS)
        lines.append(f"{'ok  ' if ring_ok else 'FAIL'} {case_name(c)} (tol {tol:.0e}): {ring} | {one}")
    lines.append(f"{'PASS' if ok else 'FAIL'}: {world} GPUs, {len(cases)} cases, forward and gradients, "
                 f"within the single-device tolerances ({seconds:.0f} s)")
    return Report(world, ok, "\n".join(lines), seconds)


def run(world: int, quick: bool = False) -> Report:
    """The self-test on ``world`` GPUs (needs that many)."""
    if torch.cuda.device_count() < world:
        raise RuntimeError(f"the self-test on {world} GPUs needs {world}, this host has {torch.cuda.device_count()}")
    cases = gpu_cases(world, quick)
    t0 = time.perf_counter()
    results = workers.spawn(gpu_worker, world, cases, backend="nccl", timeout_s=600)
    return report(world, cases, [errors for _, errors in results], time.perf_counter() - t0, results[0][0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.distributed.selftest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=None,
                    help="GPU counts to test (default: 2 and 4, those this host has)")
    ap.add_argument("--quick", action="store_true", help="two small cases per GPU count")
    args = ap.parse_args(argv)
    have = torch.cuda.device_count()
    if have < 2:
        print(f"ring attention over NCCL needs 2 or more GPUs; this host has {have}. "
              "(On the CPU: pytest -n 0 tests/test_distributed.py runs the gloo tests.)", file=sys.stderr)
        return 2
    counts = args.gpus or [w for w in (2, 4) if w <= have]
    ok = True
    for world in counts:
        if world > have:
            print(f"skipped: {world} GPUs asked for, this host has {have}")
            ok = False
            continue
        result = run(world, args.quick)
        print(result.text, flush=True)
        ok &= result.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
