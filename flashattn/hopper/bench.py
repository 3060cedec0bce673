"""The Gluon forward against the ``tl`` fast forward and SDPA's cuDNN and flash backends, on a
Hopper GPU: ``python -m flashattn.hopper.bench`` (forward only, bf16, B * S = 16k, H * D = 2048,
S 1k/4k/16k, D 64/128, causal both; TFLOP/s counted as ``bench_common.attention_flops`` does,
timed by ``triton.testing.do_bench``, every provider in one run; the Gluon forward in each of
``forward.VARIANTS``). First each variant runs once on small odd shapes, in a child process with a
time limit (a wrong mbarrier parity hangs rather than fails), against an fp32 softmax.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

GRID = [(S, D, causal) for S in (1024, 4096, 16384) for D in (64, 128) for causal in (False, True)]
VARIANTS = ("ws", "ws2", "pingpong", "inline")
PROVIDERS = tuple(f"gluon-{v}" for v in VARIANTS) + ("tl-fast", "sdpa-cudnn", "sdpa-flash")


def _providers():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from . import attention_forward
    from ..fast.forward import fast_attention_forward

    def sdpa(backend):
        def run(q, k, v, causal, scale):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        return run

    def gluon(variant):
        return lambda q, k, v, c, s: attention_forward(q, k, v, c, s, variant=variant)[0]

    return {**{f"gluon-{v}": gluon(v) for v in VARIANTS},
            "tl-fast": lambda q, k, v, c, s: fast_attention_forward(q, k, v, c, s)[0],
            "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION)}


def smoke(variants=VARIANTS) -> int:
    """Each variant once on small odd shapes (B 2, H 4, H_kv 2, S_q 200, S_k 333): the max-abs error
    of O and LSE against an fp32 softmax. Returns how many were wrong."""
    from . import attention_forward

    bad = 0
    for dtype in (torch.float16, torch.bfloat16):
        for D in (64, 128):
            for causal in (False, True):
                for variant in variants:
                    B, H, H_kv, S_q, S_k = 2, 4, 2, 200, 333
                    q = torch.randn(B, H, S_q, D, device="cuda", dtype=dtype)
                    k = torch.randn(B, H_kv, S_k, D, device="cuda", dtype=dtype)
                    v = torch.randn(B, H_kv, S_k, D, device="cuda", dtype=dtype)
                    t0 = time.time()
                    o, lse = attention_forward(q, k, v, causal, D ** -0.5, variant=variant)
                    torch.cuda.synchronize()
                    kr, vr = (t.repeat_interleave(H // H_kv, dim=1).float() for t in (k, v))
                    s = (q.float() @ kr.transpose(-1, -2)) * D ** -0.5
                    if causal:
                        s = s.masked_fill(torch.ones(S_q, S_k, device="cuda", dtype=torch.bool).tril().logical_not(),
                                          float("-inf"))
                    ref_lse = torch.logsumexp(s, dim=-1)
                    ref = torch.softmax(s, dim=-1) @ vr
                    err = (o.float() - ref).abs().max().item()
                    lse_err = (lse - ref_lse).abs().max().item()
                    ok = math.isfinite(err) and err < (2e-2 if dtype == torch.bfloat16 else 4e-3) and lse_err < 1e-3
                    bad += not ok
                    print(f"smoke {str(dtype)[6:]:8} D{D:<3} {'causal' if causal else 'full  '} "
                          f"{variant:6} O max err {err:.2e}  LSE max err {lse_err:.2e}  "
                          f"{time.time() - t0:5.1f}s {'ok' if ok else 'WRONG'}", flush=True)
    return bad


def bench(rep_ms: int, providers=PROVIDERS) -> list:
    import triton

    from ..bench_common import attention_flops

    table = _providers()
    rows = []
    for S, D, causal in GRID:
        B, H = 16384 // S, 2048 // D
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = D ** -0.5
        row = dict(B=B, H=H, S=S, D=D, causal=causal)
        ref = None
        for name in providers:
            fn = table[name]
            try:
                out = fn(q, k, v, causal, scale)
                if ref is None and name.startswith("sdpa"):
                    ref = out
                ms = triton.testing.do_bench(lambda: fn(q, k, v, causal, scale), warmup=25, rep=rep_ms,
                                             return_mode="median")
                row[name] = attention_flops(B, H, S, S, D, causal, "fwd") / ms * 1e-9
                row[name + "_out"] = out
            except Exception as exc:   # noqa: BLE001 -- one provider's failure must not stop the table
                row[name] = None
                row[name + "_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        for name in providers:   # agreement with SDPA, as a sanity check of the timed outputs
            out = row.pop(name + "_out", None)
            if out is not None and ref is not None:
                row[name + "_maxdiff"] = (out.float() - ref.float()).abs().max().item()
        rows.append(row)
        cells = "  ".join(f"{n} {row[n]:6.1f}" if row[n] is not None else f"{n}  error" for n in providers)
        best = max((row[n] for n in providers if n.startswith("gluon") and row[n]), default=None)
        ratio = best / row["sdpa-cudnn"] if best and row.get("sdpa-cudnn") else float("nan")
        print(f"S{S:<6} D{D:<4} {'causal' if causal else 'full  '}  {cells}  best gluon/cudnn {ratio:4.2f}", flush=True)
        for name in providers:
            if row.get(name + "_error"):
                print(f"    {name}: {row[name + '_error']}")
            if row.get(name + "_maxdiff", 0) > 0.05:
                print(f"    {name}: max |O - sdpa| = {row[name + '_maxdiff']:.3f}")
        del q, k, v
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", choices=VARIANTS, help="only the smoke run of one variant (in this process)")
    parser.add_argument("--smoke-timeout", type=float, default=120.0)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args(argv)
    from . import availability

    ok, why = availability()
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; gluon available: {ok} {why}")
    if not ok:
        sys.exit(1)
    if args.smoke:
        sys.exit(1 if smoke((args.smoke,)) else 0)
    providers = list(PROVIDERS)
    for variant in VARIANTS:
        try:
            child = subprocess.run([sys.executable, "-m", "flashattn.hopper.bench", "--smoke", variant],
                                   timeout=args.smoke_timeout)
            verdict = "ok" if child.returncode == 0 else "WRONG (still timed; see the max diffs)"
        except subprocess.TimeoutExpired:
            verdict = f"HANG: no answer in {args.smoke_timeout:.0f} s (not timed)"
            providers.remove(f"gluon-{variant}")
        print(f"smoke {variant}: {verdict}", flush=True)
    rows = bench(args.rep_ms, tuple(providers))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
