"""The figure helpers of lessons 02 and 05 (flashattn.viz): they draw, they check their
arguments, and the source printer shows the real file's lines."""
import inspect

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from flashattn import forward, viz  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_show_numbered_source_shows_the_files_own_lines(capsys):
    viz.show_numbered_source(forward.attn_fwd_kernel, start="m_new = tl.maximum", stop="m_i = m_new")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# flashattn/forward.py, lines ")
    lines, first = inspect.getsourcelines(forward.attn_fwd_kernel.fn)
    number, text = out[1].split(" | ", 1)
    assert text.strip() == lines[int(number) - first].strip()
    assert "m_new = tl.maximum" in out[1] and "m_i = m_new" in out[-1]


def test_show_numbered_source_refuses_a_missing_marker():
    with pytest.raises(ValueError, match="does not occur"):
        viz.show_numbered_source(forward.attention_forward, start="this text is not there")


def test_plot_program_tiles_draws_every_tile_and_the_side_blocks():
    ax = viz.plot_program_tiles(80, 72, 16, 16, program=2, step=3)
    # 5 x 5 tiles of S, plus the Q block, the LSE strip and the K/V block
    assert len(ax.patches) == 25 + 3
    ax = viz.plot_program_tiles(80, 72, 16, 16, program=3, step=1, causal=True)
    hatched = [p for p in ax.patches if p.get_hatch()]
    # tile (i, j) is never visited under the causal mask when its first key > its last query
    assert len(hatched) == sum(1 for i in range(5) for j in range(5) if 16 * j > 16 * (i + 1) - 1)


@pytest.mark.parametrize("kwargs", [dict(program=5), dict(program=3, step=4, causal=True)])
def test_plot_program_tiles_checks_program_and_step(kwargs):
    with pytest.raises(ValueError):
        viz.plot_program_tiles(80, 72, 16, 16, **kwargs)


def test_plot_memory_vs_seqlen_skips_missing_points_and_marks_oom():
    ax = viz.plot_memory_vs_seqlen([64, 128, 256], {"naive": [1e3, 4e3, None],
                                                    "flash (model)": [1e2, 2e2, 4e2]},
                                   oom={"naive": 256}, limit=1e5)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["naive"].get_xdata()) == [64, 128]
    assert lines["flash (model)"].get_linestyle() == "--"
    assert any("out of memory at S=256" in t.get_text() for t in ax.texts)
    assert viz._bytes_label(2.5e9) == "2.5 GB" and viz._bytes_label(512) == "512 B"


def test_plot_loss_curves_returns_both_panels():
    top, bottom = viz.plot_loss_curves({"SDPA": [3.0, 2.0, 1.0], "flash": [3.0, 2.0001, 1.0]})
    assert [line.get_label() for line in top.get_lines()] == ["SDPA", "flash"]
    assert len(bottom.get_lines()) == 1
    with pytest.raises(ValueError):
        viz.plot_loss_curves({})
