"""Over the data channel's TCP connection a call's tensors and results travel inline (raw beside its
messages) up to 16 MiB each, within the server's message limit, which its ticket states; on a real server."""

from __future__ import annotations

import pytest
from layer_norm_cases import layer_norm_call
from test_data_channel import OP, check

from aclnn_client import Client
from aclnn_client.grpc_client import TCP_INLINE_BYTES, UNSAID_TCP_INLINE_BYTES
from aclnn_client.staging import Staging
from aclnn_common._proto import aclnn_pb2 as pb

MIB = 1 << 20


def transfers(served) -> tuple[int, int]:
    """(uploads, downloads) the server has served."""
    count = served.server.metrics.requests.labels
    return tuple(int(count(m, "", "ACLNN_SUCCESS")._value.get()) for m in ("UploadTensor", "DownloadTensor"))


def test_calls_of_8_mib_tensors_go_inline_with_their_results(serve, rng):
    """Two 8 MiB inputs and an 8 MiB result: one exchange, nothing uploaded, downloaded or freed after."""
    served = serve()
    with Client(served.address, unix_socket=False) as c:
        assert not c._data_channel(0).unix
        assert c._transfers.max_inline_bytes(0) == TCP_INLINE_BYTES == 16 * MIB
        assert c._transfers.max_attached_bytes(0) == c._transfers.max_attached_bytes(0, results=True) == 63 * MIB
        p = layer_norm_call(rng, (2048, 1024))
        c.run(OP, **p)
        check(p)
    assert transfers(served) == (0, 0)
    assert served.server.storage.counts() == (0, 0)


def test_a_call_stays_within_the_servers_message_limit(serve, rng):
    """A server that takes messages of at most 8 MiB says so in its ticket: a call attaches at most
    7 MiB of tensors and takes back at most 7 MiB of results inline; the largest beyond go as uploads
    and downloads. (Sent inline, these calls would be over its limit, and their connection closed.)"""
    served = serve(max_message_bytes=8 * MIB)
    with Client(served.address, unix_socket=False) as c:
        assert c._transfers.max_attached_bytes(0) == 7 * MIB
        staging = Staging(c._transfers)
        assert staging._uploads(0, {"gradOut": 4 * MIB, "input": 4 * MIB, "mean": 4096}) == ["input"]
        p = layer_norm_call(rng, (1024, 1024))  # 4 MiB tensors: one uploaded, the 4 MiB result inline
        c.run(OP, **p)
        check(p)
        assert transfers(served) == (1, 0)
        p = layer_norm_call(rng, (2048, 1024))  # 8 MiB tensors: both uploaded, the result kept and downloaded
        c.run(OP, **p)
        check(p)
        assert transfers(served) == (3, 1)
    assert served.server.storage.counts() == (0, 0)


def test_a_server_from_before_gets_4_mib_tensors_inline(serve, rng):
    """A server whose ticket does not state its message limit (one from before that field) gets what
    clients sent it before: tensors of up to 4 MiB inline, larger ones uploaded, larger results kept."""
    served = serve()
    served.server.data_channel.max_message_bytes = 0  # what its ticket says: nothing
    with Client(served.address, unix_socket=False) as c:
        assert c._transfers.max_inline_bytes(0) == UNSAID_TCP_INLINE_BYTES == 4 * MIB
        assert c._transfers.max_attached_bytes(0) is None
        p = layer_norm_call(rng, (2048, 1024))
        c.run(OP, **p)
        check(p)
    assert transfers(served) == (2, 1)


def test_a_call_refused_memory_for_its_inline_bytes_is_asked_again_with_them_uploaded(serve, rng, monkeypatch):
    """Inline bytes over TCP are held as they arrive, before the call's turn: when the server has no
    room for them now (RESOURCE_EXHAUSTED), the call is asked again with its tensors above 4 MiB
    uploaded, into the memory of a reservation that waits its turn."""
    from aclnn_server import ledger as ledger_module

    served = serve()
    reserve, refused = ledger_module.MemoryLedger.reserve, []

    def refuse_the_first_request(self, owner, nbytes, kind, param=""):
        if kind == "request" and not refused:
            refused.append(nbytes)
            raise self.refusal(owner, {kind: self.budget_bytes + 1}, param)
        return reserve(self, owner, nbytes, kind, param)

    monkeypatch.setattr(ledger_module.MemoryLedger, "reserve", refuse_the_first_request)
    with Client(served.address, unix_socket=False) as c:
        assert Staging(c._transfers)._uploads(0, {"gradOut": 8 * MIB}) == []
        p = layer_norm_call(rng, (2048, 1024))
        c.run(OP, **p)
        check(p)
        assert refused and refused[0] > 16 * MIB  # the first attempt: both inputs inline
        assert transfers(served) == (2, 0)  # the second: both uploaded, the result inline
        retried = Staging(c._transfers)
        retried.retried = True
        assert retried._uploads(0, {"gradOut": 8 * MIB, "mean": 4 * MIB}) == ["gradOut"]


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_results_beyond_what_a_reply_may_carry_stay_on_the_server(serve, rng, unix):
    """Results sent back inline are within the server's message limit in all (a reply crosses its
    socket, Unix or TCP): the largest beyond it are kept and downloaded (here with every result
    inline allowed, and no result regions)."""
    served = serve(max_message_bytes=4 * MIB)
    with Client(served.address, unix_socket=unix, max_inline_bytes=64 * MIB) as c:
        assert c._transfers.max_attached_bytes(0, results=True) == 3 * MIB
        placements = pb.OpCall().placements
        staging = Staging(c._transfers)
        staging.place(0, {"a": 2 * MIB, "b": 2 * MIB, "c": 512 << 10}, placements)
        kept = sorted(name for name in ("a", "b", "c") if placements[name].keep_on_server)
        if unix:  # results of 1-64 MiB land in the client's result regions there
            assert kept == [] and sorted(staging.output_regions) == ["a", "b"]
        else:
            assert kept == ["b"] and placements["a"].attached and placements["c"].attached
        staging.reset(failed=True)
