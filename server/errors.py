"""The server's refusal for load: CapacityError (RESOURCE_EXHAUSTED with a retry hint on the wire)."""

from __future__ import annotations

from aclnn_common.errors import AclnnError


class CapacityError(AclnnError):
    """The server cannot take more work of this kind now; retrying later may succeed."""
