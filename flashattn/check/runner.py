"""Running the learner's code on the battery, and measuring what the diagnosis needs.

Per case: run, compare every output with the float64 reference, run twice where the case says
so (races), and for a failing case look closer -- which fingerprints its outputs match, and,
if NaN was computed, which input's guard it came from (re-running with finite guards, then
with one NaN guard at a time). Kernel checkers also count the kernels the launcher starts.
"""
from __future__ import annotations

import contextlib
import sys
import traceback
import warnings
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .. import runtime
from ..verify import tolerance
from . import fingerprints, structure, substitutions
from .battery import GUARDED, make_inputs
from .engine import diagnose
from .instruments import fence_wild_access, watch_guard_reads
from .errors import DtypeError, ShapeError, Unwritten
from .origin import describe_origin
from .results import CaseResult, CheckFailed, CheckResult, compare


# --------------------------------------------------------------------------------------
# errors of the learner's code
# --------------------------------------------------------------------------------------
def kernel_not_written(launch) -> bool:
    import inspect

    from .origin import kernels_used

    for _, k in kernels_used(launch):
        try:
            src = inspect.getsource(k.fn)
        except (OSError, TypeError):
            continue
        if "raise NotImplementedError" in src:
            return True
    return False


def _not_implemented(e: BaseException) -> Optional[str]:
    """The exercise's placeholder: a NotImplementedError raised by a ``raise NotImplementedError``
    line, possibly wrapped by Triton's interpreter or compiler -- not one that PyTorch raises
    for an operation it lacks (a float tensor &= a bool one). If so, the name of the function
    that raised it ("" where no frame says: where a helper of the learner's is the one left
    unwritten, the diagnosis names it); None if not."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, NotImplementedError):
            frames = traceback.extract_tb(e.__traceback__)
            if not frames:
                return ""
            return frames[-1].name if "NotImplementedError" in (frames[-1].line or "") else None
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _compiled_kernel_line(exc: BaseException) -> str:
    """'the kernel's line 56 -> the line' for Triton's compile errors (a GPU compiles the kernel,
    so no frame of the learner's file runs it): the error carries the kernel's source and the
    node that failed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        src, node = getattr(exc, "src", None), getattr(exc, "node", None)
        if isinstance(src, str) and getattr(node, "lineno", None):
            lines = src.splitlines()
            if 0 < node.lineno <= len(lines):
                return f"the kernel's line {node.lineno} (counted from its def) -> {lines[node.lineno - 1].strip()}"
        exc = exc.__cause__ or exc.__context__
    return ""


def where(exc: BaseException) -> str:
    """'a notebook cell, line 12 -> the line': the innermost frame of the learner's own code (a
    notebook cell, else a file outside this package and the installed libraries) -- inside the
    kernel when the interpreter wrapped a kernel's error."""
    import linecache

    from .origin import in_notebook, learners_frame, shown_path

    compiled = _compiled_kernel_line(exc)
    if compiled:
        return compiled
    found = learners_frame(exc)
    if found is None:
        return ""
    frame, lineno = found
    path = frame.f_code.co_filename
    line = linecache.getline(path, lineno).strip()
    src = f" -> {line}" if line else ""
    place = "a notebook cell" if in_notebook(path) else shown_path(path)
    return f"{place}, line {lineno}{src}"


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))) \
        and bool(torch.equal(torch.isnan(a), torch.isnan(b)))


def swapped_outputs(outs: dict, expected: dict) -> Optional[tuple]:
    """(got, wanted) if an output has the shape of another reference tensor and vice versa."""
    for a, t in outs.items():
        if not isinstance(t, torch.Tensor) or a not in expected or t.shape == expected[a].shape:
            continue
        for b, e in expected.items():
            if b != a and t.shape == e.shape and isinstance(outs.get(b), torch.Tensor) \
                    and outs[b].shape == expected[a].shape:
                return a, b
    return None


@contextlib.contextmanager
def _quiet_and_single_threaded():
    """The battery's tensors are tiny: one CPU thread is faster than a pool (much faster when
    the cores are shared). NaN in the guards makes NumPy (the interpreter) warn: not news."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.simplefilter("ignore", RuntimeWarning)
            yield caught
    finally:
        torch.set_num_threads(before)


def learners_warnings(caught: list) -> list:
    """'message (file, line N: code)' for the distinct warnings raised from the learner's own
    code (a notebook cell or a file outside this package and the installed libraries): the
    checker records them instead of printing one per case, and shows them with a failure."""
    import linecache

    from .origin import in_notebook, is_learners_file, shown_path

    out = []
    for w in caught:
        if not is_learners_file(w.filename):
            continue
        place = "a notebook cell" if in_notebook(w.filename) else shown_path(w.filename)
        line = linecache.getline(w.filename, w.lineno).strip()
        text = f"{w.category.__name__}: {w.message} ({place}, line {w.lineno}{f': {line}' if line else ''})"
        if text not in out:
            out.append(text)
    return out


# --------------------------------------------------------------------------------------
# inputs written in place
# --------------------------------------------------------------------------------------
#: The attributes of a case's inputs that may be handed to the learner's code (every checker
#: passes some of them, or views of them: lazy's heads, autograd's leaves share the storage).
HANDED = ("q", "k", "v", "o", "do", "lse", "delta", "bias", "tau")


def snapshot_inputs(tensors: dict) -> dict:
    """name -> a copy of the elements of each floating-point tensor in ``tensors``: the view
    itself, not its guard or padding (a kernel's own reads of those are another matter)."""
    return {n: t.detach().clone() for n, t in tensors.items()
            if isinstance(t, torch.Tensor) and t.is_floating_point()}


def _restore_layouts(tensors: dict, layouts: dict) -> None:
    """Put back the shape and strides of inputs an in-place view method (transpose_, squeeze_)
    changed, so the checker's own computations with them still work; the change is reported."""
    for name, (shape, stride, offset) in layouts.items():
        if tensors[name].shape != shape or tensors[name].stride() != stride:
            tensors[name].as_strided_(shape, stride, offset)


def inputs_changed(before: dict, tensors: dict) -> dict:
    """name -> (elements changed, elements, uniform factor or None -- or what happened to its shape)
    for each tensor of ``before`` whose elements ``tensors`` no longer hold (NaN where NaN was is
    unchanged)."""
    found = {}
    for name, old in before.items():
        new = tensors[name].detach()
        if new.shape != old.shape:        # transpose_, squeeze_, t_: the caller's tensor reshaped in place
            found[name] = (old.numel(), old.numel(), f"its shape changed from {list(old.shape)} to "
                           f"{list(new.shape)}: an in-place view method (transpose_, t_, squeeze_, "
                           f"unsqueeze_) changes the caller's tensor itself; transpose(...) returns a new view")
            continue
        same = (old == new) | (torch.isnan(old) & torch.isnan(new))
        n = int((~same).sum())
        if n:
            found[name] = (n, old.numel(), _uniform_factor(old, new))
    return found


def _uniform_factor(old, new) -> Optional[float]:
    """f where new = f * old in every element (q.mul_(scale), do.zero_()), else None."""
    a, b = old.to("cpu", torch.float64).flatten(), new.to("cpu", torch.float64).flatten()
    nz = torch.isfinite(a) & (a != 0)
    if not nz.any() or not bool(torch.isfinite(b[nz]).all()):
        return None
    ratio = b[nz] / a[nz]
    f = float(ratio.median())
    rtol = 1e-2 if old.element_size() <= 2 else 1e-4      # the product rounded to the dtype
    fits = bool(((ratio - f).abs() <= rtol * abs(f) + 1e-12).all())
    zeros_kept = bool((b[torch.isfinite(a) & (a == 0)] == 0).all())
    return f if fits and zeros_kept else None


# --------------------------------------------------------------------------------------
# the battery loop
# --------------------------------------------------------------------------------------
def _nan_origin(run_case, case, dtype, device, seed, with_do) -> Optional[list]:
    """Which inputs' NaN guards, read by the code, made its output NaN (None: not a guard)."""
    names = [n for n in GUARDED if with_do or n not in ("do", "delta")]

    def has_nan(guards) -> bool:
        x = make_inputs(case, dtype, device, seed, with_do, guards=guards)
        try:
            outs, _, _ = run_case(case, x)
        except Exception:               # noqa: BLE001 -- only the NaN question matters here
            return False
        return any(isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
                   for t in outs.values())

    if has_nan({n: 0.0 for n in names}):
        return None
    culprits = [n for n in names if has_nan({m: 0.0 for m in names if m != n})]
    return culprits or None


def run_battery(title: str, fn, cases: Sequence, run_case: Callable, *, checker, dtype, seed: int,
                with_do: bool, raise_on_fail: bool = True, show: bool = True,
                role: str = "your function", precheck: Optional[Callable] = None,
                variants: Optional[Callable] = None, make: Callable = make_inputs,
                tol: Optional[float] = None, dtype_given: bool = False) -> CheckResult:
    __tracebackhide__ = True          # IPython: show the learner's cell, not this frame
    origin, origin_warnings = describe_origin(fn, role)
    device = runtime.default_device()
    results, nan_searches = [], 0
    with _quiet_and_single_threaded() as caught:
        not_written = precheck() if precheck else False
        for case in cases:
            res = CaseResult(case)
            results.append(res)
            if not_written:
                res.error = Unwritten("kernel body not written")
                break
            # a case's own dtype (the fp16 case) applies unless the caller asked for one dtype
            case_dtype = dtype if dtype_given else (getattr(case, "dtype", None) or dtype)
            case_tol = tolerance(case_dtype) if tol is None else tol
            x = make(case, case_dtype, device, seed, with_do)
            handed = {n: getattr(x, n, None) for n in HANDED}
            before = snapshot_inputs(handed)
            layouts = {n: (t.shape, t.stride(), t.storage_offset()) for n, t in handed.items()
                       if isinstance(t, torch.Tensor)}
            try:
                watched = {n: getattr(x, n, None) for n in GUARDED}
                with fence_wild_access() as wild, watch_guard_reads(watched) as over_read:
                    outs, expected, extra = run_case(case, x)
                # an input written in place (before the second run, which would differ for it)
                res.inputs_modified = {**inputs_changed(before, handed), **extra.get("inputs_modified", {})} or None
                _restore_layouts(handed, layouts)
                res.oob_reads = sorted(over_read, key=GUARDED.index) or None
                if wild["loads"] or wild["stores"]:
                    res.wild = dict(wild)
                res.launches = extra.get("launches")
                res.launch_args = extra.get("launch_args") or None
                for name, want in extra.get("dtypes", {}).items():
                    got = getattr(outs.get(name), "dtype", None)
                    if got is not None and got != want:
                        raise DtypeError(f"{name} has dtype {got}, expected {want}")
                res.swapped = swapped_outputs(outs, expected)
                if case.repeat and not res.wild:
                    again, _, _ = run_case(case, x)
                    _restore_layouts(handed, layouts)
                    changed = [n for n in outs if not _same_bits(outs[n], again[n])]
                    res.nondeterministic = changed or None
                for name, out in outs.items():
                    try:
                        res.tensors[name] = compare(name, out, expected[name], case_tol,
                                                   extra.get("guard_touched", {}).get(name, 0))
                    except (TypeError, ValueError) as e:
                        raise ShapeError(str(e)) from None
                if not res.ok and variants is not None:
                    res.fingerprints = fingerprints.matching(variants(case, x), res.tensors, case_tol, expected)
                if not res.ok:
                    # the class of mistake, whatever the edit: zeros, equalities, factors, swaps
                    res.structure = structure.facts(case, x, res.tensors, expected, case_tol, checker)
                    res.fingerprints |= substitutions.matching(case, x, checker, res.tensors, case_tol,
                                                               fingerprints._matches, expected)
                if any(not t.ok and fingerprints.overcounted(outs[n], expected[n], case_tol)
                       for n, t in res.tensors.items()):
                    res.fingerprints.add("overcount")
                if any(t.nan_computed for t in res.tensors.values()) and not res.oob_reads and not res.wild \
                        and nan_searches < 2 and make is make_inputs:
                    nan_searches += 1
                    res.nan_from = _nan_origin(run_case, case, case_dtype, device, seed, with_do)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:          # noqa: BLE001 -- report any error of the learner's code
                unwritten_in = _not_implemented(e)
                if unwritten_in is not None:
                    res.error = Unwritten(str(e))
                    res.error.function = unwritten_in
                    break                   # every other case would say the same
                res.error = e
                res.error_where = where(e)
                res.inputs_modified = res.inputs_modified or inputs_changed(before, handed) or None
                res.swapped = getattr(e, "pair", None) or res.swapped
    diagnoses = diagnose(results, checker, fn)
    result = CheckResult(title, results, diagnoses, origin, origin_warnings, learners_warnings(caught))
    if show:
        if result.ok:
            print("\n".join([result.pass_line()] + [f"  WARNING: {w}" for w in origin_warnings]))
        else:
            print(result.failure_text())
        result._shown = True
    sys.modules[__package__].last = result     # check.last: the details at hand after a raise
    if raise_on_fail and not result.ok:
        raise CheckFailed(result.assertion_message())
    return result
