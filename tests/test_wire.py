"""The wire contract seen by any gRPC client: rich errors, presence, the generated code."""

from __future__ import annotations

import pathlib
import sys

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from aclnn_client import Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def stub(server_address):
    with grpc.insecure_channel(server_address) as channel:
        yield pb_grpc.AclnnStub(channel)


def tensor(shape, data=True) -> pb.Value:
    n = 1
    for d in shape:
        n *= d
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    t = pb.Tensor(data_type=0, format=2, view_dims=shape, strides=strides, storage_dims=[n])
    if data:
        t.data = bytes(4 * n)
    return pb.Value(tensor=t)


def valid_params() -> dict[str, pb.Value]:
    return {
        "gradOut": tensor([2, 4]),
        "input": tensor([2, 4]),
        "normalizedShape": pb.Value(int_array=pb.IntArray(values=[4])),
        "mean": tensor([2, 1]),
        "rstd": tensor([2, 1]),
        "outputMask": pb.Value(bool_array=pb.BoolArray(values=[True, False, False])),
        "gradInputOut": tensor([2, 4], data=False),
    }


def error_info(error: grpc.RpcError) -> tuple[grpc.StatusCode, error_details_pb2.ErrorInfo]:
    status = rpc_status.from_call(error)
    info = error_details_pb2.ErrorInfo()
    assert len(status.details) == 1 and status.details[0].Unpack(info)
    return error.code(), info


def test_error_info_is_readable_by_any_grpc_client(stub):
    params = valid_params()
    del params["gradOut"]
    with pytest.raises(grpc.RpcError) as raised:
        stub.GetWorkspaceSize(pb.OpCall(op="aclnnLayerNormBackward", params=params))
    code, info = error_info(raised.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.domain == "aclnn" and info.reason == "ACLNN_ERR_PARAM_NULLPTR"
    assert dict(info.metadata) == {"status": "161001", "param": "gradOut"}


def test_explicit_null_value_is_a_null_pointer(stub):
    params = valid_params()
    params["mean"] = pb.Value()
    with pytest.raises(grpc.RpcError) as raised:
        stub.Run(pb.OpCall(op="aclnnLayerNormBackward", params=params))
    assert dict(error_info(raised.value)[1].metadata) == {"status": "161001", "param": "mean"}


def test_empty_array_is_not_null(stub):
    params = valid_params()
    params["normalizedShape"] = pb.Value(int_array=pb.IntArray())
    with pytest.raises(grpc.RpcError) as raised:
        stub.Run(pb.OpCall(op="aclnnLayerNormBackward", params=params))
    _, info = error_info(raised.value)
    assert info.reason == "ACLNN_ERR_PARAM_INVALID" and info.metadata["param"] == "normalizedShape"


def test_string_scalar_is_named(stub):
    params = valid_params()
    params["outputMask"] = pb.Value(string_value="all")
    with pytest.raises(grpc.RpcError) as raised:
        stub.Run(pb.OpCall(op="aclnnLayerNormBackward", params=params))
    assert dict(error_info(raised.value)[1].metadata) == {"status": "161002", "param": "outputMask"}


def test_run_returns_requested_outputs_only(stub):
    reply = stub.Run(pb.OpCall(op="aclnnLayerNormBackward", params=valid_params()))
    assert list(reply.outputs) == ["gradInputOut"]
    out = reply.outputs["gradInputOut"]
    assert (out.data_type, list(out.dims), len(out.data)) == (0, [2, 4], 32)


def test_list_operators(server_address):
    with Client(server_address) as c:
        ops = c.list_operators()
    assert {"aclnnLayerNormBackward", "LayerNormGrad"} <= set(ops)
    params = {p["name"]: p for p in ops["aclnnLayerNormBackward"]}
    assert params["gradInputOut"]["output"] and params["weightOptional"]["optional"]


def test_generated_code_is_current():
    """common/_proto must be what proto/generate.py makes from the .proto today."""
    sys.path.insert(0, str(ROOT / "proto"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    for name, text in generate.generate().items():
        committed = (ROOT / "common" / "_proto" / name).read_text()
        assert committed == text, f"common/_proto/{name} is stale: run python proto/generate.py"
