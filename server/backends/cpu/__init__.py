"""The `cpu` backend: multi-threaded Numba kernels, deterministic and bit-reproducible.

One module per operator (`layer_norm_backward`, ...) exposes `handles(plan)`,
`workspace_size(plan)`, `compute(plan, args)` (True when fp32 could not hold a result: the call is
then repeated on the reference in fp64, `backends.widening`) and `warm_up()`. A call a kernel does not handle
(an operator without a kernel, or a view whose dims do not merge into the kernel's 2-D/3-D
shape) runs on the operator's NumPy reference instead, logged once per operator and reason.

Compilation never lands on a request: `warm_up()` (run once per process, when the backend is
created) builds every kernel for every dtype signature, loading them from Numba's on-disk
cache when an earlier process compiled them (see `_jit.configure_cache`).

Concurrent calls need a thread-safe Numba threading layer (TBB or OpenMP; `_jit.pin_threading_layer`
picks one before the first kernel). The layer in force is checked once the kernels ran; with
only the workqueue layer, which aborts the process on concurrent use, calls run one at a time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numba

from ...registry import Operator, Plan
from ..widening import in_range

log = logging.getLogger("aclnn_server")

SMALL_CALL_ELEMENTS = 1 << 16  # below this many input elements a call runs on the calling thread only
# Threading layers that let several threads run parallel kernels at once (Numba's "threadsafe").
SAFE_LAYERS = ("tbb", "omp")

_warm_lock = threading.Lock()
_warm_seconds: float | None = None


def kernel_modules() -> dict[str, ModuleType]:
    """Operator name -> its kernel module (imported after the cache directory is configured)."""
    from . import _jit

    _jit.configure_cache()
    _jit.pin_threading_layer()
    from . import (
        batch_norm,
        batch_norm_backward,
        batch_norm_elemt_backward,
        group_norm_backward,
        layer_norm_backward,
        layer_norm_grad,
        rms_norm,
        rms_norm_grad,
    )

    return {
        "aclnnLayerNormBackward": layer_norm_backward,
        "LayerNormGrad": layer_norm_grad,
        "aclnnBatchNormBackward": batch_norm_backward,
        "aclnnBatchNormElemtBackward": batch_norm_elemt_backward,
        "aclnnRmsNorm": rms_norm,
        "aclnnRmsNormGrad": rms_norm_grad,
        "aclnnGroupNormBackward": group_norm_backward,
        "aclnnBatchNorm": batch_norm,
    }


def warm_up(progress: Callable[[str], None] | None = None) -> float:
    """Compiles (or loads) and runs every kernel on tiny inputs, once per process; returns the seconds spent.

    A compile is announced first and logged kernel by kernel; `progress` gets those lines too (the
    test suite's session start shows them).
    """
    global _warm_seconds
    from . import _jit

    with _warm_lock:
        if _warm_seconds is None:
            started = time.perf_counter()
            modules = kernel_modules()
            compiling = not _jit.cache_is_warm()
            if compiling:
                report(
                    progress,
                    logging.WARNING,
                    f"cpu backend: compiling its kernels into {_jit.configure_cache() or '(no writable cache)'}: "
                    "about 3 minutes of CPU (longer on a busy machine), once per machine and code version; later "
                    "starts load them in seconds, wherever the package is installed",
                )
            for done, (op, module) in enumerate(modules.items(), 1):
                module.warm_up()
                if compiling:
                    elapsed = time.perf_counter() - started
                    report(progress, logging.INFO, f"cpu backend: {op} ready ({done}/{len(modules)}, {elapsed:.0f} s)")
            _warm_seconds = time.perf_counter() - started
            loaded, compiled = _jit.compile_counts()
            report(
                progress,
                logging.INFO,
                f"cpu backend: kernels ready in {_warm_seconds:.2f} s "
                f"({loaded} loaded from the disk cache, {compiled} compiled)",
            )
        return _warm_seconds


def report(progress: Callable[[str], None] | None, level: int, line: str) -> None:
    """A warm-up line to the log, and to `progress` when given."""
    log.log(level, "%s", line)
    if progress is not None:
        progress(line)


def checked_threading_layer() -> str:
    """The threading layer the kernels run on (once one ran), logged: a warning when it is not thread-safe."""
    layer = numba.threading_layer()
    if layer in SAFE_LAYERS:
        log.info("cpu backend: Numba threading layer %s", layer)
    else:
        log.warning(
            "cpu backend: Numba threading layer %s is not thread-safe: cpu kernel calls run one at a time "
            "(install TBB with `pip install tbb`, or OpenMP's runtime libgomp, for concurrent calls)",
            layer,
        )
    return layer


def thread_count_access() -> tuple[Callable[[], int], Callable[[int], None]]:
    """Get and set Numba's thread count for the calling thread, once its pool is up: the functions its
    public get_num_threads/set_num_threads call after taking two locks, one of them process-wide (a
    multiprocessing lock: system calls, ~10 µs of a small call's three). The public ones where this
    Numba lacks them."""
    from numba.np.ufunc import parallel

    numba.get_num_threads()  # starts the pool, which binds them
    get, set_ = getattr(parallel, "_get_num_threads", None), getattr(parallel, "_set_num_threads", None)
    if not (callable(get) and callable(set_)):
        return numba.get_num_threads, numba.set_num_threads
    return get, set_


class CpuBackend:
    name = "cpu"

    def __init__(self) -> None:
        self.kernels = kernel_modules()
        self._fallbacks_logged: set[tuple[str, str]] = set()
        warm_up()
        self.threading_layer = checked_threading_layer()
        self._serial = contextlib.nullcontext() if self.threading_layer in SAFE_LAYERS else threading.Lock()
        self._get_threads, self._set_threads = thread_count_access()

    def _kernel(self, operator: Operator, plan: Plan) -> ModuleType | None:
        module = self.kernels.get(operator.name)
        if module is None:
            self._log_fallback(operator.name, "no cpu kernel")
            return None
        if not module.handles(plan):
            self._log_fallback(operator.name, "a layout the kernel does not take")
            return None
        return module

    def _log_fallback(self, op: str, why: str) -> None:
        if (op, why) not in self._fallbacks_logged:
            self._fallbacks_logged.add((op, why))
            log.info("cpu backend: %s runs on the NumPy reference (%s)", op, why)

    def workspace_size(self, operator: Operator, plan: Plan) -> int:
        module = self._kernel(operator, plan)
        return operator.workspace_size(plan) if module is None else module.workspace_size(plan)

    def compute(self, operator: Operator, plan: Plan, args: dict[str, Any]) -> None:
        self.prepare(operator, plan)(args)

    def prepare(self, operator: Operator, plan: Plan) -> Callable[[dict[str, Any]], None]:
        """The compute of `plan`, its kernel chosen now: a repeated call's (Engine.prepare) skips the
        choice, and the kernel module's own `prepare` (where it has one) what it derives from the layout."""
        module = self._kernel(operator, plan)
        if module is None:
            return in_range(operator, plan, lambda args: operator.compute(**args))  # the reference
        prepare = getattr(module, "prepare", None)
        kernel = prepare(plan) if prepare is not None else functools.partial(module.compute, plan)
        run = (
            self._one_thread if sum(t.numel for t in plan.inputs.values()) < SMALL_CALL_ELEMENTS else self._all_threads
        )
        return in_range(operator, plan, functools.partial(run, kernel))

    def _one_thread(self, kernel: Callable[[dict[str, Any]], bool], args: dict[str, Any]) -> bool:
        """The kernel on this thread alone: whether a result left fp32's range."""
        # Waking the worker threads costs more than a small call; results do not depend on the
        # thread count, and Numba's setting is per calling thread.
        threads = self._get_threads()
        if threads > 1:
            self._set_threads(1)
        try:
            with self._serial:
                return kernel(args)
        finally:
            if threads > 1:
                self._set_threads(threads)

    def _all_threads(self, kernel: Callable[[dict[str, Any]], bool], args: dict[str, Any]) -> bool:
        with self._serial:
            return kernel(args)
