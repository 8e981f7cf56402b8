"""The `aclnn-serve` process: real process, real port, real signals."""

from __future__ import annotations

import os
import pathlib
import re
import signal
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


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "70000"], "--port: Input should be less than or equal to 65535"),
        (["--host", "0.0.0.0"], "not loopback"),
        (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "is not a readable file"),
        (["--config", "/dev/null/aclnn.toml"], "--config /dev/null/aclnn.toml is not a readable file"),
        (["--config", __file__], "--config"),  # not TOML
    ],
)
def test_invalid_configuration_is_a_clear_error(args, message):
    result = subprocess.run([sys.executable, "-m", "aclnn_server", *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_unknown_backend_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "aclnn_server", "--backend", "tpu"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and "invalid choice: 'tpu'" in result.stderr


def test_port_in_use_is_a_clear_error():
    proc, address = start()
    try:
        port = address.rsplit(":", 1)[1]
        result = subprocess.run(
            [sys.executable, "-m", "aclnn_server", "--port", port], capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 1 and "cannot" in result.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_npu_backend_without_cann_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k not in ("ACLNN_CANN_LIB_DIR", "ASCEND_HOME_PATH")}
    result = subprocess.run(
        [sys.executable, "-m", "aclnn_server", "--backend", "npu", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1 and "libascendcl.so" in result.stderr, result.stderr
