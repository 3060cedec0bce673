"""Where the code under test came from: a notebook cell, a file (which one?), an installed copy.

Editing a copy that Python does not import is a classic way to lose an afternoon (the lab's
bug 2): the checkers say where your function and the kernels it launches were defined, and
warn about a same-named file elsewhere in the project, a file changed since it was imported, or
an installed copy shadowing your checkout. Paths are shown relative to the project (or the
working directory), never as this machine's absolute paths.
"""
from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import sysconfig
from pathlib import Path

import torch

#: flashattn/ and Python's standard library: code there is not the learner's
PACKAGE = Path(__file__).resolve().parent.parent
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()      # inspect.py binding a call's arguments, say


def unwrap(fn):
    for _ in range(5):
        if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
            fn = fn.backward
        elif hasattr(fn, "func") and not hasattr(fn, "__code__"):      # functools.partial
            fn = fn.func
        elif hasattr(fn, "__func__"):                                  # bound method
            fn = fn.__func__
        elif _is_kernel(fn):
            fn = fn.fn
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            break
    return fn


def _is_kernel(obj) -> bool:
    return (hasattr(obj, "fn") and callable(getattr(obj, "fn")) and hasattr(obj, "__getitem__")
            and hasattr(obj, "run"))


def kernels_used(fn) -> list:
    fn = unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    glb = getattr(fn, "__globals__", {})
    out = []
    names = set(code.co_names)
    for const in code.co_consts:             # nested functions (a launcher's run(cfg) closure)
        if inspect.iscode(const):
            names |= set(const.co_names)
    for name in sorted(names):
        obj = glb.get(name)
        if _is_kernel(obj):
            out.append((name, obj))
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            obj = cell.cell_contents
        except ValueError:          # an empty cell
            continue
        if _is_kernel(obj):
            out.append((name, obj))
    return out


def learner_sources(fn) -> list:
    """The source of ``fn``, of the Triton kernels it launches and of the autograd.Function
    classes it calls, for the diagnoses that read the code (flashattn's own code left out)."""
    f = unwrap(fn)
    found = [f] + [k.fn for _, k in kernels_used(fn)]
    glb, code = getattr(f, "__globals__", {}), getattr(f, "__code__", None)
    for name in (code.co_names if code is not None else ()):
        obj = glb.get(name)
        if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
            found.append(obj)
        elif inspect.isfunction(obj) and obj is not f and _learners_own(obj):
            found.append(obj)         # a helper of the learner's (sequence_backward beside packed_backward)
    out = []
    for obj in found:
        for part in _parts(obj):
            try:
                path = Path(inspect.getsourcefile(part) or "").resolve()
                if PACKAGE in path.parents:
                    continue
                text = inspect.getsource(part)
            except (OSError, TypeError):
                continue
            if text not in out:
                out.append(text)
    return out


def _learners_own(fn) -> bool:
    """Whether a plain function was written by the learner: not this package's, not a library's."""
    try:
        return is_learners_file(inspect.getsourcefile(fn) or "")
    except TypeError:
        return False


def is_learners_file(path: str) -> bool:
    """Whether code at ``path`` is the learner's own: a notebook cell, or a file outside this
    package, Python's standard library and the installed libraries."""
    if in_notebook(path):
        return True
    p = Path(path).resolve()
    return not (PACKAGE in p.parents or _STDLIB in p.parents or path.startswith("<frozen")
                or "site-packages" in p.parts or "dist-packages" in p.parts)


def _parts(obj) -> list:
    """What to read the source of: a function itself; a class whole -- or, where Python cannot
    find a class's source (one defined in a notebook cell or a module not in sys.modules), each
    of its methods, whose code objects still say where they came from."""
    if not isinstance(obj, type):
        return [obj]
    try:
        inspect.getsource(obj)
        return [obj]
    except (OSError, TypeError):
        return [getattr(m, "__func__", m) for m in vars(obj).values()
                if inspect.isfunction(getattr(m, "__func__", m))]


def in_notebook(path: str) -> bool:
    return ("ipykernel_" in path or path.startswith("<ipython-input") or
            (path.startswith("<") and path.endswith(">")))


def error_frames(exc: BaseException) -> list:
    """[(frame, lineno)] of an exception's traceback, outermost first -- continued into the
    error it wraps when Triton's interpreter re-raised it at the launch (InterpreterError): the
    kernel line that failed is in the wrapped error's traceback, not the launch's."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            out.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        exc = exc.__cause__ if type(exc).__name__ == "InterpreterError" else None
    return out


def learners_frame(exc: BaseException):
    """(frame, lineno) of the innermost frame of the learner's own code (a notebook cell, else a
    file outside this package and the installed libraries), or None."""
    found = None
    for frame, lineno in error_frames(exc):
        if is_learners_file(frame.f_code.co_filename):
            found = (frame, lineno)
    return found


def _project_root(start: Path) -> Path:
    for p in [start, *start.parents]:
        if (p / ".git").exists() or (p / "pyproject.toml").exists() or (p / "setup.py").exists():
            return p
    return start


def _same_name_elsewhere(path: Path, limit: int = 4000) -> list:
    """Other files named like ``path`` in the project around the working directory and in the
    project the file itself belongs to."""
    roots = []
    for start in (Path.cwd().resolve(), path.resolve().parent):
        root = _project_root(start)
        if root not in roots:
            roots.append(root)
    skip = {".git", ".venv", "venv", "node_modules", "__pycache__", "site-packages",
            ".ipynb_checkpoints", ".pytest_cache", "build", "dist"}
    found, seen = [], 0
    target = path.name
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
            if dirpath[len(str(root)):].count(os.sep) >= 4:
                dirnames[:] = []
            seen += len(filenames)
            if target in filenames:
                p = (Path(dirpath) / target).resolve()
                if p != path.resolve() and p not in found:
                    found.append(p)
            if seen > limit:
                break
    return found


def _code_matches(code, fresh) -> bool:
    if code.co_code != fresh.co_code or code.co_names != fresh.co_names:
        return False
    a = [c for c in code.co_consts if not inspect.iscode(c)]
    b = [c for c in fresh.co_consts if not inspect.iscode(c)]
    return a == b


def _stale(fn, path: Path, kernel=None) -> bool:
    """True if the file on disk no longer holds the code that is running."""
    try:
        text = path.read_text()
    except OSError:
        return False
    if kernel is not None and hasattr(kernel, "src"):
        return kernel.src.strip() not in text
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    try:
        module_code = compile(text, str(path), "exec")
    except SyntaxError:
        return True
    stack = [module_code]
    while stack:
        c = stack.pop()
        if c.co_name == code.co_name and _code_matches(code, c):
            return False
        stack += [k for k in c.co_consts if inspect.iscode(k)]
    return True


def shown_path(path) -> str:
    """``path`` as a reader should see it: relative to the working directory or to the project
    it belongs to, with a ``~`` for the home directory, else just its name."""
    p = Path(path).resolve()
    for base in (Path.cwd().resolve(), _project_root(p.parent)):
        for root in (base, base.parent):
            try:
                return p.relative_to(root).as_posix()
            except ValueError:
                continue
    try:
        return "~/" + p.relative_to(Path.home().resolve()).as_posix()
    except (ValueError, RuntimeError):
        return p.name


def describe_origin(fn, role: str = "your function") -> tuple[list, list]:
    """Lines saying where ``fn`` (and the Triton kernels it launches) came from, and warnings
    when that is probably not the copy you are editing."""
    lines, warnings = [], []
    items = [(role, fn, None)] + [("kernel", k.fn, k) for _, k in kernels_used(fn)]
    for label, f, kernel in items:
        f = unwrap(f)
        name = getattr(f, "__qualname__", getattr(f, "__name__", repr(f)))
        try:
            path = inspect.getsourcefile(f) or f.__code__.co_filename
        except (TypeError, AttributeError):
            lines.append(f"{label} `{name}`: defined in C or unknown")
            continue
        if in_notebook(path):
            lines.append(f"{label} `{name}`: defined in a notebook cell (edited it? re-run that cell first)")
            continue
        p = Path(path).resolve()
        mod = sys.modules.get(getattr(f, "__module__", ""), None)
        mod_file = getattr(mod, "__file__", None)
        lines.append(f"{label} `{name}`: from {shown_path(p)}" +
                     (f" (module {f.__module__})" if mod_file else ""))
        if PACKAGE in p.parents:
            warnings.append(f"{label} `{name}` is flashattn's own implementation ({p.name}), not yours.")
            continue
        if "site-packages" in p.parts or "dist-packages" in p.parts:
            warnings.append(f"{label} `{name}` comes from an installed copy ({shown_path(p)}): edits to "
                            "your checkout will not be seen (pip install -e . installs it editable).")
        if _stale(f, p, kernel):
            warnings.append(f"{shown_path(p)} has changed since it was imported: the code running is the old "
                            "one. Restart the kernel or importlib.reload() the module "
                            f"({getattr(f, '__module__', '?')}), then re-run.")
        others = _same_name_elsewhere(p)
        if others:
            listed = ", ".join(shown_path(o) for o in others[:3])
            warnings.append(f"another file named {p.name} exists: {listed}. Python imported {shown_path(p)} "
                            "(print(module.__file__) to see it); make sure that is the one you edit.")
    return lines, warnings


# --------------------------------------------------------------------------------------
# the learner's line that raised, and its variables (for the exceptions' ideas)
# --------------------------------------------------------------------------------------
def raising_line(exc: BaseException):
    """(frame, line number, the line's text, the names on it) of the line of the learner's code
    that raised -- the innermost frame outside this package and the installed libraries -- or
    None. The frame's variables say what the error's sizes belong to, instead of a guess."""
    found = learners_frame(exc)
    if found is None:
        return None
    f, lineno = found
    line = linecache.getline(f.f_code.co_filename, lineno)
    return f, lineno, line, list(dict.fromkeys(re.findall(r"(?<![.\w])([A-Za-z_]\w*)", line)))


def line_tensors(exc: BaseException) -> dict:
    """name -> tensor, for the tensors named on the learner's line that raised."""
    found = raising_line(exc)
    if found is None:
        return {}
    f, _, _, names = found
    return {n: f.f_locals[n] for n in names if isinstance(f.f_locals.get(n), torch.Tensor)}


def line_shapes(exc: BaseException) -> dict:
    return {n: tuple(t.shape) for n, t in line_tensors(exc).items()}


def tile_shapes(exc: BaseException) -> dict:
    """name -> shape of the Triton tiles named on the kernel line that raised (the interpreter
    runs the kernel as Python, so its frame holds them), e.g. {'q': (32, 16), 'k': (32, 16)}."""
    found = raising_line(exc)
    if found is None:
        return {}
    f, _, _, names = found
    out = {}
    for n in names:
        value = f.f_locals.get(n)
        shape = getattr(value, "shape", None)     # a tuple of constexpr (Triton's own tuple type)
        if value is None or isinstance(value, torch.Tensor) or not shape:
            continue
        try:
            out[n] = tuple(int(getattr(d, "value", d)) for d in shape)
        except (TypeError, ValueError):
            continue
    return out


def made_by(exc: BaseException, names) -> dict:
    """name -> the line of the learner's function that last assigned it before the line that
    raised (where a wrong shape was made, often a line or two above where it is used)."""
    found = raising_line(exc)
    if found is None:
        return {}
    f, lineno, _, _ = found
    path, first = f.f_code.co_filename, f.f_code.co_firstlineno
    out = {}
    for name in names:
        target = re.compile(rf"^\s*(?:[\w\s,\[\]]*,\s*)?{re.escape(name)}\s*(?:,[\w\s,\[\]]*)?=(?!=)")
        for n in range(lineno - 1, first - 1, -1):
            line = linecache.getline(path, n)
            if target.match(line):
                out[name] = line.split("#")[0].strip()
                break
    return out
