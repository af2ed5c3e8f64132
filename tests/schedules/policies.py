"""Which of a replay's runnable actions runs next (see ``explorer.py``): seeded random, and the
adversarial orders (the host as far ahead of its device as it can get, the device eager, the most
recently ready stream first, one kind of stream starved)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from schedules.explorer import Replay

Action = tuple[str, object]


@dataclass
class Policy:
    """Which of the runnable actions runs next."""

    name: str
    choose_from: Callable[[list[Action], "Replay", random.Random], Action]
    seed: int = 0

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def choose(self, actions: list[Action], replay: "Replay") -> Action:
        return self.choose_from(sorted(actions, key=repr), replay, self._random)


def _is_host(action: Action) -> bool:
    return action[0] == "queue" and action[1][1] == "thread"


def _any(actions: list[Action], replay: "Replay", rng: random.Random) -> Action:
    return rng.choice(actions)


def _host_first(actions: list[Action], replay: "Replay", rng: random.Random) -> Action:
    host = [a for a in actions if _is_host(a)]
    return rng.choice(host or actions)


def _device_first(actions: list[Action], replay: "Replay", rng: random.Random) -> Action:
    device = [a for a in actions if not _is_host(a)]
    return rng.choice(device or actions)


def _stream_role(action: Action, replay: Replay) -> str:
    if action[0] == "collective":
        return "collective"
    rank, kind, number = action[1]
    return replay.traces[rank].streams.get(number, "") if kind == "stream" else "host"


def random_order(seed: int) -> Policy:
    """Any runnable action, uniformly."""
    return Policy(f"random order (seed {seed})", _any, seed)


def host_ahead(seed: int) -> Policy:
    """The longest lag: the host threads run whenever they can; the device only when they wait."""
    return Policy(f"host as far ahead as it can get (seed {seed})", _host_first, seed)


def device_eager(seed: int) -> Policy:
    """No lag: the device runs whatever it can before the host goes on."""
    return Policy(f"device runs all it can first (seed {seed})", _device_first, seed)


def newest_first(seed: int) -> Policy:
    """Reversed ready order: the queue that was runnable the least time goes first (the last in the
    sorted list of what is runnable, ties broken by the seed)."""

    def choose(actions: list[Action], replay: "Replay", rng: random.Random) -> Action:
        device = [a for a in actions if not _is_host(a)]
        pool = device or actions
        return pool[-1] if rng.random() < 0.8 else rng.choice(pool)

    return Policy(f"reversed ready order (seed {seed})", choose, seed)


def starving(role: str, seed: int) -> Policy:
    """The streams named ``role`` (e.g. "reduce": a slow network) run only when nothing else can."""

    def choose(actions: list[Action], replay: "Replay", rng: random.Random) -> Action:
        others = [a for a in actions if _stream_role(a, replay) != role]
        return rng.choice(others or actions)

    return Policy(f"{role} stream starved (seed {seed})", choose, seed)


def adversaries(seeds: Sequence[int]) -> list[Policy]:
    """The policies a scenario is replayed under: for each seed, a random order, the host far ahead,
    the device eager, the reversed ready order, and the reduce and copy streams starved."""
    policies = []
    for seed in seeds:
        policies += [random_order(seed), host_ahead(seed), device_eager(seed), newest_first(seed)]
        policies += [starving("reduce", seed), starving("to host", seed), starving("to device", seed)]
    return policies
