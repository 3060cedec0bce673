"""The student notebooks: generated from solutions/ by nbgrader's ClearSolutions, never stale,
never overwriting a learner's edits, and tagged so that nbval catches a checker that passes
unwritten code."""
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytest.importorskip("nbgrader")

from flashattn import exercises  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RAISES = exercises.RAISES_TAG

# A student copy of the course may ship without solutions/: nothing to compare against then.
pytestmark = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="no solutions/ here")


def _sources(nb):
    return [(c.cell_type, c.source, sorted(c.metadata.get("tags", []))) for c in nb.cells]


def test_generated_notebooks_are_up_to_date():
    """Regenerate every solution into memory and compare cell by cell with what is committed."""
    stale = []
    for sol in exercises.solution_notebooks(ROOT):
        target, fresh = exercises.generate(sol, ROOT)
        if not target.exists():
            stale.append(f"{target.relative_to(ROOT)} is missing")
            continue
        old = nbformat.read(str(target), as_version=4)
        a, b = _sources(old), _sources(fresh)
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            stale.append(f"{target.relative_to(ROOT)} differs from {sol.relative_to(ROOT)} "
                         f"regenerated, first at cell {i}")
    assert not stale, "\n".join(stale) + "\nRegenerate with: python -m flashattn.exercises"
    assert exercises.stale_report(ROOT) == []


def test_solutions_carry_nbgrader_metadata_and_no_raises_tags():
    for sol in exercises.solution_notebooks(ROOT):
        nb = nbformat.read(str(sol), as_version=4)
        solution_cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]
        assert solution_cells, f"{sol.name}: no nbgrader solution cell"
        for c in solution_cells:
            meta = c.metadata["nbgrader"]
            assert meta["schema_version"] == 3 and meta["grade_id"] and meta["locked"] is False
            assert "### BEGIN SOLUTION" in c.source and "### END SOLUTION" in c.source
        assert any(exercises._is_checker(c) for c in nb.cells), f"{sol.name}: no checker cell"
        for c in nb.cells:
            assert RAISES not in c.metadata.get("tags", []), f"{sol.name}: a solution cell is tagged {RAISES}"


def test_exercise_tags_cover_cleared_cells_and_their_checkers():
    for sol in exercises.solution_notebooks(ROOT):
        _, ex = exercises.generate(sol, ROOT)
        seen_cleared = False
        for c in ex.cells:
            if c.cell_type != "code":
                continue
            tagged = RAISES in c.metadata.get("tags", [])
            if exercises._is_solution(c):
                seen_cleared = True
                assert tagged == exercises._raises_at_top_level(c.source), c.source
                assert "### BEGIN SOLUTION" not in c.source
            elif exercises._is_checker(c):
                assert tagged == seen_cleared, c.source
            else:
                assert not tagged, c.source
        assert ex.metadata["flashattn"]["generated_from"] == sol.relative_to(ROOT).as_posix()


def test_stub_detection():
    assert exercises._raises_at_top_level("# YOUR CODE HERE\nraise NotImplementedError()")
    assert exercises._raises_at_top_level("if True:\n    raise NotImplementedError()")
    assert not exercises._raises_at_top_level("def f():\n    raise NotImplementedError()")
    assert not exercises._raises_at_top_level("class A:\n    def f(self):\n        raise NotImplementedError()")


# --------------------------------------------------------------------------------------
# regenerating never destroys a learner's work
# --------------------------------------------------------------------------------------
@pytest.fixture
def course(tmp_path):
    (tmp_path / "solutions").mkdir()
    shutil.copy(ROOT / "solutions" / "01_attention_backward.ipynb", tmp_path / "solutions")
    return tmp_path


def test_regenerating_keeps_a_learners_edits(course):
    quiet = dict(log=lambda *a: None, execute=False)
    target = course / "exercises" / "01_attention_backward.ipynb"
    first = exercises.build(course, **quiet)
    assert [o.status for o in first] == ["written"] and target.exists()
    assert [o.status for o in exercises.build(course, **quiet)] == ["up to date"]

    # the learner fills in the exercise
    nb = nbformat.read(str(target), as_version=4)
    cell = next(c for c in nb.cells if "raise NotImplementedError()" in c.source)
    cell.source = cell.source.replace("raise NotImplementedError()", "return q, k, v  # my work")
    nbformat.write(nb, str(target))
    mine = target.read_text()

    # the instructor changes the solution; regenerating must keep the learner's file
    sol = course / "solutions" / "01_attention_backward.ipynb"
    snb = nbformat.read(str(sol), as_version=4)
    snb.cells.append(nbformat.v4.new_markdown_cell("An extra note from the instructor."))
    nbformat.write(snb, str(sol))
    out = exercises.build(course, **quiet)
    assert out[0].status == "kept edited" and "kept" in out[0].note
    assert target.read_text() == mine
    new = target.with_name("01_attention_backward.new.ipynb")
    assert "An extra note" in new.read_text()
    assert exercises.stale_report(course), "an edited exercise must count as stale in --check"

    # --force overwrites, after a backup
    out = exercises.build(course, force=True, **quiet)
    assert out[0].status == "overwrote edited"
    backups = list(target.parent.glob("01_attention_backward.ipynb.*.bak"))
    assert len(backups) == 1 and backups[0].read_text() == mine
    assert "An extra note" in target.read_text()


def test_unedited_stale_exercise_is_simply_rewritten(course):
    quiet = dict(log=lambda *a: None, execute=False)
    exercises.build(course, **quiet)
    sol = course / "solutions" / "01_attention_backward.ipynb"
    snb = nbformat.read(str(sol), as_version=4)
    snb.cells.append(nbformat.v4.new_markdown_cell("Another note."))
    nbformat.write(snb, str(sol))
    assert [o.status for o in exercises.build(course, write=False, **quiet)] == ["stale"]
    assert [o.status for o in exercises.build(course, **quiet)] == ["written"]
    assert not list((course / "exercises").glob("*.new.ipynb"))


def test_command_line_check_reports_stale(course, capsys):
    assert exercises.main(["--root", str(course), "--check"]) == 1
    assert "missing" in capsys.readouterr().out
    assert exercises.main(["--root", str(course), "--no-execute"]) == 0
    assert exercises.main(["--root", str(course), "--check"]) == 0


# --------------------------------------------------------------------------------------
# nbval: a cell tagged raises-exception that does not raise must fail (conftest.py)
# --------------------------------------------------------------------------------------
def _notebook(path, source):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["flashattn"] = {"generated_from": "solutions/x.ipynb"}
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(source)]
    nb.cells[1].metadata["tags"] = [RAISES]
    nbformat.write(nb, str(path))


def _pytest(cwd, *args):
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:xdist",
           "-p", "no:cacheprovider", "-o", "addopts=", "-q", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240)


def test_nbval_fails_a_tagged_cell_that_does_not_raise(tmp_path):
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    _notebook(tmp_path / "silent.ipynb", "check_result = 'passed without raising'")
    _notebook(tmp_path / "raises.ipynb", "raise NotImplementedError()")
    with_hook = _pytest(tmp_path, "silent.ipynb", "raises.ipynb")
    assert with_hook.returncode == 1, with_hook.stdout
    assert "1 failed, 3 passed" in with_hook.stdout, with_hook.stdout
    assert "silent.ipynb::Cell 1" in with_hook.stdout and "must raise" in with_hook.stdout
    # nbval on its own lets the silent cell pass: that is why conftest.py exists
    alone = _pytest(tmp_path, "--noconftest", "silent.ipynb")
    assert alone.returncode == 0 and "2 passed" in alone.stdout, alone.stdout
