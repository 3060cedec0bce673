"""Lesson 10's CUDA kernels without a GPU: the source compiles, the planted edits apply, the
module imports anywhere, and bad input is named before anything is built.

CI has ``nvcc``: the kernels (real, and every planted variant) are compiled for sm_80 and sm_90
(syntax and types; nothing runs), and the torch binding that ``load_inline`` adds is compiled
with the host compiler against torch's headers. What the kernels *compute* is tested on the CPU
in test_cuda_emulated.py; on a GPU, ``python -m flashattn.cuda_appendix --selftest``.
"""
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from flashattn import cuda_appendix as ca
from flashattn.cuda_appendix import RACE_EDIT, Edit, Tiling

NVCC = shutil.which("nvcc")
GXX = shutil.which("g++")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (the CUDA toolkit is not "
                                "installed here): the CUDA compile check cannot run")
VARIANTS = {"real": (), "race": (RACE_EDIT,)}


def _nvcc(args, cwd):
    r = subprocess.run([NVCC, "-std=c++17", *args], capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0, f"nvcc {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nvcc_compiles_the_kernels_and_every_planted_variant(tmp_path, arch, variant):
    # exactly the translation unit the GPU build hands to nvcc (attention.h inlined, edits applied)
    cu = tmp_path / f"attention_{variant}.cu"
    cu.write_text(ca.cuda_source(VARIANTS[variant]))
    _nvcc([f"-arch={arch}", "-Xcompiler", "-Wall", "-c", cu.name, "-o", "kernels.o"], tmp_path)


@needs_nvcc
def test_nvcc_compiles_attention_cu_as_it_is_in_the_repository(tmp_path):
    _nvcc(["-arch=sm_80", "-c", str(ca.KERNEL_FILE), "-o", str(tmp_path / "a.o")], tmp_path)


def _cuda_include() -> str:
    """The CUDA toolkit's include directory (nvcc may be a wrapper script outside the toolkit)."""
    from torch.utils import cpp_extension

    homes = [cpp_extension.CUDA_HOME, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             str(Path(NVCC).resolve().parent.parent), "/usr/local/cuda"]
    for home in filter(None, homes):
        if (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return str(Path(home) / "include")
    pytest.skip("the CUDA toolkit's include directory (cuda_runtime_api.h) was not found")


@needs_nvcc
@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
def test_the_torch_binding_compiles(tmp_path):
    """main.cpp as load_inline writes it (binding + pybind11 module), compiled for syntax and types."""
    from torch.utils import cpp_extension

    main = tmp_path / "main.cpp"
    main.write_text(ca.binding_source() + "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n" + "\n".join(
        f'm.def("{f}", torch::wrap_pybind_function({f}), "{f}");' for f in ca.FUNCTIONS) + "\n}\n")
    includes = cpp_extension.include_paths() + [_cuda_include()]
    generated = Path(cpp_extension.include_paths()[0]) / "c10/cuda/impl/cuda_cmake_macros.h"
    if not generated.exists():          # a CPU build of torch ships c10/cuda without its config header
        stub = tmp_path / "stub" / "c10/cuda/impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
        includes.append(str(tmp_path / "stub"))
    cmd = [GXX, "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=flashattn_cuda_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", *[f"-I{p}" for p in includes],
           f"-I{sysconfig.get_paths()['include']}", str(main)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-6000:]


# --------------------------------------------------------------------------------------------
# the planted edit, the source, the module: no compiler needed
# --------------------------------------------------------------------------------------------
def test_the_race_is_a_one_line_edit_of_the_dk_loop():
    text = ca.diff([RACE_EDIT])
    changed = [l for l in text.splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert len(changed) == 2
    assert "n += blockDim.y" in changed[0] and "n++" in changed[1] and "rows of dK" in changed[1]
    assert ca.kernel_text().count(ca.DK_LOOP) == 1


def test_an_edit_whose_text_is_gone_fails_loudly():
    with pytest.raises(ValueError, match="Has the kernel changed"):
        ca.cuda_source([Edit("no such line", "x")])


def test_the_translation_unit_inlines_the_header_and_has_no_torch():
    src = ca.cuda_source()
    assert '#include "attention.h"' not in src and "struct View" in src and "#pragma once" not in src
    includes = [l for l in src.splitlines() if l.startswith("#include")]
    assert includes and all("torch" not in l and "ATen" not in l and "c10" not in l for l in includes)


def test_the_package_ships_the_cuda_files():
    text = (Path(ca.__file__).parent.parent / "pyproject.toml").read_text()
    assert '"cuda/*.cu"' in text and '"cuda/*.h"' in text


def test_shared_memory_formula():
    t = Tiling(32, 32, 4)
    # forward at D = 128: Q, O [32, 129] + K, V [32, 129] + S [32, 33] + 3 vectors of 32
    assert ca.smem_bytes("forward", t, 128) == 4 * (4 * 32 * 129 + 32 * 33 + 96)
    assert ca.smem_bytes("dkdv", t, 128) < 227 * 1024          # fits an H100 (and an A100: 163 KB)
    assert ca.default_tiling(64) == Tiling(32, 32, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the CPU-only behaviour")
def test_without_a_gpu_building_says_why():
    assert "GPU" in ca.why_unavailable()
    with pytest.raises(RuntimeError, match="cannot build the CUDA kernels here: no CUDA GPU"):
        ca.build()


def _inputs(B=1, H=2, S_q=8, S_k=8, D=16, H_kv=None, dtype=torch.float32, device="cpu"):
    H_kv = H_kv or H
    q = torch.randn(B, H, S_q, D, dtype=dtype, device=device)
    k = torch.randn(B, H_kv, S_k, D, dtype=dtype, device=device)
    v = torch.randn(B, H_kv, S_k, D, dtype=dtype, device=device)
    do = torch.randn_like(q)
    lse = torch.randn(B, H, S_q, dtype=torch.float32, device=device)
    delta = torch.randn_like(lse)
    return q, k, v, do, lse, delta


def _dkdv(**over):
    q, k, v, do, lse, delta = _inputs()
    args = dict(q=q, k=k, v=v, do=do, lse=lse, delta=delta, dk=torch.empty_like(k),
                dv=torch.empty_like(v), causal=False, scale=0.25)
    args.update(over)
    ca.launch_dkdv(**args)


@pytest.mark.parametrize("over, error, message", [
    (dict(q=torch.randn(1, 2, 8, 16, dtype=torch.float16)), TypeError, "q must be float32"),
    (dict(k=torch.randn(1, 2, 8)), ValueError, "k must be a 4-D tensor"),
    (dict(v=torch.randn(1, 2, 9, 16)), ValueError, r"v must have shape \[1, 2, 8, 16\]"),
    (dict(dk=torch.empty(1, 2, 8, 8)), ValueError, r"dk must have shape \[1, 2, 8, 16\]"),
    (dict(lse=torch.randn(1, 2, 7)), ValueError, r"lse must have shape \[1, 2, 8\]"),
    (dict(delta=torch.randn(1, 2, 8, dtype=torch.float64)), TypeError, "delta must be float32"),
    (dict(do="dO"), TypeError, "do must be a torch.Tensor, got a str"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(scale="0.3"), TypeError, "scale must be a finite float"),
    (dict(q=torch.randn(1, 3, 8, 16), do=torch.randn(1, 3, 8, 16), lse=torch.randn(1, 3, 8),
          delta=torch.randn(1, 3, 8)), ValueError, "not a multiple of H_kv"),
    (dict(), ValueError, "need CUDA tensors, got tensors on cpu"),
])
def test_the_launcher_names_bad_input(over, error, message):
    with pytest.raises(error, match=message):
        _dkdv(**over)


def test_head_dim_over_128_is_refused():
    q, k, v, do, lse, delta = _inputs(D=136)
    with pytest.raises(ValueError, match="head dim D = 136 > 128"):
        ca.launch_dq(q, k, v, do, lse, delta, torch.empty_like(q), True, 0.1)
    with pytest.raises(ValueError, match="head dim"):
        ca.forward(q, k, v, True)
