"""Repository-wide pytest hook: in generated exercise notebooks, a cell expected to raise must raise.

The exercise notebooks (``exercises/``, and the bug-hunt lab's student version in
``notebooks/``) are generated from ``solutions/`` by ``python -m flashattn.exercises``. Their
unfilled cells and the checker cells after them carry nbval's ``raises-exception`` tag, so nbval
lets them raise. But nbval does not fail when such a cell runs *without* an error -- so a checker
that silently passed unwritten code would go unnoticed. This hook closes that gap: in a notebook
whose metadata says it was generated (``metadata.flashattn.generated_from``), a cell tagged
``raises-exception`` that raised nothing fails the test.

Nothing here imports torch or flashattn: it costs nothing for the other tests.
"""
import pytest


def _must_raise(item) -> bool:
    options = getattr(item, "options", None)
    parent_nb = getattr(getattr(item, "parent", None), "nb", None)
    if options is None or parent_nb is None or not hasattr(item, "cell"):
        return False          # not an nbval cell
    generated = parent_nb.metadata.get("flashattn", {}).get("generated_from")
    return bool(generated) and bool(options.get("check_exception"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield            # an error inside the cell's own check propagates from here
    if _must_raise(item):
        outputs = getattr(item, "test_outputs", None)
        if outputs is None:
            pytest.fail("cannot tell whether this cell raised (nbval changed?): "
                        "conftest.py reads nbval's IPyNbCell.test_outputs", pytrace=False)
        if not any(o.get("output_type") == "error" for o in outputs):
            pytest.fail(
                f"{item.name} is tagged raises-exception in a generated exercise notebook, so it "
                "must raise (its code is not written yet), but it ran without an error. A checker "
                "that passes unwritten code, or a stub that no longer raises?\n"
                f"Cell source:\n{item.cell.source}", pytrace=False)
    return result
