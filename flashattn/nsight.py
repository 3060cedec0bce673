"""The workload behind ``results/profile_h100.md``: the fast kernels and cuDNN's, launched as
``python -m flashattn.bench`` launches them (fp16, D = 128, H = 16, B*S = 16384, the per-device
default tiles), for Nsight Compute.

    python -m flashattn.nsight time OUTDIR       # no profiler: do_bench medians -> OUTDIR/meta.json
    python -m flashattn.nsight prof S CAUSAL     # warm up, then one launch of each kernel between
                                                 # cudaProfilerStart and cudaProfilerStop
    python -m flashattn.nsight sweep fp16 MANIFEST [D ...]
        # every configuration of the benchmark's grid (S 1k/4k/16k, causal or not; D 64 and 128
        # unless named), each in a profiled range of its own: flashattn-fast's forward and
        # backward, then cuDNN's, called exactly as `python -m flashattn.bench` calls them.
        # MANIFEST (JSON) lists the configurations in order, with the device and versions;
        # `python -m flashattn.gap read` pairs it with ncu's CSV (results/cudnn_gap_h100.md).

Profile it with the profiler's clocks left alone, from the profiled range only, e.g.

    ncu --clock-control none --profile-from-start off --set full -o s4096 python -m flashattn.nsight prof 4096 0
    FLASHATTN_TMA_STATS=0 ncu --clock-control none --profile-from-start off -k regex:fast_dkdv \
        --metrics gpu__time_duration.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active \
        --csv python -m flashattn.nsight prof 4096 1

GPU only (the interpreter has no profiler to feed).
"""
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from .fast import fast_attention_backward, fast_attention_forward, precompile, tuning  # noqa: E402
from . import configs  # noqa: E402

D, H, TOKENS = 128, 16, 16384
DT = torch.float16


def tensors(S):
    B = TOKENS // S
    g = torch.Generator(device="cuda").manual_seed(S)
    q, k, v, do = (torch.randn(B, H, S, D, dtype=DT, device="cuda", generator=g) for _ in range(4))
    return B, q, k, v, do


def cudnn_fwd(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main_prof(S, causal, fwd_only):
    B, q, k, v, do = tensors(S)
    scale = D ** -0.5
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    for _ in range(3):   # compile / load from cache, cudnn plans, allocator growth
        o, lse = fast_attention_forward(q, k, v, causal, scale)
        if not fwd_only:
            fast_attention_backward(q, k, v, o, do, lse, causal, scale)
        with torch.no_grad():
            cudnn_fwd(q, k, v, causal)
        if not fwd_only:
            out = cudnn_fwd(qg, kg, vg, causal)
            torch.autograd.grad(out, (qg, kg, vg), do)
    o, lse = fast_attention_forward(q, k, v, causal, scale)
    out = cudnn_fwd(qg, kg, vg, causal) if not fwd_only else None
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fast_attention_forward(q, k, v, causal, scale)
    if not fwd_only:
        fast_attention_backward(q, k, v, o, do, lse, causal, scale)
    with torch.no_grad():
        cudnn_fwd(q, k, v, causal)
    if not fwd_only:
        torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled range done", S, causal)


def bench(fn):
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main_time(out_dir):
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "capability": ".".join(map(str, torch.cuda.get_device_capability())),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    try:
        res["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.sm,power.limit",
                                        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        res["ncu_version"] = subprocess.run(["ncu", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except Exception as e:  # noqa: BLE001
        res["driver_err"] = repr(e)
    res["precompile_s"] = precompile([DT], [D], [False, True])
    # the tiles the default path picks (what bench runs)
    dev = torch.device("cuda")
    res["default_configs"] = {k: str(configs.candidates(k, D, DT, dev)[0]) for k in ("fast_fwd", "fast_dq", "fast_dkdv")}
    timings = []
    for S, causal in ((4096, False), (4096, True), (1024, False), (1024, True)):
        B, q, k, v, do = tensors(S)
        scale = D ** -0.5
        o, lse = fast_attention_forward(q, k, v, causal, scale)
        fast_attention_backward(q, k, v, o, do, lse, causal, scale)
        row = dict(S=S, B=B, causal=causal)
        row["fast_fwd_ms"] = bench(lambda: fast_attention_forward(q, k, v, causal, scale))
        row["fast_bwd_ms"] = bench(lambda: fast_attention_backward(q, k, v, o, do, lse, causal, scale))
        row["fast_bwd_dq_only_ms"] = bench(lambda: fast_attention_backward(q, k, v, o, do, lse, causal, scale, True, False))
        row["fast_bwd_dkdv_only_ms"] = bench(lambda: fast_attention_backward(q, k, v, o, do, lse, causal, scale, False, True))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        with torch.no_grad():
            row["cudnn_fwd_ms"] = bench(lambda: cudnn_fwd(q, k, v, causal))
        out = cudnn_fwd(qg, kg, vg, causal)
        row["cudnn_bwd_ms"] = bench(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
        timings.append(row)
        print(row, flush=True)
        del q, k, v, do, o, lse, qg, kg, vg, out
        torch.cuda.empty_cache()
    res["do_bench"] = timings
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "do_bench"}))


#: The benchmark's grid (``python -m flashattn.bench``'s defaults): B*S and H*D are fixed.
SWEEP_SEQLENS, SWEEP_HEAD_DIMS, SWEEP_TOKENS, SWEEP_HIDDEN = (1024, 4096, 16384), (64, 128), 16384, 2048


def main_sweep(dtype_name, manifest_path, head_dims=SWEEP_HEAD_DIMS):
    """One profiled range per configuration. In each: the fast forward with no gradient (as the
    benchmark times it), the fast backward (``autograd.grad`` of a forward taken before the range),
    then the same two for cuDNN. So in ncu's list of kernels each configuration starts at its
    ``fast_fwd_kernel`` (on Hopper, ``hopper_fwd_kernel`` where the fast path takes the Gluon
    forward), the fast backward's kernels follow, and cuDNN's forward is the first
    kernel after them: ``flashattn.gap.group_kernels`` relies on exactly this order."""
    from .bench import DTYPES, providers

    dtype = DTYPES[dtype_name]
    table = providers()
    seconds = precompile([dtype], list(head_dims), [False, True])
    dev = torch.device("cuda")
    manifest = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "dtype": dtype_name, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                "precompile_s": round(seconds, 1), "order": ["flashattn-fast", "sdpa-cudnn"], "configs": []}
    for head_dim in head_dims:
        for S in SWEEP_SEQLENS:
            for causal in (False, True):
                batch, heads = SWEEP_TOKENS // S, SWEEP_HIDDEN // head_dim
                shape = (batch, heads, S, head_dim)
                g = torch.Generator(device="cuda").manual_seed(S + head_dim)
                q, k, v = (torch.randn(shape, dtype=dtype, device=dev, generator=g).requires_grad_() for _ in range(3))
                do = torch.randn(shape, dtype=dtype, device=dev, generator=g)
                outs = {}
                for name in manifest["order"]:
                    fn = table[name]
                    for _ in range(3):   # compile or load, cuDNN's plan, the allocator's growth
                        torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)
                    outs[name] = fn(q, k, v, causal)
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                for name in manifest["order"]:
                    with torch.no_grad():
                        table[name](q, k, v, causal)
                    torch.autograd.grad(outs[name], (q, k, v), do, retain_graph=True)
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                manifest["configs"].append(dict(D=head_dim, S=S, causal=causal, B=batch, H=heads))
                print(f"profiled D={head_dim} S={S} causal={causal}", flush=True)
                del q, k, v, do, outs
                torch.cuda.empty_cache()
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("time", "prof", "sweep"):
        sys.exit(__doc__)
    tuning.set_autotune(False)       # the per-device default tiles, as the benchmark runs them
    if sys.argv[1] == "time":
        main_time(sys.argv[2])
    elif sys.argv[1] == "sweep":
        main_sweep(sys.argv[2], sys.argv[3], tuple(int(d) for d in sys.argv[4:]) or SWEEP_HEAD_DIMS)
    else:
        S, causal = int(sys.argv[2]), sys.argv[3] == "1"
        main_prof(S, causal, fwd_only=len(sys.argv) > 4 and sys.argv[4] == "fwd")
