"""Counting the Python function calls of a block of code (a training step), for the benchmark and tests.

[Note: counting Python calls]
On a fast GPU a step is host time, and much of the host time of a sharded step is Python: hooks,
wrappers and per-parameter bookkeeping that neither the aten-op count nor the collectives see.
`count_python_calls()` counts every call of a Python function made while it is active — a 'call'
event of `sys.setprofile`, which fires on entry to any Python function, method, lambda or
comprehension (and on each resumption of a generator); calls of C functions (torch's operators,
builtins) are not counted — so a test can bound it ("zero3 makes at most 3x DDP's Python calls per
step") and the benchmark can report it per variant.

What it sees: the thread that enters it, plus Python threads started inside it (`threading.setprofile`).
On the CPU that is the whole step: autograd runs a CPU backward, hooks included, on the thread that
called `backward()`. On CUDA autograd runs the backward on a device thread of its own, which Python
3.11's profiling hooks cannot reach, so the count there leaves out the backward's hooks: compare
counts taken on the CPU. The profiler slows the code it watches several-fold, so never count a
step that is also timed.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from types import CodeType, FrameType
from typing import Any, Collection, Optional


class PythonCalls:
    """A context manager counting Python calls, and what it counted (see [Note: counting Python calls])."""

    def __init__(self, by: Optional[str] = None, outside: Collection[CodeType] = ()) -> None:
        self.total = 0
        """Python function calls made inside the block (set when it ends)."""
        self.by_code: Counter[CodeType] = Counter()
        """The same calls by function (code object); `by_function()` names them."""
        self._previous: tuple[Any, Any] = (None, None)
        self._by = by
        self._outside = frozenset(outside)

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            if self._by is not None and not _made_by(frame, self._by):
                return
            if self._outside and _within(frame, self._outside):
                return
            self.by_code[frame.f_code] += 1

    def __enter__(self) -> "PythonCalls":
        self.by_code.clear()
        self._previous = (sys.getprofile(), threading.getprofile())
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)  # from here on every Python call is counted
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.setprofile(self._previous[0])
        threading.setprofile(self._previous[1])
        # the one call counted after the block: this method's own
        self.by_code[PythonCalls.__exit__.__code__] -= 1
        self.by_code = Counter({code: n for code, n in self.by_code.items() if n > 0})
        self.total = sum(self.by_code.values())

    def by_function(self, top: Optional[int] = None) -> dict[str, int]:
        """Calls per function, most called first, as ``"file.qualname:line"`` (the `top` ones only, if given)."""
        named: Counter[str] = Counter()
        for code, count in self.by_code.items():
            named[_name(code)] += count
        return dict(named.most_common(top))


def _name(code: CodeType) -> str:
    module = code.co_filename.rsplit("/", 1)[-1].removesuffix(".py")
    return f"{module}.{getattr(code, 'co_qualname', code.co_name)}:{code.co_firstlineno}"


def count_python_calls(by: Optional[str] = None, outside: Collection[CodeType] = ()) -> PythonCalls:
    """``with count_python_calls() as calls: step()`` — then ``calls.total`` is the number of Python
    function calls the step made. Restores whatever profiler was installed before (one counter at a
    time: a nested one takes over until it ends, and the outer one misses those calls).

    ``by``, a folder: only the calls a piece of code makes itself (say, the engine's, without the
    model's and the optimizer's), those of functions defined in files under ``by`` and those such
    functions make directly (a ``torch.no_grad()`` in a loop of theirs counts). ``outside``: calls
    made within these functions (themselves included) are not counted (say, a per-parameter hook
    torch requires)."""
    return PythonCalls(by, outside)


def _made_by(frame: FrameType, folder: str) -> bool:
    """``frame``'s function, or the one that called it, is defined under ``folder``."""
    caller = frame.f_back
    return frame.f_code.co_filename.startswith(folder) or (caller is not None and caller.f_code.co_filename.startswith(folder))


def _within(frame: Optional[FrameType], codes: frozenset[CodeType]) -> bool:
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False
