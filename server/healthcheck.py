"""`python -m aclnn_server.healthcheck`: exit 0 when the local server reports SERVING.

For container HEALTHCHECKs and exec probes (Kubernetes' native gRPC probe needs no helper).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    address = f"127.0.0.1:{os.environ.get('ACLNN_PORT', '50051')}"
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="aclnn.v1.Aclnn"), timeout=3
            )
    except grpc.RpcError as error:
        print(f"{address}: {error.code().name}", file=sys.stderr)
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
