"""The data channel's protocol, spoken by the client (aclnn_client.data_channel) and the server.

Protocol (little endian). A connection opens with MAGIC and a ticket from the
OpenDataChannel RPC; the server answers with a reply frame. Then the client sends
requests, one at a time, each answered by one reply (UPLOAD: two), and sends nothing
else while it waits (the server takes a closed connection for a cancelled call):

    request  = kind:u8 has_stream:u8 stream:i64 timeout_ms:u32 length:u64, payload
    reply    = ok:u8 length:u64, payload   (ok = 0: the payload is a google.rpc.Status)

    CALL      payload = name_length:u8 method name, request message; reply: the response message
    UPLOAD    length = the tensor's size; reply (empty) when the bytes are accepted, then the
              client sends them; reply: TensorHandle
    RESERVED_UPLOAD  payload = size:u64, the id of a call reservation (ReserveCall) whose memory the
              upload takes; then as UPLOAD: reply (empty), the bytes, reply: TensorHandle
    DOWNLOAD  payload = TensorHandle message; reply: the raw bytes
    REGISTER_REGION    (Unix socket) payload = size:u64; reply (empty) when the server is ready for
              the descriptor, then the client sends one byte with one memfd as SCM_RIGHTS ancillary
              data, sealed against shrinking, growing and further seals (F_SEAL_SEAL: the server
              gives back the pages it faults in; on tmpfs, not hugetlbfs), or against shrinking and
              growing only with every page allocated: the server then seals it against writes
              through new mappings and further seals once mapped, and holds nothing for it (a
              client's result region); reply: the region's id (ASCII), valid in RegionSlice.region
              for this session
    UNREGISTER_REGION  payload = the region's id; reply: empty
    MAILBOX   (Unix socket) payload = size:u64, at most MAILBOX_MAX_BYTES; then like REGISTER_REGION
              a memfd sealed like a region: the connection's mailbox from now on (it replaces a
              smaller one); reply: empty. One larger than HELD_MAILBOX_BYTES must be sealed against
              writes too (F_SEAL_FUTURE_WRITE, added after the client mapped it: it still writes
              through that mapping, but nobody, itself included, can punch a hole in it)
    WRITE_BUFFER  payload = BufferWrite message with all its bytes in `data` (up to
              WRITE_INLINE_BYTES), or none: then a reply (empty) when the write is accepted, then the
              client sends `size` raw bytes; reply: empty
    READ_BUFFER   payload = BufferRange message; reply: the raw bytes

Descriptors pass only there: at any other time the server's Unix socket refuses them (SO_PASSRIGHTS
off; a sendmsg with SCM_RIGHTS fails with EPERM), and the byte with the memfd is the last thing a
client sends before its reply, as after any request.

A CALL may carry tensor bytes raw, after its message, rather than inside it: kind = CALL | ATTACHED,

    payload  = name_length:u8 method name, message_length:u64, request message, zero padding to a
               multiple of ATTACHMENT_ALIGN bytes of the payload, then the attached part
    reply    = ok:u8 length:u64, message_length:u64, response message, padding likewise, attached part

Tensors refer to their bytes by StorageRef.attached, a ByteRange of the attached part (the client
starts each at a multiple of ATTACHMENT_ALIGN); outputs placed `attached` come back the same way
(OutputTensor.attached). Protobuf copies a bytes field several times on each side and its
serializer slows down more than in proportion beyond a few MiB; raw bytes move with one
system call from and into NumPy memory. An error reply is a plain Status, as for any request.

A CALL whose payload is larger than one Unix-socket buffer holds (MAILBOX_FROM) travels in the
connection's mailbox instead: kind = CALL | IN_MAILBOX, the payload at the mailbox's start and
nothing after the header. Over a stream socket such a payload arrives in pieces of ~36.5 KiB,
each of which wakes a thread of the server; through the mailbox only the header moves, in one
piece. The server copies the payload out of the mailbox into memory of its own before parsing
it (the client can change the mailbox at any time), from a read-only mapping of the whole mailbox
(held in the server's memory ledger while mapped; where the caller's share has no room for it,
of its first 64 KiB, and with pread beyond). The attached part of a CALL | ATTACHED | IN_MAILBOX is
not copied where the mailbox is mapped: the server computes on it where the client wrote it, so
that a client that rewrites it before its call ran changes that call's results, and nothing else.
The server never writes the mailbox; replies come over the socket. A mailbox lives and dies with
its connection.

A mailbox above HELD_MAILBOX_BYTES (sealed against writes, so against holes) is mapped whole and
not held: a request in it is served only once the server found no hole in its bytes (lseek
SEEK_HOLE, once per range: none can appear later), so reading it never fills a page charged to
the server; its pages are the client's. Its attached part read in place is held with the call's
memory while the call runs, taken as one unit in turn with every other call like a reservation
(ReserveCall), so large inline calls wait, go in turn and are refused as uploads are. A request
in it with a hole in its bytes is refused (INVALID_ARGUMENT), the connection kept in step.
"""

from __future__ import annotations

import struct

from ._proto import aclnn_pb2 as pb

MAGIC = b"ACLNNDC1"
TICKET_BYTES = 16
CALL, UPLOAD, DOWNLOAD, REGISTER_REGION, UNREGISTER_REGION, MAILBOX = 1, 2, 3, 4, 5, 6
WRITE_BUFFER, READ_BUFFER = 7, 8
RESERVED_UPLOAD = 10
IN_MAILBOX = 0x80  # on a CALL's kind: the payload is in the connection's mailbox
ATTACHED = 0x40  # on a CALL's kind: tensor bytes follow the message, raw (and so in its reply)
ATTACHMENT_ALIGN = 64  # the attached part, and each tensor in it, starts at a multiple of this
# A Unix-socket buffer holds ~36.5 KiB (one page-sized head and 32 KiB of pages): payloads above
# this travel in the connection's mailbox, of at most MAILBOX_MAX_BYTES (room for a call with two
# 64 MiB tensors: a larger call's tensors go through the socket as uploads, at half the speed).
MAILBOX_FROM = 32 << 10
MAILBOX_MAX_BYTES = 256 << 20
# Mailboxes up to this size are held in the server's memory ledger while mapped; larger ones are sealed
# against holes instead, and a call holds what it reads of one while it runs.
HELD_MAILBOX_BYTES = 16 << 20
REQUEST = struct.Struct("<BBqIQ")
REPLY = struct.Struct("<BQ")
REGION = struct.Struct("<Q")
MESSAGE_LENGTH = struct.Struct("<Q")


def aligned(offset: int) -> int:
    """The first multiple of ATTACHMENT_ALIGN at or after `offset`."""
    return -(-offset // ATTACHMENT_ALIGN) * ATTACHMENT_ALIGN


# The unary methods the data channel carries: request and reply message types.
METHODS: dict[str, tuple[type, type]] = {
    "GetWorkspaceSize": (pb.OpCall, pb.WorkspacePlan),
    "Execute": (pb.ExecuteRequest, pb.ExecuteResponse),
    "Run": (pb.OpCall, pb.RunResponse),
    "SetExecutorRepeatable": (pb.ExecutorRef, pb.Empty),
    "DestroyExecutor": (pb.ExecutorRef, pb.Empty),
    "FreeTensor": (pb.TensorHandle, pb.Empty),
    "KeepAlive": (pb.Empty, pb.Lease),
    "MallocBuffer": (pb.MallocRequest, pb.BufferInfo),
    "FreeBuffer": (pb.BufferRef, pb.Empty),
    "CopyBuffer": (pb.BufferCopy, pb.Empty),
    "FillBuffer": (pb.BufferFill, pb.Empty),
    "Synchronize": (pb.Empty, pb.Empty),
    "ReserveCall": (pb.CallReservation, pb.Reservation),
    "ReleaseReservation": (pb.Reservation, pb.Empty),
    "EndSession": (pb.Empty, pb.Empty),
}
# A WRITE_BUFFER of up to this many bytes carries them in its message (one exchange); larger ones
# follow as raw bytes once the server accepted the write.
WRITE_INLINE_BYTES = 16 << 10


class ConnectionLost(Exception):
    """The connection broke mid-exchange (the peer is gone, or a protocol error)."""
