"""The Gluon backward (``backward.py``, both variants) against the ``tl`` fast backward and cuDNN's
(SDPA with ``CUDNN_ATTENTION``), on a Hopper GPU: ``python -m flashattn.hopper.bench_backward``.
bf16 and fp16, B * S = 16k, H * D = 2048, S 4k/16k, D 64/128, causal both; every provider in one
process, timed by ``triton.testing.do_bench``; TFLOP/s = 2.5 x the forward's 4 B H S^2 D (halved
when causal), as ``bench_common.attention_flops`` counts the backward. Work in progress (branch
gluon-backward); its first run is ``results/gluon_backward_h200.txt``."""
import torch, triton, torch.nn.functional as F
from flashattn import hopper
from flashattn.hopper import backward as bwd
from flashattn.fast.backward import fast_attention_backward


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for dtype in (torch.bfloat16, torch.float16):
        for D, S in ((64, 4096), (128, 4096), (64, 16384), (128, 16384)):
            for causal in (False, True):
                B, H = max(1, 16384 // S), 2048 // D
                try:
                    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(4))
                    o, lse = hopper.attention_forward(q, k, v, causal, D ** -0.5)
                    flops = 10 * B * H * S * S * D / (2 if causal else 1)
                    ms = {}
                    for var in ("inline", "ws"):
                        ms[var] = triton.testing.do_bench(lambda: bwd.launch(q, k, v, o, do, lse, causal, D ** -0.5, variant=var))
                    ms["tl"] = triton.testing.do_bench(lambda: fast_attention_backward(q, k, v, o, do, lse, causal, D ** -0.5))
                    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                        ms["cudnn"] = triton.testing.do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
                    tf = {n: flops / m / 1e9 for n, m in ms.items()}
                    print(f"{str(dtype)[6:]} D{D} S{S} B{B} H{H} {'causal' if causal else 'full'}: " +
                          "  ".join(f"{n} {t:.0f}" for n, t in tf.items()) +
                          f"  TFLOP/s; best gluon / cudnn {max(tf['inline'], tf['ws']) / tf['cudnn']:.2f}, / tl {max(tf['inline'], tf['ws']) / tf['tl']:.2f}", flush=True)
                except Exception as e:  # noqa
                    print(f"D{D} S{S} {causal}: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
