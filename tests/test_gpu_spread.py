"""conftest.py gives each pytest-xdist worker the host's GPUs rotated (worker i: GPU i mod GPUs
first), so that ``pytest`` on a box with several GPUs spreads the suite over all of them while
each worker still sees every GPU (the NCCL tests use them all)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def gpu_seen_by(worker: str, visible: str) -> str:
    """CUDA_VISIBLE_DEVICES after conftest.py is imported in xdist worker ``worker``."""
    env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "CUDA_VISIBLE_DEVICES": visible}
    code = "import conftest, os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    done = subprocess.run([sys.executable, "-c", code], cwd=TESTS, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return (done.stdout.strip().splitlines() or [""])[-1]


@pytest.mark.parametrize("worker, visible, expected", [
    ("gw0", "0,1,2,3", "0,1,2,3"),
    ("gw5", "0,1,2,3", "1,2,3,0"),
    ("gw3", "4,6", "6,4"),       # the GPUs the user made visible, not the host's numbering
    ("gw7", "2", "2"),           # one GPU: every worker shares it
    ("gw1", "", ""),             # none visible: nothing to order
])
def test_each_xdist_worker_starts_on_its_own_gpu(worker, visible, expected):
    assert gpu_seen_by(worker, visible) == expected
