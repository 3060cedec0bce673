"""Lesson 10's CUDA kernels on a GPU, checked in one command, and their timing.

    python -m flashattn.cuda_appendix --selftest [--no-timing] [--json results/cuda_appendix.json]

builds the real kernels and the planted race (in parallel), checks forward, dQ, dK and dV
against the float64 reference head by head (causal and not, odd lengths, S_q != S_k, GQA,
D up to 128, strided inputs and a stride-0 dO, several tilings), runs the course's checkers on
the kernels and on both bugs of the lesson, times the CUDA kernels next to the Triton teaching
kernels and SDPA, and ends with one line: ``SELFTEST PASS`` or ``SELFTEST FAIL: <what>``.

Also here: the two functions of the lesson's first bug (the CUDA log, retold in lab 08), and :func:`benchmark`.
"""
from __future__ import annotations

import argparse
import json
import math
import time
import zlib
from typing import Optional, Sequence

import torch

from .reference import attention_reference, causal_mask

#: Where the self-test puts its tensors (the tests run its logic on the CPU, on emulated kernels).
DEVICE = "cuda"


# --------------------------------------------------------------------------------------------
# Lesson 10, bug 1 (the CUDA log, retold in lab 08): the kernel was right, the test's reference was not. The helper
# takes P, but its first line recomputes P without the causal mask (shadowing the argument);
# the caller passes P and LSE in the wrong order, which that shadowing hid. The notebook's
# exercise cell holds the same code (a test keeps the two equal).
# --------------------------------------------------------------------------------------------
def manual_backward(do, q, k, v, o, lse, P, scale):
    """The test's oracle: the explicit backward of lesson 01, from the forward's P."""
    P = torch.softmax((q @ k.mT) * scale, dim=-1)    # left from a first version
    dV = P.mT @ do
    dP = do @ v.mT
    delta = (do * o).sum(dim=-1, keepdim=True)
    dS = P * (dP - delta)
    return (dS @ k) * scale, (dS.mT @ q) * scale, dV


def reference_backward(q, k, v, o, do, lse, causal, scale):
    """What the test compared the kernel with (the checker calls it with these arguments)."""
    S = (q @ k.mT) * scale
    if causal:
        S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))
    P = torch.exp(S - lse[..., None])                # P rebuilt from the forward's LSE
    return manual_backward(do, q, k, v, o, P, lse, scale)


def manual_backward_fixed(do, q, k, v, o, lse, P, scale):
    dV = P.mT @ do
    dP = do @ v.mT
    delta = (do * o).sum(dim=-1, keepdim=True)
    dS = P * (dP - delta)
    return (dS @ k) * scale, (dS.mT @ q) * scale, dV


def reference_backward_fixed(q, k, v, o, do, lse, causal, scale):
    S = (q @ k.mT) * scale
    if causal:
        S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))
    P = torch.exp(S - lse[..., None])
    return manual_backward_fixed(do, q, k, v, o, lse, P, scale)


# --------------------------------------------------------------------------------------------
# correctness against the float64 reference
# --------------------------------------------------------------------------------------------
#: (name, B, H, H_kv, S_q, S_k, D, layouts of q/k/v, layout of dO)
CASES = (
    ("odd lengths", 2, 3, 3, 37, 37, 16, ("contiguous",) * 3, "contiguous"),
    ("S_q > S_k", 1, 2, 2, 50, 23, 64, ("contiguous",) * 3, "contiguous"),
    ("S_q < S_k", 1, 2, 2, 23, 50, 32, ("contiguous",) * 3, "contiguous"),
    ("GQA 4/2, D=128", 1, 4, 2, 77, 77, 128, ("contiguous",) * 3, "contiguous"),
    ("D=72, strided", 1, 3, 3, 40, 61, 72, ("bshd", "sliced", "padded_heads"), "stride0"),
    ("garbage tails", 1, 2, 1, 45, 33, 40, ("padded_seq",) * 3, "sliced"),
    ("one key, one row", 1, 1, 1, 1, 1, 8, ("contiguous",) * 3, "contiguous"),
)


def _inputs(case, seed: int = 0):
    from .check.battery import make_input
    name, B, H, H_kv, S_q, S_k, D, layouts, do_layout = case
    gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    dev = torch.device(DEVICE)
    q = make_input((B, H, S_q, D), layouts[0], torch.float32, dev, gen)
    k = make_input((B, H_kv, S_k, D), layouts[1], torch.float32, dev, gen)
    v = make_input((B, H_kv, S_k, D), layouts[2], torch.float32, dev, gen)
    do = make_input((B, H, S_q, D), do_layout, torch.float32, dev, gen)
    return q, k, v, do


def check_reference(kernels, tilings: Sequence, cases=None, show: bool = True):
    """Forward, dQ, dK, dV of ``kernels`` against the float64 reference, per head. Returns the
    list of :class:`flashattn.verify.Comparison` rows (each named case/causal/tiling/tensor)."""
    from .verify import compare
    cases = CASES if cases is None else cases
    rows = []
    for case in cases:
        q, k, v, do = _inputs(case)
        for causal in (False, True):
            ref = attention_reference(q, k, v, do, causal=causal)
            for t in tilings:
                o, lse = kernels.forward(q, k, v, causal, tiling=t)
                dq, dk, dv = kernels.backward(q, k, v, o, do, lse, causal, tiling=t)
                tag = f"{case[0]}, {'causal' if causal else 'full'}, {t.block_m}x{t.block_n}/{t.threads_y}"
                for n, a, e in (("O", o, ref.O), ("LSE", lse, ref.LSE), ("dQ", dq, ref.dQ),
                                ("dK", dk, ref.dK), ("dV", dv, ref.dV)):
                    # floor: with one key, P = 1 and dS = P (dP - delta) = 0, so dQ and dK are
                    # exactly 0 and the reference holds only rounding (~1e-17): measure errors
                    # against at least 1e-2 (every other head's norm is far above it)
                    rows.append(compare(f"{tag}: {n}", a, e, tol=1e-4, floor=1e-2))
    if show:
        bad = [r for r in rows if not r.ok]
        worst = max(rows, key=lambda r: r.worst_rel)
        print(f"{len(rows)} comparisons with the float64 reference ({len(cases)} shapes x causal or "
              f"not x {len(tilings)} tilings x O, LSE, dQ, dK, dV): worst head rel err "
              f"{worst.worst_rel:.1e} ({worst.name}); {len(bad)} over 1e-4")
        for r in bad[:10]:
            print(f"  FAIL {r.name}: worst head rel err {r.worst_rel:.2e}")
    return rows


def race_factors(kernels, threads_y=(1, 2, 4, 8), S: int = 256, D: int = 64):
    """dK of ``kernels`` (the planted race) divided by the reference's, by thread-block shape:
    {threads_y: (least-squares factor, min, max of the elementwise ratio, bit-identical reruns)}."""
    from .cuda_appendix import Tiling
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q, k, v, do = (torch.randn(1, 2, S, D, device=DEVICE, generator=gen) for _ in range(4))
    ref = attention_reference(q, k, v, do)
    out = {}
    for ty in threads_y:
        runs = []
        for _ in range(2):
            dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
            kernels.launch_dkdv(q, k, v, do, ref.LSE.float(), ref.delta.float(), dk, dv, False,
                                1 / math.sqrt(D), tiling=Tiling(32, 32, ty))
            runs.append(dk)
        e = ref.dK
        r = runs[0].double() / e
        big = e.abs() > 1e-3 * e.abs().max()
        factor = float((runs[0].double() * e).sum() / (e * e).sum())
        out[ty] = (factor, float(r[big].min()), float(r[big].max()), bool(torch.equal(*runs)))
    return out


# --------------------------------------------------------------------------------------------
# timing: CUDA (this lesson) vs the Triton teaching kernels vs SDPA
# --------------------------------------------------------------------------------------------
PROVIDERS = ("CUDA, lesson 10", "Triton, lessons 03-04", "SDPA")


def benchmark(sizes=((4, 8, 2048, 64),), causal=(False, True), kernels=None, show: bool = True):
    """Median time (ms, triton.testing.do_bench) of the forward and of the backward (delta + dQ +
    dK/dV; SDPA: its autograd backward), fp32 inputs for every provider. One dict per row."""
    import triton.testing
    import flashattn
    from .cuda_appendix import build
    from .verify import sdpa

    kernels = kernels or build()
    rows = []
    for (B, H, S, D) in sizes:
        for c in causal:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(B, H, S, D, device="cuda", generator=gen) for _ in range(4))
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = sdpa(qg, kg, vg, causal=c)
            o, lse = kernels.forward(q, k, v, c)
            o_t, lse_t = flashattn.attention_forward(q, k, v, c)
            fns = {
                PROVIDERS[0]: (lambda: kernels.forward(q, k, v, c),
                               lambda: kernels.backward(q, k, v, o, do, lse, c)),
                PROVIDERS[1]: (lambda: flashattn.attention_forward(q, k, v, c),
                               lambda: flashattn.attention_backward(q, k, v, o_t, do, lse_t, c)),
                PROVIDERS[2]: (lambda: sdpa(q, k, v, causal=c),
                               lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)),
            }
            flops = 4 * B * H * S * S * D * (0.5 if c else 1.0)
            for name, (fwd, bwd) in fns.items():
                ms_f = triton.testing.do_bench(fwd, return_mode="median")
                ms_b = triton.testing.do_bench(bwd, return_mode="median")
                rows.append(dict(provider=name, B=B, H=H, S=S, D=D, causal=c, forward_ms=ms_f,
                                 backward_ms=ms_b, forward_tflops=flops / ms_f * 1e-9,
                                 backward_tflops=2.5 * flops / ms_b * 1e-9))
    if show:
        print(format_timings(rows))
    return rows


def format_timings(rows) -> str:
    head = f"{'shape (B, H, S, D)':<20}{'causal':<8}{'provider':<23}{'fwd ms':>9}{'TFLOP/s':>9}{'bwd ms':>9}{'TFLOP/s':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = f"{r['B']}, {r['H']}, {r['S']}, {r['D']}"
        lines.append(f"{shape:<20}{'yes' if r['causal'] else 'no':<8}{r['provider']:<23}"
                     f"{r['forward_ms']:>9.3f}{r['forward_tflops']:>9.2f}"
                     f"{r['backward_ms']:>9.3f}{r['backward_tflops']:>9.2f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the self-test
# --------------------------------------------------------------------------------------------
def selftest(timing: bool = True, json_path: Optional[str] = None) -> bool:
    """Every check of lesson 10 on this GPU; prints a report and a last line SELFTEST PASS/FAIL."""
    import traceback

    from . import check, cuda_appendix
    from .cuda_appendix import RACE_EDIT, Tiling

    t0 = time.time()
    failures, found = [], {}

    def verdict(ok: bool, what: str) -> None:
        print(("  ok    " if ok else "  FAIL  ") + what)
        if not ok:
            failures.append(what)

    def cuda(checker, launch, **kw):
        return checker(launch, kernel_language="cuda", dtype=torch.float32, raise_on_fail=False, **kw)

    def build():
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
        found["real"], found["race"] = cuda_appendix.build_many([(), (RACE_EDIT,)])
        print(f"   built in {time.time() - t0:.0f} s; default tiling at D=64: "
              f"{cuda_appendix.default_tiling(64, torch.device(DEVICE))}")
        for kernel, name in ((0, "forward"), (2, "dq"), (3, "dkdv")):
            for t, D in ((Tiling(32, 32, 4), 128), (Tiling(16, 64, 2), 40)):
                verdict(found["real"].module.smem_bytes(kernel, [t.block_m, t.block_n, t.threads_y], D)
                        == cuda_appendix.smem_bytes(name, t, D),
                        f"shared memory of {name} at {t}, D={D}: C++ carving == Python formula")

    def reference():
        rows = check_reference(found["real"], (Tiling(32, 32, 4), Tiling(16, 64, 2), Tiling(64, 16, 8)))
        found["comparisons"] = len(rows)
        found["over_tolerance"] = [(r.name, r.worst_rel) for r in rows if not r.ok][:40]
        verdict(all(r.ok for r in rows), "every comparison within 1e-4 (worst head)")

    def checkers():
        real = found["real"]
        verdict(cuda(check.dq_kernel, real.launch_dq, gqa=True).ok, "check.dq_kernel passes")
        verdict(cuda(check.dkdv_kernel, real.launch_dkdv, gqa=True).ok,
                "check.dkdv_kernel passes (two runs bit-identical)")

    def bug1():
        real = found["real"]
        q, k, v, do = (torch.randn(1, 1, 4, 4, device=DEVICE) for _ in range(4))
        o, lse = real.forward(q, k, v, True)
        row0 = float(real.backward(q, k, v, o, do, lse, True)[0][0, 0, 0].abs().max())
        bad0 = float(reference_backward(q, k, v, o, do, lse, True, 0.5)[0][0, 0, 0].abs().max())
        verdict(row0 < 1e-6 < bad0, f"causal: the kernel's dQ row 0 is zero ({row0:.1e}), the buggy "
                f"reference's is not ({bad0:.1e})")
        r = check.attention_backward(reference_backward, raise_on_fail=False, show=False)
        verdict(r.hint_ids == ["no_mask"], f"the checker names the buggy reference: {r.hint_ids}")
        r = check.attention_backward(reference_backward_fixed, raise_on_fail=False, show=False)
        verdict(r.ok, "the fixed reference passes")

    def bug2():
        race = found["race"]
        found["factors"] = factors = race_factors(race)
        for ty, (f, lo, hi, same) in factors.items():
            print(f"   blockDim.y = {ty}: dK / reference = {f:.3f} (elementwise {lo:.3f} .. {hi:.3f}), "
                  f"two runs {'bit-identical' if same else 'differ'}")
        verdict(abs(factors[1][0] - 1) < 1e-4, "blockDim.y = 1 hides the bug (one thread row, no sharing)")
        grows = [factors[ty][0] for ty in (1, 2, 4, 8)]
        verdict(all(1.05 < factors[ty][0] <= ty + 1e-3 for ty in (2, 4, 8)) and grows == sorted(grows),
                "blockDim.y = 2, 4, 8: dK too large by a factor above 1, at most blockDim.y, growing with it")

        def race_launch(q, k, v, do, lse, delta, dk, dv, causal, scale):
            race.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, tiling=Tiling(32, 32, 4))
        r = cuda(check.dkdv_kernel, race_launch, show=False)
        found["race_hint"] = r.hint_ids[0] if r.hint_ids else "none"
        verdict(not r.ok and found["race_hint"] in ("overcount", "race"),
                f"the checker names the race: {found['race_hint']}")
        verdict(cuda(check.dkdv_kernel, found["real"].launch_dkdv, show=False).ok,
                "with unique indices (the real kernel) it passes")

    def timings():
        found["timings"] = rows = benchmark(kernels=found["real"])
        verdict(all(math.isfinite(r["forward_ms"]) and math.isfinite(r["backward_ms"]) for r in rows),
                "every provider timed")

    reason = cuda_appendix.why_unavailable()
    if reason:
        print(f"SELFTEST FAIL: {reason}")
        return False
    steps = [("1. building the real kernels and the planted race (in parallel; ~1 min the first time)", build),
             ("2. forward, dQ, dK, dV vs the float64 reference, per head", reference),
             ("3. the course's checkers on the CUDA kernels (fp32, GQA cases included)", checkers),
             ("4. bug 1 (the CUDA log, retold in lab 08): the test's reference, not the kernel", bug1),
             ("5. bug 2 (the CUDA log, retold in lab 08): several threads add into the same dK rows", bug2)]
    if timing:
        steps.append(("6. timing (median of triton.testing.do_bench, fp32 inputs everywhere)", timings))
    for title, step in steps:
        print(title)
        try:
            step()
        except Exception as e:      # noqa: BLE001 -- report it and go on to the verdict
            traceback.print_exc()
            verdict(False, f"{title.split(' ', 1)[1]}: raised {type(e).__name__}: {e}")
            if step is build:
                break
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d"), "timings": found.get("timings", []),
                       "race_factors": {str(k): v for k, v in found.get("factors", {}).items()},
                       "over_tolerance": found.get("over_tolerance", []),
                       "failures": failures}, f, indent=1)
        print(f"   wrote {json_path}")
    took = time.time() - t0
    if failures:
        print(f"SELFTEST FAIL ({took:.0f} s): " + "; ".join(failures))
        return False
    print(f"SELFTEST PASS ({took:.0f} s): CUDA forward/dQ/dK/dV match the float64 reference in "
          f"{found['comparisons']} comparisons, the checkers pass, bug 1 is named 'causal', bug 2 "
          f"'{found['race_hint']}'" + (", timings above." if timing else "."))
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashattn.cuda_appendix",
                                     description="Lesson 10's CUDA kernels: build, check, time.")
    parser.add_argument("--selftest", action="store_true", help="run every check on this GPU")
    parser.add_argument("--no-timing", action="store_true", help="skip the timing table")
    parser.add_argument("--json", help="also write the timings and race factors to this file")
    args = parser.parse_args(argv)
    if not args.selftest:
        parser.print_help()
        return 0
    return 0 if selftest(timing=not args.no_timing, json_path=args.json) else 1


if __name__ == "__main__":
    raise SystemExit(main())
