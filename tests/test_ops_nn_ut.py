"""CANN's own aclnn unit-test cases, replayed: each GetWorkspaceSize a Huawei UT expects a status from
gets that status class here too.

Huawei's operator repositories (hicann/ops-nn norm/ and experimental/norm/, hicann/ops-math for
aclnnBatchNormStats) carry gtest UTs of the aclnn API: a test describes tensors, calls the
operator's GetWorkspaceSize and expects success, 161001 (a null parameter) or 161002 (an invalid
one). tests/data/make_ops_nn_ut_cases.py reads those UTs at pinned commits and writes each checked
call, in structured form with its source (repository, commit, file, test name, SoC assumed), to
tests/data/ops_nn_ut_cases.json; LayerNormGrad's graph-level infer-shape UTs are in it too, as calls
whose outputs have the shapes the UT expects inferred.

Each case here rebuilds its call (tensors through create_tensor, with their format, strides, offset
and storage shape; int and bool arrays; scalars; null pointers), plans it on LocalClient("numpy")
with get_workspace_size, as the UT's TestGetWorkspaceSize does, and checks the status class: SUCCESS,
PARAM_NULLPTR or PARAM_INVALID (or merely not success, where a UT says no more). Only the class is
checked, not which parameter is named: the UTs do not say. Nothing is executed, so tensors carry no
real data: a tensor's storage is a zero-stride view of one zero (no memory, whatever its shape).
A test id is the UT's test name, then #k for the k-th checked call of a test that checks several,
then @ the operator's folder in its repository.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

from aclnn_client import AclnnError, DataType, Format, create_tensor
from aclnn_common.types import NUMPY_DTYPES
from aclnn_server import LocalClient

CASES = json.loads((pathlib.Path(__file__).parent / "data" / "ops_nn_ut_cases.json").read_text())
STATUS = {"SUCCESS": 0, "PARAM_NULLPTR": 161001, "PARAM_INVALID": 161002}
# aclDataType codes the UTs use that DataType does not list (no NumPy type either: such a tensor
# travels as a descriptor without storage, which get_workspace_size never reads anyway).
EXTRA_DTYPES = {"DT_UNDEFINED": -1, "STRING": 13}


@pytest.fixture(scope="module")
def client():
    with LocalClient("numpy") as c:
        yield c


def _dtype(name: str) -> int:
    return DataType[name].value if name in DataType.__members__ else EXTRA_DTYPES[name]


def _tensor(desc: dict):
    shape = desc["shape"]
    strides = desc.get("strides")
    if strides is None:  # a contiguous view's, an empty dimension counting as 1 (as PyTorch's)
        strides = [math.prod(max(d, 1) for d in shape[i + 1 :]) for i in range(len(shape))]
    storage = desc.get("storage_shape", shape)
    dtype = _dtype(desc["dtype"])
    np_dtype = NUMPY_DTYPES.get(dtype)  # DataType keys: an IntEnum compares and hashes as its int
    data = None
    if np_dtype is not None and all(d >= 0 for d in storage):
        data = np.broadcast_to(np.zeros(1, np_dtype), (math.prod(storage),))
    return create_tensor(shape, dtype, strides, desc.get("offset", 0), Format[desc["format"]], storage, data)


def _value(v):
    if isinstance(v, dict):
        if "int_array" in v:
            return list(v["int_array"])
        if "bool_array" in v:
            return list(v["bool_array"])
        return _tensor(v)
    return v  # None (a null pointer), a bool, an int or a float


def test_cases_are_unique_and_complete():
    # The count make_ops_nn_ut_cases.py wrote for the pinned commits: a file losing cases fails here.
    assert len(CASES) == 338, "regenerated from other UT commits? update this count with them"
    assert len({c["id"] for c in CASES}) == len(CASES)
    assert {c["expected"] for c in CASES} <= {*STATUS, "NOT_SUCCESS"}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_ut_case(client, case):
    params = {name: _value(v) for name, v in case["params"].items()}
    try:
        _, executor = client.get_workspace_size(case["operator"], **params)
    except AclnnError as err:
        got, detail = err.code, f"{err.code} {err.param}: {err}"
    else:
        client.destroy_executor(executor)
        got, detail = 0, "success"
    where = f"{case['repository']}@{case['commit'][:10]} {case['file']}::{case['test']} ({case['soc']})"
    if case["expected"] == "NOT_SUCCESS":
        assert got != 0, f"{where}: expected a failure, got {detail}"
    else:
        assert got == STATUS[case["expected"]], f"{where}: expected {case['expected']}, got {detail}"
