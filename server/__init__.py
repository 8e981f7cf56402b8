"""aclnn-serve's server: CANN's aclnn operators behind a gRPC service, or in process."""

from .engine import Engine
from .local import LocalClient
from .transport.grpc_server import ServerOptions, create_server

__all__ = ["Engine", "LocalClient", "ServerOptions", "create_server"]
