"""Benchmark flashattn against SDPA's backends, all measured in one run.

    python -m flashattn.bench                       # the course's grid on a GPU
    python -m flashattn.bench --quick               # a tiny grid (also runs on the CPU)
    python -m flashattn.bench --dtypes fp16 --head-dims 128 --seqlens 4096 16384
    python -m flashattn.bench --host                # the CPU's time per call (flashattn/bench_host.py)

Times are medians of many runs (``triton.testing.do_bench`` on a GPU, which also flushes the
L2 cache between runs), and on a GPU the median again over ``--rounds`` rounds that take the
providers (or the ablation's steps) in turn: a GPU's clock drifts over seconds (one H100 read
the same kernel 13% apart within a minute), and taken in turn every provider meets the same
drift. FLOPs are counted as the course's anchors count them: forward 4*B*H*S_q*S_k*D, backward
2.5x the forward, causal half of either. Results go to a JSON file (device, versions, date,
every number, each round's times) and a PNG plot in runs/ (git ignores it); ``--out results``
replaces the committed results.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from . import runtime
from .bench_common import (attention_flops, command_line, device_slug, environment, in_turn,  # noqa: F401 (also bench.*)
                           measure, median_ms, median_of_rounds, providers, with_settings, with_tflops)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


DEFAULT_PROVIDERS = ["flashattn-fast", "flashattn-fused", "flashattn", "sdpa-flash", "sdpa-cudnn",
                     "sdpa-efficient"]


# --------------------------------------------------------------------------------------
# ablation: what each optimisation of the fast path buys, kernel launches timed directly
# --------------------------------------------------------------------------------------
ABLATION_STEPS = [
    ("teaching kernels (64x64 tiles)", "teaching"),
    ("fast kernels, fixed 64x64 tiles, every tile masked", "fast-masked"),
    ("fast kernels, fixed 64x64 tiles, split loops", "fast-fixed"),
    ("+ autotuned tiles / warps / stages", "fast-pointers"),
    ("+ K, V (forward), Q and dO (dK/dV) tiles through the copy engine (TMA, sm 9.0+)", "fast-tma-tiles"),
    ("+ the LSE and delta vectors through the copy engine too", "fast"),
    ("fused backward (atomic dQ) instead of two kernels", "fused"),
]


def _ablation_variant(step: str, q, k, v, do, causal, scale):
    """(forward thunk, backward thunk) for one ablation step."""
    from . import backward as teaching_bwd
    from . import planted
    from .fast import backward as fast_bwd
    from .fast import forward as fast_fwd
    from .forward import attention_forward
    from .configs import KernelConfig

    fixed = {"fwd": KernelConfig(64, 64, 4, 3), "bwd": KernelConfig(64, 64, 4, 3)}
    if step == "teaching":
        cfg = fixed["fwd"]
        o, lse = attention_forward(q, k, v, causal, scale, config=cfg)
        return (lambda: attention_forward(q, k, v, causal, scale, config=cfg),
                lambda: teaching_bwd.attention_backward(q, k, v, o, do, lse, causal, scale, config=cfg))
    o, lse = fast_fwd.fast_attention_forward(q, k, v, causal, scale)
    if step in ("fast-masked", "fast-fixed"):
        masked = step == "fast-masked"      # the causal loop split undone (planted.CATALOG)

        def fwd():
            with planted.plant(*(["fast.fwd.every_tile_masked"] if masked else [])):
                return fast_fwd.fast_attention_forward(q, k, v, causal, scale, config=fixed["fwd"])

        def bwd():
            names = ["fast.dq.every_tile_masked", "fast.dkdv.every_tile_masked"] if masked else []
            with planted.plant(*names):
                return fast_bwd.fast_attention_backward(q, k, v, o, do, lse, causal, scale, config=fixed["bwd"])

        return with_settings(fwd, tma=False), with_settings(bwd, tma=False)   # TMA is a later step
    fwd = lambda: fast_fwd.fast_attention_forward(q, k, v, causal, scale)  # noqa: E731
    if step == "fused":
        return fwd, lambda: fast_bwd.fast_attention_backward(q, k, v, o, do, lse, causal, scale, fused=True)
    bwd = lambda: fast_bwd.fast_attention_backward(q, k, v, o, do, lse, causal, scale)  # noqa: E731
    if step == "fast-pointers":
        return with_settings(fwd, tma=False), with_settings(bwd, tma=False)
    return fwd, (with_settings(bwd, tma_stats=False) if step == "fast-tma-tiles" else bwd)


def run_ablation(dtype="fp16", head_dims=(64, 128), seqlen=4096, causals=(False, True),
                 tokens=16384, hidden=2048, rep_ms=100, progress=True, rounds=1) -> list[dict]:
    """The ablation's rows; per (D, causal) its steps are timed in turn, ``rounds`` times, and
    each row holds the median (steps that run the same kernels then read the same)."""
    from tqdm.auto import tqdm

    device = runtime.default_device()
    rows = []
    groups = [(D, c, [s for s in ABLATION_STEPS if c or s[1] != "fast-masked"])  # non-causal: nothing to split
              for D in head_dims for c in causals]
    bar = tqdm(total=sum(len(steps) for *_, steps in groups) * rounds, desc="ablation", disable=not progress)
    for D, causal, steps in groups:
        B, H = max(1, tokens // seqlen), max(1, hidden // D)

        def time_step(step):
            q, k, v, do = (torch.randn(B, H, seqlen, D, dtype=DTYPES[dtype], device=device) for _ in range(4))
            fwd, bwd = _ablation_variant(step, q, k, v, do, causal, D ** -0.5)
            return dict(fwd_ms=median_ms(fwd, rep_ms), bwd_ms=median_ms(bwd, rep_ms))

        times = in_turn([step for _, step in steps], rounds, time_step, bar)
        for label, step in steps:
            rows.append(dict(step=label, dtype=dtype, B=B, H=H, S=seqlen, D=D, causal=causal,
                             **median_of_rounds(times[step], B, H, seqlen, D, causal)))
    bar.close()
    return rows


def format_ablation(rows: list[dict]) -> str:
    lines = []
    for D, causal in dict.fromkeys((r["D"], r["causal"]) for r in rows):
        lines.append(f"D={D} causal={causal} (S={rows[0]['S']}, {rows[0]['dtype']})")
        for r in rows:
            if (r["D"], r["causal"]) == (D, causal):
                lines.append(f"  {r['step']:<55}{r['fwd_tflops']:>8.1f} fwd TF/s{r['bwd_tflops']:>8.1f} bwd TF/s")
    return "\n".join(lines)


def run_grid(dtypes, head_dims, seqlens, causals, provider_names, tokens, hidden, rep_ms=100,
             progress=True, on_row=None, rounds=1) -> list[dict]:
    """One row per (configuration, provider). Per configuration the providers are measured in
    turn, ``rounds`` times over, and each row holds the median of its rounds (a provider that
    failed in the first round is not tried again)."""
    from tqdm.auto import tqdm

    table = providers()
    missing = [p for p in provider_names if p not in table]
    provider_names = [p for p in provider_names if p in table]
    if missing:
        print(f"(skipping unknown providers: {', '.join(missing)})", file=sys.stderr)
    device = runtime.default_device()
    grid = [(dt, D, S, c) for dt in dtypes for D in head_dims for S in seqlens for c in causals]
    bar = tqdm(total=len(grid) * len(provider_names) * rounds, desc="benchmark", disable=not progress)
    rows = []
    for dt, D, S, causal in grid:
        B, H = max(1, tokens // S), max(1, hidden // D)
        results = in_turn(provider_names, rounds, lambda name: measure(table[name], B, H, S, D, causal,
                                                                      DTYPES[dt], device, rep_ms), bar)
        for name in provider_names:
            rows.append(dict(provider=name, dtype=dt, B=B, H=H, S=S, D=D, causal=causal,
                             **median_of_rounds(results[name], B, H, S, D, causal)))
        if on_row is not None:
            on_row(rows)
    bar.close()
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'dtype':<5} {'D':>4} {'S':>6} {'causal':>6}  {'provider':<15}{'fwd ms':>9}{'fwd TF/s':>10}{'bwd ms':>9}{'bwd TF/s':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cfg = f"{r['dtype']:<5} {r['D']:>4} {r['S']:>6} {str(r['causal']):>6}  {r['provider']:<15}"
        if "error" in r:
            lines.append(cfg + f"  ({r['error'][:60]})")
        else:
            lines.append(cfg + f"{r['fwd_ms']:>9.3f}{r['fwd_tflops']:>10.1f}{r['bwd_ms']:>9.3f}{r['bwd_tflops']:>10.1f}")
    return "\n".join(lines)


def plot(rows: list[dict], env: dict, path: Path) -> None:
    """TFLOP/s against S, one line per provider; a panel per (dtype, D, causal, fwd/bwd)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dtype"], r["D"], r["causal"]) for r in rows}, key=str)
    fig, axes = plt.subplots(2, len(groups), figsize=(3.6 * len(groups), 6.4), squeeze=False)
    for col, (dt, D, causal) in enumerate(groups):
        for row_i, mode in enumerate(("fwd", "bwd")):
            ax = axes[row_i][col]
            for name in dict.fromkeys(r["provider"] for r in rows):
                pts = sorted((r["S"], r[f"{mode}_tflops"]) for r in rows
                             if (r["dtype"], r["D"], r["causal"], r["provider"]) == (dt, D, causal, name)
                             and "error" not in r)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode} {dt} D={D}{' causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("sequence length S")
            if col == 0:
                ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{env.get('device')}  torch {env['torch']}  triton {env['triton']}  {env['date'][:10]}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=list(DTYPES))
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--providers", nargs="+", default=DEFAULT_PROVIDERS)
    ap.add_argument("--tokens", type=int, default=16384, help="B * S, kept fixed across S")
    ap.add_argument("--hidden", type=int, default=2048, help="H * D, kept fixed across D")
    ap.add_argument("--rep-ms", type=int, default=100, help="time budget per measurement (ms)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="times each configuration's providers (and the ablation's steps) are measured "
                         "in turn; the median is kept (default: 3 on a GPU, 1 with --quick; "
                         "--dropin measures once)")
    ap.add_argument("--out", default="runs", help="folder for the JSON and PNG (default: runs/, which git "
                    "ignores; --out results replaces the committed results)")
    ap.add_argument("--name", default=None, help="file stem (default: bench_<device>)")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny grid that runs anywhere, the CPU interpreter included")
    modes = ap.add_mutually_exclusive_group()
    ap.add_argument("--ablation", action="store_true",
                    help="also measure what each optimisation of the fast path buys (S=4096)")
    modes.add_argument("--dropin", action="store_true",
                    help="instead of the grid: what SDPA users meet (head dims 80-256, GQA, S_q != S_k, "
                         "fp32, autocast, first-call time), flashattn next to SDPA's backends")
    modes.add_argument("--host", action="store_true",
                    help="instead of the grid: the CPU's time per call at a tiny shape (B1 H2 S128 D128, "
                         "causal), where the GPU waits on the host; flashattn with and without its direct "
                         "launch next to SDPA's cuDNN and flash backends, taken in turn call by call")
    modes.add_argument("--host-profile", action="store_true",
                    help="instead of the grid: one drop-in call's host time, layer by layer, at three small "
                         "shapes (bf16, causal); writes host_profile_<device>.md")
    modes.add_argument("--train", action="store_true",
                    help="instead of the grid: training steps of a GPT-2-small-like and a Llama-like block "
                         "stack, eager and torch.compile, flashattn against torch's SDPA (default backend, "
                         "cuDNN, FlashAttention-2), in turn; writes train_<device>.json")
    ap.add_argument("--train-models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"],
                    help="with --train: the GPT-2-small-like and/or the Llama-like stack (default: both)")
    ap.add_argument("--train-modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"],
                    help="with --train: eager and/or torch.compile (default: both)")
    ap.add_argument("--train-steps", type=int, default=20, help="steps per provider per round (--train)")
    ap.add_argument("--groups", nargs="+", default=None,
                    help="with --dropin: only the groups starting with these words (e.g. fp32 autocast), "
                         "and no first-call times")
    ap.add_argument("--no-precompile", action="store_true",
                    help="let the autotuner compile lazily instead of compiling all variants first")
    args = ap.parse_args(argv)

    if args.quick:
        args.seqlens, args.head_dims, args.tokens, args.hidden = [64, 128], [32], 128, 64
        args.dtypes = ["fp16"] if runtime.INTERPRET else args.dtypes[:1]
        args.providers = [p for p in args.providers if p in ("flashattn", "flashattn-fast", "sdpa-flash", "naive")]
        if runtime.INTERPRET:  # the fast path is for GPUs (fp16/bf16 tensor cores)
            args.providers = [p for p in args.providers if p != "flashattn-fast"]
    elif runtime.INTERPRET and not (args.dropin or args.host or args.train or args.host_profile):   # those say why themselves
        print("No GPU: the full benchmark would take hours in Triton's interpreter and measure "
              "nothing useful. Run it on a GPU, or use --quick to try the machinery here.",
              file=sys.stderr)
        return 2
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    env = environment()
    if args.dropin:
        return _main_dropin(args, env, argv)
    if args.host:
        return _main_host(args, env, argv)
    if args.train:
        return _main_train(args, env, argv)
    if args.host_profile:
        return _main_host_profile(args, env, argv)
    out, stem = _output(args, env, argv, "bench_")
    print(f"benchmarking on {env['where']}")
    if not args.no_precompile and any(p.startswith("flashattn-") for p in args.providers):
        from .fast import precompile

        spent = precompile([DTYPES[d] for d in args.dtypes], args.head_dims, causals)
        env["precompile_s"] = round(spent, 1)
        print(f"compiled the fast kernels' variants in {spent:.0f} s")
    ablation: list = []

    def save(rows):  # after every measurement, so an interrupted run still leaves its numbers
        (out / f"{stem}.json").write_text(json.dumps({"environment": env, "results": rows,
                                                      "ablation": ablation}, indent=1))

    rows = run_grid(args.dtypes, args.head_dims, args.seqlens, causals, args.providers,
                    args.tokens, args.hidden, args.rep_ms, on_row=save, rounds=args.rounds)
    if args.ablation:
        ablation = run_ablation(args.dtypes[0], args.head_dims, 4096, causals, args.tokens,
                                args.hidden, args.rep_ms, rounds=args.rounds)
        save(rows)
    plot(rows, env, out / f"{stem}.png")
    print(format_table(rows))
    if ablation:
        print("\nablation\n" + format_ablation(ablation))
    print(f"\nwrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    return 0


def _output(args, env, argv, prefix: str) -> tuple[Path, str]:
    """Records the command line in ``env``, makes the output folder and returns it with the file
    stem: ``--name``, or ``prefix`` and the device's name."""
    env["command"] = command_line("python -m flashattn.bench", argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out, args.name or prefix + "".join(c if c.isalnum() else "_" for c in env["device"]).strip("_").lower()


def _main_dropin(args, env, argv) -> int:
    from . import bench_dropin

    if runtime.INTERPRET:
        print("No GPU: --dropin times GPU kernels and compiles in fresh processes.", file=sys.stderr)
        return 2
    out, stem = _output(args, env, argv, "bench_dropin_")
    first: list = []

    def save(rows):
        (out / f"{stem}.json").write_text(json.dumps({"environment": env, "results": rows,
                                                      "first_call": first}, indent=1))

    if not args.groups:
        first.extend(bench_dropin.first_calls())     # before anything compiles in this process
    rows = bench_dropin.run(args.rep_ms, on_row=save, groups=args.groups)
    save(rows)
    print(bench_dropin.format_table(rows, first))
    print(f"\nwrote {out / (stem + '.json')}")
    return 0


def _main_host(args, env, argv) -> int:
    from . import bench_host

    if runtime.INTERPRET:
        print("No GPU: --host measures how long the CPU takes to launch GPU kernels.", file=sys.stderr)
        return 2
    out, stem = _output(args, env, argv, "host_")
    rows = bench_host.run()
    (out / f"{stem}.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    print(bench_host.format_table(rows))
    print(f"\nwrote {out / (stem + '.json')}")
    return 0


def _main_host_profile(args, env, argv) -> int:
    from . import bench_host

    if runtime.INTERPRET:
        print("No GPU: --host-profile measures how long the CPU takes to launch GPU kernels.", file=sys.stderr)
        return 2
    out, _ = _output(args, env, argv, "host_profile_")
    stem = args.name or f"host_profile_{device_slug(env['device'])}"
    from .fast import native

    tables = {shape: bench_host.profile_layers(*shape) for shape in bench_host.PROFILE_SHAPES}
    shape = bench_host.PROFILE_SHAPES[0]
    calls, engine = bench_host.per_call(), (shape, bench_host.engine_handoff(*shape))
    env["native"] = native.status()     # (a node that did not build would leave the Python node's numbers)
    text = bench_host.profile_markdown(tables, env, calls, engine=engine)
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"wrote {out / (stem + '.md')}")
    return 0


def _main_train(args, env, argv) -> int:
    from . import bench_train

    if runtime.INTERPRET and not args.quick:
        print("No GPU: --train times training steps on a GPU (--quick runs tiny models anywhere).", file=sys.stderr)
        return 2
    out, _ = _output(args, env, argv, "train_")
    stem = args.name or f"train_{device_slug(env['device'])}"
    rows = bench_train.run(models=args.train_models, modes=args.train_modes,
                           providers=bench_train.PROVIDERS if not runtime.INTERPRET else ("torch-sdpa",),
                           steps=2 if args.quick else args.train_steps, rounds=args.rounds,
                           warmup=1 if args.quick else 5, quick=args.quick)
    if not runtime.INTERPRET:
        from .fast import native

        env["native"] = native.status()     # which autograd node the drop-in's steps ran
    (out / f"{stem}.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1) + "\n")
    print(bench_train.format_table(rows))
    print(f"\nwrote {out / (stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
