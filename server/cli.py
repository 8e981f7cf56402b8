"""`aclnn-serve`: start the gRPC server; SIGTERM or SIGINT stops it gracefully."""

from __future__ import annotations

import argparse
import logging
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

from pydantic import ValidationError

from .config import ServerOptions, add_option_flags, load_options
from .transport.grpc_server import create_server

log = logging.getLogger("aclnn_server")


# Defaults worked out when the server starts.
_COMPUTED_DEFAULTS = {
    "memory_budget_bytes": "half of the memory limit (cgroup memory.max or RAM)",
    "max_tenant_bytes": "half of the budget",
}


def build_parser() -> argparse.ArgumentParser:
    """One flag per ServerOptions field; flags not given fall through to the environment and file."""
    parser = argparse.ArgumentParser(
        prog="aclnn-serve",
        description="Serve Huawei CANN aclnn operators over gRPC (service aclnn.v1.Aclnn).",
        epilog="Every option is also an environment variable ACLNN_<NAME> (e.g. ACLNN_MAX_QUEUE). "
        "Precedence: flags, then environment, then --config, then defaults.",
    )
    add_option_flags(
        parser,
        ServerOptions.model_fields,
        lambda name, field: (
            f"{field.description} (env ACLNN_{name.upper()}; default: {_COMPUTED_DEFAULTS.get(name, field.default)})"
        ),
        "TOML or JSON file of options, keyed by field name (env ACLNN_CONFIG)",
    )
    return parser


def _explain(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        if e["loc"]:
            lines.append(f"  --{'-'.join(str(p) for p in e['loc']).replace('_', '-')} {e.get('input')}: {e['msg']}")
        else:  # a check across options, whose message names the flags and values itself
            lines.append(f"  {e['ctx']['error'] if e['type'] == 'value_error' else e['msg']}")
    return "invalid configuration:\n" + "\n".join(lines)


def _wait_for(stop: threading.Event) -> None:
    """Waits until a signal handler sets `stop`. The kernel may deliver SIGTERM to any thread (a
    Numba, TBB or gRPC one among them): Python then runs its handler only once the main thread wakes,
    which a plain `stop.wait()` never did (a server that ignored SIGTERM). The signal's C handler
    writes to the wakeup descriptor, on whichever thread it ran, and that wakes this one."""
    woken, wakeup = socket.socketpair()
    wakeup.setblocking(False)
    signal.set_wakeup_fd(wakeup.fileno(), warn_on_full_buffer=False)
    try:
        while not stop.is_set():
            select.select([woken], [], [])
            woken.recv(4096)
    finally:
        signal.set_wakeup_fd(-1)
        woken.close()
        wakeup.close()


def main(argv: Sequence[str] | None = None) -> int:
    flags = vars(build_parser().parse_args(argv))
    config_file = flags.pop("config")
    if config_file is not None and not config_file.is_file():
        print(f"aclnn-serve: --config {config_file} is not a readable file", file=sys.stderr)
        return 2
    try:
        options = load_options(flags, config_file)
    except ValidationError as error:
        print(f"aclnn-serve: {_explain(error)}", file=sys.stderr)
        return 2
    except ValueError as error:  # a config file that does not parse
        print(f"aclnn-serve: --config {config_file}: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=options.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before anything starts: a signal in the first moments met the defaults (SIGHUP's ends the process).
    stop, reloads = threading.Event(), []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: [reload() for reload in reloads])  # the token file, once there is a server
    try:
        server, port, engine = create_server(options)
    except (ValueError, RuntimeError, OSError) as exc:  # each names the flags and values at fault
        log.error("cannot start: %s", exc)
        return 1
    reloads.append(server.reload)
    try:
        server.start()
    except (ValueError, OSError) as exc:  # the metrics port
        log.error("cannot start: %s", exc)
        server.stop(0).wait()
        return 1
    if not engine.ready.is_set():  # `listening on` is for a server that answers calls: not yet
        log.info(
            "started on %s:%d: NOT_SERVING, and calls refused as starting, until its %s backend is ready",
            options.host,
            port,
            options.backend,
        )
    while not engine.ready.wait(0.2):
        if stop.is_set():  # asked to stop while the backend loads: nothing was served, a clean stop
            log.info("stopped while the %s backend was loading", options.backend)
            server.stop(0).wait()
            return 0
    if engine.load_error is not None:
        log.error("cannot start: --backend %s: %s", options.backend, engine.load_error)
        server.stop(0).wait()
        return 1
    log.info(
        "backend %s%s; operators %s; max concurrency %d, queue %d; memory budget %d MiB, %d MiB per tenant; "
        "auth %s; tls %s; data channel %s; metrics %s",
        engine.backend.name,
        "" if engine.loaded.is_set() else " (auto: the reference until the best backend here has loaded)",
        ", ".join(sorted(engine.operators)),
        options.max_concurrency,
        options.max_queue,
        engine.ledger.budget_bytes >> 20,
        engine.ledger.tenant_bytes >> 20,
        "on" if options.auth_token_file else "off",
        "mutual" if options.tls_client_ca else "on" if options.tls_cert else "off",
        ", ".join(
            [f"port {server.data_channel.port}"] * bool(server.data_channel.port)
            + [f"unix socket {server.data_channel.unix_path}"] * bool(server.data_channel.unix_path)
        )
        if server.data_channel
        else "off",
        f"port {server.metrics_port}" if server.metrics_port else "off",
    )
    print(f"listening on {options.host}:{port}", flush=True)
    _wait_for(stop)
    log.info("draining: health NOT_SERVING, new calls refused, in-flight calls get %g s", options.grace_period_s)
    started = time.monotonic()
    server.stop(options.grace_period_s).wait()
    log.info("stopped after %.2f s", time.monotonic() - started)
    return 0
