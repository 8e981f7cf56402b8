"""Test helpers: float64 references, the SPEC 1.5 tolerance table, untouched-output checks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from aclnn_client import AclnnError

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
TOLERANCES = {np.dtype(np.float32): (1e-4, 1e-5), np.dtype(np.float16): (2e-3, 1e-4), BF16: (1.6e-2, 1e-3)}


def t64(a: np.ndarray | None) -> torch.Tensor | None:
    """A float64 torch tensor holding exactly the (already rounded) values of `a`."""
    return None if a is None else torch.from_numpy(np.asarray(a, dtype=np.float64).copy())


def assert_close(out: np.ndarray, ref: np.ndarray | torch.Tensor, name: str = "") -> None:
    """max|out - ref| <= atol + rtol * max|ref|, per output tensor (SPEC 1.5)."""
    ref = ref.numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref, dtype=np.float64)
    got = np.asarray(out, dtype=np.float64)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    if ref.size == 0:
        return
    rtol, atol = TOLERANCES[np.dtype(out.dtype)]
    err = np.max(np.abs(got - ref))
    bound = atol + rtol * np.max(np.abs(ref))
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} ({out.dtype})"


def rand(rng: np.random.Generator, shape, dtype, low: float = -2.0, high: float = 2.0) -> np.ndarray:
    return rng.uniform(low, high, size=shape).astype(dtype)


def sentinel_like(shape, dtype) -> np.ndarray:
    """An output prefilled with a recognizable value, to prove what was (not) written."""
    return np.full(shape, -7.25, dtype=dtype)


class Untouched:
    """Snapshots outputs (arrays, or create_tensor descriptors over a storage array); `.check()`
    asserts their bytes did not change."""

    def __init__(self, *outputs: object) -> None:
        arrays = [getattr(o, "data", None) if not isinstance(o, np.ndarray) else o for o in outputs]
        self.arrays = [a for a in arrays if isinstance(a, np.ndarray)]
        self.before = [a.copy() for a in self.arrays]

    def check(self) -> None:
        for a, b in zip(self.arrays, self.before):
            assert a.tobytes() == b.tobytes(), "a failed call wrote to an output"


def expect_error(client, op: str, p: dict, written: tuple[str, ...], code: int, param: str) -> None:
    """Both phases fail with `code` naming `param`, and none of the `written` tensors changed."""
    untouched = Untouched(*(p.get(n) for n in written))
    with pytest.raises(AclnnError) as info:
        client.get_workspace_size(op, **p)
    assert (info.value.code, info.value.param) == (code, param), str(info.value)
    with pytest.raises(AclnnError) as info:
        client.run(op, **p)
    assert (info.value.code, info.value.param) == (code, param), str(info.value)
    untouched.check()


# Error-table cases mutate one valid call; these build the mutations.


def set_(**changes):
    """Sets parameters (None makes a null pointer)."""
    return lambda p: p.update(changes)


def cast(name: str, dtype):
    """Gives a tensor another dtype."""
    return lambda p: p.update({name: p[name].astype(dtype)})


def reshape(name: str, shape):
    """Gives a tensor another shape (zeros of its dtype)."""
    return lambda p: p.update({name: np.zeros(shape, p[name].dtype)})


def retag(a: np.ndarray, fmt: int):
    """The same array as a tensor carrying another format tag."""
    from aclnn_client import create_tensor
    from aclnn_common.types import data_type_of

    strides = [s // a.itemsize for s in a.strides]
    return create_tensor(a.shape, data_type_of(a.dtype), strides, 0, fmt, [a.size], a)
