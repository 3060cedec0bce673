"""How far the fast path is from cuDNN, configuration by configuration, and what Nsight Compute
measures on both sides: the closing table of issue 13 (``results/cudnn_gap_h100.md``).

Two inputs, both committed under ``results/``:

- ``bench_fp16.json`` and ``bench_bf16.json``: the benchmark (``python -m flashattn.bench``),
  every provider timed in one run. They say *how far*.
- ``profile_sweep_h100.json``: one Nsight Compute pass over the same grid in fp16, read from
  ncu's CSV by ``read`` below. It says *where the time goes*: our kernels in bf16 are the same
  kernels with the same tiles (the tile choice depends on the element size only), so bf16's rows
  cite it too; cuDNN's bf16 kernels were not profiled.

The organising identity: a pass's matrix kernels take time = tensor FLOPs / FLOP rate, so for
ours against cuDNN's, time ratio = FLOP ratio / rate ratio. A FLOP ratio above 1 is work cuDNN
does not do; a rate ratio below 1 is the same work done slower. The rate splits once more into
the SM clock each ran at and the FLOPs per cycle.

    python -m flashattn.gap metrics [QUERY.txt]      # the --metrics list for ncu (only those that
                                                     # `ncu --query-metrics` printed into QUERY.txt)
    python -m flashattn.gap read OUT.json NCU_VERSION RAW.csv MANIFEST.json [RAW.csv MANIFEST.json ...]
    python -m flashattn.gap table [--results DIR] [--out FILE]   # default: results/cudnn_gap_h100.md
    python -m flashattn.gap table --device h200   # bench_{fp16,bf16}_h200.json, profile_sweep_h200.json
                                                  # -> cudnn_gap_h200.md (``files``)

The profile is taken on a GPU with ``python -m flashattn.nsight sweep`` under ncu (``RECIPE``
below, also printed at the end of the table); everything here only reads JSON and CSV, so it
runs anywhere.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

#: Nsight Compute's stall reasons, as "warps stalled for this reason per cycle that issued". Its
#: "barrier" includes a warpgroup waiting for its own wgmma (``WARPGROUP.DEPBAR``; see
#: ``results/profile_h100.md``), not only the CTA-wide ``BAR.SYNC``.
STALL_REASONS = ("wait", "barrier", "long_scoreboard", "short_scoreboard", "mio_throttle",
                 "math_pipe_throttle", "dispatch_stall", "not_selected", "selected", "no_instruction",
                 "lg_throttle", "branch_resolving", "membar", "sleeping", "drain", "imc_miss", "tex_throttle")

#: Our name for each counter -> ncu's metric. ``tensor_flops`` counts the fp16 wgmma FLOPs (an FMA
#: is two); sm 9.0 has no bf16 twin of that counter, hence the fp16 sweep.
METRICS = {
    "duration_ns": "gpu__time_duration.sum",
    "sm_clock_hz": "sm__cycles_elapsed.avg.per_second",
    "tensor_pipe_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor_flops": "sm__ops_path_tensor_op_hgmma_src_fp16_sparsity_off.sum",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "warps_active_per_scheduler": "smsp__warps_active.avg.per_cycle_active",      # resident
    "warps_eligible_per_scheduler": "smsp__warps_eligible.avg.per_cycle_active",  # ready to issue
    "registers": "launch__registers_per_thread",
    "ctas_limit_registers": "launch__occupancy_limit_registers",
    "ctas_limit_shared_mem": "launch__occupancy_limit_shared_mem",
    "ctas_limit_warps": "launch__occupancy_limit_warps",
    "ctas_limit_blocks": "launch__occupancy_limit_blocks",
    "block_size": "launch__block_size",
    "local_load_sectors": "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum",
    **{f"stall_{r}": f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in STALL_REASONS},
}

#: Our kernels' names start so; every other kernel in a profiled range is cuDNN's. (``hopper_``: the
#: Gluon kernels, which the fast path runs on Hopper where they measured faster.)
OUR_KERNELS = ("fast_", "attn_bwd_", "hopper_")
#: Our forward kernels: each profiled configuration starts at one of them.
FORWARD_KERNELS = ("fast_fwd_kernel", "hopper_fwd_kernel")
#: PyTorch's own elementwise kernels: ours where they come before cuDNN's forward (the Gluon backward
#: zeroes its fp32 dQ buffer and converts it with them), cuDNN's after it.
TORCH_KERNELS = ("void at::",)
#: A unit counts as saturated from these shares of its peak on.
BOUND_AT = {"dram_pct": 60.0, "tensor_pipe_pct": 80.0, "issue_active_pct": 70.0}
UNITS = {"dram_pct": "memory bandwidth", "tensor_pipe_pct": "tensor pipe", "issue_active_pct": "instruction issue"}


def metric_list(query_text: str | None = None) -> list[str]:
    """ncu's names of ``METRICS`` but the launch statistics (``launch__*``, which ncu records for
    every kernel and ``--query-metrics`` does not list); with the text of ``ncu --query-metrics``,
    only those it knows (ncu refuses a whole run over one unknown metric)."""
    names = [n for n in METRICS.values() if not n.startswith("launch__")]
    if query_text is None:
        return names
    known = {line.split()[0] for line in query_text.splitlines() if line.strip()}
    return [n for n in names if n.split(".")[0] in known]


# --------------------------------------------------------------------------------------
# reading ncu's CSV
# --------------------------------------------------------------------------------------
def _number(text: str):
    try:
        return float(text.replace(",", "").strip())    # ncu may print thousands separators
    except ValueError:
        return None


def read_ncu_csv(path) -> list[dict]:
    """The kernels of ``ncu --import R --page raw --csv --print-units base``, in launch order:
    ``{"name", "grid", "block", <our counter names>: float}``. Metrics ncu did not collect are
    absent; the units row is skipped."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]   # ncu's own ==PROF== lines
    by_metric = {ncu: ours for ours, ncu in METRICS.items()}
    kernels = []
    for row in csv.DictReader(lines):
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
    """Split the launch-ordered kernels into the manifest's configurations and tag each kernel
    with its part. ``nsight.main_sweep`` launches, per configuration: our forward
    (``fast_fwd_kernel``, or on Hopper ``hopper_fwd_kernel`` where the fast path takes the Gluon
    forward), our backward's kernels, cuDNN's forward (one kernel, named ``...fprop...``), cuDNN's
    backward. PyTorch's own kernels (``TORCH_KERNELS``) before cuDNN's forward count as our
    backward's (the Gluon backward zeroes and converts its dQ with them); any other kernel in
    between is an error, not a guess."""
    starts = [i for i, k in enumerate(kernels) if k["name"].startswith(FORWARD_KERNELS)]
    if len(starts) != len(manifest["configs"]):
        raise ValueError(f"expected {len(manifest['configs'])} profiled configurations (one of our forward "
                         f"kernels each: {', '.join(FORWARD_KERNELS)}), found {len(starts)} in the CSV")
    out = []
    for config, a, b in zip(manifest["configs"], starts, starts[1:] + [len(kernels)]):
        group = kernels[a:b]
        first_cudnn = next((j for j, k in enumerate(group) if not k["name"].startswith(OUR_KERNELS + TORCH_KERNELS)),
                           None)
        if (first_cudnn is None or first_cudnn < 2 or first_cudnn == len(group) - 1
                or "fprop" not in group[first_cudnn]["name"]
                or any(k["name"].startswith(OUR_KERNELS) for k in group[first_cudnn:])):
            names = [k["name"][:40] for k in group]
            raise ValueError(f"D={config['D']} S={config['S']} causal={config['causal']}: expected our forward, "
                             f"our backward, cuDNN's fprop, cuDNN's backward; got {names}")
        parts = (["ours fwd"] + ["ours bwd"] * (first_cudnn - 1) + ["cudnn fwd"]
                 + ["cudnn bwd"] * (len(group) - first_cudnn - 1))
        out.append(dict(config, kernels=[dict(k, part=p) for k, p in zip(group, parts)]))
    return out


# --------------------------------------------------------------------------------------
# what the counters say
# --------------------------------------------------------------------------------------
def flops(kernel: dict) -> float:
    return kernel.get("tensor_flops", 0.0)


def ctas_per_sm(kernel: dict) -> int:
    limits = [kernel[k] for k in ("ctas_limit_registers", "ctas_limit_shared_mem", "ctas_limit_warps",
                                  "ctas_limit_blocks") if k in kernel]
    return int(min(limits)) if limits else 0


def issued(kernel: dict) -> float:
    """Instructions one scheduler issued: the share of cycles that issued one, times the cycles."""
    return kernel["issue_active_pct"] / 100 * kernel["duration_ns"] * 1e-9 * kernel["sm_clock_hz"]


def top_stalls(kernel: dict, n: int = 2) -> list[tuple[str, float]]:
    stalls = [(r, kernel[f"stall_{r}"]) for r in STALL_REASONS if r != "selected" and f"stall_{r}" in kernel]
    return sorted(stalls, key=lambda s: -s[1])[:n]


def verdict(kernel: dict) -> tuple[str, str]:
    """(kind, detail) of one kernel: a unit past ``BOUND_AT`` (memory bandwidth, tensor pipe,
    instruction issue), else "no unit saturated", detailed by how busy the tensor pipe and the
    issue slots were, how many resident warps were ready to issue, and the largest stalls. The
    counters cannot name a cause beyond that; ``results/profile_h100.md`` reads the stalls
    instruction by instruction."""
    need = ("dram_pct", "tensor_pipe_pct", "issue_active_pct", "warps_eligible_per_scheduler",
            "warps_active_per_scheduler")
    missing = [m for m in need if m not in kernel]
    if missing:
        return "not measured", "ncu did not collect " + ", ".join(missing)
    for unit, label in UNITS.items():
        if kernel[unit] >= BOUND_AT[unit]:
            return label, f"{kernel[unit]:.0f}% of peak"
    stalls = ", ".join(f"{r.replace('_', ' ')} {v:.1f}" for r, v in top_stalls(kernel))
    return "no unit saturated", (
        f"tensor {kernel['tensor_pipe_pct']:.0f}%, issue {kernel['issue_active_pct']:.0f}%, "
        f"{kernel['warps_eligible_per_scheduler']:.2f} of {kernel['warps_active_per_scheduler']:.1f} warps ready; "
        f"stalls {stalls}")


def compare(config: dict, direction: str) -> dict:
    """Ours against cuDNN in one pass of one profiled configuration. ``vs_cudnn``: cuDNN's kernel
    time over ours (every kernel of the pass). The rest is about the matrix kernels (those with
    tensor FLOPs): ``flop_ratio`` and ``rate_ratio`` (ours over cuDNN's, so that their time ratio
    is exactly flop_ratio / rate_ratio), ``clock_ratio`` (time-weighted SM clocks) and
    ``issued_ratio`` (instructions issued); ``other_ms``: the small kernels' time, ours and cuDNN's
    (our delta; cuDNN's dot(dO, O) and dQ conversion)."""
    ours = [k for k in config["kernels"] if k["part"] == f"ours {direction}"]
    cudnn = [k for k in config["kernels"] if k["part"] == f"cudnn {direction}"]
    ours_mm, cudnn_mm = [k for k in ours if flops(k) > 0], [k for k in cudnn if flops(k) > 0]
    ms = lambda ks: sum(k["duration_ns"] for k in ks) * 1e-6                                 # noqa: E731
    work = lambda ks: sum(flops(k) for k in ks)                                              # noqa: E731
    clock = lambda ks: sum(k["sm_clock_hz"] * k["duration_ns"] for k in ks) / sum(k["duration_ns"] for k in ks)  # noqa: E731
    return dict(ours_ms=ms(ours), cudnn_ms=ms(cudnn), vs_cudnn=ms(cudnn) / ms(ours),
                flop_ratio=work(ours_mm) / work(cudnn_mm),
                rate_ratio=(work(ours_mm) / ms(ours_mm)) / (work(cudnn_mm) / ms(cudnn_mm)),
                clock_ratio=clock(ours_mm) / clock(cudnn_mm),
                issued_ratio=sum(issued(k) for k in ours_mm) / sum(issued(k) for k in cudnn_mm),
                other_ms=(ms(ours) - ms(ours_mm), ms(cudnn) - ms(cudnn_mm)),
                ours_matrix=sorted(ours_mm, key=lambda k: -k["duration_ns"]),
                cudnn_matrix=sorted(cudnn_mm, key=lambda k: -k["duration_ns"]))


def short_name(name: str) -> str:
    for ours, label in (("fast_fwd", "fwd"), ("fast_dq", "dQ"), ("fast_dkdv", "dK/dV"), ("attn_bwd_delta", "delta"),
                        ("hopper_fwd", "Gluon fwd"), ("hopper_bwd", "Gluon bwd")):
        if name.startswith(ours):
            return label
    if name.startswith(TORCH_KERNELS):     # void at::f<4, at::FillFunctor<float>, ...> -> FillFunctor (what it does)
        template = name.split("<", 1)[1].split(",") if "<" in name else []
        what = template[1] if len(template) > 1 else name.removeprefix("void ").split("<")[0]
        return "torch " + what.strip().split("<")[0].split("(")[0].split("::")[-1]
    if "fprop" in name or "bprop" in name:
        return "cuDNN " + ("fprop" if "fprop" in name else "bprop")
    return "cuDNN " + name.split("(")[0].split("::")[-1].split("<")[0]   # void cudnn::f<...>(args) -> f


def describe(kernel: dict) -> str:
    kind, detail = verdict(kernel)
    return f"{short_name(kernel['name'])}: " + (detail if kind == "no unit saturated" else f"{kind} ({detail})")


# --------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------
def files(device: str = "h100") -> dict:
    """The table's inputs and output under ``results/`` for one device: the H100's keep the names
    they were committed under (issue 13); another device's carry its name (``h200``: issue 44)."""
    tag = "" if device == "h100" else f"_{device}"
    return {"bench": {d: f"bench_{d}{tag}.json" for d in ("fp16", "bf16")},
            "profile": f"profile_sweep_{device}.json", "table": f"cudnn_gap_{device}.md"}


def bench_rows(results: Path, device: str = "h100") -> list[dict]:
    """One row per (dtype, D, S, causal, pass) that every provider measured: our time, cuDNN's and
    FA2's (SDPA flash), and our ratios to them rounded as printed (two decimals), so that counts
    at a threshold agree with what a reader sees."""
    rows = []
    for dtype in ("fp16", "bf16"):
        data = json.loads((results / files(device)["bench"][dtype]).read_text())
        by = {(r["provider"], r["D"], r["S"], r["causal"]): r for r in data["results"] if "error" not in r}
        for (provider, D, S, causal), r in sorted(by.items(), key=lambda kv: kv[0][1:]):
            cudnn, fa2 = by.get(("sdpa-cudnn", D, S, causal)), by.get(("sdpa-flash", D, S, causal))
            if provider != "flashattn-fast" or cudnn is None or fa2 is None:
                continue
            for direction in ("fwd", "bwd"):
                ours_ms = r[f"{direction}_ms"]
                rows.append(dict(dtype=dtype, D=D, S=S, causal=causal, direction=direction, ours_ms=ours_ms,
                                 cudnn_ms=cudnn[f"{direction}_ms"], fa2_ms=fa2[f"{direction}_ms"],
                                 vs_cudnn=round(cudnn[f"{direction}_ms"] / ours_ms, 2),
                                 vs_fa2=round(fa2[f"{direction}_ms"] / ours_ms, 2), environment=data["environment"]))
    return rows


def cut_needed(ratio: float, target: float) -> float:
    """The share of our time to remove to reach ``target`` x cuDNN's speed (0 if there)."""
    return max(0.0, 1 - ratio / target)


def _span(values, digits=2) -> str:
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


LEGEND = (
    "*x cuDNN*, *x FA2*: their time over ours in the benchmark (above 1: we are faster); counts use "
    "the two decimals shown. *Cut for 0.9x / 1.0x*: the share of our time that would have to go. "
    "The columns after it come from the profile (fp16; one launch of each kernel, clocks as found): "
    "*x cuDNN (ncu)*, the same ratio over the pass's kernel times under the profiler; then, for the "
    "matrix kernels alone (those with tensor FLOPs: our forward, dQ and dK/dV; cuDNN's fprop and "
    "bprop), ours over cuDNN's: *FLOPs* (tensor-core FLOPs executed), *rate* (FLOPs per second; "
    "their time ratio is FLOPs / rate), *clock* (the SM clock each ran at, so that rate / clock is "
    "the ratio of FLOPs per cycle) and *instr.* (instructions issued); *other ms*: the small kernels, "
    "ours / cuDNN's (our delta; cuDNN's dot(dO, O) and its dQ conversion). *Matrix kernels*: for each "
    "of ours, then cuDNN's largest, the tensor pipe's and the issue slots' busy share, the warps "
    "ready to issue of those resident per scheduler (per cycle), and the two largest stalls per "
    "issued instruction (ncu's *barrier* includes a warpgroup waiting for its own wgmma). A unit "
    f"past {BOUND_AT['dram_pct']:.0f}% DRAM, {BOUND_AT['tensor_pipe_pct']:.0f}% tensor pipe or "
    f"{BOUND_AT['issue_active_pct']:.0f}% issue would be named as saturated.")


def build_table(results: Path, device: str = "h100") -> str:
    names = files(device)
    rows = bench_rows(results, device)
    profile = json.loads((results / names["profile"]).read_text())
    profiled = {(c["D"], c["S"], c["causal"]): c for c in profile["configs"]}
    env = rows[0]["environment"]
    gluon = " and backward" if any(_gluon_backward(c) for c in profile["configs"]) else ""
    issue = ("issue 13" if device == "h100" else
             f"issue 44: the Gluon forward{gluon} where the fast path runs it" if _has_gluon(profile) else "issue 44")
    out = [f"# How far from cuDNN, and why: every benchmark configuration on the {device.upper()} ({issue})", ""]
    out += [f"- **Benchmark:** {env['device']}, torch {env['torch']}, triton {env['triton']}, cuDNN "
            f"{env.get('cudnn')}, {env['date'][:10]}; `results/{names['bench']['fp16']}`, `results/{names['bench']['bf16']}` "
            f"(commands in their `environment`). B*S = 16384, H*D = 2048; times are medians of three rounds, "
            f"every provider in one run.",
            f"- **Profile:** {profile['device']}, torch {profile['torch']}, triton {profile['triton']}, "
            f"{profile.get('ncu', 'ncu')}, {profile['date'][:10]}; `results/{names['profile']}`. One launch "
            f"of each kernel in {profile['dtype']}, clocks as found. Our bf16 kernels are the same kernels with "
            f"the same tiles, so bf16's rows cite it; cuDNN's bf16 kernels were not profiled.",
            "- **Regenerate:** `python -m flashattn.gap table" + ("" if device == "h100" else f" --device {device}")
            + "`; the profile's commands are at the end.", ""]
    out += ["## Summary", "", "| ours / | min | median | max | at >= 0.9x | at >= 1.0x | at >= 1.2x |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, key in (("cuDNN (SDPA cuDNN backend)", "vs_cudnn"), ("FlashAttention-2 (SDPA flash)", "vs_fa2")):
        v = [r[key] for r in rows]
        out.append(f"| {label} | {min(v):.2f} | {statistics.median(v):.2f} | {max(v):.2f} | "
                   f"{sum(x >= 0.9 for x in v)}/{len(v)} | {sum(x >= 1.0 for x in v)}/{len(v)} | "
                   f"{sum(x >= 1.2 for x in v)}/{len(v)} |")
    out += ["", "## Configuration by configuration", "", LEGEND, "",
            "| dtype | D | S | causal | pass | ours ms | cuDNN ms | x cuDNN | x FA2 | cut for 0.9x / 1.0x | "
            "x cuDNN (ncu) | FLOPs | rate | clock | instr. | other ms | matrix kernels (ncu) |",
            "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: "
            "| --- | --- |"]
    for r in rows:
        c = profiled.get((r["D"], r["S"], r["causal"]))
        if c is None:
            profile_cells = "not profiled | | | | | |"
        else:
            cmp = compare(c, r["direction"])
            kernels = [describe(k) for k in cmp["ours_matrix"]] + [describe(cmp["cudnn_matrix"][0])]
            profile_cells = (f"{cmp['vs_cudnn']:.2f} | {cmp['flop_ratio']:.2f} | {cmp['rate_ratio']:.2f} | "
                             f"{cmp['clock_ratio']:.2f} | {cmp['issued_ratio']:.2f} | "
                             f"{cmp['other_ms'][0]:.2f} / {cmp['other_ms'][1]:.2f} | {'; '.join(kernels)}")
        cut = f"{cut_needed(r['vs_cudnn'], 0.9):.0%} / {cut_needed(r['vs_cudnn'], 1.0):.0%}"
        out.append(f"| {r['dtype']} | {r['D']} | {r['S']} | {'yes' if r['causal'] else 'no'} | {r['direction']} | "
                   f"{r['ours_ms']:.3f} | {r['cudnn_ms']:.3f} | {r['vs_cudnn']:.2f} | {r['vs_fa2']:.2f} | {cut} | "
                   f"{profile_cells} |")
    out.append("")
    out += reading(rows, profile)
    out += kernel_table(profile)
    out += ["## Commands", "", "```"] + profile.get("commands", []) + ["```", ""]
    return "\n".join(out)


def reading(rows: list[dict], profile: dict) -> list[str]:
    """The table's pattern: the bullets' numbers are computed from the data; the closing paragraph
    is fixed prose, the interpretation (its numbers are computed too, its reasoning is not)."""
    lines = ["## What the profile says", ""]
    for D in sorted({c["D"] for c in profile["configs"]}):
        configs = [c for c in profile["configs"] if c["D"] == D]
        fwd = [compare(c, "fwd") for c in configs]
        bench = {d: [r["vs_cudnn"] for r in rows if r["D"] == D and r["direction"] == d] for d in ("fwd", "bwd")}
        ours, theirs = [c["ours_matrix"][0] for c in fwd], [c["cudnn_matrix"][0] for c in fwd]
        per_cycle = [c["rate_ratio"] / c["clock_ratio"] for c in fwd]
        lines.append(
            f"- **D = {D} forward** ({_span(bench['fwd'])}x cuDNN in the benchmark): the same tensor FLOPs "
            f"({_span([c['flop_ratio'] for c in fwd])}x) at {_span([c['rate_ratio'] for c in fwd])}x cuDNN's rate, "
            f"with our SM clock {_span([c['clock_ratio'] for c in fwd])}x cuDNN's, so "
            f"{_span(per_cycle)}x its FLOPs per cycle. Ours issues {_span([c['issued_ratio'] for c in fwd])}x "
            f"cuDNN's instructions; tensor pipe {_span([k['tensor_pipe_pct'] for k in ours], 0)}% busy against "
            f"{_span([k['tensor_pipe_pct'] for k in theirs], 0)}%, issue slots "
            f"{_span([k['issue_active_pct'] for k in ours], 0)}% against {_span([k['issue_active_pct'] for k in theirs], 0)}%, "
            f"warps ready per scheduler {_span([k['warps_eligible_per_scheduler'] for k in ours])} against "
            f"{_span([k['warps_eligible_per_scheduler'] for k in theirs])}.")
        tl = [c for c in configs if not _gluon_backward(c)]
        gluon = [c for c in configs if _gluon_backward(c)]
        gluon_where = "the Gluon backward (" + ", ".join(
            f"S = {c['S'] // 1024}k{' causal' if c['causal'] else ''}" for c in sorted(gluon, key=lambda c: (c["S"], c["causal"]))) + ")"
        for where, group, products in (
                ("S = 1k", [c for c in tl if c["S"] <= 1024], "seven matrix products against five"),
                ("S >= 4k", [c for c in tl if c["S"] > 1024], "seven matrix products against five"),
                (gluon_where, gluon, "one kernel: the same five matrix products")):
            bwd = [compare(c, "bwd") for c in group]
            if not bwd:
                continue
            shapes = {(c["S"], c["causal"]) for c in group}
            bench_bwd = [r["vs_cudnn"] for r in rows if r["D"] == D and r["direction"] == "bwd"
                         and (r["S"], r["causal"]) in shapes]
            lines.append(
                f"- **D = {D} backward, {where}** ({_span(bench_bwd)}x cuDNN in the benchmark): "
                f"{_span([c['flop_ratio'] for c in bwd])}x cuDNN's tensor FLOPs ({products}) "
                f"at {_span([c['rate_ratio'] for c in bwd])}x its rate in the matrix kernels; at equal rates "
                f"the FLOPs alone would put them at {_span([1 / c['flop_ratio'] for c in bwd])}x. The small "
                f"kernels take {_span([c['other_ms'][0] for c in bwd])} ms of ours against "
                f"{_span([c['other_ms'][1] for c in bwd])} ms of cuDNN's.")
    passes = [(c["D"], compare(c, d)) for c in profile["configs"] for d in ("fwd", "bwd")]
    ours_all = [k for _, cmp in passes for k in cmp["ours_matrix"]]
    cudnn_all = [k for _, cmp in passes for k in cmp["cudnn_matrix"]]
    kinds = sorted({verdict(k)[0] for k in ours_all + cudnn_all})
    largest = [(D, short_name(k["name"]), top_stalls(k, 1)[0][0]) for D, cmp in passes for k in cmp["ours_matrix"]]
    odd = sorted({(D, name, why.replace("_", " ")) for D, name, why in largest if why not in ("barrier", "wait")})
    except_odd = ("" if not odd else " except " + ", ".join(f"the D = {D} {name} (largest: {why})" for D, name, why in odd)
                  + (", whose ready warps most often wait for an issue slot another warp took, as they would in "
                     "a kernel that issues more instructions than cuDNN's for the same work (above)"
                     if all(why == "not selected" for _, _, why in odd) else ""))
    lines += ["", (f"No unit is saturated in any matrix kernel, ours or cuDNN's: "
                   if kinds == ["no unit saturated"] else f"The matrix kernels' verdicts: {', '.join(kinds)}. ")
              + f"our kernels run {_span([int(k['registers']) for k in ours_all], 0)} registers per thread and "
              f"{_span([k['warps_active_per_scheduler'] for k in ours_all], 1)} resident warps per scheduler, cuDNN's "
              f"{_span([int(k['registers']) for k in cudnn_all], 0)} registers at launch and "
              f"{_span([k['warps_active_per_scheduler'] for k in cudnn_all], 1)} warps (CTAs of "
              f"{_span([int(k['block_size']) // 32 for k in cudnn_all], 0)} warps). In each of our warpgroups the "
              "matrix product and the softmax (or dS) arithmetic that depends on it run one after the other, "
              "and the largest stall (barrier or wait) is that wait in every one of our matrix kernels"
              + except_odd + ". `results/profile_h100.md` follows the D = 128 stalls to the instruction. "
              "cuDNN's kernels are built as three warpgroups, which in FlashAttention-3's design are a "
              "producer and two consumers whose registers are reallocated after launch (`setmaxnreg`), so "
              "that one consumer's arithmetic overlaps the other's products; ncu's launch statistics show the "
              "three warpgroups, not the roles, so that part is inferred. "
              + ("Triton 3.6 does not give a kernel written as ours that structure (notebook 06, section 7, "
                 "lists what was tried). " if not _has_gluon(profile) else
                 "Triton 3.6's `tl` does not give a kernel that structure (notebook 06, section 7); where "
                 "the fast path runs the Gluon forward (`hopper_fwd_kernel`), it has it: a producer warp and "
                 "consumer warpgroups with `setmaxnreg` (lesson 12), so those rows compare like with like. ")
              + "In the backward "
              "the two-kernel design adds work on top: the dQ kernel recomputes S = QK^T and dP = dO V^T, "
              "which cuDNN's single kernel avoids by adding dQ with atomics; this package's single kernel "
              "(`backward=\"fused\"`) has the five products but spills at 255 registers and measured slower "
              "(notebook 06)." + _gluon_backward_reading(profile), ""]
    return lines


def _gluon_backward_reading(profile: dict) -> str:
    """The closing paragraph's sentence on the Gluon backward, where the sweep ran it (else nothing)."""
    gluon = [compare(c, "bwd") for c in profile["configs"] if _gluon_backward(c)]
    if not gluon:
        return ""
    stalls = sorted({top_stalls(k, 1)[0][0].replace("_", " ") for c in gluon for k in c["ours_matrix"]})
    why = ("; besides a warpgroup waiting for its own products, that includes its two consumer warpgroups "
           "meeting at the CTA barriers that Triton's barrier pass places around the shared-memory tiles they "
           "exchange" if stalls == ["barrier"] else "")
    return (" Where the fast path runs the Gluon backward (`hopper_bwd_kernel`), that extra work is gone: one "
            f"kernel with cuDNN's five products ({_span([c['flop_ratio'] for c in gluon])}x its tensor FLOPs). "
            f"It runs them at {_span([c['rate_ratio'] for c in gluon])}x cuDNN's rate, its largest stall "
            f"{' / '.join(stalls)}{why} (`results/gluon_backward_profile_h200.md`).")


def _gluon_backward(config: dict) -> bool:
    """Whether this configuration's backward ran the Gluon kernel (``BACKWARD_PREFERRED``'s rows)."""
    return any(k["part"] == "ours bwd" and k["name"].startswith("hopper_bwd") for k in config["kernels"])


def _has_gluon(profile: dict) -> bool:
    """Whether the sweep ran a Gluon kernel (the fast path on Hopper, where they measured faster)."""
    return any(k["name"].startswith("hopper_") for c in profile["configs"] for k in c["kernels"])


def kernel_table(profile: dict) -> list[str]:
    out = [f"## Kernel by kernel ({profile['dtype']}, one launch each under ncu)", "",
           "| D | S | causal | kernel | ms | MHz | TFLOP/s | tensor % | issue % | DRAM % | regs | CTAs/SM x warps "
           "| warps ready / resident per scheduler | top stalls per issue | local-load sectors |",
           "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | ---: |"]
    for c in profile["configs"]:
        for k in c["kernels"]:
            ms = k["duration_ns"] * 1e-6
            stalls = ", ".join(f"{r.replace('_', ' ')} {v:.1f}" for r, v in top_stalls(k, 3))
            out.append(f"| {c['D']} | {c['S']} | {'yes' if c['causal'] else 'no'} | {short_name(k['name'])} | "
                       f"{ms:.3f} | {k['sm_clock_hz'] / 1e6:.0f} | {flops(k) / ms * 1e-9:.0f} | "
                       f"{k['tensor_pipe_pct']:.0f} | {k['issue_active_pct']:.0f} | {k['dram_pct']:.0f} | "
                       f"{int(k['registers'])} | {ctas_per_sm(k)} x {int(k['block_size']) // 32} | "
                       f"{k['warps_eligible_per_scheduler']:.2f} / {k['warps_active_per_scheduler']:.2f} | {stalls} | "
                       f"{int(k.get('local_load_sectors', 0))} |")
    out.append("")
    return out


#: What ``results/profile_sweep_h100.json`` came from, run on the GPU from the repository's root
#: (one ncu process per head dim, so that a slow one cannot take the other with it). Another
#: device's sweep reads the same, with its own profile's name (``recipe``).
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


def recipe(profile_name: str = "profile_sweep_h100.json") -> list[str]:
    """``RECIPE`` for a profile written to ``results/<profile_name>`` (``profile_sweep_<device>.json``)."""
    lines = [line.replace("profile_sweep_h100.json", profile_name) for line in RECIPE]
    if profile_name.startswith("profile_sweep_") and profile_name.endswith(".json") and profile_name != "profile_sweep_h100.json":
        lines[-1] += f" --device {profile_name.removeprefix('profile_sweep_').removesuffix('.json')}"
    return lines


def read_profile(pairs, ncu_version: str | None = None, profile_name: str = "profile_sweep_h100.json") -> dict:
    """The profile JSON from (ncu CSV, sweep manifest) pairs, one per ncu run, in order."""
    profile = {}
    configs = []
    for csv_path, manifest_path in pairs:
        manifest = json.loads(Path(manifest_path).read_text())
        configs += group_kernels(read_ncu_csv(csv_path), manifest)
        profile.update({k: v for k, v in manifest.items() if k != "configs"})
    if not any(flops(k) for c in configs for k in c["kernels"]):
        raise ValueError(f"no tensor FLOPs counted in this {profile.get('dtype')} sweep: the counter read is "
                         f"fp16's wgmma counter (sm 9.0 has no bf16 twin), so sweep in fp16")
    if ncu_version:
        profile["ncu"] = ncu_version
    profile["commands"] = recipe(profile_name)
    profile["configs"] = configs
    return profile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.gap", description=__doc__.replace("``", "`"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("metrics", help="print ncu's --metrics list")
    m.add_argument("query", nargs="?", help="the output of `ncu --query-metrics --chip gh100` (optional)")
    r = sub.add_parser("read", help="ncu's raw CSVs and the sweep's manifests -> profile JSON")
    r.add_argument("out", help="the profile JSON to write (results/profile_sweep_h100.json)")
    r.add_argument("ncu_version", help="`ncu --version | tail -1`, recorded with the profile")
    r.add_argument("files", nargs="+", help="RAW.csv MANIFEST.json, once per ncu run")
    t = sub.add_parser("table", help="write the gap table")
    t.add_argument("--results", default="results",
                   help="the folder with the benchmark and profile JSON (default: results)")
    t.add_argument("--out", default=None, help="default: RESULTS/cudnn_gap_<device>.md; - for stdout only")
    t.add_argument("--device", default="h100", help="whose results: h100 (issue 13's names) or another "
                   "tag, read as bench_fp16_<tag>.json, bench_bf16_<tag>.json, profile_sweep_<tag>.json")
    args = ap.parse_args(argv)
    if args.command == "metrics":
        names = metric_list(Path(args.query).read_text() if args.query else None)
        dropped = sorted(set(metric_list()) - set(names))
        if dropped:
            print(f"ncu does not know {len(dropped)} of the metrics, left out: {', '.join(dropped)}", file=sys.stderr)
        print(",".join(names))
    elif args.command == "read":
        if len(args.files) % 2:
            ap.error(f"read takes RAW.csv MANIFEST.json pairs, got {len(args.files)} files")
        profile = read_profile(zip(args.files[::2], args.files[1::2]), args.ncu_version, Path(args.out).name)
        Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
        print(f"{len(profile['configs'])} configurations -> {args.out}")
    else:
        results = Path(args.results)
        names = files(args.device)
        needed = [results / n for n in (*names["bench"].values(), names["profile"])]
        missing = [str(p) for p in needed if not p.exists()]
        if missing:
            ap.error(f"table needs {', '.join(missing)} (run from the repository's root, or pass --results)")
        text = build_table(results, args.device)
        if args.out == "-":
            print(text, end="")
        else:
            out = Path(args.out or results / names["table"])
            out.write_text(text)
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
