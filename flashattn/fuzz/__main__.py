"""``python -m flashattn.fuzz``: run the randomized battery, print failures with their reproducers."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from .. import runtime
from . import __doc__ as PACKAGE_DOC
from .battery import check_problem, default_workers, one_line, run
from .problems import FAMILIES, draw


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flashattn.fuzz", description=PACKAGE_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--minutes and --problems stop the run at whichever comes first. Exit status 1: a "
               "problem failed. A failure's reproducer names its --seed, --problem, --families and "
               "--sizes: give the same to rebuild it. On a CPU the 'cuda' family is skipped (it needs "
               "nvcc and a GPU) but its draws still count towards --problems.")
    ap.add_argument("--seed", type=int, default=0, help="the battery's seed (default 0)")
    ap.add_argument("--minutes", type=float, help="time budget")
    ap.add_argument("--problems", type=int, help="how many problems (default: as many as --minutes allows)")
    ap.add_argument("--problem", type=int, help="rerun this one problem (a failure's reproducer) and print it")
    ap.add_argument("--start", type=int, default=0, help="the first problem's index")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma-separated, among {', '.join(FAMILIES)} (default: all)")
    ap.add_argument("--sizes", choices=("cpu", "gpu"), default=None,
                    help="draw at the interpreter's small sizes or a GPU's (default: where the kernels run)")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes (default: 1 on the CPU, one per two cores on GPUs, at most 12 per GPU; "
                         "on several GPUs worker i uses GPU i mod their count)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the summary as JSON here (a folder: fuzz_<device>_seed<S>.json in it); "
                         "rewritten every 30 s while the run lasts (\"finished\": false)")
    args = ap.parse_args(argv)
    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        ap.error(f"--families takes names among {', '.join(FAMILIES)}; got {', '.join(unknown) or 'none'}")
    on_gpu = (not runtime.INTERPRET) if args.sizes is None else args.sizes == "gpu"
    for name in ("problems", "workers", "minutes"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            ap.error(f"--{name} must be positive, got {value}")

    if args.problem is not None:
        p = draw(args.seed, args.problem, on_gpu=on_gpu, families=families)
        print(p.reproducer())
        result = check_problem(p)
        if result["status"] == "skipped":
            print(f"SKIPPED: {result['why']}")
        else:
            print(result["status"].upper(), *result["failures"], sep="\n  ")
        return 0 if result["status"] != "fail" else 1
    if args.minutes is None and args.problems is None:
        ap.error("give --minutes, --problems or --problem")
    def save(summary: dict) -> Path:     # (every 30 s while it runs, then once more at the end)
        from ..bench_common import device_slug

        path = args.out if args.out.suffix == ".json" else args.out / f"fuzz_{device_slug(summary['device'])}_seed{args.seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1) + "\n")
        return path

    summary = run(args.seed, problems=args.problems, minutes=args.minutes, families=families,
                  workers=args.workers or default_workers(), start=args.start, on_gpu=on_gpu,
                  on_summary=save if args.out is not None else None)
    for failure in summary["failures"]:
        print(f"FAIL {failure['reproducer']}", *failure["failures"], sep="\n     ")
    print(one_line(summary))
    if args.out is not None:
        print(f"wrote {save(summary)}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
