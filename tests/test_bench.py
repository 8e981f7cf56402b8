"""bench/transport.py's sweep report: its table, its plot and its turn order, on made-up timings
(the benchmark itself is run by hand; see bench/README.md); and bench/gpu.py's dry run on the cpu."""

from __future__ import annotations

import collections
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def transport():
    sys.path.insert(0, str(BENCH))  # transport.py imports its sibling modules by name
    try:
        spec = importlib.util.spec_from_file_location("bench_transport", BENCH / "transport.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def made_up(transport) -> dict[int, dict[str, list[float]]]:
    """Per size, each path's times: path k takes (k + 1) ms per 64 KiB, PyTorch RPC over TCP 10 ms."""
    labels = [transport.RPC, transport.RPC_TCP, *transport.SWEEP_PATHS]
    results = {}
    for nbytes in transport.SWEEP_SIZES[:3]:
        scale = nbytes / (64 << 10)
        results[nbytes] = {label: [1e-3 * (k + 1) * scale] * 3 for k, label in enumerate(labels)}
        results[nbytes][transport.RPC_TCP] = [1e-2 * scale] * 3
    return results


def test_the_table_has_each_path_and_tcp_against_tcp(transport):
    lines = transport.sweep_table(made_up(transport)).splitlines()
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert head[1:3] == [f"{transport.RPC} ms", f"{transport.RPC_TCP} ms"]
    assert head[-1] == "data channel over TCP / PyTorch RPC over TCP"
    first = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert first[0] == "64 KiB"
    # TCP is the 6th label (6 ms at 64 KiB): 6x PyTorch RPC (1 ms), 0.6x PyTorch RPC over TCP (10 ms)
    assert first[-2:] == ["6.00x", "0.60x"]


def test_the_plot_is_written_where_asked(transport, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "plots" / "sweep.png"
    target.parent.mkdir()
    transport.sweep_plot(made_up(transport), str(target), "made-up timings")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plots"]  # nothing else written


@pytest.mark.parametrize("paths", [6, 7])
def test_turns_follow_each_path_after_every_other_equally(transport, paths):
    labels = [f"path {k}" for k in range(paths)]
    turns = 2 * paths if paths % 2 else paths  # a Williams design's length
    pairs = collections.Counter()
    for turn in range(turns):
        order = transport.in_turns(labels, turn)
        assert sorted(order) == labels
        pairs.update(itertools.pairwise(order))
    assert set(pairs.values()) == {turns // paths}
    assert len(pairs) == paths * (paths - 1)


def test_the_gpu_script_runs_dry_on_the_cpu(tmp_path):
    """bench/gpu.py runs where a GPU is lent for minutes: its dry run here (torch's cpu device, two
    local server processes) must reach every timing, with results the float64 oracle accepts."""
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), "--device", "cpu", "--rows", "64", "--cols", "96",
         "--rounds", "1", "--skip-tests", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "results.json").read_text())
    timings = report["timings_ms"]
    for row in ("in process, the first call", "kernel alone: the torch-op formula (ACLNN_TORCH_FUSED=0)",
                "device buffers, local server (run + synchronize)",
                "device buffers, local server, torch-op formula (run without a stream)",
                "one round trip, local server (synchronize an idle stream)"):  # fmt: skip
        assert timings[row] > 0, row
    errors = {name: value for name, value in timings.items() if name.startswith("relative error")}
    assert len(errors) == 4 and max(errors.values()) < 1e-5, errors
