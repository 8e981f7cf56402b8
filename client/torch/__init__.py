"""PyTorch integration: normalization layers whose backward runs on an aclnn-serve server.

`layer_norm`, `batch_norm`, `rms_norm` and `group_norm` take `torch.nn.functional`'s arguments plus
a `client` (a `Client` or a `LocalClient`). The forward runs here, in aten's own kernels, keeping the
statistics they save (mean/rstd, save_mean/save_invstd); the backward sends those to
aclnnLayerNormBackward / aclnnBatchNormBackward / aclnnRmsNormGrad / aclnnGroupNormBackward, asking
only for the gradients autograd needs. `offload_norms(model, client)` makes every nn.LayerNorm,
nn.BatchNorm1d/2d/3d, nn.RMSNorm and nn.GroupNorm of a model do that, in place.

Both directions are `torch.library` custom ops (`aclnn::layer_norm` etc. with `register_autograd`,
and the remote `aclnn::layer_norm_backward` etc.),
so `torch.compile` traces an offloaded model without graph breaks and keeps each remote call as
one opaque node; outside compilation the same parts run as a plain autograd.Function (`ops/eager.py`),
which costs less per call. An op's arguments can only be tensors and plain values, so the client travels
as an int: its id in a registry of live clients.

`SyncBatchNorm` (what `offload_norms` makes of an nn.SyncBatchNorm) runs SyncBatchNorm's statistics,
normalization and backward on the service and only its cross-process reductions here, through
torch.distributed: gloo on CPU processes works, which nn.SyncBatchNorm refuses.

This package imports torch; `import aclnn_client` does not.

Rooms: `ops/` (one custom op pair per norm, with the functional form; `eager`: their eager twins),
`sync_batch_norm`, `modules` (offload_norms/restore_norms), `clients` (clients as op arguments),
`gradients` (gradient buffers).
"""

from __future__ import annotations

from .modules import SyncBatchNorm, offload_norms, restore_norms
from .ops.batch_norm import batch_norm
from .ops.group_norm import group_norm
from .ops.layer_norm import layer_norm
from .ops.rms_norm import rms_norm

__all__ = ["SyncBatchNorm", "batch_norm", "group_norm", "layer_norm", "offload_norms", "restore_norms", "rms_norm"]
