"""The NumPy reference's building blocks: fp16 conversions, row blocks, bounded scratch."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from layer_norm_cases import layer_norm_call
from oracle import FLOAT_DTYPES, rand
from test_layer_norm_grad import OP as LNG
from test_layer_norm_grad import check, lng_call

from aclnn_server import LocalClient
from aclnn_server.ops import OPERATORS, rows

F16 = np.dtype(np.float16)
ALL_F16 = np.arange(1 << 16, dtype=np.uint16).view(F16)
# Per worker thread: a few block-sized fp32 buffers and partial sums, whatever the input's size.
SCRATCH_BOUND = rows.WORKERS * 24 * rows.BLOCK_ELEMENTS


@pytest.fixture(scope="module")
def reference() -> LocalClient:
    c = LocalClient(backend="numpy")
    yield c
    c.close()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns, except that NaNs only need to be NaNs of the same sign."""
    unsigned = np.dtype(f"u{a.itemsize}")
    nan = np.isnan(a) & np.isnan(b)
    return bool(np.all((a.view(unsigned) == b.view(unsigned)) | (nan & (np.signbit(a) == np.signbit(b)))))


def test_widened_fp16_is_exact_for_every_pattern():
    out = rows.widened(ALL_F16)
    assert out.dtype == np.float32 and same_bits(out, ALL_F16.astype(np.float32))
    for special in (np.inf, -np.inf, np.nan, -np.nan):  # found when it is the only one in a block
        block = np.array([1.5, special, -2.0], F16)
        assert same_bits(rows.widened(block), block.astype(np.float32))
    strided = ALL_F16[:60000].reshape(200, 300)[::3, 5:205:2].T
    got = rows.widened(strided)
    assert got.flags.c_contiguous and np.array_equal(got.view(np.uint32), strided.astype(np.float32).view(np.uint32))


def test_store_rounds_to_fp16_as_numpy_does():
    """Every fp16 value, every midpoint between neighbours (ties to even) and one fp32 ulp either
    side, fp32 subnormals, overflow to Inf, NaNs, and random bit patterns."""
    finite = ALL_F16[np.isfinite(ALL_F16)].astype(np.float32)
    lo, hi = np.sort(finite)[:-1], np.sort(finite)[1:]
    mid = ((lo.astype(np.float64) + hi) / 2).astype(np.float32)
    near = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))])
    special = np.array([65504, 65519.99, 65520, 1e30, 3.4e38, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -0.0, 2**-25])
    bits = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    values = np.concatenate([finite, near, special.astype(np.float32), bits.view(np.float32)])
    with np.errstate(all="ignore"):
        expected = values.astype(F16)
        out = np.empty(values.size * 2, F16)[::2]  # a strided target
        rows.store(out, values.copy())
    assert same_bits(out, expected)


def test_store_writes_other_dtypes_by_assignment():
    out = np.empty(3, np.float32)
    rows.store(out, np.array([1.5, -2.0, np.inf], np.float32))
    assert out.tolist() == [1.5, -2.0, np.inf]


@pytest.mark.parametrize("m,n,period", [(12, 1, 3), (12, 1, 1), (13, 5, 6), (12, 5, 4), (0, 3, 2), (9, 2, 9)])
def test_blocks_are_whole_periods_or_inside_one(monkeypatch, m, n, period):
    monkeypatch.setattr(rows, "BLOCK_ELEMENTS", 10)
    spans = list(rows.blocks(m, n, period))
    assert [0] + [s.stop for s in spans] == [s.start for s in spans] + [m]  # in order, covering [0, m)
    for s in spans:
        b = s.stop - s.start
        assert 0 < b * n <= max(n, 10)
        assert (s.start % period == 0 and b % period == 0) or s.start // period == (s.stop - 1) // period


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "x_shape,mean_shape,gamma_shape",
    [
        ((6, 5, 8), (6, 5, 1), (8,)),  # gamma over the row
        ((6, 5, 8), (6, 5, 1), (5, 8)),  # gamma spans 5 rows: blocks inside a period
        ((6, 5, 8), (6, 1, 1), (8,)),  # gamma tiled along a 40-long row
        ((6, 5, 2), (6, 5, 1), (5, 2)),  # gamma spans 5 rows: blocks of whole periods
    ],
)
def test_layer_norm_grad_in_small_blocks(reference, rng, monkeypatch, dtype, x_shape, mean_shape, gamma_shape):
    monkeypatch.setattr(rows, "BLOCK_ELEMENTS", 24)
    p = lng_call(rng, x_shape, mean_shape, gamma_shape, dtype)
    reference.run(LNG, **p)
    check(p)


def peak_scratch(op: str, p: dict, outputs: tuple[str, ...], **plan_values) -> tuple[int, int]:
    """(the reference's workspace_size for a call, the peak bytes its compute allocates beyond the
    outputs); `plan_values` are what validation adds to compute's arguments."""
    client = LocalClient(backend="numpy")
    try:
        size, executor = client.get_workspace_size(op, **p)
        client.destroy_executor(executor)
    finally:
        client.close()
    args = {**p, **{name: np.empty_like(p[name]) for name in outputs}}
    tracemalloc.start()  # NumPy reports its array buffers to tracemalloc
    try:
        OPERATORS[op].compute(**args, **plan_values)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return size, peak


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_layer_norm_scratch_is_bounded_and_reported(rng, dtype):
    """LayerNormGrad and LayerNormBackward allocate at most their workspace_size, well below one input
    (a fixed number of blocks per worker thread, whatever the input's size)."""
    p = lng_call(rng, (256, 32, 1024), (256, 32, 1), (32, 1024), dtype)  # gamma spans 32 rows
    size, peak = peak_scratch(LNG, dict(p, output_mask=None), ("pd_x", "pd_gamma", "pd_beta"))
    assert peak <= size <= SCRATCH_BOUND
    q = layer_norm_call(rng, (8192, 1024), 1, dtype, "float32")
    size, peak = peak_scratch("aclnnLayerNormBackward", q, ("gradInputOut", "gradWeightOut", "gradBiasOut"))
    assert peak <= size <= SCRATCH_BOUND


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_batch_norm_scratch_is_bounded_and_reported(rng, dtype):
    """BatchNormBackward (whole-channel tiles, and channel-major tiles for short rows) and
    ElemtBackward allocate at most their workspace_size, well below one input."""
    from batch_norm_cases import bn_call

    for shape in ((32, 64, 56, 56), (2048, 64, 6, 6)):
        p = bn_call(rng, shape, 1, dtype, "float32")
        size, peak = peak_scratch("aclnnBatchNormBackward", p, ("gradInput", "gradWeight", "gradBias"), channel_axis=1)
        assert peak <= size <= SCRATCH_BOUND  # tiles per worker thread, whatever the input's size
    x = rand(rng, (32, 64, 56, 56), dtype)
    c = np.ones(64, np.float32)
    q = dict(gradOut=x, input=x, mean=c, invstd=c, weight=c, sumDy=c, sumDyXmu=c, counter=np.array([99], np.int32),
             gradInput=np.empty_like(x))  # fmt: skip
    size, peak = peak_scratch("aclnnBatchNormElemtBackward", q, ("gradInput",))
    assert peak <= size <= SCRATCH_BOUND


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_batch_norm_reduce_backward_scratch_is_bounded_and_reported(rng, dtype):
    """ReduceBackward (BatchNormBackward's sums pass: whole-channel tiles, and tiles shared out for
    short rows) allocates at most its workspace_size, well below one input."""
    from sync_batch_norm_cases import REDUCE_OUTPUTS, reduce_call

    for shape in ((32, 64, 56, 56), (2048, 64, 6, 6), (40000, 64)):
        p = reduce_call(rng, shape, dtype)
        size, peak = peak_scratch("aclnnBatchNormReduceBackward", p, REDUCE_OUTPUTS)
        assert peak <= size <= SCRATCH_BOUND


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_batch_norm_forward_scratch_is_bounded_and_reported(rng, dtype, training):
    """aclnnBatchNorm (statistics, then normalization, tile by tile; gathered tiles of a strided view)
    allocates at most its workspace_size, well below one input."""
    from batch_norm_forward_cases import forward_call

    # Whole-channel tiles, channel-major tiles of short rows, rows of channels (T = 1, as NHWC).
    for shape in ((32, 64, 56, 56), (2048, 64, 6, 6), (50176, 64)):
        p = forward_call(rng, shape, 1, dtype, training, params=np.float32)
        size, peak = peak_scratch("aclnnBatchNorm", p, ("output",), channel_axis=1, placeholders={})
        assert peak <= size <= SCRATCH_BOUND
    p = forward_call(rng, (32, 64, 28, 28), 1, dtype, training)
    p["input"] = np.asfortranarray(p["input"])  # tiles gathered from a view whose dims do not merge
    size, peak = peak_scratch("aclnnBatchNorm", p, ("output",), channel_axis=1, placeholders={})
    assert peak <= size <= SCRATCH_BOUND


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_results_do_not_depend_on_the_worker_count(rng, dtype, monkeypatch):
    """Blocks (LayerNorm), channel chunks (BatchNorm) and the tiles of one chunk (channel-last
    BatchNorm) on 1, 2 or 3 threads: the same bits."""
    from batch_norm_cases import BN_OUTPUTS, bn_call, with_format
    from sync_batch_norm_cases import REDUCE_OUTPUTS, reduce_call

    from aclnn_client import Format

    ln_outputs = ("gradInputOut", "gradWeightOut", "gradBiasOut")
    calls = (  # (op, call, its outputs, the format gradOut, input and gradInput are tagged with)
        ("aclnnLayerNormBackward", layer_norm_call(rng, (3000, 700), 1, dtype, "float32"), ln_outputs, None),
        ("aclnnBatchNormBackward", bn_call(rng, (64, 96, 30, 30), 1, dtype, "float32"), BN_OUTPUTS, None),
        ("aclnnBatchNormBackward", bn_call(rng, (8, 30, 40, 700), 3, dtype, "float32"), BN_OUTPUTS, Format.NHWC),
        ("aclnnBatchNormReduceBackward", reduce_call(rng, (64, 96, 30, 30), dtype), REDUCE_OUTPUTS, None),
        ("aclnnBatchNormReduceBackward", reduce_call(rng, (40000, 30), dtype), REDUCE_OUTPUTS, None),
    )
    results = []
    for workers in (1, 2, 3):
        monkeypatch.setattr(rows, "WORKERS", workers)
        with LocalClient(backend="numpy") as client:
            for op, p, outputs, fmt in calls:
                p.update({name: np.full_like(p[name], np.nan) for name in outputs})
                client.run(op, **(p if fmt is None else with_format(p, fmt)))
                results.append([p[name].tobytes() for name in outputs])
    assert results[: len(calls)] == results[len(calls) : 2 * len(calls)] == results[2 * len(calls) :]
