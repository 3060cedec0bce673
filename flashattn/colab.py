"""Colab: the first code cell of every notebook fetches and installs the course there.

On Colab a notebook arrives alone, without this repository and without the package. So each
notebook opens with the cell below: on Colab only, it clones the repository (``REPO_URL``, the
one place the address lives), installs the package beside Colab's own torch (``-e``, no torch
pin: Colab keeps the CUDA build it has), and changes into ``notebooks/`` so that relative paths
(``../results``) work. Anywhere else it does nothing.

The cells are generated from this file: after changing ``REPO_URL``, run
``python -m flashattn.colab`` to rewrite them (``--check`` lists the notebooks whose cell is
out of date; a test does the same).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: Where the course is published: the one place its address is written.
REPO_URL = "https://github.com/flashattn-course/flashattn-course"

CLONE = "/content/flashattn-course"
MARKER = "# Colab only:"


def cell_source(url: str = REPO_URL) -> str:
    return f'''{MARKER} fetch the course and install it beside Colab's own torch. Elsewhere: nothing.
import os, subprocess, sys
if "google.colab" in sys.modules:
    if not os.path.isdir("{CLONE}"):
        subprocess.run(["git", "clone", "-q", "--depth", "1", "{url}", "{CLONE}"], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "{CLONE}"], check=True)
    sys.path.insert(0, "{CLONE}")
    os.chdir("{CLONE}/notebooks")'''


def _lines(text: str) -> list:
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + [parts[-1]]


def notebooks(root: Path) -> list:
    """The notebooks that carry the cell: lessons and solutions (exercises are generated from
    the solutions and get it from there)."""
    return sorted((root / "notebooks").glob("*.ipynb")) + sorted((root / "solutions").glob("*.ipynb"))


def first_code_cell(nb: dict):
    return next((c for c in nb["cells"] if c["cell_type"] == "code"), None)


def stale(root: Path) -> list:
    want = cell_source()
    out = []
    for path in notebooks(root):
        nb = json.loads(path.read_text())
        if nb.get("metadata", {}).get("flashattn", {}).get("generated_from"):
            continue                   # a generated student notebook: it follows its solution
        cell = first_code_cell(nb)
        if cell is None or "".join(cell["source"]) != want:
            out.append(path)
    return out


def rewrite(root: Path) -> list:
    """Put the current cell first in every notebook that is out of date; return their paths."""
    want = cell_source()
    changed = []
    for path in stale(root):
        nb = json.loads(path.read_text())
        cell = first_code_cell(nb)
        if cell is not None and "".join(cell["source"]).startswith(MARKER):
            cell["source"] = _lines(want)
        else:
            index = nb["cells"].index(cell) if cell is not None else len(nb["cells"])
            nb["cells"].insert(index, {"cell_type": "code", "execution_count": None, "id": "colab-setup",
                                       "metadata": {}, "outputs": [], "source": _lines(want)})
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        changed.append(path)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.colab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="list notebooks whose Colab cell is stale")
    ap.add_argument("--root", default=".", help="the course's root (default: here)")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if args.check:
        out = stale(root)
        for p in out:
            print(f"stale Colab cell: {p}")
        return 1 if out else 0
    for p in rewrite(root):
        print(f"rewrote the Colab cell of {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
