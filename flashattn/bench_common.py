"""What the benchmarks share: the providers, timing, FLOP counting, the run's environment, file
names. ``bench`` (the grid and the command line), ``bench_dropin``, ``bench_host`` and
``bench_train`` import it; it imports none of them.
"""
from __future__ import annotations

import datetime as _dt
import platform
import re
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
import triton

from . import runtime
from .api import flash_attention, flash_attention_fast
from .reference import attention_autograd


# --------------------------------------------------------------------------------------
# providers: name -> attention function (q, k, v, causal) -> out
# --------------------------------------------------------------------------------------
def command_line(program: str, argv) -> str:
    """The command a record was made with, as it is committed: ``--out``'s folder named
    ``results`` (where records are committed), not the measuring machine's."""
    import sys

    words = list(argv if argv is not None else sys.argv[1:])
    if "--out" in words[:-1]:
        words[words.index("--out") + 1] = "results"
    return " ".join([program, *words])


def _sdpa_backend(backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def providers() -> dict[str, Callable]:
    table = {
        "flashattn": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal, impl="teaching"),
        "flashattn-fast": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal, impl="fast"),
        "flashattn-fused": lambda q, k, v, causal: flash_attention_fast(q, k, v, causal=causal,
                                                                        backward="fused"),
        "sdpa-flash": _sdpa_backend("FLASH_ATTENTION"),
        "sdpa-cudnn": _sdpa_backend("CUDNN_ATTENTION"),
        "sdpa-efficient": _sdpa_backend("EFFICIENT_ATTENTION"),
        "naive": lambda q, k, v, causal: attention_autograd(q, k, v, causal=causal),
    }
    return table


# --------------------------------------------------------------------------------------
# timing and FLOPs
# --------------------------------------------------------------------------------------
def attention_flops(B, H, S_q, S_k, D, causal, mode) -> float:
    flops = 4.0 * B * H * S_q * S_k * D
    if causal:
        flops *= 0.5
    return flops * (2.5 if mode == "bwd" else 1.0)


def median_ms(fn: Callable[[], object], rep_ms: int = 100) -> float:
    if torch.cuda.is_available():
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()  # warm-up (and, in the interpreter, nothing is compiled anyway)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def with_tflops(result: dict, B, H, S, D, causal) -> dict:
    """``result`` with its TFLOP/s from its ``fwd_ms`` and ``bwd_ms``."""
    return dict(result, fwd_tflops=attention_flops(B, H, S, S, D, causal, "fwd") / result["fwd_ms"] * 1e-9,
                bwd_tflops=attention_flops(B, H, S, S, D, causal, "bwd") / result["bwd_ms"] * 1e-9)


def median_of_rounds(results: list[dict], B, H, S, D, causal) -> dict:
    """One result from the same measurement taken in several rounds: the median time of each
    direction (each round's own times kept beside it), an error if the first round had one."""
    if "error" in results[0]:
        return results[0]
    merged = {name: value for name, value in results[-1].items() if not name.endswith(("_ms", "_tflops"))}
    for name in ("fwd_ms", "bwd_ms"):
        merged[name] = statistics.median(r[name] for r in results)
        if len(results) > 1:
            merged[name + "_rounds"] = [round(r[name], 4) for r in results]
    return with_tflops(merged, B, H, S, D, causal)


def in_turn(names, rounds: int, measure_one: Callable[[object], dict], bar) -> dict:
    """``{name: [its result in each round]}``: every round measures each name once, in turn, so
    that all of them meet the same drift of the GPU's clock; a name whose first result was an
    error is not measured again. ``bar`` (tqdm) advances once per name and round."""
    results = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            if not results[name] or "error" not in results[name][0]:
                results[name].append(measure_one(name))
            bar.update()
    return results


def measure(fn, B, H, S, D, causal, dtype, device, rep_ms=100) -> dict:
    """Forward and backward time (ms), TFLOP/s and peak memory (MiB) of one provider."""
    q, k, v = (torch.randn(B, H, S, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, S, D, dtype=dtype, device=device)
    result = {}
    try:
        # one whole step first: whatever a first call does (compiling, the background
        # preparation of the backward, the caching allocator growing) is done before timing
        torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        with torch.no_grad():
            fwd_ms = median_ms(lambda: fn(q, k, v, causal), rep_ms)
        out = fn(q, k, v, causal)
        bwd_ms = median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), rep_ms)
        del out
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)
            torch.cuda.synchronize()
            result["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}
    except RuntimeError as err:  # e.g. an SDPA backend that does not support this config
        return {"error": str(err).splitlines()[0][:160]}
    finally:
        del q, k, v, do
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return with_tflops(dict(result, fwd_ms=fwd_ms, bwd_ms=bwd_ms), B, H, S, D, causal)


def environment() -> dict:
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "where": runtime.where(),
    }
    if torch.cuda.is_available():
        info.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                    capability=".".join(map(str, torch.cuda.get_device_capability())))
        try:
            info["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # pragma: no cover
            pass
    else:
        info["device"] = "CPU (Triton interpreter)"
    return info


def device_slug(name: str) -> str:
    """A device's name as file names take it: 'NVIDIA H100 80GB HBM3' -> 'h100';
    'CPU (Triton interpreter)' -> 'cpu_triton_interpreter'."""
    found = re.search(r"\b([A-Z]\d{1,4}[A-Z]?)\b", name)
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def with_settings(fn, **changes):
    """``fn`` run with these ``flashattn.settings`` (tma=False: the forward's and the dK/dV
    kernel's pointer loads; tma_stats=False: the LSE and delta by pointer loads)."""
    from . import settings

    def run():
        with settings.override(**changes):
            return fn()
    return run
