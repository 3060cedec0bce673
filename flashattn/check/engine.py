"""The checkers' engine: mistakes, checkers, and the diagnosis.

A *mistake* is one record (:class:`Mistake`): its id, its stage, the title and the idea the learner
reads, the test that reads the evidence, and the variant that proves it. :func:`mistake` registers
one in :data:`MISTAKES` -- the only way there is -- and gives it no place in any order: a
:class:`Checker` owns the ordered list of the mistakes it tries (``checker.order``, made in
:mod:`flashattn.check.checkers` from its stage tables), and :func:`diagnose` tries them in that
order. The first test that returns evidence names the mistake.

A test takes the :class:`~flashattn.check.evidence.Evidence` of one run and returns None (not this
mistake), the evidence as text, or ``(evidence, idea)`` where what was seen changes the idea.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .evidence import Evidence
from .results import Diagnosis

# --------------------------------------------------------------------------------------
# the stages, in the order every checker tries them (checkers.py holds each stage's table)
# --------------------------------------------------------------------------------------
DID_NOT_RUN = "did not run"                # not written, no kernel, wrong order, dtype or shape
CODE = "a line of the code"                # a slip one line of the learner's code shows
RAN_BADLY = "raised, wrote an input, raced"
LAUNCH = "the launch"                      # what the launcher handed the kernel; stray addresses
LESSON_09 = "window and dropout"           # lesson 09's checkers
PINNED = "a pattern that pins the cause"   # a batch offset, the head-dim mask, GQA heads, strides
MEMORY = "memory"                          # past the end, never written
FORMULA = "a known wrong formula"          # the outputs equal a wrong computation, exactly
OUTPUTS = "how the outputs are wrong"   # zero, equal to another tensor, NaN in row 0 only, +inf
FORMULA_LINE = "a formula's line"          # a line of the formulas, after the exact matches
NUMBERS = "NaN and constant factors"       # NaN, writes past the end, a sign, a factor, rounding
FALLBACK = "what was seen"                 # which heads, outputs and cases are wrong

STAGES = (DID_NOT_RUN, CODE, RAN_BADLY, LAUNCH, LESSON_09, PINNED, MEMORY, FORMULA, OUTPUTS, FORMULA_LINE,
          NUMBERS, FALLBACK)


@dataclass(frozen=True)
class Mistake:
    """One diagnosis the checkers can give."""

    id: str
    stage: str                  # one of STAGES: the stage table of checkers.py that lists it
    title: str                  # what is wrong, one line
    idea: str                   # the principle to check, in words (no code)
    test: Callable              # Evidence -> None | evidence | (evidence, idea)
    proof: str                  # a variant that triggers it (a key of tests/golden/check_diagnoses.py)
    when_passing: bool = False  # tried even when every case passed (it reads the code)


#: id -> Mistake: every mistake registered (the package's __init__ imports the modules that do)
MISTAKES: dict = {}


def mistake(id: str, stage: str, title: str, idea: str, *, proof: str, test: Optional[Callable] = None,
            when_passing: bool = False):
    """Register mistake ``id``. Used as a decorator over its test, or with ``test=`` (a test made
    by a helper: ``matches("no_delta")``, ``quoted_line(pattern)``). ``proof``: a variant whose
    first diagnosis is this mistake -- a key of tests/golden/check_diagnoses.py (an edit of a worked
    solution, a planted kernel bug, a blind-set variant, one of the tests' examples), which
    test_every_diagnosis_is_proven runs."""
    if stage not in STAGES:
        raise ValueError(f"mistake {id!r}: unknown stage {stage!r} (one of engine.STAGES)")
    if not proof:
        raise ValueError(f"mistake {id!r}: no proof (a variant that triggers it)")

    def register(fn):
        if id in MISTAKES:
            raise ValueError(f"mistake {id!r} is registered twice")
        MISTAKES[id] = Mistake(id, stage, title, idea, fn, proof, when_passing)
        return fn
    return register if test is None else register(test)


class Checker:
    """One exercise's checker as the engine knows it: the public function (``check.<name>``), the
    exercise, and ``order``, the ids of the mistakes it tries, first to last."""

    def __init__(self, name: str, exercise: str, what: str):
        self.name = name
        self.exercise = exercise
        self.what = what
        self.order: tuple = ()          # set once, by checkers.py, from the stage tables

    def __repr__(self) -> str:
        return f"<Checker check.{self.name}: exercise {self.exercise}, {len(self.order)} mistakes>"


@dataclass(frozen=True)
class Stage:
    """One stage's table: (mistake id, the checkers that try it), in the order they are tried."""

    name: str
    rows: tuple


def assemble(stages: tuple, checkers: tuple) -> None:
    """Give every checker its order: its rows, stage by stage."""
    if tuple(s.name for s in stages) != STAGES:
        raise ValueError("the stage tables must follow engine.STAGES")
    ids = [mid for s in stages for mid, _ in s.rows]
    if len(ids) != len(set(ids)):
        raise ValueError(f"a mistake is in two rows: {sorted({i for i in ids if ids.count(i) > 1})}")
    for s in stages:
        for mid, who in s.rows:
            if not who or any(c not in checkers for c in who):
                raise ValueError(f"row {mid!r} of stage {s.name!r} names no checker or an unknown one")
    for checker in checkers:
        checker.order = tuple(mid for s in stages for mid, who in s.rows if checker in who)


def verify(stages: tuple) -> None:
    """Every row's mistake registered, in its own stage; every registered mistake in a row.
    (The package calls it once its modules have registered theirs: a slip fails at import.)"""
    rows = {mid: s.name for s in stages for mid, _ in s.rows}
    problems = [f"{mid!r} has a row but no record" for mid in rows if mid not in MISTAKES]
    problems += [f"{mid!r} is tried by no checker (add its row to a stage table)" for mid in MISTAKES if mid not in rows]
    problems += [f"{mid!r} is a {MISTAKES[mid].stage!r} mistake in the {stage!r} table" for mid, stage in rows.items()
                 if mid in MISTAKES and MISTAKES[mid].stage != stage]
    if problems:
        raise ValueError("flashattn.check's mistakes and stage tables disagree: " + "; ".join(problems))


def diagnose(results: list, checker: Checker, subject=None) -> list:
    """The first of ``checker``'s mistakes whose test fits, as a one-element list of
    :class:`Diagnosis` ([] if none). With no case failing only the mistakes that read the code
    (``when_passing``) are tried. ``subject``: the learner's function or launcher."""
    ev = Evidence(results, checker, subject)
    for mid in checker.order:
        m = MISTAKES[mid]
        if not ev.failing and not m.when_passing:
            continue
        found = m.test(ev)
        if found is not None:
            evidence, idea = found if isinstance(found, tuple) else (found, m.idea)
            return [Diagnosis(m.id, m.title, idea, evidence)]
    return []
