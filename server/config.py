"""The server's settings: one model read from flags, ACLNN_* environment variables and a config file.

Precedence: command-line flags, then environment, then the `--config` file (TOML or
JSON), then the defaults here. Everything is validated before the server starts.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import ipaddress
import os
import pathlib
import ssl
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

BackendName = Literal["auto", "numpy", "cpu", "torch", "npu"]

# The config file of the settings being loaded (a context variable keeps loads independent).
_config_file: contextvars.ContextVar[pathlib.Path | None] = contextvars.ContextVar("config_file", default=None)


# Durations are finite and fit gRPC's 32-bit milliseconds (24 days).
_MAX_SECONDS = 2_000_000.0


def _seconds(default: float, description: str, *, gt: float | None = None, ge: float | None = None) -> Any:
    """A duration option: a finite number of seconds, at most _MAX_SECONDS, above `gt` or from `ge`."""
    return Field(default, gt=gt, ge=ge, le=_MAX_SECONDS, allow_inf_nan=False, description=description)


class ServerOptions(BaseSettings):
    """Every server option; the field name is the flag (--max-queue) and the variable (ACLNN_MAX_QUEUE)."""

    # An empty ACLNN_* variable is unset (a template's FOO= means "the default"): ACLNN_UNIX_SOCKET= turned the
    # socket off, where `off` says so.
    model_config = SettingsConfigDict(env_prefix="ACLNN_", extra="forbid", validate_default=True, env_ignore_empty=True)

    host: str = Field(
        "127.0.0.1", description="address to bind; a non-loopback address needs TLS and tokens, or --insecure"
    )
    port: int = Field(50051, ge=0, le=65535, description="port to bind; 0 picks a free one")
    backend: BackendName = Field("auto", description="compute backend: auto, numpy, cpu, torch or npu")
    device: int = Field(0, ge=0, description="NPU device id for --backend npu")
    torch_device: str = Field("cpu", description="torch device for --backend torch: cpu, cuda:N or npu:N")
    data_port: int = Field(
        0,
        ge=-1,
        le=65535,
        description="data channel port (TCP beside gRPC for tensor bytes and fast calls, with the same TLS); "
        "0 picks a free one, -1 = off",
    )
    unix_socket: str = Field(
        "auto",
        description="Unix domain socket for clients on this host (the data channel, plus shared-memory regions "
        "passed as memfds): a path, 'auto' (a fresh directory under the temp directory), or 'off'",
    )
    data_max_connections_per_tenant: int = Field(
        16, ge=1, description="data-channel connections one identity may hold open; beyond: refused (gRPC carries on)"
    )
    data_max_handshakes: int = Field(
        64, ge=1, description="data-channel connections not yet admitted by a ticket; beyond: new ones closed at once"
    )
    data_handshake_timeout_s: float = _seconds(
        5.0,
        "seconds a data-channel connection has to present its ticket (TLS included); "
        "also each request's allowance, plus 1 s per MiB",
        gt=0,
    )
    data_idle_timeout_s: float = _seconds(
        60.0, "seconds an admitted data-channel connection may stay idle before it is closed", gt=0
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 = off")
    tls_cert: pathlib.Path | None = Field(None, description="server certificate chain (PEM)")
    tls_key: pathlib.Path | None = Field(None, description="server private key (PEM)")
    tls_client_ca: pathlib.Path | None = Field(None, description="CA bundle for client certificates: mutual TLS")
    auth_token_file: pathlib.Path | None = Field(None, description="bearer tokens, one per line; enables auth")
    insecure: bool = Field(False, description="allow a non-loopback address without TLS and tokens")
    max_message_bytes: int = Field(
        64 << 20,
        ge=1 << 20,
        le=2**31 - 1,
        description="largest gRPC message, in bytes (larger tensors travel as uploads, downloads or over the "
        "data channel; messages being received are only counted in the memory budget once whole)",
    )
    # Each running or queued execution may hold a thread (gRPC's and the data channel's workers): bounded, so
    # that a typo is refused at start rather than failing to start threads (a container's pids.max).
    max_concurrency: int = Field(2, ge=1, le=256, description="operator executions running at once")
    max_queue: int = Field(64, ge=0, le=4096, description="executions waiting for a slot; beyond: RESOURCE_EXHAUSTED")
    memory_budget_bytes: int | None = Field(
        None,
        ge=1,
        description="bytes the server may hold for callers: messages, uploads, kept results, executor data, "
        "outputs and workspaces (default: half of the memory limit, the cgroup's or RAM)",
    )
    max_tenant_bytes: int | None = Field(
        None, ge=1, description="bytes of the budget one identity may hold at once (default: half of the budget)"
    )
    max_tenant_executors: int = Field(1024, ge=1, description="executors one identity may hold at once")
    max_tenant_sessions: int = Field(
        256, ge=1, description="client sessions one identity may have alive at once; beyond: RESOURCE_EXHAUSTED"
    )
    max_tenant_queue: int | None = Field(
        None,
        ge=1,
        description="executions of one identity waiting in the queue (default: half of --max-queue); "
        "beyond: RESOURCE_EXHAUSTED at once",
    )
    max_tenant_calls: int | None = Field(
        None,
        ge=1,
        description="gRPC calls one identity may have in progress (default: half of the server's call cap, "
        "--max-concurrency + --max-queue + 4); beyond: RESOURCE_EXHAUSTED at once",
    )
    executor_ttl_s: float = _seconds(300.0, "seconds before a never-executed executor expires", gt=0)
    max_executors: int = Field(4096, ge=1, description="executors alive at once")
    session_ttl_s: float = _seconds(60.0, "seconds a client session's tensors and regions outlive its last call", gt=0)
    grace_period_s: float = _seconds(10.0, "seconds in-flight calls get to finish on SIGTERM", ge=0)
    max_connection_age_s: float = _seconds(
        300.0,
        "seconds before the server asks a client to reconnect its gRPC connection (GOAWAY), so "
        "that clients resolving a DNS name spread onto replicas added since",
        ge=0.001,  # gRPC takes whole milliseconds: less would be 0, a GOAWAY at once
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="logging level")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _config_file.get()
        if path is None:
            return init_settings, env_settings
        if path.suffix == ".json":
            return init_settings, env_settings, JsonConfigSettingsSource(settings_cls, json_file=path)
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=path)

    @model_validator(mode="after")
    def _consistent(self) -> ServerOptions:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{flag(name)} {path} is not a readable file")
        if self.tls_cert is not None:  # read now, so that a bad file is named (gRPC would say "failed to bind")
            with options_at_fault(tls_cert=self.tls_cert, tls_key=self.tls_key):
                try:
                    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.tls_cert, self.tls_key)
                except ssl.SSLError as exc:
                    raise ValueError(f"not a PEM certificate chain and its private key ({exc})") from exc
        if self.tls_client_ca is not None:
            with options_at_fault(tls_client_ca=self.tls_client_ca):
                try:
                    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(self.tls_client_ca)
                except ssl.SSLError as exc:
                    raise ValueError(f"not a PEM bundle of CA certificates ({exc})") from exc
        if not self.is_loopback and not self.insecure:
            if self.tls_cert is None:
                raise ValueError(f"--host {self.host} is not loopback: give --tls-cert/--tls-key, or --insecure")
            if self.auth_token_file is None:
                raise ValueError(f"--host {self.host} is not loopback: give --auth-token-file, or --insecure")
        return self

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def load_options(flags: dict[str, Any], config_file: pathlib.Path | None = None) -> ServerOptions:
    """Options from flags (those given), the environment and an optional config file."""
    token = _config_file.set(config_file)
    try:
        return ServerOptions(**flags)
    finally:
        _config_file.reset(token)


def add_option_flags(
    parser: argparse.ArgumentParser, names: Iterable[str], describe: Callable[[str, Any], str], config_help: str
) -> None:
    """`--config` and a flag per named option (`describe(name, field)` its help). A flag not given is left
    out of the parsed arguments, so that the environment and the file decide it (`load_options`)."""
    parser.add_argument("--config", type=pathlib.Path, default=os.environ.get("ACLNN_CONFIG"), help=config_help)
    for name in names:
        field = ServerOptions.model_fields[name]
        if field.annotation is bool:
            parser.add_argument(flag(name), action="store_true", default=argparse.SUPPRESS, help=describe(name, field))
            continue
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
        parser.add_argument(flag(name), default=argparse.SUPPRESS, choices=choices, help=describe(name, field))


def flag(name: str) -> str:
    """The command-line flag of an option field (`data_port` -> `--data-port`)."""
    return "--" + name.replace("_", "-")


class OptionError(ValueError):
    """A setting the server cannot start with; the message names each flag at fault and its value."""


@contextlib.contextmanager
def options_at_fault(**settings: object) -> Iterator[None]:
    """Re-raises a failure to use these settings (a port taken, a socket path that cannot be made, a file
    that does not parse) as an OptionError naming them: `--data-port 50052: [Errno 98] Address already in use`."""
    try:
        yield
    except OptionError:
        raise
    except (OSError, RuntimeError, ValueError) as exc:  # ssl.SSLError is an OSError
        named = " ".join(f"{flag(name)} {value}" for name, value in settings.items())
        raise OptionError(f"{named}: {exc}") from exc
