"""Runtime policy: interpreter switch, NumPy-proof interpreter, dtypes, poisoned outputs."""
import inspect
import os

import numpy as np
import pytest
import torch

import flashattn
from flashattn import runtime

from conftest import DEVICE, ON_GPU


def test_interpreter_matches_device():
    assert runtime.INTERPRET == (os.environ.get("TRITON_INTERPRET") == "1")
    assert ON_GPU == torch.cuda.is_available() or runtime.INTERPRET


@pytest.mark.parametrize("head_dim, block", [(8, 16), (16, 16), (24, 32), (64, 64), (72, 128), (256, 256)])
def test_head_dim_padding(head_dim, block):
    assert runtime.head_dim_block(head_dim) == block


def test_poisoned_outputs_start_as_nan():
    with runtime.poisoned_outputs():
        assert torch.isnan(runtime.new_output((3, 4), torch.float32, "cpu")).all()


def test_device_summary_says_something():
    assert "triton" in flashattn.device_summary()
    assert flashattn.where() == flashattn.device_summary()      # the old name still works


class _Handle:
    def __init__(self, data):
        self.data = data


class _Scalar:
    def __init__(self, data):
        self.handle = _Handle(data)


@pytest.mark.parametrize("data", [np.array([7]), np.array(7), np.array([[7]])])
def test_scalar_index_works_with_every_numpy(data):
    # NumPy 2.4 refuses int(np.array([7])); the interpreter's scalars are shaped (1,) or ().
    assert runtime._index_of_scalar(_Scalar(data)) == 7


def test_old_interpreter_index_gets_wrapped(monkeypatch):
    """Triton 3.2-3.6 convert with int(self.handle.data): the package wraps that function so
    every interpreted launch gets the NumPy-proof __index__ (CI also runs triton 3.7.1)."""
    from triton.runtime import interpreter

    class FakeTensor:
        pass

    def _patch_lang_tensor(tensor):      # the shape of triton 3.2-3.5's function
        tensor.__index__ = lambda self: int(self.handle.data)

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", _patch_lang_tensor)
    assert runtime._make_interpreter_index_numpy_proof()
    interpreter._patch_lang_tensor(FakeTensor)
    assert FakeTensor.__index__(_Scalar(np.array([5]))) == 5
    assert not runtime._make_interpreter_index_numpy_proof()       # wrapped once only


def test_current_interpreter_is_left_alone():
    from triton.runtime import interpreter

    fn = getattr(interpreter, "_patch_lang_tensor", None)
    if fn is not None and "int(self.handle.data)" in inspect.getsource(inspect.unwrap(fn)):
        pytest.skip("this Triton's interpreter needs the wrap (triton < 3.7)")
    assert not runtime._make_interpreter_index_numpy_proof()


def test_bf16_fallback_runs_in_fp32_with_a_warning():
    if not runtime.INTERPRET and runtime._bf16_dot_supported(flashattn.default_device()):
        assert runtime.compute_dtype(torch.bfloat16, flashattn.default_device()) == torch.bfloat16
        return
    with pytest.warns(flashattn.BF16FallbackWarning):
        assert runtime.compute_dtype(torch.bfloat16, flashattn.default_device()) == torch.float32


def test_next_power_of_2_is_tritons():
    """The launch path's bit arithmetic (bucket, padded head dims, the backward's tail) gives
    Triton's answer."""
    import triton

    ns = list(range(1, 300)) + [1023, 1024, 1025, 2 ** 20 - 1, 2 ** 20, 2 ** 20 + 1]
    assert [runtime.next_power_of_2(n) for n in ns] == [triton.next_power_of_2(n) for n in ns]


_TRITON_FIRST = """
import torch, triton, triton.language as tl   # triton before flashattn, as many scripts do
import flashattn
from flashattn import beyond, lazy_attention
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64) for _ in range(3))
o = flashattn.flash_attention(q, k, v, causal=True)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
assert (o - ref).abs().max() < 1e-10, (o - ref).abs().max()
o = beyond.flash_attention(q, k, v, causal=True, window=(5, 0))
o = lazy_attention(q, k, v, torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
print("ok")
"""


@pytest.mark.skipif(not runtime.INTERPRET, reason="the interpreter is switched on only without a GPU")
def test_kernels_run_when_triton_was_imported_first():
    """`import torch, triton, flashattn`: triton.language's own @jit helpers (tl.zeros, tl.max...)
    were made compiled before flashattn switched the interpreter on; runtime wraps them, else every
    kernel fails with "Cannot call @triton.jit'd outside of the scope of a kernel" (issue 42: a
    wheel install tried from a script that imported triton first)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _TRITON_FIRST], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_lesson_fp32_products_on_hopper_are_exact_where_tf32x3_miscompiles(monkeypatch):
    """fp32 lesson products: tf32x3 on TF32 GPUs, exact on Hopper at head dims that are not a
    multiple of 16 (Triton 3.6 miscompiled tf32x3 there: battery seed 8, problems 80 and 370)."""
    monkeypatch.setattr(runtime, "INTERPRET", False)
    for capability, head_dim, expected in (((9, 0), 72, "ieee"), ((9, 0), 120, "ieee"), ((9, 0), 24, "ieee"),
                                           ((9, 0), 64, "tf32x3"), ((9, 0), 96, "tf32x3"), ((9, 0), None, "tf32x3"),
                                           ((8, 0), 72, "tf32x3"), ((10, 0), 72, "tf32x3"), ((7, 5), 64, "ieee")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        assert runtime.dot_precision(torch.float32, head_dim) == expected, (capability, head_dim)
        assert runtime.dot_precision(torch.float16, head_dim) == "tf32"


def test_every_lesson_style_launcher_passes_its_head_dim(monkeypatch):
    """The rule above needs the head dim: the lesson kernels (forward, dQ, dK/dV), lesson 09's and
    lazy attention's launchers each pass theirs (D = 24 here)."""
    import flashattn
    from flashattn import beyond, lazy

    seen = []
    real = runtime.dot_precision
    monkeypatch.setattr(runtime, "dot_precision", lambda dtype, head_dim=None: seen.append(head_dim) or real(dtype, head_dim))
    q, k, v = (torch.randn(1, 2, 17, 24, device=DEVICE, requires_grad=True) for _ in range(3))
    flashattn.flash_attention(q, k, v, causal=True, impl="teaching").sum().backward()
    assert seen == [24] * 3, seen                                       # forward, dQ, dK/dV
    seen.clear()
    beyond.flash_attention(q, k, v, window=(4, 0), impl="teaching").sum().backward()
    assert seen and set(seen) == {24}, seen
    seen.clear()
    bias = torch.zeros(2, 5, device=DEVICE, requires_grad=True)
    tau = torch.zeros(2, device=DEVICE, requires_grad=True)
    lazy.lazy_attention(q, k, v, bias, tau).sum().backward()
    assert len(seen) == 4 and set(seen) == {24}, seen                  # forward, preprocess, dQ, dK/dV
