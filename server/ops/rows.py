"""Blocks and tiles: how the NumPy reference walks [M rows × N] and [L, C, T] problems in bounded
memory, and how a block is widened to fp32 and stored back in its dtype.

The reference computes in fp32 blocks (`work_dtype`). A computation whose fp32 intermediates
left fp32's range (a non-finite value, or a variance small enough for its
squares to have underflowed) says so, and its caller repeats it in fp64 (`wide`): fp64 holds the
square of any fp32 value, so finite inputs then give the true result, rounded once; non-finite
inputs give what IEEE arithmetic gives on the same formulas in fp64 (`backends.widening`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import itertools
import math
import os
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

# Elements per block: a few fp32 temporaries of this size are the reference's whole scratch.
# Each ufunc call hands the GIL over; at 2^18 those handovers cost two threads a quarter of their
# time on BatchNorm (2^19 measured 25% faster, 2^20 slower again, its buffers out of cache).
BLOCK_ELEMENTS = 1 << 19
LONG_RUN = 64  # elements: a tile may take whole channels when each row of a channel is this long
NUMPY_BUFFER = 8192  # elements of NumPy's buffers for ufuncs that cast (np.getbufsize())
# Rows an fp32 column sum runs over before fp64 takes over: short fixed-size blocks (SPEC 1.5).
SUM_RUN = 64
# Threads the reference spreads its blocks over: NumPy releases the GIL inside its loops.
WORKERS = max(1, min(4, len(os.sched_getaffinity(0))))

T = TypeVar("T")
R = TypeVar("R")


# The block dtype: fp32, or fp64 while a computation is repeated `wide` (a context variable, so
# `in_order`'s worker threads see it).
_WIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("aclnn_wide", default=False)
# A variance (or mean square) below this may hold underflowed fp32 squares: the call goes `wide`.
SMALLEST_SAFE_SQUARE = 2.0**-100
# A mean square above this may come from fp32 sums of squares near overflow: likewise.
LARGEST_SAFE_SQUARE = 2.0**120


def work_dtype() -> type:
    return np.float64 if _WIDE.get() else np.float32


@contextlib.contextmanager
def wide() -> Iterator[None]:
    """Blocks in fp64 (twice the bytes per element, so half the elements per block)."""
    token = _WIDE.set(True)
    try:
        yield
    finally:
        _WIDE.reset(token)


def out_of_range(*values: np.ndarray | None) -> bool:
    """Whether an fp32 block or result holds a non-finite value (never, when already `wide`)."""
    return not _WIDE.get() and any(v is not None and not np.isfinite(v).all() for v in values)


def squares_out_of_range(squares: np.ndarray) -> bool:
    """Whether mean squares (variance + eps, or mean(x²) + eps) lie where fp32 squares could have
    underflowed or overflowed, or are not finite (never, when already `wide`)."""
    if _WIDE.get():
        return False
    with np.errstate(invalid="ignore"):
        return not ((squares >= SMALLEST_SAFE_SQUARE) & (squares <= LARGEST_SAFE_SQUARE)).all()


def workers_for(items: int) -> int:
    return max(1, min(WORKERS, items))


def in_order(work: Callable[[T, np.ndarray], R], items: list[T], scratch: np.ndarray) -> Iterator[R]:
    """work(item, buffers) for each item, on up to WORKERS threads; results in item order.

    `scratch` holds one set of buffers per worker (its first axis): a worker takes a set for
    one item and gives it back. Few results wait at a time (memory stays bounded), and since
    each item is computed whole by one thread and the caller combines the results in order,
    the output does not depend on the thread count.
    """
    workers = len(scratch)
    if workers == 1:
        yield from (work(item, scratch[0]) for item in items)
        return
    free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
    for buffers in scratch:
        free.put(buffers)

    def run(item: T) -> R:
        buffers = free.get()
        try:
            return work(item, buffers)
        finally:
            free.put(buffers)

    with ThreadPoolExecutor(workers, thread_name_prefix="aclnn-numpy") as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            # Each task in a copy of this context: np.errstate is a context variable.
            pending.append(pool.submit(contextvars.copy_context().run, run, item))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def column_sums(a: np.ndarray) -> np.ndarray:
    """Σ over axis 0 of an fp32 block, in fp64: fp32 sums of runs of SUM_RUN rows, added in fp64 in
    order (an fp64 sum of the whole block casts every element and takes several times as long)."""
    whole = len(a) - len(a) % SUM_RUN
    total = a[:whole].reshape(-1, SUM_RUN, *a.shape[1:]).sum(axis=1).sum(axis=0, dtype=np.float64)
    if whole < len(a):
        total += a[whole:].sum(axis=0)
    return total


def block_elements() -> int:
    """Elements per block: the same bytes whatever the block dtype."""
    return BLOCK_ELEMENTS // 2 if _WIDE.get() else BLOCK_ELEMENTS


def block_rows(n: int) -> int:
    """Rows per block for rows of n elements."""
    return max(1, block_elements() // max(n, 1))


def blocks(m: int, n: int, period: int = 1) -> Iterator[slice]:
    """Row blocks in order; each is whole periods of `period` rows, or lies inside one period."""
    step = block_rows(n)
    if step >= period:
        step -= step % period
    start = 0
    while start < m:
        stop = min(start + step, m)
        if step < period:
            stop = min(stop, start - start % period + period)
        yield slice(start, stop)
        start = stop


class Rows:
    """An array's leading `lead` dims as rows and the rest as columns: rows[a:b] is [b-a, n].

    A block is a view when the leading dims merge into one stride; otherwise (some
    strided views) indexing copies just that block, never the whole array.
    """

    def __init__(self, array: np.ndarray, lead: int) -> None:
        self.lead_shape = array.shape[:lead]
        self.m, self.n = math.prod(self.lead_shape), math.prod(array.shape[lead:])
        self.array = array
        self.merged: np.ndarray | None = array.view()
        try:
            self.merged.shape = (self.m, self.n)
        except AttributeError:
            self.merged = None

    def __getitem__(self, rows: slice) -> np.ndarray:
        if self.merged is not None:
            return self.merged[rows]
        if not self.lead_shape:  # no leading dims: the whole array is the one row
            return self.array.reshape(1, self.n)[rows]
        index = np.unravel_index(np.arange(rows.start, rows.stop), self.lead_shape)
        return self.array[index].reshape(-1, self.n)


class Tiles:
    """An array seen as [L, C, T] around its channel axis; `tiles[l, c, t]` (three slices) is a tile.

    A tile is a view when the dims before and after the channel merge into one stride each;
    otherwise (some strided views) indexing gathers just that tile, never the whole array.
    """

    def __init__(self, array: np.ndarray, axis: int) -> None:
        self.lead, self.trail = array.shape[:axis], array.shape[axis + 1 :]
        self.shape = (math.prod(self.lead), array.shape[axis], math.prod(self.trail))
        self.array = array
        self.merged: np.ndarray | None = array.view()
        try:
            self.merged.shape = self.shape
        except AttributeError:
            self.merged = None

    def __getitem__(self, tile: tuple[slice, slice, slice]) -> np.ndarray:
        if self.merged is not None:
            return self.merged[tile]
        ls, cs, ts = tile
        lead = np.unravel_index(np.arange(ls.start, ls.stop), self.lead)
        trail = np.unravel_index(np.arange(ts.start, ts.stop), self.trail) if self.trail else ()
        index = (
            *(i[:, None, None] for i in lead),
            np.arange(cs.start, cs.stop)[None, :, None],
            *(i[None, None, :] for i in trail),
        )
        return self.array[index]


def tile_shape(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """Tile extents (l, c, t) of at most about BLOCK_ELEMENTS elements for an [L, C, T] problem.

    Whole channels (all of L and T) when they fit and T is a long contiguous run: a chunk of
    channels is then one tile, which BatchNorm's two passes share. Otherwise channels before L,
    so that short runs (channel-last: T = 1) are read as whole rows of channels.
    """
    n_l, n_c, n_t = shape
    most = block_elements()
    t = max(1, min(n_t, most))
    if n_t >= LONG_RUN and 0 < n_l * t <= most:
        return n_l, max(1, min(n_c, most // (n_l * t))), t
    c = max(1, min(n_c, most // t))
    return max(1, min(n_l, most // (c * t))), c, t


def tiles(shape: tuple[int, int, int]) -> Iterator[tuple[slice, slice, slice]]:
    """The tiles of [L, C, T], channel chunk outermost, in a fixed order."""
    if math.prod(shape) == 0:
        return
    steps = tile_shape(shape)
    n_l, n_c, n_t = shape
    for c0 in range(0, n_c, steps[1]):
        for l0 in range(0, n_l, steps[0]):
            for t0 in range(0, n_t, steps[2]):
                yield (
                    slice(l0, min(l0 + steps[0], n_l)),
                    slice(c0, min(c0 + steps[1], n_c)),
                    slice(t0, min(t0 + steps[2], n_t)),
                )


def tile_view(buffer: np.ndarray, tile: tuple[slice, slice, slice]) -> np.ndarray:
    """The first elements of a flat buffer, shaped as a tile."""
    shape = tuple(s.stop - s.start for s in tile)
    return buffer[: math.prod(shape)].reshape(shape)


def channel_chunks(shape: tuple[int, int, int]) -> Iterator[list[tuple[slice, slice, slice]]]:
    """The tiles of [L, C, T] grouped by their chunk of channels, in `tiles`' order."""
    return (list(chunk) for _, chunk in itertools.groupby(tiles(shape), key=lambda tile: tile[1].start))


# NumPy converts fp16 one element at a time (no F16C in its casts on this build), which made
# fp16 the reference's slowest dtype; integer and fp32 ufuncs on the bit patterns are
# vectorized and give NumPy's bits (NaNs stay NaNs of their sign): widening for every fp16
# pattern and rounding at every fp16 boundary are checked in tests/test_numpy_reference.py
# (rounding also matched NumPy's over all 2^32 fp32 patterns). bf16 casts (ml_dtypes) are fast.
F16_SIGN_AND_MAGNITUDE = np.int32(-0x70002000)  # 0x8FFFE000 after a sign-extending shift by 13
F16_EXPONENT = np.int16(0x7C00)
F32_EXPONENT = np.uint32(0x7F800000)
F16_TO_F32_SCALE = np.float32(2.0**112)  # 2^(127 − 15): the exponent-bias difference
F32_TO_F16_SCALE = np.float32(2.0**-112)


def widened(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A block as C-ordered fp32 (the same arithmetic whatever the input's strides): in `out`
    (fp32, C-ordered, a's shape) when given, else in a fresh array (fp64 when `wide`)."""
    if out is None:
        out = np.empty(a.shape, work_dtype())
    if a.dtype != np.float16 or out.dtype != np.float32:
        np.copyto(out, a)
        return out
    # fp16 bits moved into fp32 position (sign stays the sign), scaled by the bias difference:
    # exact for normals, subnormals and zeros; Inf/NaN (exponent all ones) then get fp32's.
    bits = np.left_shift(a.view(np.int16), 13, out=out.view(np.int32), dtype=np.int32)
    bits &= F16_SIGN_AND_MAGNITUDE
    out *= F16_TO_F32_SCALE
    # Two max reductions find any: +Inf/NaN are int16 patterns ≥ 0x7C00, −Inf/NaN uint16 ≥ 0xFC00.
    if a.size and (a.view(np.int16).max() >= F16_EXPONENT or a.view(np.uint16).max() >= 0xFC00):
        special = np.bitwise_and(a.view(np.int16), F16_EXPONENT) == F16_EXPONENT
        np.bitwise_or(bits, F32_EXPONENT.view(np.int32), out=bits, where=special)
    return out


def store(out: np.ndarray, values: np.ndarray, scratch: np.ndarray | None = None) -> None:
    """Writes an fp32 (or, `wide`, fp64) block into `out` in out's dtype, rounded to nearest even;
    clobbers `values`.

    fp16 rounding needs a block of scratch: `scratch` (fp32, C-ordered, values' shape) when given.
    """
    if out.dtype != np.float16 or values.dtype != np.float32:
        out[...] = values
        return
    u = values.view(np.uint32)
    half = out.view(np.uint16)
    np.right_shift(u, 16, out=half, casting="unsafe")
    half &= np.uint16(0x8000)  # the sign
    u &= np.uint32(0x7FFFFFFF)
    magnitude = u.view(np.float32)
    # Adding 2^(e+13) (e: the value's exponent, at least fp16's smallest, -14) leaves fp16's
    # precision at that exponent: the fp32 add rounds to nearest even, subtracting is exact.
    # Then |v| ≥ 2^16 is Inf (clip keeps NaN), and 2^-112 rebiases: fp16 bits are fp32's >> 13.
    if scratch is None:
        scratch = np.empty(values.shape, np.float32)
    exponent = np.bitwise_and(u, F32_EXPONENT, out=scratch.view(np.uint32))
    np.clip(exponent, np.uint32(113 << 23), np.uint32(143 << 23), out=exponent)
    exponent += np.uint32(13 << 23)
    magic = exponent.view(np.float32)
    magnitude += magic
    magnitude -= magic
    np.clip(magnitude, np.float32(0), np.float32(2.0**16), out=magnitude)  # 3× faster than np.minimum
    magnitude *= F32_TO_F16_SCALE
    u >>= np.uint32(13)
    u &= np.uint32(0x7FFF)  # a NaN's fp32 exponent reaches past fp16's
    # Narrowing into the (now free) scratch first: an OR that casts as it goes is 4× slower.
    narrow = scratch.view(np.uint16).reshape(-1)[: u.size].reshape(u.shape)
    np.copyto(narrow, u, casting="unsafe")
    half |= narrow
