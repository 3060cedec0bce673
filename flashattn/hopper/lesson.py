"""What lesson 12 (``notebooks/12_hopper_gluon.ipynb``) computes and draws, on any machine: the
committed H200 measurements of the Gluon forward's and backward's variants, a model of the mbarrier ring the
kernels use (the same slot and parity formulas, run by a random scheduler), and a schematic of the
three schedules. Plain Python, torch and matplotlib: no Gluon, no GPU.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Optional

#: the committed benchmark of the forward's variants (``python -m flashattn.hopper.bench``)
RESULTS = Path(__file__).resolve().parents[2] / "results" / "gluon_forward_h200.json"
#: the committed benchmark of the backward's variants and its dQ ablation (``python -m flashattn.hopper.bench_backward``)
BACKWARD_RESULTS = RESULTS.parent / "gluon_backward_h200.json"
#: the fastest Gluon backward variant at each head dim (``flashattn.hopper.backward.BEST``; a test compares them)
BACKWARD_BEST = {64: "ws_tma3", 128: "prefetch"}
#: the fastest of the first run's variants (``variants`` in the backward's results), before the producer-warp rows
FIRST_RUN_BEST = {64: "prefetch_lag", 128: "prefetch"}
#: the backward's providers, in the lesson's order: three Gluon variants, then the tl backward and cuDNN's
BACKWARD_PROVIDERS = ("inline", "prefetch", "prefetch_lag", "tl", "cudnn")
#: the later run's providers (``producer_warp_rows``): the prefetch, the producer-warp variants, tl, cuDNN
PRODUCER_WARP_PROVIDERS = ("prefetch", "ws", "ws_tma", "ws_tma3", "tl", "cudnn")
#: providers in the order the lesson names them: the tl kernel, the Gluon variants, the references
PROVIDERS = ("tl-fast", "gluon-inline", "gluon-ws", "gluon-ws2", "gluon-pingpong", "sdpa-cudnn", "sdpa-flash")


def forward_results(path: Path = RESULTS) -> tuple[dict, list]:
    """(environment, rows) of the committed run: one row per shape, TFLOP/s per provider."""
    data = json.loads(Path(path).read_text())
    return data.get("environment", {}), data["results"]


def shape_name(row: dict) -> str:
    return f"D{row['D']} S{row['S']}" + (" causal" if row["causal"] else "")


def ratio_table(rows: list, over: str = "sdpa-cudnn") -> list[tuple[str, dict]]:
    """Per shape, every provider's TFLOP/s over ``over``'s (above 1: faster than it)."""
    return [(shape_name(r), {p: r[p] / r[over] for p in PROVIDERS if p in r}) for r in rows]


def plot_forward_ratios(rows: list, providers=PROVIDERS[:5] + ("sdpa-flash",), over: str = "sdpa-cudnn", ax=None):
    """Grouped bars: each provider's TFLOP/s over ``over``'s per shape, with a line at 1 (above it:
    faster than cuDNN)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(13, 4.2))
    width = 0.8 / len(providers)
    colors = {"tl-fast": "#777777", "gluon-inline": "#c6dbef", "gluon-ws": "#6baed6", "gluon-ws2": "#2171b5",
              "gluon-pingpong": "#08306b", "sdpa-flash": "#fdae6b"}
    hatches = {"gluon-pingpong": "//"}
    for i, p in enumerate(providers):
        ax.bar([x + (i - len(providers) / 2 + 0.5) * width for x in range(len(rows))], [r[p] / r[over] for r in rows],
               width, label=p, color=colors.get(p), hatch=hatches.get(p), edgecolor="white", linewidth=0.3)
    ax.axhline(1.0, color="#e6550d", lw=1.5, label=f"{over} = 1")
    ax.set_xticks(range(len(rows)), [shape_name(r).replace(" ", "\n") for r in rows], fontsize=8)
    ax.set_ylabel(f"TFLOP/s over {over}'s")
    ax.set_ylim(0.4, 1.25)
    ax.legend(ncol=len(providers) + 1, fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return ax


def backward_results(path: Path = BACKWARD_RESULTS) -> dict:
    """The committed backward run: ``env``, ``variants`` (one row per shape, TFLOP/s per provider in
    ``tflops``) and ``ablation`` (what dQ costs the inline variant)."""
    return json.loads(Path(path).read_text())


def plot_backward(rows: list, providers=BACKWARD_PROVIDERS, ax=None):
    """Grouped bars: each provider's backward TFLOP/s per shape (the Gluon variants in blues, the
    producer-warp ones in greens, the ``tl`` backward grey, cuDNN's orange)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(13, 4.2))
    width = 0.8 / len(providers)
    colors = {"inline": "#c6dbef", "prefetch": "#6baed6", "prefetch_lag": "#08306b", "ws": "#c7e9c0",
              "ws_tma": "#74c476", "ws_tma3": "#238b45", "tl": "#777777", "cudnn": "#fd8d3c"}
    for i, p in enumerate(providers):
        ax.bar([x + (i - len(providers) / 2 + 0.5) * width for x in range(len(rows))], [r["tflops"][p] for r in rows],
               width, label=p, color=colors.get(p), edgecolor="white", linewidth=0.3)
    ax.set_xticks(range(len(rows)), [shape_name(r).replace(" ", "\n") for r in rows], fontsize=8)
    ax.set_ylabel("backward TFLOP/s")
    ax.legend(ncol=len(providers), fontsize=8, loc="upper left")
    ax.set_ylim(0, 1.2 * max(r["tflops"][p] for r in rows for p in providers))
    ax.grid(axis="y", alpha=0.3)
    return ax


# --------------------------------------------------------------------------------------
# the mbarrier ring, modelled
# --------------------------------------------------------------------------------------
class MBarrier:
    """An mbarrier as the kernels use it: ``count`` arrivals complete a phase; ``ready(parity)``
    is true once the phase of that parity has completed. A fresh barrier is in phase 0, so
    ``ready(1)`` holds at once: it counts as having completed the phase before its first."""

    def __init__(self, count: int = 1):
        self.count, self.phase, self.arrived = count, 0, 0

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived == self.count:
            self.phase, self.arrived = self.phase + 1, 0

    def ready(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def kernel_parities(stages: int) -> tuple[Callable, Callable]:
    """The formulas of ``forward._load_kv`` and the consumer loop: tile j's slot j % STAGES, its
    "ready" parity (j // STAGES) & 1, and the producer's "empty" parity, the other one."""
    return (lambda j: (j // stages) & 1), (lambda j: ((j // stages) & 1) ^ 1)


def simulate_ring(stages: int, tiles: int, seed: int = 0, consumer_parity: Optional[Callable] = None,
                  producer_parity: Optional[Callable] = None, max_steps: int = 100_000) -> dict:
    """Run a producer and a consumer over ``tiles`` tiles and ``stages`` slots, each step letting a
    randomly chosen side go on if its barrier lets it. Returns what happened: ``read`` (the tile
    the consumer found in the slot, per tile), ``overwritten`` (tiles whose slot was refilled
    before they were read), ``deadlock`` (neither side could go on) and ``max_ahead`` (how many
    tiles the producer ran ahead). The parities default to the kernels'; pass others to see a
    wrong one fail. (One consumer arriving once per slot, as the "ws" variant; ws2 and ping-pong
    have two consumer partitions and "empty" barriers of count 2.)"""
    ready_parity, empty_parity = kernel_parities(stages)
    consumer_parity = consumer_parity or ready_parity
    producer_parity = producer_parity or empty_parity
    ready = [MBarrier() for _ in range(stages)]
    empty = [MBarrier() for _ in range(stages)]
    slots: list = [None] * stages
    unread: set = set()
    rng = random.Random(seed)
    produced = consumed = 0
    read, overwritten, max_ahead = [], [], 0
    for _ in range(max_steps):
        if consumed == tiles:
            return dict(read=read, overwritten=overwritten, deadlock=False, max_ahead=max_ahead)
        can_produce = produced < tiles and empty[produced % stages].ready(producer_parity(produced))
        # (a consumer whose barrier says "ready" for a tile not yet produced reads whatever is there)
        can_consume = consumed < tiles and ready[consumed % stages].ready(consumer_parity(consumed))
        options = [side for side, ok in (("produce", can_produce), ("consume", can_consume)) if ok]
        if not options:
            return dict(read=read, overwritten=overwritten, deadlock=True, max_ahead=max_ahead)
        if rng.choice(options) == "produce":
            slot = produced % stages
            if slots[slot] in unread:
                overwritten.append(slots[slot])
                unread.discard(slots[slot])
            slots[slot] = produced
            unread.add(produced)
            ready[slot].arrive()              # the copy engine's bytes have landed
            produced += 1
            max_ahead = max(max_ahead, produced - consumed)
        else:
            slot = consumed % stages
            read.append(slots[slot])
            unread.discard(slots[slot])
            empty[slot].arrive()              # no product reads the slot any more
            consumed += 1
    raise RuntimeError(f"{max_steps} steps without finishing or getting stuck: raise max_steps")


def ring_is_sound(stages: int, tiles: int, runs: int = 200, **wrong) -> tuple[bool, str]:
    """(True, "") if in ``runs`` random schedules every tile was read in order, none overwritten
    unread and nothing deadlocked; else (False, the first thing that went wrong)."""
    for seed in range(runs):
        r = simulate_ring(stages, tiles, seed=seed, **wrong)
        bad = next((j for j, t in enumerate(r["read"]) if t != j), None)   # what went wrong first
        if bad is not None:
            return False, f"schedule {seed}: tile {bad} read slot {bad % stages} holding tile {r['read'][bad]}"
        if r["overwritten"]:
            return False, f"schedule {seed}: tile {r['overwritten'][0]} overwritten before it was read"
        if r["deadlock"]:
            return False, f"schedule {seed}: deadlock after {len(r['read'])} of {tiles} tiles"
    return True, ""


# --------------------------------------------------------------------------------------
# the three schedules, drawn
# --------------------------------------------------------------------------------------
def plot_schedules(steps: int = 4, product: float = 0.5, softmax: float = 0.6, ax=None):
    """A schematic (not a measurement) of one CTA's two warpgroups over ``steps`` key tiles. Each tile
    has two products for both warpgroups together, S = Q K^T and O += P V, each taking ``product`` on
    the tensor cores they share, and a softmax of ``softmax`` on each warpgroup's own units.
    "in step": S_j, P_{j-1} V_{j-1}, wait, softmax j (period 2 product + softmax);
    "softmax under P V" (the Gluon forward's loop, FA3's overlap within a warpgroup): issue S_j and
    P_{j-1} V_{j-1}, wait for S_j alone, and compute softmax j while P V runs
    (period product + max(product, softmax));
    "ping-pong": the warpgroups take turns on the tensor cores, each one's products (half of them)
    while the other does its softmax (period max(2 product, product + softmax))."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.8))
    colors = {"product": "#2171b5", "softmax": "#fd8d3c"}

    def bar(lane_y, start, length, kind, label, half=0):
        # half: 0 the whole lane, -1 / +1 its upper / lower half (two things at once)
        top, height = (lane_y - 0.35, 0.7) if half == 0 else (lane_y - 0.35 + (half + 1) * 0.18, 0.34)
        ax.broken_barh([(start, length)], (top, height), color=colors[kind], alpha=0.9, edgecolor="white")
        ax.text(start + length / 2, top + height / 2, label, ha="center", va="center", fontsize=7, color="white")

    lanes, ends = [], []
    t = 0.0                                        # 1. in step
    for j in range(steps + 1):
        if j < steps:
            bar(0, t, product, "product", f"S{j}")
            t += product
        if j > 0:
            bar(0, t, product, "product", f"PV{j - 1}")
            t += product
        if j < steps:
            bar(0, t, softmax, "softmax", f"softmax {j}")
            t += softmax
    lanes.append("in step")
    ends.append(t)
    t = 0.0                                        # 2. the softmax of tile j under P_{j-1} V_{j-1}
    for j in range(steps + 1):
        if j < steps:
            bar(1, t, product, "product", f"S{j}")
            t += product
        step = 0.0
        if j > 0:
            bar(1, t, product, "product", f"PV{j - 1}", half=-1)
            step = product
        if j < steps:
            bar(1, t, softmax, "softmax", f"softmax {j}", half=+1)
            step = max(step, softmax)
        t += step
    lanes.append("softmax under P V")
    ends.append(t)
    period = max(2 * product, product + softmax)   # 3. ping-pong: each warpgroup's half of both products
    for wg in range(2):
        for j in range(steps):
            start = j * period + wg * product
            bar(2 + wg, start, product, "product", f"S{j}+PV")
            bar(2 + wg, start + product, softmax, "softmax", f"sm {j}")
        lanes.append(f"ping-pong, warpgroup {wg}")
    ends.append((steps - 1) * period + 2 * product + softmax)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_xlabel("time (S = QK^T for the whole CTA's rows = 0.5)")
    ax.set_xlim(0, max(ends) + 0.2)
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["products (tensor cores, shared)", "softmax (exp2, max, sums: each warpgroup's own)"],
              fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    ax.set_title(f"a schematic, not a measurement: {steps} tiles take {ends[0]:.1f} in step, {ends[1]:.1f} with the "
                 f"softmax under P V, {ends[2]:.1f} in ping-pong", fontsize=9)
    return ax
