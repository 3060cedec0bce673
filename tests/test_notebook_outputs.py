"""Committed notebooks: outputs of a real run that show no machine's absolute paths and no
stale source listings, and the Colab setup cell in sync with flashattn/colab.py."""
import json
import re
from pathlib import Path

import pytest

from flashattn import colab

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))

#: an absolute path of some machine: a Unix home, temp, system or Colab folder, or a Windows drive
ABSOLUTE = re.compile(r"(?<![\w.~])(/(?:work|root|home|tmp|Users|opt|usr|var|private|content|mnt|srv)/[\w.-]+"
                      r"|\b[A-Za-z]:\\\\?[\w.-]+)")


def _output_texts(nb):
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            parts = [out.get("text", "")] + [out.get("evalue", "")] + out.get("traceback", [])
            for key, value in out.get("data", {}).items():
                if key.startswith("text/") or key == "application/json":
                    parts.append(value if isinstance(value, (str, list)) else json.dumps(value))
            for p in parts:
                yield "".join(p) if isinstance(p, list) else str(p)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_outputs_show_no_absolute_paths(path):
    nb = json.loads(path.read_text())
    found = sorted({m.group(0) for text in _output_texts(nb) for m in ABSOLUTE.finditer(text)})
    assert not found, f"{path.relative_to(ROOT)} shows absolute paths in its outputs: {found[:5]}"


#: viz.show_numbered_source's header; the listed lines follow as "  42 | text"
LISTING = re.compile(r"^# (flashattn/[\w/.]+\.py), lines (\d+)-(\d+)$")


def _stale_listings(text):
    """(file, line) of each listed line that no longer reads as the file does."""
    lines, stale = text.split("\n"), []
    for i, line in enumerate(lines):
        header = LISTING.match(line)
        if not header:
            continue
        source = (ROOT / header.group(1)).read_text().split("\n")
        for listed in lines[i + 1:i + 2 + int(header.group(3)) - int(header.group(2))]:
            number, _, code = listed.partition(" | ")
            if not number.strip().isdigit() or source[int(number) - 1].rstrip() != code.rstrip():
                stale.append((header.group(1), number.strip()))
                break
    return stale


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_source_listings_match_the_package(path):
    """A lesson that prints a kernel's source (viz.show_numbered_source) shows it as the package
    has it now: after a kernel changes, the notebook must be run again."""
    nb = json.loads(path.read_text())
    stale = [s for text in _output_texts(nb) for s in _stale_listings(text)]
    assert not stale, f"{path.relative_to(ROOT)}: listings that no longer match (file, line): {stale[:5]}; re-run it"


def test_the_pattern_catches_what_it_should():
    for bad in ("/work/main/flashattn/check.py", "File /root/.pyenv/x.py", "C:\\Users\\ann\\x.py",
                "see /tmp/lab08_ab12/attn_project"):
        assert ABSOLUTE.search(bad), bad
    for fine in ("flashattn/backward.py, lines 3-9", "~/course/x.py", "rows 0-15 of 0-15", "1/sqrt(D)"):
        assert not ABSOLUTE.search(fine), fine


def test_colab_cells_are_current():
    assert colab.stale(ROOT) == [], "run: python -m flashattn.colab"
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        first = colab.first_code_cell(nb)
        assert first is not None and "".join(first["source"]).startswith(colab.MARKER), path


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kernelspec_is_what_jupyterlab_writes(path):
    """JupyterLab names the kernel "Python 3 (ipykernel)"; a notebook that says "Python 3" is
    rewritten (and shown unsaved) the moment a learner opens it, and conflicts on the next pull."""
    spec = json.loads(path.read_text())["metadata"].get("kernelspec", {})
    assert spec == {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}, spec
