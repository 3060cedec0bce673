"""The checkers against their record, tests/golden/check_diagnoses.json (made by
``python tests/golden/check_diagnoses.py``, which says what it runs): every checker's ordered list
of diagnoses, exactly; the record covers every known mistake; and the first diagnoses of a
representative subset, recomputed here.

The subset: every 9th blind-set variant and planted kernel bug, in the record's (sorted) order --
46 of the 414, from every exercise the blind sets cover (all but exercise 11, newer than them). The one-line edits of the solutions (``slips/``, ``beyond/``)
are left out here because their own tests (test_check_slips.py, test_check_code.py,
test_check_beyond.py) already assert the same first diagnosis the record holds; the whole record
is recomputed by ``python tests/golden/check_diagnoses.py --check`` (about 15 minutes of CPU).
"""
import json
import sys
from pathlib import Path

import pytest

from conftest import ON_GPU

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import check_diagnoses as golden  # noqa: E402

RECORD = json.loads(golden.GOLDEN.read_text())
SUBSET = [k for k in sorted(RECORD["first"]) if k.startswith(("blind/", "planted/"))][::9]


def test_every_checker_tries_the_recorded_order():
    assert golden.orders() == RECORD["orders"], "\n".join(
        golden.differences(RECORD, {"orders": golden.orders(), "first": RECORD["first"]}))


def test_the_record_covers_every_known_mistake():
    assert sorted(golden.variants()) == sorted(RECORD["first"])


#: checkers newer than every blind set (exercise 11): their record is their edits of the worked
#: solution (slips/11m/..., slips/11r/...), whose first diagnoses test_check_slips.py asserts
NO_BLIND_SET = {"merge_partials", "ring_backward"}


def test_the_subset_spans_every_checker():
    assert len(SUBSET) >= 40
    assert {golden.variants()[k][0] for k in SUBSET} == set(RECORD["orders"]) - NO_BLIND_SET
    recorded = {golden.variants()[k][0] for k in RECORD["first"]}
    assert NO_BLIND_SET <= recorded and NO_BLIND_SET <= set(RECORD["orders"])


@pytest.mark.skipif(ON_GPU, reason="the record is the CPU's: a GPU runs the kernels in fp16")
@pytest.mark.parametrize("key", SUBSET)
def test_first_diagnosis_as_recorded(key):
    assert golden.first_diagnosis(key) == RECORD["first"][key]
