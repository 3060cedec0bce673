"""The checkers' behaviour, pinned: every checker's ordered list of diagnoses, and the first diagnosis
of every known mistake. ``check_diagnoses.json`` beside this file is the record;
``tests/test_golden_diagnoses.py`` compares today's checkers with it.

    python tests/golden/check_diagnoses.py              # recompute everything, write the JSON
    python tests/golden/check_diagnoses.py --workers 2  # the same on two processes
    python tests/golden/check_diagnoses.py --check      # recompute, compare, write nothing
    python tests/golden/check_diagnoses.py --checkers dq_kernel,dkdv_kernel   # only these checkers' variants

Regenerate it only on purpose -- when a change is *meant* to change a diagnosis -- and say in the
commit which entries changed (``--check`` lists them). The mistakes it runs, each under a key:

* ``blind/<set>/<id>``: every variant of the blind sets (tests/blind_sets/set_*.py);
* ``planted/<name>``: every dQ and dK/dV entry of flashattn.planted.CATALOG, planted into the package's
  kernel and run through check.dq_kernel / check.dkdv_kernel (the direct launchers of
  tests/test_check_kernels.py, no GQA cases); the lazy and fast entries are left out -- the lazy
  ones are run by tests/test_lazy.py, the fast ones are speed ablations that compute the right values;
* ``slips/<exercise>/<the diagnosis the test expects>``: the one-line edits of the worked solutions
  in tests/test_check_slips.py and tests/test_check_code.py, and lesson 09's in
  tests/test_check_beyond.py (``beyond/<checker>/...``: a window slip runs through both lesson-09
  checkers); the n-th edit of a table that expects the same diagnosis gets ``#n`` (n >= 2), so
  append new edits to those tables rather than insert them.

Beside the record, ``example/<checker>/<what>`` keys name the tests' own planted functions and
launchers (:func:`examples`) that prove the diagnoses no variant above triggers; every mistake's
``proof`` is one of these keys (test_check.py's test_every_diagnosis_is_proven runs each).

Each first diagnosis is the id a checker names first, ``PASS`` when it passes, ``ERROR`` when the
variant no longer applies. Every run is on the CPU (Triton's interpreter), under the test suite's
poisoned outputs, with torch's global seed set to 0 first: the record is the CPU's (a GPU runs the
kernels in fp16, where some diagnoses differ). About 15 minutes on one laptop core.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
GOLDEN = HERE / "check_diagnoses.json"


def _paths() -> None:
    for p in (str(TESTS.parent), str(TESTS)):      # tests/ first: its conftest, not the root one
        if p not in sys.path:
            sys.path.insert(0, p)


# --------------------------------------------------------------------------------------
# the ordered lists
# --------------------------------------------------------------------------------------
def orders() -> dict:
    """checker name -> the diagnosis ids it can give, in the order it tries them."""
    from flashattn import check

    return {name: list(ids) for name, ids in check.orders().items()}


# --------------------------------------------------------------------------------------
# the mistakes
# --------------------------------------------------------------------------------------
def variants() -> dict:
    """key -> (checker name, a function that runs the mistake and returns its CheckResult)."""
    _paths()
    import conftest
    import test_check_beyond
    import test_check_code
    import test_check_kernels
    import test_check_slips
    from blind_sets.run import load_set
    from flashattn import check, planted

    tmp = Path(tempfile.mkdtemp(prefix="golden_"))
    checker_of = {"01": "attention_backward", "02p": "rebuild_p", "02o": "online_softmax", "03": "dq_kernel",
                  "04": "dkdv_kernel", "05": "autograd_function", "07": "lazy_backward", "09m": "window_mask",
                  "09b": "beyond_backward", "11m": "merge_partials", "11r": "ring_backward"}
    out: dict = {}

    def edited(exercise, edits):
        def run():
            module = conftest.solution(tmp, exercise[:2] if exercise[:2] in ("09", "11") else exercise, edits)
            return conftest.SOLUTION_CHECKS[exercise](module)
        return checker_of[exercise], run

    for name in sorted(p.stem[4:] for p in (TESTS / "blind_sets").glob("set_*.py")):
        for v in load_set(name):
            out[f"blind/{name}/{v['id']}"] = edited(v["exercise"], [tuple(e) for e in v["edits"]])

    for name, entry in planted.CATALOG.items():
        if entry.kernel_name not in ("attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"):
            continue
        dq = entry.kernel_name == "attn_bwd_dq_kernel"

        def run(name=name, dq=dq):
            with planted.plant(name):
                if dq:
                    return conftest.run_checker(check.dq_kernel, test_check_kernels.launch_dq_direct)
                return conftest.run_checker(check.dkdv_kernel, test_check_kernels.launch_dkdv_direct)
        out[f"planted/{name}"] = ("dq_kernel" if dq else "dkdv_kernel", run)

    def add(key, variant):          # the n-th edit expecting the same diagnosis: key#n
        n = 1
        while (key if n == 1 else f"{key}#{n}") in out:
            n += 1
        out[key if n == 1 else f"{key}#{n}"] = variant

    for table in (test_check_slips.EDITS, test_check_code.EDITS):
        for exercise, old, new, hint, _ in table:
            add(f"slips/{exercise}/{hint}", edited(exercise, (old, new)))

    def lesson09(old, new, fn, checker):
        def run():
            return conftest.run_checker(getattr(check, checker), test_check_beyond.solution(old, new)[fn])
        return checker, run

    for old, new, hint in test_check_beyond.WINDOW_SLIPS:
        for fn, checker in (("visible_mask", "window_mask"), ("packed_backward", "beyond_backward")):
            add(f"beyond/{checker}/{hint}", lesson09(old, new, fn, checker))
    for old, new, hint in test_check_beyond.BACKWARD_SLIPS:
        add(f"beyond/beyond_backward/{hint}", lesson09(old, new, "packed_backward", "beyond_backward"))
    return out


def examples() -> dict:
    """key -> (checker name, a function that runs it): the tests' own planted functions, launchers
    and kernels that prove the diagnoses no edit of a worked solution triggers (``example/...``).
    Not part of the record: test_check.py's test_every_diagnosis_is_proven runs them (and every
    mistake's proof) through :func:`first_diagnosis`."""
    _paths()
    import torch

    import conftest
    import test_check as tc
    import test_check_kernels as tk
    import test_check_slips as ts
    import test_lazy as tl
    from flashattn import check, planted

    out: dict = {}

    def add(checker, label, make, **kw):
        out[f"example/{checker}/{label}"] = (checker, lambda: conftest.run_checker(getattr(check, checker), make(), **kw))

    for bug in ("delta_rowsum_dp", "delta_scalar", "ds_diagonal", "dk_plus_k", "dq_plus_q", "dp_scaled", "race",
                "mask_hides_diagonal", "nan"):
        add("attention_backward", f"make_backward({bug})", lambda bug=bug: tc.make_backward(bug))
    for bug in ("lengths_mixed", "some_cases", "mask_three_ahead", "dv_mixed_rows"):
        add("attention_backward", f"make_backward_lse({bug})", lambda bug=bug: tc.make_backward_lse(bug))
    for name in ("overcounted_backward", "later_blocks_off", "wrong_for_strided_inputs", "unwritten_backward"):
        add("attention_backward", name, lambda name=name: getattr(tc, name))
    for bug in ("exp2_lse", "p_sign", "mask_always"):
        add("rebuild_p", f"make_rebuild_p({bug})", lambda bug=bug: tc.make_rebuild_p(bug))
    add("rebuild_p", "make_rebuild_p_lse(plus_inf)", lambda: tc.make_rebuild_p_lse("plus_inf"))
    for bug in ("rescale", "lse_output", "online_exp2", "online_scale_in_p"):
        add("online_softmax", f"make_online({bug})", lambda bug=bug: tc.make_online(bug))
    for bug in ("lse_no_mask", "kv_swapped"):
        add("autograd_function", f"make_function({bug})", lambda bug=bug: tc.make_function(bug), gqa=False)
    add("autograd_function", "make_function(do_strided_only)", lambda: tc.make_function("do_strided_only"))
    add("autograd_function", "autograd_without_kernels", tc.autograd_without_kernels, gqa=False)
    for bug in ("ds_from_da", "no_gate"):
        add("lazy_backward", f"_lazy({bug})", lambda bug=bug: tc._lazy(bug))
    for bug in ("dK without transpose", "ungated dtau"):
        add("lazy_backward", f"_one_head_backward({bug})",
            lambda bug=bug: lambda *a: tl._one_head_backward(*a, bug=bug))
    add("window_mask", "_window_off_at_the_corner", lambda: tc._window_off_at_the_corner)
    add("dq_kernel", "launch_dq_lengths_swapped", lambda: tk.launch_dq_lengths_swapped)
    add("dq_kernel", "launch_dq_rows_rounded_down", lambda: tk.launch_dq_rows_rounded_down)
    add("dq_kernel", "launch_dq_grid_over_kv_heads", lambda: tk.launch_dq_grid_over_kv_heads, gqa=True)
    add("dkdv_kernel", "launch_dkdv_in_pytorch", lambda: tk.launch_dkdv_in_pytorch)
    add("dkdv_kernel", "launch_dkdv_direct(grid over query heads)",
        lambda: lambda *a: tk.launch_dkdv_direct(*a, grid_heads="query"), gqa=True, dtype=torch.float32)

    def planted_gqa(name, checker, launch):
        def run():
            with planted.plant(name):
                return conftest.run_checker(getattr(check, checker), launch, gqa=True)
        out[f"example/{checker}/planted {name} (GQA)"] = (checker, run)

    planted_gqa("dkdv.gqa_first_head_only", "dkdv_kernel", tk.launch_dkdv_direct)
    planted_gqa("dq.kv_offset_with_h", "dq_kernel", tk.launch_dq_gqa)
    tmp = Path(tempfile.mkdtemp(prefix="golden_"))
    kept = [("ctx.save_for_backward(q, k, v, o, lse)", "ctx.save_for_backward(q, k, v, lse)\n        ctx.o = o"),
            ("q, k, v, o, lse = ctx.saved_tensors", "q, k, v, lse, = ctx.saved_tensors\n        o = ctx.o")]
    out["example/autograd_function/o kept on ctx"] = (
        "autograd_function", lambda: conftest.SOLUTION_CHECKS["05"](ts._load(tmp, "05", kept)))
    return out


_VARIANTS: dict = {}


def all_variants() -> dict:
    """The recorded variants and the tests' examples, by key (built once per process)."""
    if not _VARIANTS:
        _VARIANTS.update(variants())
        _VARIANTS.update(examples())
    return _VARIANTS


def first_diagnosis(key: str) -> str:
    """Run the mistake ``key`` as the tests run it; its first diagnosis (``PASS``, ``ERROR``)."""
    return diagnosis(key)[0]


def diagnosis(key: str) -> tuple:
    """(first diagnosis, the diagnosis text the learner reads) of the mistake ``key``."""
    _paths()
    import torch

    from flashattn import runtime

    _, run = all_variants()[key]
    torch.manual_seed(0)
    try:
        with runtime.poisoned_outputs():
            result = run()
    except Exception as e:        # noqa: BLE001 -- an edit that no longer applies
        return "ERROR", f"{type(e).__name__}: {e}"
    return (result.hint_ids or ["PASS"])[0], result.summary() + "\n" + result.diagnosis()


def _diagnoses(keys: list, workers: int) -> dict:
    if workers <= 1:
        found = {}
        for n, key in enumerate(keys, 1):
            t0 = time.time()
            found[key] = diagnosis(key)
            print(f"{n:4d}/{len(keys)} {key:70s} {found[key][0]:28s} {time.time() - t0:5.1f}s", flush=True)
        return found
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
        found = dict(zip(keys, pool.map(diagnosis, keys, chunksize=4)))
    return found


def compute(workers: int = 1, only: str = "", texts: str = "", checkers: tuple = ()) -> dict:
    """The record; ``texts``: also write every diagnosis's full text there (JSON, key -> text);
    ``checkers``: only the variants those checkers run."""
    _paths()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    keys = sorted(k for k, (checker, _) in variants().items()
                  if k.startswith(only) and (not checkers or checker in checkers))
    found = _diagnoses(keys, workers)
    if texts:
        Path(texts).write_text(json.dumps({k: v[1] for k, v in found.items()}, indent=1, sort_keys=True) + "\n")
    return {"orders": orders(), "first": {k: v[0] for k, v in found.items()}}


def differences(old: dict, new: dict) -> list:
    """Lines naming every entry of ``new`` that differs from ``old``."""
    out = []
    for name in sorted(set(old["orders"]) | set(new["orders"])):
        before, after = old["orders"].get(name) or [], new["orders"].get(name) or []
        if before != after:
            added = [f"+{m} (at {after.index(m) + 1})" for m in after if m not in before]
            gone = [f"-{m}" for m in before if m not in after]
            moved = "" if added or gone else "; the same mistakes in another order"
            out.append(f"order of {name}: {', '.join(added + gone)}{moved}")
    for key in sorted(set(old["first"]) | set(new["first"])):
        if old["first"].get(key) != new["first"].get(key):
            out.append(f"{key}: {old['first'].get(key)} -> {new['first'].get(key)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=1, help="processes (each imports flashattn once)")
    ap.add_argument("--only", default="", help="only the keys starting with this (with --check)")
    ap.add_argument("--check", action="store_true", help="compare with the record, write nothing")
    ap.add_argument("--texts", default="", help="also write every diagnosis's full text to this JSON file "
                    "(not part of the record: compare two such files to see a move change no word)")
    ap.add_argument("--checkers", default="", help="comma-separated checker names: recompute only the variants "
                    "they run and keep the others' entries (a change that touches only these checkers)")
    args = ap.parse_args(argv)
    t0 = time.time()
    checkers = tuple(filter(None, args.checkers.split(",")))
    new = compute(args.workers, args.only, args.texts, checkers)
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"orders": {}, "first": {}}
    if checkers:            # the other checkers' entries stand as recorded
        known = variants()
        new["first"] = {**{k: v for k, v in old["first"].items() if k in known and known[k][0] not in checkers},
                        **new["first"]}
    if args.only:
        old = {"orders": old["orders"], "first": {k: v for k, v in old["first"].items() if k.startswith(args.only)}}
    changed = differences(old, new)
    print(f"{len(new['first'])} mistakes, {len(new['orders'])} checkers, {time.time() - t0:.0f} s; "
          f"{len(changed)} entries differ from {GOLDEN.name}" + (":" if changed else ""))
    for line in changed:
        print("  " + line)
    if args.check:
        return 1 if changed else 0
    if args.only:
        print("(--only computes part of the record: not written)")
        return 0
    GOLDEN.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
