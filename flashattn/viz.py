"""Figures (and a source printer) used by the lessons.

matplotlib is imported inside each function, so ``import flashattn`` never needs it and a
headless run can choose its backend first. Every plotting function takes an optional ``ax``
and returns the axes it drew on, so a notebook can put several panels side by side.

Lessons 02 (LSE recomputation) and 05 (autograd):

    print_source_excerpt(...)   print a function's or kernel's real source, with its file's
                                line numbers, optionally only from one marker line to another
    plot_program_tiles(...)     the S_q x S_k score matrix cut into BLOCK_M x BLOCK_N tiles,
                                with what one backward program holds and walks over
    plot_memory_vs_seqlen(...)  memory against sequence length (log-log), OOM points marked
    plot_loss_curves(...)       training-loss curves of several runs, and their relative gap
"""
from __future__ import annotations

import inspect
import math
import os
from typing import Mapping, Optional, Sequence


# --------------------------------------------------------------------------------------
# showing real source code
# --------------------------------------------------------------------------------------
def print_source_excerpt(obj, start: Optional[str] = None, stop: Optional[str] = None) -> None:
    """Print the source of ``obj`` (a function, class or ``@triton.jit`` kernel) with the line
    numbers it has in its file.

    ``start`` / ``stop``: print only from the first line containing ``start`` to the next line
    containing ``stop`` (both included). Markers are text, not line numbers, so the excerpt
    follows the code when the file changes, and a marker that disappears raises ``ValueError``
    instead of silently showing the wrong lines.
    """
    fn = getattr(obj, "fn", obj)          # a triton JITFunction keeps the Python function in .fn
    lines, first = inspect.getsourcelines(fn)
    lo, hi = 0, len(lines)
    if start is not None:
        hits = [i for i, line in enumerate(lines) if start in line]
        if not hits:
            raise ValueError(f"{start!r} does not occur in the source of {fn.__qualname__}")
        lo = hits[0]
    if stop is not None:
        hits = [i for i, line in enumerate(lines) if i >= lo and stop in line]
        if not hits:
            raise ValueError(f"{stop!r} does not occur after {start!r} in {fn.__qualname__}")
        hi = hits[0] + 1
    path = inspect.getsourcefile(fn) or "?"
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        shown = os.path.relpath(path, package_root)
    except ValueError:  # another drive (Windows)
        shown = path
    print(f"# {shown}, lines {first + lo}-{first + hi - 1}")
    for i in range(lo, hi):
        print(f"{first + i:4d} | {lines[i].rstrip()}")


# --------------------------------------------------------------------------------------
# lesson 02: the tiles of S and what one program holds
# --------------------------------------------------------------------------------------
def plot_program_tiles(S_q: int, S_k: int, BLOCK_M: int, BLOCK_N: int, *, program: int = 1,
                       step: Optional[int] = None, causal: bool = False, ax=None):
    """Draw the ``S_q x S_k`` score matrix cut into ``BLOCK_M x BLOCK_N`` tiles.

    The row of tiles of query block ``program`` is what one dQ program walks over, left to
    right; tile number ``step`` of that walk is drawn darker (the one in registers "now").
    Beside the matrix: the program's Q block and LSE rows (held for the whole walk) on the
    left, and the K block of the current tile on top. With ``causal``, tiles entirely above
    the diagonal (never visited) are hatched.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n_m, n_n = math.ceil(S_q / BLOCK_M), math.ceil(S_k / BLOCK_N)
    if not 0 <= program < n_m:
        raise ValueError(f"program must be in [0, {n_m}), got {program}")
    last = n_n - 1
    if causal:
        last = min(n_n, math.ceil(min(S_k, (program + 1) * BLOCK_M) / BLOCK_N)) - 1
    step = last // 2 if step is None else step
    if not 0 <= step <= last:
        raise ValueError(f"step must be in [0, {last}] for program {program}, got {step}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 7.5 * (S_q + 2 * BLOCK_N) / (S_k + 3 * BLOCK_N)), dpi=90)

    gap = 0.35 * BLOCK_N
    q_w, lse_w = 1.2 * BLOCK_N, 0.35 * BLOCK_N            # widths of the side strips
    x0 = q_w + lse_w + 2 * gap                            # where the matrix starts
    k_h = 1.0 * BLOCK_M
    y0 = k_h + gap                                        # matrix top (y grows downwards)

    for i in range(n_m):
        for j in range(n_n):
            r0, c0 = i * BLOCK_M, j * BLOCK_N
            h, w = min(BLOCK_M, S_q - r0), min(BLOCK_N, S_k - c0)
            skipped = causal and c0 > (i + 1) * BLOCK_M - 1
            face = "#f2f2f2"
            if i == program and j <= last:
                face = "#9ecae1"
            if i == program and j == step:
                face = "#2171b5"
            ax.add_patch(Rectangle((x0 + c0, y0 + r0), w, h, facecolor=face, edgecolor="#555555",
                                   lw=0.8, hatch="////" if skipped else None))
    if causal:  # the element-level diagonal: keys j <= i are visible
        d = min(S_q, S_k)
        ax.plot([x0, x0 + d], [y0, y0 + d], color="#d62728", lw=1.2, ls="--")

    r0, h = program * BLOCK_M, min(BLOCK_M, S_q - program * BLOCK_M)
    c0, w = step * BLOCK_N, min(BLOCK_N, S_k - step * BLOCK_N)
    ax.add_patch(Rectangle((0, y0 + r0), q_w, h, facecolor="#fdae6b", edgecolor="k"))
    ax.text(q_w / 2, y0 + r0 + h / 2, "Q block\n(+ dO)", ha="center", va="center", fontsize=8)
    ax.add_patch(Rectangle((q_w + gap, y0 + r0), lse_w, h, facecolor="#fd8d3c", edgecolor="k"))
    ax.text(q_w + gap + lse_w / 2, y0 + r0 + h / 2, "LSE", ha="center", va="center",
            fontsize=7, rotation=90)
    ax.add_patch(Rectangle((x0 + c0, 0), w, k_h, facecolor="#a1d99b", edgecolor="k"))
    ax.text(x0 + c0 + w / 2, k_h / 2, "K, V\nblock", ha="center", va="center", fontsize=8)
    ax.text(x0 + c0 + w / 2, y0 + r0 + h / 2, "P tile", ha="center", va="center", fontsize=8,
            color="white")
    arrow_y = y0 + r0 + h + 0.25 * BLOCK_M
    arrow_end = x0 + min((last + 1) * BLOCK_N, S_k) - 0.1 * BLOCK_N
    ax.annotate("", xy=(arrow_end, arrow_y), xytext=(x0 + 0.1 * BLOCK_N, arrow_y),
                arrowprops=dict(arrowstyle="->", color="#2171b5", lw=1.5), annotation_clip=False)

    ax.set_xlim(-1, x0 + S_k + 1)
    ax.set_ylim(y0 + S_q + 0.35 * BLOCK_M, -1)
    ax.set_aspect("equal")
    ax.set_xticks([x0 + j * BLOCK_N for j in range(n_n)] + [x0 + S_k])
    ax.set_xticklabels([str(j * BLOCK_N) for j in range(n_n)] + [str(S_k)], fontsize=7)
    ax.set_yticks([y0 + i * BLOCK_M for i in range(n_m)] + [y0 + S_q])
    ax.set_yticklabels([str(i * BLOCK_M) for i in range(n_m)] + [str(S_q)], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlabel("key index j  (S_k)")
    ax.set_ylabel("query index i  (S_q)")
    ax.set_title(f"S = Q K^T in {BLOCK_M}x{BLOCK_N} tiles: program {program} walks its row "
                 f"(tile {step} now)", fontsize=9)
    return ax


# --------------------------------------------------------------------------------------
# lesson 02: memory against sequence length
# --------------------------------------------------------------------------------------
def plot_memory_vs_seqlen(seq_lens: Sequence[int], series: Mapping[str, Sequence[Optional[float]]],
                          *, oom: Optional[Mapping[str, int]] = None,
                          limit: Optional[float] = None, limit_label: str = "device memory",
                          ax=None):
    """Log-log plot of bytes against sequence length.

    ``series`` maps a label to one value per entry of ``seq_lens`` (bytes; ``None`` where it
    was not measured). A label ending in ``"(model)"`` is drawn dashed. ``oom`` maps a label to
    the first sequence length that ran out of memory: marked with a red cross at the top.
    ``limit`` draws a horizontal line (e.g. the GPU's memory).
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    colors = {}
    for n, (label, values) in enumerate(series.items()):
        pts = [(s, v) for s, v in zip(seq_lens, values) if v is not None and v > 0]
        if not pts:
            continue
        xs, ys = zip(*pts)
        modelled = label.endswith("(model)")
        line, = ax.plot(xs, ys, ls="--" if modelled else "-", marker=None if modelled else "o",
                        lw=1.2 if modelled else 1.8, ms=4, label=label, alpha=0.7 if modelled else 1)
        colors[label] = line.get_color()
    top = max((v for vals in series.values() for v in vals if v), default=1.0)
    if limit is not None:
        ax.axhline(limit, color="k", lw=0.8, ls=":")
        ax.text(max(seq_lens), limit / 1.6, f"{limit_label}: {limit / 2**30:.0f} GiB", fontsize=8,
                ha="right", va="top")
        top = max(top, limit)
    for label, s in (oom or {}).items():
        ax.plot([s], [top * 2], marker="x", color="#d62728", ms=10, mew=2.5)
        ax.annotate(f"{label}: out of memory at S={s:,}", (s, top * 2), xytext=(-12, 0),
                    textcoords="offset points", fontsize=8, color="#d62728", ha="right",
                    va="center")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("bytes")
    ax.yaxis.set_major_formatter(FuncFormatter(_bytes_label))
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return ax


def _bytes_label(value: float, _pos=None) -> str:
    """1e3 -> '1 kB', 2.5e9 -> '2.5 GB' (decimal units: they fall on the log axis' decades)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value:g} B"


# --------------------------------------------------------------------------------------
# lesson 05: loss curves of two runs that should coincide
# --------------------------------------------------------------------------------------
def plot_loss_curves(curves: Mapping[str, Sequence[float]], *, title: str = "training loss",
                     axes=None):
    """Two panels: the loss curves (one per label) and, below, the relative gap of every curve
    to the first one, on a log scale. Returns the two axes."""
    import matplotlib.pyplot as plt

    labels = list(curves)
    if not labels:
        raise ValueError("no curves to plot")
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(7, 5), dpi=90, sharex=True,
                               gridspec_kw={"height_ratios": [3, 1.3]})
    top, bottom = axes
    styles = ["-", "--", ":", "-."]
    for n, label in enumerate(labels):
        ys = list(curves[label])
        top.plot(range(len(ys)), ys, ls=styles[n % len(styles)], lw=2.2 - 0.6 * (n > 0), label=label)
    top.set_ylabel("loss")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8)
    top.grid(True, alpha=0.3)
    base = list(curves[labels[0]])
    for label in labels[1:]:
        ys = list(curves[label])
        gap = [abs(a - b) / max(abs(a), 1e-30) for a, b in zip(ys, base)]
        bottom.plot(range(len(gap)), [max(g, 1e-12) for g in gap], lw=1, label=f"|{label} - {labels[0]}| / {labels[0]}")
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.set_ylabel("relative gap")
    bottom.grid(True, alpha=0.3)
    if len(labels) > 1:
        bottom.legend(fontsize=7)
    return axes
