"""python -m flashattn.distributed.bench: ring attention on 1, 2 and 4 GPUs next to PyTorch's
``context_parallel``, forward + backward, bf16, D = 128, causal (on a GPU host; NCCL).

For each GPU count W, W processes (one per GPU) time, per sequence length S and in turn (rounds,
so that every provider meets the same drift of the clocks):

* ``ring``: :func:`flashattn.distributed.ring_attention`, zigzag layout (its input check, one
  small all-gather per call, included);
* ``cp-cudnn`` / ``cp-flash``: ``torch.distributed.tensor.experimental.context_parallel`` with
  SDPA's cuDNN / flash backend, on the same zigzag shards (its load balancer's head-tail order is
  the zigzag layout; checked: its output is compared with the ring's). On 1 GPU: plain SDPA
  with that backend;
* ``flashattn``: on 1 GPU only, ``flashattn.flash_attention`` on the whole sequence (the ring's
  kernels without the ring).

A step is ``torch.autograd.grad`` of the output; its time is the slowest rank's (CUDA events),
the median of the rounds. Reported per GPU: tokens/s, TFLOP/s (4 B H S^2 D x 0.5 causal x 3.5
fwd+bwd, divided by W), peak memory (torch.cuda.max_memory_allocated, the slowest rank's), and
the scaling efficiency t_1 / (W t_W) against the same provider on 1 GPU. For the ring on W > 1
GPUs, the overlap: the same step with the transfers alone (no kernels) and the kernels alone
(no transfers). ``--longest`` instead finds the longest sequence that trains (one step fits)
per GPU count, doubling S per GPU until out of memory or a time limit.

Results: JSON in runs/ (git-ignored) or ``--out results``; a table at the end. ``--quick``:
S = 8k and 16k on 1 and 2 GPUs, one round, a minute or two.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from . import workers

PROVIDERS = ("ring", "cp-cudnn", "cp-flash", "flashattn")
ONE_GPU_ONLY = ("flashattn",)


def _device() -> str:
    """"cuda"; "cpu" only for ``--dry-run-cpu`` (gloo, the interpreter: the plumbing, not the numbers)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def step_flops(B, H, S, D, causal=True) -> float:
    """Forward + backward FLOPs of one attention step over the whole sequence (matrix products)."""
    return 4.0 * B * H * S * S * D * (0.5 if causal else 1.0) * 3.5


# --------------------------------------------------------------------------------------
# what each provider runs (inside a rank's process)
# --------------------------------------------------------------------------------------
def _cp_context(world: int, mesh):
    """context_parallel on ``mesh``. Its buffers are what it shards in place; our inputs are
    already zigzag shards, so it is handed a dummy of 2W positions (which also turns on its
    head-tail load balancer: the zigzag layout)."""
    from torch.distributed.tensor.experimental import context_parallel

    dummy = torch.zeros(1, 1, 2 * world, 1, device=_device())
    return context_parallel(mesh, buffers=[dummy], buffer_seq_dims=[2], no_restore_buffers={dummy})


def make_step(provider: str, world: int, mesh, q, k, v, do):
    """(step, around): ``step()`` runs one forward + backward of ``provider`` on this rank's shards;
    ``around()`` is the context a run of steps needs (context_parallel's, entered once per
    measurement, outside the timed region: the benefit of the doubt to PyTorch's path)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..api import flash_attention
    from .ring import ring_attention

    if provider == "ring":
        return (lambda: torch.autograd.grad(ring_attention(q, k, v, is_causal=True, layout="zigzag"), (q, k, v), do),
                contextlib.nullcontext)
    if provider == "flashattn":
        return lambda: torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do), contextlib.nullcontext
    backend = {"cp-cudnn": SDPBackend.CUDNN_ATTENTION, "cp-flash": SDPBackend.FLASH_ATTENTION}[provider]

    def step():
        with sdpa_kernel([backend]):
            # looked up at call time: context_parallel replaces F.scaled_dot_product_attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), do)
    return step, (lambda: _cp_context(world, mesh)) if world > 1 else contextlib.nullcontext


def ring_modes(world: int, q, k, v, do) -> dict:
    """The ring's step three ways, for the overlap: whole, transfers alone, kernels alone (no input
    check: the internal functions)."""
    import torch.distributed as dist

    from .ring import Ring, pick_kernels, ring_backward, ring_forward

    ring, kernels, scale = Ring(dist.group.WORLD), pick_kernels("auto", q.dtype, q.shape[-1]), q.shape[-1] ** -0.5

    def mode(communicate, compute):
        @torch.no_grad()
        def step():
            out, lse = ring_forward(ring, q, k, v, True, scale, "zigzag", kernels,
                                    communicate=communicate, compute=compute)
            return ring_backward(ring, do, q, k, v, out, lse, True, scale, "zigzag", kernels,
                                 communicate=communicate, compute=compute)
        return step
    return {"ring": mode(True, True), "transfers only": mode(True, False), "kernels only": mode(False, True)}


# --------------------------------------------------------------------------------------
# timing, collectively: every rank runs the same calls, the slowest rank's time counts
# --------------------------------------------------------------------------------------
def _slowest(value: float, op="max") -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return float(t.item())


def collectively(fn):
    """``fn()`` on every rank; if any rank runs out of GPU memory, every rank raises MemoryError
    (so that no rank goes on into a collective alone and waits forever)."""
    failed, result = 0.0, None
    try:
        result = fn()
    except torch.cuda.OutOfMemoryError:
        failed = 1.0
    if failed and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if _slowest(failed):
        raise MemoryError("out of memory on at least one rank")
    return result


def timed(step, iters: int, around=contextlib.nullcontext) -> tuple[float, float]:
    """(ms per step, peak GB) of ``iters`` steps inside ``around()``, the slowest rank's (CUDA
    events around the steps alone)."""
    import torch.distributed as dist

    def run():
        dist.barrier()
        with around():
            if _device() == "cpu":                            # --dry-run-cpu
                t0 = time.perf_counter()
                for _ in range(iters):
                    step()
                return (time.perf_counter() - t0) * 1e3 / iters, 0.0
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters, torch.cuda.max_memory_allocated() / 1e9

    ms, peak = collectively(run)
    return _slowest(ms), _slowest(peak)


def warm(step, around=contextlib.nullcontext) -> int:
    """Two untimed-for-the-record steps (the first compiles, allocates, plans); returns how many
    steps make about a second of measurement."""
    timed(step, 1, around)
    return _iters(timed(step, 1, around)[0])


def inputs(B, H, S_local, D, dtype, seed=0):
    """q, k, v (requiring gradients) and dO of one rank's shard; MemoryError on every rank if any
    rank cannot hold them."""
    def make():
        gen = torch.Generator(device=_device()).manual_seed(seed)
        q, k, v, do = (torch.randn(B, H, S_local, D, dtype=dtype, device=_device(), generator=gen) for _ in range(4))
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do
    return collectively(make)


def _iters(warm_ms: float, target_ms: float = 1000.0) -> int:
    return max(1, min(10, round(target_ms / max(warm_ms, 1e-3))))


def bench_worker(rank: int, world: int, cfg: dict) -> dict:
    """One rank of the timing sweep (run by ``workers.spawn``). Rank 0 returns the rows. A provider
    that fails (out of memory, or an error) is recorded and not run again in this sweep."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from tqdm.auto import tqdm

    cp = any(p.startswith("cp-") for p in cfg["providers"])
    mesh = init_device_mesh(_device(), (world,)) if world > 1 and cp else None
    dtype = getattr(torch, cfg["dtype"])
    B, H, D = cfg["B"], cfg["H"], cfg["D"]
    providers = [p for p in cfg["providers"] if world == 1 or p not in ONE_GPU_ONLY]
    rows, overlap, checks, failed = [], [], [], {}
    total = len(cfg["seqs"]) * (len(providers) * cfg["rounds"] + (3 if world > 1 and cfg["overlap"] else 0))
    bar = tqdm(total=total, desc=f"{world} GPU{'s' if world > 1 else ''}", disable=rank != 0, file=sys.stderr)
    for S in cfg["seqs"]:
        S_local = S // world
        try:
            q, k, v, do = inputs(B, H, S_local, D, dtype)
        except MemoryError:
            rows += [dict(world=world, provider=p, S=S, S_local=S_local, error="the inputs do not fit") for p in providers]
            bar.update(len(providers) * cfg["rounds"])
            continue
        steps = {p: make_step(p, world, mesh, q, k, v, do) for p in providers}
        times = {p: [] for p in providers}
        peaks, iters = {}, {}
        for _ in range(cfg["rounds"]):
            for p in providers:
                bar.update()
                if p in failed:
                    continue
                try:
                    if p not in iters:                      # the first time at this S: warm up
                        iters[p] = warm(*steps[p])
                    ms, peaks[p] = timed(steps[p][0], iters[p], steps[p][1])
                    times[p].append(ms)
                except MemoryError:
                    failed[p] = f"out of memory at S = {S}"
                except Exception as err:                    # noqa: BLE001 -- recorded; every rank raises alike
                    failed[p] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                bar.set_postfix_str(f"S={S // 1024}k {p}")
        for p in providers:
            row = dict(world=world, provider=p, S=S, S_local=S_local, B=B, H=H, D=D, dtype=cfg["dtype"])
            if times[p]:
                ms = statistics.median(times[p])
                row.update(ms=ms, rounds_ms=[round(t, 3) for t in times[p]], peak_gb=peaks[p], iters=iters[p],
                           tokens_per_s_per_gpu=B * S / (ms / 1e3) / world,
                           tflops_per_gpu=step_flops(B, H, S, D) / (ms / 1e3) / world / 1e12)
            else:
                row["error"] = failed.get(p, "not measured")
            rows.append(row)
        if world > 1 and S == cfg["seqs"][0] and {"ring", "cp-cudnn"} <= set(providers) - set(failed):
            try:
                checks.append(_same_output(world, mesh, q, k, v, S))
            except Exception as err:                        # noqa: BLE001 -- recorded
                checks.append({"world": world, "S": S, "error": f"{type(err).__name__}: {str(err)[:200]}"})
        if world > 1 and cfg["overlap"] and "ring" not in failed:
            overlap.append(_overlap(world, q, k, v, do, S, bar))
        del q, k, v, do, steps
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    bar.close()
    dist.barrier()
    return {"rows": rows, "overlap": overlap, "checks": checks, "environment": _environment()} if rank == 0 else {}


def _environment() -> dict:
    """What rank 0 runs on (taken there: the parent process stays off the GPUs, so that every rank
    has the same free memory)."""
    from ..bench import environment

    env = environment()
    if torch.cuda.is_available():
        env["gpu_memory_gb"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 1e9
    return env


def _same_output(world: int, mesh, q, k, v, S: int) -> dict:
    """The ring's output against context_parallel's (cuDNN) on the same shards: are they the same
    attention? (If the layouts differed, this error would be of order 1.)"""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .ring import ring_attention

    with torch.no_grad():
        ours = ring_attention(q, k, v, is_causal=True, layout="zigzag").float()
        with _cp_context(world, mesh), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
    err = _slowest(float((ours - theirs).norm() / theirs.norm()))
    return {"world": world, "S": S, "ring vs cp-cudnn output, relative error": err, "same": err < 3e-2}


def _overlap(world: int, q, k, v, do, S: int, bar) -> dict:
    modes = ring_modes(world, q, k, v, do)
    ms = {}
    for name, step in modes.items():
        ms[name] = timed(step, warm(step))[0]
        bar.update()
    whole, comm, compute = ms["ring"], ms["transfers only"], ms["kernels only"]
    B, H_kv, S_local, D = k.shape
    # bytes this rank sends per step: K, V forward and backward (W - 1 times each), dK, dV (fp32) W times
    sent = (2 * (world - 1) * 2 * k.element_size() + world * 2 * 4) * B * H_kv * S_local * D
    return {"world": world, "S": S, "ring_ms": whole, "transfers_only_ms": comm, "kernels_only_ms": compute,
            "exposed_transfer_ms": whole - compute, "hidden_fraction": (compute + comm - whole) / comm if comm else None,
            "transfer_GB_per_s": sent / (comm / 1e3) / 1e9}


# --------------------------------------------------------------------------------------
# the longest sequence that trains, per GPU count
# --------------------------------------------------------------------------------------
def search_longest(attempt, start: int, unit: int, limit_s: float) -> dict:
    """The longest S for which ``attempt(S)`` (one step: ``(fits, ms)``) fits: double S from
    ``start`` until a step does not fit, then try once halfway to the failure (rounded down to a
    multiple of ``unit``); stop early when the next doubling (4x a step's work per GPU, causal)
    would take longer than ``limit_s`` seconds. Returns {"longest_S", "stopped_by", "tried"}."""
    tried, fits, halfway, why = [], None, False, "not tried"
    S = start
    while True:
        ok, ms = attempt(S)
        tried.append({"S": S, "ok": ok, "ms": ms})
        if ok:
            fits = S
        else:
            why = f"out of memory at S = {S}"
        if halfway or (not ok and fits is None):
            break
        if not ok:                                           # one more try, halfway to the failure
            halfway, S = True, (fits + S) // 2 // unit * unit
            if S <= fits:
                break
            continue
        if ms * 4 / 1e3 > limit_s:
            why = f"time limit: the next doubling would take about {ms * 4 / 1e3:.0f} s a step"
            break
        S *= 2
    return {"longest_S": fits, "stopped_by": why, "tried": tried}


def longest_worker(rank: int, world: int, cfg: dict) -> dict:
    """One rank of ``--longest`` for one provider (one spawn each: should a rank fail alone, the
    group's timeout ends it, and only that provider's probe is lost)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(_device(), (world,)) if world > 1 and cfg["provider"].startswith("cp-") else None
    dtype, B, H, D, provider = getattr(torch, cfg["dtype"]), cfg["B"], cfg["H"], cfg["D"], cfg["provider"]
    peaks = {}

    def attempt(S):
        try:
            q, k, v, do = inputs(B, H, S // world, D, dtype)
            step, around = make_step(provider, world, mesh, q, k, v, do)
            ms, peaks[S] = timed(step, 1, around)
            return True, ms
        except MemoryError:
            return False, None

    found = search_longest(attempt, cfg["start_per_gpu"] * world, 2 * world * 1024, cfg["limit_s"])
    for t in found["tried"]:
        t["peak_gb"] = peaks.get(t["S"])
    return dict(found, world=world, provider=provider, environment=_environment()) if rank == 0 else {}


# --------------------------------------------------------------------------------------
# the command: spawn per GPU count, the JSON, the table
# --------------------------------------------------------------------------------------
def efficiency(rows: list[dict]) -> list[dict]:
    """Each measured row with its scaling efficiency t_1 / (W t_W) against the same provider on
    one GPU at the same S (ring: against the ring on one GPU, which is flash_attention's kernels
    plus the merge), and the ring's speed relative to each context_parallel backend."""
    by = {(r["world"], r["provider"], r["S"]): r for r in rows if "ms" in r}
    out = []
    for r in rows:
        r = dict(r)
        one = by.get((1, r["provider"], r["S"]))
        if "ms" in r and one:
            r["efficiency"] = one["ms"] / (r["world"] * r["ms"])
        if r["provider"] == "ring" and "ms" in r:
            for cp in ("cp-cudnn", "cp-flash"):
                other = by.get((r["world"], cp, r["S"]))
                if other:
                    r[f"speed_vs_{cp}"] = other["ms"] / r["ms"]
        out.append(r)
    return out


def _fill(env: dict, worker_env: dict) -> None:
    env.update({k: v for k, v in worker_env.items() if k not in env})


def memory_fit(rows: list[dict], gpu_memory_gb) -> list[dict]:
    """Per (GPU count, provider): peak memory per GPU as a + b S_local fitted to the sweep (least
    squares), and the S where it would reach 95% of the GPU's memory: an *estimate*, not a run."""
    out = []
    groups: dict = {}
    for r in rows:
        if r.get("peak_gb"):
            groups.setdefault((r["world"], r["provider"]), []).append((r["S_local"], r["peak_gb"]))
    for (world, provider), points in sorted(groups.items()):
        if len(points) < 2 or not gpu_memory_gb:
            continue
        mx, my = statistics.mean(p[0] for p in points), statistics.mean(p[1] for p in points)
        b = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-30)
        a = my - b * mx
        fit = {"world": world, "provider": provider, "gb_per_1k_tokens_per_gpu": b * 1024, "gb_fixed": a}
        if b > 0:
            fit["estimated_longest_S"] = int(world * (0.95 * gpu_memory_gb - a) / b)
        out.append(fit)
    return out


def _k(S: int) -> str:
    return f"{S // 1024}k" if S >= 1024 and S % 1024 == 0 else str(S)


def format_table(result: dict) -> str:
    rows = efficiency(result.get("rows", []))
    lines = ["GPUs  provider    S       ms/step   tokens/s/GPU  TFLOP/s/GPU  efficiency  peak GB/GPU  ring vs cp-cudnn / cp-flash"]
    for r in sorted(rows, key=lambda r: (r["world"], r["S"], PROVIDERS.index(r["provider"]))):
        if "ms" not in r:
            lines.append(f"{r['world']:>4}  {r['provider']:<10} {_k(r['S']):>5}   {r.get('error', '')}")
            continue
        eff = f"{r['efficiency']:.0%}" if "efficiency" in r else "-"
        vs = " / ".join(f"{r[f'speed_vs_{cp}']:.2f}x" for cp in ("cp-cudnn", "cp-flash") if f"speed_vs_{cp}" in r)
        lines.append(f"{r['world']:>4}  {r['provider']:<10} {_k(r['S']):>5} {r['ms']:>10.1f} {r['tokens_per_s_per_gpu']:>13,.0f}"
                     f" {r['tflops_per_gpu']:>12.0f} {eff:>11} {r['peak_gb']:>12.1f}  {vs}")
    if result.get("overlap"):
        lines.append("\noverlap of the ring's transfers with its kernels (fwd+bwd, ms): whole step | transfers alone | "
                     "kernels alone | exposed transfer time | share of the transfers hidden | GB/s sent per rank")
        for o in result["overlap"]:
            hidden = f"{o['hidden_fraction']:.0%}" if o["hidden_fraction"] is not None else "-"
            lines.append(f"{o['world']:>4} GPUs, S={_k(o['S'])}: {o['ring_ms']:.1f} | {o['transfers_only_ms']:.1f} | "
                         f"{o['kernels_only_ms']:.1f} | {o['exposed_transfer_ms']:.1f} | {hidden} | {o['transfer_GB_per_s']:.0f}")
    for c in result.get("checks", []):
        if "error" in c:
            lines.append(f"check, {c['world']} GPUs: ring vs context_parallel failed to run: {c['error']}")
            continue
        lines.append(f"check, {c['world']} GPUs, S={_k(c['S'])}: ring vs context_parallel (cuDNN) output, relative error "
                     f"{c['ring vs cp-cudnn output, relative error']:.1e}: {'the same attention' if c['same'] else 'DIFFERENT'}")
    for l in result.get("longest", []):
        longest = f"{l['longest_S']:,} tokens" if l.get("longest_S") else "none"
        lines.append(f"longest, {l['world']} GPU(s), {l['provider']}: {longest} ({l.get('stopped_by', l.get('error', ''))})")
    for f in result.get("memory_fit", []):
        if "estimated_longest_S" in f:
            lines.append(f"estimated longest, {f['world']} GPU(s), {f['provider']}: {f['estimated_longest_S']:,} tokens "
                         f"({f['gb_per_1k_tokens_per_gpu']:.2f} GB per 1k tokens per GPU, fitted to the sweep's peaks; not run)")
    for e in result.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def _output_path(args) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("ring_cpu_dry_run" if args.dry_run_cpu else "ring_" + _gpu_name())
    return out / f"{stem}{'_quick' if args.quick and not args.name else ''}.json"


def _gpu_name() -> str:
    """The GPU's name for the file name, from nvidia-smi (not torch: this process stays off the GPUs)."""
    import subprocess

    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        name = ""
    name = name.lower().replace("nvidia", "").strip()
    return "".join(c if c.isalnum() else "_" for c in name).strip("_") or "gpu"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.distributed.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU counts (default 1 2 4, those present)")
    ap.add_argument("--seqs", type=int, nargs="+", default=None,
                    help="whole sequence lengths (default 32768 65536 131072 262144)")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the providers in turn (median kept)")
    ap.add_argument("--no-overlap", action="store_true", help="skip the ring's overlap measurement")
    ap.add_argument("--longest", action="store_true",
                    help="instead of the sweep: the longest sequence one step fits, per GPU count (ring, cp-cudnn)")
    ap.add_argument("--start-per-gpu", type=int, default=131072, help="--longest: the first S per GPU")
    ap.add_argument("--limit-s", type=float, default=90.0, help="--longest: no step longer than this (seconds)")
    ap.add_argument("--quick", action="store_true", help="S = 8k and 16k on 1 and 2 GPUs, one round")
    ap.add_argument("--out", default="runs", help="folder for the JSON (runs/ is git-ignored; 'results' to commit)")
    ap.add_argument("--name", default=None, help="file stem (default ring_<device>)")
    ap.add_argument("--append", action="store_true", help="merge into the file's earlier results (other GPU counts)")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="check this script's plumbing on the CPU: gloo, the interpreter, tiny shapes, ring and flashattn "
                         "only, 1 and 2 processes; the numbers mean nothing")
    args = ap.parse_args(argv)
    have = torch.cuda.device_count()
    backend = "nccl"
    if args.dry_run_cpu:
        if have:
            ap.error("--dry-run-cpu is for machines without a GPU")
        have, backend = 2, "gloo"
        args.providers = [p for p in args.providers if not p.startswith("cp-")]
        args.seqs, args.batch, args.heads, args.head_dim = args.seqs or [32, 64], 1, 2, 16
        args.dtype, args.start_per_gpu, args.limit_s = "float16", 16, 0.0
    if have == 0:
        print("No GPU: this benchmark times NCCL ring attention on GPUs. (On the CPU, lesson 11 runs the ring "
              "with gloo.)", file=sys.stderr)
        return 2
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    gpus = args.gpus or ([1, 2] if args.quick else [1, 2, 4])
    skipped = [w for w in gpus if w > have]
    gpus = [w for w in gpus if w <= have]
    seqs = args.seqs or ([8192, 16384] if args.quick else [32768, 65536, 131072, 262144])
    for S in seqs:
        bad = [w for w in gpus if S % (2 * w)]
        if bad:
            ap.error(f"S = {S} is not divisible by 2W for W in {bad} (the zigzag layout)")
    env = {}        # filled in by rank 0 of the first GPU count (this process stays off the GPUs)
    from ..bench_common import command_line

    env["command"] = command_line("python -m flashattn.distributed.bench", argv)
    env["gpus_on_host"] = have
    cfg = dict(B=args.batch, H=args.heads, D=args.head_dim, dtype=args.dtype, causal=True, layout="zigzag",
               seqs=seqs, providers=args.providers, rounds=1 if args.quick else args.rounds, overlap=not args.no_overlap)
    path = _output_path(args)
    result = json.loads(path.read_text()) if args.append and path.exists() else {}
    if result.get("environment"):                            # --append: the earlier runs' environments kept
        result["earlier_environments"] = result.get("earlier_environments", []) + [result["environment"]]
    result.update(environment=env, config={k: v for k, v in cfg.items() if k != "seqs"})
    replaced = ("longest",) if args.longest else ("rows", "overlap", "checks")   # what this run measures again
    for key in ("rows", "overlap", "checks", "longest"):
        result[key] = [r for r in result.get(key, []) if key not in replaced or r.get("world") not in gpus]
    result["errors"] = result.get("errors", [])
    result["errors"] += [f"{w} GPUs asked for, this host has {have}" for w in skipped]

    def save():
        path.write_text(json.dumps(result, indent=1) + "\n")

    for world in gpus:
        t0 = time.perf_counter()
        if args.longest:
            for provider in [p for p in ("ring", "cp-cudnn") if p in args.providers]:
                probe = dict(cfg, provider=provider, start_per_gpu=args.start_per_gpu, limit_s=args.limit_s)
                try:
                    found = workers.spawn(longest_worker, world, probe, backend=backend,
                                          timeout_s=max(300.0, 3 * args.limit_s))[0]
                    _fill(env, found.pop("environment"))
                    result["longest"].append(found)
                except Exception as err:                     # noqa: BLE001 -- a rank failed alone: recorded
                    result["longest"].append({"world": world, "provider": provider, "longest_S": None,
                                              "error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}"})
                save()
        else:
            try:
                out = workers.spawn(bench_worker, world, cfg, backend=backend, timeout_s=300.0)[0]
                _fill(env, out.pop("environment"))
                for key in ("rows", "overlap", "checks"):
                    result[key] += out[key]
            except Exception as err:                         # noqa: BLE001 -- recorded, the next GPU count goes on
                result["errors"].append(f"{world} GPUs: {type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}")
        print(f"{world} GPU(s): {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        save()
    result["rows"] = efficiency(result["rows"])
    result["memory_fit"] = memory_fit(result["rows"], env.get("gpu_memory_gb"))
    save()
    print(format_table(result))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
