"""python -m flashattn.bench: runs anywhere with --quick, and writes where git does not look."""
import subprocess
from pathlib import Path

import pytest

from flashattn import bench

from conftest import ON_GPU

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_writes_to_runs_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if not ON_GPU:
        assert bench.main([]) == 2                      # the full grid refuses in the interpreter
        assert "--quick" in capsys.readouterr().err
    assert bench.main(["--quick", "--rep-ms", "5", "--no-precompile"]) == 0
    written = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert [n.rsplit(".", 1)[1] for n in written] == ["json", "png"]
    assert not (tmp_path / "results").exists()


def test_git_ignores_runs():
    for path in ("runs/bench_x.json", "notebooks/runs/x.png"):
        probe = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, capture_output=True)
        if probe.returncode == 128:                     # not a git checkout (an unpacked archive)
            return
        assert probe.returncode == 0, f"{path} should be git-ignored"


def test_rounds_take_the_providers_in_turn_and_keep_the_median(monkeypatch):
    """A GPU's clock drifts over seconds: every provider is measured once per round, in turn,
    and each row holds the median of its rounds (a provider that failed is not retried)."""
    calls = []
    scripted = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    def fake_measure(fn, B, H, S, D, causal, dtype, device, rep_ms=100):
        calls.append(fn)
        if fn == "broken":
            return {"error": "not supported"}
        ms = next(scripted[fn])
        return bench.with_tflops({"fwd_ms": ms, "bwd_ms": 2 * ms, "peak_mib": 1.0}, B, H, S, D, causal)

    monkeypatch.setattr(bench, "providers", lambda: {"a": "a", "b": "b", "broken": "broken"})
    monkeypatch.setattr(bench, "measure", fake_measure)
    rows = bench.run_grid(["fp16"], [32], [64], [False], ["a", "b", "broken"], 64, 64, rounds=3, progress=False)
    assert calls == ["a", "b", "broken", "a", "b", "a", "b"]
    got = {r["provider"]: r for r in rows}
    assert (got["a"]["fwd_ms"], got["a"]["bwd_ms"], got["b"]["fwd_ms"]) == (3.0, 6.0, 4.0)
    assert got["a"]["fwd_ms_rounds"] == [5.0, 1.0, 3.0] and got["b"]["bwd_ms_rounds"] == [4.0, 18.0, 8.0]
    flops = bench.attention_flops(1, 2, 64, 64, 32, False, "fwd")
    assert abs(got["a"]["fwd_tflops"] - flops / 3.0 * 1e-9) < 1e-12
    assert got["broken"]["error"] == "not supported" and "fwd_ms" not in got["broken"]


def test_ablation_rounds_take_the_steps_in_turn(monkeypatch):
    order = []

    def fake_variant(step, *args):
        return (lambda: order.append(("fwd", step))), (lambda: order.append(("bwd", step)))

    times = iter(range(1, 1000))
    monkeypatch.setattr(bench, "_ablation_variant", fake_variant)
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms=100: (fn(), float(next(times)))[1])
    rows = bench.run_ablation(head_dims=(32,), causals=(False,), tokens=64, hidden=64, seqlen=64, rounds=2,
                              progress=False)
    steps = [s for _, s in bench.ABLATION_STEPS if s != "fast-masked"]       # non-causal: no split step
    assert [s for d, s in order if d == "fwd"] == steps + steps
    first = rows[0]
    assert first["fwd_ms_rounds"] == [1.0, 2 * len(steps) + 1.0]             # round 1, then round 2
    assert first["fwd_ms"] == (1.0 + 2 * len(steps) + 1.0) / 2


def test_rounds_must_be_positive(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench.main(["--quick", "--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err


def test_host_mode_takes_the_providers_in_turn_and_summarises():
    from flashattn import bench_host

    order, synced = [], []
    fns = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    switched = []
    times = bench_host.in_turn(fns, bench_host.SYNC_EVERY + 5, sync=lambda: synced.append(len(order)),
                               before=switched.append)
    assert order[:6] == ["a", "b", "c", "a", "b", "c"]          # call by call, not provider by provider
    assert switched == order                                     # the switch runs before each call
    assert {len(v) for v in times.values()} == {bench_host.SYNC_EVERY + 5}
    assert synced == [3 * bench_host.SYNC_EVERY, 3 * (bench_host.SYNC_EVERY + 5)]
    s = bench_host.summary([float(x) for x in range(1, 101)])
    assert s["median_us"] == 50.5 and s["p10_us"] < s["median_us"] and s["calls"] == 100
    table = bench_host.format_table([dict(call="fwd", provider="flashattn", median_us=134.0, p10_us=82.0),
                                     dict(call="check", provider="flashattn", triton_run_calls_in_100_steps=0)])
    assert "134.0" in table and "in 100 warm fwd+bwd steps of flashattn: 0" in table


def test_host_profile_shows_the_engine_handoff_beside_the_layers():
    """The host profile's last table: each call's fwd+bwd with the engine's device thread and on
    the calling thread, and their difference (the H200's numbers of 2026-11-29 as sample rows)."""
    from flashattn import bench_host

    engine = [dict(call="torch SDPA", threaded_us=234.7, calling_thread_us=97.1, handoff_us=137.6),
              dict(call="flashattn drop-in", threaded_us=410.5, calling_thread_us=187.2, handoff_us=223.3)]
    text = bench_host.profile_markdown({(8, 12, 256, 64): [("torch SDPA: forward", 24.2)]},
                                       dict(device="GPU", torch="t", triton="tr", date="d"),
                                       engine=((8, 12, 256, 64), engine))
    assert "| forward + backward, B8 H12 S256 D64 (us per call, host) |" in text
    assert "| flashattn drop-in | 410.5 | 187.2 | 223.3 |" in text
    assert text.index("| torch SDPA: forward | 24.2 |") < text.index("the handoff")


@pytest.mark.skipif(ON_GPU, reason="the refusal is the interpreter's")
def test_host_mode_refuses_without_a_gpu(capsys):
    assert bench.main(["--host"]) == 2
    assert "--host measures how long the CPU takes" in capsys.readouterr().err
