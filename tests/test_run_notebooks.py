"""python -m flashattn.run_notebooks: a learner's "Run all", recorded per notebook."""
import json

import nbformat

from flashattn import run_notebooks
from flashattn.bench_common import device_slug


def _notebook(path, *cells):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, path)
    return path


def test_device_names_become_short_slugs():
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("Tesla T4") == "t4"
    assert device_slug("CPU (Triton interpreter)") == "cpu_triton_interpreter"


def test_every_lesson_and_solution_is_listed():
    names = [p.relative_to(run_notebooks.ROOT).as_posix() for p in run_notebooks.notebooks()]
    assert "notebooks/07_lazy_attention.ipynb" in names and "solutions/04_dkdv_kernel.ipynb" in names
    assert not any(n.startswith("exercises/") for n in names)      # they raise by design


def test_the_failing_cell_is_named_not_a_cell_meant_to_raise(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('planted')"),
                                         nbformat.v4.new_code_cell("assert 1 == 2, 'real'")])
    nb.cells[0].metadata["tags"] = ["raises-exception"]
    path = tmp_path / "lab.ipynb"
    nbformat.write(nb, path)
    row = run_notebooks.run_one(str(path))
    assert row["status"] == "fail" and row["error"] == "cell 1: AssertionError: real", row


def test_no_notebooks_is_an_error(monkeypatch, capsys):
    import pytest

    monkeypatch.setattr(run_notebooks, "notebooks", lambda: [])
    with pytest.raises(SystemExit):
        run_notebooks.main([])
    assert "no notebooks under" in capsys.readouterr().err


def test_a_pass_a_failure_and_the_record(tmp_path, monkeypatch):
    good = _notebook(tmp_path / "good.ipynb", "from pathlib import Path\nassert Path('good.ipynb').exists()")
    bad = _notebook(tmp_path / "bad.ipynb", "x = 1", "assert x == 2, 'x is not 2'")
    before = bad.read_text()
    rows = run_notebooks.run([good, bad], workers=2, progress=False)
    assert [r["status"] for r in rows] == ["pass", "fail"]
    assert rows[1]["error"] == "cell 1: AssertionError: x is not 2"
    assert bad.read_text() == before                       # run in a copy: outputs not written back
    monkeypatch.setattr(run_notebooks, "notebooks", lambda: [good])
    assert run_notebooks.main(["--out", str(tmp_path / "rec"), "--workers", "1"]) == 0
    (written,) = (tmp_path / "rec").glob("*_notebooks_*.json")
    rec = json.loads(written.read_text())
    assert rec["passed"] == 1 and rec["failed"] == 0 and {"device", "torch", "triton"} <= set(rec)
    assert set(rec["rows"][0]) == {"path", "status", "seconds", "error"}
