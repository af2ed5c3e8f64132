"""Many test cases in one group of rank processes, each case its own function.

Starting ranks and importing torch and Lightning costs seconds, so a test module registers its
multi-rank cases in one ``CaseGroup`` and a module-scoped fixture runs them all in one group; the
tests then assert on each case's per-rank results in the parent::

    GROUP = CaseGroup(world_size=2)

    @GROUP.case
    def tied_parity(ctx: RankContext) -> dict:       # runs on every rank
        ...

    @pytest.fixture(scope="module")
    def results(tmp_path_factory) -> GroupResults:
        return GROUP.run(tmp_path_factory.mktemp("stage3"))

    def test_tied(results):
        for r in results["tied_parity"]:             # one entry per rank
            assert ...

Adding a case is adding a function. A case that raises fails only the tests that read it, with the
rank's traceback. After a failure the ranks stop running cases (a collective may be left half-done,
so what follows would hang): the ranks agree on each case's outcome through a file store before
starting the next one, and the cases never started say which one stopped them. A group of one rank
has no peer to hang on, so it runs every case whatever failed before it (the GPU tier reports all
of its cases from one run).

To see where a group's time goes, set ``CASE_TIMES_FILE=path``: rank 0 appends one line per case,
``seconds<TAB>case<TAB>the module of the case's function``.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

from multiprocess import DEFAULT_TIMEOUT_S, run_on_ranks

Case = Callable[["RankContext"], Any]


@dataclass(frozen=True)
class RankContext:
    """What a case knows about where it runs."""

    rank: int
    world_size: int
    tmpdir: str
    """A directory every rank of the group sees (the fixture's temporary directory)."""
    kept: dict[Any, Any] = field(default_factory=dict)
    """What a case leaves for later cases on this rank (cases run in registration order), e.g. a
    fitted module that the next case evaluates, so it is not fitted twice."""

    def once(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` the first time ``key`` is asked for on this rank, what it returned afterwards
        (e.g. a DDP reference that several cases compare against, fitted once)."""
        if key not in self.kept:
            self.kept[key] = make()
        return self.kept[key]


def error_of(action: Callable[[], Any]) -> str:
    """What a case returns for an action that should fail: the error's type and message, for the
    test to read (a rank's exception is not picklable in general), or "no error"."""
    try:
        action()
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        return f"{type(err).__name__}: {err}"
    return "no error"


class CaseFailed(AssertionError):
    """Reading the result of a case that raised (or never ran) on some rank."""


class GroupResults:
    """Each case's results, one per rank, by case name."""

    def __init__(self, per_rank: list[dict[str, tuple[str, Any]]]) -> None:
        self._per_rank = per_rank

    def __getitem__(self, name: str) -> list[Any]:
        outcomes = [rank_results.get(name, ("missing", f"case {name!r} is not registered")) for rank_results in self._per_rank]
        for rank, (status, value) in enumerate(outcomes):
            if status != "ok":
                raise CaseFailed(f"case {name!r} {status} on rank {rank}:\n{value}")
        return [value for _, value in outcomes]


class CaseGroup:
    """Cases that run, in registration order, in one group of ``world_size`` rank processes.

    ``init_process_group=True`` gives the cases a gloo process group (for engine-level cases);
    cases that build a Lightning ``Trainer`` leave it False, and each Trainer joins the ranks.
    ``start_method``: how ``run_on_ranks`` starts the ranks ("spawn" for the GPU tier).
    """

    def __init__(
        self, world_size: int = 2, init_process_group: bool = False, timeout: float = DEFAULT_TIMEOUT_S, start_method: str = "forkserver"
    ) -> None:
        self.world_size = world_size
        self.init_process_group = init_process_group
        self.timeout = timeout
        self.start_method = start_method
        self.cases: dict[str, Case] = {}

    def case(self, fn: Optional[Case] = None, *, name: Optional[str] = None, **kwargs: Any) -> Any:
        """Register ``fn`` (as ``@group.case`` or ``@group.case(name=..., key=value)``); keyword
        arguments are bound to it, so one function can be registered under several names."""

        def register(fn: Case) -> Case:
            key = name or fn.__name__
            if key in self.cases:
                raise ValueError(f"a case named {key!r} is registered twice")
            self.cases[key] = functools.partial(fn, **kwargs) if kwargs else fn
            return fn

        return register(fn) if fn is not None else register

    def run(self, tmpdir: Any) -> GroupResults:
        """Run every registered case on every rank; ``tmpdir`` is shared by the ranks."""
        with tempfile.TemporaryDirectory(prefix="case_outcomes_") as outcomes_dir:
            per_rank = run_on_ranks(
                _run_cases,
                list(self.cases.items()),
                str(tmpdir),
                os.path.join(outcomes_dir, "store"),
                world_size=self.world_size,
                init_process_group=self.init_process_group,
                timeout=self.timeout,
                start_method=self.start_method,
            )
        return GroupResults(per_rank)


def _run_cases(
    rank: int, world_size: int, cases: list[tuple[str, Case]], tmpdir: str, outcomes_file: str
) -> dict[str, tuple[str, Any]]:
    import torch.distributed as dist

    store = dist.FileStore(outcomes_file, world_size)
    store.set_timeout(timedelta(seconds=DEFAULT_TIMEOUT_S))
    context = RankContext(rank, world_size, tmpdir)
    outcomes: dict[str, tuple[str, Any]] = {}
    stopped_by: Optional[str] = None
    for name, case in cases:
        if stopped_by is not None:
            outcomes[name] = ("was not run", f"case {stopped_by!r} failed before it")
            continue
        started = time.perf_counter()
        try:
            outcomes[name] = ("ok", case(context))
        except Exception:  # noqa: BLE001 - reported to the test that reads this case
            outcomes[name] = ("failed", traceback.format_exc())
        _record_case_time(rank, name, case, time.perf_counter() - started)
        # every rank learns whether any rank failed this case before anyone starts the next one
        store.set(f"{name}/{rank}", outcomes[name][0])
        keys = [f"{name}/{r}" for r in range(world_size)]
        store.wait(keys)
        if world_size > 1 and any(store.get(key) != b"ok" for key in keys):
            stopped_by = name
    return outcomes


def _record_case_time(rank: int, name: str, case: Case, seconds: float) -> None:
    times_file = os.environ.get("CASE_TIMES_FILE")
    if times_file and rank == 0:
        module = getattr(getattr(case, "func", case), "__module__", "?")
        with open(times_file, "a") as out:
            out.write(f"{seconds:.2f}\t{name}\t{module}\n")
