"""The direct launch (flashattn/fast/launch.py): a kernel launched again without Triton's per-call
binding. Two things must hold: a kind of arguments names exactly what Triton specialises on
(checked against Triton's own binder, which runs on the CPU too), and a direct call hands the
compiled kernel's launcher what ``kernel[grid]`` would. On a GPU, direct and plain launches give
the same bits."""
import dataclasses
import inspect
import warnings

import pytest
import torch
from triton.runtime.jit import JITFunction, create_function_from_signature

from flashattn import runtime, settings
from flashattn.backward import attn_bwd_delta_kernel
from flashattn.fast import launch, tuning
from flashattn.fast.backward import fast_attention_backward, fast_dkdv_kernel, fast_dq_kernel
from flashattn.fast.forward import fast_attention_forward, fast_fwd_kernel

from conftest import DEVICE, ON_GPU, FakeDriver, rand


def jit_of(kernel) -> JITFunction:
    """The compiled-mode JITFunction of a kernel (on the CPU ``triton.jit`` gave an interpreted one)."""
    if isinstance(kernel, JITFunction):
        return kernel
    keep = {k: v for k, v in kernel.kwargs.items() if k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    return JITFunction(kernel.fn, **keep)


def triton_binder(kernel):
    """Triton's own argument binder for an sm 9.0 target: no GPU needed to specialise arguments."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    jit = jit_of(kernel)
    return jit, create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))


def launches_of(monkeypatch, fn):
    """The (name, args, meta) of every tuning.run the fast launchers make inside ``fn``."""
    seen = []
    monkeypatch.setattr(tuning, "run", lambda name, raw, tuned, grid, args, meta, **kw: seen.append((name, raw, args, meta)))
    fn()
    return seen


def argument_sets(monkeypatch):
    """Real argument tuples of the forward, dQ, dK/dV and delta kernels, over inputs that differ
    in ways Triton does or does not specialise on: another batch (new addresses, same layout),
    another length (unspecialised ints), a misaligned address, a head dim of stride 2, another
    layout (strides, all multiples of 16), and a seed beyond 32 bits."""
    def inputs(S, D=32, offset=0, layout="contiguous"):
        q, k, v = (rand(1, 2, S, D, layout=layout) for _ in range(3))
        if offset:   # a view one element in: its address is no longer 16-byte aligned
            q = torch.empty(q.numel() + offset, device=q.device)[offset:].view(q.shape).copy_(q)
        return q, k, v

    sets = {}
    for label, (S, offset, layout, seed) in {"base": (40, 0, "contiguous", 5), "again": (40, 0, "contiguous", 9),
                                             "longer": (72, 0, "contiguous", 5), "misaligned": (40, 1, "contiguous", 5),
                                             "strided": (40, 0, "sliced", 5),
                                             "transposed": (40, 0, "bshd", 5), "wide seed": (40, 0, "contiguous", 2 ** 40)}.items():
        q, k, v = inputs(S, offset=offset, layout=layout)
        o, lse = q.clone(), torch.zeros(q.shape[:3], device=q.device)
        for name, raw, args, meta in launches_of(monkeypatch, lambda: (
                fast_attention_forward(q, k, v, True, 0.25, dropout_p=0.1, seed=seed),
                fast_attention_backward(q, k, v, o, o.clone(), lse, True, 0.25, fused=False, dropout_p=0.1, seed=seed))):
            sets.setdefault(name, (raw, meta, {}))[2][label] = args
        delta = torch.empty(q.shape[:3], device=q.device)
        sets.setdefault("delta", (attn_bwd_delta_kernel, dict(BLOCK_M=64, BLOCK_D=32), {}))[2][label] = \
            (q, o, delta, *q.stride(), *o.stride(), *delta.stride(), 2, S, 32)
    return sets


def test_a_kind_names_exactly_what_triton_specialises_on(monkeypatch):
    """For every pair of argument sets of every kernel: equal kinds => equal specialisations by
    Triton's binder (a direct call never runs a kernel compiled for other arguments). The kind
    may be finer than Triton's key (it holds the specialised ints' values, not their classes):
    that costs one plain launch, not a wrong kernel. A new batch of the same layout is a hit."""
    sets = argument_sets(monkeypatch)
    assert {"fwd", "dq", "dkdv", "delta"} <= set(sets)
    for name, (raw, meta, by_label) in sets.items():
        jit, binder = triton_binder(raw)
        direct = launch.DirectLaunch(jit, {})
        kwargs = dict(meta, BLOCK_M=16, BLOCK_N=16) if name != "delta" else meta
        specs = {label: binder(*args, **kwargs)[1] for label, args in by_label.items()}
        kinds = {label: direct.kind(args, 0) for label, args in by_label.items()}
        for a in by_label:
            for b in by_label:
                if kinds[a] == kinds[b]:
                    assert specs[a] == specs[b], (name, a, b)
        assert specs["base"] != specs["misaligned"] and specs["base"] != specs["strided"], name   # (teeth)
        assert kinds["base"] == kinds["again"], name                         # a new batch: a hit
        assert kinds["base"] != kinds["misaligned"] and kinds["base"] != kinds["strided"], name
        if name != "delta":
            assert kinds["base"] != kinds["wide seed"], name                  # i32 -> i64


# ---------------------------------------------------------------------------------------------
# the call itself, with a stand-in for a jitted kernel and its compiled form
# ---------------------------------------------------------------------------------------------
def _stand_in(A, B, n, LOOSE, BLOCK: "tl.constexpr" = 16, FLAG: "tl.constexpr" = False):   # noqa: F821
    pass


class FakeCompiled:
    def __init__(self, log, refuse=False):
        self.function, self.packed_metadata, self.log, self.refuse = "function", "metadata", log, refuse

    @property
    def run(self):
        def launcher(*call):
            if self.refuse:
                raise TypeError("launcher() takes other arguments")
            self.log.append(("direct", call))
        return launcher


class FakeKernel:
    """What DirectLaunch reads of a JITFunction: params, arg_names, signature, kernel[grid]."""

    def __init__(self, refuse=False):
        jit = jit_of_plain(_stand_in, do_not_specialize=["LOOSE"])
        self.params, self.arg_names, self.signature = jit.params, jit.arg_names, jit.signature
        self.pre_run_hooks, self.log, self.refuse = [], [], refuse

    def __getitem__(self, grid):
        def plain(*args, **kwargs):
            self.log.append(("plain", grid, args, kwargs))
            return FakeCompiled(self.log, self.refuse)
        return plain


def jit_of_plain(fn, **kwargs):
    return JITFunction(fn, **kwargs)


@pytest.fixture
def direct_on(monkeypatch):
    """The direct path as on a GPU: not interpreting, a stand-in driver, fresh process state."""
    monkeypatch.setattr(runtime, "INTERPRET", False)
    monkeypatch.setattr(launch, "driver", FakeDriver)
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, direct_launch=True))
    monkeypatch.setattr(launch, "_proven", False)


def test_second_call_of_a_kind_goes_straight_to_the_launcher(direct_on):
    kernel = FakeKernel()
    direct = launch.DirectLaunch(kernel, dict(BLOCK=32, num_warps=4))
    a, b = torch.zeros(16), torch.zeros(16)
    direct((3, 2), (a, b, 48, 7))
    direct((5, 2), (b, a, 48, 9))                 # other tensors, another unspecialised int: same kind
    assert [entry[0] for entry in kernel.log] == ["plain", "direct"]
    call = kernel.log[1][1]
    from triton import knobs

    # grid, stream, function, metadata, no launch metadata, the hooks, the arguments, then every
    # constexpr in the kernel's order with its default where none was given
    assert call[:7] == (5, 2, 1, 1234, "function", "metadata", None)
    assert call[7] is knobs.runtime.launch_enter_hook and call[8] is knobs.runtime.launch_exit_hook
    assert call[9:] == (b, a, 48, 9, 32, False)
    direct((5, 2), (b, a, 48, 9))
    assert kernel.log[-1][0] == "direct"
    direct((5, 2), (b, a, 64, 9))                 # a specialised int changed: Triton decides again
    assert kernel.log[-1][0] == "plain" and kernel.log[-1][3] == dict(BLOCK=32, num_warps=4)


def test_a_launch_hook_keeps_the_plain_launch(direct_on, monkeypatch):
    from triton import knobs

    kernel = FakeKernel()
    direct = launch.DirectLaunch(kernel, {})
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    for _ in range(3):
        direct((1,), (torch.zeros(4), torch.zeros(4), 1, 1))
    assert [entry[0] for entry in kernel.log] == ["plain"] * 3


def test_a_launcher_that_refuses_turns_the_direct_path_off(direct_on):
    kernel = FakeKernel(refuse=True)
    direct = launch.DirectLaunch(kernel, {})
    args = (torch.zeros(4), torch.zeros(4), 1, 1)
    direct((1,), args)
    with pytest.warns(RuntimeWarning, match="direct launch"):
        direct((1,), args)                        # refused before launching: the plain launch runs it
    assert [entry[0] for entry in kernel.log] == ["plain", "plain"] and not settings.current.direct_launch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        direct((1,), args)                        # and every later one, without a word
    assert [entry[0] for entry in kernel.log] == ["plain"] * 3


def test_a_float_argument_is_not_part_of_the_kind():
    direct = launch.DirectLaunch(FakeKernel(), {})
    a = torch.zeros(4)
    assert direct.kind((a, a, 16, 0.5), 0) == direct.kind((a, a, 16, 0.25), 0)     # Triton: fp32 either way
    assert direct.kind((a, a, 16, 1), 0) != direct.kind((a, a, 16, 1.0), 0)         # an int is another type


def test_kinds_kept_are_bounded(direct_on, monkeypatch):
    monkeypatch.setattr(launch, "MAX_KINDS", 4)
    direct = launch.DirectLaunch(FakeKernel(), {})
    for n in range(10):                           # ten specialised values: ten kinds
        direct((1,), (torch.zeros(4), torch.zeros(4), n, 1))
        assert len(direct.compiled) <= 4


def test_int_classes_are_tritons():
    assert [launch.int_class(x) for x in (0, -2 ** 31, 2 ** 31 - 1, 2 ** 31, -2 ** 31 - 1, 2 ** 63)] == [0, 0, 0, 1, 1, 2]


def test_the_stand_in_has_the_signature_assumed():
    assert list(inspect.signature(_stand_in).parameters) == FakeKernel().arg_names


# ---------------------------------------------------------------------------------------------
# on a GPU: the real thing
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not ON_GPU, reason="direct launches call a compiled kernel's launcher: GPU only")
def test_direct_launches_give_the_plain_launches_bits():
    """Forward and backward three times (the third goes direct), then a misaligned q and a longer
    sequence (new kinds); each against the same call with the direct path off."""
    def step(q, k, v, do):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fast_attention_forward(*leaves, True, 0.125)[0]
        grads = fast_attention_backward(*leaves, out, do, fast_attention_forward(*leaves, True, 0.125)[1], True, 0.125)
        return (out, *grads)

    def inputs(S, offset=0):
        q, k, v, do = (rand(2, 4, S, 64, dtype=torch.float16) for _ in range(4))
        if offset:
            q = torch.empty(q.numel() + offset, dtype=q.dtype, device=DEVICE)[offset:].view(q.shape).copy_(q)
        return q, k, v, do

    for S, offset in ((300, 0), (300, 0), (300, 0), (300, 8), (1000, 0)):
        args = inputs(S, offset)
        direct = step(*args)
        launch.set_direct(False)
        try:
            plain = step(*args)
        finally:
            launch.set_direct(True)
        for got, want in zip(direct, plain):
            assert torch.equal(got, want)
    assert launch._proven
