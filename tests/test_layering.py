"""The house's layering, drawn from the code: no import circles, and the shared vocabulary below both sides."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"aclnn_common": ROOT / "common", "aclnn_client": ROOT / "client", "aclnn_server": ROOT / "server"}


def _module_name(package: str, directory: pathlib.Path, path: pathlib.Path) -> str:
    parts = [package, *path.relative_to(directory).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {
        _module_name(package, directory, path): path
        for package, directory in PACKAGES.items()
        for path in directory.rglob("*.py")
        if "_proto" not in path.parts
    }


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every project module `name` imports, TYPE_CHECKING blocks and function-level imports included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle among modules (package __init__s, which only re-export, left out), or None."""
    graph = {n: {t for t in ts if t not in PACKAGES} for n, ts in graph.items() if n not in PACKAGES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circles():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("aclnn_common", ("aclnn_client", "aclnn_server")),
        ("aclnn_server", ("aclnn_client",)),
        ("aclnn_client", ("aclnn_server",)),
    ],
)
def test_packages_import_only_what_lies_below_them(package, forbidden):
    """The shared vocabulary needs nobody; the server and the client share only it."""
    offenders = {
        name: sorted(t for t in targets if t.split(".")[0] in forbidden)
        for name, targets in _graph().items()
        if name.split(".")[0] == package
    }
    assert {name: t for name, t in offenders.items() if t} == {}


def test_client_import_stays_light():
    """`import aclnn_client` (and the shared package) pulls in neither torch, the server, nor Numba."""
    code = (
        "import sys, aclnn_client, aclnn_common.wire, aclnn_common.framing;"
        "print(sorted(m for m in ('torch', 'numba', 'aclnn_server', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
