"""Client streams on CUDA streams, for the torch backend.

Each client stream (the engine's key: identity, session, stream id) runs on one of POOL_SIZE CUDA
streams, chosen by its key's hash, so that its calls stay in order with no state kept per stream id
(a client that used a new id for each call grew a map of them until its session ended); a session
remembers only which of the pool's streams its client streams ran on, for a synchronize of all of
them. A call without a client stream runs on its thread's CUDA stream, from torch's high-priority
pool: never one of the client streams' (its caller waits for it, and a wait on a stream another
tenant queues on would wait for that tenant's work too), and scheduled ahead of queued work. Two
client streams may share a CUDA stream: their calls then also wait for each other, which only
orders what needed no order (torch's own pool hands out its 32 streams round-robin the same way).
On the cpu device there are no streams: a call runs as it is made.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from aclnn_common.errors import AclnnError, Status

from ...streams import StreamKey

POOL_SIZE = 32  # CUDA streams client streams share (torch's pool holds 32 per device and priority)
ENDED_REMEMBERED = 4096  # sessions ended lately: a call of one still running records nothing for it


def device_failure(exc: BaseException) -> AclnnError:
    """A CUDA error (a kernel that faulted, an unusable device) as the status a CANN runtime error has."""
    return AclnnError(Status.RUNTIME_ERROR, f"the torch device failed: {exc}")


class DeviceStreams:
    """The CUDA streams of one torch device (see the module docstring)."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self._pool: list[Any] = []  # made at the first client stream's call
        self._used: dict[tuple[Any, Any], set[int]] = {}  # (identity, session) -> the pool's streams it ran on
        self._ended: collections.OrderedDict[tuple[Any, Any], None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()

    def stream(self, key: StreamKey | None) -> Any:
        """The CUDA stream a call on client stream `key` runs on (None on the cpu device)."""
        if not self.cuda:
            return None
        if key is None:
            stream = getattr(self._local, "stream", None)
            if stream is None:
                stream = self._local.stream = self.torch.cuda.Stream(self.device, priority=-1)
            return stream
        index = _pooled(key)
        with self._lock:
            if not self._pool:
                self._pool = [self.torch.cuda.Stream(self.device) for _ in range(POOL_SIZE)]
            if key[:2] not in self._ended:  # a call still running when its session ended
                self._used.setdefault(key[:2], set()).add(index)
            return self._pool[index]

    @contextlib.contextmanager
    def running(self, key: StreamKey | None) -> Iterator[Any]:
        """Makes `key`'s CUDA stream current on this thread (what torch launches goes there)."""
        stream = self.stream(key)
        if stream is None:
            yield None
            return
        with self.torch.cuda.device(self.device), self.torch.cuda.stream(stream):
            yield stream

    def wait(self, stream: Any) -> None:
        """Waits for what was launched on `stream`; a device failure becomes 361001."""
        if stream is None:
            return
        try:
            stream.synchronize()
        except RuntimeError as exc:
            raise device_failure(exc) from exc

    def synchronize(self, key: StreamKey) -> None:
        """Waits for a client stream's launches (every stream of its session when its id is None)."""
        with self._lock:
            used = self._used.get(key[:2], set())
            indices = used if key[2] is None else used & {_pooled(key)}
            streams = [self._pool[i] for i in sorted(indices)]
        for stream in streams:
            self.wait(stream)

    def end_session(self, owner: Any, session: Any) -> None:
        """An identity's session ended: nothing of it is kept (what it launched runs on, on the pool's streams)."""
        with self._lock:
            self._used.pop((owner, session), None)
            self._ended[(owner, session)] = None
            if len(self._ended) > ENDED_REMEMBERED:
                self._ended.popitem(last=False)


def _pooled(key: StreamKey) -> int:
    """The index of the pool's CUDA stream a client stream runs on."""
    return hash(key) % POOL_SIZE
