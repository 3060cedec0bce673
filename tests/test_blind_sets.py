"""The blind sets (tests/blind_sets): every variant still applies to the worked solutions it was
written against, its ids are unique, and every recorded first diagnosis is one the checker has.
(Running the sets through the checkers takes minutes: tests/blind_sets/run.py does it.)"""
import json
from pathlib import Path

import pytest

from blind_sets.run import load_set as _variants
from conftest import solution_code
from flashattn import check

HERE = Path(__file__).parent / "blind_sets"
SETS = sorted(p.stem[4:] for p in HERE.glob("set_*.py"))



@pytest.mark.parametrize("name", SETS)
def test_every_variant_applies_once(name):
    variants = _variants(name)
    ids = [v["id"] for v in variants]
    assert len(ids) == len(set(ids)), "duplicate ids"
    for v in variants:
        assert v["kind"] in ("bug", "harmless"), v["id"]
        assert v["truth"].strip(), v["id"]
        solution_code("09" if v["exercise"].startswith("09") else v["exercise"], [tuple(e) for e in v["edits"]])


def test_recorded_first_diagnoses_are_known():
    recorded = json.loads((HERE / "first_diagnoses.json").read_text())
    known = set(check.MISTAKES) | {"PASS"}
    assert set(recorded) == set(SETS)
    for name, firsts in recorded.items():
        assert set(firsts) == {v["id"] for v in _variants(name)}, name
        unknown = {i: h for i, h in firsts.items() if h not in known}
        assert not unknown, f"set {name}: {unknown}"
