"""Processes with a process group each, and the checks they run: for the tests, lesson 11 and the
GPU self-test.

:func:`spawn` starts W processes (``torch.multiprocessing``, the "spawn" method, so it works from
a notebook too), joins them into one process group (gloo for CPU tensors, NCCL for GPUs, one GPU
per rank), runs ``fn(rank, world, *args)`` in each and returns every rank's result. The
functions it runs must be importable (defined in a module, not in a notebook cell): those below.

:func:`check_cases` is the correctness check: for each case every rank draws the same whole
inputs, computes single-process attention and its gradients in float64 (the reference), cuts
the inputs into its shard, runs :func:`ring_attention` forward and backward on the shard, and
returns the relative error of every head of its shard of O, dQ, dK and dV.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
import tempfile
from pathlib import Path

import torch


def free_port() -> int:
    """A TCP port nobody listens on right now (for the processes' rendezvous)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, backend: str, folder: str, timeout_s: float, args: tuple) -> None:
    """One spawned process: join the group, run ``fn``, leave its result in ``folder``."""
    import torch.distributed as dist

    torch.set_num_threads(1)              # W processes share the machine's cores
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args, backend: str = "gloo", timeout_s: float = 120.0) -> list:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each run in a process of its own
    inside one process group of ``world`` ranks. A rank that raises makes this raise (with its
    traceback); a collective that waits longer than ``timeout_s`` fails instead of hanging.

    gloo moves CPU tensors, so its processes see no GPU and run the kernels in Triton's
    interpreter, also on a GPU machine (``CUDA_VISIBLE_DEVICES`` empty, ``TRITON_INTERPRET=1`` in
    their environment); NCCL's get one GPU each."""
    import torch.multiprocessing as mp

    child_env = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"} if backend == "gloo" else {}
    saved = {name: os.environ.get(name) for name in child_env}
    with tempfile.TemporaryDirectory(prefix="flashattn_ring_") as folder:
        try:
            os.environ.update(child_env)          # a spawned process starts with this process's environment
            mp.start_processes(_entry, args=(fn, world, free_port(), backend, folder, timeout_s, args),
                               nprocs=world, join=True, start_method="spawn")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(world)]


# --------------------------------------------------------------------------------------
# the correctness check
# --------------------------------------------------------------------------------------
def case(B=1, H=2, H_kv=None, S=24, D=16, causal=False, layout="zigzag", dtype=torch.float32, impl="auto",
         seed=0) -> dict:
    """One case of :func:`check_cases`: the *whole* sequence's shape (S tokens over all ranks)."""
    return dict(B=B, H=H, H_kv=H if H_kv is None else H_kv, S=S, D=D, causal=causal, layout=layout, dtype=dtype,
                impl=impl, seed=seed)


def case_name(c: dict) -> str:
    gqa = f"H{c['H']}/{c['H_kv']}" if c["H"] != c["H_kv"] else f"H{c['H']}"
    return (f"{c['layout']}-{'causal' if c['causal'] else 'full'}-B{c['B']}-{gqa}-S{c['S']}-D{c['D']}-"
            f"{str(c['dtype']).replace('torch.', '')}-{c['impl']}")


def reference(q, k, v, do, causal: bool):
    """Single-process attention and its gradients in float64 (PyTorch's SDPA, differentiated by
    autograd), one query head at a time so that realistic sizes fit on a GPU: O, dQ, dK, dV."""
    H, group = q.shape[1], q.shape[1] // k.shape[1]
    f64 = dict(dtype=torch.float64, device=q.device)
    out = {"O": torch.empty(q.shape, **f64), "dQ": torch.empty(q.shape, **f64),
           "dK": torch.zeros(k.shape, **f64), "dV": torch.zeros(v.shape, **f64)}
    for h in range(H):
        kv = h // group                                     # GQA: the K/V head of this query head
        qh, kh, vh = (t[:, i:i + 1].detach().double().requires_grad_() for t, i in ((q, h), (k, kv), (v, kv)))
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
        o.backward(do[:, h:h + 1].double())
        out["O"][:, h], out["dQ"][:, h] = o.detach()[:, 0], qh.grad[:, 0]
        out["dK"][:, kv] += kh.grad[:, 0]
        out["dV"][:, kv] += vh.grad[:, 0]
    return out


def run_case(c: dict, group=None, device=None, one_device: bool = False) -> dict:
    """On every rank of ``group``: the case's whole inputs (the same on every rank: one seed),
    the float64 reference, ring attention on this rank's shard; returns ``{tensor: [B, H] relative
    error per head of this rank's shard}`` (see ``flashattn.verify.per_head_relative_error``).
    ``one_device``: also ``"one device: O"``, ... , the errors of ``flashattn.flash_attention`` run
    on the whole sequence on this rank's device, on the same rows (what one GPU gets)."""
    from ..verify import per_head_relative_error
    from .ring import ring_attention
    from .shards import shard, unshard

    from .. import runtime

    device = device or (torch.device("cpu") if runtime.INTERPRET else torch.device("cuda", torch.cuda.current_device()))
    gen = torch.Generator().manual_seed(c["seed"])
    B, H, H_kv, S, D = c["B"], c["H"], c["H_kv"], c["S"], c["D"]
    q, do = (torch.randn(B, H, S, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, H_kv, S, D, generator=gen) for _ in range(2))
    q, k, v, do = (t.to(device=device, dtype=c["dtype"]) for t in (q, k, v, do))
    ref = reference(q, k, v, do, c["causal"])

    cut = lambda t: shard(t, group, c["layout"])                          # noqa: E731
    q_s, k_s, v_s = (cut(t).requires_grad_() for t in (q, k, v))
    with _quiet_bf16():
        o_s = ring_attention(q_s, k_s, v_s, group, is_causal=c["causal"], layout=c["layout"], impl=c["impl"])
        o_s.backward(cut(do))
    got = {"O": o_s, "dQ": q_s.grad, "dK": k_s.grad, "dV": v_s.grad}
    # a floor of 0.1 on each head's reference norm: a head whose gradient is ~0 has no relative error
    errors = {name: per_head_relative_error(got[name].detach().double().cpu(), cut(ref[name]).cpu(), floor=0.1)
              for name in got}
    # and the whole output gathered back from every rank's shard
    whole = unshard(o_s.detach(), group, c["layout"])
    errors["O gathered"] = per_head_relative_error(whole.double().cpu(), ref["O"].cpu(), floor=0.1)
    if one_device:
        from ..api import flash_attention

        q1, k1, v1 = (t.detach().requires_grad_() for t in (q, k, v))
        with _quiet_bf16():
            o1 = flash_attention(q1, k1, v1, causal=c["causal"], impl=c["impl"])
            o1.backward(do)
        for name, t in (("O", o1), ("dQ", q1.grad), ("dK", k1.grad), ("dV", v1.grad)):
            errors[f"one device: {name}"] = per_head_relative_error(cut(t.detach()).double().cpu(),
                                                                    cut(ref[name]).cpu(), floor=0.1)
    return errors


@contextlib.contextmanager
def _quiet_bf16():
    """bf16 in the interpreter runs in fp32 with a BF16FallbackWarning: expected in these checks."""
    import warnings

    from ..runtime import BF16FallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BF16FallbackWarning)
        yield


def check_cases(rank: int, world: int, cases: list) -> dict:
    """Every case of ``cases`` on this rank (run by :func:`spawn`): ``{case name: errors}``."""
    return {case_name(c): run_case(c) for c in cases}


def worst(results: list) -> dict:
    """``{case: {tensor: worst head's error over every rank}}`` from :func:`spawn`'s results (NaN,
    the worst of all, wins)."""
    out: dict = {}
    for per_rank in results:
        for name, errors in per_rank.items():
            for tensor, err in errors.items():
                values = [float(err.max()), out.get(name, {}).get(tensor, 0.0)]   # tensor.max() keeps a NaN
                out.setdefault(name, {})[tensor] = max(values, key=lambda x: (math.isnan(x), x))
    return out


def tolerance(dtype: torch.dtype) -> float:
    """The single-device tests' tolerance per head against float64 (tests/conftest.py's TOL)."""
    return {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]


def pass_line(results: list, cases: list) -> str:
    """One line per case and a verdict: the report of the notebook and the self-test."""
    errors = worst(results)
    lines, ok = [], True
    for c in cases:
        name = case_name(c)
        tol = tolerance(c["dtype"])
        errors[name] = {t: e for t, e in errors[name].items() if not t.startswith("one device")}
        bad = {t: e for t, e in errors[name].items() if not e <= tol}
        ok &= not bad
        shown = "  ".join(f"{t} {e:.1e}" for t, e in errors[name].items())
        lines.append(f"{'ok  ' if not bad else 'FAIL'} {name}: worst head rel err {shown} (tolerance {tol:.0e})")
    lines.append(("PASS" if ok else "FAIL") + f": ring attention on {len(results)} processes matches single-process "
                 f"attention (float64) in {sum(1 for _ in cases)} case(s), forward and gradients")
    return "\n".join(lines)



# --------------------------------------------------------------------------------------
# the refusals: bad inputs must give every rank an error, not a hang
# --------------------------------------------------------------------------------------
def _outcome(fn) -> tuple:
    try:
        fn()
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)
    return "no error", ""


def refusals(rank: int, world: int) -> dict:
    """Bad calls on a group of 2 (run by :func:`spawn`): ``{what: (exception name, message)}`` on
    this rank. Ends with a good call (did the group survive the errors?): its worst error."""
    import warnings

    import torch.distributed as dist

    from ..runtime import BF16FallbackWarning
    from .ring import ring_attention
    from .shards import shard, unshard

    def qkv(S, dtype=torch.float32, device="cpu", k_device=None):
        q, k, v = (torch.randn(1, 2, S, 16).to(dtype=dtype, device=device) for _ in range(3))
        return q, k.to(k_device or device), v.to(k_device or device)

    out = {}
    out["unequal lengths"] = _outcome(lambda: ring_attention(*qkv(8 if rank == 0 else 6), layout="contiguous"))
    out["odd zigzag shard"] = _outcome(lambda: ring_attention(*qkv(7), layout="zigzag"))
    out["shard: S not divisible by 2W"] = _outcome(lambda: shard(torch.zeros(1, 2, 10, 16), layout="zigzag"))
    out["one rank's bad dtype"] = _outcome(lambda: ring_attention(*qkv(8, dtype=torch.int32 if rank == 1 else torch.float32)))
    out["group not a group"] = _outcome(lambda: ring_attention(*qkv(8), group="world"))
    only_0 = dist.new_group([0])            # every rank takes part in making a group
    if rank == 1:
        out["not a member"] = _outcome(lambda: ring_attention(*qkv(8), group=only_0))
    else:                                   # a ring of one: plain attention
        q, k, v = qkv(8)
        err = (ring_attention(q, k, v, group=only_0, is_causal=True) - reference(q, k, v, torch.zeros_like(q), True)["O"]).abs().max()
        out["ring of one"] = ("no error", f"{float(err):.1e}")
    out["inputs on two devices"] = _outcome(lambda: ring_attention(*qkv(8, k_device="meta")))
    out["backend cannot move them"] = _outcome(lambda: ring_attention(*qkv(8, device="meta")))
    out["unknown layout"] = _outcome(lambda: ring_attention(*qkv(8), layout="ring"))
    out["unknown impl"] = _outcome(lambda: ring_attention(*qkv(8), impl="cuda" if rank == 0 else "auto"))
    out["causal on one rank only"] = _outcome(lambda: ring_attention(*qkv(8), is_causal=rank == 0))
    out["unshard: unequal shards"] = _outcome(lambda: unshard(torch.zeros(1, 2, 4 + 2 * rank, 16)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ring_attention(*qkv(8, dtype=torch.bfloat16))
    fallback = [str(w.message) for w in seen if issubclass(w.category, BF16FallbackWarning)]
    out["bf16 in the interpreter"] = ("BF16FallbackWarning", fallback[0]) if fallback else ("no warning", "")
    good = run_case(case(S=4 * world, causal=True), device=torch.device("cpu"))
    out["good call after the errors"] = ("no error", f"{max(float(e.max()) for e in good.values()):.1e}")
    return out
