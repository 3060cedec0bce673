"""Ring attention with NCCL on 2 and 4 GPUs of one host, at realistic sizes, against one GPU
(``flashattn.distributed.selftest``; the same as ``python -m flashattn.distributed.selftest``).
Skipped, with the reason, where the host has fewer GPUs. Run it alone: ``pytest -n 0
tests/test_distributed_gpu.py`` (it spawns one process per GPU)."""
import pytest
import torch

from flashattn.distributed import selftest

GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(GPUS < 2, reason=f"ring attention over NCCL needs 2 or more GPUs, found {GPUS}")


@pytest.mark.parametrize("world", [2, 4])
def test_nccl_ring_matches_one_gpu(world):
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs, found {GPUS}")
    result = selftest.run(world)
    print(result.text)
    assert result.ok, result.text
