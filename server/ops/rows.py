"""Row blocks: how the NumPy reference walks a [M rows × N] problem in bounded memory."""

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
