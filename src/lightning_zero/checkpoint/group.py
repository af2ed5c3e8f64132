"""The ranks a checkpoint is saved and loaded by: the gloo group and mesh DCP runs on, and
``on_every_rank``, which gives every rank the same outcome of a step that may fail on some.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")


class CheckpointGroup:
    """A gloo process group over all ranks and its 1-D device mesh: DCP exchanges plans and the
    chunks are staged on the CPU, whatever backend training uses. Created on first use (a
    collective call, made by every rank at the same save or load). In a process with no process
    group (the calling process after spawned ranks finished) it is this process ``alone``.

    ``timeout``: how long a collective on the groups made here waits for its peers before failing
    (the strategy's; None: torch's default). Under gloo training DCP uses the default group itself,
    unless ``dedicated``: a group of its own whatever the backend, for the saves written on a
    background thread while training issues collectives (see [Note: async saves] in ``async_save.py``)."""

    def __init__(self, timeout: Optional[timedelta] = None, dedicated: bool = False) -> None:
        self.timeout = timeout
        self.dedicated = dedicated
        self._group: Optional[dist.ProcessGroup] = None
        self._mesh: Optional[DeviceMesh] = None
        self._hybrid_meshes: dict[int, DeviceMesh] = {}
        self._device_meshes: dict[tuple[Optional[int], str], DeviceMesh] = {}

    @property
    def group(self) -> dist.ProcessGroup:
        if self._group is None:
            self._group = (
                dist.group.WORLD if dist.get_backend() == "gloo" and not self.dedicated else dist.new_group(backend="gloo", timeout=self.timeout)
            )
        return self._group

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.group, "cpu")
        return self._mesh

    def mesh_for(self, shard_group_size: Optional[int], device_type: str = "cpu") -> DeviceMesh:
        """The mesh the chunks are DTensors on: 1-D over all ranks, or with hybrid sharding 2-D
        (replicas × shard group), each chunk ``Replicate`` across shard groups (DCP stores it once).

        ``device_type``: where the chunks are. What DCP writes and reads is on the CPU's mesh; a save's
        entries stay on the device until the save copies them (see [Note: host copies of a save] in
        ``sharded.py``), as DTensors on a mesh of the device's type over the same gloo groups (torch's
        ``DTensor.from_local`` would move them to its mesh's device). Nothing communicates on it."""
        if device_type != "cpu":
            return self._device_mesh(shard_group_size, device_type)
        if shard_group_size is None:
            return self.mesh
        if shard_group_size not in self._hybrid_meshes:
            layout = torch.arange(self.size).view(-1, shard_group_size)
            groups = [self._new_gloo_group_per(layout.T), self._new_gloo_group_per(layout)]  # replicate dim, shard dim
            self._hybrid_meshes[shard_group_size] = DeviceMesh.from_group(
                groups, "cpu", mesh=layout, mesh_dim_names=("replicate", "shard")
            )
        return self._hybrid_meshes[shard_group_size]

    def _device_mesh(self, shard_group_size: Optional[int], device_type: str) -> DeviceMesh:
        key = (shard_group_size, device_type)
        if key not in self._device_meshes:
            host = self.mesh_for(shard_group_size)
            if host.ndim == 1:
                made = DeviceMesh.from_group(host.get_group(), device_type)
            else:
                groups = [host.get_group(0), host.get_group(1)]
                made = DeviceMesh.from_group(groups, device_type, mesh=host.mesh, mesh_dim_names=host.mesh_dim_names)
            self._device_meshes[key] = made
        return self._device_meshes[key]

    def host_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The CPU's mesh of the same layout as ``mesh`` (one made by ``mesh_for``): where a chunk's
        host copy is a DTensor."""
        if mesh.device_type == "cpu":
            return mesh
        for (shard_group_size, _), made in self._device_meshes.items():
            if made is mesh:
                return self.mesh_for(shard_group_size)
        raise ValueError(f"{mesh} was not made by this checkpoint group")

    def _new_gloo_group_per(self, rows: torch.Tensor) -> dist.ProcessGroup:
        """One gloo group per row of global ranks (each rank creates all, in order); this rank's."""
        mine = None
        for row in rows.tolist():
            group = dist.new_group(row, backend="gloo", timeout=self.timeout)
            if dist.get_rank() in row:
                mine = group
        assert mine is not None
        return mine

    def __getstate__(self) -> dict[str, Any]:
        # a process group belongs to its process: made anew on use
        return {"timeout": self.timeout, "dedicated": self.dedicated, "_group": None, "_mesh": None, "_hybrid_meshes": {}, "_device_meshes": {}}

    @property
    def alone(self) -> bool:
        return not dist.is_initialized()

    @property
    def rank(self) -> int:
        return 0 if self.alone else dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return 1 if self.alone else dist.get_world_size(self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        if self.alone:
            return [obj]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered


def on_every_rank(group: CheckpointGroup, work: Callable[[], T]) -> list[T]:
    """Run ``work`` on this rank and gather every rank's result. If it raised on any rank, every rank
    raises the lowest such rank's exception: all fail alike, with one message, and no rank is left
    waiting in a collective for one that gave up."""
    try:
        outcome: tuple[Optional[Exception], Any] = (None, work())
    except Exception as err:  # noqa: BLE001 - handed to every rank, raised there
        outcome = (_picklable(err), None)
    gathered = group.all_gather(outcome)
    for err, _ in gathered:
        if err is not None:
            raise err
    return [result for _, result in gathered]


def _picklable(err: Exception) -> Exception:
    try:
        pickle.dumps(err)
        return err
    except Exception:  # noqa: BLE001 - an exception carrying something unpicklable
        return RuntimeError(f"{type(err).__name__}: {err}")
