"""The figures of lesson 11: the ring's schedule, who owns which rows, the work per rank, the
overlap model and the measured scaling. matplotlib only; nothing here communicates."""
from __future__ import annotations

import math

import numpy as np

from .layout import DIAGONAL, EARLY_KEYS, LATE_QUERIES, NOTHING, block_plan, n_chunks, positions, work_per_rank

_HIDDEN, _ELSEWHERE = -2, -1     # cell values: hidden by the mask; visible, computed at another step


def _colors(world: int):
    import matplotlib.pyplot as plt

    return [plt.get_cmap("tab10")(r % 10) for r in range(world)]


def step_matrix(world: int, layout: str, causal: bool, seq_len: int, step: int) -> np.ndarray:
    """[S, S] (queries down, keys across) of what step ``step`` computes: the rank whose kernel
    computes the pair at this step, -1 for a visible pair computed at another step, -2 for a
    pair the mask hides. (Half-block plans are taken as the kernels compute them.)"""
    m = np.full((seq_len, seq_len), _ELSEWHERE)
    if causal:
        m[np.triu_indices(seq_len, 1)] = _HIDDEN
    for r in range(world):
        s = (r - step) % world
        q_pos, k_pos = positions(r, world, seq_len, layout).numpy(), positions(s, world, seq_len, layout).numpy()
        plan, half = block_plan(r, s, world, layout, causal), len(q_pos) // 2
        if plan == NOTHING:
            continue
        rows = q_pos[half:] if plan == LATE_QUERIES else q_pos
        cols = k_pos[:half] if plan == EARLY_KEYS else k_pos
        block = np.full((len(rows), len(cols)), r)
        if plan == DIAGONAL:
            block[cols[None, :] > rows[:, None]] = _HIDDEN       # the triangle the causal kernel skips
        sub = m[np.ix_(rows, cols)]
        m[np.ix_(rows, cols)] = np.where(block >= 0, block, sub)
    return m


def _matrix(ax, m: np.ndarray, world: int, title: str, chunk: int) -> None:
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap([(1, 1, 1), (0.86, 0.86, 0.86)] + _colors(world))
    ax.imshow(m + 2, cmap=cmap, vmin=0, vmax=world + 1, interpolation="nearest")
    for x in range(0, m.shape[0] + 1, chunk):
        ax.axhline(x - 0.5, color="k", lw=0.3)
        ax.axvline(x - 0.5, color="k", lw=0.3)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)


def _ring(ax, world: int, step: int) -> None:
    """W ranks on a circle; rank r holds the K/V block of rank r - step and passes it to r + 1."""
    from matplotlib.patches import Circle

    colors = _colors(world)
    angle = [math.pi / 2 - 2 * math.pi * r / world for r in range(world)]
    xy = [(math.cos(a), math.sin(a)) for a in angle]
    for r in range(world):
        (x0, y0), (x1, y1) = xy[r], xy[(r + 1) % world]
        ax.annotate("", xy=(0.8 * x1 + 0.2 * x0, 0.8 * y1 + 0.2 * y0), xytext=(0.8 * x0 + 0.2 * x1, 0.8 * y0 + 0.2 * y1),
                    arrowprops=dict(arrowstyle="->", color="0.4", lw=1))
    for r, (x, y) in enumerate(xy):
        ax.add_patch(Circle((x, y), 0.3, color=colors[r], alpha=0.9))
        ax.text(x, y + 0.05, f"rank {r}", ha="center", va="center", fontsize=7, color="w", weight="bold")
        ax.text(x, y - 0.13, f"K/V {(r - step) % world}", ha="center", va="center", fontsize=7, color="w")
    ax.set_xlim(-1.45, 1.45)
    ax.set_ylim(-1.45, 1.45)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"step {step}" + (": its own block" if step == 0 else ""), fontsize=9)


def plot_ring_schedule(world: int = 4, layout: str = "zigzag", causal: bool = True, chunk: int = 4):
    """One column per step: the ring (who holds whose K/V block) above the whole attention matrix,
    with the pairs each rank computes at that step in its colour (grey: computed at another step;
    white: hidden by the mask)."""
    import matplotlib.pyplot as plt

    seq_len = n_chunks(world, layout) * chunk
    fig, axes = plt.subplots(2, world, figsize=(2.6 * world, 5.4), gridspec_kw=dict(height_ratios=[1, 1.25]))
    for t in range(world):
        _ring(axes[0, t], world, t)
        _matrix(axes[1, t], step_matrix(world, layout, causal, seq_len, t), world,
                "queries down, keys across" if t == 0 else "", chunk)
    fig.suptitle(f"The ring, {world} ranks, {layout} layout{', causal' if causal else ''}: step t, rank r works on "
                 f"the K/V block of rank r - t and sends it on", fontsize=10)
    fig.tight_layout()
    return fig


def owner_matrix(world: int, layout: str, seq_len: int) -> np.ndarray:
    """[S, S]: the rank owning each query row, on the causal triangle (-2 above it)."""
    m = np.full((seq_len, seq_len), _HIDDEN)
    for r in range(world):
        for i in positions(r, world, seq_len, layout).numpy():
            m[i, : i + 1] = r
    return m


def plot_balance(world: int = 4, seq_len: int = 4096, chunk: int = 4):
    """Who owns which query rows of the causal matrix under each layout, and the pairs each rank
    computes over a whole pass (its work)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), gridspec_kw=dict(width_ratios=[1, 1, 1.4]))
    for ax, layout in zip(axes, ("contiguous", "zigzag")):
        S = n_chunks(world, layout) * chunk
        _matrix(ax, owner_matrix(world, layout, S), world, f"{layout}: rank r owns chunks "
                + ("r" if layout == "contiguous" else "r, 2W-1-r"), chunk)
    ax = axes[2]
    width = 0.38
    for i, layout in enumerate(("contiguous", "zigzag")):
        work = np.array(work_per_rank(world, layout, True, seq_len), dtype=float)
        ax.bar(np.arange(world) + (i - 0.5) * width, work / work.mean(), width, label=layout,
               color=_colors(world) if layout == "zigzag" else "0.6", edgecolor="k", lw=0.5)
    ax.axhline(1, color="k", lw=0.6, ls=":")
    ax.set_xticks(range(world), [f"rank {r}" for r in range(world)], fontsize=8)
    ax.set_ylabel("pairs computed / mean")
    ax.set_title(f"causal work per rank, W = {world}, S = {seq_len}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_overlap_model(tflops: float, bandwidths_gb_s, heads: int = 16, kv_heads: int = 16, head_dim: int = 128,
                       s_local=None):
    """Per off-diagonal forward step of the zigzag ring: the kernel's time (half a block of
    S_local^2 pairs at ``tflops``) against the time to pass K and V on (bf16) at each bandwidth.
    A model with the rates given, not a measurement: the transfer hides when it is the shorter."""
    import matplotlib.pyplot as plt

    s_local = np.asarray(s_local if s_local is not None else 2.0 ** np.arange(9, 18))
    compute_ms = 2 * s_local ** 2 * heads * head_dim / (tflops * 1e12) * 1e3
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.loglog(s_local, compute_ms, "k-", lw=2, label=f"kernel, {tflops:.0f} TFLOP/s")
    for bw in bandwidths_gb_s:
        transfer_ms = 4 * s_local * kv_heads * head_dim / (bw * 1e9) * 1e3
        ax.loglog(s_local, transfer_ms, "--", label=f"K and V sent, {bw:.0f} GB/s")
        cross = 2 * tflops * 1e12 * kv_heads / (heads * bw * 1e9)
        ax.axvline(cross, color=ax.lines[-1].get_color(), lw=0.5)
    ax.set_xlabel("tokens per GPU (S_local)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"one ring step, H = {heads}, H_kv = {kv_heads}, D = {head_dim}, bf16 (a model)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_scaling(result: dict):
    """The benchmark's JSON (``python -m flashattn.distributed.bench``): tokens/s per GPU against S
    for each GPU count and provider, and the ring's scaling efficiency."""
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "ms" in r]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
    styles = {"ring": "-", "cp-cudnn": "--", "cp-flash": ":", "flashattn": "-."}
    for world in sorted({r["world"] for r in rows}):
        for provider, style in styles.items():
            pts = sorted((r["S"], r["tokens_per_s_per_gpu"]) for r in rows if r["world"] == world and r["provider"] == provider)
            if pts:
                ax0.plot(*zip(*pts), style, marker="o", ms=3, label=f"{provider}, {world} GPU{'s' if world > 1 else ''}",
                         color=_colors(8)[world])
        eff = sorted((r["S"], r["efficiency"]) for r in rows
                     if r["world"] == world and r["provider"] == "ring" and "efficiency" in r)
        if world > 1 and eff:
            ax1.plot(*zip(*eff), marker="o", label=f"ring, {world} GPUs", color=_colors(8)[world])
    for ax in (ax0, ax1):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S (whole sequence)")
    ax0.set_ylabel("tokens / s per GPU")
    ax0.legend(fontsize=7, ncol=2)
    ax1.set_ylabel("scaling efficiency t_1 / (W t_W)")
    ax1.axhline(1, color="k", lw=0.5)
    ax1.legend(fontsize=8)
    env = result.get("environment", {})
    fig.suptitle(f"{env.get('device', '?')}, torch {env.get('torch', '?')}, {env.get('date', '')[:10]}", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["plot_ring_schedule", "plot_balance", "plot_overlap_model", "plot_scaling", "step_matrix", "owner_matrix"]
