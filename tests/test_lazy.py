"""Lazy attention (flashattn.lazy): kernels against autograd through the float64 formula.

Every gradient is checked head by head: O, dQ, dK, dV per (batch, head), dBias per row (head),
dTau per head. On the CPU (Triton interpreter) shapes are small, and the raw launchers get 16 x 16
blocks so that the tests cross block boundaries; on a GPU the same file also runs fp16/bf16 at
realistic sizes against a float64 reference computed one batch element at a time.
"""
import warnings

import pytest
import torch

import flashattn
from flashattn import KernelConfig, planted
from flashattn.lazy import kernels as lazy
from flashattn.lazy import lazy_attention
from flashattn.lazy.reference import (lazy_attention_reference, lazy_gradients_autograd,
                                      lazy_gradients_per_batch)

from conftest import DEVICE, ON_GPU, TOL, rand

SMALL = KernelConfig(16, 16)
NAMES = ("O", "dQ", "dK", "dV", "dBias", "dTau")

#: seed 004: every backward kernel offset dO with Q's head stride
DO_HEAD_STRIDE_BUG = planted.Edit("h.to(tl.int64) * stride_do_h", "h.to(tl.int64) * stride_q_h")
BACKWARD_KERNELS = ("lazy_bwd_preprocess_kernel", "lazy_bwd_dq_kernel", "lazy_bwd_dkdv_kernel")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def params(H, W, taus=None, dtype=torch.float32):
    bias = 0.5 * torch.randn(H, W + 1, dtype=dtype, device=DEVICE)
    if taus is None:
        taus = torch.linspace(-0.6, 0.9, H).tolist()
    return bias, torch.tensor(taus, dtype=dtype, device=DEVICE)


def per_head_errors(name, got, want):
    """Relative error per head: [B, H] for O/dQ/dK/dV, [H] for dBias (a row each) and dTau."""
    got, want = got.double(), want.double()
    if name == "dTau":
        floor = 1e-3 * float(want.norm()) + 1e-300
        return (got - want).abs() / want.abs().clamp_min(floor)
    if name == "dBias":
        floor = 1e-3 * float(want.norm()) + 1e-300
        return (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(floor)
    return flashattn.verify.per_head_relative_error(got, want)


def assert_matches(results, ref, tol, names=NAMES):
    for name in names:
        got = results[name]
        assert got is not None, f"{name} is None"
        assert got.shape == ref[name].shape, f"{name}: shape {tuple(got.shape)} vs {tuple(ref[name].shape)}"
        assert torch.isfinite(got).all(), f"{name}: NaN/inf (an element the kernels never wrote?)"
        err = per_head_errors(name, got, ref[name])
        assert float(err.max()) <= tol, f"{name}: worst head rel err {float(err.max()):.2e} > {tol:.0e}:\n{err}"


def run_kernels(q, k, v, bias, tau, do, config=SMALL):
    o, lse = lazy.lazy_attention_forward(q, k, v, bias, tau, config=config)
    dq, dk, dv, dbias, dtau = lazy.lazy_attention_backward(q, k, v, bias, tau, do, lse, config=config)
    return dict(zip(NAMES, (o, dq, dk, dv, dbias, dtau)))


def reference(q, k, v, bias, tau, do):
    if ON_GPU:  # an L x L float64 matrix per head of one batch element at a time
        return lazy_gradients_per_batch(q, k, v, bias, tau, do)
    return lazy_gradients_autograd(q, k, v, bias, tau, do)


# --------------------------------------------------------------------------------------
# against the float64 reference
# --------------------------------------------------------------------------------------
CASES = {
    # name: (B, H, L, D, W, taus)
    "W0-tau-positive": (1, 2, 37, 16, 0, (0.4, 1.5)),
    "W-ge-L": (1, 2, 29, 16, 40, (0.3, -0.5)),
    "window-ends-mid-tile": (1, 2, 45, 24, 20, (-0.3, 0.8)),
    "batches-heads-odd-L": (2, 3, 21, 16, 7, (0.5, -0.2, 0.0)),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64_reference(case):
    B, H, L, D, W, taus = CASES[case]
    q, k, v, do = (rand(B, H, L, D) for _ in range(4))
    bias, tau = params(H, W, taus)
    got = run_kernels(q, k, v, bias, tau, do)
    assert_matches(got, reference(q, k, v, bias, tau, do), TOL[torch.float32])
    if W >= L:
        assert (got["dBias"][:, L:] == 0).all(), "distances >= L never occur: their dBias is 0"


def test_dbias_and_dtau_are_deterministic():
    """Two-stage reductions, no atomics: the same bits on every run."""
    B, H, L, D, W = 1, 2, 33, 16, 40
    q, k, v, do = (rand(B, H, L, D) for _ in range(4))
    bias, tau = params(H, W)
    o, lse = lazy.lazy_attention_forward(q, k, v, bias, tau)
    first = lazy.lazy_attention_backward(q, k, v, bias, tau, do, lse, needs_dq=False, needs_dkdv=False)
    second = lazy.lazy_attention_backward(q, k, v, bias, tau, do, lse, needs_dq=False, needs_dkdv=False)
    assert first[0] is None and first[1] is None and first[2] is None
    assert torch.equal(first[3], second[3]) and torch.equal(first[4], second[4])


def test_strongly_negative_tau_gives_sparse_rows():
    """tau << 0: the ReLU zeroes most of A, whole rows near the start. Gradients still match, and
    rows that are entirely clipped give an output of exactly zero."""
    B, H, L, D, W = 1, 2, 40, 16, 6
    q, k, v, do = (rand(B, H, L, D) for _ in range(4))
    bias, tau = params(H, W, (-1.5, -3.0))
    A = lazy_attention_reference(q, k, v, bias, tau, return_parts=True).A
    causal = torch.ones(L, L, dtype=torch.bool, device=DEVICE).tril()
    zero_fraction = float(((A == 0) & causal).sum() / (causal.sum() * B * H))
    assert zero_fraction > 0.5, f"the case is meant to be sparse, A has {zero_fraction:.0%} zeros"
    got = run_kernels(q, k, v, bias, tau, do)
    # row i is all zero when no P can exceed |tau|/(i+1) (P <= 1): rows i < |tau| - 1
    assert (got["O"][:, 0, :1] == 0).all() and (got["O"][:, 1, :3] == 0).all()
    assert_matches(got, reference(q, k, v, bias, tau, do), TOL[torch.float32])


def test_every_head_gets_its_own_bias_and_tau_gradient():
    """The bug of seeds 002/004: only head 0 received dBias/dTau. Here every head's dBias and
    dTau must be non-zero and correct, with q and dO laid out so their head strides differ.
    Planting that bug (dO offset with Q's head stride in every backward kernel) must fail this
    check for heads 1..H-1 and leave head 0 right: the test can catch what it is meant to."""
    B, H, L, D, W = 1, 4, 24, 16, 5
    q = rand(B, H, L, D, layout="bshd")     # head stride D
    k, v = rand(B, H, L, D), rand(B, H, L, D)
    do = rand(B, H, L, D)                   # head stride L*D: the wrong offset stays inside dO
    assert q.stride(1) != do.stride(1)
    bias, tau = params(H, W)
    ref = reference(q, k, v, bias, tau, do)
    o, lse = lazy.lazy_attention_forward(q, k, v, bias, tau, config=SMALL)

    _, _, _, dbias, dtau = lazy.lazy_attention_backward(q, k, v, bias, tau, do, lse, config=SMALL)
    assert (dbias.abs().sum(dim=1) > 0).all() and (dtau != 0).all(), "a head got no gradient"
    for name, got in (("dBias", dbias), ("dTau", dtau)):
        err = per_head_errors(name, got, ref[name])
        assert float(err.max()) < TOL[torch.float32], f"{name} per head: {err}"

    real = {kernel: getattr(lazy, kernel) for kernel in BACKWARD_KERNELS}
    with planted.planted_bug(lazy, BACKWARD_KERNELS[0], [DO_HEAD_STRIDE_BUG]), \
         planted.planted_bug(lazy, BACKWARD_KERNELS[1], [DO_HEAD_STRIDE_BUG]), \
         planted.planted_bug(lazy, BACKWARD_KERNELS[2], [DO_HEAD_STRIDE_BUG]):
        bad = lazy.lazy_attention_backward(q, k, v, bias, tau, do, lse, config=SMALL)
    for name, got in zip(("dQ", "dK", "dV", "dBias", "dTau"), bad):
        err = per_head_errors(name, got, ref[name]).reshape(-1, H).amax(0)
        assert err[0] < TOL[torch.float32], f"{name}: head 0 should be unaffected, err {err}"
        assert (err[1:] > 1e-2).all(), f"{name}: the planted bug went unnoticed, err {err}"
    for kernel in BACKWARD_KERNELS:  # the real kernels are back
        assert getattr(lazy, kernel) is real[kernel]


# --------------------------------------------------------------------------------------
# layouts: non-contiguous q/k/v, dO with its own strides, stride-0 dO
# --------------------------------------------------------------------------------------
def test_noncontiguous_inputs_and_grad_outputs():
    B, H, L, D, W = 2, 2, 19, 16, 9
    q, k, v = rand(B, H, L, D, layout="bshd"), rand(B, H, L, D, layout="sliced"), \
        rand(B, H, L, D, layout="padded_heads")
    bias_wide, tau_wide = params(H, 2 * W + 1)
    bias, tau = bias_wide[:, ::2], tau_wide              # a strided bias: [H, W+1], stride 2
    assert bias.shape == (H, W + 1) and not bias.is_contiguous()
    o, lse = lazy.lazy_attention_forward(q, k, v, bias, tau, config=SMALL)
    for layout in ("contiguous", "padded_heads"):
        do = rand(B, H, L, D, layout=layout)
        assert do.stride() != q.stride()
        dq, dk, dv, dbias, dtau = lazy.lazy_attention_backward(q, k, v, bias, tau, do, lse, config=SMALL)
        ref = reference(q, k, v, bias, tau, do)
        assert_matches(dict(O=o, dQ=dq, dK=dk, dV=dv, dBias=dbias, dTau=dtau), ref, TOL[torch.float32])


def test_sum_backward_gives_stride0_grad_output():
    """out.sum().backward() hands the backward a dO whose strides are all 0."""
    B, H, L, D, W = 1, 3, 35, 16, 4
    q, k, v = rand(B, H, L, D, layout="bshd"), rand(B, H, L, D), rand(B, H, L, D)
    bias, tau = params(H, W)
    seen = {}
    real = lazy.lazy_attention_backward

    def spy(q_, k_, v_, bias_, tau_, do_, *args, **kwargs):
        seen["stride"] = do_.stride()
        return real(q_, k_, v_, bias_, tau_, do_, *args, **kwargs)

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias, tau)]
    lazy.lazy_attention_backward = spy
    try:
        lazy_attention(*leaves).sum().backward()
    finally:
        lazy.lazy_attention_backward = real
    assert seen["stride"] == (0, 0, 0, 0)
    ref = reference(q, k, v, bias, tau, torch.ones_like(q))
    got = dict(zip(NAMES[1:], (t.grad for t in leaves)))
    assert_matches(got, ref, TOL[torch.float32], names=NAMES[1:])


# --------------------------------------------------------------------------------------
# autograd: gradcheck, partial gradients, dtypes, memory
# --------------------------------------------------------------------------------------
def test_gradcheck_float64():
    """Finite differences in float64 agree with the analytic gradients for all five inputs."""
    B, H, L, D, W = 1, 2, 6, 8, 2
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64, device=DEVICE, requires_grad=True)
               for _ in range(3))
    bias = (0.5 * torch.randn(H, W + 1, dtype=torch.float64, device=DEVICE)).requires_grad_(True)
    tau = torch.tensor([0.3, -0.2], dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: lazy_attention(*a), (q, k, v, bias, tau),
                                    fast_mode=True)


def test_only_bias_and_tau_require_grad():
    """Learning the per-head parameters alone (q, k, v frozen): the rest is None."""
    B, H, L, D, W = 1, 2, 21, 16, 3
    q, k, v, do = (rand(B, H, L, D) for _ in range(4))
    bias, tau = (t.requires_grad_(True) for t in params(H, W))
    lazy_attention(q, k, v, bias, tau).backward(do)
    ref = reference(q, k, v, bias.detach(), tau.detach(), do)
    assert_matches(dict(dBias=bias.grad, dTau=tau.grad), ref, TOL[torch.float32], names=("dBias", "dTau"))
    assert q.grad is None and k.grad is None and v.grad is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_dtypes_end_to_end(dtype):
    """fp16 everywhere; bf16 natively on a GPU (sm 8.0+), else in fp32 with a warning; fp64
    with float64 bias and tau is exact to rounding."""
    B, H, L, D, W = 1, 2, 30, 32, 5
    q, k, v, do = (rand(B, H, L, D, dtype=dtype) for _ in range(4))
    bias, tau = params(H, W, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias, tau)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lazy_attention(*leaves)
        out.backward(do)
    fell_back = any(issubclass(w.category, flashattn.BF16FallbackWarning) for w in caught)
    assert fell_back == (dtype == torch.bfloat16 and torch.bfloat16 not in flashattn.runtime.supported_dtypes())
    got = dict(zip(NAMES, [out.detach()] + [t.grad for t in leaves]))
    for name in ("O", "dQ", "dK", "dV"):
        assert got[name].dtype == dtype
    assert got["dBias"].dtype == bias.dtype and got["dTau"].dtype == tau.dtype
    # fp64 on a GPU: Triton passes the float argument `scale` as fp32 (1/sqrt(32) rounded at
    # ~1e-8 relative), so the kernels are exact to that, not to fp64 rounding.
    tol = 1e-6 if (ON_GPU and dtype == torch.float64) else TOL[dtype]
    assert_matches(got, reference(q, k, v, bias, tau, do), tol)


def _saved_bytes(fn, *args):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(saved), max(saved)


def test_memory_is_linear_in_length():
    """What autograd keeps for the backward: q, k, v, bias, tau, LSE. No L x L matrix (the
    materialised reference keeps several; the check can tell the two apart)."""
    B, H, L, D, W = 1, 2, 64, 16, 8
    q, k, v = (rand(B, H, L, D).requires_grad_(True) for _ in range(3))
    bias, tau = (t.requires_grad_(True) for t in params(H, W))
    total, largest = _saved_bytes(lazy_attention, q, k, v, bias, tau)
    expected = 3 * q.numel() * 4 + B * H * L * 4 + bias.numel() * 4 + tau.numel() * 4
    assert total == expected, f"saved {total} bytes, expected {expected} (q, k, v, LSE, bias, tau)"
    square = B * H * L * L * 4
    assert largest < square
    ref_total, ref_largest = _saved_bytes(
        lambda *a: lazy_attention_reference(*a, dtype=None), q, k, v, bias, tau)
    assert ref_largest >= square and ref_total > 4 * total


# --------------------------------------------------------------------------------------
# input validation
# --------------------------------------------------------------------------------------
def test_bad_inputs_are_refused_with_a_clear_message():
    q = rand(1, 2, 8, 16)
    bias, tau = params(2, 3)
    with pytest.raises(ValueError, match=r"bias must have shape \[H, W\+1\]"):
        lazy_attention(q, q, q, bias[:1], tau)
    with pytest.raises(ValueError, match="bias must have shape"):
        lazy_attention(q, q, q, bias[0], tau)
    with pytest.raises(ValueError, match=r"tau must have shape \[H\]"):
        lazy_attention(q, q, q, bias, tau[:1])
    with pytest.raises(TypeError, match="tau must be a torch.Tensor"):
        lazy_attention(q, q, q, bias, 0.5)
    with pytest.raises(TypeError, match="bias must be a floating-point"):
        lazy_attention(q, q, q, bias.to(torch.int32), tau)
    with pytest.raises(ValueError, match="shaped like q"):
        lazy_attention(q, rand(1, 2, 9, 16), rand(1, 2, 9, 16), bias, tau)
    with pytest.raises(ValueError, match="shaped like q"):
        lazy_attention(q, rand(1, 1, 8, 16), rand(1, 1, 8, 16), bias, tau)
    if ON_GPU:
        with pytest.raises(ValueError, match="on q's device"):
            lazy_attention(q, q, q, bias.cpu(), tau)


# --------------------------------------------------------------------------------------
# realistic sizes on a GPU; the same test at an interpreter-sized shape on the CPU
# --------------------------------------------------------------------------------------
REALISTIC = [(2, 8, 2048, 64)] if ON_GPU else [(1, 2, 80, 32)]
REAL_DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("W", [256, 4096], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("size", REALISTIC, ids=lambda s: "B{}H{}L{}D{}".format(*s))
def test_realistic_sizes(size, W, dtype):
    B, H, L, D = size
    q, k, v, do = (rand(B, H, L, D, dtype=dtype, layout="bshd") for _ in range(4))
    bias, tau = params(H, W, torch.linspace(-2.0, 1.0, H).tolist())
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias, tau)]
    out = lazy_attention(*leaves)
    out.backward(do)
    got = dict(zip(NAMES, [out.detach()] + [t.grad for t in leaves]))
    ref = lazy_gradients_per_batch(q, k, v, bias, tau, do)
    assert_matches(got, ref, TOL[dtype])


# --------------------------------------------------------------------------------------
# the exercise checker (solutions/07): passes the right answer, names the classic bugs
# --------------------------------------------------------------------------------------
def _one_head_backward(q, k, v, bias, tau, do, scale, *, bug=None):
    L, W = q.shape[0], bias.shape[0] - 1
    parts = lazy_attention_reference(q[None, None], k[None, None], v[None, None], bias[None], tau[None],
                                     scale=scale, return_parts=True)
    P, A, O = parts.P[0, 0], parts.A[0, 0], parts.O[0, 0]
    i = torch.arange(L)
    causal = i[None, :] <= i[:, None]
    c = tau / (i + 1)
    dA = do @ v.T
    gate = causal & (P + c[:, None] > 0)
    dP = dA * (causal if bug == "no gate" else gate)
    delta = (do * O).sum(-1) if bug == "shortcut" else (P * dP).sum(-1)
    dS = P * (dP - delta[:, None])
    diag = dS.T if bug == "upper diagonals" else dS
    dbias = torch.stack([torch.diagonal(diag, -d).sum() if d < L else dS.new_zeros(()) for d in range(W + 1)])
    dtau = {"no 1/(i+1)": dP.sum(), "ungated dtau": ((dA * causal).sum(-1) / (i + 1)).sum(),
            "dtau over every key": (dA.sum(-1) / (i + 1)).sum()}.get(bug, (dP.sum(-1) / (i + 1)).sum())
    s = 1.0 if bug == "no scale" else scale
    dk = dS @ q * s if bug == "dK without transpose" else dS.T @ q * s
    dv = P.T @ do if bug == "dV from P" else A.T @ do
    return dS @ k * s, dk, dv, dbias, dtau


def test_exercise_checker_accepts_the_right_backward(capsys):
    from flashattn import check

    check.lazy_backward(_one_head_backward)
    out = capsys.readouterr().out
    assert out.startswith("PASS check.lazy_backward") and out.count("\n") == 1   # one line


@pytest.mark.parametrize("bug, hint", [("shortcut", "lazy_delta"), ("no gate", "lazy_gate"),
                                       ("no 1/(i+1)", "lazy_dtau_count"), ("no scale", "lazy_scale"),
                                       ("dK without transpose", "lazy_dk_transpose"), ("dV from P", "lazy_dv"),
                                       ("upper diagonals", "lazy_dbias_diagonals"), ("ungated dtau", "lazy_dtau_gate"),
                                       ("dtau over every key", "lazy_dtau_causal")])
def test_exercise_checker_names_the_classic_bug(bug, hint):
    from flashattn import check

    r = check.lazy_backward(lambda *a: _one_head_backward(*a, bug=bug), raise_on_fail=False, show=False)
    assert r.hint_ids == [hint], r.report()
    with pytest.raises(AssertionError, match=hint):
        check.lazy_backward(lambda *a: _one_head_backward(*a, bug=bug), show=False)


def test_benchmark_cli(capsys, tmp_path):
    """Without a GPU the full benchmark refuses (it would take hours); --quick runs anywhere and
    writes its JSON and PNG."""
    from flashattn.lazy import bench as lazy_bench

    if not ON_GPU:
        assert lazy_bench.main([]) == 2
        assert "--quick" in capsys.readouterr().err
    assert lazy_bench.main(["--quick", "--out", str(tmp_path), "--rep-ms", "5"]) == 0
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".png"]


@pytest.mark.parametrize("layout", ["transposed", "every_other", "stride0"])
def test_any_do_layout_gives_the_contiguous_dos_bits(layout):
    """Lesson 07's check, at its GPU size on a GPU: the backward reads dO through dO's own strides,
    so a transposed view, a slice and a stride-0 expansion give all five gradients bit for bit as
    a contiguous copy of the same dO does (on an H200 this held while dTau's error against float64
    read 5.5e-2 on one nearly-cancelling head: that comparison cannot test strides)."""
    from flashattn.lazy import kernels
    from flashattn.lazy.reference import random_inputs

    B, H, L, D, W = (2, 8, 2048, 64, 256) if ON_GPU else (1, 3, 40, 16, 6)
    dtype = torch.float16 if ON_GPU else torch.float32
    q, k, v, _, bias, tau = random_inputs(B, H, L, D, W, dtype=dtype, device=DEVICE, q_layout="bshd")
    do = {"transposed": torch.randn(B, L, H, D, device=DEVICE, dtype=dtype).transpose(1, 2),
          "every_other": torch.randn(B, H, L, 2 * D, device=DEVICE, dtype=dtype)[..., ::2],
          "stride0": torch.ones((), device=DEVICE, dtype=dtype).expand(B, H, L, D)}[layout]
    _, lse = kernels.lazy_attention_forward(q, k, v, bias, tau)
    strided = kernels.lazy_attention_backward(q, k, v, bias, tau, do, lse)
    contiguous = kernels.lazy_attention_backward(q, k, v, bias, tau, do.contiguous(), lse)
    for name, a, b in zip(("dQ", "dK", "dV", "dBias", "dTau"), strided, contiguous):
        assert torch.equal(a, b), name
