"""The randomized differential battery: draw problems, run them, judge them, report.

One problem is judged thus: every output and gradient, per (batch, head), against the float64
reference, by relative error; the limit is the dtype's tolerance or a few times SDPA's own error
on the same inputs, whichever is larger. Beside the values: no NaN or inf, no element of any
output left unwritten (outputs start as NaN), no store into the guard regions around every
output, no write into an input. A failure is reported with the one line that rebuilds it.
"""
from __future__ import annotations

import concurrent.futures as futures
import contextlib
import itertools
import math
import multiprocessing
import os
import queue
import time
import traceback
import warnings
from typing import Iterable, Optional

import torch

from .. import runtime
from ..check.runner import fence_wild_access
from .families import RUNNERS, head_norms, unavailable
from .problems import FAMILIES, Problem, draw, make_inputs

#: relative error per head always allowed, by dtype (the test suite's tolerances)
BASE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
#: the kernels may be this many times less accurate than SDPA on the same inputs, head by head
FLOOR_FACTOR = 4.0
#: per-head parameter gradients (lazy attention's dBias, dTau) are sums of millions of rounded
#: terms of both signs: their allowance is this many times the dtype's
PARAM_FACTOR = 4.0
#: where dQ and dK cancel to ~0, the error allowed is this many units of the products' rounding
#: times the size of the terms that make them up (families.term_sizes)
ROUNDING_UNITS = 4.0
#: the rounding unit of the kernels' products: half precision's epsilon; for fp32 inputs the
#: default GPU products (tf32x3: three TF32 products, about 1e-6 relative error each)
PRODUCT_UNIT = {torch.float16: torch.finfo(torch.float16).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps,
                torch.float32: 1e-6, torch.float64: 1e-15}


def judge(p: Problem, outcome, dtype: Optional[torch.dtype] = None) -> list[str]:
    """What is wrong with one outcome, one line each (empty: it passed).

    Head by head, the error ||got - ref|| may reach the largest of: the dtype's relative tolerance
    (of ||ref||, or of a thousandth of a typical head's norm for a head that is ~0);
    FLOOR_FACTOR times SDPA's own error on that head; and, for dQ and dK, a few roundings of the
    terms that add up to them (where those cancel, rounding is all there is)."""
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
        heads = 1 if param else 2
        err, norm = head_norms(got.double() - ref, heads), head_norms(ref, heads)
        typical = float(norm.pow(2).mean().sqrt())
        scale = norm.clamp_min(1e-3 * typical)
        allowed = BASE_TOLERANCE[dtype] * (PARAM_FACTOR if param else 1.0) * scale
        if name in outcome.floor:
            allowed = torch.maximum(allowed, FLOOR_FACTOR * outcome.floor[name].to(allowed.device))
        if name in outcome.size:
            allowed = torch.maximum(allowed, ROUNDING_UNITS * unit * outcome.size[name].to(allowed.device))
        over = err / allowed.clamp_min(torch.finfo(torch.float64).tiny)
        if not bool((over <= 1).all()):
            h = int(over.argmax())
            where = divmod(h, over.shape[-1]) if over.dim() == 2 else (h,)
            e, a, n = float(err.flatten()[h]), float(allowed.flatten()[h]), float(norm.flatten()[h])
            sdpa = float(outcome.floor[name].flatten()[h]) if name in outcome.floor else float("nan")
            problems.append(f"{name}: head {where} error {e:.2e} > allowed {a:.2e} (|ref| {n:.2e}, "
                            f"relative {e / max(n, 1e-300):.1e}; SDPA's error there {sdpa:.2e})")
    return problems


def check_problem(p: Problem, device=None) -> dict:
    """Run and judge one problem; a dict that pickles (for worker processes)."""
    device = device or runtime.default_device()
    why = unavailable(p.family)
    if why is not None:
        return {"index": p.index, "family": p.family, "status": "skipped", "why": why}
    start = time.perf_counter()
    failures = []
    try:
        tensors = make_inputs(p, device)
        before = {n: t.clone() for n, t in tensors.items()}
        with runtime.guarded_outputs() as guarded, fence_wild_access() as wild, _quiet():
            outcome = RUNNERS[p.family](p, tensors)
            if device.type == "cuda":
                torch.cuda.synchronize()
        failures += runtime.guard_violations(guarded)
        failures += [f"{n} {kind} outside every tensor the kernels were given (dropped by the interpreter)"
                     for kind, n in wild.items() if n]
        failures += [f"input {n} was written" for n, t in tensors.items()
                     if not torch.equal(torch.nan_to_num(t), torch.nan_to_num(before[n]))]
        failures += judge(p, outcome)
    except Exception as e:      # noqa: BLE001 -- a kernel that raises on a valid problem fails it
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{os.path.relpath(frame.filename)}:{frame.lineno} in {frame.name}"
        failures.append(f"raised {type(e).__name__} at {where}: {str(e).splitlines()[0] if str(e) else ''}")
    if device.type == "cuda" and p.work() > 2 ** 25 and not failures:
        torch.cuda.empty_cache()
    return {"index": p.index, "family": p.family, "status": "fail" if failures else "pass",
            "seconds": round(time.perf_counter() - start, 4), "failures": failures,
            "problem": p.describe(), "reproducer": p.reproducer()}


@contextlib.contextmanager
def _quiet():
    """No NumPy overflow warnings from the interpreter's masked lanes (exp of -inf - -inf), no
    BF16 fallback or dropout-resolution warnings: the battery judges values, not messages."""
    import numpy as np

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        yield


def _check_index(seed: int, index: int, families: tuple) -> dict:
    return check_problem(draw(seed, index, on_gpu=not runtime.INTERPRET, families=families))


def run(seed: int, *, problems: Optional[int] = None, minutes: Optional[float] = None,
        families: Iterable[str] = FAMILIES, workers: int = 1, start: int = 0, progress: bool = True) -> dict:
    """Problems ``start, start+1, ...`` of the battery ``seed`` until ``problems`` ran or
    ``minutes`` passed (whichever comes first). ``workers`` > 1: that many processes (on a GPU
    they share it; compiling, the float64 references and the host work overlap). Returns the
    summary: counts per family, every failure with its reproducer, device and versions."""
    families = tuple(families)
    unknown = set(families) - set(FAMILIES)
    if unknown or not families:
        raise ValueError(f"families must be among {FAMILIES}, got {sorted(unknown) or 'none'}")
    if problems is None and minutes is None:
        raise ValueError("give problems=, minutes= or both")
    deadline = time.monotonic() + 60 * minutes if minutes is not None else math.inf
    limit = problems if problems is not None else 2 ** 62
    results = []
    bar = _bar(problems, progress)
    t0 = time.monotonic()
    if workers <= 1:
        index = start
        while index - start < limit and time.monotonic() < deadline:
            results.append(_check_index(seed, index, families))
            _advance(bar, results[-1])
            index += 1
    else:
        for result in _in_workers(seed, range(start, start + limit) if limit < 2 ** 62 else itertools.count(start),
                                  families, workers, deadline):
            results.append(result)
            _advance(bar, result)
    if bar is not None:
        bar.close()
    return summarize(results, seed, time.monotonic() - t0, workers)


def _worker(seed: int, families: tuple, tasks, results) -> None:
    """A worker process: problems by index until told to stop (None). After a CUDA error the
    process's context is lost (the error is sticky): it reports the problem and exits, and the
    parent starts another."""
    while True:
        index = tasks.get()
        if index is None:
            return
        results.put(("start", index, os.getpid()))
        result = _check_index(seed, index, families)
        results.put(("done", index, result))
        if any("CUDA error" in f or "AcceleratorError" in f or "illegal memory access" in f
               for f in result.get("failures", [])):
            results.close()
            results.join_thread()           # the report out first: os._exit skips the queue's flush
            os._exit(3)


def _in_workers(seed: int, indices, families: tuple, workers: int, deadline: float):
    """Yield the results of problems ``indices`` run in ``workers`` processes (spawned: each
    initialises CUDA itself), until the indices or the time run out. A worker that dies (a CUDA
    error, a crash) is replaced; a problem it died on without reporting is a failure."""
    ctx = multiprocessing.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()

    def spawn():
        proc = ctx.Process(target=_worker, args=(seed, families, tasks, results), daemon=True)
        proc.start()
        return proc

    procs = [spawn() for _ in range(workers)]
    indices, queued, finished, exhausted = iter(indices), 0, 0, False
    started: dict = {}                              # index -> pid of the worker running it
    try:
        while True:
            while not exhausted and queued - finished < 2 * workers and time.monotonic() < deadline:
                index = next(indices, None)
                if index is None:
                    exhausted = True
                else:
                    tasks.put(index)
                    queued += 1
            if finished == queued and (exhausted or time.monotonic() >= deadline):
                return
            messages = []
            try:
                messages.append(results.get(timeout=2))
                while True:
                    messages.append(results.get_nowait())
            except queue.Empty:
                pass
            for kind, index, payload in messages:
                if kind == "start":
                    started[index] = payload
                else:
                    started.pop(index, None)
                    finished += 1
                    yield payload
            for i, proc in enumerate(procs):
                if proc.is_alive():
                    continue
                procs[i] = spawn()
                for index in [j for j, pid in started.items() if pid == proc.pid]:
                    started.pop(index)       # died on it without a word: a crash is a failure too
                    finished += 1
                    yield _lost(seed, index, families, proc.exitcode)
    finally:
        for proc in procs:
            proc.kill()


def _lost(seed: int, index: int, families: tuple, code) -> dict:
    p = draw(seed, index, on_gpu=not runtime.INTERPRET, families=families)
    return {"index": index, "family": p.family, "status": "fail", "seconds": 0.0,
            "failures": [f"the worker process died (exit code {code}) running it"],
            "problem": p.describe(), "reproducer": p.reproducer()}


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


def summarize(results: list, seed: int, seconds: float, workers: int) -> dict:
    from ..bench import environment

    per_family = {}
    for r in results:
        counts = per_family.setdefault(r["family"], {"pass": 0, "fail": 0, "skipped": 0})
        counts[r["status"]] += 1
    skipped = {r["family"]: r["why"] for r in results if r["status"] == "skipped"}
    failures = sorted((r for r in results if r["status"] == "fail"), key=lambda r: r["index"])
    ran = sum(1 for r in results if r["status"] != "skipped")
    return {"seed": seed, "problems": ran, "failed": len(failures), "seconds": round(seconds, 1),
            "workers": workers, "per_family": per_family, "skipped_families": skipped,
            "failures": failures, **environment()}


def one_line(summary: dict) -> str:
    fams = ", ".join(f"{f} {c['pass'] + c['fail']}" for f, c in sorted(summary["per_family"].items())
                     if c["pass"] + c["fail"])
    skipped = "; skipped: " + ", ".join(summary["skipped_families"]) if summary["skipped_families"] else ""
    return (f"{summary['problems']} problems, {summary['failed']} failed, in {summary['seconds']:.0f} s "
            f"on {summary['device']} (seed {summary['seed']}; {fams}){skipped}")


def default_workers() -> int:
    """On a GPU: one process per two CPU cores, at most 12 (they share the GPU)."""
    if runtime.INTERPRET:
        return 1
    return max(1, min(12, (os.cpu_count() or 2) // 2))
