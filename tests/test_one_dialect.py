"""One kernel dialect: the kernels learners write (exercises 03, 04) and fix (the bug-hunt lab)
are the lesson's kernels, line for line, under another name -- so the notebooks cannot drift
from the code the lessons print."""
import inspect
import json
import textwrap
from pathlib import Path

import pytest

from flashattn import backward

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="no solutions/ here")


def _cell_defining(notebook: str, name: str) -> str:
    nb = json.loads((ROOT / notebook).read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and f"def {name}(" in src:
            lines = [l for l in src.splitlines() if l.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION")]
            return "\n".join(lines)
    raise AssertionError(f"{notebook} defines no {name}")


def _lesson(kernel, name: str) -> str:
    src = textwrap.dedent(inspect.getsource(kernel.fn))
    return src.replace(f"def {kernel.fn.__name__}(", f"def {name}(", 1).rstrip()


@pytest.mark.parametrize("notebook, name, kernel", [
    ("solutions/03_dq_kernel.ipynb", "dq_kernel", backward.attn_bwd_dq_kernel),
    ("solutions/04_dkdv_kernel.ipynb", "dkdv_kernel", backward.attn_bwd_dkdv_kernel),
    ("solutions/08_bug_hunt_lab.ipynb", "dq_kernel_1", backward.attn_bwd_dq_kernel),
    ("solutions/08_bug_hunt_lab.ipynb", "dkdv_kernel_3", backward.attn_bwd_dkdv_kernel),
    ("solutions/08_bug_hunt_lab.ipynb", "dkdv_kernel_5", backward.attn_bwd_dkdv_kernel),
    ("solutions/08_bug_hunt_lab.ipynb", "dkdv_kernel_6", backward.attn_bwd_dkdv_kernel),
])
def test_worked_kernel_is_the_lesson_kernel(notebook, name, kernel):
    cell = _cell_defining(notebook, name)
    lesson = _lesson(kernel, name)
    assert lesson in cell, (f"{notebook}: {name} is not the lesson's {kernel.fn.__name__}; "
                            "regenerate the cell from flashattn/backward.py")


def test_no_other_dialect_left():
    """The old exercise dialect (stride_qb, Q += ...) appears nowhere a learner reads."""
    for folder in ("notebooks", "solutions", "exercises"):
        for path in (ROOT / folder).glob("*.ipynb"):
            nb = json.loads(path.read_text())
            for cell in nb["cells"]:
                src = "".join(cell["source"]) + json.dumps(cell.get("metadata", {}))
                for old in ("stride_qb", "stride_dob", "Q += b *", "DO += b *"):
                    assert old not in src, f"{path.relative_to(ROOT)} still uses `{old}`"
