"""The files of a sharded checkpoint directory, written and read through torch.distributed.checkpoint
(DCP), checksummed, with one outcome for all ranks.

The directory is a local path or a ``RemoteFolder`` at a URL (``folders.py``; committed by its
manifest, ``remote.py``). Failures: DCP reports a failed rank without the file or the cause on top
(``CheckpointException ranks:dict_keys([0])``), so DCP opens every file through the folder's
``dcp_files``, which name it, and its errors are re-raised with the checkpoint, the file and the cause on the first line. Every step whose outcome
can differ between ranks (checksums, rank 0's meta.pt and manifest, the checks before a load) ends
in ``on_every_rank``, so all ranks raise the same error and none waits alone in a collective.

What the tensors are (DCP keys, DTensor layout) is ``sharded.py``'s business; this module moves bytes.
The ranks' group and ``on_every_rank`` are ``group.py``'s (re-exported here).
"""

from __future__ import annotations

import io
import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generator, Optional, Union

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_zero.checkpoint.errors import (
    CheckpointWriteError,
    CorruptCheckpointError,
    ShardFileError,
    UntrustedCheckpointError,
    describe,
)
from lightning_zero.checkpoint.folders import Folder, as_folder
from lightning_zero.checkpoint.group import CheckpointGroup, on_every_rank
from lightning_zero.checkpoint.integrity import bytes_checksum, check_files, checksum_files, share
from lightning_zero.checkpoint.manifest import MANIFEST_NAME, META_NAME, REMOTE_FORMAT, Manifest
from lightning_zero.checkpoint.pickles import DcpTensorItems, load_dcp_metadata, load_torch_file, save_torch_file
from lightning_zero.checkpoint.save_plan import RankZeroWholeEntries
from lightning_zero.compat.dcp_reads import load_in_this_process

__all__ = ["CheckpointGroup", "on_every_rank"]  # and the functions below; the group lives in group.py

DCP_METADATA_NAME = ".metadata"
"""The file DCP's ``FileSystemWriter`` keeps its metadata in (one for all ranks)."""
UPLOAD_THREADS = 4
"""DCP's writer threads per rank on a remote folder: each writes its own file, so a rank's shards
upload in parallel (a local directory keeps DCP's one thread, its speed set by the disk)."""


def _writer(folder: Folder) -> dcp.FileSystemWriter:
    """DCP's writer into ``folder``, with its files opened through the folder's ``dcp_files``; on a
    remote folder without fsync (there is no local file to sync).

    Every entry is a host tensor by now (copied or staged), so DCP's default loader, which copies
    device tensors ahead on a CUDA stream of the thread's current device (cuda:0 on a thread that
    never set one: a CUDA context on GPU 0 from every rank) and synchronizes it, has nothing to do:
    ``per_thread_copy_ahead=0`` picks its serial loader, which never touches CUDA."""
    if folder.is_local:
        writer = dcp.FileSystemWriter(folder.dcp_path, sync_files=True, per_thread_copy_ahead=0)
    else:
        writer = dcp.FileSystemWriter(folder.dcp_path, sync_files=False, thread_count=UPLOAD_THREADS, per_thread_copy_ahead=0)
    writer.fs = folder.dcp_files()
    writer.path = writer.fs.init_path(folder.dcp_path)  # a Path locally: torch 2.6's FileSystem.mkdir takes no str
    return writer


class _Reader(dcp.FileSystemReader):
    """DCP's reader of ``directory``, every file opened through the folder's ``dcp_files``, and its metadata
    read first by ``_read_metadata`` (restricted, see [Note: untrusted checkpoints] in ``pickles.py``)
    and handed to DCP, in place of DCP's own ``pickle.load`` of .metadata; ``metadata``: that, read
    already (by ``read_dcp_metadata``) for this load. Tensor items are loaded as DCP loads them, each
    distinct pickle unpickled once (see [Note: one unpickling per distinct pickle] in ``pickles.py``)."""

    def __init__(self, directory: Any, metadata: Any = None) -> None:
        folder = as_folder(directory)
        super().__init__(folder.dcp_path if folder.is_local else ".")
        self.fs = folder.dcp_files()
        self.path = self.fs.init_path(folder.dcp_path)  # a Path locally, as torch 2.6 needs
        self._metadata = _read_metadata(directory) if metadata is None else metadata
        _check_files_inside(directory, self._metadata)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs.get("rank") is not None:  # a rank's own metadata, asked for where .metadata is missing
            raise FileNotFoundError("a lightning-zero checkpoint holds one .metadata for all ranks, and no other")
        storage_meta = getattr(self._metadata, "storage_meta", None)
        if storage_meta is not None and hasattr(self, "load_id"):
            storage_meta.load_id = self.load_id  # as DCP's reader tags the metadata of each load
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """DCP's ``FileSystemReader.read_data``, with ``torch.load`` of each tensor item and its copy
        into the target replaced by ``DcpTensorItems`` (``read_into`` where the target takes the whole
        item, else ``load``); items that DCP's extensions transformed (lightning-zero writes none)
        are DCP's own business."""
        if any(getattr(self.storage_data[item.storage_index], "transform_descriptors", None) for item in plan.items):
            return super().read_data(plan, planner)
        tensor_items = DcpTensorItems()
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for item in items:
                    file_slice = self._slice_file(stream, self.storage_data[item.storage_index])
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(file_slice.read(-1)))
                        continue
                    target = planner.resolve_tensor(item).detach()
                    whole = not any(item.storage_offsets) and tuple(item.lengths) == tuple(target.size())
                    if whole and tensor_items.read_into(file_slice, target):
                        planner.commit_tensor(item, target)
                        continue
                    file_slice.seek(0)
                    tensor = narrow_tensor_by_index(tensor_items.load(file_slice), item.storage_offsets, item.lengths)
                    if target.size() != tensor.size():
                        raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done


def _check_files_inside(directory: Any, metadata: Any) -> None:
    """Refuse metadata that names a file outside ``directory`` (an absolute path, a subfolder or
    ``..``): DCP would read wherever it points. Ours names plain files beside it."""
    names = {info.relative_path for info in metadata.storage_data.values()}
    outside = sorted(name for name in names if os.path.basename(name) != name or name in ("", ".", ".."))
    if outside:
        raise CorruptCheckpointError(
            f"Checkpoint {str(directory)!r} is damaged: its DCP metadata names {outside[0]!r}, which is not a file in"
            " the checkpoint's directory; nothing was read. Restore the checkpoint from a copy you trust."
        )


def _reader(directory: Any, metadata: Any = None) -> dcp.FileSystemReader:
    return _Reader(directory, metadata)


def _dcp_failure(err: BaseException) -> tuple[Optional[str], str, str]:
    """(file, cause, which ranks) of a DCP failure: the lowest failing rank's error, unwrapped."""
    if isinstance(err, CheckpointException) and err.failures:
        ranks = sorted(err.failures)
        first = err.failures[ranks[0]][0]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    else:
        first, who = err, f"rank {dist.get_rank()}" if dist.is_initialized() else "this process"
    if isinstance(first, ShardFileError):
        return first.name, first.cause, who
    return None, describe(first), who


# ---- writing ------------------------------------------------------------------------------------
def write_directory(
    directory: Any, tensors: dict[str, Tensor], meta: Union[dict[str, Any], bytes], manifest: Manifest, group: CheckpointGroup
) -> None:
    """Every rank writes its chunks into ``directory`` (a path, or a ``RemoteFolder`` being written)
    and checksums them; rank 0 then writes meta.pt (``meta``, or its bytes from ``serialize_meta``)
    and, last, the manifest with every file's size and checksum. If any of it fails, every rank
    raises the same ``CheckpointWriteError``."""
    folder = as_folder(directory)
    writer = _writer(folder)
    try:
        # rank 0 writes the buffers and every other whole entry, as DDP's checkpoint holds rank 0's
        dcp.save(tensors, storage_writer=writer, planner=RankZeroWholeEntries(), process_group=group.group)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises alike on every rank
        name, cause, who = _dcp_failure(err)
        detail = f"{cause} while writing {folder.name}/{name} ({who})" if name else f"{cause} ({who})"
        raise CheckpointWriteError(f"Checkpoint {str(folder)!r} could not be written: {detail}.", detail) from err
    # DCP's save returns once every rank's shards and .metadata are written
    rank = group.rank
    checksums: dict[str, int] = {}
    if folder.is_local:
        own = lambda: _checksum_own_files(folder.path, rank, group.size)  # noqa: E731
    else:
        own = lambda: {name: crc for name, (crc, _) in writer.fs.written.items()}  # noqa: E731 - taken while streaming
    for sums in on_every_rank(group, own):
        checksums.update(sums)
    on_every_rank(group, lambda: _write_meta_and_manifest(folder, meta, manifest, checksums) if rank == 0 else None)


def _checksum_own_files(directory: Path, rank: int, world_size: int) -> dict[str, int]:
    """Read back right after writing, so still in the page cache: the cheapest moment."""
    with _writing(directory, "while reading back the shard files for their checksums", rank):
        return checksum_files(directory, _written_by(directory, rank, world_size))


def serialize_meta(directory: Any, meta: dict[str, Any]) -> bytes:
    """meta.pt's bytes; a failure raises the ``CheckpointWriteError`` that writing it would (rank 0)."""
    folder = as_folder(directory)
    with _writing(folder, f"while writing {folder.name}/{META_NAME}", 0):
        buffer = io.BytesIO()
        save_torch_file(meta, buffer)
        return buffer.getvalue()


def _write_meta_and_manifest(directory: Any, meta: Union[dict[str, Any], bytes], manifest: Manifest, checksums: dict[str, int]) -> None:
    # serialized first, so that a full disk is reported as the OS words it
    folder = as_folder(directory)
    data = meta if isinstance(meta, bytes) else serialize_meta(folder, meta)
    with _writing(folder, f"while writing {folder.name}/{META_NAME}", 0):
        folder.write_file(META_NAME, data)
    with _writing(folder, f"while writing {folder.name}/{MANIFEST_NAME}", 0):
        if not folder.is_local:  # the manifest names the version folder it commits (remote.py)
            manifest.format, manifest.content = REMOTE_FORMAT, folder.content or ""
        manifest.record_files(folder, {**checksums, META_NAME: bytes_checksum(data)})
        manifest.write(folder)


@contextmanager
def _writing(directory: Any, doing: str, rank: int) -> Generator[None, None, None]:
    """Errors inside become ``CheckpointWriteError`` naming the checkpoint, the cause and the file."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised with the file named
        detail = f"{describe(err)} {doing} (rank {rank})"
        raise CheckpointWriteError(f"Checkpoint {str(directory)!r} could not be written: {detail}.", detail) from err


_DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")


def _written_by(directory: Path, rank: int, world_size: int) -> list[str]:
    """The files DCP's ``FileSystemWriter`` wrote for ``rank`` (it names them ``__<rank>_<n>.distcp``,
    by rank in the process group); rank 0, DCP's coordinator, also takes .metadata and anything else."""

    def owner(name: str) -> int:
        match = _DCP_SHARD.fullmatch(name)
        return int(match[1]) if match and int(match[1]) < world_size else 0

    return [p.name for p in sorted(directory.iterdir()) if owner(p.name) == rank]


# ---- reading ------------------------------------------------------------------------------------
def verify_on_ranks(directory: Any, group: CheckpointGroup) -> Manifest:
    """The manifest, once every rank has checked its share of the files (sizes and checksums) and
    all agree that none is damaged; otherwise every rank raises the same error, naming the file."""
    manifest: list[Manifest] = []

    def check_share() -> None:
        manifest.append(Manifest.read(directory))
        check_files(directory, manifest[0], share(manifest[0].files, group.rank, group.size))

    on_every_rank(group, check_share)
    return manifest[0]


def read_meta(directory: Any, weights_only: Optional[bool]) -> dict[str, Any]:
    """meta.pt, unpickled as ``torch.load`` unpickles a checkpoint file under ``weights_only`` (see
    [Note: untrusted checkpoints] in ``pickles.py``); a refused global raises ``UntrustedCheckpointError``."""
    folder = as_folder(directory)
    try:
        if folder.is_local:
            return load_torch_file(folder.path / META_NAME, weights_only, directory, META_NAME)
        with folder.open(META_NAME) as f:
            data = io.BytesIO(f.read())  # a few kB to MB: the rest of the Lightning checkpoint
        return load_torch_file(data, weights_only, directory, META_NAME)
    except UntrustedCheckpointError:
        raise
    except FileNotFoundError:
        raise CorruptCheckpointError(f"Checkpoint {str(directory)!r} is damaged: {META_NAME} is missing.") from None
    except Exception as err:  # noqa: BLE001 - torch.load raises many kinds for a damaged file
        raise CorruptCheckpointError(f"Checkpoint {str(directory)!r} is damaged: {META_NAME} cannot be read ({describe(err)}).") from err


def tensor_metadata(directory: Any, metadata: Any = None) -> dict[str, Any]:
    """DCP's metadata of every tensor saved in ``directory``, by key (full shapes and dtypes);
    ``metadata``: DCP's metadata, read already by ``read_dcp_metadata``."""
    return (_read_metadata(directory) if metadata is None else metadata).state_dict_metadata


def read_dcp_metadata(directory: Any) -> Any:
    """DCP's metadata of ``directory``, unpickled once for a whole load and handed to each of its
    reads (``tensor_metadata``, ``read_tensors``): a 227M GPT's takes ~0.1 s to unpickle."""
    return _read_metadata(directory)


def storage_items(directory: Any) -> list[tuple[str, int, int]]:
    """Where DCP's metadata says each saved item lies: (file, offset, length in bytes)."""
    return sorted((info.relative_path, info.offset, info.length) for info in _read_metadata(directory).storage_data.values())


def _read_metadata(directory: Any) -> Any:
    """DCP's metadata, read with ``DcpMetadataUnpickler`` (never DCP's own ``pickle.load``)."""
    try:
        with as_folder(directory).open(DCP_METADATA_NAME, "rb") as f:
            return load_dcp_metadata(f, directory, DCP_METADATA_NAME)
    except UntrustedCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a missing file or a failed unpickling
        cause = f"{DCP_METADATA_NAME}: {describe(err, with_filename=False)}"
        raise CorruptCheckpointError(f"Checkpoint {str(directory)!r} is damaged: its DCP metadata cannot be read ({cause}).") from err


def read_tensors(targets: dict[str, Tensor], directory: Any, group: Optional[CheckpointGroup], metadata: Any = None) -> None:
    """Fill ``targets`` (plain tensors or DTensor shards, by key) from ``directory``; ``group=None``
    reads in this process alone (the converter), else collectively over ``group``. ``metadata``:
    DCP's metadata, read already by ``read_dcp_metadata``."""
    try:
        if group is None or group.alone:
            with warnings.catch_warnings():  # DCP warns that it assumes a single process: we asked for one
                warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
                load_in_this_process(targets, _reader(directory, metadata))
        else:
            dcp.load(targets, storage_reader=_reader(directory, metadata), process_group=group.group)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises alike on every rank
        name, cause, who = _dcp_failure(err)
        who = "" if group is None or group.alone else f"; {who}"
        if name is None:
            raise CorruptCheckpointError(f"Checkpoint {str(directory)!r} could not be read: {cause}{who}.") from err
        raise CorruptCheckpointError(f"Checkpoint {str(directory)!r} is damaged: {name} cannot be read ({cause}{who}).") from err
