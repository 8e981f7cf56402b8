"""Client streams on CUDA streams, for the torch backend.

Each client stream (the engine's key: identity, session, stream id) runs on a CUDA stream of its
own, from torch's stream pool, bound until its session ends; a call without a client stream runs on
its thread's own CUDA stream. torch's pool is finite (it hands its streams out round-robin), so two
client streams may share a CUDA stream: their calls then also wait for each other, which only
orders what needed no order. On the cpu device there are no streams: a call runs as it is made.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from aclnn_common.errors import AclnnError, Status

from ...streams import StreamKey


def device_failure(exc: BaseException) -> AclnnError:
    """A CUDA error (a kernel that faulted, an unusable device) as the status a CANN runtime error has."""
    return AclnnError(Status.RUNTIME_ERROR, f"the torch device failed: {exc}")


class DeviceStreams:
    """The CUDA streams of one torch device (see the module docstring)."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self._bound: dict[StreamKey, Any] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def stream(self, key: StreamKey | None) -> Any:
        """The CUDA stream a call on client stream `key` runs on (None on the cpu device)."""
        if not self.cuda:
            return None
        if key is None:
            stream = getattr(self._local, "stream", None)
            if stream is None:
                stream = self._local.stream = self.torch.cuda.Stream(self.device)
            return stream
        with self._lock:
            stream = self._bound.get(key)
            if stream is None:
                stream = self._bound[key] = self.torch.cuda.Stream(self.device)
            return stream

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
        owner, session, stream_id = key
        with self._lock:
            streams = {
                id(s): s for k, s in self._bound.items() if k[:2] == (owner, session) and stream_id in (None, k[2])
            }
        for stream in streams.values():
            self.wait(stream)

    def end_session(self, owner: Any, session: Any) -> None:
        """An identity's session ended: its client streams are unbound (their CUDA streams go back to torch's pool)."""
        with self._lock:
            for key in [k for k in self._bound if k[:2] == (owner, session)]:
                del self._bound[key]
