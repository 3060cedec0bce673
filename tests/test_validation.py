"""Bad input gets a TypeError / ValueError that names what was expected and what came."""
import pytest
import torch

import flashattn
from flashattn import flash_attention

from conftest import ON_GPU, rand


def ok(B=1, H=2, H_kv=2, S_q=8, S_k=8, D=16, dtype=torch.float32):
    return rand(B, H, S_q, D, dtype=dtype), rand(B, H_kv, S_k, D, dtype=dtype), rand(B, H_kv, S_k, D, dtype=dtype)


CASES = {
    "q not a tensor": (lambda q, k, v: ([[1.0]], k, v), TypeError, "q must be a torch.Tensor"),
    "3-D q": (lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-D \[B, H, S_q, D\], got 3-D"),
    "5-D k": (lambda q, k, v: (q, k[None], v), ValueError, "k must be 4-D"),
    "dtype mismatch": (lambda q, k, v: (q, k.double(), v), TypeError, "share one dtype"),
    "integer dtype": (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "torch.int32 is not supported"),
    "batch mismatch": (lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), ValueError,
                       "batch size differs: q has B=1, k and v have B=2"),
    "head dim mismatch": (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head dim differs"),
    "k and v differ": (lambda q, k, v: (q, k, v[:, :, :4]), ValueError, "k and v must have the same shape"),
    "H not multiple of H_kv": (lambda q, k, v: (q, torch.cat([k] * 3, 1)[:, :3], torch.cat([v] * 3, 1)[:, :3]),
                               ValueError, "H=2 and H_kv=3"),
    "D not multiple of 8": (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), ValueError,
                            "multiple of 8 and at most 256, got D=12"),
    "D too large": (lambda q, k, v: tuple(torch.cat([t] * 17, -1) for t in (q, k, v)), ValueError, "got D=272"),
    "empty sequence": (lambda q, k, v: (q[:, :, :0], k, v), ValueError, "q is empty"),
    "empty batch": (lambda q, k, v: (q[:0], k[:0], v[:0]), ValueError, "is empty"),
}


@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_bad_input_is_named(case):
    make, exc, message = CASES[case]
    q, k, v = make(*ok())
    with pytest.raises(exc, match=message):
        flash_attention(q, k, v)


def test_device_mismatch_or_cpu_tensor_on_gpu():
    q, k, v = ok()
    if ON_GPU:
        with pytest.raises(ValueError, match="must be CUDA tensors"):
            flash_attention(q.cpu(), k.cpu(), v.cpu())
        with pytest.raises(ValueError, match="one device"):
            flash_attention(q, k.cpu(), v)
    else:
        meta = k.to("meta")
        with pytest.raises(ValueError, match="one device"):
            flash_attention(q, meta, v)


@pytest.mark.parametrize("causal, scale, exc, message", [
    (1, None, TypeError, "causal must be a bool, got int"),
    (False, "0.1", TypeError, "scale must be a float or None, got str"),
    (False, float("nan"), ValueError, "scale must be finite"),
])
def test_bad_options(causal, scale, exc, message):
    q, k, v = ok()
    for _ in range(2):   # the second time too: a call of a signature seen before is checked again when it is bad
        with pytest.raises(exc, match=message):
            flash_attention(q, k, v, causal=causal, scale=scale)


def test_unhashable_options_get_the_validation_message():
    """Validation is cached per signature (api._checked); an argument that cannot be a key still
    gets the clear error, not 'unhashable type'."""
    q, k, v = ok()
    flash_attention(q, k, v, causal=True)                   # a signature seen
    with pytest.raises(TypeError, match="scale must be a float or None, got list"):
        flash_attention(q, k, v, causal=True, scale=[0.1])
    with pytest.raises(TypeError, match="causal must be a bool, got list"):
        flash_attention(q, k, v, causal=[True])
    import numpy as np
    from flashattn import scaled_dot_product_attention

    out = scaled_dot_product_attention(q, k, v, enable_gqa=np.array(True))   # SDPA takes a truthy array too
    assert out.shape == q.shape


def test_bad_grad_output_shape():
    q, k, v = ok()
    o, lse = flashattn.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="dO must have the output's shape"):
        flashattn.attention_backward_delta(o, o[:, :, :3])


def test_error_message_shows_what_came():
    q, k, v = ok()
    with pytest.raises(ValueError) as info:
        flash_attention(q[0], k, v)
    assert "(2, 8, 16)" in str(info.value)


@pytest.mark.parametrize("which, make, message", [
    ("delta", lambda t: t[..., None], r"delta must be \[B, H, S_q\] = \[1, 2, 8\].*got \[1, 2, 8, 1\] -- a trailing "
                                      r"axis of size 1"),
    ("lse", lambda t: t.transpose(-1, -2).contiguous()[..., :2, :], r"lse must be \[B, H, S_q\] = \[1, 2, 8\]"),
    ("delta", lambda t: t.tolist(), "delta must be a torch.Tensor"),
])
@pytest.mark.parametrize("launcher", ["dq", "dkdv"])
def test_backward_launchers_name_a_bad_lse_or_delta(which, make, message, launcher):
    """attention_backward_dq / _dkdv take the forward's LSE and delta, one number per query row;
    a [..., S_q, 1] delta (a sum with keepdim=True) once surfaced as Python's 'multiple values
    for argument CAUSAL' from inside the kernel launch."""
    q, k, v = ok()
    do = torch.randn_like(q)
    o, lse = flashattn.attention_forward(q, k, v)
    stats = {"lse": lse, "delta": flashattn.attention_backward_delta(o, do)}
    stats[which] = make(stats[which])
    fn = flashattn.attention_backward_dq if launcher == "dq" else flashattn.attention_backward_dkdv
    with pytest.raises(TypeError if "torch.Tensor" in message else ValueError, match=message):
        fn(q, k, v, do, stats["lse"], stats["delta"])
