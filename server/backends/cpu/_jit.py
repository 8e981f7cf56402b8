"""What every cpu kernel module shares: the Numba set-up, dtype codes, fp16/bf16 bit conversions.

Kernels read fp16 and bf16 as their raw 16-bit patterns (a `uint16` view, no up-cast copy) and
widen each element in registers; they write 16-bit outputs as patterns too, rounded to nearest
even. `kind` says what a uint16 array holds (F16 or BF16); float32 arrays ignore it.

Dispatchers are built on first use with explicit signatures (`lazy_njit`), so nothing is ever
compiled on a request and Numba's on-disk cache makes a restart load instead of compile. Tensors
travel as (1-D contiguous storage from the view's first element, element strides) (`flat`): one
compiled version serves contiguous and strided views alike; a unit-stride row is a contiguous
slice (vectorized), any other row is gathered into a row buffer first (`row`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib
import importlib.metadata
import math
import os
import pathlib
import re
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import llvmlite
import ml_dtypes
import numba
import numpy as np
from llvmlite import ir
from numba.core import caching, types
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import intrinsic, overload

from ...registry import Plan

F32, F16, BF16 = 0, 1, 2  # the `kind` of an array the kernels read or write
# What a kernel sees for FLOAT, FLOAT16 and BF16 data: the element type picks the conversion.
STORAGE = (np.float32, np.uint16, np.int16)
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
ROW_BLOCK = 1024  # elements per fp32 partial sum along a row (then combined in fp64)

_PACKAGE = pathlib.Path(__file__).parent


# Kernel cache folders of other code versions kept beside the one in use: at most this many (the most
# recently used), none unused for longer than CACHE_MAX_IDLE_S.
CACHE_KEEP = 8
CACHE_MAX_IDLE_S = 30 * 24 * 3600


def cache_key() -> str:
    """What decides the kernels' machine code, except the CPU: the sources of every module here (the
    package's __init__ holds no kernel and is left out), Numba's, llvmlite's and Python's versions.

    Numba's index keys each compiled kernel by the CPU (its name and features) itself, so one
    folder serves every CPU that shares it. The install path is not part of it.
    """
    versions = f"numba {numba.__version__} llvmlite {llvmlite.__version__} python {sys.version_info[:2]}"
    digest = hashlib.sha256(versions.encode())
    for path in [*sorted(_PACKAGE.glob("[!_]*.py")), _PACKAGE / "_jit.py", _PACKAGE / "_reduce.py"]:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_root() -> pathlib.Path:
    """The folder that holds one kernel folder per code version: under NUMBA_CACHE_DIR when set
    (an image's warm cache), else under the user's cache directory."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return pathlib.Path(os.environ["NUMBA_CACHE_DIR"]) / "aclnn-serve"
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return base / "aclnn-serve" / "numba"


def configure_cache() -> str | None:
    """Makes Numba cache this package's kernels in `cache_root()/cache_key()`; returns that folder, or
    None when it cannot be written (kernels then compile in each process, or go where Numba's own
    locators put them).

    Numba's own locators name a kernel's folder after its source file's directory, so an editable
    and a regular install of the same code each compiled everything (KernelCacheLocator). Folders of
    other code versions are pruned here (`prune_cache`).
    """
    if KernelCacheLocator.directory is not None:
        return KernelCacheLocator.directory
    root = cache_root()
    key = cache_key()
    directory = root / key
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.utime(directory)  # its last use, which pruning goes by
    except OSError:
        return None
    prune_cache(root, directory)
    KernelCacheLocator.install(str(directory), key)
    return str(directory)


def prune_cache(root: pathlib.Path, current: pathlib.Path) -> list[pathlib.Path]:
    """Removes kernel folders of other code versions unused for CACHE_MAX_IDLE_S, and all but the
    CACHE_KEEP - 1 most recently used of the rest; returns those removed. Only folders named like a
    cache key are touched (NUMBA_CACHE_DIR may hold other things)."""

    def last_use(folder: pathlib.Path) -> float:
        try:
            return folder.stat().st_mtime
        except OSError:
            return 0.0

    try:
        others = [p for p in root.iterdir() if p != current and re.fullmatch(r"[0-9a-f]{16}", p.name) and p.is_dir()]
    except OSError:
        return []
    others.sort(key=last_use, reverse=True)
    now = time.time()
    removed = [p for rank, p in enumerate(others) if rank >= CACHE_KEEP - 1 or now - last_use(p) > CACHE_MAX_IDLE_S]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


class KernelCacheLocator(caching._CacheLocator):
    """Numba's cache locator for this package's kernels: the folder `configure_cache` picked, whatever
    path the package is installed at, and the cache key as the source stamp (the kernels' own helpers
    live in other files, which Numba's per-file stamp would miss). Numba still keys each entry by
    signature, CPU and bytecode."""

    directory: ClassVar[str | None] = None
    stamp: ClassVar[str] = ""

    def __init__(self, lineno: int) -> None:
        self._lineno = lineno

    def get_cache_path(self) -> str:
        return self.directory

    def get_source_stamp(self) -> str:
        return self.stamp

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> KernelCacheLocator | None:
        if cls.directory is None or pathlib.Path(py_file).resolve().parent != _PACKAGE.resolve():
            return None  # not a kernel of this package: Numba's own locators decide
        return cls(py_func.__code__.co_firstlineno)

    @classmethod
    def install(cls, directory: str, stamp: str) -> None:
        """Puts this locator first in Numba's list (asked for every function with cache=True)."""
        cls.directory, cls.stamp = directory, stamp
        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # renamed in Numba 0.61
        if cls not in impl._locator_classes:
            impl._locator_classes.insert(0, cls)


def pin_threading_layer() -> None:
    """Makes Numba pick a thread-safe layer (TBB, else OpenMP) when either is there; call before
    the first parallel kernel compiles or loads. The workqueue fallback aborts the process when two
    threads launch kernels at once (the backend serializes its calls then: see `CpuBackend`).

    pip's `tbb` wheel puts libtbb.so.12 in <prefix>/lib, where the dynamic loader does not look;
    loaded here by its path first, Numba's dlopen("libtbb.so.12") finds it. NUMBA_THREADING_LAYER,
    when set, is the operator's choice and is left alone.
    """
    _load_pip_tbb()
    if os.environ.get("NUMBA_THREADING_LAYER"):
        return
    for module in ("tbbpool", "omppool"):
        try:
            importlib.import_module(f"numba.np.ufunc.{module}")
        except ImportError:
            continue
        numba.config.THREADING_LAYER = "threadsafe"  # tbb before omp: Numba's priority order
        return


def _load_pip_tbb() -> None:
    try:
        files = importlib.metadata.files("tbb") or []
    except importlib.metadata.PackageNotFoundError:
        return
    for file in files:
        if file.name == "libtbb.so.12":
            with contextlib.suppress(OSError):
                ctypes.CDLL(str(file.locate()))
            return


def array(dtype: Any, ndim: int, readonly: bool = False, layout: str = "A") -> types.Array:
    return types.Array(numba.from_dtype(np.dtype(dtype)), ndim, layout, readonly=readonly)


class lazy_njit:
    """`@njit(signatures, parallel=True, cache=True)`, compiled (or loaded) on first use.

    With explicit signatures Numba compiles nothing else: a call whose types match none of
    them is a TypeError, never a compilation in the middle of a request.
    """

    _lock = threading.Lock()
    # Every kernel defined (its module imported), for the start-up report of what compiled.
    all: ClassVar[list[lazy_njit]] = []

    def __init__(self, signatures: Callable[[], Sequence[Any]], parallel: bool = True) -> None:
        self.signatures, self.parallel = signatures, parallel
        self.func: Callable[..., Any] | None = None
        self.dispatcher: Any = None
        lazy_njit.all.append(self)

    def __call__(self, func: Callable[..., Any]) -> lazy_njit:
        self.func = func
        self.__doc__, self.__name__ = func.__doc__, func.__name__
        return self

    def compiled(self) -> Any:
        with self._lock, warnings.catch_warnings():
            if self.dispatcher is None:
                warnings.simplefilter("ignore", NumbaIRAssumptionWarning)  # a pedantic note on inlining
                self.dispatcher = self._build()
        return self.dispatcher

    def _build(self) -> Any:
        return numba.njit(list(self.signatures()), parallel=self.parallel, cache=True, fastmath=False, nogil=True)(
            self.func
        )

    def run(self, *args: Any) -> Any:
        # Built once; a small call must not pay for `compiled`'s lock and warning filter each time.
        return (self.dispatcher or self.compiled())(*args)


def compile_counts() -> tuple[int, int]:
    """(signatures loaded from the disk cache, signatures compiled) over the kernels built so far."""
    loaded = compiled = 0
    for kernel in lazy_njit.all:
        if kernel.dispatcher is not None:
            stats = kernel.dispatcher.stats
            loaded += sum(stats.cache_hits.values())
            compiled += sum(stats.cache_misses.values())
    return loaded, compiled


def cache_is_warm() -> bool:
    """Whether the kernel cache holds an index for every kernel defined (a start then compiles nothing,
    unless the cache was filled on another CPU)."""
    if KernelCacheLocator.directory is None:
        return False
    directory = pathlib.Path(KernelCacheLocator.directory)
    indexed = {tuple(path.name.split("-")[0].split(".")[:2]) for path in directory.glob("*.nbi")}
    return all((kernel.func.__module__.rpartition(".")[2], kernel.__name__) in indexed for kernel in lazy_njit.all)


# --- element conversions (inlined into the kernels) -------------------------------------------


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """An IEEE half's bit pattern to float32 (exact; F16C's vcvtph2ps on x86)."""

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_f16_bits(typingctx, value):
    """float32 to an IEEE half's bit pattern, rounded to nearest even (NaN stays NaN)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def f32_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@numba.njit(inline="always")
def bf16_bits_to_f32(bits):
    return bits_f32(np.uint32(np.uint16(bits)) << np.uint32(16))


@numba.njit(inline="always")
def f32_to_bf16_bits(value):
    """Round to nearest even, as ml_dtypes does; a NaN becomes a quiet NaN of the same sign."""
    u = f32_bits(value)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.int16(np.uint16((u >> np.uint32(16)) | np.uint32(0x40)))
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.int16(np.uint16(u >> np.uint32(16)))


def load(value, kind):
    """An element as float32: `value` is a float32, or a uint16 pattern of `kind`."""


@overload(load, inline="always")
def _load(value, kind):
    if isinstance(value, types.Float):
        return lambda value, kind: np.float32(value)

    if value == types.uint16:
        return lambda value, kind: f16_bits_to_f32(value)
    return lambda value, kind: bf16_bits_to_f32(value)


def narrow(value, like, kind):
    """A float32 result as the element type of the array `like` (uint16 patterns by `kind`)."""


@overload(narrow, inline="always")
def _narrow(value, like, kind):
    if isinstance(like.dtype, types.Float):
        return lambda value, like, kind: value

    if like.dtype == types.uint16:
        return lambda value, like, kind: f32_to_f16_bits(value)
    return lambda value, like, kind: f32_to_bf16_bits(value)


@numba.njit(inline="always")
def gather_len(stride, n):
    """The row buffer a strided row needs: n elements unless the rows are contiguous."""
    if stride == 1:
        return 0
    return n


@numba.njit(inline="always")
def row(base, start, stride, n, buf):
    """Elements start, start+stride, ... (n of them) of `base` as a contiguous array.

    A unit-stride row is a slice of the storage; any other is gathered into `buf`.
    """
    if stride == 1:
        return base[start : start + n]
    for j in range(n):
        buf[j] = base[start + j * stride]
    return buf[:n]


# --- host side ----------------------------------------------------------------------------------


def kernel_view(a: np.ndarray) -> tuple[np.ndarray, int]:
    """The array the kernels take, and its kind: float32 as is, fp16/bf16 as uint16 patterns."""
    if a.dtype == np.float32:
        return a, F32
    if a.dtype == np.float16:
        return a.view(np.uint16), F16
    if a.dtype.itemsize == 2:  # bfloat16
        return a.view(np.int16), BF16
    raise TypeError(f"no cpu kernel reads {a.dtype}")


def storage_class(dtype: np.dtype) -> type:
    return np.float32 if np.dtype(dtype) == np.float32 else np.uint16


def flat(a: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """A view as (1-D contiguous base starting at its first element, element strides), or None.

    The kernels index `base[Σ i_k·stride_k]`; a row with stride 1 is sliced as a contiguous
    array (vectorized), any other row is gathered into a row buffer. None when a stride is
    negative or not a whole number of elements (the caller then copies or falls back).
    """
    if a.flags.c_contiguous:  # the common case: a plain view (as_strided costs ~5 µs a call)
        base = a.reshape(-1)
        base.flags.writeable = False
        return base, contiguous_strides(a.shape)
    strides = element_strides(a)
    if strides is None:
        return None
    span = 1 + sum((d - 1) * s for d, s in zip(a.shape, strides)) if a.size else 0
    return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.dtype.itemsize,), writeable=False), strides


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`element_strides` of a C-contiguous array of `shape`: a function of the shape alone, cached (a
    small call's layout repeats, and the generator costs more than its kernel's setup)."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step if d > 1 else 0)
        step *= d
    return tuple(reversed(strides))


def element_strides(a: np.ndarray) -> tuple[int, ...] | None:
    """`flat`'s element strides (0 for dims of size 1), or None when it would return None."""
    itemsize = a.dtype.itemsize
    if any(d > 1 and (s < 0 or s % itemsize) for d, s in zip(a.shape, a.strides)):
        return None
    return tuple(s // itemsize if d > 1 else 0 for d, s in zip(a.shape, a.strides))


def kernel_ready(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """`a` as a view of `shape` that the kernels can index, or None (its dims do not merge into
    that shape without a copy, or a stride is negative or not a whole number of elements).

    Decided from shape and strides alone (`merged_strides`): NumPy's shape setter, asked for a
    shape the strides cannot give, copies the array first — through a probe's made-up strides that
    read far outside its one element (the SIGSEGV in `_layout_ready`), and for real data a whole
    needless copy."""
    if a.flags.c_contiguous:  # the common case: NumPy's own reshape is then a view (as_strided costs ~5 µs)
        return a.reshape(shape) if a.size == math.prod(shape) else None
    strides = element_strides(a)
    merged = None if strides is None else merged_strides(a.shape, strides, shape)
    if merged is None:
        return None
    return np.lib.stride_tricks.as_strided(a, shape, tuple(s * a.dtype.itemsize for s in merged))


def merged_strides(
    view_shape: tuple[int, ...], strides: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The element strides that give the same elements, in C order, as `shape`, or None when
    that needs a copy (NumPy's no-copy reshape rule: the old dims that make up a new dim must lie
    at a fixed stride from one another)."""
    if math.prod(view_shape) != math.prod(shape):
        return None
    if math.prod(shape) <= 1:  # nothing or one element: any strides address it
        return (0,) * len(shape)
    old = [(d, s) for d, s in zip(view_shape, strides) if d != 1]
    new = list(shape)
    merged = [0] * len(new)
    oi = ni = 0
    while ni < len(new) and oi < len(old):
        oj, nj = oi + 1, ni + 1
        old_size, new_size = old[oi][0], new[ni]
        while old_size != new_size:
            if new_size < old_size:
                new_size *= new[nj]
                nj += 1
            else:
                old_size *= old[oj][0]
                oj += 1
        if any(old[k][1] != old[k + 1][0] * old[k + 1][1] for k in range(oi, oj - 1)):
            return None
        merged[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            merged[k - 1] = merged[k] * new[k]
        oi, ni = oj, nj
    return tuple(m if d > 1 else 0 for m, d in zip(merged, new))


def views_ready(plan: Plan, names: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """Whether the kernels can take the named inputs as views of `shape` (`kernel_ready`), judged
    from their descriptors before any data arrives (a kernel module's `handles`)."""
    descs = [plan.inputs[name] for name in names]
    return all(_layout_ready(d.shape, d.strides, shape) for d in descs)


@functools.lru_cache(maxsize=1024)
def _layout_ready(view_shape: tuple[int, ...], strides: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """`views_ready` for one layout (descriptor strides are elements, never negative); cached, as
    repeated calls (a training step) bring the same few layouts."""
    return merged_strides(view_shape, tuple(s if d > 1 else 0 for d, s in zip(view_shape, strides)), shape) is not None
