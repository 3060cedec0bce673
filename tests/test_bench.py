"""python -m flashattn.bench: runs anywhere with --quick, and writes where git does not look."""
import subprocess
from pathlib import Path

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
