"""aclnn-serve's Python client: CANN's two-phase aclnn API over gRPC, NumPy in and out."""

from aclnn_common.api import Executor
from aclnn_common.errors import AclnnError, Status
from aclnn_common.tensor import Tensor, create_tensor
from aclnn_common.types import DataType, Format

from .grpc_client import Client

__all__ = ["AclnnError", "Client", "DataType", "Executor", "Format", "Status", "Tensor", "create_tensor"]
