"""Building blocks for caches that several ranks may fill at the same time.

Whoever takes the lock first builds; the others block on it, then find the finished files. Files
appear under their final name only once complete (written to a temporary name, then renamed), so a
reader never sees half a file, even after a crash.
"""

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed); released on exit, or by the OS if the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def temporary_name(path: Path) -> Path:
    """A sibling of ``path`` for writing before ``os.replace``: same filesystem, so the rename is atomic; named
    by host and process, so that writers on nodes sharing the disk (where a lock may not reach) never meet."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that ``path`` holds either the old content or all of the new."""
    tmp = temporary_name(path)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
