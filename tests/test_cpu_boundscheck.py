"""The cpu kernels never index outside their arrays: their tests, run with Numba's bounds checks on.

NUMBA_BOUNDSCHECK=1 makes every array access of every kernel check its index (an out-of-bounds one
raises IndexError, which the service answers 561000, failing the test). Compiled code differs, so
these kernels get their own Numba cache, beside the regular one and keyed like it: they compile
once per machine and kernel version (minutes on 2 cores), later runs load them. The run covers the
warm-up (every signature), every operator with a kernel, contiguous, strided, gathered and
channel-last layouts, every output mask and dtype, and the differential fuzz.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNEL_TESTS = ("tests/test_cpu_backend.py", "tests/test_cpu_norm_kernels.py", "tests/test_backend_agreement.py")


def boundscheck_env() -> dict[str, str]:
    """Bounds checks on, and a kernel cache root of their own beside the regular one (keyed and
    pruned like it, by the code version)."""
    from aclnn_server.backends.cpu import _jit

    return dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=f"{_jit.cache_root()}-boundscheck")


@pytest.mark.slow  # the first run on a machine compiles every kernel again, with bounds checks (minutes)
@pytest.mark.timeout(3600)
def test_cpu_kernels_stay_in_bounds():
    env = boundscheck_env()
    probe = "import numba, numpy as np\ntry:\n    numba.njit(lambda a: a[2])(np.zeros(2))\n"
    probe += "except IndexError:\n    print(1)"
    checks = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert checks.stdout.strip() == "1", "NUMBA_BOUNDSCHECK=1 did not turn bounds checks on"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3500,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
