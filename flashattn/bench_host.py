"""The host's share of a call: how long the CPU spends in one attention call when the GPU is not
the bottleneck. Part of ``python -m flashattn.bench --host``.

At short sequences a call's Python, argument binding and launches can take longer than the
kernels themselves, and then the GPU waits on the CPU (notebook 06, section 4; the README's "Host
time per call"). Here the shape is tiny (B1 H2 S128 D128 fp16 causal by default), so the GPU
always keeps up and the wall time of a call, taken without waiting for the GPU, is the host's.

Every call of every provider is timed, and the providers take turns call by call, so that all of
them meet the same noise of a shared host (on the H100's host the same loop varied up to 2x
between passes). The GPU is synchronised every ``SYNC_EVERY`` turns, outside the timings, so that
its queue cannot grow. Reported: the median and the 10th percentile (the quiet host) per provider,
for a forward without gradients and for a forward with ``torch.autograd.grad`` of it.

``flashattn`` is what ``flash_attention`` runs on a GPU (the benchmark's ``flashattn-fast``);
``flashattn-plain`` the same with the direct launch turned off (``flashattn.fast.launch.set_direct(False)``,
what ``FLASHATTN_DIRECT_LAUNCH=0`` does), each launch going through ``kernel[grid](...)``.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

SHAPE = dict(B=1, H=2, S=128, D=128)
SYNC_EVERY = 200
#: Which of the benchmark's providers (``bench.providers``) each row calls: the direct-launch switch
#: is what tells the two flashattn rows apart.
BENCH_PROVIDER = {"flashattn": "flashattn-fast", "flashattn-plain": "flashattn-fast",
                  "sdpa-cudnn": "sdpa-cudnn", "sdpa-flash": "sdpa-flash"}
PROVIDERS = tuple(BENCH_PROVIDER)


def in_turn(fns: dict[str, Callable[[], object]], calls: int, sync: Callable[[], None] = lambda: None,
            before: Callable[[str], None] = lambda name: None) -> dict[str, list[float]]:
    """``{name: [microseconds of each call]}``: ``calls`` turns, each calling every function once
    in order; ``before(name)`` runs untimed ahead of each call, ``sync()`` every ``SYNC_EVERY`` turns."""
    times = {name: [] for name in fns}
    clock = time.perf_counter
    for turn in range(calls):
        for name, fn in fns.items():
            before(name)
            t0 = clock()
            fn()
            times[name].append((clock() - t0) * 1e6)
        if turn % SYNC_EVERY == SYNC_EVERY - 1:
            sync()
    sync()
    return times


def summary(micros: list[float]) -> dict:
    return dict(median_us=round(statistics.median(micros), 1),
                p10_us=round(statistics.quantiles(micros, n=10)[0], 1), calls=len(micros))


def _calls(provider: str, q, k, v, do, causal: bool) -> tuple[Callable, Callable]:
    """(forward without gradients, forward and backward) of one provider."""
    from .bench_common import providers

    attend = providers()[BENCH_PROVIDER[provider]]

    def forward():
        with torch.no_grad():
            return attend(q, k, v, causal)

    return forward, lambda: torch.autograd.grad(attend(q, k, v, causal), (q, k, v), do)


def run(shape: dict = SHAPE, causal: bool = True, calls: dict | None = None, warmup: int = 30) -> list[dict]:
    """One row per (call, provider): the host's microseconds per call, and for ``flashattn`` how
    often Triton's own launcher ran in 100 warm steps (0 when every launch went direct)."""
    from triton.runtime.jit import JITFunction

    from .fast import launch

    calls = calls or {"fwd": 4000, "fwd+bwd": 2000}
    device = torch.device("cuda")
    q, k, v = (torch.randn(shape["B"], shape["H"], shape["S"], shape["D"], device=device, dtype=torch.float16,
                           requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    passes = {p: _calls(p, q, k, v, do, causal) for p in PROVIDERS}
    try:
        for forward, step in passes.values():
            for _ in range(warmup):
                forward()
                step()
        torch.cuda.synchronize()
        run_calls = [0]
        plain_run = JITFunction.run

        def counted(self, *args, **kwargs):
            run_calls[0] += 1
            return plain_run(self, *args, **kwargs)

        JITFunction.run = counted
        try:
            for _ in range(100):
                passes["flashattn"][1]()
        finally:
            JITFunction.run = plain_run
        rows = []
        for index, name in enumerate(("fwd", "fwd+bwd")):
            fns = {p: passes[p][index] for p in PROVIDERS}
            times = in_turn(fns, calls[name], torch.cuda.synchronize,
                            before=lambda p: launch.set_direct(p != "flashattn-plain"))
            for p in PROVIDERS:
                rows.append(dict(call=name, provider=p, **shape, causal=causal, dtype="fp16", **summary(times[p])))
        rows.append(dict(call="check", provider="flashattn", triton_run_calls_in_100_steps=run_calls[0]))
        return rows
    finally:
        launch.set_direct(True)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'call':<9}{'provider':<17}{'median us':>11}{'p10 us':>9}"]
    for r in rows:
        if r["call"] == "check":
            lines.append(f"Triton's JITFunction.run in 100 warm fwd+bwd steps of flashattn: "
                         f"{r['triton_run_calls_in_100_steps']} (0: every launch went direct)")
        else:
            lines.append(f"{r['call']:<9}{r['provider']:<17}{r['median_us']:>11.1f}{r['p10_us']:>9.1f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# where one call's host time goes, layer by layer (python -m flashattn.bench --host-profile)
# --------------------------------------------------------------------------------------
#: the shapes a practitioner met (bf16, causal) where the host's share decides; at B4 H32 S2048
#: D128 the GPU's own time per call reaches the host's, and the clock would read the GPU
PROFILE_SHAPES = ((8, 12, 256, 64), (16, 12, 512, 64), (8, 16, 1024, 64))


def _per_call_us(fn, calls: int = 500, repeats: int = 5) -> float:
    """Median over ``repeats`` of the host's microseconds per call, the GPU synchronised only
    between repeats (so at these shapes its queue keeps up and the clock reads the host)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        times.append((t1 - t0) / calls * 1e6)
    return statistics.median(times)


def profile_layers(B: int, H: int, S: int, D: int, dtype=torch.bfloat16) -> list[tuple[str, float]]:
    """(layer, microseconds per call) for one causal call of the drop-in, from the outside in:
    each row times the call from that layer down, so a row minus the next is that layer's own
    share. torch's SDPA and an empty ``autograd.Function`` are timed beside it for scale."""
    import torch.nn.functional as F

    from . import api, ops, runtime
    from .fast import backward as fast_bwd, forward as fast_fwd

    from .fast import native

    native.wait()        # the C++ node built (or loaded) before anything is timed: the build takes a core
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    scale = D ** -0.5
    o, lse = fast_fwd.fast_attention_forward(qd, kd, vd, True, scale)

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            ctx.save_for_backward(a, b, c)
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g, None, None

    def dropin():
        return api.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows = [
        ("torch SDPA: forward + backward", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)),
        ("flashattn drop-in: forward + backward", lambda: dropin().backward(do)),
        ("torch SDPA: forward", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("flashattn.scaled_dot_product_attention (forward)", dropin),
        ("  api.flash_attention", lambda: api.flash_attention(q, k, v, causal=True)),
        ("    ops.attention (after validation and dispatch; the C++ node)", lambda: ops.attention(q, k, v, True, scale, "fast")),
        ("EagerAttention.apply (the Python node, FLASHATTN_NATIVE=0's)", lambda: ops.EagerAttention.apply(q, k, v, True, scale, "fast")),
        ("  ops.forward_kernels (forward + backward prepared)", lambda: ops.forward_kernels(qd, kd, vd, True, scale, "fast")),
        ("    fast_attention_forward (outputs + launch)", lambda: fast_fwd.fast_attention_forward(qd, kd, vd, True, scale)),
        ("    two outputs (runtime.new_output x2)", lambda: (runtime.new_output(q.shape, dtype, q.device),
                                                                  runtime.new_output(q.shape[:3], torch.float32, q.device))),
        ("ops.backward_kernels (the backward node's body)", lambda: ops.backward_kernels(
            do, qd, kd, vd, o, lse, True, scale, "fast", True, True)),
        ("  fast_attention_backward", lambda: fast_bwd.fast_attention_backward(qd, kd, vd, o, do, lse, True, scale)),
        ("    backward_delta (delta kernel)", lambda: fast_bwd.backward_delta(o, do)),
        ("    delta + dQ kernel", lambda: fast_bwd.fast_attention_backward(qd, kd, vd, o, do, lse, True, scale, True, False)),
        ("empty autograd.Function: forward", lambda: Empty.apply(q, k, v)),
        ("empty autograd.Function: forward + backward", lambda: Empty.apply(q, k, v).backward(do)),
        ("torch.empty (one allocation)", lambda: torch.empty(q.shape, dtype=dtype, device=q.device)),
    ]
    return [(name, round(_per_call_us(fn, calls=200 if "backward" in name else 500), 1)) for name, fn in rows]


def engine_handoff(B: int, H: int, S: int, D: int, dtype=torch.bfloat16) -> list[dict]:
    """Host microseconds per forward + backward (``torch.autograd.grad``) of torch's SDPA, the
    drop-in and an empty ``autograd.Function``, with autograd's engine as a training loop has it
    (the backward handed to the engine's CUDA device thread, and waited for) and with
    ``torch.autograd.set_multithreading_enabled(False)`` (the backward run on the calling thread).
    The difference is the handoff, paid once per ``backward()``: a loop that calls backward per
    attention call pays it per call, a training step once for all its layers."""
    import torch.nn.functional as F

    from . import api

    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            ctx.save_for_backward(a, b, c)
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, g):
            a, b, c = ctx.saved_tensors
            return torch.empty_like(a), torch.empty_like(b), torch.empty_like(c)

    from . import settings
    from .fast import native

    native.wait()
    calls = {"torch SDPA": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), True),
             "flashattn drop-in": (lambda: api.scaled_dot_product_attention(q, k, v, is_causal=True), True),
             "flashattn drop-in, Python node": (lambda: api.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                False),
             "empty autograd.Function": (lambda: Empty.apply(q, k, v), True)}
    rows = []
    for name, (forward, use_native) in calls.items():
        fwd_bwd = lambda forward=forward: torch.autograd.grad(forward(), (q, k, v), do)   # noqa: E731
        with settings.override(native=use_native):
            threaded = _per_call_us(fwd_bwd, calls=200)
            with torch.autograd.set_multithreading_enabled(False):
                calling = _per_call_us(fwd_bwd, calls=200)
        rows.append(dict(call=name, threaded_us=round(threaded, 1), calling_thread_us=round(calling, 1),
                         handoff_us=round(threaded - calling, 1)))
    return rows


def engine_markdown(shape: tuple, rows: list[dict]) -> list[str]:
    lines = [f"| forward + backward, B{shape[0]} H{shape[1]} S{shape[2]} D{shape[3]} (us per call, host) | "
             "engine as in training (device thread) | engine on the calling thread | the handoff |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['call']} | {r['threaded_us']:.1f} | {r['calling_thread_us']:.1f} | {r['handoff_us']:.1f} |"
              for r in rows]
    return lines


#: a practitioner's calls (issue 42's table): bf16, causal, forward + backward of the drop-in
CALL_SHAPES = ((8, 12, 256, 64), (16, 12, 512, 64), (8, 16, 1024, 64), (4, 32, 2048, 128))


def per_call(shapes=CALL_SHAPES, calls: int = 200, rounds: int = 5) -> list[dict]:
    """Wall time per forward + backward call (the GPU's time included: the last shape is GPU-bound)
    of the drop-in (its C++ autograd node, ``fast/native.py``), with the Python node instead,
    without launch plans, and of torch's SDPA (its default backend), taking turns round by round;
    the median of the rounds."""
    import torch.nn.functional as F

    from . import api, settings
    from .fast import native

    native.wait()        # built (or loaded from torch's cache) before anything is timed

    rows = []
    for B, H, S, D in shapes:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
        ours = lambda: api.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

        # name -> (the call, the settings it runs under: set around the whole loop, not per call)
        fns = {"flashattn": (ours, {}), "flashattn, Python node": (ours, dict(native=False)),
               "flashattn, no plans": (ours, dict(plans=False)), "torch SDPA": (sdpa, {})}
        times = {name: [] for name in fns}
        for fn, changes in fns.values():
            with settings.override(**changes):
                for _ in range(10):
                    fn()
        for _ in range(rounds):
            for name, (fn, changes) in fns.items():
                with settings.override(**changes):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    torch.cuda.synchronize()
                    times[name].append((time.perf_counter() - t0) / calls * 1e6)
        us = {name: statistics.median(t) for name, t in times.items()}
        rows.append(dict(shape=f"B{B} H{H} S{S} D{D}", **{name: round(t, 1) for name, t in us.items()},
                         speed=round(us["torch SDPA"] / us["flashattn"], 2)))
    return rows


def per_call_markdown(rows: list[dict]) -> list[str]:
    lines = ["| shape (bf16, causal) | flashattn fwd+bwd (us per call) | with the Python autograd node | "
             "without launch plans | torch SDPA | flashattn speed |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['flashattn']:.1f} | {r.get('flashattn, Python node', float('nan')):.1f} | "
                     f"{r['flashattn, no plans']:.1f} | {r['torch SDPA']:.1f} | {r['speed']:.2f}x |")
    return lines


def profile_markdown(tables: dict, env: dict, calls: list[dict] | None = None,
                     engine: tuple | None = None) -> str:
    """The committed table: one column per shape (and, first, the per-call table of ``per_call``)."""
    shapes = list(tables)
    names = [name for name, _ in tables[shapes[0]]]
    head = "| layer (us per call, host) | " + " | ".join(f"B{b} H{h} S{s} D{d}" for b, h, s, d in shapes) + " |"
    lines = [f"# Where one attention call's host time goes ({env['device']})", "",
             f"`{env.get('command', 'python -m flashattn.bench --host-profile')}`; torch {env['torch']}, "
             f"triton {env['triton']}, {env['date']}. bf16, causal. Each row times the call from that "
             "layer down (median of 5 x 200-500 calls, the GPU synchronised between repeats); the dots "
             "show the nesting: a row minus the row nested directly under it is that layer's own share. "
             "The first two rows are what a training loop pays per attention layer and step, at shapes "
             "where the GPU keeps up with the host."
             + (f" When measured, {env['native']}." if env.get("native") else ""), "", head,
             "| --- |" + " --- |" * len(shapes)]
    for i, name in enumerate(names):
        depth = (len(name) - len(name.lstrip())) // 2     # the nesting, shown as dots
        lines.append(f"| {'· ' * depth}{name.strip()} | " + " | ".join(f"{tables[s][i][1]:.1f}" for s in shapes) + " |")
    if calls:
        lines += ["", "Per call, what a training loop sees: wall time of forward + backward (the GPU's time "
                  "included), in turn, median of 5 rounds of 200 calls: the drop-in as it runs (launch plans, "
                  "``flashattn/fast/plans.py``, replayed by the C++ autograd node, ``flashattn/fast/native.py``), "
                  "with the Python autograd node instead (``FLASHATTN_NATIVE=0``), without launch plans "
                  "(``FLASHATTN_PLANS=0``), and torch's SDPA.", ""]
        lines += per_call_markdown(calls)
    if engine:
        shape, rows = engine
        lines += ["", "Where a per-call loop's extra time goes: autograd's engine hands every backward to its "
                  "CUDA device thread and waits for it (``engine_handoff``); a training step pays that once "
                  "per step, a loop that calls backward per attention call, once per call.", ""]
        lines += engine_markdown(shape, rows)
    return "\n".join(lines) + "\n"
