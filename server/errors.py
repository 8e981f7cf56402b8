"""The server's refusals that are no fault of the call: CapacityError (RESOURCE_EXHAUSTED with a retry hint on
the wire) and ServerLeaving (UNAVAILABLE: the server is shutting down)."""

from __future__ import annotations

from aclnn_common.errors import AclnnError, Status


class CapacityError(AclnnError):
    """The server cannot take more work of this kind now; retrying later may succeed."""


class ServerLeaving(AclnnError):
    """The server is shutting down (SIGTERM): a call it had not begun is refused, UNAVAILABLE on the wire,
    which clients take to another replica."""

    def __init__(self) -> None:
        super().__init__(Status.RUNTIME_ERROR, "the server is shutting down: call another replica")
