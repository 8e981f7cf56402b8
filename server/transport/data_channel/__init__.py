"""The server side of the data channel (protocol: aclnn_common/framing.py).

Listeners beside the gRPC port: TCP (with the gRPC port's TLS when it has it) and a Unix
domain socket for clients on this host, which also takes shared-memory regions (memfds
passed with SCM_RIGHTS). A connection is admitted by a ticket that the OpenDataChannel RPC
issued (valid for a minute, for any number of connections), so it carries that caller's
identity and session (gRPC authenticated it); every request then runs through
AclnnService like an RPC.

Modules, one concern each:
    loop          listeners, the epoll set and its workers, the connection table
    connection    one connection's state between its events; the listener's limits
    framing       reading a request's bytes without blocking; sending replies
    requests      serving one whole request through AclnnService
    tickets       tickets issued to authenticated callers, and admitting by them
    descriptors   descriptors passed over the Unix socket (SCM_RIGHTS)
    mailbox       a connection's mailbox (a sealed memfd its large requests arrive in)
    housekeeping  closing connections past their deadlines
"""

from .connection import Limits
from .loop import DataChannelServer

__all__ = ["DataChannelServer", "Limits"]
