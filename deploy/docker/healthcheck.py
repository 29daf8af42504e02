"""Container HEALTHCHECK: exit 0 when the local Sluice service reports SERVING on grpc.health.v1.

Docker (and any runtime without Kubernetes' native gRPC probes) runs this inside the container.
The target is `127.0.0.1:<port>`, the port being `SLUICE_PORT` (the same variable the service
reads, so `docker run -e SLUICE_PORT=50052 ... serve tokenizer` needs nothing else), else
`--default-port` (the image's main role). Exit codes follow Docker: 0 healthy, 1 unhealthy.

    python healthcheck.py [--default-port 50051] [--service NAME] [--timeout-s 3]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import env


def check(target: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """(healthy, what was seen) for one Health.Check call to `target`."""
    try:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as error:
        return False, f"{target}: {error.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--default-port", type=int, default=50051, help="when SLUICE_PORT is unset")
    parser.add_argument("--service", default="", help="health service name ('' = the server)")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the call")
    args = parser.parse_args(argv)
    port = env.setting("port") or str(args.default_port)
    healthy, seen = check(f"127.0.0.1:{port}", args.service, args.timeout_s)
    print(seen)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
