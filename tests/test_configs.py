"""Tile policy: configs that fit shared memory, the FLASHATTN_MAX_SHARED_MEMORY cap, step-down."""
import pytest
import torch

from flashattn import KernelConfig, configs, runtime
from flashattn.fast import tuning

from conftest import ON_GPU

KERNELS = [k for k in configs.CANDIDATES]


@pytest.mark.parametrize("limit", [48 * 1024, 64 * 1024, 99 * 1024, 227 * 1024], ids=lambda b: f"{b // 1024}KB")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kernel", KERNELS)
def test_configs_fit_shared_memory(kernel, head_dim, limit):
    """A T4 has 64 KB per block, an A100 164 KB, an H100 227 KB: the chosen configs fit (or, if
    none does, the smallest candidate is left for the compiler to judge)."""
    chosen = configs.fitting(kernel, head_dim, 2, limit)
    fits = [c for c in chosen
            if configs.shared_memory_estimate(kernel, c, runtime.head_dim_block(head_dim), 2) <= limit]
    assert fits == list(chosen) or chosen == (configs.CANDIDATES[kernel][-1],)


@pytest.mark.parametrize("limit", [64 * 1024, 99 * 1024, 227 * 1024], ids=lambda b: f"{b // 1024}KB")
@pytest.mark.parametrize("head_dim", [136, 160, 184, 192])
@pytest.mark.parametrize("kernel", ["fast_dq", "fast_dkdv"])
def test_split_head_dim_configs_fit_its_real_width(kernel, head_dim, limit):
    """The backward's split head dim holds 128 + tail columns, not 256: its configs are judged at
    that width, and on an H100 its own first choice fits, which the padded 256 columns would not."""
    tail = tuning.head_dim_tail(head_dim)
    width = 128 + tail
    chosen = configs.fitting(kernel, head_dim, 2, limit, tail=tail)
    fits = [c for c in chosen if configs.shared_memory_estimate(kernel, c, width, 2) <= limit]
    assert fits == list(chosen) or chosen == (configs.CANDIDATES[kernel][-1],)
    if limit == 227 * 1024:
        first = configs.PREFERRED[(kernel, configs.head_dim_class(head_dim, tail)[1])]
        assert chosen[0] == first
    assert configs.fitting(kernel, head_dim, 2, limit) == configs.fitting(kernel, 256, 2, limit)   # unsplit: padded


@pytest.mark.parametrize("limit", [64 * 1024, 99 * 1024, 227 * 1024], ids=lambda b: f"{b // 1024}KB")
@pytest.mark.parametrize("kernel", ["fast_dk", "fast_dv"])
def test_dk_and_dv_apart_get_their_own_tiles(kernel, limit):
    """At a 256-column tile dK and dV are two launches (``fast.tuning.dkdv_parts``), each with its
    H100 choice first where it fits, and something that fits on smaller GPUs."""
    chosen = configs.fitting(kernel, 256, 2, limit)
    assert all(configs.shared_memory_estimate(kernel, c, 256, 2) <= limit for c in chosen) \
        or chosen == (configs.CANDIDATES[kernel][-1],)
    if limit == 227 * 1024:
        assert chosen[0] == configs.PREFERRED[(kernel, 256)]


@pytest.mark.parametrize("elem_bytes", [2, 4], ids=["fp16", "fp32"])
def test_every_h100_choice_comes_first_where_it_fits(elem_bytes):
    """Each tile of PREFERRED (for fp32: PREFERRED_FP32 over it) is the first candidate at an
    H100's 227 KB wherever its estimate fits, whether or not the generic candidate list holds
    it (an fp32 choice outside that list was once dropped without a word)."""
    table = dict(configs.PREFERRED)
    if elem_bytes == 4:
        table.update(configs.PREFERRED_FP32)
    limit = 227 * 1024
    checked = 0
    for (kernel, d_class), cfg in table.items():
        if d_class in (160, 192):   # the split head dim's classes: test_split_head_dim_configs_...
            continue
        if configs.shared_memory_estimate(kernel, cfg, d_class, elem_bytes) > limit:
            continue
        assert configs.fitting(kernel, d_class, elem_bytes, limit)[0] == cfg, (kernel, d_class)
        checked += 1
    assert checked >= 7


def test_every_feature_choice_comes_first_on_an_h100():
    """Each tile of PREFERRED_WITH (lesson 09's features, the short causal forward) is the first
    candidate for its feature at an H100's 227 KB, and only for that feature: the same kernel
    without it keeps the dense choice."""
    limit = 227 * 1024
    for (kernel, d_class, feature), cfg in configs.PREFERRED_WITH.items():
        assert configs.shared_memory_estimate(kernel, cfg, d_class, 2) <= limit, (kernel, d_class, feature)
        assert configs.fitting(kernel, d_class, 2, limit, feature)[0] == cfg, (kernel, d_class, feature)
        assert configs.fitting(kernel, d_class, 2, limit)[0] == configs.PREFERRED[(kernel, d_class)]
    assert configs.fitting("fast_fwd", 64, 2, limit, "dropout")[0] != configs.fitting("fast_fwd", 64, 2, limit)[0]


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv", "fast_fwd", "fast_dq", "fast_dkdv"])
def test_64KB_gets_a_config_that_fits_up_to_D128(kernel):
    for head_dim in (64, 128):
        cfg = configs.fitting(kernel, head_dim, 2, 64 * 1024)[0]
        assert configs.shared_memory_estimate(kernel, cfg, head_dim, 2) <= 64 * 1024


def test_bigger_device_gets_bigger_tiles():
    small = configs.fitting("fwd", 128, 2, 64 * 1024)[0]
    large = configs.fitting("fwd", 128, 2, 227 * 1024)[0]
    assert large.BLOCK_M * large.BLOCK_N > small.BLOCK_M * small.BLOCK_N


@pytest.mark.parametrize("raw, value", [("65536", 65536), ("64K", 65536), ("100k", 102400), ("", None)])
def test_shared_memory_cap_from_the_environment(setenv, raw, value):
    setenv(configs.SHARED_MEMORY_ENV, raw)
    assert configs.shared_memory_cap() == value


@pytest.mark.parametrize("raw", ["lots", "1K", "-5"])
def test_bad_shared_memory_cap_is_refused(raw):
    from flashattn import settings

    with pytest.raises(ValueError, match=configs.SHARED_MEMORY_ENV):    # where it is read: at import
        settings.read({configs.SHARED_MEMORY_ENV: raw})


@pytest.mark.skipif(not ON_GPU, reason="reads the GPU's shared memory (CPU: the interpreter has no limit)")
def test_cap_lowers_the_device_limit(setenv):
    real = configs.device_shared_memory()
    setenv(configs.SHARED_MEMORY_ENV, "64K")
    assert configs.device_shared_memory() == min(real, 65536)


def test_fast_candidates_respect_the_divisibility_the_kernels_need():
    for c in configs.CANDIDATES["fast_dq"]:
        assert c.BLOCK_M % c.BLOCK_N == 0, c
    for c in configs.CANDIDATES["fast_dkdv"] + configs.CANDIDATES["fast_dk"] + configs.CANDIDATES["fast_dv"]:
        assert c.BLOCK_N % c.BLOCK_M == 0, c
    with pytest.raises(ValueError, match="divide"):
        tuning._check_divisibility("dkdv", KernelConfig(64, 32))


def test_kernel_config_round_trips_through_triton():
    for cfg in (KernelConfig(128, 64, 8, 3), KernelConfig(128, 64, 8, 2, maxnreg=128)):
        assert KernelConfig.from_triton(cfg.to_triton()) == cfg
    assert KernelConfig(128, 64, 8, 2, maxnreg=128).launch_options()["maxnreg"] == 128
    assert "maxnreg" not in KernelConfig(128, 64, 8, 3).launch_options()   # the compiler's choice


def test_launch_steps_down_on_out_of_resources():
    from triton.runtime.errors import OutOfResources

    tried = []

    def run(cfg):
        tried.append(cfg)
        if cfg.BLOCK_M > 32:
            raise OutOfResources(300000, 65536, "shared memory")

    candidates = [KernelConfig(128, 64), KernelConfig(64, 64), KernelConfig(32, 32)]
    chosen = configs.launch(("test-key",), candidates, run)
    assert chosen == KernelConfig(32, 32) and len(tried) == 3
    tried.clear()
    configs.launch(("test-key",), candidates, run)  # remembered: no retries the second time
    assert tried == [KernelConfig(32, 32)]


def test_launch_steps_past_a_register_cap_ptxas_cannot_meet():
    """A config with ``maxnreg`` that ptxas cannot compile within the cap gives way to the next;
    any other compiler error, or one from a config without a cap, is raised as it came."""
    class PTXASError(RuntimeError):
        pass

    capped, plain = KernelConfig(128, 64, 8, 2, maxnreg=128), KernelConfig(64, 64, 4, 3)

    def run(cfg):
        if cfg.maxnreg:
            raise PTXASError("ptxas fatal   : (C7602) Insufficient registers (128) to compile instruction")

    assert configs.launch(("test-cap",), [capped, plain], run) == plain

    def broken(cfg):
        raise PTXASError("ptxas fatal   : Insufficient registers (128) to compile instruction")

    with pytest.raises(PTXASError):
        configs.launch(("test-cap-2",), [plain], broken)

    def other(cfg):
        raise PTXASError("ptxas fatal   : Unresolved extern function")

    with pytest.raises(PTXASError):
        configs.launch(("test-cap-3",), [capped, plain], other)


def test_interpreter_uses_small_fixed_tiles():
    if not runtime.INTERPRET:
        pytest.skip("the GPU picks from the candidates")
    assert configs.candidates("dq", 64, torch.float32, torch.device("cpu")) == (configs.INTERPRETER_CONFIG,)
