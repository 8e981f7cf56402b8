"""native/: CANN programs built unmodified against this project's headers and libraries, run on a server.

The seeds' three example programs (tests/native/examples, CANN's own sample code, byte for byte)
and programs of our own (tests/native/programs) are compiled with `g++ -std=c++17` and the
documented link line against an installed build of native/, run as processes against a server,
and their printed or written results checked against the float64 oracle. Without the toolchain
(cmake, g++, grpc++, protobuf) these tests skip, except under CI, which installs it (.ci/run).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle import BF16, assert_close
from test_processes import free_port, start_server

from aclnn_server import LocalClient
from aclnn_server.backends.npu.acl import APIS
from aclnn_server.ops import OPERATORS
from aclnn_server.params import Kind

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
BUILD = ROOT / "build" / "native"
EXAMPLES = Path(__file__).with_name("native") / "examples"
PROGRAMS = Path(__file__).with_name("native") / "programs"
# The headers INTERFACE.md names: every served aclnn operator (LayerNormGrad is a graph op, without one).
HEADERS = {
    "aclnn_layer_norm_backward.h",
    "aclnn_batch_norm_backward.h",
    "aclnn_batch_norm_elemt_backward.h",
    "aclnn_layer_norm.h",
    "aclnn_batch_norm.h",
    "aclnn_rms_norm.h",
    "aclnn_rms_norm_grad.h",
    "aclnn_group_norm.h",
    "aclnn_group_norm_backward.h",
    "aclnn_batch_norm_stats.h",
    "aclnn_batch_norm_gather_stats_with_counts.h",
    "aclnn_batch_norm_elemt.h",
    "aclnn_batch_norm_reduce_backward.h",
    "aclnn_batch_norm_backward_reduce.h",  # CANN's own name of the one above, which includes it
}


def _generator():
    spec = importlib.util.spec_from_file_location("native_generate", NATIVE / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prototype(header: str, function: str) -> list[tuple[str, str]]:
    """(C type, name) of each parameter of `function` in a header."""
    match = re.search(rf"aclnnStatus {function}\((.*?)\);", header, re.S)
    assert match, f"{function} is not declared"
    params = []
    for part in match.group(1).split(","):
        ctype, name = re.fullmatch(r"\s*(.*?)\s*(\w+)\s*", part).groups()
        params.append((" ".join(ctype.replace("*", " * ").split()), name))
    return params


def test_generated_headers_match_the_registry():
    """Every aclnn operator's header declares its Signature's parameters in order, with CANN's C types,
    and agrees with the NPU backend's independent binding of the real CANN (acl.APIS)."""
    generate = _generator()
    files = generate.outputs(generate.aclnn_operators())
    headers = {Path(path).name: text for path, text in files.items() if path.startswith("include/aclnnop/")}
    assert set(headers) == HEADERS
    kinds = {
        Kind.INT_ARRAY: "const aclIntArray *",
        Kind.BOOL_ARRAY: "const aclBoolArray *",
        Kind.BOOL: "bool",
        Kind.INT: "int64_t",
        Kind.DOUBLE: "double",
    }
    for name, operator in OPERATORS.items():
        if not name.startswith("aclnn"):
            continue
        header = headers[f"aclnn_{generate.snake_name(name)}.h"]
        declared = _prototype(header, f"{name}GetWorkspaceSize")
        expected = [
            (
                ("aclTensor *" if p.output or p.inout else "const aclTensor *")
                if p.kind is Kind.TENSOR
                else kinds[p.kind],
                p.name,
            )
            for p in operator.signature.params
        ]
        # CANN's own declarations where they break the rule (cann_signatures.cpp asserts them apart)
        for (op, param), const in generate.CANN_CONST.items():
            if op == name:
                expected = [
                    ("const aclTensor *" if const else "aclTensor *", n) if n == param else (t, n) for t, n in expected
                ]
        assert declared == [*expected, ("uint64_t *", "workspaceSize"), ("aclOpExecutor * *", "executor")], name
        npu = [(kind, param) for kind, param in APIS[name].params]
        assert [(p.kind.value, p.name) for p in operator.signature.params] == npu, name
        assert _prototype(header, name) == [
            ("void *", "workspace"),
            ("uint64_t", "workspaceSize"),
            ("aclOpExecutor *", "executor"),
            ("aclrtStream", "stream"),
        ]


# The build ---------------------------------------------------------------------------------------------


def _toolchain_missing() -> str | None:
    for tool in ("cmake", "g++", "pkg-config", "protoc", "grpc_cpp_plugin"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"], check=False).returncode:
        return "grpc++/protobuf development files are not installed"
    return None


@pytest.fixture(scope="session")
def native_prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """native/ built (incrementally, in build/native) and installed into a fresh prefix."""
    missing = _toolchain_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build native/: {missing} (.ci/run installs the Debian packages)")
        pytest.skip(f"native/ needs cmake, g++, grpc++ and protobuf: {missing}")
    prefix = tmp_path_factory.mktemp("prefix")
    for command in (
        ["cmake", "-S", str(NATIVE), "-B", str(BUILD), f"-DACLNN_PYTHON={sys.executable}"],
        ["cmake", "--build", str(BUILD), "-j2"],
        ["cmake", "--install", str(BUILD), "--prefix", str(prefix)],
    ):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return prefix


@pytest.fixture(scope="session")
def compiled(native_prefix: Path, tmp_path_factory: pytest.TempPathFactory):
    """Compiles a program as a CANN user would: g++ -std=c++17 and INTERFACE's link line."""
    out = tmp_path_factory.mktemp("programs")
    done: dict[Path, Path] = {}

    def build(source: Path) -> Path:
        if source not in done:
            exe = out / source.stem
            command = ["g++", "-std=c++17", str(source), "-I", str(native_prefix / "include"), "-L"]
            command += [str(native_prefix / "lib64"), "-lascendcl", "-lnnopbase", "-lopapi", "-o", str(exe)]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            assert result.returncode == 0, result.stderr[-3000:]
            done[source] = exe
        return done[source]

    return build


def run_program(prefix: Path, exe: Path, address: str, *args: str, timeout: float = 60) -> str:
    env = {**os.environ, "ACLNN_REMOTE_TARGET": address, "LD_LIBRARY_PATH": str(prefix / "lib64")}
    done = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{exe.name} exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def test_functions_have_canns_own_types(native_prefix, compiled):
    """A program passing const outputs to aclnnRmsNorm (valid against CANN's headers) did not compile: the
    headers followed one rule for every parameter (red-team finding). cann_signatures.cpp static_asserts
    CANN's types where they break it."""
    assert compiled(PROGRAMS / "cann_signatures.cpp").is_file()


def test_installed_headers_are_the_generated_ones(native_prefix: Path):
    generate = _generator()
    for path, text in generate.outputs(generate.aclnn_operators()).items():
        if path.startswith("include/"):
            assert (native_prefix / path).read_text() == text
    assert {p.name for p in (native_prefix / "include" / "aclnnop").iterdir()} == HEADERS
    assert {p.name for p in (native_prefix / "lib64").glob("*.so")} == {
        "libascendcl.so",
        "libnnopbase.so",
        "libopapi.so",
    }


# The seeds' example programs, unmodified -------------------------------------------------------------


def printed(output: str, label: str) -> np.ndarray:
    """The values a program printed as `<label>[i] is: <value>`, in order."""
    values = re.findall(rf"^{re.escape(label)}\[(\d+)\] is: (\S+)$", output, re.M)
    assert [int(i) for i, _ in values] == list(range(len(values))), output
    return np.array([float(v) for _, v in values], dtype=np.float32)


def assert_printed(got: np.ndarray, ref: torch.Tensor, name: str) -> None:
    """%f prints 6 decimals: half a unit of the last one on top of the fp32 tolerance."""
    ref = ref.reshape(-1).numpy()
    assert got.shape == ref.shape, (name, got, ref)
    bound = 1e-5 + 1e-4 * np.abs(ref).max() + 5e-7
    assert np.abs(got - ref).max() <= bound, f"{name}: printed {got}, expected {ref}"


def f64(values, shape=None) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t.reshape(shape) if shape is not None else t


def test_seed_layer_norm_backward_example(native_prefix, compiled, server_address):
    check_layer_norm_backward_example(
        run_program(native_prefix, compiled(EXAMPLES / "layer_norm_backward.cpp"), server_address)
    )


def check_layer_norm_backward_example(out: str) -> None:
    x = f64([2, 3, 4, 5], (2, 2))
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        x.clone(), x, [2], f64([2, 3], (2, 1)), f64([4, 5], (2, 1)), f64([1, 1]), f64([0, 0]), [True, True, True]
    )
    assert_printed(printed(out, "out result"), dx, "gradInput")
    assert_printed(printed(out, "dw result"), dw, "gradWeight")
    assert_printed(printed(out, "db result"), db, "gradBias")


def test_a_program_started_with_its_server_waits_in_set_device(native_prefix, compiled, fake, tmp_path):
    """A server whose NPU takes 3 s to come up listens at once, NOT_SERVING, and refuses calls as
    starting: the seed's program started then waits in aclrtSetDevice (saying so on stderr) and
    runs, as on a device still initializing (its first aclrtMalloc failed with 507000)."""
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aclnn_server", "--port", "0", "--backend", "npu", "--log-level", "INFO"],
            stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "FAKE_CANN_INIT_DELAY_MS": "3000"},
        )  # fmt: skip
    try:
        deadline, started = time.monotonic() + 60, None
        while started is None and time.monotonic() < deadline:
            started = re.search(r"started on (\S+?:\d+): NOT_SERVING", log.read_text())
            time.sleep(0.05)
        assert started, log.read_text()
        exe = compiled(EXAMPLES / "layer_norm_backward.cpp")
        env = {**os.environ, "ACLNN_REMOTE_TARGET": started[1], "LD_LIBRARY_PATH": str(native_prefix / "lib64")}
        hurried = {**env, "ACLNN_REMOTE_START_WAIT_S": "0.3"}  # a program that waits less gives up, saying why
        done = subprocess.run([str(exe)], env=hurried, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode != 0 and "aclrtSetDevice failed. ERROR: 507000" in done.stdout + done.stderr
        done = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "is starting (NOT_SERVING); waiting" in done.stderr
        check_layer_norm_backward_example(done.stdout)
    finally:
        proc.kill()
        proc.wait()


def test_seed_batch_norm_backward_example(native_prefix, compiled, server_address):
    out = run_program(native_prefix, compiled(EXAMPLES / "batch_norm_backward.cpp"), server_address)
    x = f64(range(8), (1, 2, 4))
    zeros, ones = f64([0, 0]), f64([1, 1])
    dx, _, _ = torch.ops.aten.native_batch_norm_backward(
        x.clone(), x, ones, zeros, ones, zeros, ones, True, 1e-5, [True, True, True]
    )
    assert_printed(printed(out, "result"), dx, "gradInput")


def test_seed_batch_norm_elemt_backward_example(native_prefix, compiled, server_address):
    out = run_program(native_prefix, compiled(EXAMPLES / "batch_norm_elemt_backward.cpp"), server_address)
    dy = x = f64(range(8), (1, 2, 4))
    mean, invstd, weight = f64([0, 0]), f64([1, 1]), f64([1, 1])
    sum_dy, sum_dy_xmu, total = f64([0, 0]), f64([1, 1]), 10.0  # counter {5, 5}
    per_channel = lambda t: t.reshape(1, 2, 1)  # noqa: E731
    dx = (dy - per_channel(sum_dy) / total - (x - per_channel(mean)) * per_channel(invstd**2 * sum_dy_xmu) / total) * (
        per_channel(invstd * weight)
    )
    assert_printed(printed(out, "result"), dx, "gradInput")


# Programs of our own ------------------------------------------------------------------------------------


def test_errors_return_the_servers_status_and_message(native_prefix, compiled, server_address):
    out = run_program(native_prefix, compiled(PROGRAMS / "errors.cpp"), server_address)
    cases = {line.split(" ", 2)[0]: (int(line.split(" ", 2)[1]), line.split(" ", 2)[2]) for line in out.splitlines()}
    assert cases["null_gradOut"][0] == 161001 and "gradOut" in cases["null_gradOut"][1]
    assert cases["bad_normalizedShape"][0] == 161002 and "normalizedShape" in cases["bad_normalizedShape"][1]
    assert cases["host_pointer"] == (161002, "gradOut: tensor data is not device memory (a pointer from aclrtMalloc)")
    assert cases["past_end"][0] == 161002 and cases["past_end"][1].startswith("gradOut")
    for ok in ("ok", "launch", "synchronize", "free_null", "free"):
        assert cases[ok] == (0, ""), ok
    assert cases["launch_null_executor"][0] == 161001
    for used_up in ("launch_consumed_executor", "repeatable_consumed_executor", "destroy_consumed_executor"):
        assert cases[used_up][0] == 161002 and cases[used_up][1].startswith("executor: not a live executor"), used_up
    assert cases["launch_on_destroyed_stream"][0] == 161002 and cases["launch_on_destroyed_stream"][1].startswith(
        "stream"
    )
    for ok in ("destroy_stream", "ok_again", "launch_after_refusal"):  # a refused launch leaves the executor usable
        assert cases[ok] == (0, ""), ok
    invalid = 100000  # ACL_ERROR_INVALID_PARAM: nothing was sent, nothing was dereferenced
    for refused in ("destroy_stream_again", "synchronize_destroyed_stream", "destroy_stale_stream"):
        assert cases[refused][0] == invalid and "not a live stream" in cases[refused][1], refused
    # handles are never reused: a stale one was taken for the newer one at its address (found by a C session)
    for ok in ("newer_stream_is_another", "newer_stream_lives", "launch_newer_executor"):
        assert cases[ok] == (0, ""), ok
    assert cases["launch_stale_executor"][0] == 161002 and "not a live executor" in cases["launch_stale_executor"][1]
    assert cases["set_destroyed_context_after_another"][0] == invalid
    # more than the server can hold is memory it lacks (CANN's answer, a program may try smaller); past any address,
    # a wrong argument
    assert cases["malloc_beyond_the_server"][0] == 207001 and cases["malloc_beyond_any_address"][0] == invalid
    assert cases["memcpy_nothing_to_null"] == (0, "")
    for refused in ("memcpy_host_as_device", "memcpy_device_as_host", "memcpy_past_end", "memcpy_count_over_destMax"):
        assert cases[refused][0] == invalid, refused
    assert cases["free_inside"][0] == cases["use_after_free"][0] == cases["malloc_zero"][0] == invalid
    assert cases["set_device_1"][0] == 107001  # ACL_ERROR_RT_INVALID_DEVICEID
    contexts_ok = ("get_context", "create_context", "created_is_current", "stream_in_created_context")
    for ok in (*contexts_ok, "set_default_context", "destroy_context", "run_mode", "run_mode_is_host"):
        assert cases[ok] == (0, ""), ok
    for refused in ("destroy_context_again", "destroy_default_context", "set_destroyed_context", "create_context_null"):
        assert cases[refused][0] == invalid, refused
    memcpy_kinds = ("to_device", "on_device", "to_host", "round_trip")
    for ok in (*(f"memcpy_default_{name}" for name in memcpy_kinds), "memcpy_buf_to_device"):
        assert cases[ok] == (0, ""), ok
    assert cases["memcpy_default_freed"][0] == cases["memcpy_kind_8"][0] == invalid
    assert cases["create_context_device_1"][0] == 107001
    # acl_base.h's codes, as CANN's acl_base.h and rt_error_codes.h give them
    cann = {
        "ACL_ERROR_INTERNAL_ERROR": 500000,
        "ACL_ERROR_INVALID_DEVICE": 200002,
        "ACL_ERROR_RT_INVALID_DEVICEID": 107001,
        "ACL_ERROR_RT_MEMORY_ALLOCATION": 207001,
        "ACL_ERROR_RT_INTERNAL_ERROR": 507000,
    }
    assert {name: cases[name][0] for name in cann} == cann


def test_argument_objects_read_back(native_prefix, compiled, tmp_path):
    """CANN's getters return what aclCreateTensor and the array constructors were given (the dims and
    strides as arrays the caller deletes), and refuse null arguments with 161001."""
    exe = compiled(PROGRAMS / "describe.cpp")
    env = {**os.environ, "LD_LIBRARY_PATH": str(native_prefix / "lib64")}
    done = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60, check=True)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines == {
        "view": "2 3 4",
        "strides": "1 2 6",
        "storage": "30",
        "offset": "5",
        "format": "47",  # ACL_FORMAT_NCL
        "dtype": "1",  # ACL_FLOAT16
        "array_sizes": "4 2 3",
        "scalar": "1",
        "scalar_of_no_value": "0",
        "scalar_of_a_string": "0",
        "null_tensor": "161001",
        "null_out": "161001",
        "null_array": "161001",
    }


def layer_norm_chain(x: np.ndarray, dy: np.ndarray, iterations: int) -> list[np.ndarray]:
    """The float64 oracle of chain.cpp: each step's y rounded to x's dtype, as stored, feeds the next."""
    dtype, cols = x.dtype, x.shape[1]
    w, b = torch.ones(cols, dtype=torch.float64), torch.zeros(cols, dtype=torch.float64)
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    current = x
    for _ in range(iterations):
        y, mean, rstd = torch.ops.aten.native_layer_norm(t(current), [cols], w, b, 1e-5)
        mean32, rstd32 = mean.numpy().astype(np.float32), rstd.numpy().astype(np.float32)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            t(dy), t(current), [cols], t(mean32), t(rstd32), w, b, [True, True, True]
        )
        current = y.numpy().astype(dtype)
    return [y, dx, dw, db]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("streams", [1, 2])
def test_chain_on_device_memory(native_prefix, compiled, server_address, tmp_path, dtype, streams):
    """LayerNorm forward + backward, three steps each reading the last one's output, on one allocation
    carved by pointer arithmetic; with two streams, the second reads x through a strided view."""
    check_chain(native_prefix, compiled, server_address, tmp_path, dtype, streams)


@pytest.mark.parametrize("streams", [1, 2])
def test_chain_on_the_npu_backend(native_prefix, compiled, npu_address, fake, tmp_path, streams):
    """The same program on a server whose NPU backend (on the fake CANN) keeps the buffers in NPU memory
    and queues the calls on ACL streams."""
    launched = fake.calls("aclnnLayerNorm")
    check_chain(native_prefix, compiled, npu_address, tmp_path, np.float32, streams)
    assert fake.calls("aclnnLayerNorm") == launched + 3 * streams


def test_chain_issued_from_threads(native_prefix, compiled, server_address, tmp_path):
    """Four threads of one program, each issuing its own stream's chain of eight steps at once: the
    library's connection, device addresses, executors and error messages are shared safely."""
    check_chain(native_prefix, compiled, server_address, tmp_path, np.float32, 4, iterations=8, threads=True)


def check_chain(
    native_prefix: Path,
    compiled,
    address: str,
    tmp_path: Path,
    dtype,
    streams: int,
    iterations: int = 3,
    threads: bool = False,
) -> None:
    rng = np.random.default_rng(7)
    rows, cols = 6, 40
    x = rng.uniform(-2, 2, (rows, cols)).astype(dtype)
    dy = rng.uniform(-2, 2, (rows, cols)).astype(dtype)
    (tmp_path / "shape").write_text(f"{rows} {cols}")
    x.tofile(tmp_path / "x.bin")
    dy.tofile(tmp_path / "dy.bin")
    code = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, BF16: 27}[np.dtype(dtype)]
    exe = compiled(PROGRAMS / "chain.cpp")
    args = [str(tmp_path), str(code), str(streams), str(iterations), *(["threads"] if threads else [])]
    run_program(native_prefix, exe, address, *args)
    reference = layer_norm_chain(x, dy, iterations)
    n = rows * cols
    for s in range(streams):
        raw = (tmp_path / f"out{s}.bin").read_bytes()
        item = np.dtype(dtype).itemsize
        y = np.frombuffer(raw[: n * item], dtype).reshape(rows, cols)
        dx = np.frombuffer(raw[n * item : 2 * n * item], dtype).reshape(rows, cols)
        dw = np.frombuffer(raw[2 * n * item : 2 * n * item + 4 * cols], np.float32)
        db = np.frombuffer(raw[2 * n * item + 4 * cols :], np.float32)
        for name, got, ref in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), reference):
            assert_close(got, ref, f"stream {s} {name}")


def test_events_order_two_streams(native_prefix, compiled, server_address, tmp_path):
    """Stream B waits for an event recorded on stream A after a chain of LayerNorms, then RmsNorms A's
    output: B reads what A wrote. The event calls answer as CANN's do; handles past their end are refused."""
    check_events(native_prefix, compiled, server_address, tmp_path)


def test_events_on_the_npu_backend(native_prefix, compiled, npu_address, fake, tmp_path):
    """The same on the NPU backend (the fake CANN runs a kernel only when its ACL stream is synchronized)."""
    launched = fake.calls("aclnnLayerNorm")
    check_events(native_prefix, compiled, npu_address, tmp_path)
    assert fake.calls("aclnnLayerNorm") == launched + 6 + 3


def test_event_and_timeout_failures_on_the_npu_backend(native_prefix, compiled, npu_address, fake, tmp_path):
    """Two LayerNorm kernels fail while they run (a device fault): the first is found by a synchronize that
    timed out and is reported by the stream's next synchronize, not lost; the second is reported by the
    event's wait, once, and the event stays failed (not known complete) until it is recorded again."""
    rows, cols = 4, 32
    (tmp_path / "shape").write_text(f"{rows} {cols} 1")
    np.ones((rows, cols), np.float32).tofile(tmp_path / "x.bin")
    np.ones(cols, np.float32).tofile(tmp_path / "gamma.bin")
    fake.fail_next("kernel:aclnnLayerNorm", 507015, times=2)  # ACL_ERROR_RT_AICORE_EXCEPTION
    out = run_program(native_prefix, compiled(PROGRAMS / "events.cpp"), npu_address, str(tmp_path), "faults")
    cases = {name: (int(code), message) for name, code, message in (line.split(" ", 2) for line in out.splitlines())}
    assert cases["fault_no_wait"][0] == 507046  # ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    for failed in ("fault_kept_for_next_wait", "fault_event_synchronize", "fault_event_stays_failed"):
        assert cases[failed][0] == 361001 and "507015" in cases[failed][1], (failed, cases[failed])
    assert "while it was pending" in cases["fault_event_stays_failed"][1]
    for ok in ("fault_reported_once", "fault_stream_after_event", "fault_query", "fault_query_not_ready"):
        assert cases[ok] == (0, ""), (ok, cases[ok])
    for ok in ("fault_record_again", "fault_synchronize_again", "fault_query_again", "fault_complete_again"):
        assert cases[ok] == (0, ""), (ok, cases[ok])


def check_events(native_prefix: Path, compiled, address: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    rows, cols, steps = 256, 2048, 6
    x = rng.uniform(-2, 2, (rows, cols)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    (tmp_path / "shape").write_text(f"{rows} {cols} {steps}")
    x.tofile(tmp_path / "x.bin")
    gamma.tofile(tmp_path / "gamma.bin")
    out = run_program(native_prefix, compiled(PROGRAMS / "events.cpp"), address, str(tmp_path))
    cases = {name: (int(code), message) for name, code, message in (line.split(" ", 2) for line in out.splitlines())}

    # the float64 oracle: each LayerNorm's output rounded to float32, as stored, feeds the next
    w, b = torch.ones(cols, dtype=torch.float64), torch.zeros(cols, dtype=torch.float64)
    current = x
    for _ in range(steps):
        y, _, _ = torch.ops.aten.native_layer_norm(torch.from_numpy(current.astype(np.float64)), [cols], w, b, 1e-5)
        current = y.numpy().astype(np.float32)
    y64 = torch.from_numpy(current.astype(np.float64))
    z = y64 * torch.rsqrt(y64.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.from_numpy(gamma.astype(np.float64))
    assert_close(np.fromfile(tmp_path / "y.bin", np.float32).reshape(rows, cols), y, "y (stream A)")
    assert_close(np.fromfile(tmp_path / "z.bin", np.float32).reshape(rows, cols), z, "z (stream B, after the wait)")

    ok = (
        *("query_unrecorded", "unrecorded_not_ready", "record", "stream_wait", "synchronize_event"),
        *("query_after_synchronize", "complete_after_synchronize", "synchronize_b_with_timeout"),
        *("create_with_flags", "record_again", "query_polled", "polled_complete", "stream_polled_with_timeout_0"),
        *("synchronize_event_with_timeout", "synchronize_event_for_ever", "reset", "query_after_reset"),
        *("reset_not_ready", "synchronize_reset_event", "synchronize_stream_with_timeout"),
        *("synchronize_stream_for_ever", "synchronize_default_stream_with_timeout"),
        *("destroy", "create_after_destroy", "newer_event_is_another", "destroy_newer", "destroy_timed"),
    )
    for name in ok:
        assert cases[name] == (0, ""), (name, cases[name])
    assert cases["elapsed_time"][0] == 207000  # ACL_ERROR_RT_FEATURE_NOT_SUPPORT: no device timestamps
    assert "timestamps" in cases["elapsed_time"][1]
    assert cases["synchronize_stream_no_wait"][0] == 507046  # ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    for name in ("synchronize_stream_timeout_below_minus_1", "synchronize_event_timeout_below_minus_1"):
        assert cases[name][0] == 107000 and "-1" in cases[name][1], name  # ACL_ERROR_RT_PARAM_INVALID, as CANN's
    invalid = 100000  # ACL_ERROR_INVALID_PARAM: nothing sent, nothing dereferenced
    nulls = ("create_null", "create_with_flag_null", "record_null", "query_null_status", "query_null_event")
    for name in (*nulls, "synchronize_null", "stream_wait_null", "elapsed_null_ms", "destroy_null"):
        assert cases[name][0] == invalid and "null" in cases[name][1], (name, cases[name])
    assert cases["create_unknown_flag"][0] == invalid
    stale = ("record_unknown", "synchronize_stream_as_event", "destroy_unknown", "destroy_again", "record_destroyed")
    destroyed = ("query_destroyed", "synchronize_destroyed", "synchronize_destroyed_with_timeout")
    for name in (*stale, *destroyed, "stream_wait_destroyed", "reset_destroyed", "elapsed_destroyed"):
        assert cases[name][0] == invalid and "not a live event" in cases[name][1], (name, cases[name])
    on_ended = ("record_on_destroyed_stream", "stream_wait_on_destroyed_stream", "reset_on_destroyed_stream")
    for name in (*on_ended, "synchronize_destroyed_stream_with_timeout"):
        assert cases[name][0] == invalid and "not a live stream" in cases[name][1], (name, cases[name])


def test_every_parameter_kind(native_prefix, compiled, server_address, tmp_path, rng):
    """int64_t, double and bool scalars, an aclBoolArray, in/out tensors and null optional outputs
    reach the server as the Python client's would send them: GroupNorm and its backward, BatchNorm
    (training, running statistics updated), BatchNormReduceBackward and RmsNorm from a C program,
    against the same calls in process."""
    values = rng.uniform(-2, 2, 64).astype(np.float32)
    values[24:32] = rng.uniform(0.5, 1.5, 8)  # gamma/weight, beta/bias
    values.tofile(tmp_path / "in.bin")
    run_program(native_prefix, compiled(PROGRAMS / "every_kind.cpp"), server_address, str(tmp_path))
    v = values.astype(np.float32)
    zeros = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    gn = dict(self=v[:24].reshape(2, 4, 3), gamma=v[24:28], beta=v[28:32], N=2, C=4, HxW=3, group=2, eps=1e-5,
              out=zeros(2, 4, 3), meanOut=zeros(2, 2), rstdOut=zeros(2, 2))  # fmt: skip
    gnb = dict(gradOut=v[32:56].reshape(2, 4, 3), input=gn["self"], mean=gn["meanOut"], rstd=gn["rstdOut"],
               gamma=gn["gamma"], N=2, C=4, HxW=3, group=2, outputMask=[True, False, True],
               gradInput=zeros(2, 4, 3), gradGammaOut=None, gradBetaOut=zeros(4))  # fmt: skip
    bn = dict(input=v[:12].reshape(3, 2, 2), weight=v[24:26], bias=v[28:30], runningMean=zeros(2),
              runningVar=np.ones(2, np.float32), training=True, momentum=0.25, eps=1e-5, output=zeros(3, 2, 2),
              saveMean=zeros(2), saveInvstd=zeros(2))  # fmt: skip
    rb = dict(gradOut=v[32:44].reshape(3, 2, 2), input=bn["input"], mean=bn["saveMean"], invstd=bn["saveInvstd"],
              weight=bn["weight"], inputG=True, weightG=False, biasG=True, sumDy=zeros(2), sumDyXmu=zeros(2),
              gradWeight=None, gradBias=zeros(2))  # fmt: skip
    rms = dict(x=v[:12].reshape(3, 4), gamma=v[24:28], epsilon=1e-6, yOut=zeros(3, 4), rstdOut=zeros(3, 1))
    calls = [
        ("group_norm", "aclnnGroupNorm", gn, ("out", "meanOut", "rstdOut")),
        ("group_norm_backward", "aclnnGroupNormBackward", gnb, ("gradInput", "gradBetaOut")),
        ("batch_norm", "aclnnBatchNorm", bn, ("output", "saveMean", "saveInvstd", "runningMean", "runningVar")),
        ("batch_norm_reduce_backward", "aclnnBatchNormReduceBackward", rb, ("sumDy", "sumDyXmu", "gradBias")),
        ("rms_norm", "aclnnRmsNorm", rms, ("yOut", "rstdOut")),
    ]
    with LocalClient("numpy") as local:
        for stem, op, p, outputs in calls:
            local.run(op, **p)
            for name in outputs:
                got = np.fromfile(tmp_path / f"{stem}.{name}.bin", np.float32).reshape(p[name].shape)
                assert_close(got, p[name], f"{op} {name}")


def test_a_program_carries_on_across_a_server_restart(native_prefix, compiled):
    """A call while the server is away fails within about a second (ACL_ERROR_RT_INTERNAL_ERROR); the first
    call once it is back on its port succeeds: gRPC's growing reconnection backoff kept calls failing for
    10 s after a 5 s outage (found by a C session)."""
    port = free_port()
    server, address = start_server("--port", str(port))
    env = {**os.environ, "ACLNN_REMOTE_TARGET": address, "LD_LIBRARY_PATH": str(native_prefix / "lib64")}
    program = subprocess.Popen(
        [str(compiled(PROGRAMS / "restart.cpp"))], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert program.stdout.readline() == "allocated\n"
        server.kill()
        server.wait()
        for _ in range(4):  # calls while it is away, over some seconds of gRPC's backoff
            program.stdin.write("d\n")
            program.stdin.flush()
            code, took = program.stdout.readline().split()[1:]
            assert int(code) == 507000 and float(took) < 3
            time.sleep(1)
        server, _ = start_server("--port", str(port))
        program.stdin.write("u\n")
        program.stdin.flush()
        code, took = program.stdout.readline().split()[1:]
        assert int(code) == 0 and float(took) < 2
        assert program.wait(timeout=30) == 0
    finally:
        program.kill()
        server.kill()
        program.wait()
        server.wait()


def test_a_process_that_exits_without_freeing_leaves_nothing(native_prefix, compiled, serve):
    served = serve(session_ttl_s=1.0)
    out = run_program(native_prefix, compiled(PROGRAMS / "leak.cpp"), served.address)
    assert out.strip() == "allocated 3"
    assert len(served.engine.buffers) == 3
    assert served.engine.ledger.held_by_kind().get("buffer", 0) >= 3 << 20
    deadline = time.monotonic() + 10
    while len(served.engine.buffers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(served.engine.buffers) == 0
    assert served.engine.ledger.held_by_kind().get("buffer", 0) == 0


def test_an_idle_program_keeps_its_memory_on_a_server_with_a_short_lease(native_prefix, compiled, serve):
    """The library renewed its session every 10 s, whatever the server's --session-ttl-s: an idle program
    lost its buffers to a shorter lease. It renews within a third of the lease the server states."""
    served = serve(session_ttl_s=0.6)
    out = run_program(native_prefix, compiled(PROGRAMS / "idle.cpp"), served.address, "3")
    assert out.strip() == "kept 0 7"


def test_example_sources_are_the_seeds_blocks():
    """The examples stay CANN's sample code as published: each is the last C++ block of its seed, byte for byte."""
    seeds = next((p / "shared" / "seeds" for p in ROOT.parents if (p / "shared" / "seeds").is_dir()), None)
    if seeds is None:
        pytest.skip("shared/seeds is not beside this checkout")
    for stem, prefix in (
        ("layer_norm_backward", "000_"),
        ("batch_norm_backward", "001_"),
        ("batch_norm_elemt_backward", "002_"),
    ):
        raw = next(seeds.glob(f"{prefix}*.txt")).read_bytes()
        start = raw.rindex(b"```Cpp\n") + len(b"```Cpp\n")
        assert (EXAMPLES / f"{stem}.cpp").read_bytes() == raw[start : raw.index(b"```", start)]


def test_a_refusal_whose_status_is_no_failure_code_is_still_a_failure(native_prefix, compiled):
    """A lying or broken server refuses GetWorkspaceSize with ErrorInfo status "0" (or "abc"): the call
    fails (561000-class runtime error) and leaves workspaceSize and executor as they were; it returned 0,
    and a program would launch a stale executor with a garbage workspace."""
    from concurrent import futures

    import grpc
    from google.protobuf import any_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    from aclnn_common._proto import aclnn_pb2 as pb

    def refused(given: str):
        def plan(request: bytes, context: grpc.ServicerContext) -> bytes:
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.ErrorInfo(domain="aclnn", reason="X", metadata={"status": given}))
            status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="refused", details=[detail])
            context.abort_with_status(rpc_status.to_status(status))

        return plan

    exe = compiled(PROGRAMS / "refused_plan.cpp")
    for given in ("0", "abc", "-5"):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        handlers = {
            "MallocBuffer": lambda request, context: pb.BufferInfo(buffer="b1", size=64).SerializeToString(),
            "GetWorkspaceSize": refused(given),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("aclnn.v1.Aclnn", {
            name: grpc.unary_unary_rpc_method_handler(handler) for name, handler in handlers.items()
        }),))  # fmt: skip
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            status, workspace, untouched = run_program(native_prefix, exe, f"127.0.0.1:{port}").split()
        finally:
            server.stop(None)
        assert int(status) != 0 and workspace == "12345" and untouched == "1", (given, status, workspace)


def test_host_memory_and_frees_not_the_programs_to_make(native_prefix, compiled, server_address):
    """aclrtMallocHost(SIZE_MAX - 10) rounded its size up past zero and gave a 1-byte block (heap
    corruption on the first write); aclrtFreeHost of a device pointer was free() of it (a crash); a free
    refused because another thread's free of the same pointer came first forgot the allocation that
    reused the address in between (its buffer then held on the server): red-team findings."""
    out = run_program(native_prefix, compiled(PROGRAMS / "host_memory.cpp"), server_address, "60")
    codes = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert int(codes["mallochost_huge"]) == 200000  # ACL_ERROR_BAD_ALLOC
    for case in ("freehost_device", "freehost_inside", "freehost_again", "freehost_null"):
        assert int(codes[case]) == 100000, case  # ACL_ERROR_INVALID_PARAM
    assert int(codes["freehost"]) == 0 and int(codes["device_still_usable"]) == 0
    one_free, lost = (int(n) for n in codes["race"].split())
    assert lost == 0, f"{lost} of {one_free} refused frees took another allocation with them"


@pytest.mark.parametrize(
    "setting,value,named",
    [
        ("ACLNN_REMOTE_TOKEN_FILE", "tab\tinside", "not printable ASCII"),
        ("ACLNN_REMOTE_TOKEN_FILE", "caf\xe9", "not printable ASCII"),
        ("ACLNN_REMOTE_TOKEN_FILE", "\n", "no token read"),
        ("ACLNN_REMOTE_TOKEN_FILE", None, "no token read"),  # a file that is not there
        ("ACLNN_REMOTE_ROOT_CERTS", None, "no certificates read"),
        ("ACLNN_REMOTE_PING_S", "abc", "not a number of seconds"),
        ("ACLNN_REMOTE_START_WAIT_S", "nan", "not a number of seconds"),
        ("ACLNN_REMOTE_START_WAIT_S", "-5", "not a number of seconds"),
    ],
)
def test_a_setting_that_cannot_be_used_fails_init_or_set_device(
    native_prefix, compiled, server_address, tmp_path, setting, value, named
):
    """A token file holding a tab or a non-ASCII byte aborted the process inside gRPC at the first call;
    ACLNN_REMOTE_START_WAIT_S=nan waited forever, and a token or CA file that does not read went unsaid:
    now aclInit or aclrtSetDevice fails with ACL_ERROR_INVALID_PARAM and a message naming the setting."""
    if setting in ("ACLNN_REMOTE_TOKEN_FILE", "ACLNN_REMOTE_ROOT_CERTS"):
        path = tmp_path / "setting"
        if value is not None:
            path.write_bytes(value.encode("latin-1"))
        value = str(path)
    env = {**os.environ, "ACLNN_REMOTE_TARGET": server_address, "LD_LIBRARY_PATH": str(native_prefix / "lib64")}
    done = subprocess.run(
        [str(compiled(PROGRAMS / "config.cpp"))],
        env={**env, setting: value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    init, device = done.stdout.splitlines()
    failed = init if setting != "ACLNN_REMOTE_START_WAIT_S" else device
    assert failed.startswith(("init 100000 ", "set_device 100000 ")) and setting in failed and named in failed, failed


@pytest.mark.slow  # the Python client's reconnection waits out gRPC's 20 s connection attempt once
def test_a_server_that_stops_answering_fails_the_call_instead_of_hanging(native_prefix, compiled):
    """A server whose process is stopped (as one whose host is gone or cut off: TCP's own end never comes)
    left a call waiting forever, in a CANN program and in a Python client without a timeout. HTTP/2
    pings while a call is open now fail it (here every second, ACLNN_REMOTE_PING_S and gRPC's channel
    options; 30 s by default); once the server runs again, the next call succeeds."""
    import threading

    from aclnn_client import AclnnError, Client

    server, address = start_server()
    env = {**os.environ, "ACLNN_REMOTE_TARGET": address, "LD_LIBRARY_PATH": str(native_prefix / "lib64")}
    program = subprocess.Popen(
        [str(compiled(PROGRAMS / "restart.cpp"))],
        env={**env, "ACLNN_REMOTE_PING_S": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pings = [
        ("grpc.keepalive_time_ms", 1000),
        ("grpc.keepalive_timeout_ms", 1000),
        ("grpc.http2.ping_timeout_ms", 1000),
    ]
    client = Client(address, data_channel=False, options=pings)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8), dtype=np.float32)
    call = dict(gradOut=x, input=x, normalizedShape=[8], mean=np.zeros((4, 1), np.float32),
                rstd=np.ones((4, 1), np.float32), outputMask=[True, False, False])  # fmt: skip
    try:
        assert program.stdout.readline() == "allocated\n"
        client.run("aclnnLayerNormBackward", **call, gradInputOut=np.empty_like(x))
        server.send_signal(signal.SIGSTOP)
        failure: list[BaseException] = []

        def python_call() -> None:
            try:
                client.run("aclnnLayerNormBackward", **call, gradInputOut=np.empty_like(x))
            except AclnnError as exc:
                failure.append(exc)

        started = time.monotonic()
        caller = threading.Thread(target=python_call, daemon=True)
        caller.start()
        program.stdin.write("d\n")
        program.stdin.flush()
        code, took = program.stdout.readline().split()[1:]
        assert int(code) == 507000 and float(took) < 10, (code, took)
        caller.join(60)
        assert not caller.is_alive(), "the Python client's call still waits"
        assert failure and "UNAVAILABLE" in str(failure[0]), failure
        assert time.monotonic() - started < 60
        server.send_signal(signal.SIGCONT)
        program.stdin.write("u\n")
        program.stdin.flush()
        code, _ = program.stdout.readline().split()[1:]
        assert int(code) == 0
        assert program.wait(timeout=30) == 0
        client.run("aclnnLayerNormBackward", **call, gradInputOut=np.empty_like(x))
    finally:
        client.close()
        server.send_signal(signal.SIGCONT)
        for proc in (program, server):
            proc.kill()
            proc.wait()
