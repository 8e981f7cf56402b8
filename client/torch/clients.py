"""Clients as custom-op arguments: an op's arguments can only be tensors and plain values, so the
client travels as an int, its id in this registry of live clients."""

from __future__ import annotations

import itertools
import threading
import weakref

from aclnn_common.api import BaseClient
from aclnn_common.errors import invalid_error

_clients: weakref.WeakValueDictionary[int, BaseClient] = weakref.WeakValueDictionary()
_next_id = itertools.count(1)
_lock = threading.Lock()
_ID_ATTRIBUTE = "_aclnn_torch_op_id"


def client_id(client: BaseClient) -> int:
    """The client's id in the registry (registered on first use). The registry holds it weakly;
    what offloads keeps it alive: offloaded modules (`_Binding`) and each autograd node until its
    backward ran."""
    cid = getattr(client, _ID_ATTRIBUTE, None)
    if cid is None:
        if not isinstance(client, BaseClient):
            raise TypeError(f"client must be an aclnn_client.Client or aclnn_server.LocalClient, got {client!r:.80}")
        with _lock:
            cid = getattr(client, _ID_ATTRIBUTE, None)
            if cid is None:
                cid = next(_next_id)
                _clients[cid] = client
                setattr(client, _ID_ATTRIBUTE, cid)
    return cid


def client_by_id(cid: int) -> BaseClient:
    if not cid:  # a layer unpickled (torch.save/torch.load) comes back without its client
        raise invalid_error(
            "client",
            "this offloaded layer has no client: a saved model is loaded without its connection "
            "(torch.save/torch.load, pickle); call offload_norms(model, client) again after loading",
        )
    client = live_client(int(cid))
    if client is None:
        raise invalid_error(
            "client",
            f"client #{cid} of this offloaded call no longer exists (it was garbage collected): "
            "call offload_norms(model, client) with a live client",
        )
    return client


def live_client(cid: int) -> BaseClient | None:
    """The client with this id while it lives (an autograd node keeps it alive until its backward ran)."""
    return _clients.get(cid)
