"""Asynchronous sharded saves (``async_save=True``) on 2 CPU ranks: a resume from an async save is
bitwise a resume from a synchronous one; training steps run while a (slowed) write is in flight;
a failed background write raises the synchronous path's error on every rank, at the next save or
at the end of ``fit``, with the previous checkpoint intact; ModelCheckpoint removes a superseded
checkpoint only after the new one committed; ``fit`` leaves a complete checkpoint; Fabric's
save/load round trip. Ordering is asserted on recorded events, never on durations."""

from __future__ import annotations

import copy
import os
import re
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from torch.overrides import TorchFunctionMode
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.pytorch.callbacks import Callback

GROUP = CaseGroup(world_size=2, timeout=120)


class _StateAtStart(Callback):
    """After a checkpoint is restored (before any step): full weights and full optimizer state."""

    def on_train_start(self, trainer, pl_module) -> None:
        with trainer.strategy.summon_full_params():
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.strategy.engine.full_optimizer_state_dict(trainer.optimizers[0]))


class _Events(Callback):
    """Records ("batch_end", step) after each training batch, and saves to ``path`` after the
    batches in ``save_at`` (1-based steps) with ``trainer.save_checkpoint``."""

    def __init__(self, events: list, path: str = "", save_at: tuple[int, ...] = ()) -> None:
        self.events, self.path, self.save_at = events, path, save_at
        self.staging_bytes = 0

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        self.events.append(("batch_end", trainer.global_step))
        if trainer.global_step in self.save_at:
            trainer.save_checkpoint(self.path)
            self.events.append(("save_returned", trainer.global_step))
            self.staging_bytes = trainer.strategy.memory_report().checkpoint_staging


@contextmanager
def _patched(module: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, make(original))
    try:
        yield
    finally:
        setattr(module, name, original)


@contextmanager
def _recording_commits(events: list) -> Iterator[None]:
    """("committed", path name) on every rank when a save's write-and-commit step returns."""
    from lightning_zero.checkpoint import checkpointing

    def make(original: Callable) -> Callable:
        def write_and_commit(ranks, path, temporary, write) -> None:
            original(ranks, path, temporary, write)
            events.append(("committed", path.name))

        return write_and_commit

    with _patched(checkpointing, "_write_and_commit", make):
        yield


@contextmanager
def _slowed_meta_writes(before_writing: Callable[[], None]) -> Iterator[None]:
    """Rank 0's meta.pt + manifest step (the save's last write) calls ``before_writing()`` first."""
    from lightning_zero.checkpoint import storage

    def make(original: Callable) -> Callable:
        def write(*args: Any) -> None:
            before_writing()
            original(*args)

        return write

    with _patched(storage, "_write_meta_and_manifest", make):
        yield


def _fit(strategy: Any, steps: int, callbacks: list, **kwargs: Any) -> Any:
    from lightning_helpers import fit_and_record

    return fit_and_record(strategy, steps, callbacks=callbacks, **kwargs)[2]


def _zero(stage: int, async_save: bool) -> Any:
    from lightning_zero import ZeroStrategy

    return ZeroStrategy(stage=stage, async_save=async_save)


# ---- resume equality --------------------------------------------------------------------------------------
@GROUP.case
def resume_bitwise(ctx: RankContext) -> dict[str, Any]:
    """zero3 fits of 3 steps saving at step 3, asynchronously and not; a resume from each: the
    weights and optimizer state at train start."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out: dict[str, Any] = {}
    for async_save in (True, False):
        folder = os.path.join(ctx.tmpdir, f"resume_{async_save}")
        ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1)
        _fit(_zero(3, async_save), 3, [ckpt], enable_checkpointing=True)
        probe = _StateAtStart()
        _fit(_zero(3, False), 4, [probe], ckpt_path=os.path.join(folder, "epoch=0-step=3.ckpt"))
        out[async_save] = {"weights": probe.weights, "optimizer": probe.optimizer}
    return out


# ---- training goes on while the write is in flight ----------------------------------------------------------
@GROUP.case
def training_overlaps_the_write(ctx: RankContext) -> dict[str, Any]:
    """zero2, 4 steps, a save at step 1 whose last write waits until this rank's training ended
    step 3 (or 30 s, if it never could: a synchronous save would block that training). Events, and
    the staging bytes the memory report gave during fit and after it."""
    events: list = []
    step3 = threading.Event()

    class Signal(Callback):
        def on_train_batch_end(self, trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                step3.set()

    path = os.path.join(ctx.tmpdir, "overlap.ckpt")
    recorder = _Events(events, path, save_at=(1,))
    with _recording_commits(events), _slowed_meta_writes(lambda: step3.wait(30)):
        trainer = _fit(_zero(2, True), 4, [recorder, Signal()])
    from lightning_zero.checkpoint import verify_checkpoint

    verify_checkpoint(path)
    return {"events": events, "staging": recorder.staging_bytes, "staging_after_fit": trainer.strategy.memory_report().checkpoint_staging}


# ---- ModelCheckpoint's top-k removal -------------------------------------------------------------------------
@GROUP.case
def top_k_removes_after_commit(ctx: RankContext) -> dict[str, Any]:
    """zero2, ModelCheckpoint every step with save_top_k=1, the last write of each save slowed:
    the order of commits and removals, and what is left."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    events: list = []
    folder = os.path.join(ctx.tmpdir, "topk")

    def make(original: Callable) -> Callable:
        def remove(self, filepath) -> None:
            events.append(("removed", os.path.basename(filepath)))
            original(self, filepath)

        return remove

    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=1)
    with _recording_commits(events), _slowed_meta_writes(lambda: time.sleep(0.2)), _patched(DDPStrategy, "remove_checkpoint", make):
        _fit(_zero(2, True), 3, [ckpt], enable_checkpointing=True)
    from lightning_zero.checkpoint import verify_checkpoint

    torch.distributed.barrier()  # rank 0 removes (and fit returned there once it had)
    left = sorted(os.listdir(folder))
    for name in left:
        verify_checkpoint(os.path.join(folder, name))
    return {"events": events, "left": left}


# ---- a failing background write ------------------------------------------------------------------------------
@contextmanager
def _failing_manifest_write(at_save: int) -> Iterator[None]:
    """The ``at_save``-th save (1-based) fails on rank 0 writing its manifest (the last file): a full disk."""
    from lightning_zero.checkpoint.manifest import Manifest

    count = [0]

    def make(original: Callable) -> Callable:
        def write(self, directory) -> None:
            count[0] += 1
            if count[0] == at_save:
                raise OSError(28, os.strerror(28))
            original(self, directory)

        return write

    with _patched(Manifest, "write", make):
        yield


def _fit_failing(strategy: Any, steps: int, path: str, save_at: tuple[int, ...], failing_save: int) -> dict[str, Any]:
    from lightning_zero.checkpoint import CheckpointWriteError

    events: list = []
    raised: Optional[BaseException] = None
    with _failing_manifest_write(failing_save):
        try:
            _fit(strategy, steps, [_Events(events, path, save_at)])
        except CheckpointWriteError as err:
            raised = err
    last = [e for e in events if e[0] == "batch_end"][-1][1]
    return {"type": type(raised).__name__, "message": str(raised), "raised_after_step": last, "events": events}


@GROUP.case
def failed_write(ctx: RankContext) -> dict[str, Any]:
    """Saves to one path at steps 1, 2 and 3, the second failing: async (raised at the 3rd save),
    sync (raised at once); async saving at steps 1 and 2 of 2 (raised at the end of fit). What
    each raised, and what the path holds after (the step-1 checkpoint, verified)."""
    from lightning_zero.checkpoint import verify_checkpoint
    from lightning_zero.checkpoint.storage import read_meta

    out: dict[str, Any] = {}
    for name, async_save, steps in (("async_next_save", True, 4), ("sync", False, 4), ("async_end_of_fit", True, 2)):
        path = os.path.join(ctx.tmpdir, f"failing_{name}.ckpt")
        out[name] = _fit_failing(_zero(2, async_save), steps, path, save_at=(1, 2, 3), failing_save=2)
        verify_checkpoint(path)
        out[name]["kept_step"] = read_meta(path, weights_only=False)["global_step"]
        out[name]["leftovers"] = sorted(n for n in os.listdir(ctx.tmpdir) if n.startswith(f"failing_{name}.ckpt."))
    return out


# ---- fit leaves a complete checkpoint -----------------------------------------------------------------------
@GROUP.case
def fit_ends_with_the_save_committed(ctx: RankContext) -> list:
    """zero3, 2 steps, a save at the last step whose last write is slowed: events, and the
    checkpoint verified right after ``fit`` returns."""
    from lightning_zero.checkpoint import verify_checkpoint

    events: list = []
    path = os.path.join(ctx.tmpdir, "last_step.ckpt")
    with _recording_commits(events), _slowed_meta_writes(lambda: time.sleep(0.3)):
        _fit(_zero(3, True), 2, [_Events(events, path, save_at=(2,))])
    events.append(("fit_returned",))
    verify_checkpoint(path)
    return events


# ---- Fabric --------------------------------------------------------------------------------------------------
@GROUP.case
def fabric_round_trip(ctx: RankContext) -> dict[str, Any]:
    """Fabric zero3 with async_save: save after 2 steps (slowed), 2 more steps, then a fresh zero1
    model loads it and runs the same 2 steps: max |difference| of the weights; teardown waits."""
    from fabric_loop import batches_for, fabric_for, full_weights, small_gpt

    def adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)

    def step(fabric: Any, model: Any, optimizer: Any, batch: torch.Tensor) -> None:
        fabric.backward(model(batch[:, :-1], batch[:, 1:])[1])
        optimizer.step()
        optimizer.zero_grad()

    path = os.path.join(ctx.tmpdir, "fabric_async")
    batches = batches_for(ctx.rank, 4)
    events: list = []
    fabric = fabric_for("zero3", async_save=True)
    fabric.seed_everything(0)
    module = small_gpt()
    model, optimizer = fabric.setup(module, adamw(module))
    for batch in batches[:2]:
        step(fabric, model, optimizer, batch)
    with _recording_commits(events), _slowed_meta_writes(lambda: time.sleep(0.2)):
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
        events.append(("save_returned",))
        for batch in batches[2:]:
            step(fabric, model, optimizer, batch)
        events.append(("steps_done",))
        expected = full_weights(fabric, model)
        staging = fabric.strategy.memory_report().checkpoint_staging
        fabric.strategy.wait_for_checkpoint()

    fabric = fabric_for("zero1")
    fabric.seed_everything(1)
    module = small_gpt()
    model, optimizer = fabric.setup(module, adamw(module))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    for batch in batches[2:]:
        step(fabric, model, optimizer, batch)
    actual = full_weights(fabric, model)

    # teardown waits for a save in flight
    teardown_path = os.path.join(ctx.tmpdir, "fabric_teardown")
    saver = fabric_for("zero2", async_save=True)
    module = small_gpt()
    model, optimizer = saver.setup(module, adamw(module))
    with _slowed_meta_writes(lambda: time.sleep(0.2)):
        saver.save(teardown_path, {"model": model, "optimizer": optimizer})
        saver.strategy.teardown()
    from lightning_zero.checkpoint import verify_checkpoint

    verify_checkpoint(teardown_path)
    return {
        "diff": max((actual[k] - expected[k]).abs().max().item() for k in expected),
        "step": state["step"],
        "events": events,
        "staging": staging,
    }


# ---- one host copy per saved tensor ---------------------------------------------------------------------------
class _HostTransfers(TorchFunctionMode):
    """Counts, by the source's place (storage, offset, numel, dtype), each request to bring a tensor
    to the host: ``.to(<cpu>)`` / ``.cpu()`` and a ``copy_`` into a host tensor. On a GPU each is a
    device-to-host copy (a blocking ``.to`` also a host sync); on a CPU run ``.to("cpu")`` returns the
    tensor itself, so counting requests is how a CPU sees the copies the same code makes on a GPU.
    Counts this thread only (torch's mode stack is per thread): the save's foreground; and not inside
    ``not_counting`` (DCP's writing, handed host tensors only: its loader's ``.cpu()`` of each is a
    no-op on any machine)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[tuple, int] = {}
        self.counting = True

    def not_counting(self, original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.counting = False
            try:
                return original(*args, **kwargs)
            finally:
                self.counting = True

        return call

    @staticmethod
    def place(t: torch.Tensor) -> tuple:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        source = None
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and any(_names_host(a) for a in (*args[1:], *kwargs.values()))):
            source = args[0]
        elif func is torch.Tensor.copy_ and args[0].device.type == "cpu":
            source = args[1]
        if self.counting and isinstance(source, torch.Tensor) and source.numel() > 0:
            key = self.place(source)
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **kwargs)

    def of(self, t: torch.Tensor) -> int:
        return self.counts.get(self.place(t), 0)


def _names_host(arg: Any) -> bool:
    return (isinstance(arg, str) and arg.startswith("cpu")) or (isinstance(arg, torch.device) and arg.type == "cpu")


class _Ranks:
    """What ``ZeroCheckpointing.save`` needs of the strategy, over the default group."""

    def __init__(self, ctx: RankContext) -> None:
        self.is_global_zero, self.world_size = ctx.rank == 0, ctx.world_size

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    def barrier(self, name: Optional[str] = None) -> None:
        torch.distributed.barrier()


COPY_CONFIGS = {
    "zero1": {"stage": 1},
    "zero1_offload": {"stage": 1, "offload_optimizer": True},
    "zero2": {"stage": 2},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3": {"stage": 3},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
}


def _engine(config: dict[str, Any], seed: int) -> tuple[Any, Any, Any, Callable[[int], None]]:
    """``OddShapes`` (a 1-element parameter: an empty chunk on rank 1) with a buffer, AdamW, under
    the engine at ``config``; and a step on the ``i``-th batch of this rank."""
    from models import OddShapes, batches

    from lightning_zero.engine import ZeroConfig, ZeroEngine

    torch.manual_seed(seed)
    model = OddShapes()
    model.register_buffer("counts", torch.arange(5.0) + seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(**config))
    data = batches(torch.distributed.get_rank() + 10 * seed, 4)

    def step(i: int) -> None:
        x, y = data[i]
        engine.begin_step()
        torch.nn.functional.mse_loss(model(x), y).backward()
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()

    return model, optimizer, engine, step


def _engine_state(model: Any, engine: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """This rank's chunks, its optimizer state and the buffer, cloned."""
    chunks = engine.weight_chunks()
    state = {f"chunk/{sp.name}": chunks[id(sp)].clone() for sp in engine.params}
    for position, values in engine.optimizer_chunked_state(optimizer)[0]["state"].items():
        state.update({f"optim/{position}/{key}": torch.as_tensor(v).clone() for key, v in values.items()})
    state["buffer/counts"] = model.counts.clone()
    return state


@GROUP.case
def one_host_copy_per_tensor(ctx: RankContext) -> dict[str, Any]:
    """At every ``COPY_CONFIGS`` entry, engine-level: after a step, an asynchronous save (its entries
    and its staging counted by ``_HostTransfers``), a step while its write is in flight, then a
    synchronous save (counted alike); each loaded into a fresh engine. Per config: the host
    transfers of every saved tensor, per save, and the keys whose loaded values differ from the
    state each save was made of."""
    from torch.distributed.tensor import DTensor

    from lightning_zero.checkpoint import directory
    from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing

    async_saves = ZeroCheckpointing("sharded", async_save=True)  # one arena, arranged again for each config
    sync_saves = ZeroCheckpointing("sharded")
    out: dict[str, Any] = {}
    for label, config in COPY_CONFIGS.items():
        model, optimizer, engine, step = _engine(config, seed=0)
        step(0)
        saved: dict[str, dict[str, torch.Tensor]] = {}
        transfers: dict[str, list[int]] = {}
        for kind, checkpointing in (("async", async_saves), ("sync", sync_saves)):
            saved[kind] = _engine_state(model, engine, optimizer)
            with _HostTransfers() as counting, _patched(directory, "write_directory", counting.not_counting):
                checkpoint = {
                    "state_dict": checkpointing.module_shards(model, engine),
                    "optimizer_states": [checkpointing.optimizer_shards(engine, [optimizer], optimizer)],
                }
                entries = {**checkpoint["state_dict"], **checkpoint["optimizer_states"][0].tensors}
                entries = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entries.items()}
                path = os.path.join(ctx.tmpdir, f"copies_{label}_{kind}")
                checkpointing.save(_Ranks(ctx), checkpoint, path, model, engine, write_file=lambda c, p: None)
            transfers[kind] = sorted(counting.of(t) for t in entries.values() if t.numel() > 0)
            step(1)  # the async save's write may still be in flight
        async_saves.wait()
        differing = {}
        for kind in ("async", "sync"):
            fresh_model, fresh_optimizer, fresh_engine, fresh_step = _engine(config, seed=1)
            fresh_step(0)  # state of its own, which the load replaces
            sync_saves.load(os.path.join(ctx.tmpdir, f"copies_{label}_{kind}"), fresh_model, fresh_engine, [fresh_optimizer], True,
                            read_file=lambda p: {}, weights_only=True)  # fmt: skip
            loaded = _engine_state(fresh_model, fresh_engine, fresh_optimizer)
            keys = saved[kind].keys() | loaded.keys()
            differing[kind] = sorted(k for k in keys if k not in saved[kind] or k not in loaded or not torch.equal(saved[kind][k], loaded[k]))
            fresh_engine.close()
        engine.close()
        out[label] = {"transfers": transfers, "differing": differing, "saved_keys": len(saved["async"])}
    async_saves.release()
    return out


@GROUP.case
def device_entries_on_the_host(ctx: RankContext) -> dict[str, Any]:
    """Chunks on a device, with the "meta" device standing in for CUDA (a CPU has no other): their
    entries' meshes (1-D, and hybrid with shard groups of 1), and those entries rebuilt over host
    copies (what both saves hand DCP)."""
    from lightning_zero.checkpoint.group import CheckpointGroup
    from lightning_zero.checkpoint.sharded import _flat_dtensor, entries_over

    group, out = CheckpointGroup(), {}
    for label, shard_group_size in (("flat", None), ("hybrid", 1)):
        mesh = group.mesh_for(shard_group_size, "meta")
        entry = _flat_dtensor(torch.empty(3, device="meta"), 3 * ctx.world_size if shard_group_size is None else 3, mesh)
        host = entries_over({"chunk": entry, "plain": torch.ones(2), "value": 7}, {"chunk": torch.arange(3.0), "plain": torch.zeros(2)}, group)
        out[label] = {
            "entry_mesh": (entry.device_mesh.device_type, entry.device.type),
            "same_mesh_again": group.mesh_for(shard_group_size, "meta") is mesh,
            "host_mesh_is_the_cpus": group.host_mesh(mesh) is group.mesh_for(shard_group_size),
            "host": (host["chunk"].device_mesh.device_type, host["chunk"].to_local().tolist(), tuple(host["chunk"].shape),
                     host["chunk"].placements == entry.placements, host["plain"].tolist(), host["value"]),
        }  # fmt: skip
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("async_save"))


def test_resume_from_an_async_save_is_bitwise_a_resume_from_a_sync_one(results: GroupResults) -> None:
    for rank in results["resume_bitwise"]:
        async_state, sync_state = rank[True], rank[False]
        assert async_state["weights"].keys() == sync_state["weights"].keys()
        for key, value in sync_state["weights"].items():
            assert torch.equal(async_state["weights"][key], value), key
        assert _flatten(async_state["optimizer"]) == _flatten(sync_state["optimizer"])


def _flatten(state: Any) -> Any:
    """Tensors as (dtype, shape, values) so that `==` compares them exactly."""
    if isinstance(state, torch.Tensor):
        return (state.dtype, tuple(state.shape), state.flatten().tolist())
    if isinstance(state, dict):
        return {k: _flatten(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_flatten(v) for v in state]
    return state


def test_training_steps_run_while_the_write_is_in_flight(results: GroupResults) -> None:
    for rank, out in enumerate(results["training_overlaps_the_write"]):
        events = out["events"]
        assert out["staging"] > 0 and out["staging_after_fit"] == 0  # counted while held; freed at teardown
        committed = events.index(("committed", "overlap.ckpt"))
        assert events.index(("save_returned", 1)) < events.index(("batch_end", 2)) < events.index(("batch_end", 3)) < committed, (
            f"rank {rank}: {events}"
        )


def test_model_checkpoint_removes_the_superseded_checkpoint_only_after_the_new_one_committed(results: GroupResults) -> None:
    for rank, out in enumerate(results["top_k_removes_after_commit"]):
        events = out["events"]
        assert out["left"] == ["epoch=0-step=3.ckpt"], f"rank {rank}: {out['left']}"
        for step in (1, 2):  # step k's checkpoint goes once step k+1's committed
            removed = ("removed", f"epoch=0-step={step}.ckpt")  # called on every rank; rank 0 removes
            assert events.index(("committed", f"epoch=0-step={step + 1}.ckpt")) < events.index(removed), events


def test_a_failed_background_write_raises_the_sync_error_on_every_rank_and_keeps_the_previous_checkpoint(results: GroupResults) -> None:
    ranks = results["failed_write"]

    def normalized(message: str) -> str:
        return re.sub(r"\.tmp-\w+", ".tmp-X", message.replace("failing_async_next_save", "P").replace("failing_sync", "P"))

    for rank, out in enumerate(ranks):
        for name in ("async_next_save", "sync", "async_end_of_fit"):
            case = out[name]
            assert case["type"] == "CheckpointWriteError", f"rank {rank} {name}: {case}"
            assert "No space left on device while writing" in case["message"] and "lightning_zero.json (rank 0)" in case["message"]
            assert case["kept_step"] == 1, f"rank {rank} {name}: {case}"
            assert len(case["leftovers"]) == len(out["sync"]["leftovers"])  # the failed save's sibling, as a sync one leaves it
            assert case["message"] == ranks[0][name]["message"]  # the same error on every rank
        assert normalized(out["async_next_save"]["message"]) == normalized(out["sync"]["message"])
        assert out["sync"]["raised_after_step"] == 2  # at the failing save itself
        assert out["async_next_save"]["raised_after_step"] == 3  # at the next save
        assert ("save_returned", 3) not in out["async_next_save"]["events"]
        assert out["async_end_of_fit"]["raised_after_step"] == 2  # no later save: at the end of fit


def test_fit_ends_with_its_last_save_committed(results: GroupResults) -> None:
    for rank, events in enumerate(results["fit_ends_with_the_save_committed"]):
        assert events.index(("save_returned", 2)) < events.index(("committed", "last_step.ckpt")) < events.index(("fit_returned",))


def test_fabric_async_save_then_load_round_trip(results: GroupResults) -> None:
    for out in results["fabric_round_trip"]:
        assert out["diff"] == 0.0 and out["step"] == 2
        assert out["events"].index(("save_returned",)) < out["events"].index(("committed", "fabric_async"))
        assert out["staging"] > 0


@pytest.mark.parametrize("label", list(COPY_CONFIGS))
def test_a_save_brings_each_tensor_to_the_host_once_and_loads_back_bitwise(results: GroupResults, label: str) -> None:
    """Asynchronous: each tensor straight into the staging arena (once; no copy made by the
    checkpoint hooks first); synchronous: once as before. Both loaded back bitwise, the async one
    after a step taken while its write was in flight."""
    for rank, out in enumerate(results["one_host_copy_per_tensor"]):
        case = out[label]
        for kind in ("async", "sync"):
            assert case["transfers"][kind] and set(case["transfers"][kind]) == {1}, f"rank {rank} {kind}: {case['transfers'][kind]}"
            assert case["differing"][kind] == [], f"rank {rank} {kind}: {case['differing'][kind]}"
        assert case["saved_keys"] > 10


def test_device_chunks_are_entries_on_a_mesh_of_their_device_and_written_from_the_cpus(results: GroupResults) -> None:
    for out in results["device_entries_on_the_host"]:
        for label, shape in (("flat", (6,)), ("hybrid", (3,))):
            case = out[label]
            assert case["entry_mesh"] == ("meta", "meta") and case["same_mesh_again"] and case["host_mesh_is_the_cpus"], case
            assert case["host"] == ("cpu", [0.0, 1.0, 2.0], shape, True, [0.0, 0.0], 7), case


# ---- one process ---------------------------------------------------------------------------------------------
def test_staging_buffers_are_reused_and_copies():
    from lightning_zero.checkpoint.async_save import StagingBuffers

    staging = StagingBuffers()
    live = {"a": torch.arange(6.0), "b": torch.tensor(3)}
    first = staging.stage(live)
    live["a"].add_(1)  # training goes on: the staged copy keeps the saved values
    assert torch.equal(first["a"], torch.arange(6.0)) and torch.equal(first["b"], torch.tensor(3))
    # one arena: every tensor a view of the same storage, each place aligned
    assert first["a"].untyped_storage().data_ptr() == first["b"].untyped_storage().data_ptr()
    assert staging.held_bytes == 2 * StagingBuffers.ALIGNMENT
    second = staging.stage(live)
    assert second["a"].data_ptr() == first["a"].data_ptr() and torch.equal(second["a"], torch.arange(6.0) + 1)
    third = staging.stage({"a": live["a"]})  # a key gone: the arena is arranged again, and still fits
    assert third["a"].untyped_storage().data_ptr() == first["a"].untyped_storage().data_ptr()
    staging.stage({"a": live["a"], "d": torch.zeros(40)})  # outgrown: a new arena, the old one freed first
    assert staging.held_bytes == StagingBuffers.ALIGNMENT + 3 * StagingBuffers.ALIGNMENT
    staging.release()
    assert staging.held_bytes == 0


def test_removals_wait_for_the_commit_and_never_follow_a_failed_save(tmp_path):
    from lightning_zero.checkpoint.async_save import AsyncSaves

    saves, order = AsyncSaves(), []
    gate = threading.Event()

    def write(ranks, group) -> None:
        gate.wait(10)
        order.append("committed")

    saves.start_save(tmp_path / "a", write)
    saves.after_commit(lambda: order.append("removed"))
    assert order == [] and saves.in_flight == tmp_path / "a"
    gate.set()
    assert saves.finish_save().path == tmp_path / "a"
    assert order == ["committed", "removed"]
    saves.after_commit(lambda: order.append("now"))  # none in flight: at once
    assert order[-1] == "now"

    def fail(ranks, group) -> None:
        raise OSError(28, "No space left on device")

    saves.start_save(tmp_path / "b", fail)
    saves._in_flight.thread.join()
    saves.after_commit(lambda: order.append("removed after a failure"))
    with pytest.raises(OSError, match="No space"):
        saves.finish_save()
    assert "removed after a failure" not in order and saves.finish_save() is None
