"""Compiles fake_cann.c and reads its test hooks.

The fake is one shared library installed under both of CANN's names: libascendcl.so is
the compiled file and libopapi.so a symlink to it, so the dynamic loader maps it once and
the runtime half (allocations, streams) and the opapi half (tensors, executors) share state,
as the two real libraries share the driver.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_cann.c")


def build(directory: Path) -> Path:
    """Compiles the fake into `directory` (libascendcl.so + libopapi.so); returns the directory."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) to build the fake CANN")
    directory.mkdir(parents=True, exist_ok=True)
    lib = directory / "libascendcl.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(lib), str(SOURCE), "-lm", "-lpthread"],
        check=True,
        capture_output=True,
        text=True,
    )
    opapi = directory / "libopapi.so"
    if not opapi.exists():
        opapi.symlink_to(lib.name)
    return directory


class FakeCann:
    """The fake's test hooks (fake_* functions) over the already loaded library."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.lib = ctypes.CDLL(str(directory / "libascendcl.so"), mode=ctypes.RTLD_GLOBAL)
        s, L = ctypes.c_char_p, ctypes.c_long
        for name, res, args in (
            ("fake_live", L, [s]),
            ("fake_created", L, [s]),
            ("fake_calls", L, [s]),
            ("fake_fail_next", None, [s, ctypes.c_int]),
            ("fake_fail_times", None, [s, ctypes.c_int, ctypes.c_int]),
            ("fake_queued", L, []),
            ("fake_misuse_count", L, []),
            ("fake_misuse_last", s, []),
            ("fake_log_read", ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
            ("fake_log_clear", None, []),
        ):
            f = getattr(self.lib, name)
            f.restype, f.argtypes = res, args

    def live(self, kind: str) -> int:
        """created - destroyed: tensor, intArray, boolArray, executor, stream, context, alloc, device, init."""
        return self.lib.fake_live(kind.encode())

    def created(self, kind: str) -> int:
        return self.lib.fake_created(kind.encode())

    def calls(self, function: str) -> int:
        return self.lib.fake_calls(function.encode())

    def fail_next(self, function: str, code: int, times: int = 1) -> None:
        self.lib.fake_fail_times(function.encode(), code, times)

    def queued(self) -> int:
        """Kernels launched on some stream and not yet run (they run when their stream is synchronized)."""
        return self.lib.fake_queued()

    @property
    def misuse(self) -> tuple[int, str]:
        return self.lib.fake_misuse_count(), (self.lib.fake_misuse_last() or b"").decode()

    def log(self) -> list[str]:
        n = self.lib.fake_log_read(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self.lib.fake_log_read(buf, n + 1)
        return buf.value.decode().splitlines()

    def clear_log(self) -> None:
        self.lib.fake_log_clear()

    def snapshot(self) -> dict[str, int]:
        kinds = ("tensor", "intArray", "boolArray", "executor", "stream", "context", "alloc", "device", "init")
        return {k: self.live(k) for k in kinds}
