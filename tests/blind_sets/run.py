"""Run a blind set of learner mistakes through the exercises' checkers.

    python tests/blind_sets/run.py r [--only ID,ID] [--out results.json]

Each variant of set_<x>.py edits one exercise's worked solution; the exercise's checker then runs
as the exercise notebook calls it (raise_on_fail and show off). Prints one line per variant (PASS,
or FAIL and the first diagnosis), then how many mistakes were caught, how many harmless rewrites
passed, and which first diagnoses differ from first_diagnoses.json (recorded when the set was
judged; score_<x>.md has the judgement: did the first diagnosis name the real mistake?).
``--out``: every diagnosis in full, as JSON. About 2-3 minutes a set on a laptop CPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_set(name: str) -> list:
    spec = importlib.util.spec_from_file_location(f"set_{name}", HERE / f"set_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.VARIANTS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("set", choices=sorted(p.stem[4:] for p in HERE.glob("set_*.py")))
    ap.add_argument("--only", default="", help="comma-separated variant ids")
    ap.add_argument("--out", help="write every result, diagnosis included, to this JSON file")
    args = ap.parse_args(argv)
    sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]
    import conftest      # tests/conftest.py: the solutions' code and the exercises' checker calls

    only = set(filter(None, args.only.split(",")))
    recorded = json.loads((HERE / "first_diagnoses.json").read_text()).get(args.set, {})
    tmp = Path(tempfile.mkdtemp())
    results, changed = [], []
    for v in load_set(args.set):
        if only and v["id"] not in only:
            continue
        t0 = time.time()
        rec = {"id": v["id"], "exercise": v["exercise"], "kind": v["kind"]}
        try:
            module = conftest.solution(tmp, "09" if v["exercise"].startswith("09") else v["exercise"],
                                       [tuple(e) for e in v["edits"]])
            r = conftest.SOLUTION_CHECKS[v["exercise"]](module)
            rec.update(ok=bool(r.ok), first=(r.hint_ids or ["PASS"])[0], diagnosis=r.diagnosis() if not r.ok else "")
        except Exception as e:          # an edit that no longer applies, a module that does not load
            rec.update(ok=False, first="ERROR", diagnosis=f"{type(e).__name__}: {e}")
        results.append(rec)
        if v["id"] in recorded and recorded[v["id"]] != rec["first"]:
            changed.append(f"{v['id']}: {recorded[v['id']]} -> {rec['first']}")
        print(f"{v['id']:42s} {'PASS' if rec['ok'] else 'FAIL'} {rec['first'] if not rec['ok'] else '':32s} "
              f"{time.time() - t0:5.1f}s", flush=True)
    bugs = [r for r in results if r["kind"] == "bug"]
    harmless = [r for r in results if r["kind"] == "harmless"]
    print(f"\nset {args.set}: {sum(not r['ok'] for r in bugs)} of {len(bugs)} mistakes caught, "
          f"{sum(r['ok'] for r in harmless)} of {len(harmless)} harmless rewrites pass; "
          f"{len(changed)} first diagnoses differ from the recorded ones" + (":" if changed else ""))
    for line in changed:
        print("  " + line)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
