"""One edge of lesson 09's window mask written with another formula (``check.window_mask``).

The mask is two edges: key j is seen by query i when ``j >= i - left`` (if left >= 0) and
``j <= i + right`` (if right >= 0). The named window slips (:func:`beyond.window_slips`) list the
classic ones one by one; this module generates the whole class of one-edge formulas instead --
the base (i, i shifted bottom-right, or no base: an absolute position), either side's width (or
the two widths' sum or difference) with either sign, an end one key further in or out, the
comparison turned round, the right edge clamped to the last query -- so that an edge nobody
listed is still quoted as the learner wrote it, against the lesson's.
"""
from __future__ import annotations

import torch

#: the lesson's edges, as the evidence quotes them
RIGHT_EDGES = {"left": "j >= i - left", "right": "j <= i + right"}


def edge_formulas(S_q: int, S_k: int, window) -> dict:
    """``"edge:<side>:<formula>"`` -> the mask with that side's edge replaced by ``formula`` (only
    the masks that differ from the right one), for the sides that have a limit here."""
    left, right = window
    i, j = torch.arange(S_q)[:, None], torch.arange(S_k)[None, :]
    ones = torch.ones(S_q, S_k, dtype=torch.bool)
    edges = {"left": (j >= i - left) if left >= 0 else ones, "right": (j <= i + right) if right >= 0 else ones}
    want = edges["left"] & edges["right"]
    bases = {"i": i, "i + (S_k - S_q)": i + (S_k - S_q), "": torch.zeros_like(i)}
    out = {}
    for side, limit in (("left", left), ("right", right)):
        if limit < 0:
            continue
        other = edges["right" if side == "left" else "left"]
        for base_text, base in bases.items():
            for width_name, width in (("left", left), ("right", right), ("left + right", left + right),
                                      ("right - left" if side == "right" else "left - right",
                                       right - left if side == "right" else left - right)):
                for sign in (-1, 1):
                    if not base_text and sign < 0:
                        continue                      # -width alone: no one writes that
                    for end in (0, -1, 1):
                        bound = base + sign * width + end
                        for op in ((">=", "<=") if side == "left" else ("<=", ">=")):
                            mask = (j >= bound) if op == ">=" else (j <= bound)
                            signed = width_name if sign > 0 else "- " + width_name.replace(
                                "+", "#").replace("-", "+").replace("#", "-")
                            term = (f"{base_text} {'+ ' if sign > 0 else ''}{signed}" if base_text else width_name)
                            text = f"j {op} {term}" + (f" {'+' if end > 0 else '-'} 1" if end else "")
                            full = mask & other
                            if not torch.equal(full, want):
                                out.setdefault(f"edge:{side}:{text}", full)
        if side == "right":   # clamped to the last *query*, as if a key were a row index: S_k > S_q loses keys
            mask = (j <= (i + right).clamp(max=S_q - 1)) & other
            if not torch.equal(mask, want):
                out.setdefault("edge:right:j <= min(i + right, S_q - 1)", mask)
    return out
