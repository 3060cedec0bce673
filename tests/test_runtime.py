"""Runtime policy: interpreter switch, block sizes that fit shared memory, poisoned outputs."""
import os

import pytest
import torch

import flashattn
from flashattn import KernelConfig, runtime

from conftest import ON_GPU


def test_interpreter_matches_device():
    assert runtime.INTERPRET == (os.environ.get("TRITON_INTERPRET") == "1")
    assert ON_GPU == torch.cuda.is_available() or runtime.INTERPRET


@pytest.mark.parametrize("head_dim, block", [(8, 16), (16, 16), (24, 32), (64, 64), (72, 128), (256, 256)])
def test_head_dim_padding(head_dim, block):
    assert runtime.head_dim_block(head_dim) == block


@pytest.mark.parametrize("limit", [48 * 1024, 64 * 1024, 99 * 1024, 227 * 1024], ids=lambda b: f"{b // 1024}KB")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_configs_fit_shared_memory(kernel, head_dim, limit):
    """A T4 has 64 KB per block, an A100 164 KB, an H100 227 KB: the chosen configs fit."""
    configs = runtime.fitting_configs(kernel, head_dim, 2, limit)
    for cfg in configs:
        assert runtime.shared_memory_estimate(kernel, cfg, runtime.head_dim_block(head_dim), 2) <= limit


def test_bigger_device_gets_bigger_tiles():
    small = runtime.fitting_configs("fwd", 128, 2, 64 * 1024)[0]
    large = runtime.fitting_configs("fwd", 128, 2, 227 * 1024)[0]
    assert large.BLOCK_M * large.BLOCK_N > small.BLOCK_M * small.BLOCK_N


def test_launch_steps_down_on_out_of_resources():
    from triton.runtime.errors import OutOfResources

    tried = []

    def run(cfg):
        tried.append(cfg)
        if cfg.BLOCK_M > 32:
            raise OutOfResources(300000, 65536, "shared memory")

    configs = [KernelConfig(128, 64), KernelConfig(64, 64), KernelConfig(32, 32)]
    chosen = runtime.launch(("test-key",), configs, run)
    assert chosen == KernelConfig(32, 32) and len(tried) == 3
    tried.clear()
    runtime.launch(("test-key",), configs, run)  # remembered: no retries the second time
    assert tried == [KernelConfig(32, 32)]


def test_poisoned_outputs_start_as_nan():
    with runtime.poisoned_outputs():
        assert torch.isnan(runtime.new_output((3, 4), torch.float32, "cpu")).all()


def test_where_says_something():
    assert "triton" in flashattn.where()
