"""viz helpers of lessons 03/04: the tile classes agree with the real kernels' loop bounds,
the error measure is right, and every figure builds headless (Agg)."""
import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
import torch

import flashattn
from flashattn import backward, planted, viz
from flashattn.reference import causal_mask

# Trip counters: the real kernels with their accumulation replaced by "+= 1", so each output
# row ends up holding the number of tiles its program's loop visited (scale = 1).
DQ_TRIPS = planted.Edit("dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)", "dq += 1.0")
DKDV_TRIPS = planted.Edit("dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)", "dk += 1.0")

SHAPES = [(37, 37, 16, 16), (29, 53, 16, 8), (37, 53, 16, 8), (53, 29, 16, 16), (40, 40, 16, 32), (16, 48, 16, 16)]


def _inputs(S_q, S_k, D=16):
    dev = flashattn.default_device()
    q, do = torch.randn(1, 1, S_q, D, device=dev), torch.randn(1, 1, S_q, D, device=dev)
    k, v = torch.randn(1, 1, S_k, D, device=dev), torch.randn(1, 1, S_k, D, device=dev)
    lse = torch.zeros(1, 1, S_q, device=dev)
    return q, k, v, do, lse, torch.zeros_like(lse)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S_q,S_k,BM,BN", SHAPES)
def test_visited_tiles_match_the_kernels_loops(S_q, S_k, BM, BN, causal):
    classes = viz.causal_tile_classes(S_q, S_k, BM, BN, causal)
    visited = classes != viz.TILE_SKIPPED
    cfg = flashattn.KernelConfig(BM, BN)
    q, k, v, do, lse, delta = _inputs(S_q, S_k)
    with planted.planted_bug(backward, "attn_bwd_dq_kernel", [DQ_TRIPS]):
        trips_q = flashattn.attention_backward_dq(q, k, v, do, lse, delta, causal, 1.0, config=cfg)
    with planted.planted_bug(backward, "attn_bwd_dkdv_kernel", [DKDV_TRIPS]):
        trips_k, _ = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, causal, 1.0, config=cfg)
    per_q_block = trips_q[0, 0, ::BM, 0].round().long().cpu().numpy()
    per_k_block = trips_k[0, 0, ::BN, 0].round().long().cpu().numpy()
    assert (per_q_block == visited.sum(axis=1)).all()
    assert (per_k_block == visited.sum(axis=0)).all()


@pytest.mark.parametrize("S_q,S_k,BM,BN", SHAPES)
def test_diagonal_tiles_are_those_the_element_mask_splits(S_q, S_k, BM, BN):
    classes = viz.causal_tile_classes(S_q, S_k, BM, BN, True)
    mask = causal_mask(S_q, S_k).numpy()
    for m in range(classes.shape[0]):
        for n in range(classes.shape[1]):
            tile = mask[m * BM:(m + 1) * BM, n * BN:(n + 1) * BN]
            if tile.all():
                assert classes[m, n] == viz.TILE_FULL
            elif tile.any():
                assert classes[m, n] == viz.TILE_DIAGONAL
            else:  # nothing visible: skipped by the loop bounds, or visited in vain
                assert classes[m, n] in (viz.TILE_SKIPPED, viz.TILE_EMPTY)


def test_ragged_last_block_can_visit_a_tile_in_vain():
    # rows 32..36 of the last 16-row block; the loop runs to key 47, but keys 40..47 are hidden
    classes = viz.causal_tile_classes(37, 53, 16, 8)
    assert classes[2, 5] == viz.TILE_EMPTY and (classes == viz.TILE_EMPTY).sum() == 1


def test_tile_counts_square_causal():
    # 4 x 4 blocks, square: 4 diagonal tiles, 6 full below them, 6 skipped above.
    classes = viz.causal_tile_classes(64, 64, 16, 16)
    assert (classes == viz.TILE_DIAGONAL).sum() == 4
    assert (classes == viz.TILE_FULL).sum() == 6
    assert (classes == viz.TILE_SKIPPED).sum() == 6
    assert (viz.causal_tile_classes(64, 64, 16, 16, causal=False) == viz.TILE_FULL).all()


def test_row_relative_errors():
    e = torch.randn(2, 3, 10, 8, dtype=torch.float64)
    a = e.clone()
    a[1, 2, 4] += 1.0
    a[1, 0, 7] = float("nan")
    err = viz.row_relative_errors(a, e, batch=1)
    assert err.shape == (10, 3)
    typical = e[1, 2].norm(dim=-1).pow(2).mean().sqrt()
    assert err[4, 2] == pytest.approx(float(torch.ones(8).norm() / typical))
    assert np.isnan(err[7, 0]) and np.nansum(err) == pytest.approx(err[4, 2])
    assert (viz.row_relative_errors(a, e, batch=0) == 0).all()


def test_figures_build():
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(1, 5, figsize=(16, 3))
    viz.plot_causal_tiles(37, 53, 16, 8, ax=axs[0])
    viz.plot_causal_tiles(37, 37, 16, 16, causal=False, ax=axs[1], legend=False)
    viz.plot_tile_ownership(37, 37, 16, 16, kernel="dq", ax=axs[2])
    viz.plot_tile_ownership(37, 37, 16, 16, kernel="dkdv", ax=axs[3])
    a = torch.randn(1, 2, 20, 8)
    viz.plot_row_error_heatmap(a + 1e-4, a, block=8, ax=axs[4], title="t")
    fig.canvas.draw()
    plt.close(fig)
    with pytest.raises(ValueError):
        viz.plot_tile_ownership(8, 8, 4, 4, kernel="fwd")


def test_show_numbered_source(capsys):
    viz.show_numbered_source(backward.attn_bwd_dq_kernel, start="kv_end = S_k", stop="for start_n")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# flashattn/backward.py, lines ")
    assert "kv_end = S_k" in out[1] and "for start_n" in out[-1]
    first = int(out[1].split("|")[0])
    with open(backward.__file__) as f:
        assert "kv_end = S_k" in f.read().splitlines()[first - 1]
    with pytest.raises(ValueError):
        viz.show_numbered_source(backward.attn_bwd_dq_kernel, start="no such text")
