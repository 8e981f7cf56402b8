"""`aclnn-serve`: start the gRPC server; SIGTERM or SIGINT stops it gracefully."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import fields

from .backends import BACKENDS
from .transport.grpc_server import ServerOptions, create_server

log = logging.getLogger("aclnn_server")

_HELP = {
    "host": "address to bind (a non-loopback address exposes the service)",
    "port": "port to bind; 0 picks a free one",
    "backend": f"compute backend: {', '.join(BACKENDS)}",
    "max_message_bytes": "largest request or response message, in bytes",
    "max_workers": "gRPC worker threads (concurrent calls)",
    "executor_ttl_s": "seconds before an executor that was never executed expires",
    "max_executors": "most executors alive at once",
    "memory_budget_bytes": "most bytes one call's tensors and workspace may claim (default: half of RAM)",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags, each defaulting to its ACLNN_<NAME> environment variable, then to ServerOptions."""
    parser = argparse.ArgumentParser(
        prog="aclnn-serve",
        description="Serve Huawei CANN aclnn operators over gRPC (package aclnn.v1).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(ServerOptions):
        env = "ACLNN_" + f.name.upper()
        convert = (
            int
            if f.name in ("port", "max_message_bytes", "max_workers", "max_executors", "memory_budget_bytes")
            else str
        )
        convert = float if f.name.endswith("_s") else convert
        default = convert(os.environ[env]) if env in os.environ else f.default
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=convert,
            default=default,
            choices=BACKENDS if f.name == "backend" else None,
            help=f"{_HELP[f.name]} (env {env})",
        )
    parser.add_argument(
        "--grace-period-s",
        type=float,
        default=float(os.environ.get("ACLNN_GRACE_PERIOD_S", 10)),
        help="seconds in-flight calls may take to finish on shutdown (env ACLNN_GRACE_PERIOD_S)",
    )
    parser.add_argument(
        "--log-level", default=os.environ.get("ACLNN_LOG_LEVEL", "INFO"), help="logging level (env ACLNN_LOG_LEVEL)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = ServerOptions(**{f.name: getattr(args, f.name) for f in fields(ServerOptions)})
    try:
        server, port, engine = create_server(options)
    except (ValueError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    if port == 0:
        log.error("cannot bind %s:%s", options.host, options.port)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server.start()
    log.info("backend %s, operators: %s", engine.backend.name, ", ".join(sorted(engine.operators)))
    print(f"listening on {options.host}:{port}", flush=True)
    stop.wait()
    log.info("stopping: in-flight calls have %.0f s to finish", args.grace_period_s)
    started = time.monotonic()
    server.stop(args.grace_period_s).wait()
    log.info("stopped after %.2f s", time.monotonic() - started)
    return 0
