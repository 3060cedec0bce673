"""Lesson 10's CUDA kernels under ThreadSanitizer and AddressSanitizer, on the CPU emulator.

ThreadSanitizer sees every shared-memory access of every emulated CUDA thread and the barriers
between them: a missing ``__syncthreads()`` or two threads owning one accumulator element is a
data race it reports (the planted race is run as a positive control). AddressSanitizer sees
every read and write of the tensors, allocated here to their exact size. Each test builds the
emulator with the sanitizer and runs it in a child Python that preloads the sanitizer's runtime.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

cuda_emulation = pytest.importorskip("cuda_emulation")
pytestmark = pytest.mark.skipif(cuda_emulation.compiler() is None, reason="g++ is not on PATH")


SANITIZED_RUN = r"""
import math, sys, torch
import cuda_emulation
from flashattn import attention_reference
from flashattn.cuda_appendix import RACE_EDIT, Tiling

torch.manual_seed(0)
for tiling in (Tiling(16, 16, 4), Tiling(64, 16, 8)):
    emu = cuda_emulation.EmulatedKernels(tiling=tiling)
    for (B, H, H_kv, S_q, S_k, D) in ((1, 2, 1, 37, 21, 24), (1, 1, 1, 3, 40, 16)):
        for causal in (False, True):
            q, do = torch.randn(B, H, S_q, D), torch.randn(B, H, S_q, D)   # exact sizes: no slack
            k, v = torch.randn(B, H_kv, S_k, D), torch.randn(B, H_kv, S_k, D)
            ref = attention_reference(q, k, v, do, causal=causal)
            o, lse = emu.forward(q, k, v, causal)
            delta = emu.delta(o, do)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            emu.launch_dq(q, k, v, do, lse, delta, dq, causal, 1 / math.sqrt(D))
            emu.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, 1 / math.sqrt(D))
            for a, e in ((o, ref.O), (dq, ref.dQ), (dk, ref.dK), (dv, ref.dV)):
                assert float((a.double() - e).norm() / e.norm()) < 1e-5
print("REAL KERNELS DONE", file=sys.stderr, flush=True)
if sys.argv[1] == "thread":       # the planted race must be reported: the check is not blind
    race = cuda_emulation.EmulatedKernels([RACE_EDIT], tiling=Tiling(32, 32, 4))
    q, k, v, do = (torch.randn(1, 1, 40, 16) for _ in range(4))
    race.launch_dkdv(q, k, v, do, torch.randn(1, 1, 40), torch.randn(1, 1, 40), torch.empty_like(k),
                     torch.empty_like(v), False, 0.25)
"""


@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_the_kernels_are_clean_under_thread_and_address_sanitizers(sanitizer, tmp_path):
    """ThreadSanitizer: no two threads of a block touch the same shared-memory element without a
    __syncthreads() between them (and it does see the planted race). AddressSanitizer: no read
    or write outside the tensors, on inputs allocated to their exact size."""
    runtime = subprocess.run([cuda_emulation.compiler(), f"-print-file-name=lib{sanitizer[0]}san.so"],
                             capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(runtime):
        pytest.skip(f"lib{sanitizer[0]}san.so is not installed")
    script = tmp_path / "run.py"
    script.write_text(SANITIZED_RUN)
    # The emulation is CPU code: the GPU stays out of the sanitized process (the CUDA driver maps
    # memory AddressSanitizer refuses to shadow), which also puts flashattn in its interpreter mode.
    env = dict(os.environ, LD_PRELOAD=runtime, FLASHATTN_EMULATION_SANITIZE=sanitizer, CUDA_VISIBLE_DEVICES="",
               ASAN_OPTIONS="detect_leaks=0", TSAN_OPTIONS="report_signal_unsafe=0",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(script), sanitizer], env=env, capture_output=True, text=True)
    real, _, planted = r.stderr.partition("REAL KERNELS DONE")
    assert _ and "Sanitizer" not in real, real[-4000:]
    if sanitizer == "thread":
        assert "ThreadSanitizer: data race" in planted, planted[-2000:]
    else:
        assert r.returncode == 0, r.stderr[-4000:]
