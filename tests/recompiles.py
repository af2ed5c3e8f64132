"""Counting ``torch.compile`` recompilations: torch reports them only through its "recompiles" log
(``torch._dynamo.utils.counters`` has no such entry), so the counter listens to that log."""

from __future__ import annotations

import logging

import torch

RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"


class RecompileCounter(logging.Handler):
    """``with RecompileCounter() as counter:`` ... ``counter.count``: the recompilations inside."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.count = 0
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Recompiling function"):
            self.count += 1
            self.reasons.append(message.splitlines()[0])

    def __enter__(self) -> "RecompileCounter":
        torch._logging.set_logs(recompiles=True)
        logging.getLogger(RECOMPILES_LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(RECOMPILES_LOGGER).removeHandler(self)
        torch._logging.set_logs()
