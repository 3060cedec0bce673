"""Generate the student notebooks from the worked solutions: ``python -m flashattn.exercises``.

``solutions/*.ipynb`` are the single source. Each holds nbgrader solution regions::

    ### BEGIN SOLUTION
    ...the worked code...
    ### END SOLUTION

in cells marked as nbgrader solution cells. This command runs nbgrader's own
:class:`~nbgrader.preprocessors.ClearSolutions` preprocessor over every solution notebook and
writes the result to ``exercises/<same name>.ipynb`` (or wherever the solution's metadata
``flashattn.exercise_path`` says: the bug-hunt lab's student version lives in ``notebooks/``).

What it adds on top of nbgrader:

* **nbval tags.** Every cleared cell whose stub raises when run (the default stub is
  ``raise NotImplementedError()``) and every checker cell after it (nbgrader "grade" cells, or
  cells with ``flashattn.checker: true``) get nbval's ``raises-exception`` tag, so the exercise
  notebooks run under ``pytest --nbval-lax``; the repository's ``conftest.py`` then fails any
  tagged cell that does *not* raise. ``flashattn.raises: true/false`` in a cell's metadata
  overrides the guess.
* **Per-cell stubs.** ``flashattn.stub`` in a solution cell's metadata replaces nbgrader's
  default stub for that cell (the lab uses it to hand out the buggy line instead of a blank).
* **Learners' work is never overwritten.** The generated notebook records a hash of its cells
  (``metadata.flashattn.content_sha256``). If a target no longer matches its own hash, someone
  edited it: it is kept as it is, the new version is written beside it as ``<name>.new.ipynb``,
  and the command says so (``--force`` overwrites after copying the edited one to ``.bak``).
* **Outputs.** Generated notebooks carry no outputs, unless the solution's metadata says
  ``flashattn.execute_exercise: true`` (the lab: its student version is committed with the
  failing checker output a learner will see).

Usage (from the repository's root)::

    python -m flashattn.exercises            # regenerate everything that is out of date
    python -m flashattn.exercises --check    # exit 1 and list what is stale (CI, tests)
    python -m flashattn.exercises --force    # overwrite edited targets (keeping a .bak copy)
    python -m flashattn.exercises solutions/03_dq_kernel.ipynb   # just these

nbgrader (``pip install nbgrader``) is needed only here, not by the package.
"""
from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import nbformat

GENERATOR = "python -m flashattn.exercises"
RAISES_TAG = "raises-exception"


# --------------------------------------------------------------------------------------
# locating things
# --------------------------------------------------------------------------------------
def find_root(start: Optional[Path] = None) -> Path:
    """The course's root: the nearest directory (from ``start``, default the working directory)
    that holds ``solutions/``; else the directory above this package."""
    start = (start or Path.cwd()).resolve()
    for p in [start, *start.parents]:
        if (p / "solutions").is_dir():
            return p
    return Path(__file__).resolve().parent.parent


def solution_notebooks(root: Path) -> list:
    return sorted(p for p in (root / "solutions").glob("*.ipynb")
                  if not p.name.endswith(".new.ipynb"))


def target_of(solution: Path, nb, root: Path) -> Path:
    rel = nb.metadata.get("flashattn", {}).get("exercise_path")
    return (root / rel) if rel else (root / "exercises" / solution.name)


# --------------------------------------------------------------------------------------
# generating one notebook
# --------------------------------------------------------------------------------------
def _fa(cell) -> dict:
    return cell.metadata.get("flashattn", {})


def _is_checker(cell) -> bool:
    nbg = cell.metadata.get("nbgrader", {})
    return cell.cell_type == "code" and (bool(nbg.get("grade")) and not nbg.get("solution")
                                         or bool(_fa(cell).get("checker")))


def _is_solution(cell) -> bool:
    return bool(cell.metadata.get("nbgrader", {}).get("solution"))


def _raises_at_top_level(source: str) -> bool:
    """Does running this cell execute a ``raise`` statement that is not inside a def or class?"""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False

    def walk(nodes) -> bool:
        for node in nodes:
            if isinstance(node, ast.Raise):
                return True
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if walk(ast.iter_child_nodes(node)):
                return True
        return False

    return walk(tree.body)


def content_hash(nb) -> str:
    """Hash of what a learner edits: cell types, sources and tags (not outputs, not ids)."""
    cells = [[c.cell_type, c.source, sorted(c.metadata.get("tags", []))] for c in nb.cells]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()


def _banner(solution_rel: str) -> str:
    return (f"> **Student version.** Write your code where a cell says `# YOUR CODE HERE` and run "
            f"the checker after it. Generated from `{solution_rel}` by `{GENERATOR}`: "
            "instructors edit the solution and regenerate; your edits here are kept if you "
            "regenerate.")


def generate(solution: Path, root: Path):
    """Return ``(target_path, exercise_notebook)`` for one solution notebook."""
    from nbgrader.preprocessors import ClearSolutions

    nb = nbformat.read(str(solution), as_version=4)
    target = target_of(solution, nb, root)
    ex = copy.deepcopy(nb)
    default = ClearSolutions(enforce_metadata=True)
    resources = {"language": ex.metadata.get("kernelspec", {}).get("language", "python")}
    cleared_seen = False         # checkers after a cleared cell fail until the learner writes it
    cells = []
    for i, cell in enumerate(ex.cells):
        fa = _fa(cell)
        if fa.get("solution_only"):
            continue
        before = cell.source
        stub = fa.get("stub")
        pre = default if stub is None else ClearSolutions(enforce_metadata=True,
                                                          code_stub={"python": stub})
        cell, resources = pre.preprocess_cell(cell, resources, i)
        cleared = _is_solution(cell) and cell.source != before
        tags = [t for t in cell.metadata.get("tags", []) if t != RAISES_TAG]
        if cell.cell_type == "code":
            if cleared:
                raises = fa.get("raises", _raises_at_top_level(cell.source))
                cleared_seen = True
            elif _is_checker(cell):
                raises = fa.get("raises", cleared_seen)
            else:
                raises = fa.get("raises", False)
            if raises:
                tags.append(RAISES_TAG)
            cell.outputs = []
            cell.execution_count = None
        if tags:
            cell.metadata["tags"] = tags
        else:
            cell.metadata.pop("tags", None)
        cell.metadata.pop("flashattn", None)
        cells.append(cell)
    ex.cells = cells
    ex.metadata.pop("celltoolbar", None)
    solution_rel = solution.resolve().relative_to(root.resolve()).as_posix()
    ex.cells.insert(0, nbformat.v4.new_markdown_cell(_banner(solution_rel)))
    ex.cells[0].metadata["flashattn"] = {"banner": True}
    meta = {k: v for k, v in nb.metadata.get("flashattn", {}).items()
            if k not in ("exercise_path", "execute_exercise")}
    meta.update({"generated_from": solution_rel, "generator": GENERATOR})
    meta["content_sha256"] = content_hash(ex)
    ex.metadata["flashattn"] = meta
    _stable_ids(ex, target.stem)  # ids derived from the position: regenerating gives no diff
    return target, ex


def _stable_ids(nb, stem: str) -> None:
    nb.nbformat_minor = max(nb.nbformat_minor, 5)
    for i, c in enumerate(nb.cells):
        c["id"] = hashlib.sha1(f"{stem}:{i}:{c.cell_type}".encode()).hexdigest()[:12]


def _execute(nb, cwd: Path, root: Path):
    from nbconvert.preprocessors import ExecutePreprocessor

    env_path = os.environ.get("PYTHONPATH", "")
    if str(root) not in env_path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env_path] if env_path else []))
    ep = ExecutePreprocessor(timeout=900, allow_errors=True, kernel_name="python3")
    ep.preprocess(nb, {"metadata": {"path": str(cwd)}})
    return nb


# --------------------------------------------------------------------------------------
# writing without destroying anyone's work
# --------------------------------------------------------------------------------------
@dataclass
class Outcome:
    solution: Path
    target: Path
    status: str        # "written", "up to date", "kept edited", "overwrote edited", "stale", "missing", "edited"
    note: str = ""


def _state(target: Path, new_hash: str) -> str:
    if not target.exists():
        return "missing"
    try:
        old = nbformat.read(str(target), as_version=4)
    except Exception:   # noqa: BLE001 -- unreadable counts as edited: never overwrite it silently
        return "edited"
    current = content_hash(old)
    if current == new_hash:
        return "up to date"
    stored = old.metadata.get("flashattn", {}).get("content_sha256")
    return "stale" if stored == current else "edited"


def build(root: Path, solutions: Optional[Iterable[Path]] = None, *, write: bool = True,
          force: bool = False, execute: bool = True, log=print) -> list:
    """Regenerate (``write=True``) or only compare (``write=False``); returns the outcomes."""
    outcomes = []
    for sol in (list(solutions) if solutions else solution_notebooks(root)):
        sol = Path(sol).resolve()
        target, ex = generate(sol, root)
        new_hash = ex.metadata["flashattn"]["content_sha256"]
        state = _state(target, new_hash)
        rel = target.relative_to(root) if target.is_relative_to(root) else target
        if not write:
            outcomes.append(Outcome(sol, target, state))
            continue
        if state == "up to date":
            outcomes.append(Outcome(sol, target, state))
            continue
        src_meta = nbformat.read(str(sol), as_version=4).metadata.get("flashattn", {})
        if execute and src_meta.get("execute_exercise"):
            log(f"executing {rel} (its outputs are part of the student version) ...")
            _execute(ex, target.parent, root)
        if state == "edited" and not force:
            new = target.with_name(target.stem + ".new.ipynb")
            nbformat.write(ex, str(new))
            outcomes.append(Outcome(sol, target, "kept edited",
                                    f"{rel} was edited since it was generated: kept as it is; the "
                                    f"new version is {new.name} (compare, then move it over)"))
        else:
            note = ""
            if state == "edited":
                bak = target.with_name(target.name + f".{time.strftime('%Y%m%d-%H%M%S')}.bak")
                shutil.copy2(target, bak)
                note = f"{rel} was edited: copied to {bak.name} before overwriting (--force)"
            target.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(ex, str(target))
            outcomes.append(Outcome(sol, target, "overwrote edited" if state == "edited" else "written", note))
    return outcomes


def stale_report(root: Path) -> list:
    """Problems that make the generated notebooks disagree with solutions/ (empty: all good)."""
    problems = []
    outcomes = build(root, write=False)
    for o in outcomes:
        if o.status != "up to date":
            problems.append(f"{o.target.relative_to(root)}: {o.status} (generated from "
                            f"{o.solution.relative_to(root)}); run `{GENERATOR}`")
    expected = {o.target.resolve() for o in outcomes}
    for p in sorted((root / "exercises").glob("*.ipynb")) if (root / "exercises").is_dir() else []:
        if p.name.endswith(".new.ipynb") or p.resolve() in expected:
            continue
        meta = nbformat.read(str(p), as_version=4).metadata.get("flashattn", {})
        why = (f"generated from {meta['generated_from']}, which no longer exists"
               if meta.get("generated_from") else "not generated from solutions/ (hand-written?)")
        problems.append(f"{p.relative_to(root)}: {why}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=GENERATOR, description=__doc__.split("\n\n")[0])
    ap.add_argument("solutions", nargs="*", type=Path, help="solution notebooks (default: all)")
    ap.add_argument("--root", type=Path, default=None, help="course root (default: found from cwd)")
    ap.add_argument("--check", action="store_true", help="only report what is stale; exit 1 if any")
    ap.add_argument("--force", action="store_true", help="overwrite edited targets (a .bak copy is kept)")
    ap.add_argument("--no-execute", action="store_true", help="do not run notebooks marked execute_exercise")
    args = ap.parse_args(argv)
    root = (args.root or find_root()).resolve()
    if args.check:
        problems = stale_report(root)
        for p in problems:
            print(p)
        print("exercises are up to date" if not problems else f"{len(problems)} stale")
        return 1 if problems else 0
    outcomes = build(root, args.solutions or None, force=args.force, execute=not args.no_execute)
    for o in outcomes:
        line = f"{o.status:>16}: {o.target.relative_to(root)}"
        print(line + (f"\n{'':>18}{o.note}" if o.note else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
