"""Figures (and one source printer) used by the lessons.

matplotlib is imported inside each function, so ``import flashattn`` never needs it and a
headless run can pick its backend first. Every plotting function takes an optional ``ax`` and
returns the axes it drew on, so a notebook can put several panels side by side.

Lessons 03 (dQ kernel) and 04 (dK/dV kernel):

    causal_tile_classes(...)      which (Q block, K block) tiles the backward kernels visit
    plot_causal_tiles(...)        ... drawn over the element-level causal mask
    plot_tile_ownership(...)      which program visits (and owns the output of) each tile
    row_relative_errors(...)      per-head, per-row error of a gradient against a reference
    plot_row_error_heatmap(...)   ... as a heatmap (rows = positions, one column per head)
    show_numbered_source(...)     print a kernel's real source with the file's line numbers
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

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
                        causal: bool = True) -> np.ndarray:
    """``[cdiv(S_q, BLOCK_M), cdiv(S_k, BLOCK_N)]`` array of ``TILE_*`` codes.

    "Visited" follows the loop bounds of ``attn_bwd_dq_kernel``: query block ``m`` loops over
    key tiles starting below ``min(S_k, (m + 1) * BLOCK_M)`` (``attn_bwd_dkdv_kernel``'s start
    ``floor(n * BLOCK_N / BLOCK_M) * BLOCK_M`` visits the very same tiles). Whether a visited
    tile needs the element mask is decided element by element over its real (unpadded) rows
    and columns, with SDPA's top-left causal rule: query ``i`` sees key ``j`` iff ``j <= i``.
    """
    n_m, n_n = _cdiv(S_q, BLOCK_M), _cdiv(S_k, BLOCK_N)
    out = np.full((n_m, n_n), TILE_FULL, dtype=np.int64)
    if not causal:
        return out
    for m in range(n_m):
        kv_end = min(S_k, (m + 1) * BLOCK_M)
        r0, r1 = m * BLOCK_M, min((m + 1) * BLOCK_M, S_q)
        for n in range(n_n):
            c0, c1 = n * BLOCK_N, min((n + 1) * BLOCK_N, S_k)
            if c0 >= kv_end:
                out[m, n] = TILE_SKIPPED
                continue
            i = np.arange(r0, r1)[:, None]
            j = np.arange(c0, c1)[None, :]
            seen = int((j <= i).sum())
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
                      ax=None, title: Optional[str] = None, legend: bool = True):
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
    classes = causal_tile_classes(S_q, S_k, BLOCK_M, BLOCK_N, causal)
    n_m, n_n = classes.shape
    H, W = n_m * BLOCK_M, n_n * BLOCK_N

    i = np.arange(H)[:, None]
    j = np.arange(W)[None, :]
    used = (i < S_q) & (j < S_k) & ((j <= i) if causal else True)
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
        title = f"S_q={S_q}, S_k={S_k}, {'causal' if causal else 'not causal'}: {visited}/{classes.size} visited"
        if causal:
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
    lo, hi = 0, len(lines)
    if start is not None:
        found = [n for n, line in enumerate(lines) if start in line]
        if not found:
            raise ValueError(f"{start!r} does not occur in the source of {fn.__name__}")
        lo = found[0]
    if stop is not None:
        found = [n for n, line in enumerate(lines) if n >= lo and stop in line]
        if not found:
            raise ValueError(f"{stop!r} does not occur after {start!r} in {fn.__name__}")
        hi = found[0] + 1
    try:
        shown = Path(path).resolve().relative_to(Path(__file__).resolve().parent.parent).as_posix()
    except ValueError:
        shown = path
    print(f"# {shown}, lines {first + lo}-{first + hi - 1}")
    for n in range(lo, hi):
        print(f"{first + n:4d} | {lines[n].rstrip()}")
