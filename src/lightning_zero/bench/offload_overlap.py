"""`lightning-zero bench --offload-overlap`: how much of an offloaded host step a slow backward hides
(issue 53's CPU stand-in for a GPU), and how close the host step runs to the memory's speed.

[Note: the overlap stand-in]
On a GPU, backward runs on the device and leaves the host free: with `ZeroConfig.overlap_host_step`
the host steps each bucket's chunks as soon as their gradients land, so by the time backward ends most
of the host step is done. On a CPU, backward's kernels take the very cores the host step needs, so a
sleep stands for the GPU's time: an identity autograd function around block 0's output sleeps S ms
in its backward, after the later blocks' gradients are reduced and on the host and before block 0's
own backward (`time.sleep` releases the GIL and the cores). The control is the same sleep in block
0's forward: same work, same sleep, but before backward starts, so nothing can hide behind it.

Per step, the time *exposed* after backward is measured from `loss.backward()` returning to the end
of `engine.after_optimizer_step` (finish_backward, end_step, the clipping, `optimizer.step()`,
after_optimizer_step); issue 53 asks that with overlap it be at most 0.35x with the sleep in backward
what it is with the sleep in forward, with clipping on and off. With `overlap_host_step=False` the
two are the same by construction: the baseline. The whole host step is `optimizer.step()` with
overlap off and the sleep in forward, set against AdamW's bytes (`host_bandwidth.adamw_step_bytes`)
and the memory probe (`host_bandwidth.measure_host_bandwidth`), run on every rank at once, before and
after the steps. The host step is torch's fused CPU kernel here (`HOST_KERNEL`, not the engine's
default): its one pass over the chunks is what `adamw_step_bytes` counts, and the figures stay
comparable with those issue 53 measured with it.

Each variant runs in fresh processes (`worker.run_variant`; at one rank, on the sharded path:
`COLLECTIVES_AT_ONE_RANK`), first an engine with overlap off and then one with it on, each seeded
alike. An engine steps its conditions round-robin, one step of each sleep place and clipping setting
per round, so that a load changing on a shared machine hits them alike. Without `--sleep-ms` the
sleep is `SLEEP_FACTOR` x the host step as the first engine's warm-up rounds (which sleep 0) time it,
the largest any rank measured: long enough for the whole host step to hide, which is what a GPU whose
backward outlasts the host step offers.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.bench import offload_overlap_report, provenance, report, variants, worker
from lightning_zero.bench.host_bandwidth import HostBandwidth, measure_host_bandwidth
from lightning_zero.bench.offload_overlap_results import (
    CLIPPING, HOOKS, SETTINGS, SLEEP_PLACES, ConditionTimes, OverlapRankMeasurement, OverlapResult, OverlapRow, summarize,
)  # fmt: skip
from lightning_zero.bench.options import BenchOptions, model_config, num_parameters
from lightning_zero.bench.rank import BuiltRank, build_rank
from lightning_zero.bench.results import OK
from lightning_zero.bench.run import check_devices
from lightning_zero.bench.variants import VariantSpec
from lightning_zero.engine.gradients.norms import clip_grads_by_global_norm_
from lightning_zero.models.gpt import GPTConfig

SLEEP_FACTOR = 2.0
"""The default sleep over the warm-up's host step (see [Note: the overlap stand-in])."""
CONDITIONS = tuple(itertools.product(SLEEP_PLACES, SETTINGS))
"""(sleep place, setting name): the steps of one round, in order."""
HOST_KERNEL = {"fused_host_step": True}
"""The host step's kernel in these runs: torch's fused CPU one (see [Note: the overlap stand-in])."""


def _say_nothing(line: str) -> None:
    """The default progress callback: silence."""


def run_offload_overlap(options: BenchOptions, progress: Callable[[str], None] = _say_nothing) -> OverlapResult:
    """Measure every selected variant (see the module doc), write the report into `options.out`
    (markdown, `bench.json`, chart) and return it; `progress` receives a few lines per variant."""
    if not options.offload_overlap:
        raise ValueError("run_offload_overlap needs `offload_overlap=True` in the options (build them with `shaped`)")
    check_devices(options)
    environment = provenance.describe_environment(options)  # now, before our own processes load the machine
    config = model_config(options)
    specs = variants.select(options.variants)
    rows = []
    for index, spec in enumerate(specs, start=1):
        progress(f"[{index}/{len(specs)}] {spec.name}: {spec.description}; overlap_host_step off, then on ...")
        run = worker.run_variant(spec, options, config, options.out / report.LOG_DIR_NAME, body=measure_overlap)
        if run.status != OK:
            progress(f"      {run.status}: {run.reason}")
            rows.append(OverlapRow(spec.name, spec.stage, spec.description, run.status, run.reason, None, None, (), ()))
            continue
        row = summarize(spec.name, spec.stage, spec.description, run.ranks)
        _tell(row, progress)
        rows.append(row)
    model = {"config": dataclasses.asdict(config), "num_params": num_parameters(config)}
    result = OverlapResult(environment, provenance.options_record(options), model, tuple(rows), notes=(), files={})
    return report.write_all(
        result, options.out, render=offload_overlap_report.markdown, chart=offload_overlap_report.write_chart
    )


def _tell(row: OverlapRow, progress: Callable[[str], None]) -> None:
    host = row.host_step
    assert host is not None and row.sleep_ms is not None  # a row that ran has both
    progress(
        f"      sleep {row.sleep_ms:,.1f} ms; host step {host.ms:,.1f} ms, {host.bytes_per_s / 1e9:,.1f} GB/s,"
        f" {host.of_bandwidth:.0%} of the memory's {host.bandwidth_bytes_per_s / 1e9:,.1f} GB/s"
    )
    for line in row.lines:
        progress(
            f"      overlap {'on ' if line.overlap_host_step else 'off'}, clipping {line.clipping:5}: exposed"
            f" {line.exposed_backward_ms:,.1f} ms (sleep in backward) vs {line.exposed_forward_ms:,.1f} ms"
            f" (in forward), {line.ratio:.2f}x"
        )


# --- a rank -------------------------------------------------------------------------------------


def measure_overlap(rank: int, spec: VariantSpec, options: BenchOptions, config: GPTConfig) -> OverlapRankMeasurement:
    """A rank's part (a `worker.RankBody`): the memory probe, then both engines' rounds (module doc)."""
    bandwidth = _probe()
    sleep_ms = options.sleep_ms
    times: list[ConditionTimes] = []
    loss = float("nan")
    for overlap in (False, True):
        stepper = _Stepper(build_rank(rank, spec, options, config, len(CONDITIONS), {"overlap_host_step": overlap, **HOST_KERNEL}))
        try:
            warm_up = stepper.rounds(max(options.warmup, 1 if sleep_ms is None else 0), sleep_ms or 0.0)
            if sleep_ms is None:
                sleep_ms = _agreed_sleep_ms(warm_up)
            timed = stepper.rounds(options.steps, sleep_ms)
            loss = stepper.last_loss
        finally:
            stepper.close()
        for sleep_in, clipping in CONDITIONS:
            steps = timed[(sleep_in, clipping)]
            times.append(
                ConditionTimes(
                    overlap, sleep_in, clipping, tuple(s.exposed_s for s in steps), tuple(s.optimizer_step_s for s in steps),
                    tuple(s.host_step_s for s in steps), tuple(s.host_step_before_backward_end_s for s in steps),
                    tuple(s.verdict_s for s in steps),
                )  # fmt: skip
            )
    assert sleep_ms is not None
    bandwidth = max(bandwidth, _probe(), key=lambda probe: probe.bytes_per_s)
    return OverlapRankMeasurement(
        rank, bandwidth, stepper.stepped_numel, stepper.hideable_numel, sleep_ms, tuple(times), loss
    )


def _probe() -> HostBandwidth:
    """The memory probe on every rank at once, as they step at once. Run before and after the steps,
    the better kept: a probe lasts a fraction of a second, and on a shared machine another process
    may take the memory in just that moment, where the steps' medians ride it out."""
    dist.barrier()
    return measure_host_bandwidth()


def _agreed_sleep_ms(warm_up: dict[tuple[str, str], list["_StepTimes"]]) -> float:
    """`SLEEP_FACTOR` x the median `optimizer.step()` of the warm-up (its very first step, which
    creates the optimizer state, left out), the largest over the ranks, so that every rank sleeps alike."""
    ordered = sorted((s for steps in warm_up.values() for s in steps), key=lambda s: s.index)[1:]
    host_s = statistics.median(s.optimizer_step_s for s in ordered) if ordered else 0.0
    agreed = torch.tensor([SLEEP_FACTOR * host_s * 1e3], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return float(agreed)


@dataclasses.dataclass(frozen=True)
class _StepTimes:
    index: int
    """The engine's step count before this one."""
    exposed_s: float
    optimizer_step_s: float
    host_step_s: float = 0.0
    """The host's time stepping (``engine.host_step_report().last``; 0 where it reports none)."""
    host_step_before_backward_end_s: float = 0.0
    """Of that, what ran before backward ended (the host step during backward)."""
    verdict_s: float = 0.0
    """The verdict's comparisons (``host_step_report().last.verdict_s``)."""


class _Stepper:
    """Our engine driven step by step, with block 0's output wrapped by `_SleepAt` (module doc)."""

    def __init__(self, built: BuiltRank) -> None:
        self.built = built
        wrapped: Any = built.wrapped  # an `OursWrapped`: the options admit only our offload variants
        self.engine, self.optimizer, self.model = wrapped.engine, wrapped.optimizer, wrapped.model
        self.sleep = _SleepAt()
        self._hook = self.model.blocks[0].register_forward_hook(self.sleep.hook)
        self.steps = 0
        self.last_loss = float("nan")
        self.stepped_numel = sum(p.numel() for group in self.optimizer.param_groups for p in group["params"])
        self.hideable_numel = _hideable_numel(self.engine, self.model)

    def rounds(self, count: int, sleep_ms: float) -> dict[tuple[str, str], list[_StepTimes]]:
        """`count` rounds of one step per condition, each condition on its own batch; the times by condition."""
        out: dict[tuple[str, str], list[_StepTimes]] = {condition: [] for condition in CONDITIONS}
        for _ in range(count):
            for (sleep_in, setting), (x, y) in zip(CONDITIONS, self.built.batches):
                out[(sleep_in, setting)].append(self.step(x, y, sleep_in, sleep_ms / 1e3, setting))
        return out

    def step(self, x: Tensor, y: Tensor, sleep_in: str, sleep_s: float, setting: str) -> _StepTimes:
        """One training step as `OursWrapped.step` takes it, with the clock read where backward ends,
        around `optimizer.step()` and after the parameters are refreshed. ``setting``: a `CLIPPING`
        one, or a `HOOKS` one (`_edit_point` runs between backward and the step)."""
        engine, optimizer = self.engine, self.optimizer
        self.sleep.place, self.sleep.seconds = sleep_in, sleep_s
        max_norm, hook = CLIPPING.get(setting), setting in HOOKS
        # as the Trainer plans it: rollback copies only where clipping or a hook may change the step,
        # the content check only where user code runs between backward and the step. Each step
        # afresh (another plan first: a plan starts over only where it changes), so that a firing
        # condition's redo does not make the next condition's step back off (a run where clipping
        # fires step after step backs off instead: 1 redo in up to 65 steps)
        engine.plan_host_step(ahead=False)
        engine.plan_host_step(keep_rollback=max_norm is not None or hook, check_contents=HOOKS.get(setting, False))
        engine.begin_step()
        with self.built.wrapped.setup.autocast():
            loss = self.model(x, y)[1]
        loss.backward()
        backward_end = time.perf_counter()
        engine.finish_backward()
        engine.end_step()
        if max_norm is not None:
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            clip_grads_by_global_norm_(parameters, max_norm, self.built.device)
        if hook:
            _edit_point(self.model, optimizer)
        step_start = time.perf_counter()
        optimizer.step()
        step_end = time.perf_counter()
        engine.after_optimizer_step(optimizer)
        end = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        self.last_loss = float(loss.detach())
        self.steps += 1
        report = engine.host_step_report()
        last = report.last if report is not None else None
        host_s, before_s, verdict_s = (last.host_step_s, last.before_backward_end_s, last.verdict_s) if last is not None else (0.0,) * 3
        return _StepTimes(self.steps - 1, end - backward_end, step_end - step_start, host_s, before_s, verdict_s)

    def close(self) -> None:
        self._hook.remove()
        self.built.wrapped.close()


def _edit_point(model: nn.Module, optimizer: Any) -> None:
    """Where a Lightning callback's ``on_before_optimizer_step`` runs: user code between backward and
    the step, which may edit gradients where no version counter sees it. It edits nothing here, so
    every step taken ahead is kept; what it costs is the verdict's content check."""


def _hideable_numel(engine: Any, model: nn.Module) -> int:
    """Elements of this rank's shards in buckets whose gradients are all complete before block 0's
    backward (the sleep): those whose parameters all belong to blocks 1 and later or to the final
    norm, which backward reaches first. The rest (block 0, the embeddings, the head tied to the token
    embedding, whose gradient completes in the embedding's backward) can only be stepped after it."""
    early = {f"ln_f.{name}" for name, _ in model.ln_f.named_parameters()}
    for index, block in enumerate(model.blocks):
        if index > 0:
            early.update(f"blocks.{index}.{name}" for name, _ in block.named_parameters())
    return sum(bucket.shard_numel for bucket in engine.buckets if all(p.name in early for p in bucket.params))


class _SleepAt:
    """A forward hook for block 0: sleep `seconds` now (place "forward"), or wrap the output in
    `_SleepInBackward` (place "backward"), whose backward sleeps before block 0's own backward."""

    def __init__(self) -> None:
        self.place = "backward"
        self.seconds = 0.0

    def hook(self, module: nn.Module, inputs: Any, output: Tensor) -> Optional[Tensor]:
        if self.seconds <= 0:
            return None
        if self.place == "forward":
            time.sleep(self.seconds)
            return None
        return _SleepInBackward.apply(output, self.seconds)


class _SleepInBackward(torch.autograd.Function):
    """The identity, whose backward sleeps: the time a GPU's backward of the earlier layers leaves the host free."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None
