"""Lesson 10's CUDA kernels, run on the CPU by the test-only emulator (tests/cuda_emulation.py).

The emulator compiles the very translation unit the GPU build compiles, with g++, and runs each
thread block with one OS thread per CUDA thread and real barriers. So the kernels' logic --
indices, strides, masks, loop bounds, the online softmax, the ownership of every accumulator
element, the barriers -- is checked here against the float64 reference and the course's
checkers. What only a GPU can tell (its scheduling, memory model, limits, speed) is left to
``python -m flashattn.cuda_appendix --selftest``.
"""
import inspect
import json
import math
from pathlib import Path

import pytest
import torch

import flashattn
from flashattn import check, cuda_appendix, cuda_selftest
from flashattn.cuda_appendix import RACE_EDIT, Edit, Tiling
from flashattn.verify import per_head_relative_error

cuda_emulation = pytest.importorskip("cuda_emulation")
pytestmark = pytest.mark.skipif(cuda_emulation.compiler() is None, reason="g++ is not on PATH")
EmulatedKernels = cuda_emulation.EmulatedKernels
#: The checkers' batteries live on flashattn's device: CUDA tensors on a GPU, which the emulator
#: (CPU threads) cannot read. There the real kernels take the same checks (test_the_gpu_selftest_on_the_real_kernels).
cpu_checkers = pytest.mark.skipif(not flashattn.INTERPRET, reason="on a GPU the checkers hand the kernels CUDA tensors, "
                                  "which the CPU emulator cannot read; the real CUDA kernels take the same checks "
                                  "there (test_the_gpu_selftest_on_the_real_kernels)")


def _cuda(checker) -> dict:
    """``kernel_language="cuda"`` where the checker knows it (kernel checkers refuse launchers
    that launch no Triton kernel unless told the kernel is CUDA)."""
    return {"kernel_language": "cuda"} if "kernel_language" in inspect.signature(checker).parameters else {}


def _worst(a, e) -> float:
    return float(per_head_relative_error(a.double(), e.double()).max())


@pytest.mark.parametrize("tiling", [Tiling(16, 16, 4), Tiling(32, 32, 4), Tiling(16, 64, 2), Tiling(64, 16, 8)])
def test_forward_and_backward_match_the_reference(tiling):
    emu = EmulatedKernels(tiling=tiling)
    torch.manual_seed(0)
    for (B, H, H_kv, S_q, S_k, D) in [(2, 2, 2, 37, 37, 16), (1, 4, 2, 20, 45, 24), (1, 2, 1, 50, 23, 40)]:
        q, do = torch.randn(B, H, S_q, D), torch.randn(B, H, S_q, D)
        k, v = torch.randn(B, H_kv, S_k, D), torch.randn(B, H_kv, S_k, D)
        for causal in (False, True):
            ref = flashattn.attention_reference(q, k, v, do, causal=causal)
            o, lse = emu.forward(q, k, v, causal)
            delta = emu.delta(o, do)
            dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
            emu.launch_dq(q, k, v, do, lse, delta, dq, causal, 1 / math.sqrt(D))
            emu.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, 1 / math.sqrt(D))
            for name, a, e in (("O", o, ref.O), ("LSE", lse, ref.LSE), ("delta", delta, ref.delta),
                               ("dQ", dq, ref.dQ), ("dK", dk, ref.dK), ("dV", dv, ref.dV)):
                assert _worst(a, e) < 1e-5, (name, (B, H, H_kv, S_q, S_k, D), causal, _worst(a, e))


def test_head_dim_128_and_strided_inputs():
    emu = EmulatedKernels(tiling=Tiling(32, 32, 4))
    torch.manual_seed(1)
    q = torch.randn(1, 13, 2, 128).transpose(1, 2)                # [B, S, H, D] viewed as [B, H, S, D]
    k = torch.randn(1, 2, 21, 256)[..., ::2]                      # stride_d = 2
    v = torch.randn(1, 4, 21, 128)[:, 1:3]                        # a slice of the heads
    do = torch.randn(()).expand(1, 2, 13, 128)                    # every stride 0
    ref = flashattn.attention_reference(q, k, v, do, causal=True)
    o, lse = emu.forward(q, k, v, True)
    dq, dk, dv = (torch.full(t.shape, float("nan")) for t in (q, k, v))
    delta = emu.delta(o, do)
    emu.launch_dq(q, k, v, do, lse, delta, dq, True, 1 / math.sqrt(128))
    emu.launch_dkdv(q, k, v, do, lse, delta, dk, dv, True, 1 / math.sqrt(128))
    for name, a, e in (("O", o, ref.O), ("dQ", dq, ref.dQ), ("dK", dk, ref.dK), ("dV", dv, ref.dV)):
        assert _worst(a, e) < 1e-5, name


@cpu_checkers
@pytest.mark.parametrize("tiling", [Tiling(16, 16, 4), Tiling(32, 32, 4)])
def test_the_course_checkers_pass(tiling):
    emu = EmulatedKernels(tiling=tiling)

    def launch_dq(q, k, v, do, lse, delta, dq, causal, scale):
        emu.launch_dq(q, k, v, do, lse, delta, dq, causal, scale)

    def launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale):
        emu.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale)

    for checker, launch in ((check.dq_kernel, launch_dq), (check.dkdv_kernel, launch_dkdv)):
        result = checker(launch, dtype=torch.float32, gqa=True, raise_on_fail=False, show=False, **_cuda(checker))
        assert result.ok, result.report()


@cpu_checkers
def test_the_planted_race_overcounts_dk_by_the_block_shape_and_the_checker_names_it():
    torch.manual_seed(2)
    q, k, v, do = (torch.randn(1, 1, 64, 16) for _ in range(4))
    ref = flashattn.attention_reference(q, k, v, do)
    for ty in (1, 2, 4):
        race = EmulatedKernels([RACE_EDIT], tiling=Tiling(32, 32, ty))
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        race.launch_dkdv(q, k, v, do, ref.LSE.float(), ref.delta.float(), dk, dv, False, 0.25)
        assert _worst(dv, ref.dV) < 1e-5                     # dV's loop is untouched
        # row n of every 32-key tile is added by the thread rows y <= n: min(n + 1, ty) times
        rows = (dk.double() * ref.dK).sum(-1) / (ref.dK * ref.dK).sum(-1)
        expected = torch.tensor([min(n % 32 + 1, ty) for n in range(64)], dtype=torch.float64)
        assert (rows[0, 0] - expected).abs().median() < 1e-4, (ty, rows[0, 0])

        def launch(q, k, v, do, lse, delta, dk, dv, causal, scale):
            race.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale)
        result = check.dkdv_kernel(launch, dtype=torch.float32, raise_on_fail=False, show=False,
                                   **_cuda(check.dkdv_kernel))
        if ty == 1:
            assert result.ok, "with one thread row nobody shares a row: the bug hides"
        else:
            assert result.hint_ids in (["overcount"], ["race"]), result.report()


def test_the_emulator_catches_out_of_bounds_tiles_and_divergent_barriers():
    q, k, v, do = (torch.randn(1, 1, 20, 16) for _ in range(4))
    oob = EmulatedKernels([Edit("for (int c = 0; c < BN; ++c) m_new = fmaxf(",
                                "for (int c = 0; c <= BN; ++c) m_new = fmaxf(")])
    with pytest.raises(RuntimeError, match="out of bounds"):
        oob.forward(q, k, v)
    divergent = EmulatedKernels([Edit("        __syncthreads();   // before the next step",
                                      "        if (threadIdx.x == 0) __syncthreads();   // before the next step")])
    with pytest.raises(RuntimeError, match="__syncthreads reached"):
        divergent.forward(q, k, v)


def test_shared_memory_bytes_agree_with_the_carving_in_attention_h():
    emu = EmulatedKernels()
    names = {0: "forward", 2: "dq", 3: "dkdv"}
    for t in (Tiling(32, 32, 4), Tiling(16, 64, 2), Tiling(64, 16, 8), Tiling(7, 9, 1)):
        for D in (8, 40, 64, 127, 128):
            for kernel, name in names.items():
                assert emu.smem_bytes(kernel, t, D) == cuda_appendix.smem_bytes(name, t, D), (t, D, name)


# --------------------------------------------------------------------------------------------
# bug 1 of the lesson is plain PyTorch: the checker names it on any machine
# --------------------------------------------------------------------------------------------
def test_bug1_the_checker_names_the_test_side_bug():
    result = check.attention_backward(cuda_selftest.reference_backward, raise_on_fail=False, show=False)
    assert result.hint_ids == ["no_mask"], result.report()
    assert all(r.ok for r in result.results if not r.case.causal)
    fixed = check.attention_backward(cuda_selftest.reference_backward_fixed, raise_on_fail=False, show=False)
    assert fixed.ok, fixed.report()


def test_the_notebook_shows_the_same_buggy_reference_as_the_selftest():
    nb = json.loads((Path(__file__).parent.parent / "notebooks" / "10_cuda_appendix.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    for fn in (cuda_selftest.manual_backward, cuda_selftest.reference_backward):
        src = inspect.getsource(fn)
        body = src[src.index('"""', src.index('"""') + 3) + 3:]      # the code after the docstring
        assert any(body.strip() in c for c in code), f"the notebook's copy of {fn.__name__} differs"


@cpu_checkers
def test_the_package_launchers_end_to_end_on_an_emulated_binding(monkeypatch):
    """cuda_appendix.Kernels (validation, default tiling, output allocation, the calls into the
    binding) around an emulated extension: everything of the Python side except the device."""
    monkeypatch.setattr(cuda_appendix, "_check_device", lambda *a: None)
    kernels = cuda_appendix.Kernels(cuda_emulation.EmulatedBinding())
    q = torch.randn(2, 27, 3, 24).transpose(1, 2)
    k, v = torch.randn(2, 3, 40, 24), torch.randn(2, 3, 40, 48)[..., ::2]
    do = torch.randn(2, 3, 27, 24)
    for causal in (False, True):
        ref = flashattn.attention_reference(q, k, v, do, causal=causal, scale=0.3)
        o, lse = kernels.forward(q, k, v, causal, 0.3)
        dq, dk, dv = kernels.backward(q, k, v, o, do, lse, causal, 0.3)
        for name, a, e in (("O", o, ref.O), ("LSE", lse, ref.LSE), ("dQ", dq, ref.dQ), ("dK", dk, ref.dK),
                           ("dV", dv, ref.dV)):
            assert _worst(a, e) < 1e-5, (name, causal)
    for checker, launch in ((check.dq_kernel, kernels.launch_dq), (check.dkdv_kernel, kernels.launch_dkdv)):
        result = checker(launch, dtype=torch.float32, raise_on_fail=False, show=False, **_cuda(checker))
        assert result.ok, result.report()



@cpu_checkers
def test_the_gpu_selftest_itself_on_emulated_kernels(monkeypatch, capsys):
    """python -m flashattn.cuda_appendix --selftest, run here with the emulator standing in for
    the GPU build (fewer shapes, no timing): its own logic must hold before anyone runs it on an
    H100."""
    monkeypatch.setattr(cuda_selftest, "DEVICE", "cpu")
    monkeypatch.setattr(cuda_selftest, "CASES", cuda_selftest.CASES[3:5])   # GQA D=128; strided D=72
    monkeypatch.setattr(cuda_appendix, "why_unavailable", lambda: None)
    monkeypatch.setattr(cuda_appendix, "_check_device", lambda *a: None)
    monkeypatch.setattr(cuda_appendix, "build_many", lambda lists, **kw: [
        cuda_appendix.Kernels(cuda_emulation.EmulatedBinding(e), e) for e in lists])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "emulated")
    for name in ("dq_kernel", "dkdv_kernel"):
        real = getattr(check, name)
        if "kernel_language" not in inspect.signature(real).parameters:
            monkeypatch.setattr(check, name, lambda *a, _f=real, kernel_language=None, **kw: _f(*a, **kw))
    assert cuda_selftest.selftest(timing=False)
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.strip().splitlines()[-1].startswith("SELFTEST PASS"), out[-3000:]


@pytest.mark.skipif(cuda_appendix.why_unavailable() is not None,
                    reason=f"the real CUDA kernels cannot be built here: {cuda_appendix.why_unavailable()}")
def test_the_gpu_selftest_on_the_real_kernels(capsys):
    """On a GPU with nvcc: ``python -m flashattn.cuda_appendix --selftest`` itself (no timing): the
    real kernels against the float64 reference, the course's checkers on them, both bugs of the
    lesson named -- what the emulated tests above check on the CPU."""
    assert cuda_selftest.selftest(timing=False)
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.strip().splitlines()[-1].startswith("SELFTEST PASS"), out[-3000:]
