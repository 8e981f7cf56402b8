"""Blocks and tiles: how the NumPy reference walks [M rows × N] and [L, C, T] problems in bounded memory."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

# Elements per block: a few fp32 temporaries of this size are the reference's whole scratch.
BLOCK_ELEMENTS = 1 << 18


def block_rows(n: int) -> int:
    """Rows per block for rows of n elements."""
    return max(1, BLOCK_ELEMENTS // max(n, 1))


def blocks(m: int, n: int) -> Iterator[slice]:
    step = block_rows(n)
    for start in range(0, m, step):
        yield slice(start, min(start + step, m))


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
    """Tile extents (l, c, t) of at most about BLOCK_ELEMENTS elements for an [L, C, T] problem."""
    n_l, n_c, n_t = shape
    t = max(1, min(n_t, BLOCK_ELEMENTS))
    c = max(1, min(n_c, BLOCK_ELEMENTS // t))
    return max(1, min(n_l, BLOCK_ELEMENTS // (c * t))), c, t


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


def widened(a: np.ndarray) -> np.ndarray:
    """A tile as a fresh C-ordered fp32 array: the same arithmetic whatever the input's strides."""
    return a.astype(np.float32, order="C")
