"""Compile the Hopper kernels for sm_90 without a GPU, and read what ptxas made of them.

``python -m flashattn.hopper.offline`` (under triton 3.6, the release the kernels were written
for) compiles every variant -- fp16/bf16, D = 64/128, causal or not, ``forward.VARIANTS`` (ws, ws2,
pingpong, inline) -- through Gluon's own ``GluonASTSource`` and ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``,
then prints per variant: registers per thread, spills (ptxas -v on the PTX), shared memory, and
whether ptxas serialised any wgmma (its "Potential Performance Loss" warning). No driver is needed:
compilation is the front end, LLVM and ptxas. On a machine without a GPU run it as
``TRITON_INTERPRET=0 python -m flashattn.hopper.offline``: there ``import flashattn`` switches Triton's
interpreter on, and a kernel made under it cannot be compiled (its ``gl.max`` is an interpreted function).
``--backward`` compiles the fused backward's variants instead (``backward.VARIANTS``), ``--only``
picks variants by the words of their names (``--only bf16 D64 full``).
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile

VARIANTS = list(itertools.product(("fp16", "bf16"), (64, 128), (False, True), ("ws", "ws2", "pingpong", "inline")))


def compile_variant(dtype: str, head_dim: int, causal: bool, variant: str):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import forward as fwd

    gdt = {"fp16": fwd.gl.float16, "bf16": fwd.gl.bfloat16}[dtype]
    warp_specialize, consumers, pingpong, num_warps = fwd.VARIANTS[variant]
    shapes = fwd.block_shapes(head_dim, consumers)
    BLOCK_M, BLOCK_N, STAGES = fwd.TILES[head_dim]

    def desc(block):
        layout = fwd.gl.NVMMASharedLayout.get_default_for(block, gdt)
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"

    constants = dict(CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim, STAGES=STAGES,
                     WARP_SPECIALIZE=warp_specialize, CONSUMERS=consumers, PINGPONG=pingpong, NUM_WARPS=num_warps,
                     PRODUCER_REGS=fwd.PRODUCER_REGS, CONSUMER_REGS=fwd.CONSUMER_REGS)
    signature = dict(q_desc=desc(shapes["q"]), k_desc=desc(shapes["kv"]), v_desc=desc(shapes["kv"]),
                     o_desc=desc(shapes["o"]), LSE="*fp32", H="i32", GROUP_SIZE="i32", S_q="i32", S_k="i32",
                     qk_scale="fp32", **{name: "constexpr" for name in constants})
    src = GluonASTSource(fwd.hopper_fwd_kernel, signature, constexprs=constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def compile_backward(dtype: str, head_dim: int, causal: bool, variant: str = "inline", dq_mode: str = "atomics"):
    """The Gluon backward (``backward.hopper_bwd_kernel``) for sm_90, as ``compile_variant``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import backward as bwd

    gdt = {"fp16": bwd.gl.float16, "bf16": bwd.gl.bfloat16}[dtype]
    shapes = bwd.block_shapes(head_dim)
    BLOCK_M, BLOCK_N = bwd.TILES[head_dim]
    warp_specialize, prefetch, dq_lag, stages = bwd.VARIANTS[variant]

    def desc(block, element=dtype, gl_element=gdt):
        layout = bwd.gl.NVMMASharedLayout.get_default_for(block, gl_element)
        return f"tensordesc<{element}[{', '.join(map(str, block))}],{layout!r}>"

    rows = desc(shapes["rows"], "fp32", bwd.gl.float32) if prefetch == 2 else "*fp32"
    constants = dict(CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim, STAGES=stages,
                     NUM_WARPS=bwd.NUM_WARPS, WARP_SPECIALIZE=warp_specialize, PRODUCER_REGS=bwd.PRODUCER_REGS,
                     DQ=bwd.DQ_MODES[dq_mode], PREFETCH=prefetch, DQ_LAG=dq_lag)
    ints = ("stride_dk_b", "stride_dk_h", "stride_dk_s", "stride_dv_b", "stride_dv_h", "stride_dv_s",
            "H", "GROUP_SIZE", "S_q", "S_k")
    signature = dict(q_desc=desc(shapes["q"]), k_desc=desc(shapes["kv"]), v_desc=desc(shapes["kv"]),
                     do_desc=desc(shapes["q"]), LSE="*fp32", DELTA="*fp32", LSE_DESC=rows, DELTA_DESC=rows, DQ_ACC="*fp32", DK=f"*{dtype}",
                     DV=f"*{dtype}", **{n: "i32" for n in ints}, scale="fp32", qk_scale="fp32",
                     **{name: "constexpr" for name in constants})
    src = GluonASTSource(bwd.hopper_bwd_kernel, signature, constexprs=constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": bwd.NUM_WARPS})


class _TargetOnly:
    """A stand-in for Triton's CUDA driver that knows only the target: enough for the JIT's
    binder and compile (``warmup``), nothing that launches."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def check_launcher(causal=True, variant="ws", D=128, dtype="bf16"):
    """The launcher's own path through the JIT, without a GPU: ``launch_args`` on CPU tensors (the
    descriptors only read addresses, shapes, strides) and ``warmup``, which binds the arguments as a
    launch would -- descriptors, constexprs, specialisation -- and compiles. Returns the kernel."""
    import torch
    from triton.runtime import driver

    from . import forward as fwd

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    q = torch.randn(2, 4, 333, D, dtype=torch_dtype).transpose(1, 2).contiguous().transpose(1, 2)
    k, v = (torch.randn(2, 2, 517, D, dtype=torch_dtype) for _ in range(2))
    grid, args, options, o, lse = fwd.launch_args(q, k, v, causal, D ** -0.5, variant)
    before = driver._active          # (reading driver.active would make the real one: no GPU, no driver)
    driver.set_active(_TargetOnly())
    try:
        return fwd.hopper_fwd_kernel.warmup(*args, grid=grid, **options)
    finally:
        driver._active = before


def check_backward_launcher(causal=True, variant="tma3", D=128, dtype="bf16"):
    """``check_launcher`` for the backward: ``backward.launch_args`` (its descriptors, the flat LSE
    and delta ones too) bound by ``warmup`` and compiled, GQA and odd lengths. Returns the kernel."""
    import torch
    from triton.runtime import driver

    from . import backward as bwd

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    q, do = (torch.randn(2, 4, 333, D, dtype=torch_dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 517, D, dtype=torch_dtype) for _ in range(2))
    lse, delta = (torch.randn(2, 4, 333) for _ in range(2))
    grid, args, options, *_ = bwd.launch_args(q, k, v, do, lse, delta, causal, D ** -0.5, variant)
    before = driver._active
    driver.set_active(_TargetOnly())
    try:
        return bwd.hopper_bwd_kernel.warmup(*args, grid=grid, **options)
    finally:
        driver._active = before


def ptxas_report(ptx: str) -> dict:
    """ptxas -v of the PTX for sm_90a: registers, spill stores/loads, stack, serialised wgmma."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(90)
    ptxas = getattr(tool, "path", tool)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    grab = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else None
    return dict(registers=grab(r"Used (\d+) registers"), spill_stores=grab(r"(\d+) bytes spill stores"),
                spill_loads=grab(r"(\d+) bytes spill loads"), stack=grab(r"(\d+) bytes stack frame"),
                wgmma_serialized="wgmma.mma_async instructions are serialized" in text,
                warnings=[line.strip() for line in text.splitlines() if "warning" in line.lower()])


def _compiled(cases, compile_one, only: list, prefix: str, clip):
    """(name, compiled kernel) for each (dtype, D, causal, variant) whose name holds every word of
    ``only``; a variant that fails to compile is reported (its error clipped by ``clip``) and skipped."""
    for dtype, D, causal, variant in cases:
        name = f"{prefix}{dtype} D{D} {'causal' if causal else 'full'} {variant}"
        if not all(word in name.split() for word in only):
            continue
        try:
            kernel = compile_one(dtype, D, causal, variant)
        except Exception as exc:   # noqa: BLE001 -- report every variant
            print(f"{name:34} FAILED: {type(exc).__name__}: {clip(str(exc))}")
            continue
        yield name, kernel


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", help="folder to write each variant's TTGIR and PTX into")
    parser.add_argument("--only", nargs="*", default=[], help="variants whose name holds all these words "
                        "(fp16 D128 causal ws)")
    parser.add_argument("--launcher", action="store_true", help="also bind and compile through the launcher "
                        "(launch_args + warmup, a stand-in driver)")
    parser.add_argument("--backward", action="store_true", help="compile the Gluon backward instead")
    args = parser.parse_args(argv)
    from .. import runtime
    if runtime.INTERPRET:
        parser.error("Triton's interpreter is on (TRITON_INTERPRET=1, or set by flashattn on a machine without a "
                     "GPU), and kernels made under it do not compile: run it as TRITON_INTERPRET=0 python -m "
                     "flashattn.hopper.offline")
    if args.backward:
        from . import backward as bwd
        if args.launcher:
            for variant in bwd.VARIANTS:
                k = check_backward_launcher(variant=variant)
                print(f"launcher: launch_args + warmup bound and compiled the backward's {variant} (bf16 D128 causal, "
                      f"GQA 2, S_q 333, S_k 517): {k.metadata.num_warps} warps, {k.metadata.shared / 1024:.1f} KB shared")
        cases = itertools.product(("fp16", "bf16"), (64, 128), (False, True), tuple(bwd.VARIANTS))
        for name, k in _compiled(cases, compile_backward, args.only, "bwd ", lambda text: text[:1500]):
            rep = ptxas_report(k.asm["ptx"])
            print(f"{name:34} regs {rep['registers']} spill {rep['spill_stores']}/{rep['spill_loads']} "
                  f"smem {k.metadata.shared / 1024:.1f} KB wgmma serialized {rep['wgmma_serialized']}")
            for w in rep["warnings"]:
                print("    ptxas:", w[:200])
            _dump(args.dump, name, k)
        return
    if args.launcher:
        k = check_launcher()
        print(f"launcher: launch_args + warmup bound and compiled {k.name} (bf16 D128 causal ws, [B, S, H, D] q): "
              f"{k.metadata.num_warps} warps, {k.metadata.shared / 1024:.1f} KB shared")
    print(f"{'variant':34} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem KB':>7} {'setmaxnreg':>10} "
          f"{'wgmma':>5} serialized")
    for name, k in _compiled(VARIANTS, compile_variant, args.only, "", lambda text: text.splitlines()[0][:200]):
        ptx = k.asm["ptx"]
        rep = ptxas_report(ptx)
        setmax = sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)))
        n_wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
        print(f"{name:34} {rep['registers']!s:>4} {rep['spill_stores']!s:>5}/{rep['spill_loads']!s:<5} "
              f"{rep['stack']!s:>5} {k.metadata.shared / 1024:7.1f} {' '.join(f'{d}{n}' for d, n in setmax) or '-':>10} "
              f"{n_wgmma:>5} {rep['wgmma_serialized']}")
        for w in rep["warnings"]:
            print("    ptxas:", w[:200])
        _dump(args.dump, name, k)


def _dump(folder, name: str, kernel) -> None:
    """A compiled variant's TTGIR and PTX into ``folder`` (``--dump``), if one was named."""
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, name.strip().replace(" ", "_"))
    for ext in ("ttgir", "ptx"):
        with open(f"{stem}.{ext}", "w") as f:
            f.write(kernel.asm[ext])


if __name__ == "__main__":
    main()
