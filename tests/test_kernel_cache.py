"""The cpu kernels' disk cache: keyed by what decides their machine code (their sources, Numba's, llvmlite's
and Python's versions; Numba's index adds the CPU), never by where the package is installed; folders of
other code versions are pruned."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from aclnn_server.backends import cpu
from aclnn_server.backends.cpu import _jit

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Run in a fresh interpreter with the packages copied to SITE first on the path: where they load from,
# the cache key and folder, and what the kernels' warm-up loaded and compiled.
_REPORT = """
import sys
sys.path.insert(0, sys.argv[1])
import aclnn_server
from aclnn_server.backends.cpu import _jit, warm_up
warm_up()
print(aclnn_server.__file__, _jit.cache_key(), _jit.configure_cache(), *_jit.compile_counts())
"""


def install_copy(site: pathlib.Path) -> pathlib.Path:
    """The packages as a regular install lays them out (aclnn_server/, aclnn_client/), with fresh mtimes."""
    for source, package in (("server", "aclnn_server"), ("client", "aclnn_client")):
        shutil.copytree(
            ROOT / source, site / package, copy_function=shutil.copy, ignore=shutil.ignore_patterns("__pycache__")
        )
    return site


def report(site: pathlib.Path) -> tuple[str, str, str, int, int]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", _REPORT, str(site)], capture_output=True, text=True, check=True, env=env, cwd=site
    ).stdout.split()
    return out[0], out[1], out[2], int(out[3]), int(out[4])


def test_another_install_of_the_same_code_loads_every_kernel_from_the_cache(tmp_path):
    """An editable install (this checkout) and a regular one elsewhere share one cache folder: the second
    compiles nothing (the session's start filled the cache for this checkout)."""
    cpu.warm_up()
    site = install_copy(tmp_path / "site")
    copied = site / "aclnn_server" / "backends" / "cpu" / "_jit.py"
    assert copied.stat().st_mtime != pathlib.Path(_jit.__file__).stat().st_mtime
    location, key, folder, loaded, compiled = report(site)
    assert location == str(site / "aclnn_server" / "__init__.py")
    assert (key, folder) == (_jit.cache_key(), _jit.configure_cache())
    assert loaded > 0 and compiled == 0


def test_the_key_follows_the_kernels_sources_not_their_path(tmp_path):
    """The same sources anywhere: one key; a changed kernel module or helper: another."""
    key = _jit.cache_key()
    kernel_dir = install_copy(tmp_path / "site") / "aclnn_server" / "backends" / "cpu"
    probe = "import sys; sys.path.insert(0, sys.argv[1]); from aclnn_server.backends.cpu import _jit; "
    probe += "print(_jit.cache_key())"

    def key_of(site: pathlib.Path) -> str:
        result = subprocess.run([sys.executable, "-c", probe, str(site)], capture_output=True, text=True, check=True)
        return result.stdout

    assert key_of(tmp_path / "site").strip() == key
    with (kernel_dir / "_reduce.py").open("a") as helper:
        helper.write("\n# a changed helper changes every kernel that inlines it\n")
    assert key_of(tmp_path / "site").strip() != key


def test_the_cache_lives_under_numba_cache_dir_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert _jit.cache_root() == tmp_path / "aclnn-serve"
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _jit.cache_root() == tmp_path / "xdg" / "aclnn-serve" / "numba"


def test_folders_of_other_versions_are_pruned(tmp_path):
    """Kept: the folder in use, and the CACHE_KEEP - 1 most recently used others not idle for
    CACHE_MAX_IDLE_S; anything not named like a key is left alone."""
    now = time.time()

    def folder(name: str, age_s: float) -> pathlib.Path:
        path = tmp_path / name
        path.mkdir()
        (path / "kernel.nbi").write_bytes(b"")
        os.utime(path, (now - age_s, now - age_s))
        return path

    current = folder("0" * 16, 10 * 24 * 3600)  # in use, however old its last touch
    recent = [folder(f"{i:016x}", 60 * (i + 1)) for i in range(1, _jit.CACHE_KEEP + 2)]
    idle = folder("f" * 16, _jit.CACHE_MAX_IDLE_S + 60)
    unrelated = folder("not-a-cache-key", _jit.CACHE_MAX_IDLE_S + 60)
    removed = _jit.prune_cache(tmp_path, current)
    assert sorted(removed) == sorted([*recent[_jit.CACHE_KEEP - 1 :], idle])
    assert sorted(p for p in tmp_path.iterdir()) == sorted([current, *recent[: _jit.CACHE_KEEP - 1], unrelated])


@pytest.mark.parametrize("module", ["rms_norm", "batch_norm"])
def test_kernels_are_indexed_under_the_key_folder(module):
    """Numba's index files of this package's kernels are in the key's folder, named by module and kernel."""
    cpu.warm_up()
    folder = pathlib.Path(_jit.configure_cache())
    assert folder.name == _jit.cache_key()
    assert list(folder.glob(f"{module}.*.nbi"))
    assert _jit.cache_is_warm()
