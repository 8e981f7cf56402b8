"""The `aclnn-serve` process: real process, real port, real signals."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close

from aclnn_client import Client
from aclnn_server import ServerOptions


def start(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aclnn_server", "--port", "0", "--backend", "numpy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline()
    match = re.fullmatch(r"listening on (\S+):(\d+)\n", line)
    assert match, f"unexpected first line {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    return proc, f"{match[1]}:{match[2]}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serves_then_stops_gracefully_on_signal(signum, rng):
    proc, address = start()
    try:
        with Client(address) as c:
            p = layer_norm_call(rng, (4, 16))
            c.run("aclnnLayerNormBackward", **p)
        assert_close(p["gradInputOut"], layer_norm_reference(p)[0])
        proc.send_signal(signum)
        assert proc.wait(timeout=20) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_environment_configures_the_server():
    proc, address = start(env={"ACLNN_HOST": "127.0.0.1", "ACLNN_MAX_EXECUTORS": "7"})
    try:
        assert address.startswith("127.0.0.1:")
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0


def test_help_lists_every_option():
    script = pathlib.Path(sys.executable).with_name("aclnn-serve")  # the installed console script
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True).stdout
    for name in [*ServerOptions.model_fields, "config"]:
        assert "--" + name.replace("_", "-") in out
        assert name == "config" or f"ACLNN_{name.upper()}" in out


def test_flags_beat_environment_beat_config_file(tmp_path):
    config = tmp_path / "aclnn.toml"
    config.write_text("max_queue = 3\nmax_executors = 5\nexecutor_ttl_s = 9.5\n")
    env = {**os.environ, "ACLNN_MAX_EXECUTORS": "6", "ACLNN_EXECUTOR_TTL_S": "7"}
    options = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from aclnn_server.cli import build_parser; from aclnn_server.config "
            "import load_options; f = vars(build_parser().parse_args(sys.argv[1:])); c = f.pop('config'); "
            "print(load_options(f, c).model_dump_json())",
            "--config",
            str(config),
            "--executor-ttl-s",
            "8",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert '"max_queue":3' in options and '"max_executors":6' in options and '"executor_ttl_s":8.0' in options


def test_an_empty_environment_variable_is_unset():
    """ACLNN_UNIX_SOCKET= (a template's empty line) turned the socket off; empty means the default."""
    env = {**os.environ, "ACLNN_UNIX_SOCKET": "", "ACLNN_MAX_QUEUE": ""}
    code = "from aclnn_server.config import load_options; o = load_options({}); print(o.unix_socket, o.max_queue)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert done.stdout.split() == ["auto", "64"]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A file that is no PEM, an empty token file, and a plain file where a socket would go."""
    folder = tmp_path_factory.mktemp("bad")
    (folder / "junk.pem").write_text("not a certificate\n")
    (folder / "tokens").write_text("# no token here\n\n")
    (folder / "plain").write_text("")
    return folder


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "70000"], "--port 70000: Input should be less than or equal to 65535"),
        (["--host", "0.0.0.0"], "--host 0.0.0.0 is not loopback"),
        (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "--tls-cert /nonexistent.pem is not a"),
        (["--auth-token-file", "/nonexistent"], "--auth-token-file /nonexistent is not a readable file"),
        (["--tls-cert", "{bad}/junk.pem", "--tls-key", "{bad}/junk.pem"], "--tls-cert {bad}/junk.pem --tls-key {bad}/"),
        (["--config", "/dev/null/aclnn.toml"], "--config /dev/null/aclnn.toml is not a readable file"),
        (["--config", __file__], f"--config {__file__}:"),  # not TOML
        # Each once a traceback (OverflowError, "can't start new thread") or a setting gRPC rounds to 0 ms:
        (["--grace-period-s", "inf"], "--grace-period-s inf: Input should be a finite number"),
        (["--session-ttl-s", "nan"], "--session-ttl-s nan: Input should be a finite number"),
        (["--max-connection-age-s", "1e300"], "--max-connection-age-s 1e300: Input should be less than or equal"),
        (["--max-connection-age-s", "0.0001"], "--max-connection-age-s 0.0001: Input should be greater than or"),
        (["--max-queue", "1000000000000"], "--max-queue 1000000000000: Input should be less than or equal to 4096"),
        (["--max-concurrency", "100000"], "--max-concurrency 100000: Input should be less than or equal to 256"),
    ],
)
def test_invalid_configuration_is_a_clear_error(args, message, bad_files):
    args = [a.format(bad=bad_files) for a in args]
    result = subprocess.run([sys.executable, "-m", "aclnn_server", *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and message.format(bad=bad_files) in result.stderr, result.stderr


def test_a_client_ca_that_is_no_pem_is_named(bad_files):
    """--tls-client-ca is read at start too: a file of another kind is named, not reported as a failed bind."""
    from certs import make_certificates

    (bad_files / "certs").mkdir(exist_ok=True)
    certs = make_certificates(bad_files / "certs")
    tls = ["--tls-cert", str(certs.path("server-dns.pem")), "--tls-key", str(certs.path("server-dns.key"))]
    result = subprocess.run(
        [sys.executable, "-m", "aclnn_server", *tls, "--tls-client-ca", str(bad_files / "junk.pem")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and f"--tls-client-ca {bad_files}/junk.pem: not a PEM bundle" in result.stderr


def test_unknown_backend_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "aclnn_server", "--backend", "tpu"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and "invalid choice: 'tpu'" in result.stderr


def cannot_start(*args: str) -> str:
    """The error of a server that fails to start with these flags (exit status 1)."""
    result = subprocess.run(
        [sys.executable, "-m", "aclnn_server", "--backend", "numpy", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize("flag", ["--port", "--data-port", "--metrics-port"])
def test_a_port_in_use_is_named_with_its_flag(flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": "0", "--data-port": "0", "--metrics-port": "0", flag: str(port)}
        error = cannot_start(*[item for pair in ports.items() for item in pair])
    assert f"--host 127.0.0.1 {flag} {port}: " in error and "Address already in use" in error, error


def test_localhost_does_not_share_a_port_held_on_one_of_its_addresses():
    """--host localhost is 127.0.0.1 and ::1 to gRPC, which binds those it can and only logs the others:
    a server started while another process listened on [::1]:PORT took 127.0.0.1:PORT and shared the
    port with it (red-team finding). It now refuses to start, naming the address."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with socket.socket(socket.AF_INET6) as taken:
        try:
            taken.bind(("::1", 0))
        except OSError:
            pytest.skip("no ::1 here")
        taken.listen()
        port = taken.getsockname()[1]
        error = cannot_start("--host", "localhost", "--port", str(port))
    assert f"--host localhost --port {port}: port {port} of ::1 is another process's" in error, error


@pytest.mark.parametrize(
    "path,reason", [("/nonexistent/dir/x.sock", "No such file or directory"), ("{bad}/plain", "is not a socket")]
)
def test_an_unusable_unix_socket_path_is_named(bad_files, path, reason):
    path = path.format(bad=bad_files)
    error = cannot_start("--port", "0", "--unix-socket", path)
    assert f"--unix-socket {path}: " in error and reason in error, error


def test_a_token_file_without_tokens_is_named(bad_files):
    error = cannot_start("--port", "0", "--auth-token-file", str(bad_files / "tokens"))
    assert f"--auth-token-file {bad_files}/tokens: " in error and "holds no token" in error, error


def test_npu_backend_without_cann_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k not in ("ACLNN_CANN_LIB_DIR", "ASCEND_HOME_PATH")}
    result = subprocess.run(
        [sys.executable, "-m", "aclnn_server", "--backend", "npu", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1 and "--backend npu: " in result.stderr and "libascendcl.so" in result.stderr
