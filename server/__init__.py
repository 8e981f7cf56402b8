"""aclnn-serve's server: CANN's aclnn operators behind a gRPC service, or in process."""

from .config import ServerOptions
from .engine import Engine
from .local import LocalClient
from .transport.grpc_server import AclnnServer, create_server

__all__ = ["AclnnServer", "Engine", "LocalClient", "ServerOptions", "create_server"]
