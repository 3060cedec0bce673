"""Plant a bug in a real kernel by editing one line of its source.

The lessons and the bug-hunt lab show what classic mistakes look like (a causal mask in the
wrong place, dO offset with Q's head stride, ...). Rather than keeping hand-made copies of the
kernels that would drift away from the real ones, a buggy variant is made *from* the real
kernel: take its source, replace one exact piece of text, compile the result as a new kernel.
If the real kernel changes so that the text is no longer there, this fails loudly.

    from flashattn import backward, planted
    edit = planted.Edit("h.to(tl.int64) * stride_do_h", "h.to(tl.int64) * stride_q_h")
    print(planted.diff(backward.attn_bwd_dq_kernel, [edit]))
    with planted.planted_bug(backward, "attn_bwd_dq_kernel", [edit]):
        dq = flashattn.attention_backward_dq(...)   # the launcher now runs the buggy copy
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import inspect
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterable, Sequence

from . import runtime  # noqa: F401  (interpreter decision first)


@dataclass(frozen=True)
class Edit:
    """Replace ``find`` (which must occur exactly ``count`` times) with ``replace``."""

    find: str
    replace: str
    count: int = 1


def kernel_source(kernel) -> str:
    """The source text of a ``@triton.jit`` kernel (or of any function)."""
    fn = getattr(kernel, "fn", kernel)
    return textwrap.dedent(inspect.getsource(fn))


def apply_edits(source: str, edits: Sequence[Edit], name: str = "kernel") -> str:
    for e in edits:
        found = source.count(e.find)
        if found != e.count:
            raise ValueError(f"planting a bug in {name}: expected {e.count} occurrence(s) of "
                             f"{e.find!r}, found {found}. Has the kernel changed?")
        source = source.replace(e.find, e.replace)
    return source


def diff(kernel, edits: Sequence[Edit]) -> str:
    """A unified diff between the real kernel and the planted one."""
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
    before = kernel_source(kernel)
    after = apply_edits(before, edits, name)
    lines = difflib.unified_diff(before.splitlines(), after.splitlines(),
                                 f"{name} (real)", f"{name} (planted bug)", n=1, lineterm="")
    return "\n".join(lines)


_CACHE_DIR = Path(tempfile.gettempdir()) / "flashattn_planted"


def mutated_kernel(kernel, edits: Sequence[Edit]):
    """Compile a copy of ``kernel`` with ``edits`` applied. The copy is written to a real file
    (Triton reads a kernel's source through ``inspect``) and imported with the globals of the
    kernel's own module, so it sees the same ``tl``, ``triton`` and helpers."""
    fn = getattr(kernel, "fn", kernel)
    name = fn.__name__
    source = apply_edits(kernel_source(kernel), edits, name)
    home = sys.modules[fn.__module__]
    header = "import triton\nimport triton.language as tl\n\n"
    text = header + source
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    _CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = _CACHE_DIR / f"{name}_{digest}.py"
    if not path.exists():
        path.write_text(text)
    mod_name = f"flashattn_planted_{name}_{digest}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        # Give the copy everything the original module had (helpers, constants) ...
        module.__dict__.update({k: v for k, v in vars(home).items() if not k.startswith("__")})
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)  # ... then define the mutated kernel in it
    return getattr(sys.modules[mod_name], name)


@contextlib.contextmanager
def planted_bug(module: ModuleType, kernel_name: str, edits: Iterable[Edit]):
    """Inside this block, ``module.<kernel_name>`` is the buggy copy, so the module's own
    launcher runs it. The real kernel is put back on exit, even after an error."""
    real = getattr(module, kernel_name)
    setattr(module, kernel_name, mutated_kernel(real, list(edits)))
    try:
        yield
    finally:
        setattr(module, kernel_name, real)
