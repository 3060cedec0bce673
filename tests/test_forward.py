"""Forward kernel: O and LSE against the float64 reference, every head checked separately."""
import pytest
import torch

import flashattn
from flashattn import KernelConfig

from conftest import DTYPES, TOL, assert_close_per_head, rand, reference

SMALL = KernelConfig(16, 16)  # forces several blocks on small inputs (interpreter and GPU)

# (B, H, H_kv, S_q, S_k, D): a single token, odd lengths, S_q != S_k both ways, GQA, MQA,
# head dims that are not powers of two, and the largest supported head dim.
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 3, 3, 37, 37, 64),
    (2, 4, 2, 50, 23, 40),
    (1, 4, 1, 23, 50, 24),
    (1, 2, 2, 33, 17, 256),
    (3, 2, 1, 16, 48, 96),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}Sq{}Sk{}D{}".format(*s))
def test_forward_matches_reference(shape, causal):
    B, H, H_kv, S_q, S_k, D = shape
    q, k, v = rand(B, H, S_q, D), rand(B, H_kv, S_k, D), rand(B, H_kv, S_k, D)
    o, lse = flashattn.attention_forward(q, k, v, causal, config=SMALL)
    ref = reference(q, k, v, causal=causal)
    assert_close_per_head("O", o, ref["O"], TOL[torch.float32])
    assert lse.dtype == torch.float32 and lse.shape == (B, H, S_q)
    assert_close_per_head("LSE", lse, ref["LSE"], TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_dtypes(dtype, causal):
    q, k, v = (rand(2, 3, 45, 64, dtype=dtype) for _ in range(3))
    o, lse = flashattn.attention_forward(q, k, v, causal)
    assert o.dtype == dtype
    ref = reference(q, k, v, causal=causal)
    assert_close_per_head("O", o, ref["O"], TOL[dtype])
    assert_close_per_head("LSE", lse, ref["LSE"], TOL[torch.float32])


@pytest.mark.parametrize("layouts", [("bshd", "bshd", "bshd"), ("sliced", "contiguous", "bshd"),
                                     ("padded_heads", "sliced", "padded_heads")], ids=str)
def test_forward_any_strides(layouts):
    lq, lk, lv = layouts
    q, k, v = rand(2, 4, 29, 32, layout=lq), rand(2, 2, 41, 32, layout=lk), rand(2, 2, 41, 32, layout=lv)
    assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    o, lse = flashattn.attention_forward(q, k, v, True, config=SMALL)
    ref = reference(q, k, v, causal=True)
    assert_close_per_head("O", o, ref["O"], TOL[torch.float32])


def test_scale_argument():
    q, k, v = (rand(1, 2, 20, 32) for _ in range(3))
    o, lse = flashattn.attention_forward(q, k, v, False, scale=0.37)
    ref = reference(q, k, v, scale=0.37)
    assert_close_per_head("O", o, ref["O"], TOL[torch.float32])
    assert_close_per_head("LSE", lse, ref["LSE"], TOL[torch.float32])


def test_lse_rebuilds_softmax_exactly():
    """P = exp(S - LSE) with the kernel's LSE equals softmax(S): the basis of the backward.
    (D = 64 makes the scale 1/8 exact: on a GPU Triton passes a float argument as fp32.)"""
    q, k, v = (rand(1, 3, 40, 64, dtype=torch.float64) for _ in range(3))
    _, lse = flashattn.attention_forward(q, k, v, True)
    ref = flashattn.attention_reference(q, k, v, causal=True)
    P = torch.exp(ref.S - lse[..., None])
    assert_close_per_head("P", P, ref.P, 1e-12)
