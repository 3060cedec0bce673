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


def config_kernels(start, ours_extra=(), forward="fast_fwd_kernel"):
    names = [forward, "attn_bwd_delta_kernel", "fast_dq_kernel", "fast_dkdv_kernel", *ours_extra,
             "cudnn_generated_sm90_flash_fprop", "cudnn_dot_do_o", "cudnn_sm90_flash_bprop", "cudnn_convert_dq"]
    return [kernel_row(start + i, n, duration_ns=1000 * (i + 1), tensor_flops=1e9 * (i % 3))
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


def test_a_configuration_may_start_at_the_gluon_forward(tmp_path):
    """On Hopper the fast path runs the Gluon forward (``hopper_fwd_kernel``) where it measured
    faster: a configuration starts there too, and the Gluon kernels count as ours."""
    rows = config_kernels(0) + config_kernels(100, forward="hopper_fwd_kernel")
    path = tmp_path / "raw.csv"
    path.write_text(ncu_csv(rows))
    manifest = {"configs": [dict(D=64, S=1024, causal=False), dict(D=64, S=4096, causal=False)]}
    groups = gap.group_kernels(gap.read_ncu_csv(path), manifest)
    assert [k["part"] for k in groups[1]["kernels"]] == ["ours fwd"] + ["ours bwd"] * 3 + ["cudnn fwd"] + ["cudnn bwd"] * 3
    assert groups[1]["kernels"][0]["name"] == "hopper_fwd_kernel"


def test_metric_list_keeps_only_what_ncu_knows():
    query = "Device GH100\nsm__pipe_tensor_cycles_active   Counter   ...\ngpu__time_duration   ns\n"
    assert gap.metric_list(query) == [gap.METRICS["duration_ns"], gap.METRICS["tensor_pipe_pct"]]
    assert len(gap.metric_list()) == sum(not n.startswith("launch__") for n in gap.METRICS.values())


def test_verdict_names_a_unit_only_past_its_bound():
    base = dict(dram_pct=10.0, tensor_pipe_pct=55.0, issue_active_pct=30.0, warps_active_per_scheduler=2.0,
                warps_eligible_per_scheduler=0.45, stall_wait=1.4, stall_barrier=2.3, stall_selected=9.0,
                stall_long_scoreboard=0.2)
    kind, detail = gap.verdict(base)
    assert kind == "no unit saturated"
    assert "0.45 of 2.0 warps ready" in detail
    assert "stalls barrier 2.3, wait 1.4" in detail          # largest first; "selected" is not a stall
    assert gap.verdict(dict(base, dram_pct=85.0))[0] == "memory bandwidth"
    assert gap.verdict(dict(base, tensor_pipe_pct=90.0))[0] == "tensor pipe"
    assert gap.verdict(dict(base, issue_active_pct=75.0))[0] == "instruction issue"
    missing = {k: v for k, v in base.items() if k != "warps_eligible_per_scheduler"}
    assert gap.verdict(missing) == ("not measured", "ncu did not collect warps_eligible_per_scheduler")


def test_pytorchs_elementwise_kernels_inside_our_backward_are_ours(tmp_path):
    """Where the fast path runs the Gluon backward, PyTorch zeroes its fp32 dQ buffer and converts it
    (``void at::...`` kernels) between our delta and cuDNN's forward: those count as ours, by name."""
    names = ["hopper_fwd_kernel", "attn_bwd_delta_kernel",         # ncu's names, as in the H200's sweep
             "void at::vectorized_elementwise_kernel<4, at::FillFunctor<float>, std::array<char *, 1>>",
             "hopper_bwd_kernel", "void at::vectorized_elementwise_kernel<8, at::float16_copy_kernel_cuda",
             "cudnn_generated_sm90_flash_fprop", "cudnn_dot_do_o", "cudnn_sm90_flash_bprop", "cudnn_convert_dq"]
    path = tmp_path / "raw.csv"
    path.write_text(ncu_csv([kernel_row(i, n, duration_ns=1000.0) for i, n in enumerate(names)]))
    (group, ) = gap.group_kernels(gap.read_ncu_csv(path), {"configs": [dict(D=64, S=4096, causal=True)]})
    assert [k["part"] for k in group["kernels"]] == ["ours fwd"] + ["ours bwd"] * 4 + ["cudnn fwd"] + ["cudnn bwd"] * 3
    assert gap._gluon_backward(group)
    assert gap.short_name(group["kernels"][2]["name"]) == "torch FillFunctor"
    assert gap.short_name(group["kernels"][4]["name"]) == "torch float16_copy_kernel_cuda"
    assert gap.short_name("hopper_bwd_kernel") == "Gluon bwd"


def test_a_stray_kernel_inside_a_configuration_is_an_error():
    rows = config_kernels(0)
    rows.insert(2, kernel_row(99, "vectorized_elementwise_kernel", duration_ns=10.0))   # inside our backward
    kernels = [dict(name=r["Kernel Name"]) for r in rows]
    with pytest.raises(ValueError, match="cuDNN's fprop"):
        gap.group_kernels(kernels, {"configs": [dict(D=64, S=1024, causal=False)]})


def kernel(name, part, ms, tflops=0.0, clock=1.7e9, issue=30.0):
    return dict(name=name, part=part, duration_ns=ms * 1e6, tensor_flops=tflops * 1e12, sm_clock_hz=clock,
                issue_active_pct=issue)


def test_compare_splits_time_into_flops_and_rate():
    config = {"kernels": [
        kernel("fast_dq_kernel", "ours bwd", 3, 6, issue=30),
        kernel("fast_dkdv_kernel", "ours bwd", 5, 8, issue=30),
        kernel("attn_bwd_delta_kernel", "ours bwd", 0.1),
        kernel("cudnn_sm90_bprop", "cudnn bwd", 6, 10, clock=1.6e9, issue=40),
        kernel("cudnn::convert_dq", "cudnn bwd", 0.2),
    ]}
    cmp = gap.compare(config, "bwd")
    assert cmp["flop_ratio"] == pytest.approx(1.4)
    assert cmp["rate_ratio"] == pytest.approx((14 / 8) / (10 / 6))            # matrix kernels only
    assert 8 / 6 == pytest.approx(cmp["flop_ratio"] / cmp["rate_ratio"])    # their time ratio
    assert cmp["vs_cudnn"] == pytest.approx(6.2 / 8.1)                        # every kernel of the pass
    assert cmp["other_ms"] == pytest.approx((0.1, 0.2))
    assert cmp["clock_ratio"] == pytest.approx(1.7 / 1.6)
    assert cmp["issued_ratio"] == pytest.approx((0.3 * 8 * 1.7) / (0.4 * 6 * 1.6))
    assert [k["name"] for k in cmp["ours_matrix"]] == ["fast_dkdv_kernel", "fast_dq_kernel"]
    assert cmp["cudnn_matrix"][0]["name"] == "cudnn_sm90_bprop"


def test_bench_rows_round_as_printed_and_skip_errors(tmp_path):
    env = {"device": "GPU", "torch": "t", "triton": "x", "date": "2026-11-25"}
    base = dict(D=64, S=1024, causal=False)
    for dtype in ("fp16", "bf16"):
        results = [dict(base, provider="flashattn-fast", fwd_ms=1.0, bwd_ms=1.0),
                   dict(base, provider="sdpa-cudnn", fwd_ms=0.89996, bwd_ms=0.5),
                   dict(base, provider="sdpa-flash", fwd_ms=1.3, bwd_ms=1.3),
                   dict(base, S=4096, provider="flashattn-fast", fwd_ms=1.0, bwd_ms=1.0),
                   dict(base, S=4096, provider="sdpa-cudnn", error="not supported")]
        (tmp_path / f"bench_{dtype}.json").write_text(json.dumps({"environment": env, "results": results}))
    rows = gap.bench_rows(tmp_path)
    assert {(r["S"], r["direction"]) for r in rows} == {(1024, "fwd"), (1024, "bwd")}   # S=4096: cuDNN failed
    assert rows[0]["vs_cudnn"] == 0.9              # 0.89996 counts as the 0.90 a reader sees


def test_cut_needed():
    assert gap.cut_needed(0.72, 0.9) == pytest.approx(0.2)
    assert gap.cut_needed(0.95, 0.9) == 0.0


def test_committed_table_is_the_committed_data():
    """results/cudnn_gap_h100.md is what `python -m flashattn.gap table` makes of the committed
    benchmark and profile: edit the data and regenerate, never the table by hand."""
    assert (RESULTS / "cudnn_gap_h100.md").read_text() == gap.build_table(RESULTS)


def test_committed_h200_table_is_the_committed_data():
    """results/cudnn_gap_h200.md likewise, from the H200's files; its sweep ran the Gluon backward
    (the fast path's at D 64 causal from 4k keys), and the table says what that kernel's counters show."""
    text = (RESULTS / "cudnn_gap_h200.md").read_text()
    assert text == gap.build_table(RESULTS, "h200")
    assert "D = 64 backward, the Gluon backward (S = 4k causal, S = 16k causal)" in text
    assert "Where the fast path runs the Gluon backward (`hopper_bwd_kernel`), that extra work is gone" in text


def test_profile_covers_every_benchmark_configuration():
    profile = json.loads((RESULTS / "profile_sweep_h100.json").read_text())
    bench = {(r["D"], r["S"], r["causal"]) for r in gap.bench_rows(RESULTS)}
    assert {(c["D"], c["S"], c["causal"]) for c in profile["configs"]} == bench
    for c in profile["configs"]:
        for direction in ("fwd", "bwd"):
            cmp = gap.compare(c, direction)
            assert cmp["ours_ms"] > 0 and cmp["cudnn_ms"] > 0 and cmp["ours_matrix"] and cmp["cudnn_matrix"]
            for k in cmp["ours_matrix"] + cmp["cudnn_matrix"]:
                assert gap.verdict(k)[0] != "not measured", k["name"]


def test_a_sweep_without_its_flop_counter_is_refused(tmp_path):
    rows = [kernel_row(i, k["Kernel Name"], duration_ns=1000.0) for i, k in enumerate(config_kernels(0))]
    (tmp_path / "raw.csv").write_text(ncu_csv(rows))
    (tmp_path / "m.json").write_text(json.dumps({"dtype": "bf16", "configs": [dict(D=64, S=1024, causal=False)]}))
    with pytest.raises(ValueError, match="no tensor FLOPs counted in this bf16 sweep"):
        gap.read_profile([(tmp_path / "raw.csv", tmp_path / "m.json")])


def test_another_devices_table_reads_its_own_files_and_names_the_gluon_forward(tmp_path, capsys):
    """``table --device h200`` reads bench_{fp16,bf16}_h200.json and profile_sweep_h200.json and
    writes cudnn_gap_h200.md; where the sweep ran the Gluon forward, the closing paragraph says that
    those rows have cuDNN's structure instead of saying that Triton cannot give it."""
    for dtype in ("fp16", "bf16"):
        (tmp_path / f"bench_{dtype}_h200.json").write_text((RESULTS / f"bench_{dtype}.json").read_text())
    profile = json.loads((RESULTS / "profile_sweep_h100.json").read_text())
    for c in profile["configs"]:
        if c["S"] >= 4096:
            c["kernels"][0]["name"] = "hopper_fwd_kernel"
    (tmp_path / "profile_sweep_h200.json").write_text(json.dumps(profile))
    assert gap.main(["table", "--device", "h200", "--results", str(tmp_path)]) == 0
    text = (tmp_path / "cudnn_gap_h200.md").read_text()
    assert text.startswith("# How far from cuDNN, and why: every benchmark configuration on the H200 (issue 44")
    assert "`results/bench_fp16_h200.json`" in text and "`results/profile_sweep_h200.json`" in text
    assert "`python -m flashattn.gap table --device h200`" in text
    assert "where the fast path runs the Gluon forward (`hopper_fwd_kernel`), it has it" in text
    assert "Triton 3.6 does not give a kernel written as ours that structure" not in text
    assert "Triton 3.6 does not give a kernel written as ours that structure" in gap.build_table(RESULTS)
    assert "| 64 | 4096 | no | Gluon fwd |" in text and "cuDNN hopper" not in text      # ours, by its name
    steps = gap.recipe("profile_sweep_h200.json")
    assert steps[-3].startswith("python -m flashattn.gap read results/profile_sweep_h200.json")
    assert steps[-1] == "python -m flashattn.gap table --device h200" and gap.recipe() == gap.RECIPE
    assert gap.recipe("out.json")[-1] == "python -m flashattn.gap table"           # no device in that name
    with pytest.raises(SystemExit):                  # a device with no results: the files named
        gap.main(["table", "--device", "h300", "--results", str(tmp_path)])
    assert "bench_fp16_h300.json" in capsys.readouterr().err
