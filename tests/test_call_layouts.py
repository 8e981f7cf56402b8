"""A repeated call layout is encoded once by the client and decoded once by the server; results and
refusals stay exactly those of a call encoded afresh, and no cache keeps a caller's tensor bytes."""

from __future__ import annotations

import numpy as np
import pytest
from layer_norm_cases import layer_norm_call
from oracle import assert_close
from test_data_channel import OP, OUTPUTS, check
from test_device_memory import layer_norm_reference, on_device

from aclnn_client import AclnnError, Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.binding import BoundCall, bind
from aclnn_common.tensor import Tensor
from aclnn_common.wire import encode_call
from aclnn_server.transport import wire


def test_a_repeated_layout_reuses_its_request_and_computes_on_each_calls_bytes(serve, rng):
    served = serve()
    with Client(served.address) as c:
        for _ in range(3):  # new bytes each time: nothing of an earlier call's is sent again
            p = layer_norm_call(rng, (4, 16))
            c.run(OP, **p)
            check(p)
        assert len(c._layouts) == 1
        p = layer_norm_call(rng, (5, 16))  # another shape: another layout
        c.run(OP, **p)
        check(p)
        p = layer_norm_call(rng, (4, 16), weight=None)  # a null weight: another layout
        c.run(OP, **p)
        check(p)
        assert len(c._layouts) == 3


def test_a_refused_layout_is_refused_again_exactly_and_writes_nothing(serve, rng):
    served = serve()
    with Client(served.address) as c:
        refusals = []
        for _ in range(2):  # the second call sends the request kept from the first
            p = layer_norm_call(rng, (4, 16))
            p["mean"] = p["mean"][:3]
            for name in OUTPUTS:
                p[name][...] = 7.0
            with pytest.raises(AclnnError) as refused:
                c.run(OP, **p)
            refusals.append((refused.value.code, refused.value.param, refused.value.message))
            for name in OUTPUTS:
                assert (p[name] == 7.0).all(), name
        assert len(c._layouts) == 1
        assert refusals[0] == refusals[1] and refusals[0][0] == 161002


def test_a_call_on_device_buffers_reuses_its_request_keyed_by_buffer_and_offset(serve, rng):
    """Every tensor in a device buffer (or a host output beside them): the request is kept per layout and
    buffers; other buffers, or other offsets, make another; a freed buffer is refused as before."""
    served = serve()
    rows, cols = 4, 16
    with Client(served.address) as c:

        def layer_norm(x: np.ndarray, at: int, y=None, stream=None) -> np.ndarray:
            buf = bufs[at]
            c.memcpy(buf, x)
            stats = buf + 2 * x.nbytes
            y_tensor = on_device(buf + x.nbytes, x.shape) if y is None else y
            c.run("aclnnLayerNorm", input=on_device(buf, x.shape), normalizedShape=[cols], eps=1e-5, out=y_tensor,
                  meanOutOptional=on_device(stats, (rows, 1)), rstdOutOptional=on_device(stats + 4 * rows, (rows, 1)),
                  stream=stream)  # fmt: skip
            c.synchronize(stream)
            if y is None:
                y = np.empty_like(x)
                c.memcpy(y, buf + x.nbytes)
            assert_close(y, layer_norm_reference(x, x, np.ones(cols), np.zeros(cols))[0], "out")

        bufs = [c.malloc(4 * (2 * rows * cols + 2 * rows)) for _ in range(2)]
        for stream in (None, 1, None):  # the stream travels beside the request, not in it
            layer_norm(rng.uniform(-2, 2, (rows, cols)).astype(np.float32), 0, stream=stream)
        assert len(c._layouts) == 1
        layer_norm(rng.uniform(-2, 2, (rows, cols)).astype(np.float32), 1)  # other buffers
        assert len(c._layouts) == 2
        for _ in range(2):  # a host output beside device inputs: attached over the data channel
            layer_norm(rng.uniform(-2, 2, (rows, cols)).astype(np.float32), 1, y=np.empty((rows, cols), np.float32))
        assert len(c._layouts) == 3
        c.free(bufs[0])
        with pytest.raises(AclnnError) as refused:  # the kept request names a buffer that is gone
            c.run("aclnnLayerNorm", input=on_device(bufs[0], (rows, cols)), normalizedShape=[cols], eps=1e-5,
                  out=on_device(bufs[0] + 4 * rows * cols, (rows, cols)))  # fmt: skip
        assert refused.value.code == 161002 and "freed" in refused.value.message, refused.value


def test_layout_keys_tell_scalars_apart_by_type_and_bits(serve):
    served = serve()
    with Client(served.address) as c:

        def key(value: object) -> tuple | None:
            return c._layout_key(0, BoundCall("aclnnBatchNormBackward", {"eps": value}, {}), {})

        assert len({key(v) for v in (0.0, -0.0, 0, False, 1, True, 1.0)}) == 7
        unhashable = Tensor([4], 0, [1], 0, 2, [4])  # hand-made, with lists: encoded each time
        assert c._layout_key(0, BoundCall(OP, {"gradInputOut": unhashable}, {}), {}) is None
    with Client(served.address, shared_memory=True) as c:  # keyed too: its staging is kept, regions and all
        assert c._layout_key(0, BoundCall(OP, {"eps": 0.0}, {}), {}) is not None


def _attached_call(rng) -> pb.OpCall:
    p = layer_norm_call(rng, (4, 16))
    call = encode_call(OP, bind(OP, p, frozenset(OUTPUTS)).values, storage=False)
    offset = 0
    for name in ("gradOut", "input", "mean", "rstd", "weightOptional"):
        call.params[name].tensor.ref.attached.offset = offset
        call.params[name].tensor.ref.attached.size = p[name].nbytes
        offset += p[name].nbytes
    return call


def test_the_server_decodes_a_layout_once_and_resolves_storage_per_call(rng):
    call = _attached_call(rng)
    fresh = wire.decode_params(call.params, lambda ref, name: ("bytes", ref.attached.offset))
    for round_ in range(2):
        values = wire.decode_call(call, lambda ref, name, r=round_: ("bytes", ref.attached.offset, r))
        assert values.keys() == fresh.keys()
        for name, value in values.items():
            if isinstance(value, Tensor) and value.data is not None:
                assert value.data == (*fresh[name].data, round_), name  # resolved now, for this call
                assert value.without_data() == fresh[name].without_data(), name
            else:
                assert value == fresh[name], name
    assert call.SerializeToString() in wire._calls


def test_the_server_never_caches_tensor_bytes_sent_inline(rng):
    call = _attached_call(rng)
    call.params["gradOut"].tensor.ClearField("ref")
    call.params["gradOut"].tensor.data = np.arange(16, dtype=np.float32).tobytes()  # small, but inline
    values = wire.decode_call(call, lambda ref, name: None)
    assert values["gradOut"].data == call.params["gradOut"].tensor.data
    assert call.SerializeToString() not in wire._calls
    assert not any(call.params["gradOut"].tensor.data in key for key in wire._calls)
    assert wire._parts(call.params["gradOut"]) is None  # nor as a Value


def test_calls_naming_uploads_are_decoded_each_time_not_kept(rng):
    """A handle or a reservation is made for one call: keeping its layout would only push others out."""
    call = _attached_call(rng)
    call.params["gradOut"].tensor.ref.handle = "h-1"
    values = wire.decode_call(call, lambda ref, name: ("bytes", ref.WhichOneof("kind")))
    assert values["gradOut"].data == ("bytes", "handle")
    assert call.SerializeToString() not in wire._calls
    call = _attached_call(rng)
    call.reservation = "r-1"
    wire.decode_call(call, lambda ref, name: None)
    assert call.SerializeToString() not in wire._calls
