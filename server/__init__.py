"""aclnn-serve's server: CANN's aclnn operators behind a gRPC service, or in process.

The public names load on first use, so that `python -m aclnn_server.healthcheck` (an exec
probe, run every few seconds) does not pay for the engine, NumPy and the backends.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import ServerOptions
    from .engine import Engine
    from .local import LocalClient
    from .transport.grpc_server import AclnnServer, create_server

_PUBLIC = {
    "AclnnServer": ".transport.grpc_server",
    "Engine": ".engine",
    "LocalClient": ".local",
    "ServerOptions": ".config",
    "create_server": ".transport.grpc_server",
}
__all__ = ["AclnnServer", "Engine", "LocalClient", "ServerOptions", "create_server"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
