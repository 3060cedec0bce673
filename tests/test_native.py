"""The C++ autograd node's host logic, on any machine with a C++ compiler (``flashattn/fast/native.py``;
its launches are tested on a GPU in ``test_native_gpu.py``): the module builds against this torch,
finds no plan for inputs it was never given, and refuses a malformed plan, saying what was wrong."""
import shutil

import pytest
import torch

from flashattn.fast import native


@pytest.fixture(scope="module")
def module():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the C++ node cannot be built here")
    module = native._module or native.build()     # (on a GPU, the node's own module: loaded once)
    module.clear()          # (on a GPU other tests' plans may be kept: each test records its own)
    return module


def test_no_plan_is_kept_for_inputs_never_planned(module):
    q = torch.randn(1, 2, 16, 8)
    assert module.attention(q, q, q, True, 0.5) is None       # a CPU tensor: never a plan


def test_a_malformed_plan_is_refused_saying_what_was_wrong(module):
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float16)
    fresh = [([1, 1, 4, 8], "float16"), ([1, 1, 4], "float32")]
    no_backward = ([], [], [-1, -1, -1])
    launch = (0, [1, 1, 1], 128, 0, 0, 1, 0, [0, 0, 0], [(0, 9)])      # slot 9 of 5
    kept = module.kept()
    assert module.keep(q, q, q, False, 0.5, ([launch], fresh, [3, 4]), no_backward, [32, 32, 8, 1]) == \
        "tensor slot 9 -> parameter 0 is out of range"
    launch = (0, [1, 1], 128, 0, 0, 1, 0, [0], [])
    assert module.keep(q, q, q, False, 0.5, ([launch], fresh, [3, 4]), no_backward, [32, 32, 8, 1]).startswith(
        "a malformed launch")
    assert module.keep(q, q, q, False, 0.5, ([], fresh, [3, 4]), ([], [], [0]), [32, 32, 8, 1]) == \
        "the backward returns dQ, dK, dV"
    assert module.keep(q, q, q, False, 0.5, ([], fresh, [3, 7]), no_backward, [32, 32, 8, 1]) == \
        "result slot 7 is out of range"
    assert module.keep(q, q, q, False, 0.5, ([], [([4], "complex64")], [3, 3]), no_backward, [32, 32, 8, 1]) == \
        "no fresh output of dtype complex64"
    assert module.kept() == kept
    assert module.keep(q, q, q, False, 0.5, ([], fresh, [3, 4]), no_backward, [32, 32, 8, 1]) == ""   # well formed
    assert module.kept() == kept + 1
    module.clear()
    assert module.kept() == 0


def test_launch_words_follow_the_kernel_signature():
    """A recorded launch as words: constexprs skipped, ints masked to their width, fp32 as its
    bits, tensors as slots, the two scratch pointers last; anything unsure refused (None)."""
    class Meta:
        global_scratch_size, global_scratch_align = 128, 16

    class Src:
        signature = {"Q": "*fp16", "n": "i32", "big": "i64", "scale": "fp32", "ONE": "constexpr", "BLOCK": "constexpr"}

    class Kernel:
        metadata, src = Meta, Src

    entry = (None, (3, 2, 1), 0xABC, (4, 1, 2048), (None, -1, 2 ** 40, 0.5, 1), ((0, 0),), (64,))
    function, grid, threads, shared, scratch, align, scratch_param, words, tensors = native._launch_spec(entry, Kernel)
    assert (function, grid, threads, shared) == (0xABC, [3, 2, 1], 128, 2048)
    assert words == [0, 0xFFFFFFFF, 2 ** 40, 0x3F000000, 0, 0] and tensors == [(0, 0)]
    assert (scratch, align, scratch_param) == (6 * 128, 16, 4)
    Src.signature = dict(Src.signature, Q="tensordesc<fp16[64, 64]>")
    assert native._launch_spec(entry, Kernel) is None
    assert native._dense((2, 4, 8, 16), (512, 16, 64, 1)) and native._dense((2, 1, 8, 16), (128, 7, 16, 1))
    assert not native._dense((2, 4, 8, 16), (0, 0, 0, 0)) and not native._dense((2, 4, 8, 16), (1024, 256, 32, 2))


def test_the_key_tells_apart_what_a_plan_depends_on(module):
    """The C++ key: equal for inputs laid out alike, different for anything the kernels' launch
    reads (strides, 16-byte alignment, inputs that are one tensor, which require gradients, causal,
    the scale's bits)."""
    def qkv(**kw):
        return [torch.randn(2, 3, 16, 8, dtype=torch.float16, **kw) for _ in range(3)]

    q, k, v = qkv()
    base = module.key(q, k, v, True, 0.125)
    assert module.key(*qkv(), True, 0.125) == base                      # fresh tensors, same layout
    assert module.key(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, True, 0.125) != base   # strides
    wide = torch.randn(2 * 3 * 16 * 8 + 1, dtype=torch.float16)
    assert module.key(wide[1:].view(2, 3, 16, 8), k, v, True, 0.125) != base    # 2 bytes off 16-byte alignment
    assert module.key(q, q, q, True, 0.125) != module.key(q, k, v, True, 0.125)  # one tensor thrice
    assert module.key(q.requires_grad_(), k, v, True, 0.125) != base            # requires_grad
    q.requires_grad_(False)
    assert module.key(q, k, v, False, 0.125) != base                            # causal
    assert module.key(q, k, v, True, 0.125 + 2 ** -40) != base                   # the scale, bit for bit


def test_an_offer_is_refused_for_a_do_that_shares_memory_or_has_gaps():
    q, k, v, o = (torch.randn(1, 2, 8, 16) for _ in range(4))
    lse = torch.randn(1, 2, 8)
    assert native._refusal(q, k, v, o, o, lse, False, False).startswith("dO shares memory")
    assert native._refusal(q, k, v, o, o[..., :8], lse, False, False) is not None      # a view of O: gaps
    strided = torch.randn(1, 2, 8, 32)[..., ::2]
    assert native._refusal(q, k, v, o, strided, lse, False, False).startswith("dO laid out")
    assert native._refusal(q, k, v, o, torch.randn(1, 2, 8, 16), lse, True, False).startswith("the gradients")
    assert native._refusal(q, k, v, o, torch.randn(1, 2, 8, 16), lse, False, False) is None


def test_a_python_exception_raised_under_the_node_comes_out_as_itself(module):
    """Checkpointing stops its recomputation by raising from a saved-tensor hook, which runs inside
    the C++ forward: that exception has to reach Python unchanged (an earlier form turned it into
    a bare RuntimeError, and checkpointed steps failed on an H200, 2026-11-29)."""
    class Stop(Exception):
        pass

    def hook():
        raise Stop("stopped in a hook")

    with pytest.raises(Stop, match="stopped in a hook"):
        module.call_through(hook)


class _NoPlans:
    """A stand-in for the built module that keeps no plan: the Python node runs, and offers."""

    def attention(self, *args):
        return None

    def clear(self):
        pass

    def keep(self, *args):
        return "a stand-in keeps no plans"


def test_non_reentrant_checkpointing_works_while_the_cpp_node_is_ready(monkeypatch):
    """The Python node's backward unpacks its saved tensors once (non-reentrant checkpointing
    refuses a second unpack), also when it offers its plans to a built C++ node."""
    from torch.utils.checkpoint import checkpoint

    import flashattn
    from flashattn import api

    monkeypatch.setattr(native, "_module", _NoPlans())       # "built": the backward offers its plans
    monkeypatch.setattr(native, "_settings", native._settings)     # (what _active and offer set: put back after)
    monkeypatch.setattr(native, "_refused", native._refused)
    q, k, v = (torch.randn(1, 2, 24, 16, device=flashattn.default_device(), requires_grad=True) for _ in range(3))
    plain = torch.autograd.grad(api.flash_attention(q, k, v, causal=True, impl="fast").sum(), (q, k, v))
    out = checkpoint(lambda a, b, c: api.flash_attention(a, b, c, causal=True, impl="fast"), q, k, v,
                     use_reentrant=False)
    for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
