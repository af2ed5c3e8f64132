"""Run a function on N CPU ranks (gloo) and collect what each rank returns.

Starting processes and importing torch/Lightning costs seconds, so most tests register many cases
in one ``case_groups.CaseGroup``, which runs them all through one ``run_on_ranks`` call; a test
then asserts on each case's results in the parent. The ranks are forked from a server process that
has done those imports once (``rank_imports.py``), not spawned.

The environment variables Lightning's ``LightningEnvironment`` reads are set in each rank, so a
``Trainer(accelerator="cpu", devices=N, strategy=...)`` created inside the function joins the
already-running ranks instead of launching new processes.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing.forkserver
import os
import pickle
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300.0


def ranks_started() -> int:
    """How many ranks ``run_on_ranks`` started, as seen from one of them: the process group's size
    once there is one (Lightning's ``LightningEnvironment.teardown`` deletes ``WORLD_SIZE`` from the
    environment after each fit, so a second Trainer would read the default), else ``WORLD_SIZE``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_environment() -> dict[str, str]:
    """The environment for a rank the tests start as a script (``torchrun``, or as ``srun`` would):
    this process's, without any launcher's variables, with the tests and the sources importable."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_", "LT_"))}
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        keep.pop(key, None)
    keep["OMP_NUM_THREADS"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    keep["PYTHONPATH"] = os.pathsep.join([here, os.path.join(os.path.dirname(here), "src"), keep.get("PYTHONPATH", "")])
    return keep


_RANK_SERVER = multiprocessing.forkserver.ForkServer()
_RANK_SERVER.set_forkserver_preload(["rank_imports"])


@contextlib.contextmanager
def _forked_from_the_rank_server() -> Iterator[None]:
    """Processes of the "forkserver" context started in here are forked from ``_RANK_SERVER``: a
    forkserver of the tests' own, that imported ``rank_imports``. multiprocessing's own forkserver is
    left alone: lightning-zero's bench forks its ranks from that one, started with the environment
    and the imports that the bench chooses (the first user of that server sets both)."""
    # the server finds rank_imports (next to this file) on its PYTHONPATH: Python 3.11's forkserver
    # does not take the parent's sys.path (later versions do)
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in (here, saved) if path)
    try:
        _RANK_SERVER.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    shared = multiprocessing.forkserver.connect_to_new_process
    multiprocessing.forkserver.connect_to_new_process = _RANK_SERVER.connect_to_new_process
    try:
        yield
    finally:
        multiprocessing.forkserver.connect_to_new_process = shared


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, init_pg: bool, environ: dict[str, str]
) -> None:
    # a forked rank has the server's environment (the parent's when the server started): give it the
    # parent's of now, as a spawned process would have (multiprocessing sets the directory and sys.path)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world_size),
        # one intra-op thread, as set below, for the offloaded host step too (which reads this): a
        # value an earlier test's in-process Trainer left in the parent (Lightning sets it where unset)
        # would give ours another thread count than DDP's run in the same rank, and 1-ulp differences
        OMP_NUM_THREADS="1",
    )
    try:
        import rank_imports  # noqa: F401 - imported already, unless the server could not import it
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # two ranks on two cores
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        out = fn(rank, world_size, *args)
        # pickled here, tensor data copied; the queue's own pickler would share it through file
        # descriptors that die with this process
        results.put((rank, "ok", _pickled_result(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _pickled_result(result: Any) -> bytes:
    """``pickle.dumps(result)``, with each CPU tensor's storage sent as its bytes.

    Plain pickle sends a storage as a whole ``torch.save`` of it, which the parent reads back with
    a whole ``torch.load``: ~0.1 ms a tensor on each side, and a group's results hold thousands
    (weights after every step of every case, on each rank), a few CPU-seconds per test file. The
    tensors themselves are pickled as torch pickles them (``Parameter``, strides, offset,
    ``requires_grad``); only their storages' bytes travel differently, copied as before (a
    storage shared by two tensors arrives as two copies, as with plain pickle)."""
    out = io.BytesIO()
    _ResultPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
    return out.getvalue()


class _ResultPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        import torch

        # the private fields: TypedStorage's public ones warn that the class is deprecated
        untyped, dtype = getattr(obj, "_untyped_storage", None), getattr(obj, "_dtype", None)
        if not isinstance(obj, torch.storage.TypedStorage) or untyped is None or dtype is None or untyped.device.type != "cpu":
            return NotImplemented
        as_bytes = torch.empty(0, dtype=torch.uint8).set_(untyped).numpy().tobytes()
        return _storage_from_bytes, (as_bytes, dtype)


def _storage_from_bytes(data: bytes, dtype: Any) -> Any:
    import torch

    untyped = torch.UntypedStorage.from_buffer(data, dtype=torch.uint8) if data else torch.UntypedStorage(0)
    return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    init_process_group: bool = True,
    timeout: float = DEFAULT_TIMEOUT_S,
    tolerate_deaths: bool = False,
    start_method: str = "forkserver",
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return the
    per-rank results in rank order. A rank's exception is re-raised here with its traceback; a
    hang fails after ``timeout`` seconds instead of blocking the test run.

    ``fn`` must be importable (a module-level function). With ``init_process_group=False`` the
    function (e.g. a Lightning Trainer) creates the process group itself.

    ``tolerate_deaths=True`` is for fault tests: once a rank exits without a result (killed), the
    others are stopped too and every missing result is None.

    ``start_method``: "forkserver" forks the ranks from the tests' rank server (``rank_imports``);
    "spawn" starts each in a new interpreter, for the GPU tier, whose ranks must not inherit
    anything a server's imports may have done to CUDA's state (the driver breaks across a fork).
    """
    if start_method == "forkserver" and "forkserver" not in mp.get_all_start_methods():
        start_method = "spawn"  # Windows
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results, init_process_group, environ), daemon=False)
        for r in range(world_size)
    ]
    with _forked_from_the_rank_server():
        for p in procs:
            p.start()
    collected: dict[int, tuple[str, Any]] = {}
    try:
        import queue

        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                died = [r for r, p in enumerate(procs) if r not in collected and p.exitcode is not None]
                if tolerate_deaths and died:
                    # let surviving ranks report what they finished: up to 2 s, less once all have
                    grace = time.monotonic() + 2.0
                    survivors = set(range(world_size)) - set(died)
                    while not survivors <= collected.keys() and time.monotonic() < grace:
                        try:
                            rank, status, payload = results.get(timeout=grace - time.monotonic())
                        except (queue.Empty, ValueError):  # ValueError: the grace ran out meanwhile
                            break
                        collected[rank] = (status, payload)
                    while not results.empty():  # what any rank sent before it exited
                        rank, status, payload = results.get()
                        collected[rank] = (status, payload)
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish within {timeout}s (hang?)"
                    ) from None
                continue
            collected[rank] = (status, payload)
            if status == "error":
                break
    finally:
        for p in procs:
            p.join(timeout=5 if len(collected) == world_size else 1)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: payload for r, (status, payload) in collected.items() if status == "error"}
    if tolerate_deaths:
        # a survivor's error is a consequence of the death: it is returned as its traceback text
        outcomes: list[Any] = []
        for r in range(world_size):
            status, payload = collected.get(r, ("missing", None))
            outcomes.append(None if status == "missing" else payload if status == "error" else pickle.loads(payload))
        return outcomes
    if errors:
        rank, tb = sorted(errors.items())[0]
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    return [pickle.loads(collected[r][1]) if r in collected else None for r in range(world_size)]
