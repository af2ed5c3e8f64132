"""What one benchmark run measures: the model, the data shape, the world and the variants.

The defaults size a run for a small machine: on 2 CPU cores the thirteen default variants (three of them
DeepSpeed's) finish in about two minutes, ~10 s each, most of it in the 8 steps. Scale `--params` (or
the shape) and `--steps` up for figures that speak for real models.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lightning_zero.bench import variants
from lightning_zero.engine.config import check_shard_group_size
from lightning_zero.models.gpt import GPT, GPTConfig

PRECISIONS = ("fp32", "bf16-mixed")
"""fp32, or Lightning's bf16-mixed: autocast to bf16 around the forward, fp32 model states."""
DEVICES = ("cpu", "cuda")
CAPACITY_MODES = ("model", "batch")
"""What `--capacity` grows: `n_layer` at a fixed width, or the sequences per rank of a fixed model."""
CAPACITY_VARIANTS = ("ddp", "fsdp2_z3", "zero1", "zero2", "zero3", "zero3_offload")
"""The variants a capacity run compares unless `--variants` names others."""
BUDGET_SCOPES = ("device", "host")
"""What a capacity budget charges on the CPU (`budget.py`): what a GPU would hold, or the whole host."""
SHAPES: dict[str, dict[str, int]] = {  # (options set by a shape are `cli/bench.py`'s _SHAPED)
    "launch-bound": dict(n_layer=12, n_embd=64, n_head=4, block_size=32, batch_size=1, warmup=5, steps=100, threads=1),
}
"""Named shapes (`--shape`): defaults for the options they set, which explicit options override.

launch-bound: 12 blocks of width 64 (4 heads), 1 × 32 tokens per rank — compute is negligible, so
the step is the host's work: what a fast GPU exposes (on one H200 in bf16 the 124M GPT's step is
mostly host time too, and zero3's ratio to DDP there matches this shape's on a CPU). A step takes
milliseconds, so it also sets 5 warm-up and 100 timed steps (rounds, with `paired`): enough for the
median's 95% interval to resolve a few % on shared cores. And one intra-op thread per rank: a GPU's
host is one thread, and on a loaded machine two OpenMP threads per rank spin-wait for each other
(measured: DDP's step 15 ms with one thread; 57 ms to 3.5 s with two, other jobs running)."""

OFFLOAD_OVERLAP_DEFAULTS: dict[str, object] = dict(
    n_layer=12, n_embd=512, n_head=8, block_size=32, batch_size=1, devices=1, warmup=1, steps=5,
    variants=("zero2_offload", "zero3_offload"),
)  # fmt: skip
"""`offload_overlap`'s defaults for what the options leave out: a 38M-parameter GPT whose host step
(fused AdamW moving 1.06 GB) takes ~30 ms on two cores; 1 × 32 tokens, so that forward and backward
(~0.2 s here) stay small; twelve blocks, so that the buckets complete before block 0's backward hold
most of the model; one rank. On 2 cores the two variants take about 75 s."""
OVERLAP_VARIANTS = ("zero2_offload", "zero3_offload", "zero3_offload_nvme")
"""The variants `offload_overlap` can measure: host memory offload at stages 2-3, and Adam's moments
on NVMe with the parameter shards in host memory, where `ZeroConfig.overlap_host_step` applies (with
the shards in NVMe files too, the step is taken after backward)."""


@dataclass(frozen=True)
class BenchOptions:
    """Every option of `lightning-zero bench`; checked in `__post_init__`."""

    n_layer: int = 4
    """Transformer blocks (each one a stage-3 / FSDP2 unit)."""
    n_embd: int = 384
    """Width; with the other defaults Ψ = 7.25M parameters and a DDP step of ~0.65 s on one core
    per rank."""
    n_head: int = 6
    """Attention heads (head size 64 at the default width, as GPT-2)."""
    block_size: int = 128
    """Sequence length of every sample."""
    params: Optional[int] = None
    """A target parameter count: when given, `n_embd` is chosen (a multiple of `n_head`) so the
    model comes closest to it, keeping the other shape options."""
    batch_size: int = 8
    """Sequences per rank per step."""
    devices: int = 2
    """Ranks (processes), N."""
    warmup: int = 2
    """Untimed steps first: the optimizer state is created in the first step, and DDP rebuilds its
    buckets after it."""
    steps: int = 5
    """Timed steps; the median is reported."""
    variants: tuple[str, ...] = variants.DEFAULT_VARIANTS
    """Which variants to run (`variants.VARIANTS` names), DDP first whatever the order given; by
    default all but the ownership path's (`zero2_whole`, `zero3_whole`)."""
    precision: str = "fp32"
    """One of `PRECISIONS`."""
    fused: bool = False
    """Use `torch.optim.AdamW(fused=True)` in every variant; issue 8 measured it 3.5x faster than the
    default (for-loop) implementation on CPU, which shrinks the share of the step that stage 1 divides."""
    activation_checkpointing: bool = False
    """Wrap every block in torch's `checkpoint_wrapper` (non-reentrant) in every variant: activations
    are recomputed in backward instead of kept, which the peak column shows."""
    out: Path = Path("bench-results")
    """Directory for the markdown, JSON, PNG and the processes' logs."""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (nccl, one GPU per rank)."""
    seed: int = 1234
    """Seeds the model's initialisation (identical for every variant) and the data."""
    bucket_size_mb: float = 25.0
    """Bucket size for every variant that has one (ours, DDP, DeepSpeed), so they communicate in
    pieces of the same size; 25 MiB is DDP's default."""
    shard_group_size: Optional[int] = None
    """Our variants only: hybrid sharding, states sharded within groups of this many ranks and
    replicated across the groups; the report then splits our traffic by group."""
    nodes: Optional[int] = None
    """Split the ranks into this many simulated nodes of `devices / nodes` consecutive ranks each
    (Lightning's `LOCAL_WORLD_SIZE`): ZeRO++'s variants (`variants.NODE_VARIANTS`) need 2 or more, and
    the report then splits our collectives' bytes into intra-node and inter-node (`links.py`)."""
    timeout_s: float = 900.0
    """A variant whose processes have not all reported by then is killed and marked failed (with
    `capacity`: each try)."""
    capacity: Optional[str] = None
    """One of `CAPACITY_MODES`: search the largest model or batch that trains under `memory_budget`
    (see `capacity.py`) instead of measuring one."""
    memory_budget: Optional[int] = None
    """With `capacity`: bytes every rank must stay under (see `budget.py` for what is counted)."""
    budget_scope: str = "device"
    """With `capacity`, one of `BUDGET_SCOPES`: "device" charges what a GPU would hold (on the CPU,
    offload's host state is left out); "host" charges the whole process, offloaded state included,
    as a host-memory budget does (NVMe files and the page cache are not the process's memory). CPU only."""
    nvme_path: Optional[Path] = None
    """Where `zero3_offload_nvme` keeps its files (each rank in a directory of its own inside): an
    existing directory on the disk to measure. None: a fresh directory under the current directory,
    removed after the run."""
    threads: Optional[int] = None
    """CPU: intra-op threads per rank (`torch.set_num_threads`); None: the cores divided among the ranks."""
    shape: Optional[str] = None
    """The name of the `SHAPES` entry the shape options came from (recorded with the run; build
    options from a shape with `shaped`)."""
    paired: bool = False
    """Step the variants round-robin in the same processes, one step of each in turn, and report
    each one's ratio to DDP as the median of per-round ratios (`paired.py`); variants that cannot
    share a process run alone, as without it."""
    offload_overlap: bool = False
    """Instead of the table: how much of an offloaded host step a slow backward hides (issue 53's CPU
    stand-in, `offload_overlap.py`), for `OVERLAP_VARIANTS`; build with `shaped` for its defaults
    (`OFFLOAD_OVERLAP_DEFAULTS`)."""
    sleep_ms: Optional[float] = None
    """With `offload_overlap`: milliseconds slept in block 0's backward (or forward); None: twice the
    host step the warm-up measures, so that the whole of it could hide."""

    def __post_init__(self) -> None:
        positive = ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "devices", "steps")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"`warmup` must be a non-negative integer, got {self.warmup!r}")
        threads = self.threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"`threads` must be a positive integer or None, got {self.threads!r}")
        if self.params is not None and self.params < 1:
            raise ValueError(f"`params` must be a positive parameter count, got {self.params!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"`precision` must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.device not in DEVICES:
            raise ValueError(f"`device` must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"`bucket_size_mb` must be positive, got {self.bucket_size_mb!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"`timeout_s` must be positive, got {self.timeout_s!r}")
        if self.shard_group_size is not None:
            check_shard_group_size(self.shard_group_size, self.devices)
        self._check_nodes()
        self._check_capacity()
        if self.shape is not None and self.shape not in SHAPES:
            raise ValueError(f"`shape` must be one of {', '.join(SHAPES)}, got {self.shape!r}")
        if self.paired and self.capacity is not None:
            raise ValueError("`paired` times steps; `capacity` searches sizes under a budget: use one or the other")
        self._check_offload_overlap()
        if not self.variants:
            raise ValueError("`variants` must name at least one variant")
        variants.select(self.variants)  # raises for unknown names
        object.__setattr__(self, "variants", tuple(self.variants))
        object.__setattr__(self, "out", Path(self.out))
        if self.nvme_path is not None:
            object.__setattr__(self, "nvme_path", Path(self.nvme_path))
            if not self.nvme_path.is_dir():
                raise ValueError(f"`nvme_path` {self.nvme_path} is not a directory: create it on the disk to measure")
        if self.n_embd % self.n_head and self.params is None:
            raise ValueError(f"`n_head` ({self.n_head}) must divide `n_embd` ({self.n_embd})")

    def _check_nodes(self) -> None:
        nodes = self.nodes
        if nodes is not None:
            if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
                raise ValueError(f"`nodes` must be a positive integer or None, got {nodes!r}")
            if self.devices % nodes:
                divisors = ", ".join(str(d) for d in range(1, self.devices + 1) if self.devices % d == 0)
                raise ValueError(
                    f"`nodes={nodes}` does not split the {self.devices} ranks (`devices`) into equal nodes:"
                    f" it must divide them ({divisors} here)"
                )
        names = tuple(self.variants)
        variants.select(names)  # unknown names raise first, with the list of known ones
        plus = [name for name in names if variants.BY_NAME[name].zero_plus_plus is not None]
        if not plus:
            return
        if nodes is None or nodes < 2:
            raise ValueError(
                f"{', '.join(plus)} (ZeRO++) need{'s' if len(plus) == 1 else ''} `nodes` of 2 or more (`--nodes M`,"
                f" {self.devices} ranks as M nodes of {self.devices}/M): hpZ gathers within a node, qgZ reduces within"
                f" then across nodes, and what they save is measured on the inter-node link; got nodes={nodes!r}"
            )
        if self.shard_group_size is not None:
            raise ValueError(
                f"{', '.join(plus)} (ZeRO++) cannot be combined with hybrid sharding (`shard_group_size`):"
                " the engine refuses hpZ and qgZ with it. Run them in separate benches."
            )

    @property
    def ranks_per_node(self) -> int:
        """Ranks of one (simulated) node: `devices / nodes`, or all of them without `nodes`."""
        return self.devices // (self.nodes or 1)

    def _check_capacity(self) -> None:
        if self.budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"`budget_scope` must be one of {', '.join(BUDGET_SCOPES)}, got {self.budget_scope!r}")
        if self.capacity is None:
            if self.memory_budget is not None:
                modes = ", ".join(CAPACITY_MODES)
                raise ValueError(f"`memory_budget` is only used with `capacity` (one of: {modes})")
            if self.budget_scope != "device":
                raise ValueError("`budget_scope` is only used with `capacity`")
            return
        if self.budget_scope == "host" and self.device != "cpu":
            raise ValueError(
                "`budget_scope='host'` charges the process's resident memory, which is measured on the CPU only;"
                " on CUDA the budget is the device's (`budget_scope='device'`)"
            )
        if self.capacity not in CAPACITY_MODES:
            raise ValueError(f"`capacity` must be one of {', '.join(CAPACITY_MODES)}, got {self.capacity!r}")
        whole = [spec.name for spec in variants.select(self.variants) if spec.whole_tensor]
        if whole:
            raise ValueError(
                f"`capacity` does not search {', '.join(whole)} yet (its prediction has no owner plan);"
                " measure it without `capacity`, and price it with `lightning-zero estimate --whole-tensor-optimizer`"
            )
        budget = self.memory_budget
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"`capacity` needs `memory_budget`, a positive number of bytes, got {budget!r}")

    def _check_offload_overlap(self) -> None:
        if self.sleep_ms is not None:
            if not self.offload_overlap:
                raise ValueError("`sleep_ms` is only used with `offload_overlap`")
            if isinstance(self.sleep_ms, bool) or not isinstance(self.sleep_ms, (int, float)) or not 0 <= self.sleep_ms < float("inf"):
                raise ValueError(f"`sleep_ms` must be a non-negative, finite number of milliseconds, got {self.sleep_ms!r}")
        if not self.offload_overlap:
            return
        for name in ("capacity", "shape", "shard_group_size"):
            if getattr(self, name) is not None:
                raise ValueError(f"`offload_overlap` measures one model of its own, without `{name}`: remove one of them")
        if self.paired:
            raise ValueError("`offload_overlap` pairs its own conditions step by step; remove `paired`")
        if self.device != "cpu":
            raise ValueError(
                "`offload_overlap` is the CPU stand-in for a GPU (a sleep frees the host as a GPU's backward does);"
                " on a GPU, time the offloaded step itself with scripts/offload_gpu.py"
            )
        others = [name for name in self.variants if name not in OVERLAP_VARIANTS]
        if others:
            raise ValueError(
                f"`offload_overlap` measures {', '.join(OVERLAP_VARIANTS)} (where the host step can run during backward),"
                f" not {', '.join(others)}"
            )

    @property
    def tokens_per_step(self) -> int:
        """Tokens all ranks together train on per step."""
        return self.devices * self.batch_size * self.block_size


def shaped(shape: Optional[str], **options: object) -> BenchOptions:
    """`BenchOptions(**options)` with the defaults of `SHAPES[shape]` (or, with `offload_overlap`,
    `OFFLOAD_OVERLAP_DEFAULTS`) for what `options` leaves out."""
    if shape is not None and shape not in SHAPES:
        raise ValueError(f"`shape` must be one of {', '.join(SHAPES)}, got {shape!r}")
    preset: dict[str, object] = dict(SHAPES[shape]) if shape is not None else {}
    if options.get("offload_overlap"):
        preset = {**OFFLOAD_OVERLAP_DEFAULTS, **preset}
    return BenchOptions(**{**preset, **options, "shape": shape})  # type: ignore[arg-type]


def _count(config: GPTConfig) -> int:
    with torch.device("meta"):  # shapes only: any size is counted instantly and allocates nothing
        return GPT(config).num_parameters()


def model_config(options: BenchOptions) -> GPTConfig:
    """The GPT shape to train: the options' own, or with `n_embd` fitted to `options.params`."""
    base = dict(vocab_size=256, block_size=options.block_size, n_layer=options.n_layer, n_head=options.n_head)
    if options.params is None:
        return GPTConfig(n_embd=options.n_embd, dropout=0.0, bias=True, **base)

    def shaped(heads_wide: int) -> GPTConfig:
        return GPTConfig(n_embd=heads_wide * options.n_head, dropout=0.0, bias=True, **base)

    # The count grows monotonically with the width: bisect on n_embd / n_head.
    low, high = 1, 1
    while _count(shaped(high)) < options.params:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if _count(shaped(middle)) < options.params:
            low = middle
        else:
            high = middle
    best = min((low, high), key=lambda k: abs(_count(shaped(k)) - options.params))
    return shaped(best)


def num_parameters(config: GPTConfig) -> int:
    """Ψ: distinct parameters of the model (the tied embedding counted once). Every block has the
    same shapes, so Ψ is affine in ``n_layer``: counted on one and two blocks, not on all of them
    (a capacity search asks for models of hundreds of blocks, each a second to build on meta)."""
    one, two = (_count(dataclasses.replace(config, n_layer=n)) for n in (1, 2))
    return one + (config.n_layer - 1) * (two - one)
