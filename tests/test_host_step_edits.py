"""The verdict of the host step during backward against every way user code edits gradients or
hyperparameters between backward and ``optimizer.step()`` (issue 59, N3/N5/N7/N10), driven through
the engine in one process (quick to diagnose; ``test_host_step_verdict.py`` runs the same edits
through the Trainer on 2 ranks).

Each edit runs twice, with ``overlap_host_step`` on and off: the weights must be bitwise equal, and
the step the edit follows must be redone for the reason that names what saw it. The host step is
waited for before the edit (``wait_for_host_step``), so the worker has stepped on the unedited
gradients and only the verdict can tell. At one rank an offloaded engine takes the sharded path
(its rows go through the host, ``param.grad`` is a ``ShardedGradient``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch

from host_step_modes import StepRecorder, mode_between, same_history
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.gradients.norms import clip_grads_by_global_norm_
from lightning_zero.engine.host_step_overlap import ScaleOf
from lightning_zero.engine.offload.bucket_step import (
    CHUNKS_READ,
    CONTENTS_CHANGED,
    GRADIENTS_CHANGED,
    HYPERPARAMETERS_CHANGED,
)
from lightning_zero.engine.offload.grad_digest import LANES, digest, same
from lightning_zero.engine.offload.backoff import BACKOFF_REASON

WIDTH = 16
SMALL_BUCKETS = 0.001
"""About one Linear per bucket: a backward lands several buckets."""


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])


def _config(stage: int, overlap: bool, **extra: Any) -> ZeroConfig:
    placement = {"offload_params": True, "unit_classes": ["Linear"]} if stage == 3 else {"bucket_size_mb": SMALL_BUCKETS}
    return ZeroConfig(stage=stage, offload_optimizer=True, overlap_host_step=overlap, fused_host_step=False, **{**placement, **extra})


def _shards(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What the optimizer steps: this rank's chunks, whose ``.grad`` is a host tensor."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


Edit = Callable[[torch.nn.Module, torch.optim.Optimizer, Any], Any]


def _run(
    overlap: bool,
    edit: Optional[Edit] = None,
    stage: int = 2,
    optimizer: str = "sgd",
    steps: int = 2,
    edit_at: tuple[int, ...] = (0,),
    scheduler: bool = False,
    plan: Optional[dict] = None,
    before_step: Optional[Callable[[ZeroEngine, torch.optim.Optimizer], None]] = None,
    model: Callable[[], torch.nn.Module] = _model,
    unit_classes: Optional[list[str]] = None,
) -> dict:
    """``steps`` steps of ``model`` under an offloading engine; ``edit(model, optimizer, scheduler)``
    after the host step of each step in ``edit_at``. The weights after every step, how each step was
    taken, the report."""
    torch.manual_seed(0)
    net = model()
    if optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    elif optimizer == "adamw_tensor_lr":
        opt = torch.optim.AdamW(net.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    extra = {"unit_classes": unit_classes} if unit_classes else {}
    config = _config(stage, overlap, **extra)
    engine = ZeroEngine(net, [opt], config, device=torch.device("cpu"))
    if plan is not None and overlap:
        engine.plan_host_step(**plan)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5) if scheduler else None
    torch.manual_seed(1)
    record = StepRecorder(engine)
    try:
        for step in range(steps):
            engine.begin_step()
            net(torch.randn(4, WIDTH)).pow(2).mean().backward()
            engine.finish_backward()
            engine.end_step()
            engine.wait_for_host_step()  # the worker has stepped on the gradients as backward left them
            if edit is not None and step in edit_at:
                edit(net, opt, sched)
            if before_step is not None:
                before_step(engine, opt)
            opt.step()
            engine.after_optimizer_step(opt)
            opt.zero_grad()
            if sched is not None:
                sched.step()
            record.after_step(net)
    finally:
        engine.close()
    return record.results()


def _twins(**kwargs: Any) -> tuple[dict, dict]:
    return _run(True, **kwargs), _run(False, **kwargs)


# ---- every edit form -------------------------------------------------------------------------------


def _each(params: Any, edit: Callable[[torch.Tensor], Any]) -> None:
    for p in params:
        if p.grad is not None:
            edit(p)


def _numpy_halve(shard: torch.Tensor) -> None:
    view = shard.grad.numpy()  # shares the gradient's memory, moves no version counter
    np.multiply(view, 0.5, out=view)


GRADIENT_EDITS: dict[str, tuple[Edit, str]] = {
    # through `param.grad` (the `ShardedGradient` view): its in-place edits and its aliases' move versions
    "grad_in_place": (lambda m, o, s: _each(m.parameters(), lambda p: p.grad.mul_(0.5)), GRADIENTS_CHANGED),
    "grad_data_clamp": (lambda m, o, s: _each(m.parameters(), lambda p: p.grad.data.clamp_(-1e-3, 1e-3)), GRADIENTS_CHANGED),
    "grad_detach": (lambda m, o, s: _each(m.parameters(), lambda p: p.grad.detach().mul_(0.5)), GRADIENTS_CHANGED),
    "grad_data_data_zero": (lambda m, o, s: _each(m.parameters(), lambda p: p.grad.data.data.zero_()), GRADIENTS_CHANGED),
    "grad_assigned": (lambda m, o, s: _each(m.parameters(), lambda p: setattr(p, "grad", p.grad * 0.5)), GRADIENTS_CHANGED),
    "grad_dropped": (lambda m, o, s: setattr(next(iter(m.parameters())), "grad", None), GRADIENTS_CHANGED),
    "grad_copy": (lambda m, o, s: _each(m.parameters(), lambda p: p.grad.copy_(p.grad * 0.5)), GRADIENTS_CHANGED),
    "grad_masked_fill": (lambda m, o, s: _each(m.parameters(), lambda p: p.grad.masked_fill_(p.detach() > 0, 0.0)), GRADIENTS_CHANGED),
    # the optimizer's own shards (what Lightning's precision plugin sees): `.data` and NumPy move none
    "shard_numpy": (lambda m, o, s: [_numpy_halve(p) for p in _shards(o)], CONTENTS_CHANGED),
    "shard_data": (lambda m, o, s: [p.grad.data.mul_(0.5) for p in _shards(o)], CONTENTS_CHANGED),
    "shard_data_neg": (lambda m, o, s: [p.grad.data.neg_() for p in _shards(o)], CONTENTS_CHANGED),
    "shard_data_assigned": (lambda m, o, s: [setattr(p.grad, "data", p.grad * 0.5) for p in _shards(o)], CONTENTS_CHANGED),
    "shard_detach": (lambda m, o, s: [p.grad.detach().mul_(0.5) for p in _shards(o)], GRADIENTS_CHANGED),
    "shard_set": (lambda m, o, s: [p.grad.set_(p.grad * 0.5) for p in _shards(o)], GRADIENTS_CHANGED),
    "shard_assigned": (lambda m, o, s: [setattr(p, "grad", p.grad * 0.5) for p in _shards(o)], GRADIENTS_CHANGED),
    # torch's clipping on the module's parameters and on the optimizer's
    "clip_grad_norm_params": (lambda m, o, s: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3), GRADIENTS_CHANGED),
    "clip_grad_norm_groups": (lambda m, o, s: torch.nn.utils.clip_grad_norm_(_shards(o), 1e6), GRADIENTS_CHANGED),
    "clip_grad_value_params": (lambda m, o, s: torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3), GRADIENTS_CHANGED),
    "clip_grad_value_groups": (lambda m, o, s: torch.nn.utils.clip_grad_value_(_shards(o), 1e-3), GRADIENTS_CHANGED),
}


UNSEEN_BY_VERSIONS = ("grad_data_clamp", "shard_numpy", "shard_data")
"""The forms no version counter saw before issue 59, also at stages 1 and 3."""


@pytest.mark.parametrize(
    "name, stage", [(name, 2) for name in GRADIENT_EDITS] + [(name, stage) for stage in (1, 3) for name in UNSEEN_BY_VERSIONS]
)
def test_each_gradient_edit_is_seen_by_the_verdict(name, stage):
    edit, reason = GRADIENT_EDITS[name]
    ahead, after = _twins(edit=edit, stage=stage)
    assert same_history(ahead, after)
    assert ahead["modes"] == ["redone", "after_backward"], ahead["modes"]
    assert ahead["report"].reasons == {reason: 1, BACKOFF_REASON: 1}, ahead["report"].reasons


HYPERPARAMETER_EDITS: dict[str, tuple[Edit, str]] = {
    "lr_float": (lambda m, o, s: [g.__setitem__("lr", g["lr"] * 0.5) for g in o.param_groups], "adamw"),
    "lr_tensor_in_place": (lambda m, o, s: [g["lr"].mul_(0.5) for g in o.param_groups], "adamw_tensor_lr"),
    "weight_decay": (lambda m, o, s: [g.__setitem__("weight_decay", 0.5) for g in o.param_groups], "adamw"),
    "betas_replaced": (lambda m, o, s: [g.__setitem__("betas", (0.8, 0.99)) for g in o.param_groups], "adamw"),
    "scheduler_stepped_between": (lambda m, o, s: s.step(), "adamw"),
}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # on purpose, between backward and the step
@pytest.mark.parametrize("name", list(HYPERPARAMETER_EDITS))
def test_each_hyperparameter_edit_is_seen_by_the_verdict(name):
    edit, optimizer = HYPERPARAMETER_EDITS[name]
    scheduler = name.startswith("scheduler")
    ahead, after = _twins(edit=edit, optimizer=optimizer, scheduler=scheduler)
    assert same_history(ahead, after)
    assert ahead["modes"] == ["redone", "after_backward"], ahead["modes"]
    assert ahead["report"].reasons == {HYPERPARAMETERS_CHANGED: 1, BACKOFF_REASON: 1}


def test_weights_written_after_the_step_taken_ahead_raise():
    """A write to the optimizer's chunks after the worker stepped them lands on the stepped weights;
    no rollback can say what it would have done before the step, so the verdict says so loudly."""
    def decay(m: torch.nn.Module, o: torch.optim.Optimizer, s: Any) -> None:
        with torch.no_grad():
            for p in _shards(o):
                p.mul_(0.99)  # the optimizer's own chunks, stepped already by the worker

    def decay_and_halve(m: torch.nn.Module, o: torch.optim.Optimizer, s: Any) -> None:
        _each(m.parameters(), lambda p: p.grad.mul_(0.5))  # a redo alone would roll the write back
        decay(m, o, s)

    for edit in (decay, decay_and_halve):
        with pytest.raises(RuntimeError, match="written between backward and `optimizer.step\\(\\)`.*HINT"):
            _run(True, edit=edit)
    _run(False, edit=decay)  # taken after backward, the step reads the written weights


def test_a_hyperparameter_container_edited_in_place_is_seen():
    from lightning_zero.engine.offload.bucket_step import _same, hyperparameters_of

    group = {"params": [], "lr": torch.tensor(0.1), "betas": [0.9, 0.99], "nested": {"k": torch.ones(2)}}
    taken = hyperparameters_of(group, copy=True)
    assert _same(hyperparameters_of(group), taken)
    group["betas"][0] = 0.8  # a list edited in place: the snapshot copied it
    assert not _same(hyperparameters_of(group), taken)
    group["betas"][0] = 0.9
    group["nested"]["k"].mul_(2)
    assert not _same(hyperparameters_of(group), taken)
    assert _same({"x": float("nan")}, {"x": float("nan")})  # a NaN hyperparameter is no edit


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_tensor_lr"])
def test_a_scheduler_after_the_step_keeps_steps_ahead(optimizer):
    ahead, after = _twins(optimizer=optimizer, scheduler=True, steps=3)
    assert same_history(ahead, after)
    assert ahead["modes"] == ["ahead"] * 3 and ahead["report"].reasons == {}
    assert ahead["report"].content_checks == 3  # the engine's own API: always compared


def test_reads_and_clipping_that_does_not_apply_keep_the_step():
    def reads(m: torch.nn.Module, o: torch.optim.Optimizer, s: Any) -> None:
        params = list(m.parameters())
        torch.nn.utils.get_total_norm([p.grad for p in params])
        [(p.grad.norm(), p.grad.abs().max(), p.grad.data.sum()) for p in params]
        [(p.grad.numpy().sum(), p.grad.data.norm()) for p in _shards(o)]
        clip_grads_by_global_norm_(_shards(o), 1e6, torch.device("cpu"))  # ours skips the multiply by 1.0

    ahead, after = _twins(edit=reads, steps=2, edit_at=(0, 1))
    assert same_history(ahead, after)
    assert ahead["modes"] == ["ahead", "ahead"] and ahead["report"].reasons == {}


# ---- the norms the worker remembers ------------------------------------------------------------------


@pytest.mark.parametrize("through, reason", [("param.grad.data", GRADIENTS_CHANGED), ("shard.grad.data", CONTENTS_CHANGED)])
def test_clipping_after_a_data_edit_uses_the_new_norm(through, reason):
    """The worker remembers each gradient's norm for clipping; halving the gradients through ``.data``
    must keep the old norm from being used (with it, clipping at a bound between the two norms would
    clip the halved gradients once more): through ``param.grad.data`` the version moves, through the
    optimizer's ``shard.grad.data`` none does and the content check tells."""
    box: dict = {}

    def halve(m: torch.nn.Module, o: torch.optim.Optimizer, s: Any) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in _shards(o)]))
        box["bound"] = 0.75 * norm.item()  # between the halved norm and the norm
        edited = m.parameters() if through == "param.grad.data" else _shards(o)
        _each(edited, lambda p: p.grad.data.mul_(0.5))

    def clip(engine: ZeroEngine, o: torch.optim.Optimizer) -> None:
        clip_grads_by_global_norm_(_shards(o), box.pop("bound", 1e6), torch.device("cpu"))

    ahead, after = _twins(edit=halve, before_step=clip, plan={"keep_rollback": True})
    assert same_history(ahead, after)
    assert ahead["report"].reasons == {reason: 1, BACKOFF_REASON: 1}


def test_a_remembered_norm_reads_the_version_before_the_norm(monkeypatch):
    """An edit racing ``remember_grad_norms`` (here: made while the norm is computed) moves the
    version after it was read, so the norm, of the gradient before the edit, is never used."""
    from lightning_zero.engine.shards import precomputed_norms

    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    computing = precomputed_norms.norms_of

    def racing(tensors: Any, norm_type: float = 2.0) -> Any:
        norms = computing(tensors, norm_type)
        p.grad.mul_(2)  # the concurrent edit lands after the norm read the gradient
        return norms

    monkeypatch.setattr(precomputed_norms, "norms_of", racing)
    precomputed_norms.remember_grad_norms([p])
    monkeypatch.setattr(precomputed_norms, "norms_of", computing)
    assert precomputed_norms.remembered_grad_norms([p], 2.0)[0] is None


def test_a_remembered_norm_is_not_used_after_a_content_edit():
    from lightning_zero.engine.offload.grad_digest import GradContents
    from lightning_zero.engine.shards.precomputed_norms import remember_grad_norms, remembered_grad_norms

    row = torch.tensor([3.0, 4.0, 0.0, 1.0])
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    params[0].grad, params[1].grad = row[:2], row[2:]
    contents = GradContents.take(row, [p.grad for p in params], [True, True])
    asked = []

    def still_valid() -> bool:
        asked.append(1)
        return contents.unchanged([p.grad for p in params])

    remember_grad_norms(params, still_valid=still_valid)
    assert [n.item() for n in remembered_grad_norms(params, 2.0)] == [5.0, 1.0] and len(asked) == 1  # asked once
    params[0].grad.data.mul_(0.5)  # no version moves
    assert remembered_grad_norms(params, 2.0) == [None, None]


# ---- the digest ---------------------------------------------------------------------------------------


def test_the_digest_sees_any_one_element_changed_at_any_alignment():
    base = torch.randn(4 * LANES + 37)
    for offset in range(4):
        for n in (0, 1, 3, 2 * LANES - 1, 2 * LANES, 2 * LANES + 1, 4 * LANES + 5):
            taken = digest(base[offset : offset + n])
            assert same(digest(base.clone()[offset : offset + n]), taken)
            for i in range(n):
                edited = base.clone()
                edited[offset + i] = torch.nextafter(edited[offset + i], torch.tensor(float("inf")))  # one ulp
                assert not same(digest(edited[offset : offset + n]), taken), (offset, n, i)


def test_the_digest_sees_an_edit_in_any_block():
    from lightning_zero.engine.offload import grad_digest

    grad = torch.randn(grad_digest._BLOCK // 4 * 2 + 5)  # two blocks of sums and a tail
    taken = digest(grad)
    for i in (0, grad_digest._BLOCK // 4 + 7, grad.numel() - 6, grad.numel() - 1):
        edited = grad.clone()
        edited[i] = torch.nextafter(edited[i], torch.tensor(float("inf")))
        assert not same(digest(edited), taken), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_digest_sees_the_usual_edits(dtype):
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(1 << 14, generator=g).to(dtype)
    taken = digest(grad)
    edits = {
        "neg": lambda t: t.neg_(),
        "abs": lambda t: t.abs_(),
        "times 2": lambda t: t.mul_(2),
        "times 0.5": lambda t: t.mul_(0.5),
        "times 0.9": lambda t: t.mul_(0.9),
        "clamp": lambda t: t.clamp_(-1e-3, 1e-3),
        "zero": lambda t: t.zero_(),
        "noise": lambda t: t.add_(torch.randn(t.shape, generator=g).to(dtype), alpha=1e-3),
        "one bias flipped": lambda t: t[:64].neg_(),
        "every other zeroed": lambda t: t[::2].zero_(),
        "sign": lambda t: t.sign_(),
    }
    for name, edit in edits.items():
        edited = grad.clone()
        edit(edited)
        assert not same(digest(edited), taken), name
    with_nan = grad.clone()
    with_nan[3] = float("nan")
    assert same(digest(with_nan), digest(with_nan.clone()))  # NaN and -0.0 are bits like any other


# ---- N5: reads before the verdict ----------------------------------------------------------------------


class _WithAux(torch.nn.Module):
    """Block units and an ``aux`` unit registered last, called first, whose output is unused: its
    bucket gets no gradient, and ``finish_backward`` gathers it (backward never reached it)."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_zero.models.gpt import Block, GPTConfig

        config = GPTConfig(block_size=8, n_layer=4, n_head=2, n_embd=WIDTH)
        self.blocks = torch.nn.ModuleList(Block(config) for _ in range(4))
        self.aux = Block(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aux(x.view(-1, 1, WIDTH))
        x = x.view(-1, 1, WIDTH)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("keep_rollback", [True, False])
def test_an_unused_unit_read_after_backward_redoes_nothing(keep_rollback):
    plan = {"keep_rollback": keep_rollback, "check_contents": keep_rollback}  # False: the Trainer's plan without hooks
    ahead, after = _twins(stage=3, steps=3, model=_WithAux, unit_classes=["Block"], plan=plan)
    assert same_history(ahead, after)
    assert ahead["modes"] == ["ahead"] * 3 and ahead["report"].reasons == {}, ahead["report"]


class _WorkerLate:
    """A handoff scheduler (see [Note: handoffs]) that is plain threading, except that the worker,
    once it has handed a batch's gradients out, waits to take its buckets until the training thread
    waits for something it has not done yet: the latest the worker can be, so every read of the chunks before the verdict
    finds its bucket not taken yet (the order a busy host gives now and then)."""

    def __init__(self) -> None:
        self.main = threading.get_ident()
        self.main_waits = threading.Event()
        self.held = 0

    def point(self, name: str) -> None:
        if name == "gradients handed out" and threading.get_ident() != self.main:
            self.held += 1
            self.main_waits.wait(timeout=30)
            self.main_waits.clear()

    def wait_until(self, ready: Callable[[], bool], name: str, token: object) -> None:
        if threading.get_ident() == self.main and not ready():
            self.main_waits.set()

    def adopt_thread(self, worker: object) -> None: ...
    def submitted(self, worker: object, job: object) -> None: ...
    def job_started(self, job: object) -> None: ...
    def job_finished(self, job: object) -> None: ...
    def signalled(self, token: object) -> None: ...


@pytest.mark.parametrize("keep_rollback", [True, False])
def test_an_unused_unit_read_before_the_worker_took_its_bucket_redoes_nothing(keep_rollback):
    """The read calls the bucket's step off (it is never waited for: see ``_settle_bucket``); a
    bucket no rank used steps nothing, so the verdict has nothing to redo."""
    from lightning_zero.engine.offload import handoffs

    plan = {"keep_rollback": keep_rollback, "check_contents": keep_rollback}
    late = _WorkerLate()
    with handoffs.scheduled(late):
        ahead = _run(True, stage=3, steps=3, model=_WithAux, unit_classes=["Block"], plan=plan)
    after = _run(False, stage=3, steps=3, model=_WithAux, unit_classes=["Block"], plan=plan)
    assert late.held > 0
    assert same_history(ahead, after)
    assert ahead["modes"] == ["ahead"] * 3 and ahead["report"].reasons == {}, ahead["report"]


def _read_one_bucket(engine: ZeroEngine, optimizer: torch.optim.Optimizer) -> None:
    """A read of one stepped bucket's master chunks before the verdict (as a gather would)."""
    host = engine.buckets[1].host
    with host.in_memory():
        host.master.sum()


@pytest.mark.parametrize("keep_rollback", [True, False])
def test_a_read_before_the_verdict_undoes_only_its_bucket(keep_rollback):
    if not keep_rollback:
        with pytest.raises(RuntimeError, match="the chunks were read before the optimizer step.*HINT"):
            _run(True, before_step=_read_one_bucket, plan={"keep_rollback": False})
        return
    ahead, after = _twins(before_step=_read_one_bucket, steps=1)
    assert same_history(ahead, after)
    report = ahead["report"]
    assert ahead["modes"] == ["redone"] and report.reasons == {CHUNKS_READ: 1}
    # the other buckets kept their steps: only the one read stepped again after backward
    stepped_again = report.last.host_step_s - sum(end - start for _, start, end in report.last.buckets)
    assert len(report.last.buckets) > 2 and stepped_again > 0


# ---- N7: planning the same again keeps backing off --------------------------------------------------------


def test_planning_the_same_loss_scale_every_backward_keeps_backing_off():
    """As Fabric with ``16-mixed`` plans on every backward; clipping applies on every step, so each
    step taken ahead is redone, and backing off must take 1, then 2 steps after backward."""
    from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler

    scaler = ZeroGradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    assert ScaleOf(scaler) == ScaleOf(scaler) and ScaleOf(scaler) != ScaleOf(ZeroGradScaler("cpu"))
    torch.manual_seed(0)
    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    engine = ZeroEngine(net, [opt], _config(2, True), device=torch.device("cpu"))
    modes, previous = [], None
    try:
        for _ in range(7):
            engine.plan_host_step(loss_scale=ScaleOf(scaler))
            engine.begin_step()
            scaler.scale(net(torch.randn(4, WIDTH)).pow(2).mean()).backward()
            engine.finish_backward()
            engine.end_step()
            engine.wait_for_host_step()
            scaler.unscale_(opt)
            clip_grads_by_global_norm_(_shards(opt), 1e-6, torch.device("cpu"))
            scaler.step(opt)
            scaler.update()
            engine.after_optimizer_step(opt)
            opt.zero_grad()
            report = engine.host_step_report()
            modes.append(mode_between(previous, report))
            previous = report
    finally:
        engine.close()
    # step 0: no scale before its backward; then redone, backing off 1, redone, backing off 2, ...
    assert modes == ["after_backward", "redone", "after_backward", "redone", "after_backward", "after_backward", "redone"], modes


# ---- N10: the worker's CUDA device ------------------------------------------------------------------------


def test_the_worker_sets_the_ranks_cuda_device_first(monkeypatch):
    """Where the process uses CUDA, the worker thread sets the device the engine's thread has (a new
    thread's is GPU 0); on the CPU it touches nothing of CUDA."""
    from lightning_zero.engine.offload import handoffs

    calls: list[tuple[int, str]] = []
    _run(True, steps=1)  # CPU: no CUDA call (set_device would raise here without a GPU)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append((device, threading.current_thread().name)))
    assert handoffs.current_cuda_device() == 3
    _run(True, steps=1)
    assert len(calls) == 1 and calls[0][0] == 3 and calls[0][1].startswith("lightning-zero-host-step"), calls


# ---- a kept step that did not pay: backing off -------------------------------------------------------


def test_a_kept_step_whose_content_check_costs_more_than_it_hides_backs_off(monkeypatch):
    """Judged from the last step's timing alone: the worker's part after backward plus the verdict,
    against the whole host step; only where the verdict compared contents and the step is long."""
    from lightning_zero.engine.offload import backoff
    from lightning_zero.engine.offload.backoff import paid_off
    from lightning_zero.engine.offload.host_step_report import HostStepTiming

    WORTH_JUDGING_S = 0.02  # the default, which the suite's environment lifts (tests/conftest.py)
    monkeypatch.setattr(backoff, "WORTH_JUDGING_S", WORTH_JUDGING_S)

    step = 4 * WORTH_JUDGING_S
    end = 100.0

    def timing(tail_s: float, verdict_s: float, host_step_s: float = step) -> HostStepTiming:
        return HostStepTiming("ahead", ((0, end - 1.0, end + tail_s),), end, host_step_s, verdict_s)

    assert paid_off(timing(tail_s=0.1 * step, verdict_s=0.5 * step))  # hides 40% of the step
    assert not paid_off(timing(tail_s=0.5 * step, verdict_s=0.6 * step))  # exposes more than stepping after
    assert paid_off(timing(tail_s=0.5 * step, verdict_s=0.05 * step))  # no content check: judged as it was
    assert paid_off(timing(tail_s=1.0, verdict_s=1.0, host_step_s=WORTH_JUDGING_S / 2))  # too short to judge


def test_backing_off_after_a_costly_step_counts_its_own_reason():
    from lightning_zero.engine.offload.backoff import COSTLY_REASON, BackOff

    backoff = BackOff()
    assert backoff.why_not() == ""
    backoff.after_step("ahead", paid=False, was_backing_off=False)
    assert (backoff.left, backoff.why_not()) == (1, COSTLY_REASON)
    backoff.after_step("after_backward", paid=True, was_backing_off=True)
    assert backoff.why_not() == ""
    backoff.after_step("ahead", paid=False, was_backing_off=False)
    assert (backoff.length, backoff.left) == (2, 2)  # twice as long while it keeps not paying
    backoff.after_step("redone", paid=True, was_backing_off=False)
    assert (backoff.length, backoff.left, backoff.why_not()) == (4, 4, BACKOFF_REASON)
    backoff.after_step("ahead", paid=True, was_backing_off=False)
    assert backoff.length == 0
