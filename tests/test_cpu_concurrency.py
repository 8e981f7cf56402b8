"""The cpu backend under concurrent calls, through a real server process.

Numba's workqueue threading layer aborts the whole process when two threads launch parallel
kernels at once; the server pins a thread-safe layer (TBB, else OpenMP) and, when neither is
there, runs its kernel calls one at a time. A server process is used so that an abort shows
as the process dying.
"""

from __future__ import annotations

import concurrent.futures
import re

import numpy as np
import pytest
from batch_norm_cases import bn_call, elemt_call
from batch_norm_forward_cases import forward_call
from group_norm_cases import group_norm_backward_call, group_norm_call
from layer_norm_cases import layer_norm_call
from layer_norm_forward_cases import layer_norm_forward_call
from oracle import BF16, assert_close
from rms_norm_cases import rms_norm_call, rms_norm_grad_call
from sync_batch_norm_cases import REDUCE_OUTPUTS, gather_call, reduce_call, stats_call
from sync_batch_norm_cases import elemt_call as sync_elemt_call
from test_grpc_abuse import Server
from test_layer_norm_grad import lng_call

from aclnn_client import Client
from aclnn_server import LocalClient
from aclnn_server.ops import OPERATORS

OUTPUTS = {
    "aclnnLayerNormBackward": ("gradInputOut", "gradWeightOut", "gradBiasOut"),
    "LayerNormGrad": ("pd_x", "pd_gamma", "pd_beta"),
    "aclnnBatchNormBackward": ("gradInput", "gradWeight", "gradBias"),
    "aclnnBatchNormElemtBackward": ("gradInput",),
    "aclnnLayerNorm": ("out", "meanOutOptional", "rstdOutOptional"),
    "aclnnRmsNorm": ("yOut", "rstdOut"),
    "aclnnRmsNormGrad": ("dxOut", "dgammaOut"),
    "aclnnGroupNorm": ("out", "meanOut", "rstdOut"),
    "aclnnGroupNormBackward": ("gradInput", "gradGammaOut", "gradBetaOut"),
    "aclnnBatchNormStats": ("mean", "invstd"),
    "aclnnBatchNormGatherStatsWithCounts": ("meanAll", "invstdAll"),
    "aclnnBatchNormElemt": ("output",),
    "aclnnBatchNormReduceBackward": REDUCE_OUTPUTS,
    "aclnnBatchNorm": ("output", "saveMean", "saveInvstd"),
}


def cases() -> list[tuple[str, dict]]:
    """Every operator, large enough for the parallel path (>= 64 Ki input elements) and small."""
    rng = np.random.default_rng(14)
    return [
        ("aclnnLayerNormBackward", layer_norm_call(rng, (256, 512), 1)),
        ("aclnnLayerNormBackward", layer_norm_call(rng, (96, 1024), 1, BF16, "float32")),
        ("aclnnLayerNormBackward", layer_norm_call(rng, (4, 16), 1)),
        ("LayerNormGrad", lng_call(rng, (64, 32, 64), (64, 32, 1), (64,))),
        ("LayerNormGrad", lng_call(rng, (2, 3, 8), (2, 3, 1), (8,))),
        ("aclnnBatchNormBackward", bn_call(rng, (8, 16, 32, 32), 1)),
        ("aclnnBatchNormBackward", bn_call(rng, (4, 3, 5), 1, training=False)),
        ("aclnnBatchNormElemtBackward", elemt_call(rng, (8, 16, 32, 32))),
        ("aclnnBatchNormElemtBackward", elemt_call(rng, (4, 3, 5))),
        ("aclnnLayerNorm", layer_norm_forward_call(rng, (64, 1024), 1)),
        ("aclnnRmsNorm", rms_norm_call(rng, (64, 1024), 1)),
        ("aclnnRmsNormGrad", rms_norm_grad_call(rng, (64, 1024), 1, BF16, "float32")),
        ("aclnnGroupNorm", group_norm_call(rng, (8, 16, 32, 16), 4)),
        ("aclnnGroupNormBackward", group_norm_backward_call(rng, (8, 16, 32, 16), 4)),
        ("aclnnBatchNormStats", stats_call(rng, (8, 16, 32, 32))),
        # No running statistics: calls sharing one in/out array would update it in any order.
        ("aclnnBatchNormGatherStatsWithCounts", gather_call(rng, 64, 8, running=False)),
        ("aclnnBatchNormElemt", sync_elemt_call(rng, (8, 16, 32, 32))),
        ("aclnnBatchNormReduceBackward", reduce_call(rng, (8, 16, 32, 32))),
        ("aclnnBatchNormReduceBackward", reduce_call(rng, (4, 3, 5), flags=(True, False, True))),
        # Training without running statistics (shared in/out arrays); inference reads them only.
        ("aclnnBatchNorm", forward_call(rng, (8, 16, 32, 32), running=False)),
        ("aclnnBatchNorm", dict(forward_call(rng, (4, 3, 5), training=False), saveMean=None, saveInvstd=None)),
    ]


def fresh(p: dict, op: str) -> dict:
    """The call with output arrays of its own (each call writes its results into them)."""
    return {k: (np.full_like(v, np.nan) if k in OUTPUTS[op] and v is not None else v) for k, v in p.items()}


@pytest.mark.parametrize("layer", ["pinned", "workqueue"])
def test_concurrent_cpu_calls_of_every_operator(layer):
    """64 calls of every operator at once from 8 threads, 4 executing at a time: all agree with the
    NumPy backend and the server lives. Pinned: a thread-safe layer is in force. Workqueue only
    (as without TBB and OpenMP): the server says so and runs its kernels one at a time."""
    assert set(OUTPUTS) == set(OPERATORS), "a new operator joins this test"
    env = {"NUMBA_THREADING_LAYER": "workqueue"} if layer == "workqueue" else {}
    server = Server("--backend", "cpu", "--max-concurrency", "4", "--log-level", "INFO", env=env)
    calls = cases()
    with LocalClient(backend="numpy") as reference:
        expected = []
        for op, p in calls:
            q = fresh(p, op)
            reference.run(op, **q)
            expected.append({name: q[name] for name in OUTPUTS[op] if q[name] is not None})

    def run(client: Client, i: int) -> None:
        op, p = calls[i % len(calls)]
        q = fresh(p, op)
        client.run(op, **q)
        for name, want in expected[i % len(calls)].items():
            assert_close(q[name], want.astype(np.float64), f"{op} {name}")

    try:
        with Client(server.address) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(run, client, i) for i in range(64 * len(calls))]:
                future.result()
        assert server.proc.poll() is None, "the server died"
    finally:
        log = server.stop()
    assert server.proc.returncode == 0, log[-2000:]
    reported = re.search(r"cpu backend: Numba threading layer (\w+)", log)
    assert reported, log[-2000:]
    if layer == "pinned":
        assert reported[1] in ("tbb", "omp"), log[-2000:]
    else:
        assert reported[1] == "workqueue" and "one at a time" in log
