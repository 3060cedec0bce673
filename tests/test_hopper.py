"""flashattn.hopper's host logic, on any machine: when the Gluon forward may run and why not
(availability, the setting, supports()' reasons, the copy engine's stride rules). The kernel
itself runs in tests/test_hopper_gpu.py, on a Hopper GPU only."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from flashattn import hopper, settings
from flashattn.hopper import gluon_api, host

from conftest import DEVICE

ROOT = Path(__file__).resolve().parent.parent


def _qkv(B=2, H=4, H_kv=2, S_q=65, S_k=127, D=64, dtype=torch.float16):
    return (torch.randn(B, H, S_q, D, dtype=dtype), torch.randn(B, H_kv, S_k, D, dtype=dtype),
            torch.randn(B, H_kv, S_k, D, dtype=dtype))


@pytest.fixture
def pretend_hopper(monkeypatch):
    """supports()' own rules, past the availability check a CPU fails first."""
    monkeypatch.setattr(hopper, "availability", lambda device=None: (True, ""))


def test_the_module_imports_and_says_why_it_is_off_here():
    ok, why = hopper.availability()
    if not torch.cuda.is_available():
        assert not ok and why and not hopper.available()
    ok, why = hopper.supports(*_qkv(), causal=True, scale=0.125)
    if not torch.cuda.is_available():
        assert not ok and why


def test_the_gluon_api_check_follows_the_triton_release():
    assert gluon_api._version("3.6.0") == (3, 6) and gluon_api._version("3.10.0+git1a2b") == (3, 10)
    written_for = gluon_api._version(triton.__version__) in gluon_api.WRITTEN_FOR
    assert gluon_api.ok() == (written_for and gluon_api.ERROR is None)
    if not written_for:
        assert not gluon_api.ok() and gluon_api.ERROR       # a missing name, or the release named


def test_the_setting_turns_it_off(setenv):
    setenv("FLASHATTN_GLUON", "0")
    assert not settings.current.gluon
    assert hopper.availability() == (False, "FLASHATTN_GLUON=0")
    setenv("FLASHATTN_GLUON")
    assert settings.current.gluon


def test_without_the_gluon_api_it_is_off(monkeypatch):
    monkeypatch.setattr(gluon_api, "ERROR", "triton 9.9: the Gluon kernels were written for triton 3.6")
    ok, why = hopper.availability()
    assert not ok and "Gluon API" in why and "3.6" in why


def test_attention_forward_refuses_with_the_reason():
    if hopper.available():
        pytest.skip("this machine runs the Gluon forward")
    with pytest.raises(ValueError, match="flashattn.hopper cannot run this"):
        hopper.attention_forward(*_qkv(), causal=False, scale=0.125)


def test_supports_plain_inputs(pretend_hopper):
    for D in (64, 128):
        for dtype in (torch.float16, torch.bfloat16):
            assert hopper.supports(*_qkv(D=D, dtype=dtype), causal=True, scale=D ** -0.5) == (True, "")
    assert hopper.supports(*_qkv(H=8, H_kv=1, S_q=1, S_k=1)) == (True, "")       # GQA 8:1, one row


@pytest.mark.parametrize("make, reason", [
    (lambda: _qkv(dtype=torch.float32), "fp16 or bf16"),
    (lambda: (_qkv()[0], *_qkv(dtype=torch.bfloat16)[1:]), "all alike"),
    (lambda: _qkv(D=96), "head dim 96"),
    (lambda: _qkv(D=256), "head dim 256"),
    (lambda: _qkv(H=6, H_kv=4), "not a multiple"),
    (lambda: (_qkv()[0], _qkv()[1], _qkv(S_k=5)[2]), "must be [B, H_kv, S_k, D]"),
    (lambda: (_qkv()[0][0], *_qkv()[1:]), "[B, H, S, D]"),
    (lambda: _qkv(S_q=0), "empty"),
])
def test_supports_refuses_with_a_reason(pretend_hopper, make, reason):
    ok, why = hopper.supports(*make(), causal=False)
    assert not ok and reason in why, why


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_supports_wants_a_positive_scale(pretend_hopper, scale):
    ok, why = hopper.supports(*_qkv(), causal=False, scale=scale)
    assert not ok and "positive scale" in why


def test_the_grid_limit_on_batch_times_heads(pretend_hopper):
    q = torch.empty(1, 70000, 1, 64, dtype=torch.float16)
    k = torch.empty(1, 1, 1, 64, dtype=torch.float16)
    ok, why = hopper.supports(q, k, k.clone())
    assert not ok and "B * H = 70000" in why


# --- the copy engine's rules -------------------------------------------------------------
def test_layouts_the_copy_engine_takes(pretend_hopper):
    q, k, v = _qkv(D=128)
    bshd = torch.randn(2, 65, 4, 128, dtype=torch.float16).transpose(1, 2)            # [B, S, H, D] storage
    heads = torch.randn(2, 7, 65, 128, dtype=torch.float16)[:, 1:5]                  # a slice of heads
    assert host.layout_problem(bshd, "q") == "" and host.layout_problem(heads, "q") == ""
    assert hopper.supports(bshd, k, v) == (True, "") and hopper.supports(heads, k, v) == (True, "")


@pytest.mark.parametrize("make, reason", [
    (lambda: torch.randn(2, 4, 65, 128, dtype=torch.float16)[..., ::2], "last stride is 2"),
    (lambda: torch.randn(2, 4, 65, 68, dtype=torch.float16)[..., :64], "stride 68 in dim 2 is not a multiple of 16 bytes"),
    (lambda: torch.randn(2, 1, 65, 64, dtype=torch.float16).expand(2, 4, 65, 64), "stride 0 in dim 1"),
    (lambda: torch.randn(2 * 4 * 65 * 64 + 1, dtype=torch.float16)[1:].view(2, 4, 65, 64), "not 16-byte aligned"),
])
def test_layouts_the_copy_engine_refuses(pretend_hopper, make, reason):
    t = make()
    assert reason in host.layout_problem(t, "q")
    ok, why = hopper.supports(t, *_qkv(H_kv=4)[1:])
    assert not ok and reason in why


def test_a_dim_of_one_gets_a_dense_stride():
    """torch reports any stride for a dim of size 1 (here 1, unaligned); the copy engine never steps
    over it, so the launcher gives it the dense value, and supports() does not refuse it."""
    t = torch.randn(1, 1, 65, 64, dtype=torch.float16).as_strided((1, 1, 65, 64), (1, 1, 64, 1))
    assert host.layout_problem(t, "q") == ""
    assert host.descriptor_strides(t) == [65 * 64, 65 * 64, 64, 1]
    bshd = torch.randn(3, 65, 4, 64, dtype=torch.float16).transpose(1, 2)
    assert host.descriptor_strides(bshd) == list(bshd.stride())                       # nothing to change


def test_the_kernels_compile_for_sm90_without_a_gpu():
    """Under the Triton they were written for, the Gluon forward compiles for sm_90 (front end,
    LLVM and ptxas; no driver) with no spills, and the launcher's arguments bind through the JIT
    (``--launcher``: launch_args + warmup with a stand-in driver). Elsewhere there is nothing to compile."""
    if not gluon_api.ok():
        pytest.skip(f"Gluon API: {gluon_api.ERROR}")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "flashattn.hopper.offline", "--launcher", "--only", "bf16", "D128", "causal", "ws"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "launcher: launch_args + warmup bound and compiled" in out.stdout, out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("bf16 D128 causal ws")]
    assert len(rows) == 1 and "FAILED" not in rows[0], out.stdout
    regs, spills = rows[0].split()[4:6]
    assert spills == "0/0", rows[0]


def test_lse_and_delta_are_padded_to_whole_tiles_for_the_copy_engine():
    """The backward's copy-engine variants read LSE and delta as one flat vector in boxes of a tile:
    each head's rows padded to whole tiles (a box never starts off a tile or crosses into the next
    head), the values kept, the padding zero; no copy where the rows are whole tiles already."""
    x = torch.randn(2, 3, 65)
    flat = host.padded_rows(x, 64)
    assert flat.shape == (2 * 3 * 128,)
    rows = flat.view(2, 3, 128)
    assert torch.equal(rows[..., :65], x) and not rows[..., 65:].any()
    whole = torch.randn(2, 3, 128)
    assert host.padded_rows(whole, 64).data_ptr() == whole.data_ptr()         # a view, no copy
    strided = torch.randn(2, 3, 256)[..., ::2]                                 # not dense: copied
    assert torch.equal(host.padded_rows(strided, 64).view(2, 3, 128), strided)
    one = host.padded_rows(torch.ones(1, 2, 1), 64).view(1, 2, 64)
    assert one[..., 0].eq(1).all() and not one[..., 1:].any()
    huge = torch.empty(1, 2 ** 16, 2 ** 15 + 1, device="meta")                # 32-bit coordinates overflow
    with pytest.raises(ValueError, match="32-bit coordinates"):
        host.padded_rows(huge, 64)


def test_the_backward_compiles_for_sm90_without_a_gpu():
    """The Gluon backward's fastest variant at each head dim (``backward.BEST``, without the mask: causal,
    the D 128 one spills 12 bytes, results/gluon_backward_profile_h200.md) and every variant the fast
    path dispatches (``hopper.BACKWARD_PREFERRED``, with its mask) compile for sm_90 under the Triton
    they were written for, without a spill. Elsewhere there is nothing to compile."""
    if not gluon_api.ok():
        pytest.skip(f"Gluon API: {gluon_api.ERROR}")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    from flashattn.hopper import backward as bwd

    compiles = [(D, "full", variant) for D, variant in sorted(bwd.BEST.items())]
    compiles += [(D, "causal" if causal else "full", variant)                 # what the fast path dispatches
                 for (D, causal), (_, variant) in sorted(hopper.BACKWARD_PREFERRED.items())]
    for D, mask, variant in compiles:
        out = subprocess.run([sys.executable, "-m", "flashattn.hopper.offline", "--backward", "--only", "bf16",
                              f"D{D}", mask, variant], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = [line for line in out.stdout.splitlines() if line.startswith(f"bwd bf16 D{D} {mask} {variant} ")]
        assert len(rows) == 1 and "spill 0/0" in rows[0], out.stdout


def test_flashattn_imports_where_triton_has_no_gluon():
    """The Gluon kernels' module is imported only where Gluon is the API it was written for: a
    Triton without ``triton.experimental.gluon`` still imports flashattn and its fast path."""
    import subprocess
    import sys

    script = (
        "import builtins\n"
        "real = builtins.__import__\n"
        "def refuse(name, globals=None, locals=None, fromlist=(), level=0):\n"
        "    if name.startswith('triton.experimental.gluon') or (name == 'triton.experimental' and fromlist and 'gluon' in fromlist):\n"
        "        raise ImportError('no gluon in this triton')\n"
        "    return real(name, globals, locals, fromlist, level)\n"
        "builtins.__import__ = refuse\n"
        "import flashattn, flashattn.fast.forward, flashattn.hopper as h\n"
        "ok, why = h.availability()\n"
        "assert not ok and 'no gluon' in why, why\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_the_ring_model_holds_the_kernels_parities_and_fails_wrong_ones():
    """Lesson 12's model of the mbarrier ring: the forward's slot and parity formulas read every tile
    in order under random schedules, for 1-4 slots; a consumer parity that forgets the slot's reuse,
    a producer that waits on the ready parity, and a consumer that never waits (it reads a slot
    before the copy lands) each fail."""
    from flashattn.hopper import lesson

    for stages in (1, 2, 3, 4):
        assert lesson.ring_is_sound(stages, 25, runs=100) == (True, ""), stages
    assert not lesson.ring_is_sound(3, 25, consumer_parity=lambda j: j & 1)[0]
    assert not lesson.ring_is_sound(3, 25, producer_parity=lambda j: (j // 3) & 1)[0]
    ok, why = lesson.ring_is_sound(3, 25, consumer_parity=lambda j: 1)      # a fresh barrier's free phase
    assert not ok and "read slot" in why, why


def test_the_backward_preference_reads_its_table(monkeypatch):
    """``preferred_backward``: the variant of ``BACKWARD_PREFERRED`` for (head dim, causal) from its
    fewest keys on; none off the table, below it, or under deterministic algorithms (the Gluon
    backward adds dQ with atomics). The committed table has the one row that measured faster: D 64
    causal from 4k keys."""
    assert hopper.BACKWARD_PREFERRED == {(64, True): (4096, "ws_tma")}
    q, k, _ = _qkv()                                     # D 64
    assert hopper.preferred_backward(q, k, False) is None
    assert hopper.preferred_backward(q, k, True) is None                       # too few keys for the row
    long_k = k.new_zeros(k.shape[0], k.shape[1], 4096, k.shape[3])
    assert hopper.preferred_backward(q, long_k, True) == "ws_tma"
    assert hopper.preferred_backward(q, long_k, False) is None
    assert hopper.preferred_backward(torch.zeros(1, 1, 8, 128), torch.zeros(1, 1, 4096, 128), True) is None
    monkeypatch.setitem(hopper.BACKWARD_PREFERRED, (q.shape[-1], False), (k.shape[2], "ws_tma"))
    assert hopper.preferred_backward(q, k, False) == "ws_tma"
    assert hopper.preferred_backward(q, k, True) is None                       # another row, too few keys
    monkeypatch.setitem(hopper.BACKWARD_PREFERRED, (q.shape[-1], False), (k.shape[2] + 1, "ws_tma"))
    assert hopper.preferred_backward(q, k, False) is None                      # too few keys
    monkeypatch.setitem(hopper.BACKWARD_PREFERRED, (q.shape[-1], False), (1, "ws_tma"))
    torch.use_deterministic_algorithms(True)
    try:
        assert hopper.preferred_backward(q, k, False) is None
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_fast_backward_hands_a_preferred_call_to_the_gluon_backward(monkeypatch):
    """With a row in ``BACKWARD_PREFERRED`` and ``supports`` agreeing, ``fast_attention_backward``
    hands a plain call of all three gradients to ``hopper.launch_backward``; a call for dK and dV
    alone, one that asks for the two tl kernels (``backward="two-kernel"``), or one ``supports``
    refuses, stays on the ``tl`` kernels."""
    from flashattn import runtime
    from flashattn.fast.backward import fast_attention_backward

    if not runtime.INTERPRET and not torch.cuda.is_available():
        pytest.skip("compiled kernels (TRITON_INTERPRET=0) and no GPU: no kernel can launch here")
    q, k, v = (t.to(DEVICE) for t in _qkv())            # (the kernels' device: compiled ones take no CPU tensors)
    o, do, lse = torch.randn_like(q), torch.randn_like(q), torch.zeros(q.shape[:3], device=DEVICE)
    calls = []
    monkeypatch.setitem(hopper.BACKWARD_PREFERRED, (q.shape[-1], False), (1, "ws_tma"))
    monkeypatch.setattr(hopper, "supports", lambda *a: (True, ""))
    monkeypatch.setattr(hopper, "launch_backward",
                        lambda *a, delta: calls.append((a[-1], tuple(delta.shape))) or ("dq", "dk", "dv"))
    assert fast_attention_backward(q, k, v, o, do, lse, False, 0.125) == ("dq", "dk", "dv")
    assert calls == [("ws_tma", tuple(q.shape[:3]))]       # with the fast path's delta
    monkeypatch.setattr(hopper, "launch_backward", lambda *a, **kw: pytest.fail("dK, dV alone went to the Gluon backward"))
    dq, dk, dv = fast_attention_backward(q, k, v, o, do, lse, False, 0.125, needs_dq=False)
    assert dq is None and dk.shape == k.shape
    monkeypatch.setattr(hopper, "launch_backward", lambda *a, **kw: pytest.fail("backward='two-kernel' went to Gluon"))
    assert fast_attention_backward(q, k, v, o, do, lse, False, 0.125, fused=False)[0].shape == q.shape
    monkeypatch.setattr(hopper, "launch_backward", lambda *a, **kw: pytest.fail("went to the Gluon backward"))
    with hopper.tl_backward_only():                  # the benchmarks' baseline
        assert fast_attention_backward(q, k, v, o, do, lse, False, 0.125)[0].shape == q.shape
    assert hopper.BACKWARD_PREFERRED == {(64, True): (4096, "ws_tma"), (q.shape[-1], False): (1, "ws_tma")}  # restored
    monkeypatch.setattr(hopper, "supports", lambda *a: (False, "not Hopper"))
    dq, dk, dv = fast_attention_backward(q, k, v, o, do, lse, False, 0.125)
    assert dq.shape == q.shape

