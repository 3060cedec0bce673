"""Shared fixtures: device, dtypes and sizes chosen by where the kernels run.

On the CPU (Triton interpreter) the suite runs small shapes that still cross block
boundaries (blocks are forced to 16 x 16 where it matters); on a GPU the same tests run at
realistic sizes. Every output buffer starts as NaN, so an element a kernel forgets to write
fails the comparison instead of passing by luck.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import zlib
from pathlib import Path


def _host_gpus() -> list:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (without starting CUDA).
    Empty where there is none, or where a GPU is split into MIG instances (left as it is)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    if "MIG" in listing:
        return []
    return [str(i) for i, _ in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def _rotate_gpus_for_xdist_worker() -> None:
    """``pytest -n N`` on a host with several GPUs: worker i sees the GPUs rotated by i, so that its
    first GPU (where torch and Triton run by default) is GPU i mod (GPUs) and the default ``-n auto``
    spreads the suite over every GPU instead of crowding the first; every GPU stays visible (the
    NCCL tests use them all). Only workers ask for the GPUs (the controller and ``-n 0`` leave them)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    gpus = _host_gpus()
    if len(gpus) > 1:
        first = int(worker[2:]) % len(gpus)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[first:] + gpus[:first])


# before torch starts CUDA, hence here, above ``import torch``
_rotate_gpus_for_xdist_worker()

import pytest  # noqa: E402 -- after the GPUs are ordered
import torch  # noqa: E402

import flashattn  # noqa: E402
from flashattn import runtime  # noqa: E402

ON_GPU = not flashattn.INTERPRET
DEVICE = flashattn.default_device()

#: dtypes the kernels run natively here
DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float16, torch.float32, torch.float64]

#: relative error allowed against a float64 (CPU) / float32 (GPU, large) reference, per head
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def setenv(monkeypatch):
    """``setenv(name, value)`` / ``setenv(name)`` (unset): a FLASHATTN_* switch as if the process
    had started with it -- the environment and ``flashattn.settings``, which reads it at import."""
    from flashattn import settings

    def set_(name, value=None):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(settings, "current", settings.read())
    return set_


@pytest.fixture(autouse=True)
def poison_outputs():
    with runtime.poisoned_outputs():
        yield


@pytest.fixture(autouse=True)
def fresh_seed(request):
    # A different seed per test (fresh inputs), reproducible from the test's name.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


class FakeDriver:
    """Stands in for ``triton.runtime.driver`` in the CPU tests of direct launches and plans:
    device 0, stream 1234."""

    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234


def rand(*shape, dtype=torch.float32, layout="contiguous", device=DEVICE):
    """Random [B, H, S, D] tensor in a given memory layout (values are the same kind either way).

    contiguous: plain;  bshd: allocated [B, S, H, D] then transposed (the usual projection
    output);  sliced: every other element of a wider tensor's last dim (non-unit stride);
    padded_heads: a slice of a tensor with extra heads (head stride unlike anyone else's).
    """
    B, H, S, D = shape
    if layout == "contiguous":
        return torch.randn(B, H, S, D, dtype=dtype, device=device)
    if layout == "bshd":
        return torch.randn(B, S, H, D, dtype=dtype, device=device).transpose(1, 2)
    if layout == "sliced":
        return torch.randn(B, H, S, 2 * D, dtype=dtype, device=device)[..., ::2]
    if layout == "padded_heads":
        return torch.randn(B, H + 3, S, D, dtype=dtype, device=device)[:, 1:H + 1]
    raise ValueError(layout)


#: Floor of a head's reference norm in the relative error. Some heads' gradients are exactly 0
#: (one visible key: P = 1, dS = P (dP - delta) = 0): the float64 reference then holds 0 or
#: rounding, a kernel's fp32 (tf32x3) rounding ~1e-7, and their ratio means nothing. Real
#: gradient heads of these random inputs have norms far above 0.1.
HEAD_NORM_FLOOR = 0.1


def per_head_error(actual, expected, floor: float = 0.0):
    return flashattn.verify.per_head_relative_error(actual.detach().double(), expected.detach().double(),
                                                    floor=floor)


def assert_close_per_head(name, actual, expected, tol):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: NaN/inf in output (unwritten elements?)"
    err = per_head_error(actual, expected, HEAD_NORM_FLOOR)
    worst = float(err.max())
    assert worst <= tol, f"{name}: worst head rel err {worst:.2e} > {tol:.0e}; per head:\n{err}"


# flashattn.check results (test_check.py, test_check_kernels.py): run a checker quietly, then
# assert it named exactly the planted bug, or nothing at all.
def run_checker(checker, fn, **kw):
    return checker(fn, raise_on_fail=False, show=False, **kw)


#: The worked solutions whose definitions ``solution`` loads: notebook, the cells' markers, and
#: where a cell's demo starts (cut off: only the definitions are wanted).
NOTEBOOKS = {"01": ("01_attention_backward.ipynb", ("def attention_backward(",), None),
             "02p": ("02_lse_and_online_softmax.ipynb", ("def rebuild_p(",), None),
             "02o": ("02_lse_and_online_softmax.ipynb", ("def online_softmax_forward(",), None),
             "03": ("03_dq_kernel.ipynb", ("def dq_kernel", "def launch_dq"), None),
             "04": ("04_dkdv_kernel.ipynb", ("def dkdv_kernel", "def launch_dkdv"), None),
             "05": ("05_autograd_function.ipynb", ("class FlashAttention(",), None),
             "07": ("07_lazy_attention.ipynb", ("def forward_one_head(", "def lazy_backward_one_head("),
                    "torch.manual_seed(0)"),
             "09": ("09_beyond_the_basics.ipynb", ("def visible_mask(", "def sequence_backward(",
                                                   "def packed_backward("), None),
             "11": ("11_ring_attention.ipynb", ("def merge_partials(", "def ring_backward("), None)}
_HEADER = ("import math\nimport torch\nimport triton\nimport triton.language as tl\nimport flashattn\n"
           "from flashattn.reference import causal_mask\nfrom flashattn.beyond import dropout_mask\n\n")


def solution_code(exercise, edit=None) -> str:
    """The definitions of exercise ``exercise``'s worked solution (its notebook's code cells), with
    ``edit = (old, new)`` (or a list of them) applied; each ``old`` must occur exactly once."""
    name, markers, cut = NOTEBOOKS[exercise]
    nb = json.loads((Path(__file__).parents[1] / "solutions" / name).read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    cells = [c.split(cut)[0] if cut else c for c in cells if any(m in c for m in markers)]
    code = "\n\n".join(cells)
    for old, new in ([edit] if isinstance(edit, tuple) else edit or []):
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    return code


def solution(tmp_path, exercise, edit=None):
    """``solution_code`` as a module (a file: triton.jit reads a kernel's source). ``exercise`` is a
    notebook's key: "09" and "11" hold two checkers' functions each (their EDITS say "09m", "11r")."""
    code = solution_code(exercise, edit)
    path = tmp_path / f"solution_{exercise}_{abs(hash(code))}.py"
    path.write_text(_HEADER + code)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checks():
    from flashattn import check
    return {
        "01": lambda m, **kw: run_checker(check.attention_backward, m.attention_backward, **kw),
        "02p": lambda m, **kw: run_checker(check.rebuild_p, m.rebuild_p, **kw),
        "02o": lambda m, **kw: run_checker(check.online_softmax, m.online_softmax_forward, **kw),
        "03": lambda m, **kw: run_checker(check.dq_kernel, m.launch_dq, gqa=True, **kw),
        "04": lambda m, **kw: run_checker(check.dkdv_kernel, m.launch_dkdv, gqa=True, **kw),
        "05": lambda m, **kw: run_checker(check.autograd_function, m.my_flash_attention, **kw),
        "07": lambda m, **kw: run_checker(check.lazy_backward, m.lazy_backward_one_head, **kw),
        "09m": lambda m, **kw: run_checker(check.window_mask, m.visible_mask, **kw),
        "09b": lambda m, **kw: run_checker(check.beyond_backward, m.packed_backward, **kw),
        "11m": lambda m, **kw: run_checker(check.merge_partials, m.merge_partials, **kw),
        "11r": lambda m, **kw: run_checker(check.ring_backward, m.ring_backward, **kw),
    }


#: exercise -> its checker run on a loaded solution module (``solution``): the call each exercise
#: notebook makes, with raise_on_fail and show off
SOLUTION_CHECKS = _checks()


def assert_hint(result, hint):
    assert not result.ok, "the planted bug went unnoticed:\n" + result.report()
    assert result.hint_ids == [hint], f"expected [{hint}], got {result.hint_ids}\n" + result.report()


def assert_clean(result):
    assert result.ok and result.hint_ids == [], result.report()


def reference(q, k, v, do=None, *, causal=False, scale=None):
    """High-precision oracle: the float64 materialised reference, computed one batch element and
    one K/V head (with its GQA group of query heads) at a time, so that realistic sizes fit."""
    H, H_kv = q.shape[1], k.shape[1]
    G = H // H_kv
    fields = ["O", "LSE"] + ([] if do is None else ["delta", "dQ", "dK", "dV"])
    per_q_head = {"O", "LSE", "delta", "dQ"}
    rows = []
    for b in range(q.shape[0]):
        parts = {f: [] for f in fields}
        for j in range(H_kv):
            qs = slice(j * G, (j + 1) * G)
            r = flashattn.attention_reference(q[b:b + 1, qs], k[b:b + 1, j:j + 1], v[b:b + 1, j:j + 1],
                                              None if do is None else do[b:b + 1, qs],
                                              causal=causal, scale=scale)
            for f in fields:
                parts[f].append(getattr(r, f))
            del r
        rows.append({f: torch.cat(parts[f], dim=1) for f in fields})
    out = {f: torch.cat([r[f] for r in rows]) for f in fields}
    assert all(out[f].shape[1] == (H if f in per_q_head else H_kv) for f in fields)
    return out

def pytest_xdist_auto_num_workers(config):
    """``-n auto``: every core on the CPU; on a GPU two workers share the card (the
    realistic-size tests hold a float64 reference of several GB each)."""
    import os

    return 2 if torch.cuda.is_available() else max(1, os.cpu_count() or 1)
