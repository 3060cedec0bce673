"""The Gluon backward (``backward.py``, every variant) against the ``tl`` fast backward and cuDNN's
(SDPA with ``CUDNN_ATTENTION``), on a Hopper GPU: ``python -m flashattn.hopper.bench_backward``.
bf16 and fp16, B * S = 16k, H * D = 2048, S 4k/16k, D 64/128, causal both; every provider in one
process, timed by ``triton.testing.do_bench``; TFLOP/s = 2.5 x the forward's 4 B H S^2 D (halved
when causal), as ``bench_common.attention_flops`` counts the backward. Its runs are in
``results/gluon_backward_h200.txt``.

    python -m flashattn.hopper.bench_backward                # the table
    python -m flashattn.hopper.bench_backward --bf16 [variant ...]   # bf16 only, those variants
    python -m flashattn.hopper.bench_backward --ablation [prefetch]  # what dQ costs: the inline (or
        # prefetch) variant with dQ by atomics, by plain stores (a wrong dQ) and without dQ, bf16, S 4k
    ncu --profile-from-start off --set full -o bwd python -m flashattn.hopper.bench_backward --ncu [D64] [variant ...]
        # one launch of each variant (default all; bf16 S4k full, D128 or D64), between cudaProfilerStart and Stop
"""
import sys

import torch, triton, torch.nn.functional as F
from flashattn import hopper
from flashattn.hopper import backward as bwd
from flashattn.fast.backward import backward_delta, fast_attention_backward


def main(dtypes=(torch.bfloat16, torch.float16), variants=()) -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for dtype in dtypes:
        for D, S in ((64, 4096), (128, 4096), (64, 16384), (128, 16384)):
            for causal in (False, True):
                B, H = max(1, 16384 // S), 2048 // D
                try:
                    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(4))
                    o, lse = hopper.attention_forward(q, k, v, causal, D ** -0.5)
                    flops = 10 * B * H * S * S * D / (2 if causal else 1)
                    ms = {}
                    for var in variants or bwd.VARIANTS:
                        ms[var] = triton.testing.do_bench(lambda: bwd.launch(q, k, v, o, do, lse, causal, D ** -0.5, variant=var,
                                                                             delta=backward_delta(o, do)))
                    with hopper.tl_backward_only():     # the baseline, whatever BACKWARD_PREFERRED says
                        ms["tl"] = triton.testing.do_bench(lambda: fast_attention_backward(q, k, v, o, do, lse, causal, D ** -0.5))
                    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                        ms["cudnn"] = triton.testing.do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
                    tf = {n: flops / m / 1e9 for n, m in ms.items()}
                    print(f"{str(dtype)[6:]} D{D} S{S} B{B} H{H} {'causal' if causal else 'full'}: " +
                          "  ".join(f"{n} {t:.0f}" for n, t in tf.items()) +
                          f"  TFLOP/s; best gluon / cudnn {best(tf) / tf['cudnn']:.2f}, / tl {best(tf) / tf['tl']:.2f}", flush=True)
                except Exception as e:  # noqa
                    print(f"D{D} S{S} {causal}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def best(tflops: dict) -> float:
    return max(t for name, t in tflops.items() if name in bwd.VARIANTS)


def _inputs(dtype, B, H, S, D, causal):
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(4))
    o, lse = hopper.attention_forward(q, k, v, causal, D ** -0.5)
    return q, k, v, o, do, lse


def ablation(variant: str = "inline") -> None:
    """A variant ("inline" or "prefetch") with dQ by atomics, by plain stores and without it: what dQ costs."""
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for D in (64, 128):
        for causal in (False, True):
            B, H, S = 4, 2048 // D, 4096
            q, k, v, o, do, lse = _inputs(torch.bfloat16, B, H, S, D, causal)
            flops = 10 * B * H * S * S * D / (2 if causal else 1)
            ms = {mode: triton.testing.do_bench(lambda: bwd.launch(q, k, v, o, do, lse, causal, D ** -0.5,
                                                                  variant=variant, dq_mode=mode,
                                                                  delta=backward_delta(o, do)))
                  for mode in bwd.DQ_MODES}
            with hopper.tl_backward_only():     # the baseline, whatever BACKWARD_PREFERRED says
                ms["tl"] = triton.testing.do_bench(lambda: fast_attention_backward(q, k, v, o, do, lse, causal, D ** -0.5))
            print(f"bf16 D{D} S{S} {'causal' if causal else 'full'} ({variant}): " +
                  "  ".join(f"{n} {flops / m / 1e9:.0f}" for n, m in ms.items()) + " TFLOP/s (dQ modes counted as the whole)",
                  flush=True)


def ncu_launches(*args) -> None:
    """Warm up, then one launch of each variant (default: all) between cudaProfilerStart and cudaProfilerStop;
    bf16, S 4k, full, D 128 unless a ``D64`` among the arguments asks for D 64 (B*S = 16k, H*D = 2048)."""
    D = 64 if "D64" in args else 128
    variants = [a for a in args if a not in ("D64", "D128")] or list(bwd.VARIANTS)
    q, k, v, o, do, lse = _inputs(torch.bfloat16, 4, 2048 // D, 4096, D, False)
    for variant in variants:
        bwd.launch(q, k, v, o, do, lse, False, D ** -0.5, variant=variant)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for variant in variants:
        bwd.launch(q, k, v, o, do, lse, False, D ** -0.5, variant=variant)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--bf16":      # --bf16 [variant ...]
        unknown = [v for v in sys.argv[2:] if v not in bwd.VARIANTS]
        if unknown:
            sys.exit(f"no backward variant {', '.join(unknown)}: the variants are {', '.join(bwd.VARIANTS)}")
        main((torch.bfloat16, ), tuple(sys.argv[2:]))
    else:
        {"--ablation": lambda: ablation(*sys.argv[2:3]), "--ncu": lambda: ncu_launches(*sys.argv[2:])}.get(
            sys.argv[1] if len(sys.argv) > 1 else "", main)()
