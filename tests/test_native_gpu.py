"""The C++ autograd node (``flashattn/fast/native.py``) on a GPU.

Each case runs forward + backward of ``flash_attention`` three ways on the same fresh inputs:

* the plain Python path with poisoned outputs (every output starts as NaN, so an element no kernel
  writes shows);
* the C++ node, after two calls that record the plans and keep the C++ one;
* the float64 reference, per head.

The C++ node must give O, dQ, dK and dV *identical bit for bit* to the poisoned plain path: it
launches the same kernels with the same arguments, so any difference is a wrong word, slot or
stride in the replay. ``native.calls()`` must show that the C++ node really ran. Skips, with the
reason, where there is no GPU or the module cannot be built (no C++ compiler)."""
import pytest
import torch

from flashattn import api, runtime, settings
from flashattn.fast import native

from conftest import per_head_error, rand, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or runtime.INTERPRET,
                                reason="the C++ node replays GPU launches: no GPU here")

TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def built():
    if not native.wait():
        pytest.skip(native.status())
    return native


def _do(kind, o):
    """dO as a model hands it over: contiguous, a transposed view (``o.transpose(1, 2)`` then a
    reshape, in the backward), or out.sum()'s one number expanded (every stride 0)."""
    if kind == "contiguous":
        return torch.randn_like(o)
    if kind == "transposed":
        return torch.randn(o.shape[0], o.shape[2], o.shape[1], o.shape[3], dtype=o.dtype, device=o.device).transpose(1, 2)
    if kind == "stride0":
        return torch.randn((), dtype=o.dtype, device=o.device).expand(o.shape)
    raise ValueError(kind)


def _run(q, k, v, do, causal):
    q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
    o = api.flash_attention(q, k, v, causal=causal)
    o.backward(do)
    return o.detach(), *(t.grad for t in (q, k, v))


# (B, H, H_kv, S_q, S_k, D, dtype, causal, q/k/v layout, dO, which of q, k, v require a gradient)
CASES = [
    (2, 4, 4, 256, 256, 64, torch.bfloat16, True, "contiguous", "contiguous", "qkv"),
    (1, 8, 2, 129, 129, 128, torch.float16, False, "bshd", "transposed", "qkv"),
    (2, 4, 2, 100, 300, 64, torch.bfloat16, False, "sliced", "stride0", "qkv"),
    (1, 4, 4, 2048, 2048, 128, torch.bfloat16, True, "contiguous", "contiguous", "qkv"),   # TMA: scratch
    (2, 2, 2, 64, 64, 64, torch.float16, True, "padded_heads", "contiguous", "q"),
    (1, 2, 1, 1, 77, 32, torch.float16, True, "contiguous", "transposed", "kv"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}/{c[2]}-Sq{c[3]}-Sk{c[4]}-D{c[5]}-"
                                                   f"{str(c[6])[6:]}-{'causal' if c[7] else 'full'}-{c[8]}-dO{c[9]}-{c[10]}")
def test_the_cpp_node_matches_the_poisoned_python_path_bit_for_bit(built, case):
    B, H, H_kv, S_q, S_k, D, dtype, causal, layout, do_kind, needs = case
    q = rand(B, H, S_q, D, dtype=dtype, layout=layout).requires_grad_("q" in needs)
    k = rand(B, H_kv, S_k, D, dtype=dtype, layout=layout).requires_grad_("k" in needs)
    v = rand(B, H_kv, S_k, D, dtype=dtype, layout=layout).requires_grad_("v" in needs)
    do = _do(do_kind, torch.empty(B, H, S_q, D, dtype=dtype, device=q.device))

    plain = _run(q, k, v, do, causal)                      # poisoned (conftest): the plain path
    with runtime.poisoned_outputs(False):
        for _ in range(2):                                 # compile, then record both plans
            _run(q, k, v, do, causal)
        before = native.calls()
        replayed = _run(q, k, v, do, causal)
        assert native.calls() == before + 1, f"the C++ node did not run: {native.status()}"
        with settings.override(native=False):              # the switch: the Python node again
            _run(q, k, v, do, causal)
        assert native.calls() == before + 1, "FLASHATTN_NATIVE=0 did not keep the Python node"

    for name, a, b in zip(("O", "dQ", "dK", "dV"), plain, replayed):
        if a is None:
            assert b is None, f"{name}: the C++ node computed a gradient nobody asked for"
            continue
        assert b is not None and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride(), name
        assert torch.isfinite(a).all(), f"{name}: the plain path left {int((~torch.isfinite(a)).sum())} unwritten"
        assert torch.equal(a, b), f"{name}: C++ replay differs from the Python path in {int((a != b).sum())} elements"
    ref = reference(q, k, v, do, causal=causal)
    for name, got in zip(("O", "dQ", "dK", "dV"), replayed):
        if got is not None:
            err = per_head_error(got, ref[name], floor=0.1).max().item()
            assert err < TOL[dtype], f"{name}: worst head relative error {err:.2e}"


def test_changed_settings_drop_the_kept_plans_and_a_new_signature_is_not_replayed(built):
    q, k, v = (torch.randn(1, 2, 192, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    with runtime.poisoned_outputs(False):
        for _ in range(3):
            api.flash_attention(q, k, v, causal=True).sum().backward()
        assert native._module.kept() >= 1
        before = native.calls()
        other = q[:, :, :191].detach().requires_grad_()     # another signature: the Python node, no replay
        api.flash_attention(other, k, v, causal=True).sum().backward()
        assert native.calls() == before
        with settings.override(tma=False):                  # a setting the kernels read: plans dropped
            o = api.flash_attention(q, k, v, causal=True)
            assert native._module.kept() == 0 and native.calls() == before
            o.sum().backward()


def test_a_failed_launch_raises_a_runtime_error_not_a_crash(built):
    """A plan whose kernel cannot launch (here: no function at all) raises, with the driver's word."""
    module = native._module
    q = torch.zeros(1, 1, 4, 8, device="cuda", dtype=torch.float16)
    fresh = [([1, 1, 4, 8], "float16"), ([1, 1, 4], "float32")]
    no_function = (0, [1, 1, 1], 128, 0, 0, 1, 1, [0, 0, 0], [(0, 0)])
    assert module.keep(q, q, q, False, 0.5, ([no_function], fresh, [3, 4]), ([], [], [-1, -1, -1]), [32, 32, 8, 1]) == ""
    try:
        with pytest.raises(RuntimeError, match="cuLaunchKernel failed"):
            module.attention(q, q, q, False, 0.5)
    finally:
        module.clear()


def test_non_reentrant_checkpointing_mixes_the_two_nodes_with_the_same_gradients(built):
    """A checkpointed call runs the C++ node first (its signature is planned) and the Python node
    when it is recomputed (the recomputed inputs require no gradient: another signature). Both
    save the same five tensors, so checkpointing accepts the pair, and the gradients are those of
    the uncheckpointed call, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    with runtime.poisoned_outputs(False):
        for _ in range(3):
            want = torch.autograd.grad(api.flash_attention(q, k, v, causal=True), (q, k, v), do)
        before = native.calls()
        out = checkpoint(lambda a, b, c: api.flash_attention(a, b, c, causal=True), q, k, v, use_reentrant=False)
        got = torch.autograd.grad(out, (q, k, v), do)
        assert native.calls() == before + 1, "the checkpointed forward should have run the C++ node"
    for name, a, b in zip(("dQ", "dK", "dV"), got, want):
        assert torch.equal(a, b), f"{name} differs under checkpointing"
