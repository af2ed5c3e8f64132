"""Agreeing through the process group's store rather than a collective: each rank posts a value
and the ranks decide together whether to go ahead (the agreement behind reads at rest, see
``parameters/reads_at_rest.py``). A rank that never posts leaves nothing half-done in any process
group, so the others can fail and go on; ``collectives`` gives the store."""

from __future__ import annotations

from datetime import timedelta
from typing import NamedTuple, Optional

from lightning_zero.engine.comm import collectives


class StoreAgreement(NamedTuple):
    """What ``post_and_agree`` found: each rank's post, and whether the ranks go ahead."""

    values: list[Optional[str]]
    """Each rank's value in ``group`` order; None for a rank that had not posted when this rank
    stopped waiting (only where ``go`` is False)."""
    go: bool
    """True on every rank alike, or False on every rank alike: every rank posted, and the first rank
    to decide saw them all (then each goes ahead together); False once any rank gave up waiting."""


def post_and_agree(prefix: str, value: str, group: collectives.ProcessGroup, timeout: timedelta) -> StoreAgreement:
    """Post ``value`` under ``prefix`` for this rank in the process group's store, wait up to
    ``timeout`` for every rank of ``group`` to post under the same ``prefix``, and decide with the
    other ranks whether to go ahead. Not a collective: a rank that never posts leaves nothing half-done
    in any process group, so the others can fail and go on.

    The decision is one key set once (``compare_set``: the first rank to decide wins): "go" by a rank
    that saw every post, "gave_up" by one that stopped waiting. A rank that gave up after another
    decided "go" goes ahead too (every post is there); a rank that saw every post after another
    gave up does not. So a rank never enters what follows (a collective) that another abandoned."""
    store = collectives.default_store()
    keys = [f"{prefix}/{r}" for r in collectives.group_ranks(group)]
    store.set(f"{prefix}/{collectives.rank()}", value)
    try:
        store.wait(keys, timeout)
        complete = True
    except RuntimeError:  # DistStoreError on timeout (a RuntimeError on a FileStore): decided below
        complete = False
    go = store.compare_set(f"{prefix}/decision", "", "go" if complete else "gave_up") == b"go"
    values = [store.get(key).decode() if (complete or go or store.check([key])) else None for key in keys]
    return StoreAgreement(values, go)


def forget_posts(keys: list[str]) -> None:
    """Delete ``keys`` from the store (those no rank reads any more)."""
    store = collectives.default_store()
    for key in keys:
        store.delete_key(key)
