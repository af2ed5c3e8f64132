"""GPU tier, concurrency (issue 59; the review's section 4, ``shared/reviews/concurrency-read-2026-12-06.md``):
what the CPU schedule explorer (``tests/schedules/``) cannot see — real kernels and their timing, the
caching allocator's reuse of memory across streams, contexts made on GPU 0 from other threads and
ranks, and CUDA's streams and events behaving as the stream layer models them
([Note: the stream layer] in ``engine/comm/streams.py``). Skipped without a CUDA device, except the
tests of the trace reader (``allocator_trace.py``), which run anywhere.

Every check asserts the behaviour the fixes give (bitwise equality, no error, bounded memory):

1. **N1** — ``engine.gathered(offload_to_cpu=True)`` between steps points every parameter at a host
   copy and back, which gives it a new accumulation node: 4 steps against 2 + the context + 2 must be
   the same bits, at zero3 and zero3 with both offloads, with the one-rank shortcuts and with real
   NCCL collectives (``LIGHTNING_ZERO_COLLECTIVES_AT_ONE_RANK=1``; before the fix: a RuntimeError in
   step 3, or silently dropped gradients).
2. **N2 and N4, a late peer** — one GPU cannot have a late peer, so each launch of a reduction queues
   ``torch.cuda._sleep`` on the reduce stream after its collective (``ReduceStream.launching`` wrapped):
   everything later on that stream, and everything waiting for it, runs late, as behind a peer that
   joins each reduce-scatter late. See [Note: a late peer on one GPU]
Per variant (zero2 and zero3 with ``offload_optimizer``; zero3 with ``offload_params`` too, fp32
weights, the configuration of N2), three runs: one step not timed (what an engine's first step costs
the host once per process), then 3 steps on time, then 3 late, each launch sleeping ``sleep`` on the
reduce stream, ten on-time first backwards long (at least 20 ms).

- **Step 1: the backward is not stretched** (N2). Before it the compute stream spins ``LEAD_MS``
  (the host queues the whole backward meanwhile), so two CUDA events around ``loss.backward()`` on
  the compute stream time the device's backward alone. An engine's first backward trusts no marking
  of unreached parameters, so no launch is bounded and the compute stream must wait for no
  reduction: late / on time ≤ ``STRETCH_LIMIT`` (2). Robust because the sleep dwarfs the step: with
  the gathers' copies to the device queued behind the gradients' copies to the host on one stream
  (before the fix), each gather issued after the first launch waited for at least one sleep (ten
  backwards), so the ratio was ≥ ~10; with the fix it is ~1 (a spinning kernel takes one block of
  one SM).
- **From step 2 the lag is bounded** (N4): launches are bounded where every rank launches every bucket
  in its backward, so at most ``MAX_IN_FLIGHT + 1`` buckets' full gradients wait for the reduce stream
  however late it is. Measured as the peak of *active* memory in steps 2-3 above its value at their
  start: a block freed while another stream was declared to read it (``record_stream``) leaves
  ``memory_allocated`` at once (``max_memory_allocated`` cannot see a lag) but stays active until that
  stream got there. The late run may exceed the on-time run by at most that many of the largest
  bucket's full gradients; before the fix every bucket's gradients stayed active until the reduce
  stream reached them (5 to 7 buckets more at 8 units). These steps run without the lead: with the
  host far ahead no stream gets anywhere before the host is done, and the on-time run would keep every
  gradient as long. Asserted at zero2 and zero3 with ``offload_optimizer`` (see
  ``LATE_MEMORY_ASSERTED`` for why not with ``offload_params``). Bounding makes the compute stream
  wait for the copy-in ``MAX_IN_FLIGHT`` launches back, so in these steps the late backward *is*
  stretched (by about the sleeps of all but the last launches): that figure, both peaks, and
  ``memory_report().unpacked_gradients`` / ``waiting_gradients`` (the host's view of the lag, which
  counts launches whose gradients the bound already let go) are recorded, not asserted.
- **The copies to the device and to the host run on different streams** (the N2 fix, seen by Kineto
  in a profiled late step at zero3 with ``offload_params``; the trace is kept for the summary).
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from allocator_trace import allocator_findings
from case_groups import CaseFailed, CaseGroup, GroupResults, RankContext
from cuda_tier import MARKS, START_METHOD, copy_overlap, setup_rank

from lightning_zero.engine.comm.collectives import COLLECTIVES_AT_ONE_RANK
from lightning_zero.engine.gradients.grad_sync import MAX_IN_FLIGHT  # buckets in flight, and the launches the reduce stream may lag

DETAIL = "GPU_CHECK_DETAIL"
"""Where ``scripts/gpu_check.sh`` wants its figures (``<it>/concurrency/``); unset: kept nowhere."""
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"
ONE_GPU = (
    "one GPU here: the two-rank NCCL check (rank 1 detaching, contexts on GPU 0) needs 2; the lent machines"
    " have one, so it runs only where `pytest -m cuda tests/test_cuda_concurrency.py` sees 2 or more"
)


def on_gpu(test: Callable) -> Callable:
    """The GPU tier's marks on one test (the trace reader's tests at the end run anywhere)."""
    for mark in MARKS:
        test = mark(test)
    return test


on_two_gpus = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason=ONE_GPU)

GROUP = CaseGroup(world_size=1, timeout=600, start_method=START_METHOD)
"""Checks 1, 2, 4 and 5 (default allocator), in one process on cuda:0."""
EXPANDABLE = CaseGroup(world_size=1, timeout=300, start_method=START_METHOD)
"""Check 5 again in a process started with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``."""
TWO_GPUS = CaseGroup(world_size=2, timeout=420, start_method=START_METHOD)
"""Check 3: two ranks on cuda:0 and cuda:1 (a hang ends at the 120 s process-group timeout)."""


# ---- helpers -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _environment(**values: Optional[str]) -> Iterator[None]:
    """Set (a str) or unset (None) environment variables in the body."""
    saved = {name: os.environ.get(name) for name in values}

    def apply(settings: dict) -> None:
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    apply(values)
    try:
        yield
    finally:
        apply(saved)


def _collectives_at_one_rank(on: bool = True) -> contextlib.AbstractContextManager:
    """Real NCCL collectives at world size 1 (``on``), or the one-rank shortcuts; set before an engine
    is built and kept until it is closed (each collective reads it)."""
    return _environment(**{COLLECTIVES_AT_ONE_RANK: "1" if on else None})


def _tokens(shape: dict, steps: int, batch: int, seed: int = 0) -> list[torch.Tensor]:
    """One (batch, T + 1) batch of token ids per step, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, shape["block_size"] + 1), generator=g) for _ in range(steps)]


def _engine_gpt(
    shape: dict, options: dict, device: torch.device, engine: bool = True, lr: float = 1e-3, prepare: Callable[[Any], None] = lambda model: None
) -> tuple:
    """A seeded GPT on ``device`` with AdamW, under a ``ZeroEngine`` of ``options`` (or alone);
    ``prepare(model)`` runs before the engine is built (e.g. compiling its blocks)."""
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape)).to(device)
    prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    zero = ZeroEngine(model, [optimizer], ZeroConfig(**options), device=device) if engine else None
    return model, optimizer, zero


def _step(
    model: Any,
    optimizer: Any,
    engine: Any,
    tokens: torch.Tensor,
    before_backward: Optional[Callable[[], None]] = None,
    after_backward: Optional[Callable[[], None]] = None,
    bf16: bool = False,
) -> None:
    """One training step of the engine's loop (the model alone where ``engine`` is None);
    ``bf16``: the forward under bf16 autocast (bf16-mixed)."""
    if engine is not None:
        engine.begin_step()
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        loss = model(tokens[:, :-1], tokens[:, 1:])[1]
    if before_backward is not None:
        before_backward()
    loss.backward()
    if after_backward is not None:
        after_backward()
    if engine is not None:
        engine.finish_backward()
        engine.end_step()
    optimizer.step()
    if engine is not None:
        engine.after_optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def _weights(model: Any, engine: Any) -> dict[str, torch.Tensor]:
    weights = engine.full_state_dict(model) if engine is not None else model.state_dict()
    return {name: value.detach().float().cpu() for name, value in weights.items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a)


def _release(*engines: Any) -> None:
    """Close ``engines`` and give their memory back, so that the next run starts where this one did."""
    for engine in engines:
        if engine is not None:
            engine.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _error(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _mb(nbytes: float) -> float:
    return round(nbytes / 2**20, 2)


def _cycles_per_ms() -> float:
    """``torch.cuda._sleep`` spins a number of GPU clock cycles: how many take a millisecond here
    (timed by CUDA events; the second of two tries, once the kernel is loaded)."""
    cycles = 20_000_000
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def _figures_dir() -> Optional[Path]:
    detail = os.environ.get(DETAIL)
    if not detail:
        return None
    path = Path(detail) / "concurrency"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _record_figures(part: str, value: Any) -> None:
    """Merge ``value`` under ``part`` into ``$GPU_CHECK_DETAIL/concurrency/figures.json`` (nothing
    without the variable)."""
    folder = _figures_dir()
    if folder is None:
        return
    path = folder / "figures.json"
    figures = json.loads(path.read_text()) if path.exists() else {}
    figures[part] = value
    path.write_text(json.dumps(figures, indent=1, default=str) + "\n")


def _figures_of(results: GroupResults, names: list[str], rank: int = 0) -> dict[str, Any]:
    """Each case's ``figures`` (``rank``'s), or the last line of why it has none, by case name."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = results[name][rank].get("figures", {})
        except CaseFailed as failed:
            lines = [line.strip() for line in str(failed).splitlines() if line.strip()]
            out[name] = {"failed": lines[-1] if lines else "failed"}
    return out


# ---- 1. N1: the marking after `gathered(offload_to_cpu=True)` ----------------------------------------

N1_SHAPE = dict(block_size=32, n_layer=4, n_head=4, n_embd=64)
N1_STEPS, N1_SUMMON_BEFORE = 4, 2
"""4 steps, the context entered before the third (after 2 steps: the marking is trusted by then)."""
N1_VARIANTS = {
    "zero3": {"stage": 3},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
}


def _n1_run(options: dict, data: list, summon_before: Optional[int], device: torch.device) -> dict:
    """``N1_STEPS`` steps, with ``with engine.gathered(offload_to_cpu=True): pass`` before step
    ``summon_before`` (None: never): the weights, or the error that stopped the run."""
    model, optimizer, engine = _engine_gpt(N1_SHAPE, options, device, lr=1e-2)
    step = 0
    try:
        for step, tokens in enumerate(data):
            if step == summon_before:
                with engine.gathered(offload_to_cpu=True):
                    pass
            _step(model, optimizer, engine, tokens.to(device))
        out = {"weights": _weights(model, engine), "error": None}
    except Exception as error:  # noqa: BLE001 - the test reports it
        out = {"weights": None, "error": f"step {step + 1}: {_error(error)}"}
    with contextlib.suppress(Exception):  # after an error the engine may be half-way through a step
        engine.close()
    del model, optimizer, engine
    _release()
    return out


def n1_offloaded_summon(ctx: RankContext, variant: str, collectives: bool) -> dict:
    """``variant`` run straight and with the context entered after 2 steps (see ``_n1_run``), with
    NCCL's collectives at one rank (``collectives``) or the one-rank shortcuts."""
    device = setup_rank(deterministic=True)
    data = _tokens(N1_SHAPE, N1_STEPS, batch=4)
    with _collectives_at_one_rank(collectives):
        straight = _n1_run(N1_VARIANTS[variant], data, None, device)
        summoned = _n1_run(N1_VARIANTS[variant], data, N1_SUMMON_BEFORE, device)
    errors = {"straight": straight["error"], "summoned": summoned["error"]}
    diff = _max_diff(straight["weights"], summoned["weights"]) if not any(errors.values()) else None
    error = "; ".join(f"the {run} run, {why}" for run, why in errors.items() if why) or None
    return {"errors": errors, "diff": diff, "figures": {"max_diff": diff, "error": error}}


for _variant in N1_VARIANTS:
    for _collectives in (False, True):
        _name = f"n1_{_variant}_{'nccl' if _collectives else 'shortcuts'}"
        GROUP.case(n1_offloaded_summon, name=_name, variant=_variant, collectives=_collectives)


# ---- 2. N2 and N4: a late peer on one GPU (see [Note: a late peer on one GPU]) -----------------------

LATE_SHAPE = dict(block_size=64, n_layer=8, n_head=8, n_embd=512)
"""8 blocks of 3.1M parameters (12.6 MB of fp32 gradients each, 100 MB in all) and 64 tokens (about
2.6 MB of activations a block): gradients, not activations, make the peak of backward, so gradients
a lag keeps show in it; a backward of about a millisecond on the device, far shorter than a sleep."""
LATE_BATCH, LATE_STEPS = 1, 3
LATE_VARIANTS = {
    "zero2_offload": {"stage": 2, "offload_optimizer": True, "bucket_size_mb": 8.0},
    "zero3_offload_optimizer": {"stage": 3, "offload_optimizer": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
}
"""Stage 2 with about 1.5 buckets a block; stage 3's buckets are its units, one a block. fp32 weights."""
LEAD_MS = 200.0
"""The compute stream spins this long before each backward: longer than the host takes to queue one
(the first step's included), so the events time the device's backward, not the host's pace."""
MIN_SLEEP_MS, SLEEP_OVER_BACKWARD = 20.0, 10.0
"""A late launch sleeps 10 on-time first backwards (the device's time), at least 20 ms."""
LATE_MEMORY_ASSERTED = ("zero2_offload", "zero3_offload_optimizer")
"""Where the peak of active memory from step 2 on is asserted. Not with ``offload_params``: there
backward's gathers copy chunks to the device into rows that stay active until the compute stream has
read them (``CopyStream.to_device`` keeps them alive for it), and the compute stream, made to wait by
the bound, falls behind the host, so in the late run those rows add up, a unit each, by design
(recorded, not asserted)."""
STRETCH_LIMIT = 2.0
"""Step 1's backward, late / on time: ~1 with the fix, ≥ ~10 before it (see the Note)."""


@contextlib.contextmanager
def _late_peer(cycles: int) -> Iterator[None]:
    """Each launch of a reduction queues ``torch.cuda._sleep(cycles)`` on the reduce stream right after
    its collective (``ReduceStream.launching`` wrapped; nothing with ``cycles`` 0)."""
    from lightning_zero.engine.comm.reduce_stream import ReduceStream

    if not cycles:
        yield
        return
    original = ReduceStream.launching

    @contextlib.contextmanager
    def launching(self: ReduceStream, bounded: bool = False) -> Iterator[None]:
        with original(self, bounded):
            yield
            if self.stream is not None:  # the body ran on the reduce stream, still the current one here
                torch.cuda._sleep(cycles)

    ReduceStream.launching = launching
    try:
        yield
    finally:
        ReduceStream.launching = original


def _warm_nccl() -> None:
    """The default group's NCCL communicator, made now (at its first collective) rather than inside
    a timed backward."""
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()


def _timed_run(variant: str, data: list, device: torch.device, lead: int, sleep: int, profile_step: Optional[int] = None) -> dict:
    """The steps of ``variant`` on ``data``, the compute stream spinning ``lead`` cycles before the
    first backward, each launch of a reduction followed by a sleep of ``sleep`` cycles on the reduce
    stream (0: none): each backward's time (ms, CUDA events on the compute stream: the device's
    alone in step 1), the host's time to queue it, the peaks of active and of allocated memory from
    step 2 on above their values at its start, the memory report's lag figures after each step;
    ``profile_step``: that step's Chrome trace.

    Active, not only allocated: a block freed while another stream was declared to read it
    (``record_stream``) leaves the allocated count at once but stays active, not to be handed out,
    until that stream got there; a lag keeps gradients so. Steps 2 on have no lead: with the host
    far ahead, no stream gets anywhere before the host is done, and the on-time run would keep every
    such block as long as the late one."""
    from torch.profiler import ProfilerActivity, profile

    model, optimizer, engine = _engine_gpt(LATE_SHAPE, LATE_VARIANTS[variant], device)
    events: list[tuple] = []
    host_ms, unpacked, waiting = [], [], []
    trace: Optional[dict] = None
    start: dict[str, int] = {}
    with _late_peer(sleep):
        for step, tokens in enumerate(data):
            if step == 1:  # the bound applies from the second backward (the first one only learns)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = {"active": torch.cuda.memory_stats()["active_bytes.all.current"], "allocated": torch.cuda.memory_allocated()}
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host: list[float] = []

            def before_backward(began: Any = began, host: list = host, spin: int = lead if step == 0 else 0) -> None:
                if spin:
                    torch.cuda._sleep(spin)
                began.record()
                host.append(time.perf_counter())

            def after_backward(ended: Any = ended, host: list = host) -> None:
                ended.record()
                host.append(time.perf_counter())

            profiling = profile(activities=[ProfilerActivity.CUDA]) if step == profile_step else contextlib.nullcontext()
            with profiling:
                _step(model, optimizer, engine, tokens.to(device), before_backward, after_backward)
                torch.cuda.synchronize()
            if step == profile_step:
                trace = _chrome_trace(profiling)
            events.append((began, ended))
            host_ms.append((host[1] - host[0]) * 1e3)
            report = engine.memory_report()
            unpacked.append(report.unpacked_gradients)
            waiting.append(report.waiting_gradients)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    out = {
        "backward_ms": [began.elapsed_time(ended) for began, ended in events],
        "host_backward_ms": host_ms,
        "active_rise": stats["active_bytes.all.peak"] - start.get("active", 0),
        "allocated_rise": torch.cuda.max_memory_allocated() - start.get("allocated", 0),
        "unpacked": unpacked,
        "waiting": waiting,
        "buckets": len(engine.buckets),
        "largest_bucket": max(b.param_bytes for b in engine.buckets),
        "trace": trace,
    }
    del model, optimizer
    _release(engine)
    return out


def _chrome_trace(profiling: Any) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiling.export_chrome_trace(path)
        return json.loads(Path(path).read_text())


def _lead_and_sleep(ctx: RankContext) -> tuple[float, int]:
    """This GPU's ``_sleep`` cycles per millisecond (measured once) and the lead in cycles."""
    cycles_per_ms = ctx.once("cycles_per_ms", _cycles_per_ms)
    return cycles_per_ms, int(LEAD_MS * cycles_per_ms)


def late_peer(ctx: RankContext, variant: str) -> dict:
    """``variant`` on time, then with a late peer sleeping ten on-time backwards per launch; before
    both, one step of it not timed, so that what an engine's first step costs the host once per
    process (pinned host buffers, which torch keeps cached; kernels loaded) is paid outside them."""
    device = setup_rank(deterministic=False)  # timings: the kernels users run
    cycles_per_ms, lead = _lead_and_sleep(ctx)
    data = _tokens(LATE_SHAPE, LATE_STEPS, LATE_BATCH)
    with _collectives_at_one_rank():
        ctx.once("nccl", _warm_nccl)
        warm = _timed_run(variant, data[:1], device, lead, sleep=0)
        on_time = _timed_run(variant, data, device, lead, sleep=0)
        sleep_ms = max(MIN_SLEEP_MS, SLEEP_OVER_BACKWARD * on_time["backward_ms"][0])
        late = _timed_run(variant, data, device, lead, sleep=int(sleep_ms * cycles_per_ms))
    runs = {"on_time": on_time, "late": late}
    figures = {
        "sleep_ms": round(sleep_ms, 2),
        "lead_ms": LEAD_MS,
        "buckets": late["buckets"],
        "largest_bucket_mb": _mb(late["largest_bucket"]),
        "bound_mb": _mb((MAX_IN_FLIGHT + 1) * late["largest_bucket"]),
        "step1_ratio": round(late["backward_ms"][0] / on_time["backward_ms"][0], 3),
        "host_backward_ms_warm_up": round(warm["host_backward_ms"][0], 3),
        **{f"{key}_{label}": [round(v, 3) for v in run[key]] for label, run in runs.items() for key in ("backward_ms", "host_backward_ms")},
        **{f"{key}_mb_{label}": _mb(run[key]) for label, run in runs.items() for key in ("active_rise", "allocated_rise")},
        "memory_asserted": variant in LATE_MEMORY_ASSERTED,
        **{f"{key}_mb_{label}": [_mb(v) for v in run[key]] for label, run in runs.items() for key in ("unpacked", "waiting")},
    }
    return {**{label: {k: v for k, v in run.items() if k != "trace"} for label, run in runs.items()}, "lead_ms": LEAD_MS, "figures": figures}


for _variant in LATE_VARIANTS:
    GROUP.case(late_peer, name=f"late_peer_{_variant}", variant=_variant)


@GROUP.case
def late_peer_copies(ctx: RankContext) -> dict:
    """zero3 with ``offload_params`` and a late peer, its second step profiled: the streams the copies
    to the device and to the host ran on (Kineto), and the trace kept for the summary."""
    device = setup_rank(deterministic=False)
    cycles_per_ms, lead = _lead_and_sleep(ctx)
    data = _tokens(LATE_SHAPE, 2, LATE_BATCH)
    with _collectives_at_one_rank():
        ctx.once("nccl", _warm_nccl)
        run = _timed_run("zero3_offload", data, device, lead, sleep=int(MIN_SLEEP_MS * cycles_per_ms), profile_step=1)
    found = copy_overlap(run["trace"] or {})
    streams = {kind: sorted({str(c["stream"]) for c in found["copies"] if kind in c["name"]}) for kind in ("HtoD", "DtoH")}
    kept = None
    folder = _figures_dir()
    if folder is not None and run["trace"] is not None:
        kept = "late_peer_zero3_offload.trace.json.gz"
        with gzip.open(folder / kept, "wt") as out:
            json.dump(run["trace"], out)
    figures = {"h2d_streams": streams["HtoD"], "d2h_streams": streams["DtoH"], "copies": len(found["copies"]), "trace": kept}
    return {"h2d": streams["HtoD"], "d2h": streams["DtoH"], "figures": figures}


# ---- 4. the host step during backward through the Trainer ---------------------------------------------

HOST_SHAPE = dict(block_size=64, n_layer=4, n_head=4, n_embd=256)
TINY_SHAPE = dict(block_size=16, n_layer=3, n_head=2, n_embd=16)
"""The launch-bound model: the host's work per kernel outweighs the kernel."""
HOST_BATCH = 4
SMALL_BUCKETS = {"bucket_size_mb": 0.01}
"""About a block per bucket of the tiny model: a backward lands several buckets one after the other."""
ZERO2_OFFLOAD = {"stage": 2, "offload_optimizer": True}
ZERO3_OFFLOAD = {"stage": 3, "offload_optimizer": True, "offload_params": True}
HOST_CASES: dict[str, dict[str, Any]] = {
    # bf16-mixed, AdamW, clipping by norm; the compute stream spins before each backward
    "host_lead_clipped": dict(args=ZERO3_OFFLOAD, shape=HOST_SHAPE, precision="bf16-mixed", clip=1.0, lead=True, steps=4),
    "launch_bound_clipped": dict(args={**ZERO2_OFFLOAD, **SMALL_BUCKETS}, shape=TINY_SHAPE, precision="bf16-mixed", clip=1.0, steps=4),
    # N3: in-place edits through `.data` (after the host stepped) and `.detach()` (whenever it did)
    "grad_data_edits": dict(args={**ZERO2_OFFLOAD, **SMALL_BUCKETS}, shape=TINY_SHAPE, precision="bf16-mixed", edits=True, steps=4),
    # N5: an `aux` unit registered last, called first, its output unused; no hook: no rollback copies
    "unused_unit": dict(args={**ZERO3_OFFLOAD, "unit_classes": ["Block"]}, shape=TINY_SHAPE, precision="32-true", aux=True, steps=3),
    # loss scaling: the second step's loss is inf (every bucket's step undone, the scale halved)
    "overflow_16_mixed": dict(args={**ZERO2_OFFLOAD, **SMALL_BUCKETS}, shape=TINY_SHAPE, precision="16-mixed", inf_at=1, steps=3),
}


def _lightning_gpt(shape: dict, aux: bool = False, inf_at: int = -1) -> Any:
    """A LightningModule over a GPT of ``shape``; ``aux``: a Block registered after it and called
    first, its output unused; ``inf_at``: that batch's loss times inf."""
    import lightning as L

    from lightning_zero.models.gpt import GPT, Block, GPTConfig

    class HostStepGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(GPTConfig(**shape))
            if aux:
                self.aux = Block(self.model.config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens = batch[0]
            if aux:
                self.aux(torch.zeros(tokens.shape[0], 4, shape["n_embd"], device=tokens.device))
            loss = self.model(tokens[:, :-1], tokens[:, 1:])[1]
            return loss * float("inf") if batch_idx == inf_at else loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return HostStepGPT()


def _host_step_callbacks() -> dict[str, type]:
    """The callbacks of the host-step cases; none overrides a hook between backward and the step but
    ``DataEdits`` (which makes the Trainer keep rollback copies)."""
    from lightning.pytorch.callbacks import Callback

    class HostLead(Callback):
        """The compute stream spins before each backward: the host queues it all, every gradient
        hook runs, before the device starts it."""

        def __init__(self, cycles: int) -> None:
            self.cycles = cycles

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
            torch.cuda._sleep(self.cycles)

    class Seen(Callback):
        """After every batch: the host step's report and the loss scale."""

        def __init__(self) -> None:
            self.report, self.scales = None, []

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.report = trainer.strategy.engine.host_step_report()
            scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
            self.scales.append(scaler.get_scale() if scaler is not None else None)

    class DataEdits(Callback):
        """Halves the gradients below autograd: step 1 through ``.data`` once the host stepped every
        bucket (the step taken ahead read the unedited values), step 2 through ``.detach()`` whenever."""

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 1:
                trainer.strategy.engine.wait_for_host_step()
                for p in pl_module.parameters():
                    if p.grad is not None:
                        p.grad.data.mul_(0.5)
            elif trainer.global_step == 2:
                for p in pl_module.parameters():
                    if p.grad is not None:
                        p.grad.detach().mul_(0.5)

    return {"HostLead": HostLead, "Seen": Seen, "DataEdits": DataEdits}


def _report(report: Any) -> Optional[dict]:
    if report is None:
        return None
    return {"ahead": report.ahead, "redone": report.redone, "after_backward": report.after_backward, "reasons": dict(report.reasons)}


def _fit_host_step(case: dict, overlap: bool, device: torch.device, lead: int) -> dict:
    """One fit of ``case`` with ``overlap_host_step=overlap``: the weights after every batch, the
    host step's report and the loss scales."""
    import lightning as L
    from lightning_helpers import WeightRecorder, make_trainer
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zero

    callbacks = _host_step_callbacks()
    L.seed_everything(0, verbose=False)
    recorder, seen = WeightRecorder(), callbacks["Seen"]()
    extra = ([callbacks["HostLead"](lead)] if case.get("lead") else []) + ([callbacks["DataEdits"]()] if case.get("edits") else [])
    options: dict[str, Any] = dict(accelerator=device.type, precision=case["precision"])
    if case.get("clip"):
        options.update(gradient_clip_val=case["clip"], gradient_clip_algorithm="norm")
    strategy = lightning_zero.ZeroStrategy(**case["args"], overlap_host_step=overlap)
    trainer = make_trainer(strategy, case["steps"], callbacks=[recorder, seen, *extra], **options)
    tokens = torch.cat(_tokens(case["shape"], case["steps"], HOST_BATCH, seed=1))
    module = _lightning_gpt(case["shape"], aux=case.get("aux", False), inf_at=case.get("inf_at", -1))
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=HOST_BATCH))
    history = [{k: v.float().cpu() for k, v in weights.items()} for weights in recorder.history]
    return {"history": history, "report": _report(seen.report), "scales": seen.scales}


def host_step_twins(ctx: RankContext, label: str) -> dict:
    """``HOST_CASES[label]`` fitted with the host step during backward and without it (or the error
    that stopped a fit)."""
    from lightning_zero.engine.offload import backoff

    device = setup_rank(deterministic=True)
    case = HOST_CASES[label]
    _, lead = _lead_and_sleep(ctx) if case.get("lead") else (0.0, 0)
    longest_backoff = backoff.MAX_BACKOFF
    if case.get("edits"):
        backoff.MAX_BACKOFF = 0  # every edited step is taken ahead and judged, none after a redo
    try:
        with _collectives_at_one_rank():
            ahead = _fit_host_step(case, True, device, lead)
            after = _fit_host_step(case, False, device, lead)
    except Exception as error:  # noqa: BLE001 - the test reports it (N5 raised here before its fix)
        return {"error": _error(error), "figures": {"error": _error(error)}}
    finally:
        backoff.MAX_BACKOFF = longest_backoff
        _release()
    diffs = [_max_diff(a, b) for a, b in zip(ahead["history"], after["history"])]
    inf_at = case.get("inf_at", -1)
    moved = _max_diff(ahead["history"][inf_at], ahead["history"][inf_at - 1]) > 0 if inf_at > 0 else None
    figures = {"diffs": diffs, "report": ahead["report"], "report_without_overlap": after["report"]}
    if case["precision"] == "16-mixed":
        figures["scales"] = ahead["scales"]
    return {
        "error": None, "diffs": diffs, "records": (len(ahead["history"]), len(after["history"])), "report": ahead["report"],
        "scales": (ahead["scales"], after["scales"]), "moved_at_inf": moved, "figures": figures,
    }  # fmt: skip


for _label in HOST_CASES:
    GROUP.case(host_step_twins, name=f"host_{_label}", label=_label)


# ---- 5. stage-3 storage under the real allocator ------------------------------------------------------

STORAGE_SHAPE = dict(block_size=64, n_layer=4, n_head=4, n_embd=256)
"""Every parameter of a block is a multiple of 1 KB: the views of a unit's storage are as aligned as
the plain model's tensors, so inductor's kernels (and cuBLAS's choices) are the same for both."""
STORAGE_STEPS, STORAGE_BATCH = 5, 4
STORAGE_OPTIONS = {"stage": 3, "prefetch_units": 2}
COMPILE_BACKEND = "inductor"
RECOMPILE_LIMIT = 64
"""Dynamo's limit on compiled versions of one function (8 by default): each block's forward may get
its own, for two models; past the limit dynamo falls back to eager, and the runs would differ."""


def _checkpointed(forward: Callable) -> Callable:
    """``forward`` under non-reentrant activation checkpointing (compiled with it: dynamo traces the
    checkpoint, inductor recomputes inside its backward graph)."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed_forward(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)

    return checkpointed_forward


def _compile_blocks(model: Any) -> None:
    """Each block's forward compiled (the block's hooks stay outside: the engine's gathers are eager)."""
    for block in model.blocks:
        block.forward = torch.compile(_checkpointed(block.forward), backend=COMPILE_BACKEND)


def _storage_run(data: list, device: torch.device, engine: bool) -> dict:
    """``STORAGE_STEPS`` bf16-mixed steps of the compiled model, alone or under zero3: the weights,
    and (under zero3) its memory report against the allocator's counts."""
    model, optimizer, zero = _engine_gpt(STORAGE_SHAPE, STORAGE_OPTIONS, device, engine=engine, prepare=_compile_blocks)
    memory: dict[str, Any] = {}
    for step, tokens in enumerate(data):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            memory["allocated_before_step_2"] = torch.cuda.memory_allocated()
        _step(model, optimizer, zero, tokens.to(device), bf16=True)
    torch.cuda.synchronize()
    out: dict[str, Any] = {"weights": _weights(model, zero)}
    if zero is not None:
        report = zero.memory_report()
        memory.update(
            max_allocated_steps_2_on=torch.cuda.max_memory_allocated(),
            allocated_at_rest=torch.cuda.memory_allocated(),
            reserved=torch.cuda.memory_reserved(),
            report_device_total=report.device.total,
            report_comm_buffers=report.comm_buffers,
            report_copy_buffers=report.copy_buffers,
            report_unpacked_gradients=report.unpacked_gradients,
            report_waiting_gradients=report.waiting_gradients,
        )
        out["roles"] = {zero.grad_sync.stream.stream.cuda_stream: "reduce"} if zero.grad_sync.stream.stream is not None else {}
    out["memory"] = memory
    del model, optimizer
    _release(zero)
    return out


def storage_under_the_allocator(ctx: RankContext) -> dict:
    """The compiled model alone, then under zero3 with the allocator's history recorded: max
    |difference| of the weights, what the history shows (``allocator_findings``), memory figures."""
    import torch._dynamo
    from recompiles import RecompileCounter

    device = setup_rank(deterministic=True)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(RECOMPILE_LIMIT, getattr(torch._dynamo.config, name)))
            break
    data = _tokens(STORAGE_SHAPE, STORAGE_STEPS, STORAGE_BATCH)
    with _collectives_at_one_rank(), RecompileCounter() as recompiles:
        plain = _storage_run(data, device, engine=False)
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
        try:
            zero3 = _storage_run(data, device, engine=True)
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    compute = torch.cuda.current_stream().cuda_stream
    findings = allocator_findings(snapshot["device_traces"][torch.cuda.current_device()], compute, zero3["roles"])
    expandable = any(segment.get("is_expandable", False) for segment in snapshot.get("segments", []))
    diff = _max_diff(plain["weights"], zero3["weights"])
    memory = zero3["memory"]
    figures = {
        "max_diff": diff,
        "expandable_segments": expandable,
        "allocator": {k: findings[k] for k in ("entries", "unit_allocs", "unit_frees", "deferred_frees", "allocs_by_stream", "counts")},
        "memory_mb": {k: _mb(v) for k, v in memory.items()},
        "recompiles": recompiles.count,
        "recompile_reasons": recompiles.reasons[:3],
    }
    return {"diff": diff, "findings": findings, "memory": memory, "expandable": expandable, "figures": figures}


GROUP.case(storage_under_the_allocator, name="storage")
EXPANDABLE.case(storage_under_the_allocator, name="storage")


# ---- 3. two ranks on NCCL (2 GPUs) ---------------------------------------------------------------------

TWO_GPU_SHAPE = dict(block_size=32, n_layer=8, n_head=4, n_embd=64)
TWO_GPU_STEPS, DETACH_AFTER, DETACHED_STEPS = 3, 3, (0, 2)
"""Rank 1 detaches the residual stream after block 4 (index 3) in steps 1 and 3: its backward reaches
none of blocks 1-4; step 1 is a first backward (no marking trusted), step 3 a trusted one."""
TWO_GPU_VARIANTS = {"zero3": {}, "zero3_offload": {"offload_optimizer": True, "offload_params": True}}
TWO_GPU_TIMEOUT_S = 120
TWO_GPU_TOLERANCE = 1e-4
"""Against the DDP arithmetic in one process (the mean of the ranks' losses): the sums run in another
order, and the offloaded AdamW steps on the host (1.2e-6 apart on the CPU with gloo); a missing or
stale gradient moves a weight by about the learning rate (1e-3) per step."""


def _detaching_gpt(shape: dict) -> Any:
    """The GPT whose forward detaches the residual stream after block ``detach_after`` (None: never)."""
    import torch.nn.functional as F

    from lightning_zero.models.gpt import GPT, GPTConfig

    class DetachingGPT(GPT):
        detach_after: Optional[int] = None

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
            for i, block in enumerate(self.blocks):
                x = block(x)
                if i == self.detach_after:
                    x = x.detach()
            logits = self.lm_head(self.ln_f(x))  # (B, T, V)
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return DetachingGPT(GPTConfig(**shape))


def _two_rank_reference(data: list, device: torch.device) -> dict[str, torch.Tensor]:
    """What DDP trains on two ranks, in one process: each step the mean of both ranks' losses."""
    torch.manual_seed(0)
    model = _detaching_gpt(TWO_GPU_SHAPE).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(TWO_GPU_STEPS):
        losses = []
        for rank, batches in enumerate(data):
            model.detach_after = DETACH_AFTER if rank == 1 and step in DETACHED_STEPS else None
            tokens = batches[step].to(device)
            losses.append(model(tokens[:, :-1], tokens[:, 1:])[1])
        (sum(losses) / len(losses)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _weights(model, None)


def _listed_on_gpu_0(pid: int) -> Optional[bool]:
    """Whether NVML lists ``pid`` among GPU 0's processes (None where it cannot list them)."""
    text = torch.cuda.list_gpu_processes(0)
    if not text.startswith("GPU:"):
        return None
    return any(line.split()[1:2] == [str(pid)] for line in text.splitlines())


def two_ranks_one_detaching(ctx: RankContext, variant: str) -> dict:
    """Fabric, zero3 (``variant``'s offload), cuda:0 and cuda:1, rank 1 detaching in steps 1 and 3;
    an asynchronous save at the end. Max |difference| from DDP's arithmetic, and whether this rank's
    process is listed on GPU 0 at the start, after the first step and after the save."""
    from datetime import timedelta

    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy

    torch.cuda.set_device(ctx.rank)
    strategy = ZeroFabricStrategy(stage=3, timeout=timedelta(seconds=TWO_GPU_TIMEOUT_S), async_save=True, **TWO_GPU_VARIANTS[variant])
    fabric = Fabric(accelerator="cuda", devices=ctx.world_size, strategy=strategy, precision="32-true")
    fabric.launch()
    data = [_tokens(TWO_GPU_SHAPE, TWO_GPU_STEPS, batch=2, seed=100 + rank) for rank in range(ctx.world_size)]
    torch.manual_seed(0)
    module = _detaching_gpt(TWO_GPU_SHAPE)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    pid = os.getpid()
    listed = {"start": _listed_on_gpu_0(pid)}
    for step in range(TWO_GPU_STEPS):
        module.detach_after = DETACH_AFTER if ctx.rank == 1 and step in DETACHED_STEPS else None
        tokens = data[ctx.rank][step].to(fabric.device)
        fabric.backward(model(tokens[:, :-1], tokens[:, 1:])[1])
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            listed["after_a_step"] = _listed_on_gpu_0(pid)  # with offload: a step taken during backward
    fabric.save(os.path.join(ctx.tmpdir, f"two_gpus_{variant}"), {"model": model, "optimizer": optimizer})
    fabric.strategy.wait_for_checkpoint()
    listed["after_an_async_save"] = _listed_on_gpu_0(pid)
    sharded = fabric.strategy._modules.of(module)
    report = _report(sharded.engine.host_step_report()) if sharded is not None and sharded.engine is not None else None
    weights = {k: v.detach().float().cpu() for k, v in fabric.strategy.get_module_state_dict(module).items()}
    diff = _max_diff(_two_rank_reference(data, fabric.device), weights)
    figures = {"max_diff": diff, "listed_on_gpu_0": listed, "report": report}
    return {"diff": diff, "listed": listed, "figures": figures}


for _variant in TWO_GPU_VARIANTS:
    TWO_GPUS.case(two_ranks_one_detaching, name=f"two_gpus_{_variant}", variant=_variant)


# ---- the groups --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    found = GROUP.run(tmp_path_factory.mktemp("cuda_concurrency"))
    _record_figures("one_gpu", _figures_of(found, list(GROUP.cases)))
    if torch.cuda.device_count() < 2:
        _record_figures("two_gpus", {"skipped": ONE_GPU})
    return found


@pytest.fixture(scope="module")
def expandable(tmp_path_factory) -> GroupResults:
    """Check 5 in a process started with expandable segments (the allocator reads the setting once)."""
    setting = ",".join(filter(None, [os.environ.get(ALLOC_CONF), EXPANDABLE_SEGMENTS]))
    with _environment(**{ALLOC_CONF: setting}):
        found = EXPANDABLE.run(tmp_path_factory.mktemp("cuda_concurrency_expandable"))
    _record_figures("expandable_segments", _figures_of(found, list(EXPANDABLE.cases)))
    return found


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory) -> GroupResults:
    found = TWO_GPUS.run(tmp_path_factory.mktemp("cuda_concurrency_two_gpus"))
    _record_figures("two_gpus", _figures_of(found, list(TWO_GPUS.cases), rank=1))  # the rank whose contexts matter
    return found


# ---- 1. N1 -------------------------------------------------------------------------------------------


@on_gpu
@pytest.mark.parametrize("collectives", ["shortcuts", "nccl"])
@pytest.mark.parametrize("variant", list(N1_VARIANTS))
def test_a_summon_to_the_host_between_steps_changes_no_later_gradient(results, variant, collectives):
    (r,) = results[f"n1_{variant}_{collectives}"]
    assert r["errors"] == {"straight": None, "summoned": None}, r["errors"]
    assert r["diff"] == 0.0, r["diff"]


# ---- 2. N2 and N4 ------------------------------------------------------------------------------------


@on_gpu
@pytest.mark.parametrize("variant", list(LATE_VARIANTS))
def test_a_late_peer_does_not_stretch_the_first_backward(results, variant):
    (r,) = results[f"late_peer_{variant}"]
    on_time, late = r["on_time"], r["late"]
    host = max(on_time["host_backward_ms"][0], late["host_backward_ms"][0])
    assert host < r["lead_ms"], f"the host took {host:.0f} ms to queue a first backward, more than the lead: raise LEAD_MS"
    ratio = late["backward_ms"][0] / on_time["backward_ms"][0]
    assert ratio <= STRETCH_LIMIT, (
        f"step 1's backward took {late['backward_ms'][0]:.1f} ms with a late peer against {on_time['backward_ms'][0]:.1f} ms"
        f" on time ({ratio:.1f}x; each launch slept {r['figures']['sleep_ms']} ms): the compute stream waited for a reduction"
    )


@on_gpu
@pytest.mark.parametrize("variant", LATE_MEMORY_ASSERTED)
def test_a_late_peer_keeps_waiting_gradients_within_the_bound_from_the_second_step(results, variant):
    (r,) = results[f"late_peer_{variant}"]
    on_time, late = r["on_time"], r["late"]
    assert late["buckets"] > MAX_IN_FLIGHT + 1, late["buckets"]  # else any lag is within the bound
    above = late["active_rise"] - on_time["active_rise"]
    bound = (MAX_IN_FLIGHT + 1) * late["largest_bucket"]
    assert above <= bound, (
        f"steps 2-3 peaked {above / 2**20:.1f} MiB of active memory above the on-time run, more than {MAX_IN_FLIGHT + 1}"
        f" buckets of full gradients ({bound / 2**20:.1f} MiB): the reduce stream's lag kept them"
    )


@on_gpu
def test_copies_to_the_device_never_wait_behind_copies_to_the_host(results):
    (r,) = results["late_peer_copies"]
    assert r["h2d"] and r["d2h"], r  # the trace saw both (a gather's chunks in, a reduced row out)
    assert not set(r["h2d"]) & set(r["d2h"]), r


# ---- 3. two ranks ------------------------------------------------------------------------------------


@on_gpu
@on_two_gpus
@pytest.mark.parametrize("variant", list(TWO_GPU_VARIANTS))
def test_two_ranks_one_detaching_finish_and_train_as_ddp(two_gpus, variant):
    for r in two_gpus[f"two_gpus_{variant}"]:
        assert r["diff"] <= TWO_GPU_TOLERANCE, r["diff"]


@on_gpu
@on_two_gpus
@pytest.mark.parametrize("variant", list(TWO_GPU_VARIANTS))
def test_rank_1_makes_no_cuda_context_on_gpu_0(two_gpus, variant):
    rank0, rank1 = two_gpus[f"two_gpus_{variant}"]
    if rank1["listed"]["start"] is None or not rank0["listed"]["start"]:
        pytest.skip("NVML cannot list the ranks' processes here (pynvml missing, or another pid namespace)")
    if rank1["listed"]["start"]:
        pytest.skip("rank 1 was listed on GPU 0 before the step and the save (made by something before them)")
    assert rank1["listed"] == {"start": False, "after_a_step": False, "after_an_async_save": False}, rank1["listed"]


# ---- 4. the host step during backward -------------------------------------------------------------------


@on_gpu
@pytest.mark.parametrize("label", list(HOST_CASES))
def test_the_host_step_during_backward_gives_the_bits_of_the_step_after_it(results, label):
    (r,) = results[f"host_{label}"]
    assert r["error"] is None, r["error"]
    steps = HOST_CASES[label]["steps"]
    assert r["records"] == (steps, steps), r["records"]
    assert r["diffs"] == [0.0] * steps, r["diffs"]
    report = r["report"]
    assert report is not None and report["ahead"] + report["redone"] >= 1, report  # the overlap was exercised


@on_gpu
def test_an_overflow_under_16_mixed_skips_the_step_and_halves_the_scale_as_without_overlap(results):
    (r,) = results["host_overflow_16_mixed"]
    assert r["error"] is None, r["error"]
    with_overlap, without = r["scales"]
    assert with_overlap == without, r["scales"]
    assert with_overlap[1] < with_overlap[0] and r["moved_at_inf"] is False, r


# ---- 5. storage under the allocator ------------------------------------------------------------------------


def _assert_storage(r: dict) -> None:
    assert r["diff"] == 0.0, r["diff"]
    found = r["findings"]
    assert found["unit_allocs"] >= STORAGE_STEPS * STORAGE_SHAPE["n_layer"] and found["unit_frees"] > 0, found
    assert found["counts"] == dict.fromkeys(("unit_off_compute", "unit_deferred_frees", "reused_across_streams", "reused_while_pending"), 0), {
        k: found[k] for k in ("counts", "unit_off_compute", "unit_deferred_frees", "reused_across_streams", "reused_while_pending")
    }
    memory = r["memory"]
    # the report claims no more than is allocated (its model state and kept buffers are all live tensors)
    assert memory["report_device_total"] + memory["report_comm_buffers"] <= memory["allocated_at_rest"], memory


@on_gpu
def test_stage_3_storage_lives_on_the_compute_stream_under_the_caching_allocator(results):
    _assert_storage(results["storage"][0])


@on_gpu
def test_stage_3_storage_lives_on_the_compute_stream_with_expandable_segments(expandable):
    (r,) = expandable["storage"]
    assert r["expandable"], "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True did not reach the allocator"
    _assert_storage(r)


# ---- the trace reader, on hand-made traces (anywhere) ----------------------------------------------------

COMPUTE, REDUCE = 0, 7


def _entry(action: str, addr: int, size: int = 512, stream: int = COMPUTE, unit: bool = False) -> dict:
    frames = [{"filename": "/src/lightning_zero/engine/shards/gathered_storage.py", "line": 1, "name": "grow"}] if unit else []
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames}


def _freed(addr: int, size: int = 512, stream: int = COMPUTE, deferred: bool = False) -> list[dict]:
    requested, completed = _entry("free_requested", addr, size, stream), _entry("free_completed", addr, size, stream)
    return [requested, _entry("alloc", 10**9, 512, REDUCE), completed] if deferred else [requested, completed]


def test_the_trace_reader_finds_nothing_in_stream_ordered_reuse():
    trace = [
        _entry("alloc", 0, 1024, unit=True), *_freed(0, 1024),
        _entry("alloc", 0, 512), _entry("alloc", 512, 512),  # the freed block split, on its own stream
        _entry("alloc", 4096, 512, REDUCE), *_freed(4096, 512, REDUCE), _entry("alloc", 4096, 512, REDUCE),
    ]  # fmt: skip
    found = allocator_findings(trace, COMPUTE, {REDUCE: "reduce"})
    assert found["counts"] == dict.fromkeys(("unit_off_compute", "unit_deferred_frees", "reused_across_streams", "reused_while_pending"), 0)
    assert (found["unit_allocs"], found["unit_frees"], found["deferred_frees"]) == (1, 1, 0)
    assert found["allocs_by_stream"] == {"compute": 3, "reduce": 2}


def test_the_trace_reader_finds_memory_handed_to_another_stream_and_reused_before_a_deferred_free():
    trace = [
        _entry("alloc", 0, 1024), *_freed(0, 1024),
        _entry("alloc", 512, 256, REDUCE),  # inside memory the compute stream freed: reused across streams
        _entry("alloc", 8192, 512), _entry("free_requested", 8192),
        _entry("alloc", 8192, 512),  # before the deferred free completed
        _entry("free_completed", 8192),
        _entry("alloc", 20000, 512), *_freed(20000), _entry("segment_free", 20000, 2048),
        _entry("alloc", 20000, 512, REDUCE),  # the driver took it back in between: fine
    ]  # fmt: skip
    found = allocator_findings(trace, COMPUTE)
    assert found["counts"]["reused_across_streams"] == 1 and found["reused_across_streams"][0]["addr"] == 512
    assert found["counts"]["reused_while_pending"] == 1 and found["reused_while_pending"][0]["addr"] == 8192
    assert found["deferred_frees"] == 1


def test_the_trace_reader_flags_unit_storage_off_the_compute_stream_or_freed_late():
    trace = [
        _entry("alloc", 0, 1024, REDUCE, unit=True), *_freed(0, 1024, REDUCE),
        _entry("alloc", 4096, 1024, unit=True), *_freed(4096, 1024, deferred=True),
    ]  # fmt: skip
    found = allocator_findings(trace, COMPUTE)
    assert found["counts"]["unit_off_compute"] == 2  # its allocation and its free
    assert found["counts"]["unit_deferred_frees"] == 1 and found["unit_frees"] == 2
