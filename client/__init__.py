"""aclnn-serve's Python client: CANN's two-phase aclnn API over gRPC, NumPy in and out."""

from .api import Executor
from .errors import AclnnError, Status
from .grpc_client import Client
from .tensor import Tensor, create_tensor
from .types import DataType, Format

__all__ = ["AclnnError", "Client", "DataType", "Executor", "Format", "Status", "Tensor", "create_tensor"]
