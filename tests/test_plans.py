"""Launch plans (flashattn/fast/plans.py): one call's launches recorded, replayed for the next call
of the same signature. On the CPU, with stand-in launches: what is recorded, what is refused,
what a replay hands the launcher. On a GPU: replays give the plain path's bits, and are skipped
while outputs are guarded or launches watched."""
import dataclasses

import pytest
import torch

from flashattn import runtime, settings
from flashattn.fast import launch, plans

from conftest import DEVICE, ON_GPU, FakeDriver, rand


class FakeDirect:
    """Stands in for a ``DirectLaunch``: observers see each call, the first call of a kind is a
    'plain' launch that compiles it, later ones call the kept launcher."""

    def __init__(self, log, constexprs=(64,)):
        self.compiled, self.log, self.constexprs = {}, log, constexprs

    def kind(self, args, device):
        return tuple(type(a).__name__ for a in args)

    def launcher(self, *call):
        self.log.append(("direct", call))

    def __call__(self, grid, args):
        plans.count_launch()
        for observe in launch.OBSERVERS:
            observe(self, grid, args)
        kind = self.kind(args, 0)
        if kind not in self.compiled:
            self.compiled[kind] = (self.launcher, "function", "metadata", self.constexprs)
            self.log.append(("plain", grid, args))
        else:
            self.log.append(("direct", grid, args))


@pytest.fixture
def on_gpu_like(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    monkeypatch.setattr(plans, "driver", FakeDriver)
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, direct_launch=True))
    monkeypatch.setattr(launch, "_proven", True)
    monkeypatch.setattr(launch, "_hooks_idle", lambda: True)
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setattr(runtime, "_poison", False)


def two_kernel_call(log, first, second, *, returns="outputs"):
    """A stand-in backward: allocates delta and dq, launches two kernels, returns dq (or a copy)."""
    def call(x, y):
        delta = torch.empty(x.shape[0], dtype=torch.float32)
        first((3,), (x, delta, x.shape[0], 0.5))
        dq = torch.empty_like(x)
        second((2, 4), (x, y, delta, dq, x, 7))           # x twice: a placeholder argument
        return (dq if returns == "outputs" else dq.clone(), None)
    return call


def test_a_plan_is_kept_only_once_every_launch_went_direct(on_gpu_like):
    log = []
    first, second = FakeDirect(log), FakeDirect(log, constexprs=(32, True))
    call = two_kernel_call(log, first, second)
    x, y = torch.randn(8), torch.randn(8)
    key = plans.signature((x, y), ("test",))
    plans.record(key, (x, y), lambda: call(x, y))        # first call: both kernels compiled now
    assert plans.find(key) is None
    plans.record(key, (x, y), lambda: call(x, y))        # second call: both went direct
    plan = plans.find(key)
    assert plan is not None and plan.fresh == (((8,), torch.float32), ((8,), torch.float32))
    log.clear()
    x2, y2 = torch.randn(8), torch.randn(8)
    dq, none = plan((x2, y2))
    assert none is None and dq.shape == (8,) and dq is not x2
    (_, one), (_, two) = log
    # grid padded to three, the stream, function, metadata, no launch metadata, the two hooks
    assert one[:7] == (3, 1, 1, 1234, "function", "metadata", None)
    delta = one[10]
    assert one[9] is x2 and one[11:] == (8, 0.5, 64)
    assert two[:3] == (2, 4, 1)
    assert two[9] is x2 and two[10] is y2 and two[11] is delta and two[12] is dq and two[13] is x2
    assert two[14:] == (7, 32, True)
    plan((x2, y2))
    assert log[2][1][10] is not delta                   # fresh outputs at every replay


def test_a_result_the_launches_did_not_write_keeps_no_plan(on_gpu_like):
    log = []
    call = two_kernel_call(log, FakeDirect(log), FakeDirect(log), returns="copy")
    x, y = torch.randn(8), torch.randn(8)
    key = plans.signature((x, y), ("copy",))
    for _ in range(3):
        plans.record(key, (x, y), lambda: call(x, y))
    assert plans.find(key) is None


def test_a_launch_the_observer_did_not_see_keeps_no_plan(on_gpu_like):
    """A plain launch (a first compile, the autotuner) is counted but not observed."""
    log = []
    first = FakeDirect(log)
    x, y = torch.randn(8), torch.randn(8)

    def call():
        first((1,), (x, y, 1, 0.5))
        plans.count_launch()                            # a launch through kernel[grid]
        return ()

    key = plans.signature((x, y), ("unseen",))
    for _ in range(3):
        plans.record(key, (x, y), call)
    assert plans.find(key) is None


def test_plans_are_for_the_current_settings_only(on_gpu_like, monkeypatch):
    log = []
    call = two_kernel_call(log, FakeDirect(log), FakeDirect(log))
    x, y = torch.randn(8), torch.randn(8)
    key = plans.signature((x, y), ("settings",))
    for _ in range(2):
        plans.record(key, (x, y), lambda: call(x, y))
    assert plans.find(key) is not None
    with settings.override(tma=not settings.current.tma):
        assert plans.find(key) is None
    with settings.override(tma=settings.current.tma):    # a new settings object, equal: the plan holds
        assert plans.find(key) is not None


def test_a_plan_recorded_on_one_tensor_passed_thrice_is_not_used_for_three(on_gpu_like):
    """f(x, x) records both arguments as one slot: f(q, k) must not replay it (it would read k twice)."""
    log = []
    call = two_kernel_call(log, FakeDirect(log), FakeDirect(log))
    x = torch.randn(8)
    aliased = plans.signature((x, x), ("alias",))
    for _ in range(2):
        plans.record(aliased, (x, x), lambda: call(x, x))
    assert plans.find(aliased) is not None
    q, k = torch.randn(8), torch.randn(8)
    assert plans.signature((q, k), ("alias",)) != aliased and plans.find(plans.signature((q, k), ("alias",))) is None


def test_a_kernel_with_pre_run_hooks_keeps_no_plan(on_gpu_like):
    """DirectLaunch takes the plain path for a kernel with pre-run hooks: a replay would skip them."""
    log = []
    first = FakeDirect(log)
    first.raw = type("Raw", (), {"pre_run_hooks": [print]})()
    call = two_kernel_call(log, first, FakeDirect(log))
    x, y = torch.randn(8), torch.randn(8)
    key = plans.signature((x, y), ("hooks",))
    for _ in range(3):
        plans.record(key, (x, y), lambda: call(x, y))
    assert plans.find(key) is None


def test_a_signature_holds_layout_dtype_and_alignment(on_gpu_like):
    a = torch.zeros(4, 6)
    assert plans.signature((a,), ()) != plans.signature((a.t(),), ())
    assert plans.signature((a,), ()) != plans.signature((a.half(),), ())
    assert plans.signature((a,), ()) != plans.signature((torch.zeros(25)[1:].view(4, 6),), ())
    assert plans.signature((a,), ()) != plans.signature((torch.zeros(4, 6, device="meta"),), ())   # the device
    assert plans.signature((a,), ()) == plans.signature((torch.ones(4, 6),), ())


def test_no_plan_while_outputs_are_guarded_or_launches_watched(on_gpu_like):
    assert plans.enabled()
    with runtime.guarded_outputs():
        assert not plans.enabled()
    launch.OBSERVERS.append(print)
    try:
        assert not plans.enabled()
    finally:
        launch.OBSERVERS.remove(print)
    with settings.override(direct_launch=False):
        assert not plans.enabled()


# ---------------------------------------------------------------------------------------------
# on a GPU: the real kernels
# ---------------------------------------------------------------------------------------------
CASES = [  # (B, H, H_kv, S_q, S_k, D, causal, layout, dtype)
    (2, 4, 4, 300, 300, 64, True, "contiguous", torch.bfloat16),
    (1, 6, 2, 129, 257, 64, False, "bshd", torch.float16),
    (2, 2, 1, 2048, 2048, 128, True, "contiguous", torch.bfloat16),     # TMA loads
    (1, 2, 2, 77, 77, 160, True, "sliced", torch.float16),              # split head dim
    (1, 2, 2, 65, 65, 256, False, "contiguous", torch.bfloat16),        # dK, dV by two launches
]


@pytest.mark.skipif(not ON_GPU, reason="plans replay compiled kernels' launchers: GPU only")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[3]}x{c[4]}-D{c[5]}-{'causal' if c[6] else 'full'}-{c[7]}")
def test_replayed_calls_give_the_plain_paths_bits(case, monkeypatch):
    import flashattn

    B, H, H_kv, S_q, S_k, D, causal, layout, dtype = case
    monkeypatch.setattr(runtime, "_poison", False)      # (the suite poisons outputs: no plans then)
    # the Python node replays the Python plans (the C++ node's own replays: test_native_gpu.py)
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, native=False))
    replays = []
    real_call = plans.Plan.__call__
    monkeypatch.setattr(plans.Plan, "__call__", lambda self, inputs: replays.append(1) or real_call(self, inputs))

    def step(q, k, v, do):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = flashattn.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=H != H_kv)
        out.backward(do)
        return (out, *(t.grad for t in leaves))

    for _ in range(2):   # fresh inputs each round; within a round, three plan-eligible calls and a plain one
        q = rand(B, H, S_q, D, dtype=dtype, layout=layout)
        k, v = (rand(B, H_kv, S_k, D, dtype=dtype, layout=layout) for _ in range(2))
        do = rand(B, H, S_q, D, dtype=dtype)
        runs = [step(q, k, v, do) for _ in range(3)]
        with settings.override(direct_launch=False):
            plain = step(q, k, v, do)
        for run in runs:
            for got, want in zip(run, plain):
                assert torch.equal(got, want)
    assert len(replays) >= 6, "the second round's calls should have replayed the forward and backward plans"


@pytest.mark.skipif(not ON_GPU, reason="plans replay compiled kernels' launchers: GPU only")
def test_guarded_outputs_take_the_plain_path_with_plans_kept():
    import flashattn

    q, k, v = (rand(1, 2, 100, 64, dtype=torch.float16) for _ in range(3))
    for _ in range(3):
        flashattn.flash_attention(q, k, v, causal=True)
    with runtime.guarded_outputs() as guarded:
        o = flashattn.flash_attention(q, k, v, causal=True)
    assert guarded, "the guarded run allocated its outputs through runtime.new_output"
    assert not runtime.guard_violations(guarded)
    torch.testing.assert_close(o, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                               atol=2e-3, rtol=0)
