"""What a checker found: per tensor, per case, and the whole result with its report.

A pass is one line. A failure is a table (a row per case and tensor) and a diagnosis; the
details -- the table, the per-head errors, a heat map -- are there on request
(``result.report()``, ``result.table()``, ``result.plot()``).
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..verify import per_head_relative_error
from .battery import Case, is_poison
from .errors import Unwritten


@dataclass
class TensorResult:
    """How far one output is from the reference."""

    name: str
    rel: float                 # whole tensor, ||a - e|| / ||e||
    per_head: torch.Tensor     # [B, H] relative errors (inf where not finite)
    row_err: torch.Tensor      # [rows]: max over (b, h) of ||a_i - e_i|| / rms row norm
    tol: float
    finite: bool
    ratio: float               # least-squares a ~ ratio * e
    ratio_resid: float         # ||a - ratio * e|| / ||ratio * e||
    unwritten: int = 0         # elements still holding the poison
    guard_touched: int = 0     # elements written past the end of the output
    actual: Optional[torch.Tensor] = None   # float64 copy on the CPU, for the fingerprints
    cosine: float = math.nan   # (a . e) / (|a| |e|): 1 when only the size is off

    @property
    def worst(self) -> float:
        return float(self.per_head.max()) if self.per_head.numel() else self.rel

    @property
    def ok(self) -> bool:
        return self.finite and self.worst <= self.tol and self.guard_touched == 0

    @property
    def heads_ok(self) -> torch.Tensor:
        return self.per_head <= self.tol

    @property
    def nan_computed(self) -> bool:
        """NaN that is not the poison: computed from something (read past the end, inf - inf)."""
        return not self.finite and self.unwritten == 0

    def bad_rows(self) -> list[int]:
        return [int(i) for i in torch.nonzero(self.row_err > self.tol).flatten()]


def compare(name: str, actual, expected, tol: float, guard_touched: int = 0) -> TensorResult:
    """Compare one output with the float64 reference (``ValueError`` on a wrong shape)."""
    if not isinstance(actual, torch.Tensor):
        raise TypeError(f"{name} should be a torch.Tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"{name} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    unwritten = int(is_poison(actual.detach()).sum()) if actual.dtype.is_floating_point else 0
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    finite = bool(torch.isfinite(a).all())
    tiny = torch.finfo(torch.float64).tiny
    if a.dim() < 3:              # per-head parameters [H, ...] (lazy attention's dBias, dTau)
        a3, e3 = a.reshape(1, a.shape[0] if a.dim() else 1, -1), e.reshape(1, e.shape[0] if e.dim() else 1, -1)
    else:
        a3, e3 = a, e
    per_head = per_head_relative_error(a3, e3)
    per_head = torch.nan_to_num(per_head, nan=math.inf, posinf=math.inf)
    diff = torch.nan_to_num(a3 - e3, nan=1e30, posinf=1e30, neginf=-1e30)
    rel = float(diff.norm() / e3.norm().clamp_min(tiny))
    if a3.dim() >= 3 and a3.shape[-1] and a3.dim() == 4:
        # per row (dim 2): error relative to the head's root-mean-square row norm
        rms = (e3.flatten(2).norm(dim=-1) / math.sqrt(max(e3.shape[2], 1))).clamp_min(tiny)   # [B, H]
        row_err = (diff.norm(dim=-1) / rms[..., None]).amax(dim=(0, 1))
    else:
        row_err = per_head.flatten()
    if finite:
        ee = float((e * e).sum())
        ratio = float((a * e).sum()) / ee if ee > 0 else math.nan
        resid = float((a - ratio * e).norm()) / max(abs(ratio) * math.sqrt(ee), tiny)
        cosine = float((a * e).sum()) / max(float(a.norm()) * math.sqrt(ee), tiny)
    else:
        ratio, resid, cosine = math.nan, math.inf, math.nan
    return TensorResult(name, rel, per_head, row_err, tol, finite, ratio, resid, unwritten,
                        guard_touched, a, cosine)


@dataclass
class CaseResult:
    case: Case
    tensors: dict = field(default_factory=dict)      # name -> TensorResult
    error: Optional[BaseException] = None
    error_where: str = ""
    nondeterministic: Optional[list] = None          # names of outputs whose bits changed
    fingerprints: set = field(default_factory=set)   # known wrong variants the output matches
    nan_from: Optional[list] = None                  # inputs whose guard, read, put NaN in outputs
    swapped: Optional[tuple] = None                  # (got, wanted) names of outputs in wrong order
    launches: Optional[int] = None                   # kernels the launcher started (kernel checkers)
    launch_args: Optional[list] = None               # instruments.Launch per Triton launch (kernel checkers)
    oob_reads: Optional[list] = None                 # inputs whose guard memory a load returned
    wild: Optional[dict] = None                      # loads/stores outside every tensor, dropped
    structure: dict = field(default_factory=dict)    # output -> structural facts (structure.py)
    inputs_modified: Optional[dict] = None           # input -> (changed, elements, factor or None)

    @property
    def ok(self) -> bool:
        return (self.error is None and not self.nondeterministic and self.launches != 0 and not self.inputs_modified
                and not self.oob_reads and not self.wild and all(t.ok for t in self.tensors.values()))

    def bad(self) -> list:
        return [t for t in self.tensors.values() if not t.ok]


class Text(str):
    """Text for a person to read: a ``str`` (print it, search it), which a notebook shows as the
    text itself -- lines and all -- where a plain string would show as one quoted line of ``\\n``."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, p, cycle) -> None:      # IPython and Jupyter
        p.text(str(self))


@dataclass(frozen=True)
class Diagnosis:
    """A named mistake with the evidence that points at it."""

    id: str
    title: str          # what is wrong, one line
    idea: str           # the principle to check (tier 1: no code)
    evidence: str = ""  # numbers from this run that point at it


@dataclass
class CheckResult:
    """What a checker found: the cases, the diagnosis, and where your code came from."""

    title: str
    results: list
    diagnoses: list
    origin: list            # lines describing where the function came from
    warnings: list          # origin warnings (editing the wrong copy?)
    code_warnings: list = field(default_factory=list)   # warnings your code raised while it ran
    _shown: bool = field(default=False, repr=False)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results) and not self.diagnoses

    @property
    def hint_ids(self) -> list:
        return [d.id for d in self.diagnoses]

    @property
    def failed(self) -> list:
        return [r for r in self.results if not r.ok]

    # -- one line -----------------------------------------------------------------------
    def summary(self) -> str:
        if self.ok:
            return self.pass_line()
        d = self.diagnoses[0] if self.diagnoses else None
        n, m = len(self.failed), len(self.results)
        if not n and d and not any(r.error for r in self.results):    # a rule read the code, not the values
            return f"FAIL {self.title}: all {m} cases' values pass, but [{d.id}] {d.title}"
        what = f"{n} of {m} cases wrong" if n else "refused"
        return f"FAIL {self.title}: {what}" + (f" -- [{d.id}] {d.title}" if d else "")

    def pass_line(self) -> str:
        """'PASS ...: all 27 cases within tolerance (worst head rel err 3.6e-07, tol 1e-04; in
        'fp16 inputs' 3.2e-04, tol 1e-02).' Each case is held to its own dtype's tolerance, so
        the worst error is given per tolerance: first the one most cases have."""
        groups: dict = {}                        # tol -> [worst error, names of its cases]
        for r in self.results:
            for t in r.tensors.values():
                worst, names = groups.setdefault(t.tol, [0.0, []])
                groups[t.tol][0] = max(worst, t.worst)
                if r.case.name not in names:
                    names.append(r.case.name)
        ranked = sorted(groups.items(), key=lambda g: (-len(g[1][1]), g[0])) or [(0.0, [0.0, []])]
        (tol, (worst, _)), others = ranked[0], ranked[1:]
        said = "".join(f"; in {repr(names[0]) if len(names) == 1 else f'{len(names)} cases'} {w:.1e}, tol {t:.0e}"
                       for t, (w, names) in others)
        return (f"PASS {self.title}: all {len(self.results)} cases within tolerance "
                f"(worst head rel err {worst:.1e}, tol {tol:.0e}{said}).")

    def __repr__(self) -> str:
        return f"<CheckResult {self.summary()} (.report() for the table)>"

    def _ipython_display_(self):
        # The checker printed its verdict already: a notebook cell shows it once, not twice.
        if not self._shown:
            print(self.summary())

    # -- details ------------------------------------------------------------------------
    def table(self) -> Text:
        head = f"{'#':>2}  {'case':<26}{'shape':<20}{'causal':<7}{'tensor':<7}{'rel err':>9}  {'heads ok':>8}  verdict"
        lines = [head, "-" * len(head)]
        for i, r in enumerate(self.results, 1):
            c = r.case
            prefix = f"{i:>2}  {c.name[:25]:<26}{c.shape_text():<20}{'yes' if c.causal else 'no':<7}"
            if r.error is not None:
                kind = "not implemented" if isinstance(r.error, Unwritten) else \
                    f"raised {type(r.error).__name__}"
                lines.append(prefix + f"{'-':<7}{'-':>9}  {'-':>8}  {kind}")
                continue
            for j, t in enumerate(r.tensors.values()):
                p = prefix if j == 0 else " " * len(prefix)
                heads = f"{int(t.heads_ok.sum())}/{t.heads_ok.numel()}"
                if t.ok:
                    verdict = "ok"
                elif t.unwritten:
                    verdict = f"FAIL ({t.unwritten} never written)"
                elif not t.finite:
                    verdict = "FAIL (NaN)"
                else:
                    verdict = "FAIL"
                if t.guard_touched:
                    verdict += f" (+{t.guard_touched} written past the end)"
                err = "inf" if not math.isfinite(t.worst) else f"{t.worst:.1e}"
                lines.append(p + f"{t.name:<7}{err:>9}  {heads:>8}  {verdict}")
            if r.nondeterministic:
                lines.append(" " * 4 + f"!! run twice on the same input: {', '.join(r.nondeterministic)} "
                             "changed between runs")
            if r.oob_reads:
                lines.append(" " * 4 + f"!! read past the end of {', '.join(r.oob_reads)}")
            if r.inputs_modified:
                lines.append(" " * 4 + f"!! wrote into its input {', '.join(r.inputs_modified)}")
        return Text("\n".join(lines))

    def diagnosis(self) -> str:
        lines = []
        for d in self.diagnoses:
            lines.append(f"Diagnosis [{d.id}]: {d.title}.")
            lines += _wrap(d.idea, "  ")
            if d.evidence:
                lines += _wrap("Evidence: " + d.evidence, "  ", subsequent="    ")
        errs = [r for r in self.results if r.error is not None
                and not isinstance(r.error, Unwritten)]
        if errs:
            r = errs[0]
            lines.append(f"  First error (case '{r.case.name}'): {type(r.error).__name__}: "
                         f"{_short(str(r.error))}")
            if r.error_where:
                lines.append(f"  at {r.error_where}")
        for w in self.code_warnings[:2]:
            lines += _wrap("Your code warned: " + w, "  ", subsequent="    ")
        return "\n".join(lines)

    def report(self) -> Text:
        """Where the code came from, every case's row, and the verdict; shown as text in a notebook."""
        parts = [self.title] + [f"  {l}" for l in self.origin] + [f"  WARNING: {w}" for w in self.warnings]
        if self.ok:       # a failure's diagnosis lists them already
            parts += [f"  Your code warned: {w}" for w in self.code_warnings]
        parts += [self.table()]
        if self.ok:
            parts.append(self.pass_line())
        else:
            parts.append(f"FAIL: {len(self.failed)} of {len(self.results)} cases wrong.")
            parts.append(self.diagnosis())
        return Text("\n".join(parts))

    def failure_text(self) -> str:
        """What a failing checker prints: the diagnosis first, then the table."""
        parts = [self.summary()] + [f"  WARNING: {w}" for w in self.warnings]
        parts += [self.diagnosis(), "", self.table(), "",
                  "(check.last.report() prints this again with where your code came from; "
                  "check.last.plot() draws the errors per case and head.)"]
        return "\n".join(parts)

    def plot(self, ax=None):
        """A heat map of the error of every (batch, head) pair in every case: a stride bug shows
        as a column of green (head 0) next to red, a causal bug as red rows for the causal cases."""
        import matplotlib.pyplot as plt

        rows = [r for r in self.results if r.tensors]
        width = max((t.per_head.numel() for r in rows for t in r.tensors.values()), default=1)
        grid = torch.full((len(rows), width), float("nan"), dtype=torch.float64)
        for i, r in enumerate(rows):
            worst = None
            for t in r.tensors.values():          # the worst tensor, head by head
                e = t.per_head.flatten().clamp_min(1e-12)
                worst = e if worst is None or worst.numel() != e.numel() else torch.maximum(worst, e)
            grid[i, :worst.numel()] = worst.log10()
        if ax is None:
            _, ax = plt.subplots(figsize=(1.6 + 0.45 * width, 0.8 + 0.32 * len(rows)), dpi=90)
        tol = max((t.tol for r in rows for t in r.tensors.values()), default=1e-4)
        img = ax.imshow(grid.numpy(), cmap="RdYlGn_r", vmin=math.log10(tol) - 4,
                        vmax=math.log10(tol) + 4, aspect="auto")
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not math.isnan(float(grid[i, j])) and float(grid[i, j]) > math.log10(tol):
                    ax.text(j, i, "x", ha="center", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [r.case.name for r in rows], fontsize=8)
        ax.set_xticks(range(width), [str(j) for j in range(width)], fontsize=8)
        ax.set_xlabel("(batch, head) pair, flattened  (x: over tolerance)")
        ax.figure.colorbar(img, ax=ax, label="log10 rel. error")
        ax.set_title(self.title, fontsize=9)
        ax.figure.tight_layout()
        return ax.figure

    def assertion_message(self) -> str:
        if self.diagnoses and self.diagnoses[0].id == "not_implemented":
            return f"{self.title}: not implemented yet -- {self.diagnoses[0].idea}"
        return self.summary() + " (see the diagnosis and the table above)"


class CheckFailed(AssertionError):
    """A checker's failure. Still an AssertionError (pytest, nbval and ``raises-exception`` cells
    see it as one), but IPython shows it as one red line: the diagnosis and the table were
    printed just above, and a traceback through the checker's own frames would bury them."""

    def _render_traceback_(self):
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {self}"]


def _wrap(text: str, indent: str, width: int = 96, subsequent: Optional[str] = None) -> list:
    return textwrap.wrap(text, width=width, initial_indent=indent,
                         subsequent_indent=indent if subsequent is None else subsequent)


def _short(s: str, n: int = 300) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[:n] + " ..."
