"""Benchmark lazy attention: the Triton kernels against the materialised PyTorch formula.

    python -m flashattn.lazy.bench                   # on a GPU: L = 1024 ... 8192, fp16
    python -m flashattn.lazy.bench --dtype bf16 --window 4096   # JSON + PNG in runs/
    python -m flashattn.lazy.bench --quick           # tiny sizes: runs anywhere, the CPU included

For each length L it measures, for both providers, the forward time and the forward+backward
time (medians of ``triton.testing.do_bench``, gradients for q, k, v, bias and tau) and the
peak memory of one forward+backward above what the inputs already hold. "pytorch" is
``lazy_attention_reference`` in the inputs' dtype, differentiated by autograd: it materialises
several L x L matrices per head, and may run out of memory (reported, not fatal). Before
timing, both providers are compared once, so the numbers are those of a correct kernel.
Writes a JSON file (device, torch/triton versions, date, every number) and a PNG plot.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import runtime
from ..bench import DTYPES, environment, median_ms
from .kernels import lazy_attention
from .reference import lazy_attention_reference, random_inputs

def providers() -> dict[str, Callable]:
    def pytorch(q, k, v, bias, tau):
        return lazy_attention_reference(q, k, v, bias.to(q.dtype), tau.to(q.dtype), dtype=None)

    return {"triton": lazy_attention, "pytorch": pytorch}


def make_inputs(B, H, L, D, W, dtype, device, seed=0):
    q, k, v, do, bias, tau = random_inputs(B, H, L, D, W, dtype=dtype, device=device,
                                           taus=torch.linspace(-1.0, 1.0, H),
                                           generator=torch.Generator().manual_seed(seed))
    leaves = [t.requires_grad_(True) for t in (q, k, v, bias, tau)]
    return leaves, do


def measure(fn, B, H, L, D, W, dtype, device, rep_ms) -> dict:
    """fwd and fwd+bwd medians (ms) and peak memory (MiB) of one provider, or an error."""
    leaves, do = make_inputs(B, H, L, D, W, dtype, device)
    row = {}
    try:
        with torch.no_grad():
            row["fwd_ms"] = median_ms(lambda: fn(*leaves), rep_ms)
        row["fwd_bwd_ms"] = median_ms(lambda: torch.autograd.grad(fn(*leaves), leaves, do), rep_ms)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            torch.autograd.grad(fn(*leaves), leaves, do)
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    except torch.cuda.OutOfMemoryError:
        row = {"error": "out of memory"}
    finally:
        del leaves, do
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def agreement(B, H, L, D, W, dtype, device) -> dict:
    """Relative errors of the kernels against the PyTorch formula in float32, worst head."""
    leaves, do = make_inputs(B, H, L, D, W, dtype, device, seed=1)
    got = [lazy_attention(*leaves)]
    got += list(torch.autograd.grad(got[0], leaves, do))
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    ref = [lazy_attention_reference(*ref_leaves, dtype=torch.float32)]
    ref += list(torch.autograd.grad(ref[0], ref_leaves, do.float()))
    errs = {}
    for name, a, e in zip(("O", "dQ", "dK", "dV", "dBias", "dTau"), got, ref):
        a, e = a.detach().float(), e.detach().float()
        if a.dim() == 4:
            per_head = (a - e).flatten(2).norm(dim=-1) / e.flatten(2).norm(dim=-1)
        elif a.dim() == 2:
            per_head = (a - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-3 * float(e.norm()))
        else:
            per_head = (a - e).abs() / e.abs().clamp_min(1e-3 * float(e.norm()))
        errs[name] = float(per_head.max())
    return errs


def run(seqlens, B, H, D, W, dtype_name, rep_ms, progress=True) -> tuple[list[dict], dict]:
    from tqdm.auto import tqdm

    dtype, device = DTYPES[dtype_name], runtime.default_device()
    check = agreement(B, H, min(seqlens), D, W, dtype, device)
    rows = []
    jobs = [(L, name, fn) for L in seqlens for name, fn in providers().items()]
    for L, name, fn in tqdm(jobs, desc="lazy attention benchmark", disable=not progress):
        row = dict(provider=name, L=L, B=B, H=H, D=D, W=W, dtype=dtype_name)
        row.update(measure(fn, B, H, L, D, W, dtype, device, rep_ms))
        rows.append(row)
    return rows, check


def summary(rows: list[dict]) -> list[dict]:
    """One line per L: both providers side by side, speed-ups and memory ratio."""
    out = []
    for L in sorted({r["L"] for r in rows}):
        t = next(r for r in rows if r["L"] == L and r["provider"] == "triton")
        p = next(r for r in rows if r["L"] == L and r["provider"] == "pytorch")
        line = {"L": L, "triton": t, "pytorch": p}
        if "error" not in t and "error" not in p:
            line["fwd_speedup"] = p["fwd_ms"] / t["fwd_ms"]
            line["fwd_bwd_speedup"] = p["fwd_bwd_ms"] / t["fwd_bwd_ms"]
            if "peak_mib" in t:
                line["memory_ratio"] = p["peak_mib"] / max(t["peak_mib"], 1e-9)
        out.append(line)
    return out


def format_table(lines: list[dict]) -> str:
    head = (f"{'L':>6} | {'triton fwd':>10} {'fwd+bwd':>9} {'peak MiB':>9} | {'pytorch fwd':>11} "
            f"{'fwd+bwd':>9} {'peak MiB':>9} | {'speed-up fwd':>12} {'fwd+bwd':>8} {'memory':>8}")
    rows = [head, "-" * len(head)]

    def cells(r, w_fwd):
        if "error" in r:
            return f"{r['error']:>{w_fwd + 20}}"
        mem = f"{r['peak_mib']:>9.1f}" if "peak_mib" in r else f"{'-':>9}"
        return f"{r['fwd_ms']:>{w_fwd}.3f} {r['fwd_bwd_ms']:>9.3f} {mem}"

    for ln in lines:
        s = (f"{ln['L']:>6} | {cells(ln['triton'], 10)} | {cells(ln['pytorch'], 11)} | ")
        if "fwd_speedup" in ln:
            mem = f"{ln['memory_ratio']:>7.1f}x" if "memory_ratio" in ln else f"{'-':>8}"
            s += f"{ln['fwd_speedup']:>11.1f}x {ln['fwd_bwd_speedup']:>7.1f}x {mem}"
        else:
            s += f"{'(pytorch failed)':>30}"
        rows.append(s)
    rows.append("times in ms (medians); peak MiB: one forward+backward above the inputs; "
                "memory: pytorch's peak / triton's")
    return "\n".join(rows)


def plot(lines: list[dict], env: dict, cfg: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for provider, style, color in (("triton", "o-", "C0"), ("pytorch", "s--", "C3")):
        pts = [(ln["L"], ln[provider]) for ln in lines if "error" not in ln[provider]]
        if not pts:
            continue
        Ls = [p[0] for p in pts]
        axes[0].plot(Ls, [p[1]["fwd_bwd_ms"] for p in pts], style, color=color, label=f"{provider} fwd+bwd")
        axes[0].plot(Ls, [p[1]["fwd_ms"] for p in pts], style, color=color, alpha=0.4, label=f"{provider} fwd")
        if all("peak_mib" in p[1] for p in pts):
            axes[1].plot(Ls, [p[1]["peak_mib"] for p in pts], style, color=color, label=provider)
        for ln in lines:
            if "error" in ln[provider]:  # e.g. the materialised version out of memory
                axes[0].axvline(ln["L"], color="grey", ls=":", lw=1)
                axes[0].annotate(f"{provider}: {ln[provider]['error']}", (ln["L"], 0.5),
                                 xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                                 va="center", ha="right")
    for ax, title, unit in ((axes[0], "time", "ms"), (axes[1], "peak memory (fwd+bwd)", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "measured on a GPU only", transform=ax.transAxes, ha="center")
    fig.suptitle(f"lazy attention, {cfg['dtype']} B={cfg['B']} H={cfg['H']} D={cfg['D']} W={cfg['W']} | "
                 f"{env.get('device')} | torch {env['torch']} triton {env['triton']} | {env['date'][:10]}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.lazy.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=256, help="W: bias over distances 0..W")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    ap.add_argument("--rep-ms", type=int, default=100, help="time budget per measurement (ms)")
    ap.add_argument("--out", default="runs", help="folder for the JSON and PNG (default: runs/, which git "
                    "ignores; --out results replaces the committed results)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes that run anywhere, the CPU interpreter included")
    args = ap.parse_args(argv)

    if args.quick:
        args.seqlens, args.batch, args.heads, args.head_dim, args.window = [16, 32], 1, 2, 16, 8
        if runtime.INTERPRET:
            args.dtype = "fp32"
    elif runtime.INTERPRET:
        print("No GPU: this benchmark measures GPU time and memory, and would take hours in "
              "Triton's CPU interpreter. Run it on a GPU, or add --quick to try the machinery "
              "here on tiny sizes.", file=sys.stderr)
        return 2
    env = environment()
    env["command"] = "python -m flashattn.lazy.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    cfg = dict(B=args.batch, H=args.heads, D=args.head_dim, W=args.window, dtype=args.dtype)
    print(f"lazy attention benchmark on {env['where']}: {cfg}")
    rows, check = run(args.seqlens, args.batch, args.heads, args.head_dim, args.window, args.dtype,
                      args.rep_ms)
    print("agreement with the PyTorch formula (fp32) at L=%d, worst head: %s"
          % (min(args.seqlens), ", ".join(f"{k} {v:.1e}" for k, v in check.items())))
    lines = summary(rows)
    print(format_table(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "lazy_bench_" + "".join(c if c.isalnum() else "_" for c in env["device"]).strip("_").lower()
    (out / f"{stem}.json").write_text(json.dumps(
        {"environment": env, "config": cfg, "agreement": check, "results": rows, "summary": lines},
        indent=1))
    plot(lines, env, cfg, out / f"{stem}.png")
    print(f"\nwrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
