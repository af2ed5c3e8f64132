"""What a strategy's checkpoint calls do under ZeRO: ``ZeroCheckpointing``, which both adapters (the
Trainer's ``ZeroStrategy`` and ``ZeroFabricStrategy``) own and delegate their checkpoint hooks to.

It holds only checkpoint state (the format, the DCP process group, where the last restore came
from); the engine and the module are handed in by the strategy at each call. The formats and their
guarantees are in this package's other modules.

Every save ends with one outcome shared by all ranks: each raises the same error, or none does.
With ``async_save`` a sharded save's writes and commit run in the background and that outcome is
raised by the next save, load or ``wait`` (see [Note: async saves] in ``async_save.py``).
"""

from __future__ import annotations

import uuid
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Protocol, Sequence, Union

from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint import remote
from lightning_zero.checkpoint.async_save import AsyncSaves, FinishedSave
from lightning_zero.checkpoint.atomic import commit, recover, temporary_sibling
from lightning_zero.checkpoint.directory import DirectoryContents, directory_contents, load_directory, save_directory
from lightning_zero.checkpoint.errors import CheckpointWriteError, CorruptCheckpointError, describe
from lightning_zero.checkpoint.folders import Folder, LocalFolder, RemoteFolder
from lightning_zero.checkpoint.frozen import fingerprint, frozen_names
from lightning_zero.checkpoint.group import CheckpointGroup, on_every_rank
from lightning_zero.checkpoint.integrity import check_zip
from lightning_zero.checkpoint.locations import Location, RemoteLocation, checkpoint_location
from lightning_zero.checkpoint.manifest import PathLike
from lightning_zero.checkpoint.pickles import checkpoint_globals, untrusted, weights_only_refusal
from lightning_zero.checkpoint.sharded import entries_over, entry_tensors, model_tensors, optimizer_shards
from lightning_zero.checkpoint.storage import serialize_meta, write_directory
from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.optimizer.averaged_shards import AveragedShards

StateDictType = Literal["sharded", "full"]


def check_state_dict_type(state_dict_type: Any) -> StateDictType:
    if state_dict_type not in ("sharded", "full"):
        raise ValueError(f"`state_dict_type` must be 'sharded' or 'full', got {state_dict_type!r}.")
    return state_dict_type


_FROZEN_NEEDS_SHARDED = (
    "`save_frozen=False` leaves the frozen weights out of sharded checkpoint directories only, and this save"
    ' writes one full file. HINT: keep `state_dict_type="sharded"` (the default) with `save_frozen=False`.'
)


def check_save_frozen(save_frozen: Any, state_dict_type: StateDictType) -> bool:
    """``save_frozen`` is a bool, and False only with sharded saves (a full file holds every weight)."""
    if not isinstance(save_frozen, bool):
        raise TypeError(f"`save_frozen` must be True or False, got {save_frozen!r}.")
    if not save_frozen and state_dict_type != "sharded":
        raise ValueError(_FROZEN_NEEDS_SHARDED)
    return save_frozen


class RankCoordination(Protocol):
    """The strategy's own collectives that a save needs (Lightning's strategies all have them)."""

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: Optional[str] = None) -> None: ...


class ZeroCheckpointing:
    """Sharded directories by default, one DDP-format file with ``state_dict_type="full"``."""

    def __init__(
        self, state_dict_type: StateDictType, timeout: Optional[timedelta] = None, async_save: bool = False, save_frozen: bool = True
    ) -> None:
        self.state_dict_type = check_state_dict_type(state_dict_type)
        if not isinstance(async_save, bool):
            raise TypeError(f"`async_save` must be True or False, got {async_save!r}.")
        self.async_save = async_save
        """Sharded saves write and commit in the background (see ``async_save.py``)."""
        self.save_frozen = check_save_frozen(save_frozen, self.state_dict_type)
        """False: sharded saves leave the frozen parameters out, their fingerprint in their place (``frozen.py``)."""
        self.group = CheckpointGroup(timeout)
        """DCP's gloo group, under the strategy's ``timeout`` like every group the strategy makes."""
        self.saves = AsyncSaves(timeout)
        """The save in flight (``async_save``), its staging buffers and its own gloo group."""
        self.restored_from_directory = False
        """Whether the last ``load`` read a directory (weights and optimizer state are then already
        in the shards, and Lightning's later ``load_*_state_dict`` calls must do nothing)."""

    def saves_directory(self, engine: Optional[ZeroEngine]) -> bool:
        """Sharded format, and an engine whose shards there are to write."""
        return self.state_dict_type == "sharded" and engine is not None

    def module_shards(self, module: nn.Module, engine: ZeroEngine, average: Optional[AveragedShards] = None) -> dict[str, Any]:
        """The ``state_dict`` entry of a sharded checkpoint: this rank's chunks, no communication
        (``average``: of a weight-averaging callback's average instead); not copied, the save copies
        them to the host (see [Note: host copies of a save] in ``sharded.py``)."""
        return model_tensors(module, engine, self.group, average, leave_out=self._left_out(module))

    def _left_out(self, module: nn.Module) -> frozenset[str]:
        """The parameters a save leaves out: the frozen ones with ``save_frozen=False``."""
        return frozenset() if self.save_frozen else frozenset(frozen_names(module))

    def optimizer_shards(self, engine: ZeroEngine, optimizers: Sequence[Optimizer], optimizer: Optimizer) -> Any:
        """One ``optimizer_states`` entry of a sharded checkpoint: this rank's chunks of the state (not
        copied, as ``module_shards``)."""
        index = [id(o) for o in optimizers].index(id(optimizer))
        return optimizer_shards(engine, optimizer, index, self.group)

    def save(
        self,
        ranks: RankCoordination,
        checkpoint: dict[str, Any],
        filepath: PathLike,
        module: nn.Module,
        engine: Optional[ZeroEngine],
        write_file: Callable[[dict[str, Any], Location], None],
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        """Write ``filepath`` (a directory when sharded, else one file written by rank 0 with
        ``write_file``) so that it appears only once complete: an interrupted save leaves the previous
        checkpoint there untouched. A collective; if any rank fails, every rank raises the same
        ``CheckpointWriteError``, the cause and the file on its first line. ``filepath`` may be a URL
        (``storage_options``: its fsspec filesystem's arguments), committed by its manifest (see
        [Note: commits on object storage] in ``remote.py``).

        With ``async_save`` a sharded save returns once this rank's shards are staged, and that error,
        if any, is raised by the next save, load or ``wait`` (one save in flight at a time: this one
        waits for the previous first). A file (``state_dict_type="full"``) is always written here."""
        location = checkpoint_location(filepath, storage_options)
        if isinstance(location, RemoteLocation):  # a missing fsspec package: the same error on every rank
            on_every_rank(self.group, lambda: _open_filesystem(location))
        self.wait()
        token = ranks.broadcast(uuid.uuid4().hex[:8])
        path: Location
        temporary: Union[Path, RemoteFolder, RemoteLocation]
        if isinstance(location, RemoteLocation):
            path = RemoteLocation(ranks.broadcast(location.url), location.storage_options)
            temporary = remote.version_folder(path, token) if self.saves_directory(engine) else path
        else:
            path = Path(ranks.broadcast(str(location)))
            temporary = temporary_sibling(path, token)
        if not self.save_frozen and not self.saves_directory(engine):
            raise ValueError(_FROZEN_NEEDS_SHARDED)
        if self.saves_directory(engine):
            assert engine is not None
            # a collective over every rank's chunks, before any file is written
            frozen = fingerprint(module, engine, self.group, self._left_out(module)) if not self.save_frozen else None
            if self.async_save:
                contents = directory_contents(checkpoint, module, engine, engine.config.stage, ranks.world_size, frozen)
                self._start_background_save(path, temporary, contents)
                return

            def write() -> None:
                save_directory(temporary, checkpoint, module, engine, engine.config.stage, ranks.world_size, self.group, frozen)

        else:

            def write() -> None:
                _on_rank_zero(ranks, lambda: write_file(checkpoint, temporary), f"while writing {temporary.name}")

        _write_and_commit(ranks, path, temporary, write)

    def _start_background_save(self, path: Location, temporary: Union[Path, RemoteFolder], contents: DirectoryContents) -> None:
        """Stage this rank's tensors (and rank 0's meta.pt) — every rank agreeing on the outcome, so a
        failure raises here on all of them — then write and commit on the background thread."""

        staged: dict[str, Any] = {}

        def stage() -> None:
            if self.group.rank == 0:
                staged["meta"] = serialize_meta(temporary, contents.meta)
            try:
                copies = self.saves.staging.stage(entry_tensors(contents.tensors))
                staged["tensors"] = entries_over(contents.tensors, copies, self.group)
            except Exception as err:  # noqa: BLE001 - e.g. out of host memory; raised on every rank
                detail = f"{describe(err)} while copying the shards into staging buffers (rank {self.group.rank})"
                raise CheckpointWriteError(detail, detail) from err

        try:
            on_every_rank(self.group, stage)  # only outcomes travel, never the tensors
        except CheckpointWriteError as err:
            raise _not_saved(path, err) from err
        meta = staged.get("meta", b"")  # only rank 0 writes meta.pt

        def write_in_background(ranks: RankCoordination, group: CheckpointGroup) -> None:
            write = lambda: write_directory(temporary, staged["tensors"], meta, contents.manifest, group)  # noqa: E731
            _write_and_commit(ranks, path, temporary, write)

        self.saves.start_save(path, write_in_background)  # type: ignore[arg-type] - a Path or a RemoteLocation

    def wait(self) -> Optional[FinishedSave]:
        """Wait for the save in flight (``async_save``), if any; raise its ``CheckpointWriteError``
        (on every rank alike) if it failed. Every load and save calls it first."""
        return self.saves.finish_save()

    def after_commit(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the save in flight committed (now if none is; never if it fails)."""
        self.saves.after_commit(work)

    def remove(self, filepath: PathLike, is_global_zero: bool, remove_local: Callable[[], None]) -> None:
        """ModelCheckpoint's removal of a superseded checkpoint, once the save in flight committed:
        at a URL by rank 0, manifest first (``remote.remove``); a local one with ``remove_local``."""
        location = checkpoint_location(filepath)
        if isinstance(location, RemoteLocation):
            self.after_commit(lambda: _remove_remote(location) if is_global_zero else None)
        else:
            self.after_commit(remove_local)

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the asynchronous saves' staging buffers."""
        return self.saves.staging.held_bytes

    def release(self) -> None:
        """At teardown: wait for the save in flight (raising its error) and free the staging buffers."""
        self.saves.release()

    def load(
        self,
        checkpoint_path: PathLike,
        module: nn.Module,
        engine: Optional[ZeroEngine],
        optimizers: Sequence[Optimizer],
        strict: bool,
        read_file: Callable[[Any], dict[str, Any]],
        weights_only: Optional[bool] = None,
        averaging_states: bool = False,
    ) -> dict[str, Any]:
        """A sharded directory is read straight into the shards (any world size, any stage) and what
        Lightning restores itself (loops, schedulers, callbacks, ...) is returned; a file (ours with
        ``state_dict_type="full"``, or one written by DDP) is read with ``read_file``. Both are checked
        against their checksums first; a checkpoint that a crash left under a sibling name while it
        was being replaced is moved back first. ``weights_only``: how the pickles are read, as
        ``torch.load`` reads a file (``read_file`` is given it already; see [Note: untrusted
        checkpoints] in ``pickles.py``). ``averaging_states``: see ``load_directory``."""
        self.wait()  # a save in flight may be the very checkpoint asked for
        location = checkpoint_location(checkpoint_path)
        folder = self.sharded_folder(location)
        self.restored_from_directory = folder is not None
        if folder is not None:
            return load_directory(folder, module, engine, optimizers, strict, self.group, weights_only, averaging_states)
        path = check_file(location)  # the same bytes on every rank, so the same verdict
        try:
            with checkpoint_globals():
                return read_file(path)
        except Exception as err:  # noqa: BLE001 - torch.load raises many kinds for a damaged file
            refused = weights_only_refusal(err)
            if refused is not None:
                raise untrusted(path, "it", refused) from None
            raise CorruptCheckpointError(f"Checkpoint {str(path)!r} is truncated or corrupted ({describe(err)}).") from err

    def sharded_folder(self, location: Location) -> Optional[Folder]:
        """The folder of the sharded checkpoint at ``location``, or None where it is a file (or
        nothing); every rank calls it. A local one that a crash left under a sibling name while it
        was being replaced is moved back first (every rank: they agree on which sibling, whoever
        moves it). At a URL the ranks compare answers: storage that one of them cannot reach (its
        credentials, its network: ``CheckpointReadError``) fails every rank with that rank's error,
        rather than the others waiting for it in the load's first collective."""
        if isinstance(location, RemoteLocation):
            folder = RemoteFolder(location)
            return folder if on_every_rank(self.group, folder.has_manifest)[self.group.rank] else None
        recover(location)
        return LocalFolder(location) if location.is_dir() else None

    @staticmethod
    def load_full_optimizer_states(engine: ZeroEngine, optimizers: Sequence[Optimizer], states: Sequence[Any]) -> None:
        """DDP-format optimizer states (a full-file checkpoint) into the shards. torch's
        ``Optimizer.load_state_dict`` puts each state tensor where its shard lives, so offloaded
        state stays in host memory."""
        if len(states) != len(optimizers):
            raise ValueError(
                f"The checkpoint holds state for {len(states)} optimizers, but `configure_optimizers`"
                f" returned {len(optimizers)}."
            )
        for optimizer, state in zip(optimizers, states):
            engine.load_full_optimizer_state_dict(optimizer, state)


def _open_filesystem(location: RemoteLocation) -> None:
    """Make ``location``'s fsspec filesystem (``MissingFilesystemError`` naming the package to install)."""
    location.fs  # noqa: B018 - a cached property: made here, used by the save


def _remove_remote(location: RemoteLocation) -> None:
    """Rank 0's removal of a superseded checkpoint at a URL: a failure (the endpoint gone) warns, as
    a leftover checkpoint is no reason to stop training, and raising on rank 0 alone would leave the
    other ranks waiting for it at the next collective."""
    try:
        remote.remove(location)
    except Exception as err:  # noqa: BLE001 - reported, never raised on one rank
        warnings.warn(f"Could not remove the superseded checkpoint {location.url!r} ({describe(err)}); delete it yourself.", stacklevel=2)


def check_file(location: Location) -> Union[Path, str]:
    """A checkpoint file's zip records against their CRC-32s; the path (a URL's text) to read it by."""
    if isinstance(location, RemoteLocation):
        fs = location.fs
        if not fs.isfile(location.path):
            leftover = remote.leftovers(location)
            hint = f" (only {leftover[0]!r}, which a save interrupted before its manifest was written left)" if leftover else ""
            raise FileNotFoundError(f"Checkpoint {location.url!r} does not exist{hint}.")
        with fs.open(location.path, "rb") as f:
            check_zip(f, location.url)
        return location.url
    if not location.exists():
        raise FileNotFoundError(f"Checkpoint {str(location)!r} does not exist.")
    check_zip(location)
    return location


def _write_and_commit(
    ranks: RankCoordination, path: Location, temporary: Union[Path, RemoteFolder, RemoteLocation], write: Callable[[], None]
) -> None:
    """``write`` the checkpoint into ``temporary``, then commit it (rank 0): a local one moved to
    ``path``; at a URL, where the manifest (or the file's upload) committed it already, what it
    supersedes deleted. Every rank raises the same ``CheckpointWriteError`` if either fails."""
    try:
        write()
        _on_rank_zero(ranks, lambda: _commit(path, temporary), f"while moving {temporary.name} into its place")
    except CheckpointWriteError as err:
        raise _not_saved(path, err) from err


def _commit(path: Location, temporary: Union[Path, RemoteFolder, RemoteLocation]) -> None:
    if isinstance(temporary, RemoteFolder):
        remote.finish_commit(temporary)
    elif isinstance(path, Path):
        assert isinstance(temporary, Path)
        commit(temporary, path)
    # else: a file at a URL, published by its upload's completion


def _not_saved(path: Location, err: CheckpointWriteError) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"Checkpoint {str(path)!r} was not saved: {err.detail}; the checkpoint saved there before, if any, is untouched."
    )


def _on_rank_zero(ranks: RankCoordination, work: Callable[[], None], doing: str) -> None:
    """Rank 0 runs ``work`` (a file write or the commit); every rank then raises the same
    ``CheckpointWriteError`` if it failed. The broadcast doubles as the barrier that ends the step."""
    error = None
    if ranks.is_global_zero:
        try:
            work()
        except Exception as err:  # noqa: BLE001 - shared with every rank, raised there
            error = f"{describe(err)} {doing} (rank 0)"
    error = ranks.broadcast(error)
    if error is not None:
        raise CheckpointWriteError(error)
