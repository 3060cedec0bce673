"""What a user of SDPA meets: head dims beyond 64/128, GQA, S_q != S_k, fp32, autocast, and the
cost of a first call. Part of ``python -m flashattn.bench --dropin`` (all providers in one run).

Every row times ``flashattn.scaled_dot_product_attention`` next to SDPA's backends on the same
inputs (median of ``triton.testing.do_bench``; FLOPs 4·B·H·S_q·S_k·D forward, 2.5x backward,
half when causal, H the query heads). First-call times come from fresh Python processes, with
an empty Triton cache and then a warm one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Callable

import torch
import torch.nn.functional as F

from . import runtime
from .api import scaled_dot_product_attention
from .bench_common import attention_flops, median_ms, with_settings


def _sdpa(backend: str | None) -> Callable:
    def run(q, k, v, causal):
        gqa = q.shape[1] != k.shape[1]
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return run


PROVIDERS = {
    "flashattn": lambda q, k, v, causal: scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                       enable_gqa=q.shape[1] != k.shape[1]),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa-default": _sdpa(None),
}


def measure(fn, B, H, H_kv, S_q, S_k, D, causal, dtype, rep_ms=100, autocast=None) -> dict:
    """Forward and backward time (ms) and TFLOP/s of one provider, or the error it raised.
    Under autocast the inputs are activations (results of an operation, as a model's q, k, v
    are), not leaves: autocast caches its casts of leaf tensors that require grad (meant for
    weights), so SDPA would be timed casting once instead of every call. A forward and backward
    run untimed first, so no compilation falls inside a timing."""
    dev = "cuda"
    q = torch.randn(B, H, S_q, D, dtype=dtype, device=dev, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S_k, D, dtype=dtype, device=dev, requires_grad=True) for _ in range(2))
    if autocast:
        q, k, v = q.clone(), k.clone(), v.clone()
    ctx = (lambda: torch.autocast("cuda", dtype=autocast)) if autocast else torch.enable_grad
    try:
        # one training step untimed: every kernel compiled and loaded (flashattn compiles the
        # backward's kernels in background threads, which would share the CPU with a timed forward)
        with ctx():
            out = fn(q, k, v, causal)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        with ctx():
            with torch.no_grad():
                fwd = median_ms(lambda: fn(q, k, v, causal), rep_ms)
            out = fn(q, k, v, causal)
        do = torch.randn_like(out)
        bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), rep_ms)
    except (RuntimeError, ValueError, NotImplementedError) as err:
        return {"error": str(err).splitlines()[0][:160]}
    finally:
        torch.cuda.empty_cache()
    fl = attention_flops(B, H, S_q, S_k, D, causal, "fwd")
    return dict(fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=fl / fwd * 1e-9, bwd_tflops=2.5 * fl / bwd * 1e-9,
                out_dtype=str(out.dtype).replace("torch.", ""))


def configurations() -> list[dict]:
    """The grid: one dict per configuration (providers are crossed with it)."""
    grid = []
    for dtype in ("fp16", "bf16"):
        for D in (80, 96, 160, 192, 256):
            for causal in (False, True):
                grid.append(dict(group="head dim", dtype=dtype, B=4, H=max(1, round(2048 / D)), H_kv=None,
                                 S_q=4096, S_k=4096, D=D, causal=causal))
    for causal in (False, True):
        grid.append(dict(group="GQA 32/8", dtype="bf16", B=4, H=32, H_kv=8, S_q=4096, S_k=4096, D=128, causal=causal))
    for S_q, S_k in ((1024, 8192), (8192, 1024)):
        grid.append(dict(group="S_q != S_k", dtype="bf16", B=2, H=16, H_kv=None, S_q=S_q, S_k=S_k, D=128, causal=False))
    for D, B, H, S in ((64, 2, 8, 2048), (128, 2, 16, 4096)):
        for tf32 in (False, True):
            grid.append(dict(group="fp32" + (" (TF32 allowed)" if tf32 else ""), dtype="fp32", B=B, H=H, H_kv=None,
                             S_q=S, S_k=S, D=D, causal=True, tf32=tf32))
        # FLASHATTN_FP32_PRECISION=bf16x3: fp32 products from two bf16 pieces (~1e-5 relative error)
        grid.append(dict(group="fp32 (bf16x3 opt-in)", dtype="fp32", B=B, H=H, H_kv=None, S_q=S, S_k=S, D=D,
                         causal=True, fp32_precision="bf16x3"))
    grid.append(dict(group="autocast bf16 (fp32 inputs)", dtype="fp32", B=2, H=16, H_kv=None, S_q=4096,
                     S_k=4096, D=128, causal=True, autocast="bf16"))
    return grid


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def run(rep_ms=100, progress=True, on_row=None, groups=None) -> list[dict]:
    """Every configuration x provider; ``groups``: only the configurations whose group starts
    with one of these words (e.g. ``("fp32", "autocast")``)."""
    from tqdm.auto import tqdm

    rows = []
    jobs = [(c, p) for c in configurations() for p in PROVIDERS
            if not groups or any(c["group"].startswith(g) for g in groups)]
    for c, name in tqdm(jobs, desc="drop-in", disable=not progress):
        if c["group"].startswith("autocast") and name not in ("flashattn", "sdpa-default"):
            continue
        if "fp32_precision" in c and name != "flashattn":   # SDPA's rows are the group "fp32"'s
            continue
        def one_row(c=c, name=name):
            return measure(PROVIDERS[name], c["B"], c["H"], c["H_kv"] or c["H"], c["S_q"], c["S_k"], c["D"],
                           c["causal"], DTYPES[c["dtype"]], rep_ms, DTYPES.get(c.get("autocast")))
        if "fp32_precision" in c:
            one_row = with_settings(one_row, fp32_precision=c["fp32_precision"])
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = c.get("tf32", False)
        try:
            r = one_row()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
        rows.append(dict(c, provider=name, **r))
        if on_row:
            on_row(rows)
    return rows


_FIRST_CALL = r'''
import json, sys, time, torch
t0 = time.perf_counter()
import flashattn
t_import = time.perf_counter() - t0
dtype = getattr(torch, sys.argv[1]); D = int(sys.argv[2]); causal = sys.argv[3] == "1"
provider = sys.argv[4]
def call(S):
    q, k, v = (torch.randn(2, 16, S, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    torch.cuda.synchronize(); t = time.perf_counter()
    if provider == "flashattn":
        out = flashattn.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.sum().backward(); torch.cuda.synchronize()
    return time.perf_counter() - t
first = call(3000)
again = call(3000)
bucket = call(5000)      # a new sequence length in a warm process
print(json.dumps(dict(import_s=t_import, first_s=first, again_s=again, new_length_s=bucket)))
'''


def first_calls(cases=(("bfloat16", 128, True), ("float16", 64, False), ("float16", 96, True))) -> list[dict]:
    """Seconds of a first forward + backward in a fresh process: with an empty Triton cache, and
    in a second process with the cache warm; and of a new sequence length in a warm process."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        for dtype, D, causal in cases:
            for provider in ("flashattn", "sdpa"):
                for label in ("empty cache", "warm cache"):
                    out = subprocess.run([sys.executable, "-c", _FIRST_CALL, dtype, str(D), str(int(causal)), provider],
                                         env=env, capture_output=True, text=True, timeout=600)
                    if out.returncode != 0:
                        rows.append(dict(dtype=dtype, D=D, causal=causal, provider=provider, cache=label,
                                         error=out.stderr.strip().splitlines()[-1][:160]))
                        continue
                    rows.append(dict(dtype=dtype, D=D, causal=causal, provider=provider, cache=label,
                                     **json.loads(out.stdout.strip().splitlines()[-1])))
    return rows


def format_table(rows: list[dict], first: list[dict]) -> str:
    lines = [f"{'group':<28}{'dtype':<6}{'D':>4}{'H/Hkv':>7}{'S_q x S_k':>12}{'causal':>7}  {'provider':<15}"
             f"{'fwd TF/s':>9}{'bwd TF/s':>9}  out"]
    for r in rows:
        hk = f"{r['H']}/{r['H_kv'] or r['H']}"
        head = (f"{r['group']:<28}{r['dtype']:<6}{r['D']:>4}{hk:>7}{str(r['S_q']) + 'x' + str(r['S_k']):>12}"
                f"{str(r['causal']):>7}  {r['provider']:<15}")
        lines.append(head + (f"  ({r['error'][:50]})" if "error" in r else
                             f"{r['fwd_tflops']:>9.1f}{r['bwd_tflops']:>9.1f}  {r['out_dtype']}"))
    lines.append("")
    lines.append(f"{'first call (s)':<28}{'dtype':<10}{'D':>4}{'causal':>7}  {'provider':<10}{'cache':<12}"
                 f"{'first':>7}{'again':>7}{'new S':>7}")
    for r in first:
        head = f"{'':<28}{r['dtype']:<10}{r['D']:>4}{str(r['causal']):>7}  {r['provider']:<10}{r['cache']:<12}"
        lines.append(head + (f"  ({r['error'][:50]})" if "error" in r else
                             f"{r['first_s']:>7.2f}{r['again_s']:>7.3f}{r['new_length_s']:>7.3f}"))
    return "\n".join(lines)
