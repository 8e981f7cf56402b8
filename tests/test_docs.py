"""The documentation that ships with the code: links resolve inside the repository, and the operator
reference (docs/operators.md) covers every registered operator, parameter by parameter, with null
checks in the order the server really makes them."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from aclnn_client import AclnnError, Client
from aclnn_server.ops import OPERATORS
from aclnn_server.params import Kind

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "operators.md"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(document):
    for target in LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not the repository's
        file, _, fragment = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        assert path.is_relative_to(ROOT), f"{document.name}: {target} leaves the repository"
        assert path.exists(), f"{document.name}: {target} does not exist"
        if fragment and path.suffix == ".md":
            assert fragment in anchors(path), f"{document.name}: {target} names no heading"


def section(name: str) -> str:
    """The reference's `## name` section, up to the next second-level heading."""
    text = REFERENCE.read_text()
    match = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/operators.md has no section '## {name}'"
    return match[1]


def subsection(name: str, title: str) -> str:
    match = re.search(rf"^### {title}\n(.*?)(?=^### |\Z)", section(name), re.M | re.S)
    assert match, f"{name}: no '### {title}'"
    return match[1]


def table_rows(text: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()]
    return [r for r in rows if len(r) > 2 and r[0] != "#" and not set("".join(r)) <= set("-")]  # no header, no rule


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_reference_lists_every_parameter_in_cann_order(name):
    documented = [re.sub(r"[`\s]", "", row[1]) for row in table_rows(subsection(name, "Parameters"))]
    assert documented == [p.name for p in OPERATORS[name].signature.params]


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_error_table_names_only_real_parameters(name):
    names = OPERATORS[name].signature.names
    rows = table_rows(subsection(name, "Errors, in the order they are checked"))
    assert rows, f"{name}: empty error table"
    for row in rows:
        assert row[1] in ("161001", "161002"), row
        assert set(re.findall(r"`(\w+)`", row[2])) <= names, row


# A value of each kind that passes the descriptor and null checks (not the operator's later rules).
SAMPLE = {
    Kind.TENSOR: lambda: np.zeros((2, 2), np.float32),
    Kind.INT_ARRAY: lambda: [2],
    Kind.BOOL_ARRAY: lambda: [True, True, True],
    Kind.BOOL: lambda: True,
    Kind.INT: lambda: 2,
    Kind.DOUBLE: lambda: 1e-5,
}


@pytest.fixture(scope="module")
def server(request):
    from aclnn_server import ServerOptions, create_server

    served, port, _ = create_server(ServerOptions(port=0, backend="numpy"))
    served.start()
    request.addfinalizer(lambda: served.stop(None))
    with Client(f"127.0.0.1:{port}") as client:
        yield client


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_documented_null_checks_come_in_the_documented_order(server, name):
    """Row 1 of each error table, as a caller reads it: leave out each listed parameter in turn."""
    first = table_rows(subsection(name, "Errors, in the order they are checked"))[0]
    assert first[1] == "161001"
    required = re.findall(r"`(\w+)`", first[2])
    signature = OPERATORS[name].signature
    for i, missing in enumerate(required):
        given = {p: SAMPLE[signature.spec(p).kind]() for p in required[:i]}
        with pytest.raises(AclnnError) as caught:
            server.get_workspace_size(name, **given)
        assert (caught.value.code, caught.value.param) == (161001, missing)


def test_the_create_tensor_examples_run():
    """The worked create_tensor examples (NHWC, a channel-first view tagged NHWC, 5-D) run as written."""
    text = subsection("Reading this reference", "Tensors with a format tag: `create_tensor`")
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(block, "docs/operators.md", "exec"), {})
