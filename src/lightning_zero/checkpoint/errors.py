"""What a failed checkpoint read or write raises: the checkpoint, the file and the cause, on the first
line of the message.

The messages travel between ranks (pickled), so every rank can raise the same one; each class takes
its whole message as its only argument, which pickles as is.
"""

from __future__ import annotations

import os
import pickle
from typing import Optional


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files are missing, truncated, fail their checksums or cannot be parsed."""


class UntrustedCheckpointError(pickle.UnpicklingError):
    """A checkpoint whose pickle names a global that a weights-only load does not allow: unpickling it
    could run code, so it was refused before that global was called (see ``pickles.py``). A
    ``pickle.UnpicklingError``, as torch's own weights-only refusal is."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, a permission, a lost rank's files)."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)  # one argument: OSError then keeps it as the message, no errno
        self.detail = detail or message
        """The cause and the file, without the checkpoint's path (kept when pickled: it is in __dict__)."""


class CheckpointReadError(OSError):
    """A checkpoint at a URL whose storage refused or failed the first request of a read (credentials
    missing or refused, the endpoint unreachable): the URL and the cause on one line, as a save's
    ``CheckpointWriteError`` names them, instead of the filesystem's own trace (botocore's runs to
    70 lines a rank)."""


class ShardFileError(Exception):
    """An error raised while torch.distributed.checkpoint had one file open, tagged with that file.

    DCP reports a rank's failure without naming the file it was reading or writing; ``sharded.py``
    opens every file through a wrapper that turns any error into this one.
    """

    def __init__(self, name: str, cause: str) -> None:
        super().__init__(name, cause)
        self.name, self.cause = name, cause

    def __str__(self) -> str:
        return f"{self.name}: {self.cause}"


def describe(err: BaseException, with_filename: bool = True) -> str:
    """A one-line cause: the OS's own words for I/O errors ("No space left on device"), else the
    exception's type and the first line of its message."""
    if isinstance(err, ShardFileError):
        return str(err)
    if isinstance(err, OSError) and err.errno is not None:
        where = f" ({err.filename})" if err.filename and with_filename else ""
        return f"{err.strerror or os.strerror(err.errno)}{where}"
    text = str(err).strip().splitlines()
    first: Optional[str] = text[0] if text else None
    return type(err).__name__ + (f": {first[:300]}" if first else "")
