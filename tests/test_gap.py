"""flashattn.gap: ncu's CSV read and grouped, the counters' verdicts, and the committed table
regenerated from the committed JSON (CPU only: nothing here needs a GPU)."""
import csv
import io
import json
from pathlib import Path

import pytest

from flashattn import gap

RESULTS = Path(__file__).resolve().parent.parent / "results"


def kernel_row(i, name, **values):
    row = {"ID": str(i), "Kernel Name": name, "Grid Size": "(8, 64, 1)", "Block Size": "(256, 1, 1)"}
    for ours, ncu in gap.METRICS.items():
        if ours in values:
            row[ncu] = f"{values[ours]:,}"     # ncu may print thousands separators
    return row


def ncu_csv(rows) -> str:
    columns = ["ID", "Kernel Name", "Grid Size", "Block Size", *gap.METRICS.values()]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, quoting=csv.QUOTE_ALL)
    w.writeheader()
    w.writerow({c: ("nsecond" if c == gap.METRICS["duration_ns"] else "") for c in columns})   # units row
    for r in rows:
        w.writerow(r)
    return "==PROF== Disconnected\n" + buf.getvalue()


def config_kernels(start, ours_extra=()):
    names = ["fast_fwd_kernel", "attn_bwd_delta_kernel", "fast_dq_kernel", "fast_dkdv_kernel", *ours_extra,
             "cudnn_generated_sm90_flash_fprop", "cudnn_dot_do_o", "cudnn_sm90_flash_bprop", "cudnn_convert_dq"]
    return [kernel_row(start + i, n, duration_ns=1000 * (i + 1), tensor_flops_fp16=1e9 * (i % 3))
            for i, n in enumerate(names)]


def test_read_and_group(tmp_path):
    rows = config_kernels(0) + config_kernels(100, ours_extra=("fast_dq_convert",))
    path = tmp_path / "raw.csv"
    path.write_text(ncu_csv(rows))
    kernels = gap.read_ncu_csv(path)
    assert len(kernels) == len(rows)                      # the units row is skipped
    assert kernels[0]["duration_ns"] == 1000.0
    assert kernels[0]["name"] == "fast_fwd_kernel"
    manifest = {"configs": [dict(D=64, S=1024, causal=False), dict(D=64, S=1024, causal=True)]}
    groups = gap.group_kernels(kernels, manifest)
    parts = [k["part"] for k in groups[0]["kernels"]]
    assert parts == ["ours fwd"] + ["ours bwd"] * 3 + ["cudnn fwd"] + ["cudnn bwd"] * 3
    parts = [k["part"] for k in groups[1]["kernels"]]
    assert parts == ["ours fwd"] + ["ours bwd"] * 4 + ["cudnn fwd"] + ["cudnn bwd"] * 3
    with pytest.raises(ValueError, match="expected 3 profiled configurations"):
        gap.group_kernels(kernels, {"configs": manifest["configs"] + [dict(D=64, S=4096, causal=False)]})
    with pytest.raises(ValueError, match="cuDNN's backward"):
        gap.group_kernels(kernels[:5], {"configs": manifest["configs"][:1]})


def test_metric_list_keeps_only_what_ncu_knows():
    query = "Device GH100\nsm__pipe_tensor_cycles_active   Counter   ...\ngpu__time_duration   ns\n"
    assert gap.metric_list(query) == [gap.METRICS["duration_ns"], gap.METRICS["tensor_pipe_pct"]]
    assert len(gap.metric_list()) == sum(not n.startswith("launch__") for n in gap.METRICS.values())


def test_limiter_names_a_unit_only_past_its_bound():
    base = dict(dram_pct=10.0, tensor_pipe_pct=55.0, issue_active_pct=30.0, warps_active_pct=12.5,
                stall_wait=1.4, stall_barrier=2.3, stall_selected=9.0, stall_long_scoreboard=0.2)
    verdict = gap.limiter(base)
    assert verdict.startswith("latency: 2.0 warps/scheduler")
    assert "barrier 2.3, wait 1.4" in verdict          # largest first, "selected" is not a stall
    assert "spills" not in verdict
    assert "spills" in gap.limiter(dict(base, local_load_sectors=5.0))
    assert gap.limiter(dict(base, dram_pct=85.0)).startswith("memory bandwidth")
    assert gap.limiter(dict(base, tensor_pipe_pct=90.0)).startswith("tensor pipe")
    assert gap.limiter(dict(base, issue_active_pct=75.0)).startswith("instruction issue")


def test_compare_splits_time_into_flops_and_rate():
    config = {"kernels": [
        dict(name="fast_dq_kernel", part="ours bwd", duration_ns=3e6, tensor_flops_fp16=6e12),
        dict(name="fast_dkdv_kernel", part="ours bwd", duration_ns=5e6, tensor_flops_fp16=8e12),
        dict(name="attn_bwd_delta_kernel", part="ours bwd", duration_ns=0.1e6),
        dict(name="cudnn_bprop", part="cudnn bwd", duration_ns=6e6, tensor_flops_fp16=10e12),
        dict(name="cudnn_convert", part="cudnn bwd", duration_ns=0.2e6),
    ]}
    cmp = gap.compare(config, "fp16", "bwd")
    assert cmp["flop_ratio"] == pytest.approx(1.4)
    time_ratio = cmp["ours_ms"] / cmp["cudnn_ms"]
    assert time_ratio == pytest.approx(cmp["flop_ratio"] / cmp["rate_ratio"])
    assert [k["name"] for k in cmp["gemm"]] == ["fast_dq_kernel", "fast_dkdv_kernel"]
    assert cmp["cudnn_main"]["name"] == "cudnn_bprop"
    assert "1.40x cuDNN's tensor FLOPs (the dQ kernel" in gap.why(cmp, "bwd")


def test_cut_needed():
    assert gap.cut_needed(0.72, 0.9) == pytest.approx(0.2)
    assert gap.cut_needed(0.95, 0.9) == 0.0


def test_committed_table_is_the_committed_data():
    """results/cudnn_gap_h100.md is what `python -m flashattn.gap table` makes of the committed
    benchmark and profile: edit the data and regenerate, never the table by hand."""
    assert (RESULTS / "cudnn_gap_h100.md").read_text() == gap.build_table(RESULTS)


def test_profile_covers_every_benchmark_configuration():
    profile = json.loads((RESULTS / "profile_sweep_h100.json").read_text())
    bench = {(r["D"], r["S"], r["causal"]) for r in gap.bench_rows(RESULTS)}
    assert {(c["D"], c["S"], c["causal"]) for c in profile["configs"]} == bench
    for c in profile["configs"]:
        for direction in ("fwd", "bwd"):
            cmp = gap.compare(c, profile["dtype"], direction)
            assert cmp["ours_ms"] > 0 and cmp["cudnn_ms"] > 0 and cmp["gemm"]


def test_a_sweep_without_its_flop_counter_is_refused(tmp_path):
    rows = [kernel_row(i, k["Kernel Name"], duration_ns=1000.0) for i, k in enumerate(config_kernels(0))]
    (tmp_path / "raw.csv").write_text(ncu_csv(rows))
    (tmp_path / "m.json").write_text(json.dumps({"dtype": "bf16", "configs": [dict(D=64, S=1024, causal=False)]}))
    with pytest.raises(ValueError, match="no tensor FLOPs counted for bf16"):
        gap.read_profile([(tmp_path / "raw.csv", tmp_path / "m.json")])
