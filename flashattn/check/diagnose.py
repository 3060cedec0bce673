"""The diagnosis: from *which* outputs are wrong, in *which* cases and *how*, to the mistake.

Everything a diagnosis can use is measured first (per case and tensor: error per head and row,
a constant factor, NaN that was never written or was computed, writes past the end, run-to-run
changes, exact matches with known wrong formulas -- the *fingerprints*), then the rules below
are tried in order and the first that fits names the mistake. Each rule is one function with
its title and idea beside it: adding a diagnosis means adding one rule here (and a planted bug
in ``flashattn.planted`` that proves it, see ``tests/test_check_kernels.py``).

Case patterns are found, not listed: every *property* a case can have (causal, S_q > S_k,
several query blocks of 32 rows, a non-contiguous dO, ...) is tried, and a property whose cases
are exactly the failing ones (or contain them all, and mostly fail) names the pattern. When no
rule fits, the diagnosis says what pattern was seen rather than "unknown".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from .battery import BLOCKS, Case
from .results import CaseResult, Diagnosis

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


def _properties() -> list:
    props = [
        Property("causal", "the causal cases", lambda c: c.causal),
        Property("custom_scale", "the case with a custom scale", lambda c: c.scale is not None),
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
    # each also split by the mask: a causal loop clamps its bounds, so some mistakes show only
    # without it (or only with it)
    derived = []
    for p in props:
        if p.id == "causal":
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
# the context a rule sees
# --------------------------------------------------------------------------------------
class Context:
    """What the rules look at, computed once."""

    def __init__(self, results: list, kind: str):
        self.results = results
        self.kind = kind               # backward, dq, dkdv, autograd, rebuild_p, online_softmax, lazy
        self.failing = [r for r in results if not r.ok]
        self.ran = [r for r in results if r.error is None]
        self.names = list(dict.fromkeys(n for r in self.ran for n in r.tensors))
        sep = separating(results, self.failing)
        self.pattern, self.exact = sep if sep else (None, False)

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


# --------------------------------------------------------------------------------------
# the rules, in order: the first that returns evidence names the mistake
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    idea: str
    test: Callable[[Context], Optional[str]]
    kinds: Optional[tuple] = None     # checkers it applies to (None: all)


RULES: list = []


def rule(id: str, title: str, idea: str, kinds: Optional[tuple] = None):
    def register(test):
        RULES.append(Rule(id, title, idea, test, kinds))
        return test
    return register


def _first_error(ctx, kind):
    return next((r for r in ctx.results if isinstance(r.error, kind)), None)


class NotWritten(Exception):
    """The learner's code still raises NotImplementedError."""


class ShapeError(Exception):
    """An output of the wrong type or shape."""


@rule("not_implemented", "not written yet",
      "Your code still raises NotImplementedError: replace the `raise NotImplementedError()` line "
      "(the `# YOUR CODE HERE` block) with your implementation, re-run that cell, then this one.")
def _not_implemented(ctx):
    r = _first_error(ctx, NotImplementedError)
    return "" if r is not None else None


@rule("no_kernel", "your launcher ran no kernel",
      "This checker checks a kernel: the launcher must launch it (kernel[grid](...)) and let it "
      "write the outputs it was given. It computed them some other way (plain PyTorch?) or not at all.",
      kinds=("dq", "dkdv"))
def _no_kernel(ctx):
    counted = [r for r in ctx.results if r.launches is not None]
    if counted and all(r.launches == 0 for r in counted):
        return f"the launcher returned without launching any kernel, in all {len(counted)} cases"
    return None


@rule("grad_order", "gradients returned in the wrong order",
      "Return the gradients in the order of the inputs they belong to: (dq, dk, dv) for "
      "(q, k, v) -- and in an autograd.Function, one per input of forward, None for the "
      "non-tensor ones.")
def _wrong_order(ctx):
    swapped = [r for r in ctx.results if r.swapped]
    if swapped:
        got, wanted = swapped[0].swapped
        return f"in {ctx.names_of(swapped)} the tensor returned as {got} has the shape of {wanted}"
    fp = [r for r in ctx.failing if "swapped" in r.fingerprints]
    if fp and all("swapped" in r.fingerprints for r in ctx.failing):
        return f"in every failing case two returned gradients equal each other's true values ({ctx.tensor_pattern()})"
    return None


@rule("shape", "an output has the wrong shape or type",
      "Return tensors shaped like the reference: dQ like q, dK and dV like k and v, "
      "P [B, H, S_q, S_k], LSE [B, H, S_q].")
def _shape(ctx):
    r = _first_error(ctx, ShapeError)
    return str(r.error) if r is not None else None


@rule("exception", "your code raised an exception",
      "The error and the line it came from are shown below. Shapes are q [B, H, S_q, D], "
      "k, v [B, H_kv, S_k, D], lse [B, H, S_q]; cases with S_q != S_k or non-contiguous tensors "
      "are the usual triggers (use .reshape rather than .view, and each tensor's own strides).")
def _exception(ctx):
    raised = [r for r in ctx.results if r.error is not None]
    if not raised:
        return None
    sep = separating(ctx.results, raised)
    where = f"only in {sep[0].label}" if sep and sep[1] else f"in {len(raised)} of {len(ctx.results)} cases"
    return f"raised {where} ({ctx.names_of(raised)})"


@rule("race", "results change between runs on the same input: a race on a global accumulator",
      "Two runs on identical inputs gave different bits. Several programs (or threads) add into "
      "the same output addresses, and the order of those additions -- or whether an update is "
      "lost -- depends on scheduling. Atomics fix lost updates but not the order. Give every "
      "output block to exactly one program that accumulates in registers and stores once.")
def _race(ctx):
    r = next((r for r in ctx.results if r.nondeterministic), None)
    return f"case '{r.case.name}': {', '.join(r.nondeterministic)} differed between two runs" if r else None


@rule("unwritten", "some output elements were never written",
      "Outputs start filled with a marked NaN here, and some still hold it: those elements were "
      "never stored. Check that the grid covers the last, partial block (cdiv, not //), that the "
      "store's mask is not stricter than `row < S`, and that the launcher writes into the output "
      "it was given.")
def _unwritten(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.unwritten]
    if not bad:
        return None
    r, t = bad[0]
    rows = t.bad_rows()
    what = "keys" if t.name in ("dK", "dV") else "rows"
    return (f"{t.unwritten} elements of {t.name} never written in '{r.case.name}' ({what} "
            f"{_ranges(rows)} of 0-{t.row_err.numel() - 1}); {ctx.case_pattern()}")


@rule("read_past_end", "a load reads past the end of a tensor (a mask is missing)",
      "The memory around every input holds NaN here, and NaN reached your output: some load "
      "reads rows (or columns) that do not exist. Every load needs the mask of its own tensor -- "
      "the query-row mask for q, dO, LSE and delta, the key mask for k and v -- so that padded "
      "positions read a harmless `other` value.")
def _read_past_end(ctx):
    hits = [r for r in ctx.failing if r.nan_from]
    if not hits:
        return None
    names = list(dict.fromkeys(n for r in hits for n in r.nan_from))
    return (f"with NaN only around {', '.join(_INPUT_NAMES.get(n, n) for n in names)}, the output "
            f"turns NaN; with finite values there it does not (case '{hits[0].case.name}')")


_INPUT_NAMES = {"q": "Q", "k": "K", "v": "V", "do": "dO", "lse": "LSE", "delta": "delta"}


@rule("nan", "NaN computed inside your code",
      "NaN appeared although every element was written and no load reads past the end: "
      "something like exp(+inf), inf - inf or 0 * inf. A row whose every key is masked with -inf "
      "(max = -inf, then -inf - (-inf)) is the classic; so is exp applied before the mask.")
def _nan(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.nan_computed]
    if not bad:
        return None
    r, t = bad[0]
    return f"{t.name} holds NaN in '{r.case.name}'; {ctx.case_pattern()}"


@rule("oob_write", "memory just past the output was written: a store without its mask",
      "The kernel stored elements beyond the end of the output tensor: the store's mask is missing "
      "the row (or column) condition, so the padded rows of the last block land in whatever "
      "follows in memory -- another head's rows, or another tensor.")
def _oob_write(ctx):
    bad = [(r, t) for r, t in ctx.bad_tensors() if t.guard_touched]
    if not bad:
        return None
    r, t = bad[0]
    return f"'{r.case.name}': {t.guard_touched} elements written after the end of {t.name}"


def _fingerprint_rule(name: str):
    def test(ctx):
        if ctx.failing and all(name in r.fingerprints for r in ctx.failing):
            return f"in every failing case your outputs match that computation exactly; {ctx.tensor_pattern()}"
        return None
    return test


rule("delta", "dS is missing the - delta term",
     "dS = P * (dP - delta): the softmax Jacobian subtracts, from each row of dP, its P-weighted "
     "mean delta = rowsum(P * dP) = rowsum(dO * O) -- one number per query row.")(_fingerprint_rule("no_delta"))

rule("scale_in_scores", "P is rebuilt from scores without the scale",
     "S = Q K^T * scale in the forward, so P = exp(S - LSE) must be rebuilt from the *scaled* "
     "scores -- the same S as the forward, or LSE does not match it. Check every place the scale "
     "enters: the scores that rebuild P, and the one factor in dQ and dK.")(_fingerprint_rule("unscaled_s"))

rule("lse", "P rebuilt with exp2 from a natural-log LSE",
     "The forward's LSE is a natural log: rebuild P = exp(S - LSE). exp2 works only if both S and "
     "LSE are converted to base 2 (multiplied by log2(e)).")(_fingerprint_rule("exp2"))


def _lazy(fp: str, title: str, idea: str):
    rule(fp, title, idea, kinds=("lazy",))(_fingerprint_rule(fp))


_lazy("lazy_delta", "delta = rowsum(dO * O) does not hold for lazy attention",
      "The shortcut delta = rowsum(dO * O) holds because O = P V in softmax attention; here "
      "O = A V with A = ReLU(P + tau/(i+1)), so delta must be summed the long way: rowsum(P * dP).")
_lazy("lazy_gate", "the ReLU's gate is missing from dP",
      "A = ReLU(P + tau/(i+1)): the gradient reaches P only where the ReLU let it through, so "
      "dP = dA * 1[P + tau/(i+1) > 0] (and 0 on the hidden keys).")
_lazy("lazy_scale", "dQ and dK are missing the scale",
      "S = Q K^T * scale + b, so dQ = dS K * scale and dK = dS^T Q * scale.")
_lazy("lazy_dk_transpose", "dK needs dS transposed",
      "Key j collects dS[i, j] over the query rows i: dK = dS^T Q * scale.")
_lazy("lazy_dv", "dV is computed from P instead of A",
      "O = A V, so dV = A^T dO with A the ReLU-shifted matrix, not the softmax P.")
_lazy("lazy_dbias_diagonals", "dBias sums the wrong diagonals",
      "bias[d] enters S[i, j] for i - j = d (keys before the query): dBias[d] sums dS along the "
      "d-th diagonal *below* the main one.")
_lazy("lazy_dtau_count", "dTau is missing the 1/(i+1) factor",
      "tau enters row i as tau/(i+1): dTau sums dP[i, j] / (i + 1).")
_lazy("lazy_dtau_gate", "dTau is not gated by the ReLU",
      "Entries the ReLU clipped pass no gradient to tau either: sum dA * gate / (i + 1).")
_lazy("lazy_dtau_causal", "dTau sums over hidden keys too",
      "tau/(i+1) is added only on the visible keys j <= i: sum the causal entries only (and gate them).")


@rule("accumulate", "only the last block's contribution survives: accumulate, don't overwrite",
      "A program sums its output over every block it visits: dQ over the key blocks, dK and dV "
      "over the query blocks. `acc += tl.dot(...)` inside the loop, one store after it; `acc = ...` "
      "or a store of the tile's share inside the loop keeps only the last block.",
      kinds=("dq", "dkdv"))
def _accumulate(ctx):
    hits = [r for r in ctx.failing if any(f.startswith("last_block") for f in r.fingerprints)]
    if hits and len(hits) == len(ctx.failing):
        block = sorted(f for f in hits[0].fingerprints if f.startswith("last_block"))[0].split("_")[-1]
        return (f"your outputs equal the last block's share alone (blocks of {block}) in every "
                f"failing case; {ctx.case_pattern()}")
    return None


@rule("scale", "the error is a constant factor tied to the softmax scale",
      "S = Q K^T * scale, so the chain rule puts one factor `scale` into dQ = dS K * scale and "
      "dK = dS^T Q * scale -- exactly one, after the matrix product -- and none into dV. A ratio "
      "of 1/scale means the factor is missing, scale means it is applied twice.")
def _scale_factor(ctx):
    bad = ctx.bad_tensors()
    if not bad:
        return None

    def factor(r, t):
        s = r.case.scale_value
        if not (math.isfinite(t.ratio) and t.ratio_resid < 1e-2):
            return None
        for f in (1.0 / s, s, (1.0 / math.sqrt(r.case.D)) / s, s * math.sqrt(r.case.D), 1 / s ** 2, s ** 2):
            if abs(t.ratio / f - 1.0) < 2e-2:
                return f
        return None

    if all(factor(r, t) is not None for r, t in bad):
        parts = [f"'{r.case.name}' {t.name}: yours / reference = {t.ratio:.4g} (scale = "
                 f"{r.case.scale_value:.4g}, 1/scale = {1 / r.case.scale_value:.4g})" for r, t in bad[:3]]
        return "; ".join(parts) + f"; {ctx.tensor_pattern()}"
    return None


@rule("heads", "only some (batch, head) pairs are right: a stride borrowed from another tensor",
      "Head 0 (or batch 0) is right and the others are not, so the offset of everything after the "
      "first head is wrong for some tensor -- typically that tensor's pointer is offset with "
      "another tensor's stride (dO with Q's head stride). Every tensor must use its own strides. "
      "The bug hides when all tensors share one layout: that is why the cases mix layouts.")
def _heads(ctx):
    seen = []
    for r, t in ctx.bad_tensors():
        ok = t.heads_ok
        if ok.numel() < 2:
            continue
        if not bool(ok.any()):
            return None
        seen.append((r, t))
    if not seen:
        return None
    r, t = seen[0]
    per = ", ".join(f"({b},{h}) {'ok' if t.heads_ok[b, h] else f'{float(t.per_head[b, h]):.0e}'}"
                    for b in range(t.per_head.shape[0]) for h in range(t.per_head.shape[1]))
    return f"case '{r.case.name}', {t.name} per (batch, head): {per}"


def _pattern_rule(prop_ids, kinds=None, exact: bool = True):
    def test(ctx):
        if ctx.kind not in (kinds or (ctx.kind,)):
            return None
        p = ctx.pattern
        base = p.id.split("&")[0] if p is not None else ""
        if p is None or not any(base == i or (i.endswith("*") and base.startswith(i[:-1])) for i in prop_ids):
            return None
        if exact and not ctx.exact:
            return None
        return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}"
    return test


rule("default_scale", "the scale you were given is not the one used",
     "Only the case with a custom scale fails: somewhere 1/sqrt(D) is used instead of the `scale` "
     "argument (when rebuilding S, or for the factor in dQ / dK).")(_pattern_rule(["custom_scale"]))

rule("gqa", "the K/V head of a query head is wrong (GQA)",
     "With grouped-query attention, query head h reads K/V head h // (H // H_kv), and dK, dV sum "
     "the contributions of every query head of the group.")(_pattern_rule(["gqa"]))


@rule("dv_formula", "only dV is wrong: dV = P^T dO, check its formula or a transpose",
      "dK and dQ need P too, and they are right, so P is right. dV = P^T dO: each key's row sums "
      "P[i, j] * dO[i] over the query rows i -- in a key-block program, the transposed tile P^T "
      "times the dO tile.")
def _dv_formula(ctx):
    if ctx.wrong_in("dV") and all(ctx.right_everywhere(n) for n in ("dK", "dQ") if n in ctx.names) \
            and any(n in ctx.names for n in ("dK", "dQ")):
        return ctx.tensor_pattern()
    return None


@rule("dq_formula", "only dQ is wrong: dQ = dS K * scale",
      "dK and dV are right, so P and dS are right: what is left is dQ's own product -- dS times K "
      "(not K^T, not dS^T), one factor of scale -- and where it is accumulated and stored.")
def _dq_formula(ctx):
    if ctx.wrong_in("dQ") and all(ctx.right_everywhere(n) for n in ("dK", "dV") if n in ctx.names) \
            and any(n in ctx.names for n in ("dK", "dV")):
        return ctx.tensor_pattern()
    return None


@rule("ds", "dV is right but dK / dQ are wrong: delta or dS is wrong",
      "dV = P^T dO needs only P, so P is fine. dK and dQ go through dS = P * (dP - delta) with "
      "dP = dO V^T and delta = rowsum(dO * O) (one number per query row). Check dP, the "
      "subtraction of delta and its broadcasting (one value per row).")
def _ds_formula(ctx):
    if "dV" in ctx.names and ctx.right_everywhere("dV") and \
            any(ctx.wrong_in(n) for n in ("dK", "dQ") if n in ctx.names):
        return ctx.tensor_pattern()
    return None


@rule("lse_output", "O is right but LSE is wrong",
      "LSE must be the natural log of the row's sum of exp(S): with the running maximum m and the "
      "running sum l of exp(S - m), LSE = m + log(l).", kinds=("online_softmax",))
def _lse_output(ctx):
    if "O" in ctx.names and ctx.right_everywhere("O") and ctx.wrong_in("LSE"):
        return ctx.tensor_pattern()
    return None


rule("causal", "only causal cases are wrong: the mask is on the wrong quantity or the wrong keys",
     "Hidden keys (j > i) must get P = 0: S = -inf before the softmax, or P = 0 after rebuilding "
     "it -- not S = 0 (exp(0) = 1), not only on dP or dS. The loop bounds must still visit every "
     "visible key. Note: under a causal mask, row 0 of dQ is zero (row 0 sees one key); if the "
     "function under test is your *reference*, test the test.")(_pattern_rule(["causal"], exact=False))

rule("rescale", "wrong only when the keys come in several blocks: running sums not rescaled",
     "When the running maximum grows from m_old to m_new, everything accumulated so far (the sum "
     "l and the output accumulator) must be multiplied by exp(m_old - m_new) before the new "
     "block is added.", )(_pattern_rule(["multi_block"], kinds=("online_softmax",)))

rule("rows_bound", "a bound or mask on the query rows uses S_k",
     "Wrong exactly where there are more query rows than keys: rows past S_k are never visited, "
     "or masked away, because a loop bound or a row mask uses S_k where S_q belongs.",
     )(_pattern_rule(["sq_gt_sk"], exact=False))

rule("keys_bound", "a bound or mask on the keys uses S_q",
     "Wrong exactly where there are more keys than query rows: keys past S_q are never visited, "
     "or masked away, because a loop bound or a key mask uses S_q where S_k belongs.",
     )(_pattern_rule(["sq_lt_sk"], exact=False))

rule("lengths_mixed", "S_q and S_k are mixed up somewhere",
     "Wrong only where S_q != S_k: a bound, mask or shape uses one length for the other.",
     )(_pattern_rule(["sq_ne_sk"]))

rule("query_blocks", "wrong only where S_q spans several query blocks: the loop over query blocks",
     "A key-block program must visit every query block that sees its keys and add up their "
     "contributions: each iteration loads the block it steps to (offsets from the loop variable, "
     "not from the program id) and adds (+=) into dK, dV, stored once after the loop.",
     kinds=("dkdv",))(_pattern_rule(["multi_q*"]))

rule("key_blocks", "wrong only where S_k spans several key blocks: the loop over key blocks",
     "A query-block program must visit every key block its rows see and add up their "
     "contributions: each iteration loads the key block it steps to and adds (+=) into dQ, "
     "stored once after the loop.", kinds=("dq",))(_pattern_rule(["multi_k*"]))

rule("padding", "only lengths that are not block multiples are wrong: the partial last block",
     "Rows and keys past S_q / S_k must be masked in every load and get P = 0, and the loops "
     "and the grid must cover the partial last block.")(_pattern_rule(["ragged*"], exact=False))

rule("do_strides", "only the cases with an unusual dO are wrong: dO's own strides",
     "dO arrives as autograd makes it: contiguous, a strided view, or one number expanded to the "
     "whole shape (every stride 0, after out.sum()). Offset dO with its own four strides, "
     "never assume it is contiguous, never copy another tensor's strides.",
     )(_pattern_rule(["do_stride0", "do_strided"]))

rule("strides", "only non-contiguous inputs are wrong: offsets computed from shapes, not strides",
     "Contiguous inputs pass, strided ones (transposed [B, S, H, D] views, slices) fail. Pass "
     "every tensor's own .stride() to the kernel and use it for every offset, including the last "
     "dimension's stride.")(_pattern_rule(["strided", "qkv_strided"], exact=False))


@rule("everything_wrong", "every case and every head is wrong: P is not the forward's softmax",
      "The backward rebuilds P = exp(S - LSE) with S = Q K^T * scale computed exactly as in the "
      "forward (same scale, same mask) and LSE the forward's natural-log log-sum-exp. Check the "
      "scores first (the scale, which of q and k is transposed), then the exponent.")
def _everything(ctx):
    if ctx.failing and len(ctx.failing) == len(ctx.results) and \
            all(not bool(t.heads_ok.any()) for r in ctx.failing for t in r.bad()):
        return ctx.tensor_pattern()
    return None


@rule("pattern", "no classic mistake fits; here is the pattern that was seen",
      "Compare the failing and the passing cases in the table: what do the failing ones share, "
      "which outputs are wrong, and in which rows?")
def _pattern(ctx):
    if not ctx.failing:
        return None
    r = ctx.failing[0]
    t = r.bad()[0] if r.bad() else None
    rows = ""
    if t is not None and t.row_err.numel() > 1:
        what = "keys" if t.name in ("dK", "dV") else "rows"
        rows = f"; in '{r.case.name}', {t.name}: wrong {what} {_ranges(t.bad_rows())} of 0-{t.row_err.numel() - 1}"
    return f"{ctx.case_pattern()}; {ctx.tensor_pattern()}{rows}"


def diagnose(results: list, kind: str) -> list:
    """The first rule that fits, as a one-element list of :class:`Diagnosis` ([] if all passed)."""
    ctx = Context(results, kind)
    if not ctx.failing:
        return []
    for r in RULES:
        if r.kinds is not None and kind not in r.kinds:
            continue
        evidence = r.test(ctx)
        if evidence is not None:
            return [Diagnosis(r.id, r.title, r.idea, evidence)]
    return []


def _ranges(idx, limit: int = 6) -> str:
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
