"""Exercise 11's checkers (flashattn.check.ring): their references against independent ones, the
ring simulated in one process against the whole sequence, and what they say about the package's
own merge. (Each diagnosis is proven by an edit of the worked solution in test_check_slips.py.)"""
import pytest
import torch

import flashattn
from conftest import run_checker
from flashattn import check
from flashattn.check import ring as checker_ring
from flashattn.check.ring import MERGE_CASES, RING_CASES, RING_SLIPS, merge_slips, simulate
from flashattn.distributed import layout, merge_
from flashattn.distributed.simulate import block_grads, ring_pass


def _make(case, make):
    return make(case, case.dtype or torch.float32, "cpu", 0, True)


def test_ring_pass_sends_each_item_to_the_next_rank():
    assert ring_pass(["a", "b", "c", "d"]) == ["d", "a", "b", "c"]       # rank 1 now holds rank 0's
    items = list(range(5))
    for _ in range(5):
        items = ring_pass(items)
    assert items == list(range(5))                                        # W passes: every item home


@pytest.mark.parametrize("causal", [False, True])
def test_block_grads_over_every_key_is_the_backward(causal):
    """One block holding every key, in float64: the oracle's dQ, dK, dV (GQA: 4 query heads, 2 K/V)."""
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(2, 4, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ref = flashattn.attention_reference(q, k, v, do, causal=causal, scale=0.4)
    pos = torch.arange(11)
    got = block_grads(q, k, v, do, ref.LSE, ref.delta, pos, pos, causal, 0.4)
    for mine, want in zip(got, (ref.dQ, ref.dK, ref.dV)):
        assert torch.allclose(mine, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: c.name)
def test_the_ring_reference_is_the_whole_backward(case):
    """The checker's reference equals the float64 oracle's gradients (up to the inputs' rounding of
    O and the LSE), and the ring simulated without a slip equals the reference."""
    x = _make(case, checker_ring._ring_make)
    whole = {n: layout.paste(getattr(x, n), case.W, case.ring_layout, 2).double() for n in ("q", "k", "v", "do")}
    ref = flashattn.attention_reference(whole["q"], whole["k"], whole["v"], whole["do"], causal=case.causal,
                                        scale=case.scale_value)
    tol = 1e-2 if case.dtype == torch.float16 else 1e-5      # O handed over in fp16 moves delta
    ring = simulate(x, case)
    for name, want in (("dQ", ref.dQ), ("dK", ref.dK), ("dV", ref.dV)):
        assert flashattn.verify.per_head_relative_error(x.expected[name], want).max() < tol, name
        assert torch.allclose(ring[name], x.expected[name], rtol=1e-9, atol=1e-11), name


@pytest.mark.parametrize("slip", RING_SLIPS)
def test_every_ring_slip_changes_the_gradients(slip):
    """A fingerprint the right answer also fits would prove nothing: each changes some case."""
    changed = False
    for case in RING_CASES:
        x = _make(case, checker_ring._ring_make)
        got = simulate(x, case, slip)
        changed |= any(not torch.allclose(got[n], x.expected[n], rtol=1e-6, atol=1e-8) for n in got)
    assert changed


@pytest.mark.parametrize("case", MERGE_CASES, ids=lambda c: c.name)
def test_the_merge_reference_is_attention_over_both_blocks(case):
    """Where every row saw a key of both blocks the reference is what the package's merge_ gives;
    the empty rows get LSE -inf and O 0."""
    x = _make(case, checker_ring._merge_make)
    want_o, want_lse = x.expected["O"], x.expected["LSE"]
    out, lse = x.o_a.float().clone(), x.lse_a.clone()
    merge_(out, lse, x.o_b, x.lse_b)
    both_empty = torch.isneginf(x.lse_a) & torch.isneginf(x.lse_b)
    assert bool(torch.isneginf(want_lse).eq(both_empty).all())
    assert bool((want_o[both_empty] == 0).all())
    seen = ~both_empty
    assert torch.allclose(out[seen].double(), want_o[seen], rtol=1e-5, atol=1e-6)
    assert torch.allclose(lse[seen].double(), want_lse[seen], rtol=1e-6, atol=1e-5)
    if case.spread > 10:      # the case for the overflow: e^LSE is inf in fp32
        assert bool(torch.isinf(torch.exp(x.lse_a)).any())
    for name, outs in merge_slips(x, case).items():
        assert set(outs) == {"O", "LSE"}, name


def test_the_packages_merge_is_named_on_rows_no_block_saw():
    """flashattn.distributed.merge_ never meets a row no block saw (step 0 of the ring covers every
    row); the exercise asks for that row too, and the checker names what merge_ does there."""
    def packaged(o_a, lse_a, o_b, lse_b):
        out, lse = o_a.float().clone(), lse_a.clone()
        merge_(out, lse, o_b, lse_b)
        return out, lse

    result = run_checker(check.merge_partials, packaged)
    assert result.hint_ids == ["merge_masked_rows"], result.report()
    failing = [r.case.name for r in result.results if not r.ok]
    assert failing == ["1x3x12, rows masked in a, b, both"]


def test_merge_cases_cover_what_the_exercise_promises():
    assert {c.o_dtype for c in MERGE_CASES} == {torch.float32, torch.float16}
    assert {c.masked for c in MERGE_CASES} == {"", "a", "both"}
    assert any(c.S_q == 1 for c in MERGE_CASES) and any(c.spread * 3 > 88 for c in MERGE_CASES)


def test_ring_cases_cover_what_the_exercise_promises():
    assert {c.W for c in RING_CASES} == {1, 2, 3, 4}
    assert {c.ring_layout for c in RING_CASES} == {"contiguous", "zigzag"}
    assert {c.causal for c in RING_CASES} == {False, True}
    assert any(c.heads_kv != c.H for c in RING_CASES) and any(c.dtype == torch.float16 for c in RING_CASES)
    assert any(c.scale is not None for c in RING_CASES) and any(c.B > 1 for c in RING_CASES)
    # an odd number of tokens per chunk (contiguous: per shard; zigzag: per half shard)
    assert any((c.S_q // c.W) % 2 for c in RING_CASES if c.ring_layout == "contiguous")
    assert any((c.S_q // (2 * c.W)) % 2 for c in RING_CASES if c.ring_layout == "zigzag")
