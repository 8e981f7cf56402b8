"""The operator conformance suites, for a test module that runs them with its own `client` fixture."""

from __future__ import annotations

import re

import test_batch_norm
import test_batch_norm_backward
import test_batch_norm_elemt_backward
import test_batch_norm_reduce_backward
import test_group_norm
import test_layer_norm_backward
import test_layer_norm_forward
import test_layer_norm_grad
import test_rms_norm
import test_sync_batch_norm

# Error-table tests are left out: validation runs before any backend is reached.
_SKIP = re.compile(r"error_table|dtype_and_shape_relations|unknown_parameter|tiles_smaller|bias_dtype_must_equal")


def collect_into(namespace: dict) -> None:
    """Adds every conformance test to `namespace` (a module's globals), named after its suite."""
    for suite in (
        test_layer_norm_backward,
        test_layer_norm_grad,
        test_batch_norm_backward,
        test_batch_norm_elemt_backward,
        test_layer_norm_forward,
        test_rms_norm,
        test_group_norm,
        test_sync_batch_norm,
        test_batch_norm_reduce_backward,
        test_batch_norm,
    ):
        for name, fn in vars(suite).items():
            if name.startswith("test_") and callable(fn) and not _SKIP.search(name):
                namespace[f"{name}__{suite.__name__.removeprefix('test_')}"] = fn
