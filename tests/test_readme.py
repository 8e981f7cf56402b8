"""The README's client example runs as written against a live server and prints what it promises."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_block(after_heading: str, language: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(after_heading) :]
    return re.search(rf"```{language}\n(.*?)```", section, re.S)[1]


def test_client_example_prints_correct_results(server_address, tmp_path):
    example = readme_block("## Client example", "python").replace("127.0.0.1:50051", server_address)
    (tmp_path / "example.py").write_text(example)
    out = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    promised = readme_block("It prints:", "").strip().splitlines()
    lines = out.strip().splitlines()
    assert len(lines) == len(promised), out
    for line, expected in zip(lines, promised):
        assert re.fullmatch(re.escape(expected).replace(r"\.\.\.", r"\d+"), line), (line, expected)


def test_device_memory_example_runs_as_written(server_address):
    """docs/native.md's Python example: buffers on the server, a queued LayerNorm, the result copied back."""
    text = (ROOT / "docs" / "native.md").read_text()
    example = re.search(r"## From Python\n+```python\n(.*?)```", text, re.S)[1]
    namespace: dict = {}
    exec(compile(example.replace("127.0.0.1:50051", server_address), "docs/native.md", "exec"), namespace)
    x = namespace["x"].astype(np.float64)
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(namespace["y"], expected, rtol=1e-4, atol=1e-5)
