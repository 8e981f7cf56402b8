"""A small call's fixed cost, cut without changing a result: the shortcuts taken on the common layouts
(C-contiguous views, CPU tensors of a NumPy dtype) give what the general paths give."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from aclnn_common.types import torch_array
from aclnn_server.backends.cpu import _jit, kernel_modules, thread_count_access


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((64, 64), np.float32),
        torch.empty(64, 1).numpy(),  # a size-1 dim's stride as torch gives it (relaxed strides)
        np.zeros((1, 5, 1, 3), np.float16),
        np.lib.stride_tricks.as_strided(np.zeros(12, np.float32), (3, 1, 4), (16, 400, 4)),  # any size-1 stride
        np.zeros((7,), np.float32),
        np.zeros((1, 1), np.float32),
    ],
)
def test_a_contiguous_views_strides_and_merged_shape_are_the_general_paths(array):
    assert array.flags.c_contiguous
    assert _jit.contiguous_strides(array.shape) == _jit.element_strides(array)
    base, strides = _jit.flat(array)
    assert strides == _jit.element_strides(array) and base.shape == (array.size,) and not base.flags.writeable
    shape = (array.size // array.shape[-1], array.shape[-1])
    fast = _jit.kernel_ready(array, shape)
    merged = _jit.merged_strides(array.shape, _jit.element_strides(array), shape)
    assert fast.shape == shape and np.shares_memory(fast, array)
    assert _jit.element_strides(fast) == tuple(s if d > 1 else 0 for s, d in zip(merged, shape))
    assert _jit.kernel_ready(array, (array.size + 1,)) is None  # another element count: no view


@pytest.mark.parametrize(("m", "n"), [(5000, 1), (5000, 3), (300, 64), (64, 64), (2, 5)])
@pytest.mark.parametrize("scale", [1.0, 1e36])
def test_the_layer_norm_kernel_adds_its_column_partials_as_numpy_does(rng, m, n, scale):
    """The kernel's fp64 column sums (once NumPy's sum(axis=0, dtype=float64) on the host) are that
    sum of its own fp32 partials, bit for bit, and it says when one is not finite."""
    module = kernel_modules()["aclnnLayerNormBackward"]
    g = (rng.standard_normal((m, n)) * scale).astype(np.float32)
    x = rng.standard_normal((m, n)).astype(np.float32)
    blocks, rows = module.n_blocks(m), module.block_rows(m)
    part_g, part_gx = np.empty((blocks, n), np.float32), np.empty((blocks, n), np.float32)
    sums = np.empty(n), np.empty(n)
    (gb, gs), (xb, xs) = _jit.flat(g), _jit.flat(x)
    stats = np.zeros(m, np.float32), np.ones(m, np.float32)
    trouble = module.rows_kernel.run(
        *(gb, gs, xb, xs, _jit.F32, (m, n), *stats, np.ones(n, np.float32), np.empty((1, 1), np.float32)),
        *(_jit.F32, part_g, part_gx, rows, False, True, np.empty(blocks, np.bool_), *sums),
    )
    expected = part_g.sum(axis=0, dtype=np.float64), part_gx.sum(axis=0, dtype=np.float64)
    assert np.array_equal(sums[0], expected[0], equal_nan=True)
    assert np.array_equal(sums[1], expected[1], equal_nan=True)
    assert trouble == (not (np.isfinite(expected[0]).all() and np.isfinite(expected[1]).all()))


def test_torch_tensors_are_seen_in_place_or_refused_as_before():
    t = torch.arange(6.0).reshape(2, 3)
    assert np.shares_memory(torch_array(t), t.numpy())
    p = torch.nn.Parameter(torch.ones(3))
    assert np.shares_memory(torch_array(p), p.detach().numpy())
    b = torch.ones(4, dtype=torch.bfloat16)
    assert torch_array(b).dtype.name == "bfloat16" and torch_array(b).tolist() == [1.0] * 4
    assert torch_array(np.zeros(2)) is None and torch_array([1.0]) is None
    with pytest.raises(TypeError, match="must be on the CPU, this one is on meta"):
        torch_array(torch.empty(2, device="meta"))
    with pytest.raises(TypeError, match=r"torch tensor torch.complex64\[2\] has no NumPy view"):
        torch_array(torch.ones(2, dtype=torch.complex64).conj())
    with pytest.raises(TypeError, match=r"torch tensor torch.bfloat16\[2\] has no NumPy view"):
        torch_array(torch.ones(2, dtype=torch.bfloat16).to_sparse())


def test_the_thread_count_is_read_and_set_as_numbas_own_functions_do():
    get, set_ = thread_count_access()
    threads = numba.get_num_threads()
    assert get() == threads
    set_(1)
    try:
        assert numba.get_num_threads() == 1 == get()
    finally:
        set_(threads)
    assert numba.get_num_threads() == threads
