"""flashattn.check's engine: one registry of mistakes, one ordered list per checker, and the first
mistake of that list whose test fits is the diagnosis. (The orders themselves are compared with
their record by test_golden_diagnoses.py; every mistake is triggered by test_check.py's
test_every_diagnosis_is_proven.)"""
import pytest

from flashattn import check
from flashattn.check import checkers, engine
from flashattn.check.__main__ import listing, main
from flashattn.check.results import CaseResult


def test_every_mistake_has_one_row_and_every_row_a_mistake():
    rows = [mid for stage in checkers.STAGES for mid, _ in stage.rows]
    assert sorted(rows) == sorted(check.MISTAKES)
    for stage in checkers.STAGES:
        for mid, who in stage.rows:
            assert check.MISTAKES[mid].stage == stage.name, mid
            assert who and all(c in checkers.EVERY for c in who), mid


def test_a_checker_tries_its_rows_stage_by_stage():
    for c in checkers.EVERY:
        expected = [mid for stage in checkers.STAGES for mid, who in stage.rows if c in who]
        assert list(c.order) == expected, c.name
    assert checkers.DQ.order[:3] == ("accumulator_precision", "not_implemented", "no_kernel")


def test_verify_names_a_row_without_a_mistake_and_a_mistake_without_a_row():
    extra = engine.Stage(engine.FALLBACK, checkers.FALLBACK_TABLE.rows + (("no_such_mistake", checkers.EVERY),))
    stages = checkers.STAGES[:-1] + (extra,)
    with pytest.raises(ValueError, match="'no_such_mistake' has a row but no record"):
        engine.verify(stages)
    short = engine.Stage(engine.FALLBACK, checkers.FALLBACK_TABLE.rows[:-1])
    with pytest.raises(ValueError, match="'pattern' is tried by no checker"):
        engine.verify(checkers.STAGES[:-1] + (short,))


def test_the_first_fitting_mistake_of_the_order_names_it(monkeypatch):
    """Two mistakes that both fit: the one earlier in the checker's order is the diagnosis."""
    seen = []
    fits = lambda mid: lambda ctx: seen.append(mid) or f"{mid} fits"      # noqa: E731
    monkeypatch.setitem(engine.MISTAKES, "first", engine.Mistake("first", engine.FALLBACK, "t1", "i1", fits("first"), "-"))
    monkeypatch.setitem(engine.MISTAKES, "second", engine.Mistake("second", engine.FALLBACK, "t2", "i2", fits("second"), "-"))
    checker = engine.Checker("toy", "00", "a toy")
    failing = CaseResult(check.BATTERY[0], error=RuntimeError("boom"))
    checker.order = ("second", "first")
    assert [d.id for d in engine.diagnose([failing], checker)] == ["second"] and seen == ["second"]
    checker.order = ("first", "second")
    assert [d.id for d in engine.diagnose([failing], checker)] == ["first"]
    assert engine.diagnose([CaseResult(check.BATTERY[0])], checker) == []      # nothing failed: no mistake


def test_a_mistake_is_registered_once_and_in_a_known_stage():
    with pytest.raises(ValueError, match="registered twice"):
        engine.mistake("shape", engine.DID_NOT_RUN, "t", "i", proof="x", test=lambda ctx: None)
    with pytest.raises(ValueError, match="unknown stage"):
        engine.mistake("a_new_one", "some stage", "t", "i", proof="x", test=lambda ctx: None)
    with pytest.raises(ValueError, match="no proof"):
        engine.mistake("a_new_one", engine.FALLBACK, "t", "i", proof="", test=lambda ctx: None)
    assert "a_new_one" not in engine.MISTAKES


def test_list_prints_the_order(capsys):
    text = listing("dq_kernel")
    ids = [line.split()[1] for line in text.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert ids == list(checkers.DQ.order)
    assert "\nmemory\n" in text and "read_past_end" in text
    assert main(["--list", "check.window_mask"]) == 0 and "window_left_off" in capsys.readouterr().out
    assert main(["--list", "02"]) == 0           # an exercise: both its checkers
    out = capsys.readouterr().out
    assert "check.rebuild_p" in out and "check.online_softmax" in out and "check.dq_kernel" not in out
    assert [c.name for c in checkers.by_name("3")] == ["dq_kernel"]
    assert main(["--list", "11"]) == 0           # exercise 11: the merge, then the ring's backward
    out = capsys.readouterr().out
    assert out.index("check.merge_partials") < out.index("check.ring_backward") and "ring_stale_kv" in out
    assert main(["--list", "no_such_checker"]) == 2
    capsys.readouterr()
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out for c in checkers.EVERY)
