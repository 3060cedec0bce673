"""Benchmark lesson 09's kernels against the best PyTorch path for the same work.

    python -m flashattn.beyond.bench            # on a GPU: the three workloads below, fp16 and bf16
    python -m flashattn.beyond.bench --quick    # tiny sizes: runs anywhere, the CPU included

* window:  one 16k sequence, causal, each query sees the 4096 keys before it (window (4096, 0)):
  flashattn's fast kernels and lesson 09's kernels, FlexAttention with a sliding-window block mask (compiled), torch's
  ``varlen_attn`` with ``window_size`` (where torch has it), and SDPA's flash backend on the full
  causal problem (what the window saves).
* varlen:  16 causal sequences of mixed lengths, 16k tokens packed: flashattn (fast, lesson),
  ``varlen_attn``, FlexAttention with a document mask.
* dropout: B=4, S=4096, causal, dropout 0.1 against none, for flashattn (fast, lesson) and SDPA's
  flash backend: what regenerating the mask costs.

H=16, D=128. Times are medians of ``triton.testing.do_bench``; FLOPs count the visible (query,
key) pairs: 4 * D per pair forward, 2.5 times that backward (the anchors' convention, whose
0.5 for causal is the same count). The JSON (device, versions, every number) goes to runs/.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from .. import runtime
from ..bench import DTYPES, environment, median_ms
from .attention import flash_attention, flash_attention_varlen, precompile

WINDOW = 4096
#: provider name -> ``impl`` of lesson 09's entry points
OURS = {"flashattn fast": "fast", "flashattn lesson kernels": "teaching"}


def _flex(mask_mod, S, device):
    """Compiled FlexAttention with the block mask of ``mask_mod``, or None where torch lacks it."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    import torch._functorch.config as functorch_config
    functorch_config.donated_buffer = False   # the backward is timed again and again on one graph
    block_mask = create_block_mask(mask_mod, None, None, S, S, device=device)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _time(fn, inputs, do, rep_ms) -> dict:
    """Forward and backward medians (ms) of ``fn(*inputs)``; an error is reported, not raised."""
    try:
        with torch.no_grad():
            fwd = median_ms(lambda: fn(*inputs), rep_ms)
        out = fn(*inputs)
        bwd = median_ms(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True), rep_ms)
        return {"fwd_ms": fwd, "bwd_ms": bwd}
    except Exception as err:        # noqa: BLE001 -- one provider failing must not end the run
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}


def _rows(workload, dtype_name, H, D, results: dict) -> list[dict]:
    """One row per provider; ``results`` maps a provider to (its times, the (query, key) pairs
    per head its problem has)."""
    rows = []
    for provider, (r, pairs) in results.items():
        row = {"workload": workload, "dtype": dtype_name, "provider": provider, **r}
        if "fwd_ms" in r:
            row["fwd_tflops"] = 4.0 * pairs * H * D / r["fwd_ms"] * 1e-9
            row["bwd_tflops"] = 2.5 * 4.0 * pairs * H * D / r["bwd_ms"] * 1e-9
        rows.append(row)
    return rows


def window_workload(S, H, D, dtype, dtype_name, device, rep_ms, window=WINDOW) -> list[dict]:
    q, k, v = (torch.randn(1, H, S, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    pairs = sum(min(i, window) + 1 for i in range(S))
    results = {name: (_time(lambda q, k, v: flash_attention(q, k, v, causal=True, window=(window, 0), impl=impl),
                            (q, k, v), do, rep_ms), pairs) for name, impl in OURS.items()}
    if device.type == "cuda":
        flex = _flex(lambda b, h, i, j: (j <= i) & (i - j <= window), S, device)
        if flex is not None:
            results["flex (sliding window)"] = (_time(flex, (q, k, v), do, rep_ms), pairs)
        varlen = _varlen_attn()
        if varlen is not None:
            cu = torch.tensor([0, S], dtype=torch.int32, device=device)
            packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
            results["torch varlen_attn (window)"] = (_time(
                lambda q, k, v: varlen(q, k, v, cu, cu, S, S, window_size=(window, 0)),
                tuple(packed), do[0].transpose(0, 1).contiguous(), rep_ms), pairs)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            full = _time(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do, rep_ms)
        results["SDPA flash (full causal)"] = (full, S * (S + 1) // 2)   # the whole causal problem: more pairs
    return _rows(f"window {window} in {S}", dtype_name, H, D, results)


def mixed_lengths(total: int, n: int, seed: int = 0) -> list[int]:
    """n lengths that add up to total, from short to long (a fixed draw, so runs compare)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(n, generator=g) + 0.1
    lens = (weights / weights.sum() * total).long().clamp_min(1)
    lens[-1] += total - int(lens.sum())
    return lens.tolist()


def varlen_workload(total, n, H, D, dtype, dtype_name, device, rep_ms) -> list[dict]:
    lens = mixed_lengths(total, n)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q, k, v = (torch.randn(total, H, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    longest = max(lens)
    pairs = sum(s * (s + 1) // 2 for s in lens)
    results = {name: (_time(
        lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, impl=impl),
        (q, k, v), do, rep_ms), pairs) for name, impl in OURS.items()}
    if device.type == "cuda":
        varlen = _varlen_attn()
        if varlen is not None:
            results["torch varlen_attn"] = (_time(
                lambda q, k, v: varlen(q, k, v, cu, cu, longest, longest, window_size=(-1, 0)), (q, k, v), do, rep_ms),
                pairs)
        doc = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lens, device=device))
        flex = _flex(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), total, device)
        if flex is not None:
            as4d = lambda t: t.transpose(0, 1)[None]  # noqa: E731
            results["flex (document mask)"] = (_time(
                lambda q, k, v: flex(as4d(q), as4d(k), as4d(v))[0].transpose(0, 1), (q, k, v), do, rep_ms), pairs)
    return _rows(f"varlen {n} seqs, {total} tokens", dtype_name, H, D, results)


def dropout_workload(B, S, H, D, dtype, dtype_name, device, rep_ms, p=0.1) -> list[dict]:
    q, k, v = (torch.randn(B, H, S, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    pairs = B * S * (S + 1) // 2
    results = {}
    for name, impl in OURS.items():
        for prob in (0.0, p):
            results[f"{name}, dropout {prob}"] = (_time(
                lambda q, k, v: flash_attention(q, k, v, causal=True, dropout_p=prob, impl=impl), (q, k, v), do,
                rep_ms), pairs)
    if device.type == "cuda":
        for prob in (0.0, p):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                results[f"SDPA flash, dropout {prob}"] = (_time(
                    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=prob),
                    (q, k, v), do, rep_ms), pairs)
    return _rows(f"dropout B{B} S{S}", dtype_name, H, D, results)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'workload':<28} {'dtype':<9} {'provider':<38} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['workload']:<28} {r['dtype']:<9} {r['provider']:<38} {r['error']}")
            continue
        lines.append(f"{r['workload']:<28} {r['dtype']:<9} {r['provider']:<38} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} "
                     f"{r['fwd_tflops']:9.1f} {r['bwd_tflops']:9.1f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.beyond.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=list(DTYPES))
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU or a smoke test")
    ap.add_argument("--out", default="runs", help="folder for the JSON (default: runs/, ignored by git)")
    args = ap.parse_args(argv)
    device = runtime.default_device()
    env = environment()
    env["command"] = "python -m flashattn.beyond.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    small = args.quick or device.type != "cuda"
    S, total, B, H, D = (256, 256, 1, 2, 32) if small else (16384, 16384, 4, 16, 128)
    window = 64 if small else WINDOW
    dtypes = ["fp32"] if device.type != "cuda" else args.dtypes
    variants = [(False, True, False, False), (True, False, True, False), (True, False, False, True)]
    seconds = precompile([DTYPES[name] for name in dtypes], [D], variants)   # in parallel, before any timing
    if seconds:
        print(f"compiled the fast kernels' variants in {seconds:.0f} s", flush=True)
    rows = []
    for name in dtypes:
        dtype = DTYPES[name]
        dtype_name = str(dtype).split(".")[-1]
        rows += window_workload(S, H, D, dtype, dtype_name, device, args.rep_ms, window)
        rows += varlen_workload(total, 16 if not small else 4, H, D, dtype, dtype_name, device, args.rep_ms)
        rows += dropout_workload(B, 4096 if not small else 128, H, D, dtype, dtype_name, device, args.rep_ms)
        print(format_table(rows), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"beyond_{re.sub(r'[^a-z0-9]+', '_', env['device'].lower()).strip('_')}.json"
    path.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
