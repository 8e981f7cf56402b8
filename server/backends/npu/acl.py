"""A ctypes binding of the CANN C API the NPU backend needs: ACL runtime and aclnn (opapi).

Libraries: `libascendcl.so` (aclInit, aclrt*) and `libopapi.so` (aclCreateTensor, the
aclnn operators, executors). They are searched in `$ACLNN_CANN_LIB_DIR` (an override,
used by the tests to load a fake CANN), `$ASCEND_HOME_PATH/lib64`, `$ASCEND_HOME_PATH/lib`,
`/usr/local/Ascend/ascend-toolkit/latest/lib64`, then the normal library path
(`LD_LIBRARY_PATH`, ld.so.cache), which is where CANN's `set_env.sh` puts them.

Error mapping: an aclnn call's status passes through unchanged (AclnnError(status, ...));
an ACL runtime call (aclInit, aclrt*) that returns non-zero becomes 361001
(ACLNN_ERR_RUNTIME_ERROR) carrying the ACL error code and `aclGetRecentErrMsg()`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aclnn_common.errors import AclnnError, Status

# aclrtMemMallocPolicy / aclrtMemcpyKind (acl_rt.h)
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEMCPY_HOST_TO_HOST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3

RUNTIME_LIB = "libascendcl.so"
OPAPI_LIB = "libopapi.so"

_p = ctypes.c_void_p
_i64p = ctypes.POINTER(ctypes.c_int64)
_u64p = ctypes.POINTER(ctypes.c_uint64)
_pp = ctypes.POINTER(ctypes.c_void_p)


@dataclass(frozen=True)
class AclnnApi:
    """One aclnn operator: its C name and its GetWorkspaceSize parameters, in CANN's order.

    Each parameter is (kind, name) with kind one of "tensor", "int_array", "bool_array",
    "bool", "int" (int64_t), "double"; `name` is the parameter's CANN name (the engine's argument key).
    """

    name: str
    params: tuple[tuple[str, str], ...]


def _t(*names: str) -> tuple[tuple[str, str], ...]:
    return tuple(("tensor", n) for n in names)


# The exact CANN argument lists (before `uint64_t* workspaceSize, aclOpExecutor** executor`).
APIS: dict[str, AclnnApi] = {
    api.name: api
    for api in (
        AclnnApi(
            "aclnnLayerNormBackward",
            (
                *_t("gradOut", "input"),
                ("int_array", "normalizedShape"),
                *_t("mean", "rstd", "weightOptional", "biasOptional"),
                ("bool_array", "outputMask"),
                *_t("gradInputOut", "gradWeightOut", "gradBiasOut"),
            ),
        ),
        AclnnApi(
            "aclnnBatchNormBackward",
            (
                *_t("gradOut", "input", "weight", "runningMean", "runningVar", "saveMean", "saveInvstd"),
                ("bool", "training"),
                ("double", "eps"),
                ("bool_array", "outputMask"),
                *_t("gradInput", "gradWeight", "gradBias"),
            ),
        ),
        AclnnApi(
            "aclnnBatchNormElemtBackward",
            _t("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter", "gradInput"),
        ),
        AclnnApi(
            "aclnnLayerNorm",
            (
                *_t("input"),
                ("int_array", "normalizedShape"),
                *_t("weightOptional", "biasOptional"),
                ("double", "eps"),
                *_t("out", "meanOutOptional", "rstdOutOptional"),
            ),
        ),
        AclnnApi("aclnnRmsNorm", (*_t("x", "gamma"), ("double", "epsilon"), *_t("yOut", "rstdOut"))),
        AclnnApi("aclnnRmsNormGrad", _t("dy", "x", "rstd", "gamma", "dxOut", "dgammaOut")),
        AclnnApi(
            "aclnnGroupNorm",
            (
                *_t("self", "gamma", "beta"),
                ("int", "N"),
                ("int", "C"),
                ("int", "HxW"),
                ("int", "group"),
                ("double", "eps"),
                *_t("out", "meanOut", "rstdOut"),
            ),
        ),
        AclnnApi(
            "aclnnGroupNormBackward",
            (
                *_t("gradOut", "input", "mean", "rstd", "gamma"),
                ("int", "N"),
                ("int", "C"),
                ("int", "HxW"),
                ("int", "group"),
                ("bool_array", "outputMask"),
                *_t("gradInput", "gradGammaOut", "gradBetaOut"),
            ),
        ),
        AclnnApi("aclnnBatchNormStats", (*_t("input"), ("double", "eps"), *_t("mean", "invstd"))),
        AclnnApi(
            "aclnnBatchNormGatherStatsWithCounts",
            (
                *_t("input", "mean", "invstd", "runningMean", "runningVar"),
                ("double", "momentum"),
                ("double", "eps"),
                *_t("counts", "meanAll", "invstdAll"),
            ),
        ),
        AclnnApi(
            "aclnnBatchNormElemt",
            (*_t("input", "weight", "bias", "mean", "invstd"), ("double", "eps"), *_t("output")),
        ),
        AclnnApi(
            "aclnnBatchNormReduceBackward",
            (
                *_t("gradOut", "input", "mean", "invstd", "weight"),
                ("bool", "inputG"),
                ("bool", "weightG"),
                ("bool", "biasG"),
                *_t("sumDy", "sumDyXmu", "gradWeight", "gradBias"),
            ),
        ),
        AclnnApi(
            "aclnnBatchNorm",
            (
                *_t("input", "weight", "bias", "runningMean", "runningVar"),
                ("bool", "training"),
                ("double", "momentum"),
                ("double", "eps"),
                *_t("output", "saveMean", "saveInvstd"),
            ),
        ),
    )
}

_CTYPE = {
    "tensor": _p,
    "int_array": _p,
    "bool_array": _p,
    "bool": ctypes.c_bool,
    "int": ctypes.c_int64,
    "double": ctypes.c_double,
}


def library_dirs() -> list[str]:
    """Directories searched for CANN's libraries, in order (the normal library path comes last)."""
    dirs = []
    if os.environ.get("ACLNN_CANN_LIB_DIR"):
        dirs.append(os.environ["ACLNN_CANN_LIB_DIR"])
    home = os.environ.get("ASCEND_HOME_PATH")
    if home:
        dirs += [os.path.join(home, "lib64"), os.path.join(home, "lib")]
    dirs.append("/usr/local/Ascend/ascend-toolkit/latest/lib64")
    return dirs


def _load(name: str) -> ctypes.CDLL:
    tried = []
    for d in library_dirs():
        path = os.path.join(d, name)
        tried.append(path)
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                raise RuntimeError(f"CANN library {path} exists but does not load: {exc}") from exc
    try:
        return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)  # LD_LIBRARY_PATH, ld.so.cache
    except OSError:
        pass
    raise RuntimeError(
        f"CANN not found: {name} not found (looked in {', '.join(tried)} and the library path); "
        "set ASCEND_HOME_PATH (source CANN's set_env.sh) or ACLNN_CANN_LIB_DIR, or choose another backend"
    )


class Acl:
    """The loaded libraries with typed entry points; methods raise AclnnError on failure."""

    def __init__(self) -> None:
        self.rt = _load(RUNTIME_LIB)
        self.op = _load(OPAPI_LIB)
        self._declare()

    # ------------------------------------------------------------------ declarations

    def _fn(self, lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
        try:
            f = getattr(lib, name)
        except AttributeError as exc:
            raise RuntimeError(f"CANN library {lib._name} has no symbol {name}: CANN too old or incomplete") from exc
        f.restype, f.argtypes = restype, list(argtypes)
        return f

    def _declare(self) -> None:
        rt, op, i = self.rt, self.op, ctypes.c_int
        self.aclInit = self._fn(rt, "aclInit", i, ctypes.c_char_p)
        self.aclFinalize = self._fn(rt, "aclFinalize", i)
        self.aclrtSetDevice = self._fn(rt, "aclrtSetDevice", i, ctypes.c_int32)
        self.aclrtResetDevice = self._fn(rt, "aclrtResetDevice", i, ctypes.c_int32)
        self.aclrtCreateContext = self._fn(rt, "aclrtCreateContext", i, _pp, ctypes.c_int32)
        self.aclrtDestroyContext = self._fn(rt, "aclrtDestroyContext", i, _p)
        self.aclrtSetCurrentContext = self._fn(rt, "aclrtSetCurrentContext", i, _p)
        self.aclrtCreateStream = self._fn(rt, "aclrtCreateStream", i, _pp)
        self.aclrtDestroyStream = self._fn(rt, "aclrtDestroyStream", i, _p)
        self.aclrtSynchronizeStream = self._fn(rt, "aclrtSynchronizeStream", i, _p)
        self.aclrtMalloc = self._fn(rt, "aclrtMalloc", i, _pp, ctypes.c_size_t, ctypes.c_int)
        self.aclrtFree = self._fn(rt, "aclrtFree", i, _p)
        self.aclrtMemcpy = self._fn(rt, "aclrtMemcpy", i, _p, ctypes.c_size_t, _p, ctypes.c_size_t, ctypes.c_int)
        self.aclrtMemset = self._fn(rt, "aclrtMemset", i, _p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_size_t)
        self.aclGetRecentErrMsg = self._fn(rt, "aclGetRecentErrMsg", ctypes.c_char_p)
        self.aclCreateTensor = self._fn(
            op, "aclCreateTensor", _p, _i64p, ctypes.c_uint64, i, _i64p, ctypes.c_int64, i, _i64p, ctypes.c_uint64, _p
        )
        self.aclDestroyTensor = self._fn(op, "aclDestroyTensor", i, _p)
        self.aclCreateIntArray = self._fn(op, "aclCreateIntArray", _p, _i64p, ctypes.c_uint64)
        self.aclDestroyIntArray = self._fn(op, "aclDestroyIntArray", i, _p)
        self.aclCreateBoolArray = self._fn(op, "aclCreateBoolArray", _p, ctypes.POINTER(ctypes.c_bool), ctypes.c_uint64)
        self.aclDestroyBoolArray = self._fn(op, "aclDestroyBoolArray", i, _p)
        self.aclSetAclOpExecutorRepeatable = self._fn(op, "aclSetAclOpExecutorRepeatable", i, _p)
        self.aclDestroyAclOpExecutor = self._fn(op, "aclDestroyAclOpExecutor", i, _p)
        self.get_workspace_fns = {}
        self.launch_fns = {}
        for api in APIS.values():
            argtypes = [_CTYPE[kind] for kind, _ in api.params] + [_u64p, _pp]
            self.get_workspace_fns[api.name] = self._fn(op, api.name + "GetWorkspaceSize", i, *argtypes)
            self.launch_fns[api.name] = self._fn(op, api.name, i, _p, ctypes.c_uint64, _p, _p)

    # ------------------------------------------------------------------ errors

    def recent_error(self) -> str:
        try:
            msg = self.aclGetRecentErrMsg()
        except Exception:  # the message is a courtesy; never mask the real failure
            return ""
        return msg.decode(errors="replace").strip() if msg else ""

    def check_runtime(self, code: int, what: str) -> None:
        """An ACL runtime failure: 361001 with the ACL code and message."""
        if code != 0:
            detail = self.recent_error()
            raise AclnnError(
                Status.RUNTIME_ERROR, f"{what} failed with ACL error {code}" + (f": {detail}" if detail else "")
            )

    def check_aclnn(self, code: int, what: str) -> None:
        """An aclnn status: passed through unchanged."""
        if code != 0:
            detail = self.recent_error()
            raise AclnnError(code, f"{what} returned {code}" + (f": {detail}" if detail else ""))

    # ------------------------------------------------------------------ runtime

    def init(self) -> None:
        self.check_runtime(self.aclInit(None), "aclInit")

    def finalize(self) -> None:
        self.check_runtime(self.aclFinalize(), "aclFinalize")

    def set_device(self, device: int) -> None:
        self.check_runtime(self.aclrtSetDevice(device), f"aclrtSetDevice({device})")

    def reset_device(self, device: int) -> None:
        self.check_runtime(self.aclrtResetDevice(device), f"aclrtResetDevice({device})")

    def create_context(self, device: int) -> int:
        ctx = ctypes.c_void_p()
        self.check_runtime(self.aclrtCreateContext(ctypes.byref(ctx), device), "aclrtCreateContext")
        return ctx.value

    def destroy_context(self, ctx: int) -> None:
        self.check_runtime(self.aclrtDestroyContext(ctx), "aclrtDestroyContext")

    def set_current_context(self, ctx: int) -> None:
        self.check_runtime(self.aclrtSetCurrentContext(ctx), "aclrtSetCurrentContext")

    def create_stream(self) -> int:
        stream = ctypes.c_void_p()
        self.check_runtime(self.aclrtCreateStream(ctypes.byref(stream)), "aclrtCreateStream")
        return stream.value

    def destroy_stream(self, stream: int) -> None:
        self.check_runtime(self.aclrtDestroyStream(stream), "aclrtDestroyStream")

    def synchronize(self, stream: int) -> None:
        self.check_runtime(self.aclrtSynchronizeStream(stream), "aclrtSynchronizeStream")

    def malloc(self, size: int) -> int:
        ptr = ctypes.c_void_p()
        self.check_runtime(
            self.aclrtMalloc(ctypes.byref(ptr), size, ACL_MEM_MALLOC_HUGE_FIRST), f"aclrtMalloc({size} bytes)"
        )
        return ptr.value

    def free(self, ptr: int) -> None:
        self.check_runtime(self.aclrtFree(ptr), "aclrtFree")

    def memcpy(self, dst: int, src: int, count: int, kind: int) -> None:
        self.check_runtime(self.aclrtMemcpy(dst, count, src, count, kind), f"aclrtMemcpy(kind {kind})")

    def memset(self, ptr: int, count: int, value: int) -> None:
        self.check_runtime(self.aclrtMemset(ptr, count, value, count), "aclrtMemset")

    # ------------------------------------------------------------------ opapi objects

    def create_tensor(
        self,
        shape: Sequence[int],
        data_type: int,
        strides: Sequence[int],
        offset: int,
        fmt: int,
        storage_dims: Sequence[int],
        data: int | None,
    ) -> int:
        view = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        stride = (ctypes.c_int64 * max(len(strides), 1))(*strides)
        storage = (ctypes.c_int64 * max(len(storage_dims), 1))(*storage_dims)
        t = self.aclCreateTensor(
            view, len(shape), int(data_type), stride, offset, int(fmt), storage, len(storage_dims), data
        )
        if not t:
            raise AclnnError(Status.INNER_NULLPTR, f"aclCreateTensor returned null: {self.recent_error()}")
        return t

    def create_int_array(self, values: Sequence[int]) -> int:
        a = self.aclCreateIntArray((ctypes.c_int64 * max(len(values), 1))(*values), len(values))
        if not a:
            raise AclnnError(Status.INNER_NULLPTR, f"aclCreateIntArray returned null: {self.recent_error()}")
        return a

    def create_bool_array(self, values: Sequence[bool]) -> int:
        a = self.aclCreateBoolArray((ctypes.c_bool * max(len(values), 1))(*values), len(values))
        if not a:
            raise AclnnError(Status.INNER_NULLPTR, f"aclCreateBoolArray returned null: {self.recent_error()}")
        return a

    def get_workspace_size(self, api: str, args: Sequence[Any]) -> tuple[int, int]:
        """aclnnXGetWorkspaceSize(args..., &workspaceSize, &executor) -> (workspaceSize, executor)."""
        size, executor = ctypes.c_uint64(), ctypes.c_void_p()
        code = self.get_workspace_fns[api](*args, ctypes.byref(size), ctypes.byref(executor))
        self.check_aclnn(code, f"{api}GetWorkspaceSize")
        if not executor.value:
            raise AclnnError(Status.INNER_CREATE_EXECUTOR, f"{api}GetWorkspaceSize returned no executor")
        return size.value, executor.value

    def launch(self, api: str, workspace: int | None, workspace_size: int, executor: int, stream: int) -> None:
        self.check_aclnn(self.launch_fns[api](workspace, workspace_size, executor, stream), api)

    def set_repeatable(self, executor: int) -> None:
        self.check_aclnn(self.aclSetAclOpExecutorRepeatable(executor), "aclSetAclOpExecutorRepeatable")

    def destroy_executor(self, executor: int) -> None:
        self.check_aclnn(self.aclDestroyAclOpExecutor(executor), "aclDestroyAclOpExecutor")
