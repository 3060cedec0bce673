"""``python -m flashattn.run_notebooks``: every lesson and solution run as a learner's "Run all".

CI runs the notebooks under nbval on a CPU, where the kernels run in Triton's interpreter; what
only a GPU shows (a stride the compiled kernel reads another way, a tile that does not fit, a
timing cell's assumptions) needs them run on a GPU too. This executes each notebook top to
bottom with nbclient, in a copy (the committed outputs are left alone), from the notebook's own
folder, several at a time, and writes one row per notebook -- ``{path, status: "pass" | "fail",
seconds, error}`` -- with the device and versions to ``results/gpu_notebooks_<device>.json``
(``--out`` elsewhere). Run it on a GPU after any change to the kernels or the notebooks, and
commit the record.

    python -m flashattn.run_notebooks                      # notebooks/ and solutions/
    python -m flashattn.run_notebooks notebooks/07_lazy_attention.ipynb --workers 1
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
#: what a learner runs: the lessons and the worked solutions (exercises/ raise by design)
FOLDERS = ("notebooks", "solutions")


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (root / folder).glob("*.ipynb"))


def run_one(path: str, timeout: int = 1800, keep: Optional[str] = None) -> dict:
    """Execute one notebook in a copy, from its folder. A row of the record. ``keep``: a folder
    to write the executed copy to (to read what a failing cell printed)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb_path = Path(path)
    nb = nbformat.read(nb_path, as_version=4)
    for cell in nb.cells:                    # a copy that shows only what this run printed
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(nb_path.parent)}})
    start = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as e:
        error = _cell_error(nb, str(e))
    except (CellTimeoutError, DeadKernelError, RuntimeError) as e:
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    if keep is not None:
        Path(keep).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, Path(keep) / f"{nb_path.parent.name}_{nb_path.name}")
    return {"path": nb_path.relative_to(ROOT).as_posix() if nb_path.is_relative_to(ROOT) else str(nb_path),
            "status": "fail" if error else "pass", "seconds": round(time.perf_counter() - start, 1),
            "error": error}


def _cell_error(nb, message: str) -> str:
    """'cell 29: AssertionError: ...' for the cell that raised (not the cells meant to raise, tagged
    ``raises-exception``, as the bug-hunt lab's are)."""
    for index, cell in enumerate(nb.cells):
        if "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return f"cell {index}: {out.get('ename')}: {out.get('evalue')}"[:500]
    return message.strip().splitlines()[-1][:500] if message.strip() else "CellExecutionError"


def run(paths: list[Path], workers: int = 1, progress: bool = True, keep: Optional[str] = None,
        on_row=None) -> list[dict]:
    """Run the notebooks, ``workers`` at a time (each in its own kernel process); ``on_row(rows)``
    after each one (the record is written as it grows: a run cut short still leaves one)."""
    rows = []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(paths), desc="notebooks", unit="notebook")
    with futures.ThreadPoolExecutor(max(1, workers)) as pool:     # the kernels are processes
        for row in pool.map(lambda p: run_one(str(p), keep=keep), paths):
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            if bar is not None:
                bar.update(1)
                bar.write(f"{row['status'].upper():4} {row['seconds']:7.1f} s  {row['path']}"
                          + (f"\n      {row['error']}" if row["error"] else ""))
    if bar is not None:
        bar.close()
    return rows


def record(rows: list[dict]) -> dict:
    from .bench_common import environment

    env = environment()
    passed = sum(r["status"] == "pass" for r in rows)
    return {**env, "passed": passed, "failed": len(rows) - passed, "rows": rows}


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.run_notebooks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", type=Path, help="notebooks to run (default: notebooks/ and solutions/)")
    ap.add_argument("--workers", type=int, default=1,
                    help="notebooks at a time (default 1: the timing cells then have the GPU to themselves)")
    ap.add_argument("--out", type=Path, default=ROOT / "results",
                    help="folder for gpu_notebooks_<device>.json (default: results/)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="also write each executed notebook (with its outputs) into this folder")
    args = ap.parse_args(argv)
    paths = [p.resolve() for p in args.paths] or notebooks()
    if not paths:
        ap.error(f"no notebooks under {ROOT}: run it from a clone of the course (an installed package has "
                 "none), or name the notebooks")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        ap.error(f"no such notebook: {', '.join(missing)}")
    from .bench_common import device_slug, environment

    device = environment()["device"]
    prefix = "gpu_notebooks" if "Triton interpreter" not in device else "cpu_notebooks"
    out = args.out / f"{prefix}_{device_slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows):
        out.write_text(json.dumps(dict(record(rows), of=len(paths)), indent=1) + "\n")

    rows = run(paths, args.workers, keep=str(args.keep) if args.keep else None, on_row=save)
    save(rows)
    rec = record(rows)
    print(f"{rec['passed']} of {len(rows)} notebooks passed on {rec['device']}; wrote {out}")
    return 0 if rec["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
