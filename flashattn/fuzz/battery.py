"""The randomized differential battery: draw problems, run them, judge them, report.

One problem is judged thus: every output and gradient, row by row, against the float64
reference (:func:`judge`); beside the values, no NaN or inf, no element of any output left
unwritten (outputs start as NaN), no store into the guard regions around every output, no
write into an input or the NaN around it. A failure is reported with the one line that
rebuilds it. On a GPU the problems run in worker processes: a kernel's illegal access poisons
its process's CUDA context for good, so the worker that met one reports it and is replaced. On a
host with several GPUs the workers take them in turn (worker i on GPU i mod the count).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing
import os
import time
import traceback
import warnings
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import Iterable, Optional

import torch

from .. import planted, runtime
from ..check.instruments import fence_wild_access
from .families import PRODUCT_UNIT, ROUNDING_UNITS, RUNNERS, SCORE_UNIT, head_norms, row_norms, unavailable
from .problems import FAMILIES, Problem, draw, make_inputs

#: relative error per row always allowed, by dtype (the test suite's tolerances, tests/conftest.py)
BASE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
#: the kernels may be this many times less accurate than SDPA on the same inputs, row by row
FLOOR_FACTOR = 4.0
#: per-head parameter gradients (lazy attention's dBias, dTau) sum millions of rounded terms of
#: both signs: their allowance is this many times the dtype's
PARAM_FACTOR = 4.0
#: (the rounding units of the products and of S, and how many of them are allowed, live in
#: ``families``: the lazy family's allowance at the ReLU's kink is built from them there)

#: a problem still running after this many seconds fails (and its worker is replaced)
PROBLEM_TIMEOUT_S = 300
#: when the time budget is spent, problems still running get this long to finish; the rest are
#: dropped, neither passed nor failed (a budget is a promise to the caller's clock)
GRACE_S = 20


def judge(p: Problem, outcome, dtype: Optional[torch.dtype] = None) -> list[str]:
    """What is wrong with one outcome, one line each (empty: it passed).

    Row by row (a per-head norm would dilute an error in one row, the last tile's say, by the
    square root of the length), the error ||got - ref|| may reach the largest of: the dtype's
    relative tolerance of ||ref|| (or of a thousandth of a typical row, for a row that is ~0), or
    where the logits are large, a few roundings of S times their bound (P = exp(S - LSE) turns
    S's absolute error into its own relative error);
    FLOOR_FACTOR times SDPA's own error on that row; and a few roundings of the terms that add
    up to the row (where those cancel, rounding is all there is: ``families.term_sizes``); plus,
    for lazy attention, the whole term a ReLU gate lets through where the gate sits on its kink
    within rounding (``families.lazy_term_sizes``); plus the output's own rounding near 0
    (:func:`output_rounding_floor`). Lazy attention's dBias and dTau are judged per head."""
    dtype = outcome.dtype or dtype or p.torch_dtype
    unit = PRODUCT_UNIT[dtype]
    problems = []
    for name, got in outcome.got.items():
        ref = outcome.ref[name]
        if got is None:
            problems.append(f"{name}: no gradient returned")
            continue
        if got.shape != ref.shape:
            problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
            continue
        bad = ~torch.isfinite(got)
        if bool(bad.any()):
            problems.append(f"{name}: {int(bad.sum())} of {got.numel()} elements NaN or inf "
                            "(unwritten, or overflowed)")
            continue
        param = name in outcome.per_head_param
        err = head_norms(got.double() - ref, 1) if param else row_norms(got.double() - ref)
        norm = head_norms(ref, 1) if param else row_norms(ref)
        typical = float(norm.pow(2).mean().sqrt())
        relative = max(BASE_TOLERANCE[dtype] * (PARAM_FACTOR if param else 1.0),
                       ROUNDING_UNITS * SCORE_UNIT[dtype] * outcome.logits)     # large logits
        allowed = relative * norm.clamp_min(1e-3 * typical)
        if name in outcome.floor:           # a row where SDPA's own result is NaN or inf has no floor
            floor = outcome.floor[name].to(allowed.device)
            allowed = torch.maximum(allowed, FLOOR_FACTOR * torch.where(torch.isfinite(floor), floor, 0.0))
        if name in outcome.size:
            allowed = torch.maximum(allowed, ROUNDING_UNITS * unit * outcome.size[name].to(allowed.device))
        if name in outcome.kink:                  # a gate on its kink, which rounding may flip
            allowed = allowed + outcome.kink[name].to(allowed.device)
        if not param:                             # the output's own rounding to its dtype, near 0
            allowed = allowed + output_rounding_floor(got)
        over = err / allowed.clamp_min(torch.finfo(torch.float64).tiny)
        if not bool((over <= 1).all()):
            flat = int(over.argmax())
            where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), over.shape))
            e, a, n = float(err.flatten()[flat]), float(allowed.flatten()[flat]), float(norm.flatten()[flat])
            sdpa = float(outcome.floor[name].flatten()[flat]) if name in outcome.floor else float("nan")
            what = "head" if param else "(batch, head, row)"
            problems.append(f"{name}: {what} {where} error {e:.2e} > allowed {a:.2e} (|ref| {n:.2e}, "
                            f"relative {e / max(n, 1e-300):.1e}; SDPA's error there {sdpa:.2e})")
    return problems


def output_rounding_floor(got: torch.Tensor) -> float:
    """The most that storing a row of ``got`` can lose where its elements lie below the dtype's
    smallest normal number: half the subnormal spacing (eps * tiny) per element, sqrt(D) of them
    (fp16: 3e-8 per element, 2.4e-7 for a row of 64: a relative error of 12% for a row of norm
    2e-6, which no kernel writing fp16 can avoid; bf16 and fp32: below 1e-38)."""
    info = torch.finfo(got.dtype)
    return 0.5 * info.eps * info.tiny * math.sqrt(got.shape[-1])


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    """All of the buffer an input lives in (its NaN margins and gaps included)."""
    return t._base if t._base is not None else t


def _context_lost() -> bool:
    """After a failure on a GPU: is this process's CUDA context still usable?"""
    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001 -- any error here means the context is gone
        return True


def check_problem(p: Problem, device=None) -> dict:
    """Run and judge one problem; a dict that pickles (for worker processes)."""
    device = device or runtime.default_device()
    why = unavailable(p.family)
    if why is not None:
        return {"index": p.index, "family": p.family, "status": "skipped", "why": why}
    start = time.perf_counter()
    failures, lost = [], False
    try:
        tensors = make_inputs(p, device)
        before = {n: _storage_view(t).clone() for n, t in tensors.items()}
        with runtime.guarded_outputs() as guarded, fence_wild_access() as wild, _quiet():
            outcome = RUNNERS[p.family](p, tensors)
            if device.type == "cuda":
                torch.cuda.synchronize()
        failures += runtime.guard_violations(guarded)
        failures += [f"{n} {kind} outside every tensor the kernels were given (dropped by the interpreter)"
                     for kind, n in wild.items() if n]
        failures += [f"input {n} (or the NaN around it) was written" for n, t in tensors.items()
                     if not torch.equal(torch.nan_to_num(_storage_view(t), 7.0), torch.nan_to_num(before[n], 7.0))]
        failures += judge(p, outcome)
    except Exception as e:      # noqa: BLE001 -- a kernel that raises on a valid problem fails it
        failures.append(f"raised {type(e).__name__} at {_raised_where(e)}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}")
        lost = device.type == "cuda" and _context_lost()
    if device.type == "cuda" and not lost and p.work() > 2 ** 25:
        torch.cuda.empty_cache()
    return {"index": p.index, "family": p.family, "status": "fail" if failures else "pass",
            "seconds": round(time.perf_counter() - start, 4), "failures": failures,
            "problem": p.describe(), "reproducer": p.reproducer(), "context_lost": lost}


#: the folder that holds the flashattn package (the repository, or site-packages when installed)
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def _short_path(filename: str) -> str:
    """A source file as a record may show it: from the folder holding flashattn (``flashattn/...``,
    ``tests/...``) or from site-packages (``triton/...``), never the machine's own directories."""
    path = Path(filename)
    try:
        return path.resolve().relative_to(_PACKAGE_PARENT).as_posix()
    except (ValueError, OSError):
        pass
    parts = path.parts
    for root in ("site-packages", "dist-packages"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root):])
    return path.name


def _raised_where(error: BaseException) -> str:
    """Where ``error`` was raised, and where that is not flashattn's own code, which flashattn call
    led there and which Triton kernel was being launched (the innermost one on the stack)."""
    frames = traceback.extract_tb(error.__traceback__)
    paths = [_short_path(f.filename) for f in frames]
    where = f"{paths[-1]}:{frames[-1].lineno} in {frames[-1].name}"
    if paths[-1].startswith("flashattn/"):
        return where
    kernel, tb = None, error.__traceback__
    while tb is not None:                  # a JITFunction's run, or a DirectLaunch (its kernel: .raw)
        owner = tb.tb_frame.f_locals.get("self")
        jitted = getattr(owner, "raw", owner)
        if hasattr(jitted, "arg_names") and callable(getattr(jitted, "fn", None)):
            kernel = jitted.fn.__name__
        tb = tb.tb_next
    ours = [(path, f) for path, f in zip(paths[:-1], frames[:-1])
            if path.startswith("flashattn/") and not path.startswith("flashattn/fuzz/")]
    led = [f"launching {kernel}"] if kernel else []
    led += [f"from {ours[-1][0]}:{ours[-1][1].lineno} in {ours[-1][1].name}"] if ours else []
    return where + (f" ({' '.join(led)})" if led else "")


@contextlib.contextmanager
def _quiet():
    """The battery judges values, not messages: no NumPy warnings from the interpreter's masked
    lanes (exp of -inf - -inf), no bf16-fallback or dropout-resolution warnings. And fp32 is
    judged at fp32's accuracy: TF32 products stay off whatever the process set."""
    import numpy as np

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _check_index(seed: int, index: int, families: tuple, on_gpu: bool) -> dict:
    return check_problem(draw(seed, index, on_gpu=on_gpu, families=families))


def run(seed: int, *, problems: Optional[int] = None, minutes: Optional[float] = None,
        families: Iterable[str] = FAMILIES, workers: int = 1, start: int = 0, progress: bool = True,
        on_gpu: Optional[bool] = None, plant: tuple = (), on_summary=None, every_s: float = 30.0) -> dict:
    """Problems ``start, start+1, ...`` of the battery ``seed`` until ``problems`` ran or
    ``minutes`` passed, whichever comes first. On a GPU they always run in worker processes
    (``workers`` of them, sharing the GPU: compiling, the float64 references and the host work
    overlap), so that a poisoned CUDA context costs one worker, not the run. ``on_gpu``: draw at
    a GPU's sizes (default: where the kernels run). ``plant``: names of ``flashattn.planted`` bugs
    planted in every process that runs problems (a worker process would not see a bug planted in
    its parent: the battery's own tests). ``on_summary(summary)`` is called every ``every_s``
    seconds with the summary so far (``"finished": False``), so that a run cut short by its
    caller's clock still leaves its record. Returns the summary: counts per family,
    every failure with its reproducer, device and versions."""
    families = tuple(families)
    draw(seed, start, on_gpu=False, families=families)          # names bad families before anything runs
    if problems is None and minutes is None:
        raise ValueError("give problems=, minutes= or both")
    on_gpu = (not runtime.INTERPRET) if on_gpu is None else on_gpu
    deadline = time.monotonic() + 60 * minutes if minutes is not None else math.inf
    indices = range(start, start + problems) if problems is not None else itertools.count(start)
    results = []
    bar = _bar(problems, progress)
    t0 = saved = time.monotonic()

    def advance(result):
        nonlocal saved
        results.append(result)
        _advance(bar, result)
        if on_summary is not None and time.monotonic() - saved >= every_s:
            saved = time.monotonic()
            on_summary(summarize(results, seed, saved - t0, workers, gpus=gpu_count(), finished=False))

    if workers <= 1 and runtime.INTERPRET:
        with planted.plant(*plant):
            for index in indices:
                if time.monotonic() >= deadline:
                    break
                advance(_check_index(seed, index, families, on_gpu))
    else:
        for result in _in_workers(seed, indices, families, max(1, workers), deadline, on_gpu, tuple(plant)):
            advance(result)
    if bar is not None:
        bar.close()
    return summarize(results, seed, time.monotonic() - t0, workers, gpus=gpu_count())


# --------------------------------------------------------------------------------------
# worker processes
# --------------------------------------------------------------------------------------
def _worker(seed: int, families: tuple, on_gpu: bool, gpu: Optional[int], plant: tuple, conn) -> None:
    """A worker process: problems by index from ``conn`` until told to stop (None); each result
    goes back on ``conn`` (a pipe: sent before this process can exit). After a problem that
    lost the CUDA context it exits, and the parent starts another. ``gpu``: the GPU its
    tensors and kernels use (None: the current one)."""
    if gpu is not None:
        torch.cuda.set_device(gpu)
    with planted.plant(*plant):
        while True:
            index = conn.recv()
            if index is None:
                return
            result = _check_index(seed, index, families, on_gpu)
            conn.send(result)
            if result.get("context_lost"):
                conn.close()
                os._exit(3)


class _Worker:
    def __init__(self, ctx, seed, families, on_gpu, gpu, plant=()):
        self.conn, child = ctx.Pipe()
        self.seed, self.families, self.on_gpu, self.gpu, self.plant = seed, families, on_gpu, gpu, plant
        self.proc = ctx.Process(target=_worker, args=(seed, families, on_gpu, gpu, plant, child), daemon=True)
        self.proc.start()
        child.close()
        self.index, self.since = None, 0.0       # the problem it was given, and when

    def replacement(self, ctx) -> "_Worker":
        """A new worker in place of this one (which died, or lost its CUDA context): the same
        problems' seed and families, the same GPU, the same planted bugs."""
        return _Worker(ctx, self.seed, self.families, self.on_gpu, self.gpu, self.plant)

    def give(self, index: int) -> None:
        self.conn.send(index)
        self.index, self.since = index, time.monotonic()


def _start_pool(ctx, seed: int, families: tuple, on_gpu: bool, workers: int, plant: tuple = ()) -> list:
    """``workers`` worker processes; on a host with several GPUs worker i uses GPU i mod their count."""
    gpus = gpu_count()
    return [_Worker(ctx, seed, families, on_gpu, i % gpus if gpus > 1 else None, plant) for i in range(workers)]


def _in_workers(seed: int, indices, families: tuple, workers: int, deadline: float, on_gpu: bool,
                plant: tuple = ()):
    """Yield the results of problems ``indices`` run in ``workers`` processes (spawned: each
    initialises CUDA itself) until the indices or the time run out. The parent knows which
    worker holds which problem; one that dies (a CUDA error, a crash) or overruns
    PROBLEM_TIMEOUT_S is replaced, and a problem it held without answering is a failure."""
    ctx = multiprocessing.get_context("spawn")
    pool = _start_pool(ctx, seed, families, on_gpu, workers, plant)
    indices = iter(indices)
    exhausted = False
    try:
        while True:
            for w in pool:                       # every idle worker gets the next problem
                if w.index is None and not exhausted:
                    index = next(indices, None) if time.monotonic() < deadline else None
                    if index is None:
                        exhausted = True
                    else:
                        w.give(index)
            busy = [w for w in pool if w.index is not None]
            if not busy:
                return
            if time.monotonic() > deadline + GRACE_S:     # out of time: drop what still runs
                for w in busy:                            # (joined below, with the rest)
                    w.proc.kill()
                return
            ready = wait_for([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=2)
            for i, w in enumerate(pool):
                if w.index is None:
                    continue
                if w.conn in ready or w.conn.poll():
                    try:
                        result = w.conn.recv()
                    except EOFError:             # it died with nothing more to say
                        result = None
                    if result is not None:
                        w.index = None
                        yield result
                        if result.get("context_lost"):
                            w.proc.join(5)
                            pool[i] = w.replacement(ctx)
                        continue
                overdue = time.monotonic() - w.since > PROBLEM_TIMEOUT_S
                if not w.proc.is_alive() or overdue:
                    if overdue:
                        w.proc.kill()
                    why = (f"ran over {PROBLEM_TIMEOUT_S} s" if overdue
                           else f"the worker process died (exit code {w.proc.exitcode}) running it")
                    yield _lost(seed, w.index, families, on_gpu, why)
                    w.index = None
                    if exhausted:                # nothing left to give: no new process
                        w.proc.join(1)
                    else:
                        pool[i] = w.replacement(ctx)
    finally:                      # every worker told at once, then a few seconds for all together
        for w in pool:
            if w.proc.is_alive():
                try:
                    w.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        end = time.monotonic() + 5
        for w in pool:
            w.proc.join(max(0.0, end - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(1)
            w.conn.close()


def gpu_count() -> int:
    """How many GPUs the workers share: where the kernels run, whatever sizes are drawn (0 in
    the interpreter)."""
    return torch.cuda.device_count() if not runtime.INTERPRET and torch.cuda.is_available() else 0


def _lost(seed: int, index: int, families: tuple, on_gpu: bool, why: str) -> dict:
    p = draw(seed, index, on_gpu=on_gpu, families=families)
    return {"index": index, "family": p.family, "status": "fail", "seconds": 0.0, "failures": [why],
            "problem": p.describe(), "reproducer": p.reproducer()}


# --------------------------------------------------------------------------------------
# progress and the summary
# --------------------------------------------------------------------------------------
def _bar(total, progress):
    if not progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="problems", unit="problem", dynamic_ncols=True)


def _advance(bar, result):
    if bar is not None:
        bar.update(1)
        if result["status"] == "fail":
            bar.write(f"FAIL {result['reproducer']}\n     " + "\n     ".join(result["failures"]))


def summarize(results: list, seed: int, seconds: float, workers: int, gpus: int = 0, finished: bool = True) -> dict:
    from ..bench_common import environment

    per_family, busy = {}, {}
    for r in results:
        counts = per_family.setdefault(r["family"], {"pass": 0, "fail": 0, "skipped": 0})
        counts[r["status"]] += 1
        busy[r["family"]] = busy.get(r["family"], 0.0) + r.get("seconds", 0.0)
    skipped = {r["family"]: r["why"] for r in results if r["status"] == "skipped"}
    failures = sorted((r for r in results if r["status"] == "fail"), key=lambda r: r["index"])
    ran = sum(1 for r in results if r["status"] != "skipped")
    return {"seed": seed, "finished": finished, "problems": ran, "failed": len(failures), "seconds": round(seconds, 1),
            "workers": workers, "gpus": gpus, "per_family": per_family,
            "worker_seconds_per_family": {f: round(t, 1) for f, t in sorted(busy.items())},
            "skipped_families": skipped,
            "failures": failures, **environment()}


def one_line(summary: dict) -> str:
    fams = ", ".join(f"{f} {c['pass'] + c['fail']}" for f, c in sorted(summary["per_family"].items())
                     if c["pass"] + c["fail"])
    skipped = "; skipped: " + ", ".join(summary["skipped_families"]) if summary["skipped_families"] else ""
    return (f"{summary['problems']} problems, {summary['failed']} failed, in {summary['seconds']:.0f} s "
            f"on {summary['device']} (seed {summary['seed']}; {fams}){skipped}")


def default_workers() -> int:
    """On GPUs: one process per two CPU cores, at most 12 per GPU (they share it); 1 on the CPU."""
    if runtime.INTERPRET:
        return 1
    return max(1, min(12 * max(1, gpu_count()), (os.cpu_count() or 2) // 2))
