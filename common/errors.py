"""The one exception class of aclnn-serve, and CANN's status codes."""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """aclnnStatus values that cross the wire."""

    SUCCESS = 0
    PARAM_NULLPTR = 161001
    PARAM_INVALID = 161002
    RUNTIME_ERROR = 361001
    INNER = 561000
    INNER_INFERSHAPE_ERROR = 561001
    INNER_TILING_ERROR = 561002
    INNER_FIND_KERNEL_ERROR = 561003
    INNER_CREATE_EXECUTOR = 561101
    INNER_NOT_TRANS_EXECUTOR = 561102
    INNER_NULLPTR = 561103

    @property
    def reason(self) -> str:
        """The status name as CANN spells it (ErrorInfo.reason on the wire)."""
        if self is Status.SUCCESS:
            return "ACLNN_SUCCESS"
        return "ACLNN_ERR_" + self.name


class AclnnError(Exception):
    """A call failed. `.code` is the aclnn status, `.param` the parameter at fault.

    `.grpc_code` is the gRPC status it crossed the wire with (None in process).
    """

    def __init__(self, code: int, message: str, param: str = "", grpc_code: object = None) -> None:
        self.code = int(code)
        self.param = param
        self.message = message
        self.grpc_code = grpc_code
        super().__init__(f"[{self.code}] {message}")

    @property
    def reason(self) -> str:
        try:
            return Status(self.code).reason
        except ValueError:
            return f"ACLNN_STATUS_{self.code}"


def null_error(param: str, message: str = "") -> AclnnError:
    return AclnnError(Status.PARAM_NULLPTR, f"{param} must not be null{message}", param)


def invalid_error(param: str, message: str) -> AclnnError:
    return AclnnError(Status.PARAM_INVALID, f"{param}: {message}", param)


def malformed(what: str) -> AclnnError:
    """A reply no server of ours sends (a buggy or impostor server, or bytes changed on the way): a
    runtime error, never a Python exception from decoding it."""
    return AclnnError(Status.RUNTIME_ERROR, f"malformed reply from the server: {what}")
