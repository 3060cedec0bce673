"""Figures (and one source printer) used by the lessons.

matplotlib is imported inside each function, so ``import flashattn`` never needs it and a
headless run can pick its backend first. Every plotting function takes an optional ``ax`` and
returns the axes it drew on, so a notebook can put several panels side by side.

    show_numbered_source(...)     print a kernel's real source with the file's line numbers,
                                  optionally only from one marker line to another

Lessons 02 (LSE recomputation) and 05 (autograd):

    plot_program_tiles(...)       the S_q x S_k score matrix cut into BLOCK_M x BLOCK_N tiles,
                                  with what one backward program holds and walks over
    plot_memory_vs_seqlen(...)    memory against sequence length (log-log), OOM points marked
    plot_loss_curves(...)         training-loss curves of several runs, and their relative gap

Lessons 03 (dQ kernel) and 04 (dK/dV kernel):

    causal_tile_classes(...)      which (Q block, K block) tiles the backward kernels visit
    plot_causal_tiles(...)        ... drawn over the element-level causal mask
    plot_tile_ownership(...)      which program visits (and owns the output of) each tile
    row_relative_errors(...)      per-head, per-row error of a gradient against a reference
    plot_row_error_heatmap(...)   ... as a heatmap (rows = positions, one column per head)
"""
from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

# --------------------------------------------------------------------------------------
# lessons 03 / 04: tiles visited by the backward kernels under a causal mask
# --------------------------------------------------------------------------------------
#: Tile classes returned by :func:`causal_tile_classes`.
TILE_SKIPPED = 0    # the kernel's loop bounds never visit it (every element is masked)
TILE_FULL = 1       # visited, every element visible: no element mask needed
TILE_DIAGONAL = 2   # visited, some elements visible and some not: needs the element mask
TILE_EMPTY = 3      # visited, yet nothing in it is visible (only past a ragged edge)

_TILE_NAMES = {TILE_SKIPPED: "skipped", TILE_FULL: "fully visible",
               TILE_DIAGONAL: "needs element mask", TILE_EMPTY: "visited, all masked"}
_TILE_COLORS = {TILE_SKIPPED: "#ffffff", TILE_FULL: "#4daf4a", TILE_DIAGONAL: "#ff9f1c",
                TILE_EMPTY: "#e41a1c"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def causal_tile_classes(S_q: int, S_k: int, BLOCK_M: int, BLOCK_N: int,
                        causal: bool = True, window=None) -> np.ndarray:
    """``[cdiv(S_q, BLOCK_M), cdiv(S_k, BLOCK_N)]`` array of ``TILE_*`` codes.

    "Visited" follows the loop bounds of ``attn_bwd_dq_kernel``: query block ``m`` loops over
    key tiles starting below ``min(S_k, (m + 1) * BLOCK_M)`` (``attn_bwd_dkdv_kernel``'s start
    ``floor(n * BLOCK_N / BLOCK_M) * BLOCK_M`` visits the very same tiles). Whether a visited
    tile needs the element mask is decided element by element over its real (unpadded) rows
    and columns, with SDPA's top-left causal rule: query ``i`` sees key ``j`` iff ``j <= i``.
    ``window=(left, right)`` (lesson 09): query i sees keys i - left ... i + right, and the loop
    also starts late, at the first tile the window reaches (``flashattn.beyond``'s bounds).
    """
    from .beyond.kernels import window_bounds

    n_m, n_n = _cdiv(S_q, BLOCK_M), _cdiv(S_k, BLOCK_N)
    out = np.full((n_m, n_n), TILE_FULL, dtype=np.int64)
    if not causal and window is None:
        return out
    windowed, left, right = window_bounds(window, causal, S_q, S_k)
    for m in range(n_m):
        kv_start = max(0, m * BLOCK_M - left) // BLOCK_N * BLOCK_N if windowed else 0
        kv_end = min(S_k, (m + 1) * BLOCK_M + right)
        r0, r1 = m * BLOCK_M, min((m + 1) * BLOCK_M, S_q)
        for n in range(n_n):
            c0, c1 = n * BLOCK_N, min((n + 1) * BLOCK_N, S_k)
            if c0 >= kv_end or c1 <= kv_start:
                out[m, n] = TILE_SKIPPED
                continue
            i = np.arange(r0, r1)[:, None]
            j = np.arange(c0, c1)[None, :]
            seen = int(((j >= i - left) & (j <= i + right)).sum())
            if seen == 0:
                out[m, n] = TILE_EMPTY
            elif seen == (r1 - r0) * (c1 - c0):
                out[m, n] = TILE_FULL
            else:
                out[m, n] = TILE_DIAGONAL
    return out


def _tile_counts(classes: np.ndarray) -> dict:
    return {name: int((classes == code).sum()) for code, name in _TILE_NAMES.items()}


def plot_causal_tiles(S_q: int, S_k: int, BLOCK_M: int, BLOCK_N: int, *, causal: bool = True,
                      window=None, ax=None, title: Optional[str] = None, legend: bool = True):
    """Draw the (Q block, K block) tiles over the element-level mask.

    Grey pixels are the (query i, key j) pairs that attention actually uses; each tile is
    coloured by its class (see :func:`causal_tile_classes`); hatched tiles stick out past
    ``S_q`` or ``S_k`` and rely on the row/column bound masks; dashed lines mark ``S_q`` and
    ``S_k``. Returns the axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(4.2, 4.2 * min(2.0, max(0.5, S_q / S_k))))
    from .beyond.reference import window_mask

    classes = causal_tile_classes(S_q, S_k, BLOCK_M, BLOCK_N, causal, window)
    n_m, n_n = classes.shape
    H, W = n_m * BLOCK_M, n_n * BLOCK_N

    used = np.zeros((H, W), dtype=bool)
    used[:S_q, :S_k] = window_mask(S_q, S_k, causal, window).numpy()
    ax.imshow(np.where(used, 0.55, 1.0), cmap="gray", vmin=0, vmax=1, extent=(0, W, H, 0),
              interpolation="nearest")
    for m in range(n_m):
        for n in range(n_n):
            code = classes[m, n]
            edge = (m + 1) * BLOCK_M > S_q or (n + 1) * BLOCK_N > S_k
            ax.add_patch(Rectangle((n * BLOCK_N, m * BLOCK_M), BLOCK_N, BLOCK_M,
                                   facecolor=_TILE_COLORS[code],
                                   alpha=0.0 if code == TILE_SKIPPED else 0.45,
                                   edgecolor="black", linewidth=0.8,
                                   hatch="//" if edge and code != TILE_SKIPPED else None))
    ax.axhline(S_q, color="tab:blue", linestyle="--", linewidth=1.2)
    ax.axvline(S_k, color="tab:blue", linestyle="--", linewidth=1.2)
    ax.set_xlim(0, W)
    ax.set_ylim(H, 0)
    ax.set_xlabel(f"key position j  (BLOCK_N = {BLOCK_N})")
    ax.set_ylabel(f"query position i  (BLOCK_M = {BLOCK_M})")
    counts = _tile_counts(classes)
    visited = classes.size - counts["skipped"]
    if title is None:
        kind = ("causal" if causal else "not causal") + (f", window {tuple(window)}" if window is not None else "")
        title = f"S_q={S_q}, S_k={S_k}, {kind}: {visited}/{classes.size} visited"
        if causal or window is not None:
            title += f"\n{counts['fully visible']} full, {counts['needs element mask']} need the mask"
            if counts["visited, all masked"]:
                title += f", {counts['visited, all masked']} in vain"
    ax.set_title(title, fontsize=10)
    if legend:
        handles = [Patch(facecolor=_TILE_COLORS[c], alpha=0.45 if c != TILE_SKIPPED else 1.0,
                         edgecolor="black", label=_TILE_NAMES[c])
                   for c in (TILE_FULL, TILE_DIAGONAL, TILE_EMPTY, TILE_SKIPPED)]
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//",
                             label="past S_q / S_k (bound masks)"))
        handles.append(Patch(facecolor="#8c8c8c", edgecolor="none", label="(query, key) pairs used"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8,
                  frameon=False)
    return ax


def plot_tile_ownership(S_q: int, S_k: int, BLOCK_M: int, BLOCK_N: int, *, causal: bool = True,
                        kernel: str = "dq", ax=None, title: Optional[str] = None):
    """Colour every visited tile by the program that visits it.

    ``kernel="dq"``: program ``m`` owns query block ``m`` (a row of tiles) and loops across it;
    ``kernel="dkdv"``: program ``n`` owns key block ``n`` (a column of tiles) and loops down it.
    The arrow shows the direction of each program's loop. Returns the axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if kernel not in ("dq", "dkdv"):
        raise ValueError(f"kernel must be 'dq' or 'dkdv', got {kernel!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4))
    classes = causal_tile_classes(S_q, S_k, BLOCK_M, BLOCK_N, causal)
    n_m, n_n = classes.shape
    n_prog = n_m if kernel == "dq" else n_n
    cmap = plt.get_cmap("tab10" if n_prog <= 10 else "tab20")
    for m in range(n_m):
        for n in range(n_n):
            prog = m if kernel == "dq" else n
            visited = classes[m, n] != TILE_SKIPPED
            ax.add_patch(Rectangle((n, m), 1, 1, edgecolor="black", linewidth=0.6,
                                   facecolor=cmap(prog % cmap.N) if visited else "white",
                                   alpha=0.75 if visited else 1.0))
            if visited and n_m * n_n <= 144:
                ax.text(n + 0.5, m + 0.5, str(prog), ha="center", va="center", fontsize=8)
    # one arrow per program: the direction its loop walks
    for p in range(n_prog):
        if kernel == "dq":
            cols = [n for n in range(n_n) if classes[p, n] != TILE_SKIPPED]
            if len(cols) > 1:
                ax.annotate("", xy=(cols[-1] + 0.9, p + 0.85), xytext=(cols[0] + 0.1, p + 0.85),
                            arrowprops=dict(arrowstyle="->", lw=0.8))
        else:
            rows = [m for m in range(n_m) if classes[m, p] != TILE_SKIPPED]
            if len(rows) > 1:
                ax.annotate("", xy=(p + 0.85, rows[-1] + 0.9), xytext=(p + 0.85, rows[0] + 0.1),
                            arrowprops=dict(arrowstyle="->", lw=0.8))
    ax.set_xlim(0, n_n)
    ax.set_ylim(n_m, 0)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(n_n) + 0.5, [str(n) for n in range(n_n)], fontsize=7)
    ax.set_yticks(np.arange(n_m) + 0.5, [str(m) for m in range(n_m)], fontsize=7)
    ax.set_xlabel("key block n")
    ax.set_ylabel("query block m")
    if title is None:
        title = ("dQ kernel: program m owns a row of tiles" if kernel == "dq"
                 else "dK/dV kernel: program n owns a column")
    ax.set_title(title, fontsize=10)
    return ax


# --------------------------------------------------------------------------------------
# lessons 03 / 04: per-head, per-row error heatmaps
# --------------------------------------------------------------------------------------
def row_relative_errors(actual: torch.Tensor, expected: torch.Tensor, *, batch: int = 0) -> np.ndarray:
    """``[S, H]`` errors of one batch element of ``[B, H, S, D]`` tensors.

    Row ``i`` of head ``h`` gets ``||actual[i] - expected[i]|| / rms_i ||expected[i]||``: the
    error of that row measured against the *typical* row of that head, so a row whose true
    gradient is zero (row 0 of a causal dQ, say) still gets a meaningful number. NaN/inf in
    ``actual`` gives NaN.
    """
    if actual.shape != expected.shape or actual.dim() != 4:
        raise ValueError(f"expected two [B, H, S, D] tensors of one shape, got "
                         f"{tuple(actual.shape)} and {tuple(expected.shape)}")
    a = actual[batch].detach().double().cpu()
    e = expected[batch].detach().double().cpu()
    err = (a - e).norm(dim=-1)                                   # [H, S]
    typical = e.norm(dim=-1).pow(2).mean(dim=-1).sqrt()          # [H]
    rel = err / typical.clamp_min(torch.finfo(torch.float64).tiny)[:, None]
    rel[~torch.isfinite(a).all(dim=-1)] = float("nan")
    return rel.T.numpy()


def plot_row_error_heatmap(actual: torch.Tensor, expected: torch.Tensor, *, batch: int = 0,
                           ax=None, title: Optional[str] = None, block: Optional[int] = None,
                           row_label: str = "query position i", vmin: float = 1e-8,
                           vmax: float = 10.0, colorbar: bool = True):
    """Heatmap of :func:`row_relative_errors`: rows = positions, one column per head.

    Log colour scale from ``vmin`` (clipped: anything smaller is as good as exact for the
    dtype) to ``vmax``; NaN/inf rows are drawn black. ``block`` draws a line every ``block``
    rows (the kernel's tile boundaries). Returns the axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    err = row_relative_errors(actual, expected, batch=batch)
    S, H = err.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(2.4 + 0.6 * H, 4))
    shown = np.ma.masked_invalid(np.clip(err, vmin, vmax))
    cmap = plt.get_cmap("viridis").with_extremes(bad="black")
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap,
                   norm=LogNorm(vmin=vmin, vmax=vmax), extent=(-0.5, H - 0.5, S, 0))
    if block:
        for r in range(block, S, block):
            ax.axhline(r, color="white", linewidth=0.6, linestyle=":")
    ax.set_xticks(range(H), [f"h{h}" for h in range(H)], fontsize=8)
    ax.set_xlabel("head")
    ax.set_ylabel(row_label)
    if title:
        ax.set_title(title, fontsize=10)
    if colorbar:
        plt.colorbar(im, ax=ax, label="row error / typical row norm", fraction=0.08, pad=0.04)
    return ax


# --------------------------------------------------------------------------------------
# showing the real source of a kernel
# --------------------------------------------------------------------------------------
def show_numbered_source(obj, start: Optional[str] = None, stop: Optional[str] = None) -> None:
    """Print the source of a function or ``@triton.jit`` kernel with the line numbers it has in
    its file. ``start``/``stop``: print only from the first line containing ``start`` to the
    next line containing ``stop`` (both included), so a lesson can point at one passage
    without hard-coding line numbers that drift when the file changes."""
    fn = getattr(obj, "fn", obj)
    lines, first = inspect.getsourcelines(fn)
    path = inspect.getsourcefile(fn) or "?"
    try:
        shown = Path(path).resolve().relative_to(Path(__file__).resolve().parent.parent).as_posix()
    except ValueError:
        shown = path
    _print_passage(shown, lines, first, start, stop, f"the source of {fn.__name__}")


def show_file_passage(path: str, start: str, stop: str) -> None:
    """As :func:`show_numbered_source`, for a file (relative to the repository, e.g.
    ``flashattn/hopper/forward.py``) rather than a function: for source a lesson cannot import
    here (the Gluon kernels, which need a Triton with their Gluon API)."""
    root = Path(__file__).resolve().parent.parent
    _print_passage(path, (root / path).read_text().split("\n"), 1, start, stop, path)


def _print_passage(shown: str, lines: list, first: int, start: Optional[str], stop: Optional[str],
                   what: str) -> None:
    """``lines`` (the first one numbered ``first``) from the first holding ``start`` to the next
    holding ``stop``, under a ``# path, lines a-b`` header (what tests/test_notebook_outputs.py
    checks against the file)."""
    lo, hi = 0, len(lines)
    if start is not None:
        found = [n for n, line in enumerate(lines) if start in line]
        if not found:
            raise ValueError(f"{start!r} does not occur in {what}")
        lo = found[0]
    if stop is not None:
        found = [n for n, line in enumerate(lines) if n >= lo and stop in line]
        if not found:
            raise ValueError(f"{stop!r} does not occur after {start!r} in {what}")
        hi = found[0] + 1
    print(f"# {shown}, lines {first + lo}-{first + hi - 1}")
    for n in range(lo, hi):
        print(f"{first + n:4d} | {lines[n].rstrip()}")


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
