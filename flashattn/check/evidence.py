"""The evidence a mistake's test reads, and the tests most mistakes share.

Everything a diagnosis can use is measured first (per case and tensor: error per head and row, a
constant factor, NaN that was never written or was computed, reads and writes past the end,
run-to-run changes, exact matches with known wrong formulas -- the *fingerprints*) and collected
in one :class:`Evidence` per run; the checker's mistakes are then tried in its order
(:func:`flashattn.check.engine.diagnose`).

Case patterns are found, not listed: every *property* a case can have (causal, S_q > S_k,
several query blocks of 32 rows, a non-contiguous dO, V's strides unlike K's, ...) is tried, and
a property whose cases are exactly the failing ones (or contain them all, and mostly fail) names
the pattern. When no mistake fits, the fallback says what pattern was seen rather than "unknown".

The shared tests: :func:`matches` (the outputs equal a fingerprint) and :func:`quoted_line` (a
line of the learner's code shows the slip).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from .battery import BLOCKS, Case, aligned, padded_head_dim
from .origin import learner_sources
from .source import first_line

# --------------------------------------------------------------------------------------
# case properties
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Property:
    id: str
    label: str                        # "causal cases"
    holds: Callable[[Case], bool]
    block: Optional[int] = None       # for the block-count properties


def _layout_differs(c: Case) -> bool:
    return not c.contiguous


_STRIDES: dict = {}


def _strides(c: Case) -> dict:
    if c not in _STRIDES:
        _STRIDES[c] = c.strides()
    return _STRIDES[c]


def _properties() -> list:
    props = [
        Property("causal", "the causal cases", lambda c: c.causal),
        Property("noncausal", "the cases without the causal mask", lambda c: not c.causal),
        Property("custom_scale", "the case with a custom scale", lambda c: c.scale is not None),
        Property("scale_none", "the case that leaves the scale to its default (scale=None)",
                 lambda c: getattr(c, "scale_none", False)),
        Property("gqa", "the GQA cases (H != H_kv)", lambda c: c.heads_kv != c.H),
        Property("sq_gt_sk", "the cases with S_q > S_k", lambda c: c.S_q > c.S_k),
        Property("sq_lt_sk", "the cases with S_q < S_k", lambda c: c.S_q < c.S_k),
        Property("sq_ne_sk", "the cases with S_q != S_k", lambda c: c.S_q != c.S_k),
        Property("do_stride0", "the case whose dO has stride 0", lambda c: c.do_layout in ("stride0", "sum")),
        Property("do_strided", "the cases whose dO is not contiguous",
                 lambda c: c.do_layout not in ("contiguous",)),
        Property("qkv_strided", "the cases with non-contiguous q, k or v",
                 lambda c: any(l != "contiguous" for l in c.layout)),
        Property("strided", "the cases with a non-contiguous tensor", _layout_differs),
        Property("batch", "the cases with more than one batch element", lambda c: c.B > 1),
        Property("stride_lse_delta", "the cases where delta's strides differ from LSE's",
                 lambda c: c.stats_padded in ("lse", "delta", "strided")),
        Property("stats_strided", "the case whose LSE and delta have last-axis strides of 2 and 3",
                 lambda c: c.stats_padded == "strided"),
        Property("head_dim", "the case whose head dim D is below its padded block (D < BLOCK_D)",
                 lambda c: padded_head_dim(c.D)),
    ]
    for b in BLOCKS:
        props += [
            Property(f"multi_q{b}", f"the cases where S_q spans more than one query block of {b}",
                     lambda c, b=b: c.S_q > b, b),
            Property(f"multi_k{b}", f"the cases where S_k spans more than one key block of {b}",
                     lambda c, b=b: c.S_k > b, b),
            Property(f"ragged{b}", f"the cases whose lengths are not multiples of {b}",
                     lambda c, b=b: c.S_q % b != 0 or c.S_k % b != 0, b),
            Property(f"ragged_q{b}", f"the cases whose S_q is not a multiple of {b}",
                     lambda c, b=b: c.S_q % b != 0, b),
            Property(f"ragged_k{b}", f"the cases whose S_k is not a multiple of {b}",
                     lambda c, b=b: c.S_k % b != 0, b),
        ]
    props.append(Property("multi_block", "the cases where the keys come in several blocks",
                          lambda c: c.multi_block))
    # one tensor addressed with another's strides fails exactly where their strides differ
    names = {"q": "Q", "k": "K", "v": "V", "do": "dO"}
    dims = {0: "batch", 1: "head", 2: "sequence", 3: "last-dim"}
    pairs = [("q", "k"), ("q", "v"), ("k", "v"), ("q", "do"), ("k", "do"), ("v", "do")]
    for a, b in pairs:
        for d, dim in dims.items():
            props.append(Property(f"stride_{a}_{b}_{d}", f"the cases where {names[b]}'s {dim} stride differs "
                                  f"from {names[a]}'s", lambda c, a=a, b=b, d=d: _strides(c)[a][d] != _strides(c)[b][d]))
        props.append(Property(f"stride_{a}_{b}", f"the cases where {names[b]}'s strides differ from {names[a]}'s",
                              lambda c, a=a, b=b: _strides(c)[a] != _strides(c)[b]))
    # an output stored with its input's strides fails exactly where the two are laid out unlike
    # (the outputs are contiguous but in the 'strided outputs' case: dQ there, dV there, never dK)
    for a in ("q", "k", "v"):
        props.append(Property(f"{a}_layout", f"the cases where {names[a]} is laid out unlike the output",
                              lambda c, a=a: c.layout["qkv".index(a)] != ("contiguous" if a == "k" else c.out_layout)))
        for d, dim in dims.items():
            props.append(Property(f"stride_{a}_out_{d}", f"the cases where the output's {dim} stride differs from "
                                  f"{names[a]}'s", lambda c, a=a, d=d: _strides(c)[a][d] != c.output_strides(a)[d]))
    # each also split by the mask: a causal loop clamps its bounds, so some mistakes show only
    # without it (or only with it)
    derived = []
    for p in props:
        if p.id in ("causal", "noncausal"):
            continue
        derived.append(Property(p.id + "&causal", p.label + " (causal)",
                                lambda c, p=p: p.holds(c) and c.causal, p.block))
        derived.append(Property(p.id + "&noncausal", p.label + " (not causal)",
                                lambda c, p=p: p.holds(c) and not c.causal, p.block))
    return props + derived


PROPERTIES = _properties()


def separating(results: list, failing: list) -> Optional[tuple]:
    """The property that best explains which cases fail: (property, exact). ``exact``: its
    cases are exactly the failing ones. Otherwise the property whose cases contain every
    failing case and fail most often (at least half), the most specific first."""
    if not failing or len(failing) == len(results):
        return None
    fail_ids = {id(r) for r in failing}
    best = None
    for p in PROPERTIES:
        having = [r for r in results if p.holds(r.case)]
        if not having or len(having) == len(results):
            continue
        if not all(p.holds(r.case) for r in failing):
            continue
        frac = sum(id(r) in fail_ids for r in having) / len(having)
        key = (frac, -len(having))
        if frac >= 0.5 and (best is None or key > best[0]):
            best = (key, p)
    if best is None:
        return None
    (frac, _), p = best
    return p, frac == 1.0


# --------------------------------------------------------------------------------------
# the evidence every mistake's test reads
# --------------------------------------------------------------------------------------
class Evidence:
    """One run's evidence, computed once: the case results, which fail, which ran, the property
    that sets the failing cases apart, the learner's sources. Every mistake's test reads it (its
    parameter is named ``ctx``)."""

    def __init__(self, results: list, checker, subject=None):
        self.results = results
        self.checker = checker         # the Checker (checkers.py) that ran: compare with `is`
        self.subject = subject         # the learner's function or launcher, for the tests that read code
        self._sources = None
        self.failing = [r for r in results if not r.ok]
        self.ran = [r for r in results if r.error is None]
        self.names = list(dict.fromkeys(n for r in self.ran for n in r.tensors))
        sep = separating(results, self.failing)
        self.pattern, self.exact = sep if sep else (None, False)

    @property
    def sources(self) -> list:
        """The learner's source texts (function, kernels, autograd classes), read once."""
        if self._sources is None:
            self._sources = learner_sources(self.subject) if self.subject is not None else []
        return self._sources

    def wrong_in(self, name: str) -> list:
        return [r for r in self.ran if name in r.tensors and not r.tensors[name].ok]

    def right_everywhere(self, name: str) -> bool:
        have = [r for r in self.ran if name in r.tensors]
        return bool(have) and all(r.tensors[name].ok for r in have)

    def bad_tensors(self):
        return [(r, t) for r in self.failing for t in r.bad()]

    def names_of(self, rs, limit: int = 4) -> str:
        text = ", ".join(f"'{r.case.name}'" for r in rs[:limit])
        return text + (", ..." if len(rs) > limit else "")

    def tensor_pattern(self) -> str:
        """'dK wrong in 5 of 16 cases; dQ and dV right in every case'."""
        wrong = [n for n in self.names if self.wrong_in(n)]
        right = [n for n in self.names if n not in wrong]
        parts = [f"{n} wrong in {len(self.wrong_in(n))} of {len(self.ran)} cases" for n in wrong]
        if right:
            parts.append(f"{' and '.join(right)} right in every case")
        return "; ".join(parts)

    def case_pattern(self) -> str:
        n, m = len(self.failing), len(self.results)
        if self.pattern is None:
            return f"{n} of {m} cases fail ({self.names_of(self.failing)}), no single property sets them apart"
        having = [r for r in self.results if self.pattern.holds(r.case)]
        if self.exact:
            return f"exactly {self.pattern.label} fail ({n} of {m}); every other case passes"
        return (f"every failing case is among {self.pattern.label} ({n} of the {len(having)} fail); "
                f"no case without it fails")


def exactly(ctx, *bases) -> bool:
    """Whether the failing cases are exactly those of a property with one of these base ids."""
    p = ctx.pattern
    return p is not None and ctx.exact and p.id.split("&")[0] in bases


def errors_raised(ctx, error_class) -> list:
    """The cases whose code raised an ``error_class`` (ShapeError, Unwritten, ...)."""
    return [r for r in ctx.results if isinstance(r.error, error_class)]


def first_raised(ctx, error_class):
    """The first case whose code raised an ``error_class``, or None."""
    return next(iter(errors_raised(ctx, error_class)), None)


def in_every_failing_case(ctx, prefix: str, also=lambda label: True) -> set:
    """The full fingerprint labels starting with ``prefix`` (and passing ``also``) that every
    failing case matches: a mistake generated from a class (one operand, one edge's formula)
    names itself only where it explains them all."""
    common = None
    for r in ctx.failing:
        labels = {f for f in r.fingerprints if f.startswith(prefix) and also(f)}
        common = labels if common is None else common & labels
    return common or set()


def matches(name: str):
    """The test of a mistake whose failing cases' outputs match fingerprint ``name``, a known wrong
    computation (:mod:`flashattn.check.fingerprints`)."""
    def test(ctx):
        matched = [r for r in ctx.failing if name in r.fingerprints]
        rest = [r for r in ctx.failing if name not in r.fingerprints]
        # where low precision overflowed (inf, NaN) the float64 match cannot hold: those may differ
        if matched and len(matched) >= len(rest) and \
                all(any(not t.finite for t in r.tensors.values()) for r in rest):
            overflow = f" (the other {len(rest)} overflowed to inf or NaN)" if rest else ""
            return (f"in {len(matched)} of {len(ctx.failing)} failing cases your outputs match that "
                    f"computation exactly{overflow}; {ctx.tensor_pattern()}{_only_without_causal(ctx)}")
        return None
    return test


def _only_without_causal(ctx) -> str:
    """A note when exactly the non-causal cases fail: the right computation ran only under causal."""
    causal = [r for r in ctx.results if getattr(r.case, "causal", None) is True]
    if causal and all(r.ok for r in causal) and all(getattr(r.case, "causal", None) is False for r in ctx.failing) \
            and any(re.search(r"\bif\s+(?:not\s+)?(?:\w+\.)?(?:causal|CAUSAL|is_causal)\b", src) for src in ctx.sources):
        return ("; only cases without the causal mask fail, and every causal case passes: the step that "
                "computes this right runs only under causal -- inside the `if causal:` branch (indented "
                "one level too deep?) where it belongs before it")
    return ""




_PATTERNS = {"case": lambda ctx: ctx.case_pattern(), "tensors": lambda ctx: ctx.tensor_pattern()}


def quoted_line(test, show=("case",)):
    """The test of a mistake that quotes the first line of the learner's code for which
    ``test(line)`` holds, followed by the case pattern and/or the tensor pattern (``show``)."""
    def quote(ctx):
        line = first_line(ctx, test)
        return "; ".join([f"`{line}`"] + [_PATTERNS[s](ctx) for s in show]) if line else None
    return quote


def ranges(idx, limit: int = 6) -> str:
    idx = list(idx)
    if not idx:
        return "none"
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    text = ", ".join(out[:limit])
    return text + (", ..." if len(out) > limit else "")


#: the lessons' names of the inputs a kernel is handed
INPUT_NAMES = {"q": "Q", "k": "K", "v": "V", "do": "dO", "lse": "LSE", "delta": "delta"}


def facts(r, name: str) -> dict:
    """The structural facts (:mod:`flashattn.check.structure`) of output ``name`` in case result ``r``."""
    return r.structure.get(name, {})


def heads_text(case, idx) -> str:
    """'(0,1), (1,0), ...': the (batch, head) pairs of flat head indices ``idx``."""
    return ", ".join(f"({i // case.H},{i % case.H})" for i in idx[:8]) + (", ..." if len(idx) > 8 else "")


def displaced_stores(ctx):
    """A GPU fences nothing off, but the guard past an output shows stores that landed there: with
    contiguous inputs and block-multiple lengths, unwritten elements beside elements written past
    the end mean the store's address itself is wrong. The evidence, or None."""
    shifted = [(r, t) for r, t in ctx.bad_tensors()
               if r.case.contiguous and aligned(r.case) and t.unwritten and t.guard_touched]
    if not shifted:
        return None
    r, t = shifted[0]
    return (f"'{r.case.name}' (contiguous inputs, lengths multiples of {BLOCKS[-1]}): {t.unwritten} "
            f"elements of {t.name} never written and {t.guard_touched} written past its end -- its stores "
            f"went to other addresses; {ctx.case_pattern()}")
