"""flashattn.settings: every FLASHATTN_* switch read once, in one place, listed in one table."""
import re
from pathlib import Path

import pytest

from flashattn import settings

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_and_each_variable():
    assert settings.read({}) == settings.Settings()
    got = settings.read({"FLASHATTN_TMA": "0", "FLASHATTN_TMA_STATS": "0", "FLASHATTN_SPLIT_D": "0",
                         "FLASHATTN_SPLIT_DKDV": "0", "FLASHATTN_FP32_PIECES": "0",
                         "FLASHATTN_FP32_PRECISION": " TF32X3 ", "FLASHATTN_AUTOTUNE": "yes",
                         "FLASHATTN_DIRECT_LAUNCH": "0", "FLASHATTN_PLANS": "0", "FLASHATTN_MAX_SHARED_MEMORY": "64K",
                         "FLASHATTN_POISON": "1", "FLASHATTN_GLUON": "0"})
    assert got == settings.Settings(tma=False, tma_stats=False, split_d=False, split_dkdv=False,
                                    fp32_pieces=False, fp32_precision="tf32x3", autotune=True,
                                    direct_launch=False, plans=False, max_shared_memory=65536, poison=True,
                                    gluon=False)
    assert settings.read({"FLASHATTN_TMA": "1", "FLASHATTN_AUTOTUNE": "0", "FLASHATTN_GLUON": "1"}) == settings.Settings()


@pytest.mark.parametrize("name, raw, message", [("FLASHATTN_MAX_SHARED_MEMORY", "lots", "number of bytes"),
                                                ("FLASHATTN_MAX_SHARED_MEMORY", "1K", "below 16 KB"),
                                                ("FLASHATTN_FP32_PRECISION", "tf32", "must be one of")])
def test_a_bad_value_is_named(name, raw, message):
    with pytest.raises(ValueError, match=f"{name}.*{message}|{message}"):
        settings.read({name: raw})


def test_override_is_undone():
    before = settings.current
    with settings.override(tma=False, split_d=False) as inside:
        assert settings.current is inside and not inside.tma and not inside.split_d
    assert settings.current is before


def test_no_module_but_settings_reads_a_switch_from_the_environment():
    """Read once: the hot path never asks the environment (a few microseconds per call each)."""
    offenders = []
    for path in (ROOT / "flashattn").rglob("*.py"):
        if path.name == "settings.py":
            continue
        text = path.read_text()
        if re.search(r"environ(\.get)?[\[(]\s*[\"']FLASHATTN_(?!EMULATION)", text) or \
                re.search(r"environ(\.get)?[\[(]\s*\w+_ENV\b", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_the_readme_lists_every_switch_in_one_table():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(FLASHATTN_[A-Z0-9_]+)", readme, flags=re.M)
    assert sorted(set(rows)) == sorted(name for name, _ in settings.VARIABLES.values())
    assert len(rows) == len(set(rows))
