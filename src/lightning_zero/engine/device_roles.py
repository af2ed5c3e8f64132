"""Which tensors belong to the host, checked where a collective takes them, also where the host and the
compute device are one CPU.

[Note: device roles]
NCCL takes device tensors only (a host tensor fails with "No backend type associated with device type
cpu"); gloo takes any. With offload, the engine keeps tensors in host memory: offloaded chunks and
their gradients, pinned copy buffers, NVMe staging, the optimizer state stepped there. On a GPU they
are CPU tensors beside CUDA ones, so handing one to a collective crashes the first multi-GPU offloaded
run; on a CPU-only machine every tensor is a CPU tensor and the same mistake passes unseen. Under
``tracking_host_tensors()`` (the tests marked ``nccl_semantics``, and the GPU tier):

- the engine tags what it allocates for the host (``mark_host``: ``copy_stream.host_empty``, the
  offload tier's buffers);
- a torch-function mode tags every tensor computed from a host tensor (a norm of a host gradient is a
  host tensor), except where a device is named: ``t.to(compute_device)`` is a device tensor (a copy
  where host and device are one memory), ``t.to(other device)`` a host one; in-place results keep
  their role (``device_buffer.copy_(host_chunk)`` fills a device tensor);
- every collective refuses a host tensor (``check_compute_tensors``), at any world size.

Tags live on storages, so views of a host buffer are host tensors too, also after the storage was
resized. Outside the context each hook
here costs one ``is None`` test.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class HostTensorInCollective(RuntimeError):
    """A host tensor was handed to a collective on the compute group (NCCL would refuse it)."""


class _HostTensors(TorchFunctionMode):
    """Host tags by storage, spread to what is computed from tagged tensors (see [Note: device roles])."""

    def __init__(self, compute_device: torch.device) -> None:
        super().__init__()
        self.compute_device = torch.device(compute_device)
        self._owners: dict[int, list["weakref.ref[Tensor]"]] = {}  # storage -> the tagged tensors on it

    def tag(self, tensor: Tensor) -> None:
        key = _storage_key(tensor)
        if key:
            owners = self._owners.setdefault(key, [])
            if len(owners) >= 8:  # views come and go: keep the live ones
                owners[:] = [owner for owner in owners if owner() is not None]
            owners.append(weakref.ref(tensor))

    def is_host(self, tensor: Tensor) -> bool:
        if tensor.device.type != self.compute_device.type:
            return True
        key = _storage_key(tensor)
        owners = self._owners.get(key) if key else None
        if not owners:
            return False
        if any((owner := ref()) is not None and _storage_key(owner) == key for ref in owners):
            return True
        del self._owners[key]  # every tagged tensor on it was freed (its key is another storage's now)
        return False

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _MOVES:
            target = _named_device(func, args[1:], kwargs)
            if target is not None:
                return self._moved(args[0], result, target)
        if _in_place(func, kwargs) or not any(self.is_host(t) for t in _tensors((args, kwargs))):
            return result
        for t in _tensors(result):
            self.tag(t)
        return result

    def _moved(self, source: Tensor, result: Any, target: torch.device) -> Any:
        if not isinstance(result, Tensor):
            return result
        if target.type != self.compute_device.type:
            self.tag(result)
            return result
        if result is source and self.is_host(source):  # a no-op where host and device are one memory
            return source.clone()
        return result


_MOVES = {Tensor.to, Tensor.cuda, Tensor.cpu}
_TRACKER: Optional[_HostTensors] = None


def _storage_key(tensor: Tensor) -> int:
    """The identity of ``tensor``'s storage, shared by its views and kept when the storage is resized
    (an NVMe master shrunk to 0 bytes between uses and grown again); 0 without one."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return 0


def _named_device(func: Callable, args: tuple, kwargs: dict) -> Optional[torch.device]:
    """The device a ``.to(...)``, ``.cuda(...)`` or ``.cpu()`` call names, if any."""
    if func is Tensor.cpu:
        return torch.device("cpu")
    candidates = [kwargs.get("device"), *args[:1]]
    if func is Tensor.cuda and not any(c is not None for c in candidates):
        return torch.device("cuda")
    for candidate in candidates:
        if isinstance(candidate, Tensor):
            return candidate.device
        if isinstance(candidate, (torch.device, str)):
            try:
                return torch.device(candidate)
            except RuntimeError:  # a dtype given as a string, e.g. never in practice
                return None
        if isinstance(candidate, int):
            return torch.device("cuda", candidate)
    return None


def _in_place(func: Callable, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    return "out" in kwargs or (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def _tensors(tree: Any) -> Iterator[Tensor]:
    return (leaf for leaf in tree_leaves(tree) if isinstance(leaf, Tensor))


@contextlib.contextmanager
def tracking_host_tensors(compute_device: torch.device | str = "cpu") -> Iterator[None]:
    """Tag host tensors and make every collective refuse them, while the context is open (in the
    thread that opened it; see [Note: device roles]). ``compute_device``: where the engine computes."""
    global _TRACKER
    if _TRACKER is not None:
        raise RuntimeError("tracking_host_tensors() is already open")
    tracker = _HostTensors(torch.device(compute_device))
    _TRACKER = tracker
    try:
        with tracker:
            yield
    finally:
        _TRACKER = None


def join_tracking() -> None:
    """The calling thread (one the engine started, such as the host step's worker) tags host tensors
    too while ``tracking_host_tensors()`` is open elsewhere; its mode goes when the thread ends."""
    if _TRACKER is not None:
        _TRACKER.__enter__()


def tracking() -> bool:
    """Whether ``tracking_host_tensors()`` is open."""
    return _TRACKER is not None


def mark_host(tensor: Tensor) -> Tensor:
    """Tag ``tensor`` (and its views) as host memory; returns it."""
    if _TRACKER is not None:
        _TRACKER.tag(tensor)
    return tensor


def is_host(tensor: Tensor) -> bool:
    """Whether ``tensor`` is host memory under tracking (a CPU tensor beside a CUDA compute device,
    or tagged); False when nothing is tracked."""
    return _TRACKER is not None and _TRACKER.is_host(tensor)


def check_compute_tensors(kind: str, tensors: Iterable[Tensor]) -> None:
    """Raise ``HostTensorInCollective`` when tracking and one of ``tensors``, handed to a ``kind``
    collective, is host memory."""
    if _TRACKER is None:
        return
    for t in tensors:
        if _TRACKER.is_host(t):
            raise HostTensorInCollective(
                f"A host tensor ({tuple(t.shape)}, {t.dtype}) was handed to a {kind} on the compute group."
                " NCCL accepts device tensors only and would fail with 'No backend type associated with"
                " device type cpu'. HINT: move it to the compute device first (see [Note: device roles])."
            )
