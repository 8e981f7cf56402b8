"""Whole models: `offload_norms` swaps each norm layer's class for a subclass whose forward runs the
offloaded op; `restore_norms` swaps it back."""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist
from torch import Tensor, fx, nn
from torch.nn.modules.lazy import LazyModuleMixin

from aclnn_common.api import BaseClient

from .clients import client_id
from .local import unserved_dtype, warn_not_served
from .ops.batch_norm import batch_norm_with_id
from .ops.group_norm import group_norm_with_id
from .ops.layer_norm import layer_norm_with_id
from .ops.rms_norm import rms_norm_with_id
from .sync_batch_norm import SyncBatchNormFunction


class _Binding:
    """An offloaded module's client: keeps it alive; copies of the module share it; a pickled
    module comes back unbound (its backward then says so) rather than carrying a connection."""

    def __init__(self, client: BaseClient | None) -> None:
        self.client = client
        self.id = client_id(client) if client is not None else 0

    def __deepcopy__(self, memo: dict) -> _Binding:
        return self

    def __copy__(self) -> _Binding:
        return self

    def __reduce__(self) -> tuple:
        return _Binding, (None,)


_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # layers that said they run in PyTorch


def _runs_in_pytorch(layer: nn.Module, input: Tensor) -> bool:
    """Whether a tensor of the layer has a dtype the service lacks (see local.py): then the layer runs
    PyTorch's own forward and backward, and says so once, by its name in the offloaded model."""
    # The layer's own parameters and buffers (None where unset), as parameters(recurse=False) and
    # buffers(recurse=False) yield them, without their generators' cost on every forward.
    dtype = unserved_dtype(input, *layer._parameters.values(), *layer._buffers.values())
    if dtype is None:
        return False
    if layer not in _warned:
        _warned.add(layer)
        name = getattr(layer, "_aclnn_name", "")
        what = type(layer).__name__.removeprefix("Offloaded")
        warn_not_served(f"offloaded layer {name!r} ({what})" if name else f"an offloaded {what}", dtype, stacklevel=4)
    return True


def _fx_leaf(layer: nn.Module, input: fx.Proxy) -> fx.Proxy:
    """Under torch.fx.symbolic_trace, the layer as one call_module node, as PyTorch's own norm layers are
    (FX keeps a module whole only when its class lives in torch.nn): tracing into the forward met its
    Python branches on the input's dtype and failed; the traced module calls the layer, offloaded."""
    return input.tracer.create_proxy("call_module", input.tracer.path_of_module(layer), (input,), {})


class _Offloaded:
    """What every offloaded class has: it pickles as the class it was made from (a user's subclass
    too, whose offloaded class is made at run time and has no importable name), and refuses
    TorchScript, which cannot call the client, with a message that says so."""

    def __reduce_ex__(self, protocol: int) -> tuple:
        _, _, *state = super().__reduce_ex__(max(protocol, 2))  # (copyreg.__newobj__, (cls,), state, ...)
        return (_new_offloaded, (type(self).__bases__[1],), *state)

    def __prepare_scriptable__(self) -> nn.Module:
        raise RuntimeError(
            f"an offloaded {type(self).__bases__[1].__name__} cannot be scripted: its backward calls the "
            "aclnn client from Python. torch.compile and torch.jit.trace take it; or script after restore_norms"
        )


def _new_offloaded(cls: type) -> nn.Module:
    """Unpickling: a bare instance of `cls`'s offloaded class (its state comes next)."""
    offloaded = _offloaded_class(cls)
    return offloaded.__new__(offloaded)


class _OffloadedLayerNorm(_Offloaded):
    """nn.LayerNorm's forward with the remote backward."""

    _aclnn: _Binding

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, fx.Proxy):
            return _fx_leaf(self, input)
        if _runs_in_pytorch(self, input):
            return super().forward(input)
        return layer_norm_with_id(input, self.normalized_shape, self.weight, self.bias, self.eps, self._aclnn.id)


class _OffloadedBatchNorm(_Offloaded):
    """nn.BatchNorm's forward (torch.nn.modules.batchnorm._BatchNorm.forward) with the remote backward."""

    _aclnn: _Binding

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, fx.Proxy):
            return _fx_leaf(self, input)
        if _runs_in_pytorch(self, input):
            return super().forward(input)
        self._check_input_dim(input)
        running_mean, running_var, bn_training, factor = self._batch_norm_arguments()
        return batch_norm_with_id(
            input, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps, self._aclnn.id
        )

    def _batch_norm_arguments(self) -> tuple[Tensor | None, Tensor | None, bool, float]:
        """Counts the batch; returns the running statistics to use, whether to normalize with the
        batch's statistics, and the momentum factor (_BatchNorm.forward's logic)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean, running_var = (self.running_mean, self.running_var) if track else (None, None)
        return running_mean, running_var, bn_training, factor


class _OffloadedSyncBatchNorm(_OffloadedBatchNorm):
    """nn.SyncBatchNorm's forward with statistics, normalization and backward on the service and
    the cross-process reductions through torch.distributed: unlike nn.SyncBatchNorm's, it takes
    CPU tensors (gloo). Without a process group of two or more, or in eval(), it is the offloaded
    BatchNorm. Also built directly: `SyncBatchNorm(num_features, ..., process_group=None, client=client)`."""

    def __init__(self, *args: Any, client: BaseClient, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._aclnn = _Binding(client)

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, fx.Proxy):
            return _fx_leaf(self, input)
        world_size = self._world_size() if self.training else 1
        if world_size > 1 and not input.is_cuda:  # PyTorch's own SyncBatchNorm takes only GPU tensors
            dtype = unserved_dtype(input, *self._parameters.values(), *self._buffers.values())
            if dtype is not None:
                raise ValueError(
                    f"SyncBatchNorm across {world_size} processes on {input.device.type} tensors runs on the "
                    f"aclnn service, which does not serve {str(dtype).removeprefix('torch.')}: train it in float32, "
                    "float16 or bfloat16 (PyTorch's own SyncBatchNorm takes only GPU tensors)"
                )
        if isinstance(input, fx.Proxy):
            return _fx_leaf(self, input)
        if _runs_in_pytorch(self, input):
            return super().forward(input)  # nn.SyncBatchNorm's, through the offloaded BatchNorm's check
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        running_mean, running_var, bn_training, factor = self._batch_norm_arguments()
        eps, cid = self.eps, self._aclnn.id
        if world_size < 2:  # one process, or eval: the offloaded BatchNorm
            return batch_norm_with_id(
                input, running_mean, running_var, self.weight, self.bias, bn_training, factor, eps, cid
            )
        group = self.process_group or dist.group.WORLD
        return SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, eps, factor, group, world_size, cid
        )

    def _world_size(self) -> int:
        """The processes its statistics would be synchronized over (1 without torch.distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group or dist.group.WORLD)


class _OffloadedRMSNorm(_Offloaded):
    """nn.RMSNorm's forward with the remote backward."""

    _aclnn: _Binding

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(x, fx.Proxy):
            return _fx_leaf(self, x)
        if _runs_in_pytorch(self, x):
            return super().forward(x)
        return rms_norm_with_id(x, self.normalized_shape, self.weight, self.eps, self._aclnn.id)


class _OffloadedGroupNorm(_Offloaded):
    """nn.GroupNorm's forward with the remote backward."""

    _aclnn: _Binding

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, fx.Proxy):
            return _fx_leaf(self, input)
        if _runs_in_pytorch(self, input):
            return super().forward(input)
        return group_norm_with_id(input, self.num_groups, self.weight, self.bias, self.eps, self._aclnn.id)


_BATCH_NORM_FORWARD = nn.modules.batchnorm._BatchNorm.forward
_STOCK = (  # (class, its stock forward, the offloaded forward's mixin)
    (nn.LayerNorm, nn.LayerNorm.forward, _OffloadedLayerNorm),
    (nn.BatchNorm1d, _BATCH_NORM_FORWARD, _OffloadedBatchNorm),
    (nn.BatchNorm2d, _BATCH_NORM_FORWARD, _OffloadedBatchNorm),
    (nn.BatchNorm3d, _BATCH_NORM_FORWARD, _OffloadedBatchNorm),
    (nn.RMSNorm, nn.RMSNorm.forward, _OffloadedRMSNorm),
    (nn.GroupNorm, nn.GroupNorm.forward, _OffloadedGroupNorm),
    (nn.SyncBatchNorm, nn.SyncBatchNorm.forward, _OffloadedSyncBatchNorm),
)
_offloaded: dict[type, type] = {}  # module class -> its offloaded subclass


def _offloaded_class(cls: type) -> type:
    """The subclass of `cls` with the offloaded forward (one per class, named Offloaded<cls>). A lazy
    layer's (nn.LazyBatchNorm2d, ...) becomes the offloaded class of what the lazy one becomes."""
    if cls not in _offloaded:
        becomes = _becomes(cls)
        mixin = next(m for base, _, m in _STOCK if issubclass(becomes or cls, base))
        name = f"Offloaded{cls.__name__}"
        namespace = {"__module__": __name__, "__qualname__": name}
        if becomes is not None:
            namespace["cls_to_become"] = _offloaded_class(becomes)
        _offloaded[cls] = type(name, (mixin, cls), namespace)
    return _offloaded[cls]


def _becomes(cls: type) -> type | None:
    """The class a lazy layer class turns into once its first input set its sizes, None for another."""
    return getattr(cls, "cls_to_become", None) if issubclass(cls, LazyModuleMixin) else None


for _stock, _, _ in _STOCK:  # the stock classes' subclasses live here by name, so offloaded models pickle
    globals()[f"Offloaded{_stock.__name__}"] = _offloaded_class(_stock)
SyncBatchNorm = _offloaded_class(nn.SyncBatchNorm)


def offload_norms(module: nn.Module, client: BaseClient) -> nn.Module:
    """Makes every nn.LayerNorm, nn.BatchNorm1d/2d/3d, nn.RMSNorm and nn.GroupNorm in `module` (itself
    included) compute its backward through `client`, in place; returns `module`.

    Each layer's class (a lazy one's, nn.LazyBatchNorm1d/2d/3d, too) becomes a subclass whose forward
    calls `layer_norm` / `batch_norm` / `rms_norm` / `group_norm` here:
    parameters, buffers and state_dict keys stay as they are. Subclasses that override forward
    are left alone (their forward is not the one this replaces). Offloading again rebinds the client
    (a model saved and loaded comes back without one: offload it again).

    A layer with a tensor of a dtype the service lacks (a float64 model) runs PyTorch's own forward
    and backward, with one NotServedWarning naming it (see local.py).
    """
    binding = _Binding(client)
    for name, m in module.named_modules():
        cls = type(m)
        if isinstance(m, _Offloaded):  # its class, or one made of it since (torch's parametrize makes one)
            m._aclnn, m._aclnn_name = binding, name
            continue
        for base, stock_forward, _ in _STOCK:
            if issubclass(_becomes(cls) or cls, base) and cls.forward is stock_forward:
                m.__class__ = _offloaded_class(cls)
                m._aclnn, m._aclnn_name = binding, name
                break
    return module


def restore_norms(module: nn.Module) -> nn.Module:
    """Undoes `offload_norms`: every offloaded layer in `module` gets its own class back; returns `module`."""
    originals = {sub: cls for cls, sub in _offloaded.items()}
    for m in module.modules():
        if not isinstance(m, _Offloaded):
            continue
        cls = type(m)
        if cls in originals:
            m.__class__ = originals[cls]
        elif len(cls.__bases__) == 1 and cls.__bases__[0] in originals:
            # A class made of the offloaded one for this layer alone (torch's parametrize makes one per
            # module, and takes its base back when the parametrization is removed): its base goes back.
            offloaded, original = cls.__bases__[0], originals[cls.__bases__[0]]
            cls.__bases__ = (original,)
            cls.__name__ = cls.__qualname__ = cls.__name__.replace(offloaded.__name__, original.__name__)
        else:
            raise TypeError(f"{cls.__qualname__} was made of an offloaded class: restore_norms cannot take it apart")
        del m._aclnn
        m.__dict__.pop("_aclnn_name", None)
    return module
