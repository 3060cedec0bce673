"""How far the fast path is from cuDNN, configuration by configuration, and what Nsight Compute
says limits each one: the closing table of issue 13 (``results/cudnn_gap_h100.md``).

Two inputs, both committed under ``results/``:

- ``bench_fp16.json`` and ``bench_bf16.json``: the benchmark (``python -m flashattn.bench``),
  every provider timed in one run. They say *how far*.
- ``profile_sweep_h100.json``: one Nsight Compute pass over the same grid in fp16 (bf16 runs the
  same kernels with the same tiles), read from ncu's CSV by ``read`` below. It says *why*.

    python -m flashattn.gap metrics [QUERY.txt]      # the --metrics list for ncu (only those that
                                                     # `ncu --query-metrics` printed into QUERY.txt)
    python -m flashattn.gap read OUT.json NCU_VERSION RAW.csv MANIFEST.json [RAW.csv MANIFEST.json ...]
    python -m flashattn.gap table [--results DIR] [--out FILE]   # default: results/cudnn_gap_h100.md

The profile is taken on a GPU with ``python -m flashattn.nsight sweep`` under ncu (the commands
are in the table's header); everything here only reads JSON and CSV, so it runs anywhere.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

#: Nsight Compute's stall reasons, as "warps stalled for this reason per cycle that issued".
STALL_REASONS = ("wait", "barrier", "long_scoreboard", "short_scoreboard", "mio_throttle",
                 "math_pipe_throttle", "dispatch_stall", "not_selected", "selected", "no_instruction",
                 "lg_throttle", "branch_resolving", "membar", "sleeping", "drain", "imc_miss", "tex_throttle")

#: Our name for each counter -> ncu's metric. The tensor-op counter counts FLOPs (an FMA is two).
METRICS = {
    "duration_ns": "gpu__time_duration.sum",
    "sm_clock_hz": "sm__cycles_elapsed.avg.per_second",
    "tensor_pipe_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor_flops_fp16": "sm__ops_path_tensor_op_hgmma_src_fp16_sparsity_off.sum",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "xu_pipe_pct": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "warps_active_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "ctas_limit_registers": "launch__occupancy_limit_registers",
    "ctas_limit_shared_mem": "launch__occupancy_limit_shared_mem",
    "ctas_limit_warps": "launch__occupancy_limit_warps",
    "ctas_limit_blocks": "launch__occupancy_limit_blocks",
    "grid_size": "launch__grid_size",
    "block_size": "launch__block_size",
    "local_load_sectors": "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum",
    **{f"stall_{r}": f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in STALL_REASONS},
}

#: sm 9.0: 64 resident warps per SM over 4 schedulers.
MAX_WARPS_PER_SCHEDULER = 16
#: Our kernels' names start so; every other kernel in a profiled range is cuDNN's.
OUR_KERNELS = ("fast_", "attn_bwd_")
#: Where a kernel counts as held by a unit rather than by latency.
BOUND_AT = {"dram_pct": 60.0, "tensor_pipe_pct": 80.0, "issue_active_pct": 70.0}


def metric_list(query_text: str | None = None) -> list[str]:
    """ncu's names of ``METRICS`` but the launch statistics (``launch__*``, which ncu records for
    every kernel and ``--query-metrics`` does not list); with the text of ``ncu --query-metrics``,
    only those it knows (ncu refuses a whole run over one unknown metric)."""
    names = [n for n in METRICS.values() if not n.startswith("launch__")]   # ncu collects these anyway
    if query_text is None:
        return names
    known = {line.split()[0] for line in query_text.splitlines() if line.strip()}
    return [n for n in names if n.split(".")[0] in known]


# --------------------------------------------------------------------------------------
# reading ncu's CSV
# --------------------------------------------------------------------------------------
def _number(text: str):
    cleaned = text.replace(",", "").strip()
    try:
        return float(cleaned)
    except ValueError:
        return None


def read_ncu_csv(path) -> list[dict]:
    """The kernels of ``ncu --import R --page raw --csv --print-units base``, in launch order:
    ``{"name", "grid", "block", <our counter names>: float}``. Metrics ncu did not collect are
    absent; the units row is skipped."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]   # ncu's own ==PROF== lines
    rows = list(csv.DictReader(lines))
    by_metric = {ncu: ours for ours, ncu in METRICS.items()}
    kernels = []
    for row in rows:
        if not row.get("ID", "").strip().isdigit():   # the units row
            continue
        name = row["Kernel Name"].split("(")[0].strip()      # a C++ kernel's argument list is noise here
        kernel = {"name": name, "grid": row.get("Grid Size", ""), "block": row.get("Block Size", "")}
        for column, value in row.items():
            if column in by_metric and _number(value) is not None:
                kernel[by_metric[column]] = _number(value)
        kernels.append(kernel)
    return kernels


def group_kernels(kernels: list[dict], manifest: dict) -> list[dict]:
    """Split the launch-ordered kernels into the manifest's configurations (``nsight.main_sweep``'s
    order: each starts at ``fast_fwd_kernel``, our backward's kernels follow, cuDNN's forward is
    the first other kernel, its backward the rest) and tag each kernel with its pass."""
    starts = [i for i, k in enumerate(kernels) if k["name"].startswith("fast_fwd_kernel")]
    if len(starts) != len(manifest["configs"]):
        raise ValueError(f"expected {len(manifest['configs'])} profiled configurations (one fast_fwd_kernel "
                         f"each), found {len(starts)} in the CSV")
    out = []
    for config, a, b in zip(manifest["configs"], starts, starts[1:] + [len(kernels)]):
        group = kernels[a:b]
        theirs = next((j for j, k in enumerate(group) if not k["name"].startswith(OUR_KERNELS)), None)
        if theirs is None or theirs < 2 or theirs == len(group) - 1:
            names = [k["name"][:40] for k in group]
            raise ValueError(f"D={config['D']} S={config['S']} causal={config['causal']}: expected our forward, "
                             f"our backward, cuDNN's forward, cuDNN's backward; got {names}")
        passes = ["ours fwd"] + ["ours bwd"] * (theirs - 1) + ["cudnn fwd"] + ["cudnn bwd"] * (len(group) - theirs - 1)
        out.append(dict(config, kernels=[dict(k, part=p) for k, p in zip(group, passes)]))
    return out


# --------------------------------------------------------------------------------------
# what the counters say
# --------------------------------------------------------------------------------------
def flops(kernel: dict, dtype: str) -> float:
    return kernel.get(f"tensor_flops_{dtype}", 0.0)


def ctas_per_sm(kernel: dict) -> int:
    limits = [kernel[k] for k in ("ctas_limit_registers", "ctas_limit_shared_mem", "ctas_limit_warps",
                                  "ctas_limit_blocks") if k in kernel]
    return int(min(limits)) if limits else 0


def warps_per_scheduler(kernel: dict) -> float:
    return kernel.get("warps_active_pct", 0.0) / 100 * MAX_WARPS_PER_SCHEDULER


def top_stalls(kernel: dict, n: int = 2) -> list[tuple[str, float]]:
    stalls = [(r, kernel.get(f"stall_{r}", 0.0)) for r in STALL_REASONS if r != "selected"]
    return sorted(stalls, key=lambda s: -s[1])[:n]


def limiter(kernel: dict) -> str:
    """What holds one kernel, from its counters: a unit past ``BOUND_AT``, else latency (too few
    warps ready to issue; with issue contention too when "not selected" is the largest stall),
    with the stalls that keep them waiting."""
    if kernel.get("dram_pct", 0) >= BOUND_AT["dram_pct"]:
        return f"memory bandwidth (DRAM {kernel['dram_pct']:.0f}%)"
    if kernel.get("tensor_pipe_pct", 0) >= BOUND_AT["tensor_pipe_pct"]:
        return f"tensor pipe ({kernel['tensor_pipe_pct']:.0f}%)"
    if kernel.get("issue_active_pct", 0) >= BOUND_AT["issue_active_pct"]:
        return f"instruction issue ({kernel['issue_active_pct']:.0f}%)"
    top = top_stalls(kernel)
    stalls = ", ".join(f"{r.replace('_', ' ')} {v:.1f}" for r, v in top)
    spills = " spills," if kernel.get("local_load_sectors", 0) > 0 else ""
    # "not selected" first: ready warps waited for the issue slot another warp took
    kind = "latency and issue contention" if top[0][0] == "not_selected" else "latency"
    return (f"{kind}: {warps_per_scheduler(kernel):.1f} warps/scheduler,{spills} tensor "
            f"{kernel.get('tensor_pipe_pct', 0):.0f}%, issue {kernel.get('issue_active_pct', 0):.0f}%; "
            f"stalls/issue {stalls}")


def compare(config: dict, dtype: str, direction: str) -> dict:
    """Ours against cuDNN in one pass of one profiled configuration: kernel time, tensor FLOPs
    executed and their rate, so that time ratio = FLOP ratio / rate ratio exactly."""
    ours = [k for k in config["kernels"] if k["part"] == f"ours {direction}"]
    theirs = [k for k in config["kernels"] if k["part"] == f"cudnn {direction}"]
    t_ours, t_theirs = (sum(k["duration_ns"] for k in ks) * 1e-6 for ks in (ours, theirs))
    f_ours, f_theirs = (sum(flops(k, dtype) for k in ks) for ks in (ours, theirs))
    gemm = [k for k in ours if flops(k, dtype) > 0]       # our kernels with matrix products
    their_main = max(theirs, key=lambda k: k["duration_ns"])
    return dict(ours_ms=t_ours, cudnn_ms=t_theirs, flop_ratio=f_ours / f_theirs,
                rate_ratio=(f_ours / t_ours) / (f_theirs / t_theirs), ours_tflops=f_ours / t_ours * 1e-9,
                cudnn_tflops=f_theirs / t_theirs * 1e-9, kernels=ours, gemm=gemm, cudnn_main=their_main)


def short_name(name: str) -> str:
    for ours, label in (("fast_fwd", "fwd"), ("fast_dq", "dQ"), ("fast_dkdv", "dK/dV"), ("attn_bwd_delta", "delta")):
        if name.startswith(ours):
            return label
    if "fprop" in name or "bprop" in name:
        return "cuDNN " + ("fprop" if "fprop" in name else "bprop")
    return "cuDNN " + name.split("(")[0].split("::")[-1].split("<")[0]   # void cudnn::f<...>(args) -> f


def why(cmp: dict, direction: str) -> str:
    """One cell: what the profile says limits ours in this pass."""
    parts = []
    if cmp["flop_ratio"] > 1.1:
        recompute = " (the dQ kernel recomputes S and dP)" if direction == "bwd" else ""
        parts.append(f"{cmp['flop_ratio']:.2f}x cuDNN's tensor FLOPs{recompute}")
    theirs = cmp["cudnn_main"]
    for k in sorted(cmp["gemm"], key=lambda k: -k["duration_ns"]):
        parts.append(f"{short_name(k['name'])}: {limiter(k)}")
    parts.append(f"cuDNN: tensor {theirs.get('tensor_pipe_pct', 0):.0f}%, "
                 f"{warps_per_scheduler(theirs):.1f} warps/scheduler")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------
def bench_rows(results: Path) -> list[dict]:
    """One row per (dtype, D, S, causal, pass): our time, cuDNN's and FA2's (SDPA flash)."""
    rows = []
    for dtype in ("fp16", "bf16"):
        data = json.loads((results / f"bench_{dtype}.json").read_text())
        by = {(r["provider"], r["D"], r["S"], r["causal"]): r for r in data["results"]}
        for (provider, D, S, causal), r in sorted(by.items(), key=lambda kv: kv[0][1:]):
            if provider != "flashattn-fast":
                continue
            for direction in ("fwd", "bwd"):
                cudnn, fa2 = by[("sdpa-cudnn", D, S, causal)], by[("sdpa-flash", D, S, causal)]
                rows.append(dict(dtype=dtype, D=D, S=S, causal=causal, direction=direction,
                                 ours_ms=r[f"{direction}_ms"], cudnn_ms=cudnn[f"{direction}_ms"],
                                 fa2_ms=fa2[f"{direction}_ms"], environment=data["environment"]))
    for row in rows:
        row["vs_cudnn"] = row["cudnn_ms"] / row["ours_ms"]
        row["vs_fa2"] = row["fa2_ms"] / row["ours_ms"]
    return rows


def cut_needed(ratio: float, target: float) -> float:
    """The share of our time to remove to reach ``target`` x cuDNN's speed (0 if there)."""
    return max(0.0, 1 - ratio / target)


def _span(values, digits=2) -> str:
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def build_table(results: Path) -> str:
    rows = bench_rows(results)
    profile = json.loads((results / "profile_sweep_h100.json").read_text())
    pdtype = profile["dtype"]
    profiled = {(c["D"], c["S"], c["causal"]): c for c in profile["configs"]}
    env = rows[0]["environment"]
    out = ["# How far from cuDNN, and why: every benchmark configuration on the H100 (issue 13)", ""]
    out += [f"- **Benchmark:** {env['device']}, torch {env['torch']}, triton {env['triton']}, cuDNN "
            f"{env.get('cudnn')}, {env['date'][:10]}; `results/bench_fp16.json`, `results/bench_bf16.json` "
            f"(commands in their `environment`). B*S = 16384, H*D = 2048; times are medians of three rounds, "
            f"every provider in one run.",
            f"- **Profile:** {profile['device']}, torch {profile['torch']}, triton {profile['triton']}, "
            f"{profile.get('ncu', 'ncu')}, {profile['date'][:10]}; `results/profile_sweep_h100.json`. One launch "
            f"of each kernel in {pdtype} (bf16 runs the same kernels with the same tiles, so its rows cite "
            f"the {pdtype} profile), clocks as found.",
            "- **Regenerate:** `python -m flashattn.gap table`; the profile's commands are at the end.", ""]
    # ---- summary, as the issue counts it
    out += ["## Summary", "", "| ours / | min | median | max | at >= 0.9x | at >= 1.0x | at >= 1.2x |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, key in (("cuDNN (SDPA cuDNN backend)", "vs_cudnn"), ("FlashAttention-2 (SDPA flash)", "vs_fa2")):
        v = [r[key] for r in rows]
        out.append(f"| {label} | {min(v):.2f} | {statistics.median(v):.2f} | {max(v):.2f} | "
                   f"{sum(x >= 0.9 for x in v)}/{len(v)} | {sum(x >= 1.0 for x in v)}/{len(v)} | "
                   f"{sum(x >= 1.2 for x in v)}/{len(v)} |")
    out.append("")
    # ---- config by config
    out += ["## Configuration by configuration", "",
            "*x cuDNN*: cuDNN's time / ours (above 1: we are faster). *Cut for 0.9x / 1.0x*: the share of "
            "our time that would have to go. *FLOPs* and *rate*: from the profile, tensor-core FLOPs executed "
            "and FLOPs per second of kernel time, ours over cuDNN's, so that ncu's time ratio = FLOPs / rate. "
            "*Limits*: from the counters of our kernels in that pass (largest first): a unit past "
            f"{BOUND_AT['dram_pct']:.0f}% DRAM, {BOUND_AT['tensor_pipe_pct']:.0f}% tensor pipe or "
            f"{BOUND_AT['issue_active_pct']:.0f}% issue would be named; otherwise latency, with the resident "
            f"warps per scheduler (at most {MAX_WARPS_PER_SCHEDULER}) and the largest stalls per issued "
            "instruction.", "",
            "| dtype | D | S | causal | pass | ours ms | cuDNN ms | x cuDNN | x FA2 | cut for 0.9x / 1.0x | "
            "FLOPs | rate | limits (ncu) |",
            "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        c = profiled.get((r["D"], r["S"], r["causal"]))
        if c is None:
            flop_cell = rate_cell = limits = "not profiled"
        else:
            cmp = compare(c, pdtype, r["direction"])
            flop_cell, rate_cell, limits = f"{cmp['flop_ratio']:.2f}", f"{cmp['rate_ratio']:.2f}", why(cmp, r["direction"])
        cut = f"{cut_needed(r['vs_cudnn'], 0.9):.0%} / {cut_needed(r['vs_cudnn'], 1.0):.0%}"
        out.append(f"| {r['dtype']} | {r['D']} | {r['S']} | {'yes' if r['causal'] else 'no'} | {r['direction']} | "
                   f"{r['ours_ms']:.3f} | {r['cudnn_ms']:.3f} | {r['vs_cudnn']:.2f} | {r['vs_fa2']:.2f} | {cut} | "
                   f"{flop_cell} | {rate_cell} | {limits} |")
    out.append("")
    out += reading(rows, profile)
    out += kernel_table(profile)
    out += ["## Commands", "", "```"] + profile.get("commands", []) + ["```", ""]
    return "\n".join(out)


def reading(rows: list[dict], profile: dict) -> list[str]:
    """The table's pattern, in numbers computed from it."""
    pdtype = profile["dtype"]
    lines = ["## What the profile says", ""]
    for D in sorted({c["D"] for c in profile["configs"]}):
        configs = [c for c in profile["configs"] if c["D"] == D]
        fwd = [compare(c, pdtype, "fwd") for c in configs]
        bwd = [compare(c, pdtype, "bwd") for c in configs]
        bench = {d: [r["vs_cudnn"] for r in rows if r["D"] == D and r["direction"] == d] for d in ("fwd", "bwd")}
        ours = [c["gemm"][0] for c in fwd]
        theirs = [c["cudnn_main"] for c in fwd]
        lines.append(
            f"- **D = {D} forward** ({_span(bench['fwd'])}x cuDNN in the benchmark): the same tensor FLOPs "
            f"({_span([c['flop_ratio'] for c in fwd])}x), at {_span([c['rate_ratio'] for c in fwd])}x cuDNN's "
            f"rate. Our kernel keeps the tensor pipe {_span([k['tensor_pipe_pct'] for k in ours], 0)}% busy "
            f"with {_span([warps_per_scheduler(k) for k in ours], 1)} resident warps per scheduler and issues "
            f"on {_span([k['issue_active_pct'] for k in ours], 0)}% of cycles; cuDNN's "
            f"{_span([k['tensor_pipe_pct'] for k in theirs], 0)}% with "
            f"{_span([warps_per_scheduler(k) for k in theirs], 1)} and "
            f"{_span([k['issue_active_pct'] for k in theirs], 0)}%.")
        rates = [c["rate_ratio"] for c in bwd]
        verdict = ("per FLOP our two kernels are as fast as cuDNN's one or faster, and the whole gap is the "
                   "recomputation" if min(rates) >= 1 else
                   "so the gap is the recomputation and, where the rate is under 1, kernel efficiency too")
        lines.append(
            f"- **D = {D} backward** ({_span(bench['bwd'])}x cuDNN in the benchmark): "
            f"{_span([c['flop_ratio'] for c in bwd])}x cuDNN's tensor FLOPs, at {_span(rates)}x its rate: "
            f"{verdict}. With cuDNN's five products at today's rate the backward would read {_span(rates)}x cuDNN.")
    ours_all = [k for c in profile["configs"] for d in ("fwd", "bwd") for k in compare(c, pdtype, d)["gemm"]]
    held = sorted({limiter(k).split(" (")[0] for k in ours_all if not limiter(k).startswith("latency")})
    first = ("No kernel of ours is held by a unit: DRAM, the tensor pipe and instruction issue are all below "
             "their bounds. They wait." if not held else
             f"Some of our kernels are held by a unit ({', '.join(held)}: see the table); the rest wait.")
    lines += ["", first + " At one or two programs per SM (up to 255 registers per thread) "
              "each warpgroup waits for its own matrix product, then does its softmax or dS arithmetic while "
              "the tensor cores idle (`results/profile_h100.md` shows the stalls instruction by instruction; "
              "at D = 64 the forward's 16 warps per SM also contend for issue slots). cuDNN's kernels split "
              "their warps into a producer and two consumers with reallocated registers (168 per thread), so "
              "one consumer's arithmetic overlaps the other's products; Triton 3.6 does not give a kernel "
              "written as ours that structure (notebook 06 lists what was tried). In the backward the "
              "two-kernel design costs more than any kernel's efficiency: the dQ kernel recomputes S = QK^T "
              "and dP = dO V^T, seven matrix products against cuDNN's five, which its single kernel avoids "
              "by adding dQ with atomics; this package's single kernel (`backward=\"fused\"`) has the five "
              "products but spills at 255 registers and was measured slower (notebook 06).", ""]
    return lines


def kernel_table(profile: dict) -> list[str]:
    pdtype = profile["dtype"]
    out = [f"## Kernel by kernel ({pdtype}, one launch each under ncu)", "",
           "| D | S | causal | kernel | ms | TFLOP/s | tensor % | issue % | DRAM % | regs | CTAs/SM x warps "
           "| warps/scheduler | top stalls per issue | local loads |",
           "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |"]
    for c in profile["configs"]:
        for k in c["kernels"]:
            ms = k["duration_ns"] * 1e-6
            tflops = flops(k, pdtype) / ms * 1e-9 if flops(k, pdtype) else 0
            stalls = ", ".join(f"{r.replace('_', ' ')} {v:.1f}" for r, v in top_stalls(k, 3))
            warps = int(k.get("block_size", 0)) // 32
            out.append(f"| {c['D']} | {c['S']} | {'yes' if c['causal'] else 'no'} | {short_name(k['name'])} | "
                       f"{ms:.3f} | {tflops:.0f} | {k.get('tensor_pipe_pct', 0):.0f} | "
                       f"{k.get('issue_active_pct', 0):.0f} | {k.get('dram_pct', 0):.0f} | {int(k.get('registers', 0))} | "
                       f"{ctas_per_sm(k)} x {warps} | {warps_per_scheduler(k):.1f} | {stalls} | "
                       f"{int(k.get('local_load_sectors', 0))} |")
    out.append("")
    return out


#: What ``results/profile_sweep_h100.json`` came from, run on the GPU from the repository's root
#: (one ncu process per head dim, so that a slow one cannot take the other with it).
RECIPE = [
    "ncu --query-metrics --chip gh100 > query.txt",
    "M=$(python -m flashattn.gap metrics query.txt)",
    "for D in 64 128; do",
    "  ncu --clock-control none --profile-from-start off --metrics $M -o sweep_$D \\",
    "      python -m flashattn.nsight sweep fp16 manifest_$D.json $D",
    "  ncu --import sweep_$D.ncu-rep --page raw --csv --print-units base > raw_$D.csv",
    "done",
    "python -m flashattn.gap read results/profile_sweep_h100.json \"$(ncu --version | tail -1)\" \\",
    "    raw_64.csv manifest_64.json raw_128.csv manifest_128.json",
    "python -m flashattn.gap table",
]


def read_profile(pairs, ncu_version: str | None = None) -> dict:
    """The profile JSON from (ncu CSV, sweep manifest) pairs, one per ncu run, in order."""
    profile = {}
    configs = []
    for csv_path, manifest_path in pairs:
        manifest = json.loads(Path(manifest_path).read_text())
        configs += group_kernels(read_ncu_csv(csv_path), manifest)
        profile.update({k: v for k, v in manifest.items() if k != "configs"})
    if not any(flops(k, profile["dtype"]) for c in configs for k in c["kernels"]):
        raise ValueError(f"no tensor FLOPs counted for {profile['dtype']}: METRICS reads the fp16 counter "
                         f"(ncu has no bf16 twin on sm 9.0), so sweep in fp16")
    if ncu_version:
        profile["ncu"] = ncu_version
    profile["commands"] = RECIPE
    profile["configs"] = configs
    return profile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.gap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("metrics", help="print ncu's --metrics list")
    m.add_argument("query", nargs="?", help="the output of `ncu --query-metrics --chip gh100`")
    r = sub.add_parser("read", help="ncu's raw CSVs and the sweep's manifests -> profile JSON")
    r.add_argument("out")
    r.add_argument("ncu_version")
    r.add_argument("files", nargs="+", help="RAW.csv MANIFEST.json, once per ncu run")
    t = sub.add_parser("table", help="write the gap table")
    t.add_argument("--results", default="results")
    t.add_argument("--out", default=None, help="default: RESULTS/cudnn_gap_h100.md; - for stdout only")
    args = ap.parse_args(argv)
    if args.command == "metrics":
        print(",".join(metric_list(Path(args.query).read_text() if args.query else None)))
    elif args.command == "read":
        if len(args.files) % 2:
            ap.error(f"read takes RAW.csv MANIFEST.json pairs, got {len(args.files)} files")
        profile = read_profile(zip(args.files[::2], args.files[1::2]), args.ncu_version)
        Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
        print(f"{len(profile['configs'])} configurations -> {args.out}")
    else:
        text = build_table(Path(args.results))
        if args.out == "-":
            print(text)
        else:
            out = Path(args.out or Path(args.results) / "cudnn_gap_h100.md")
            out.write_text(text)
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
