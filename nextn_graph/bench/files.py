"""Writing a set of files so that readers see the old set or the new one.

Each file is written to a hidden temporary name beside its destination (same
directory, so same file system), and only once every temporary is complete is
each moved into place with ``os.replace``, with Ctrl-C held for those renames.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from ..errors import InputError


def creatable_dir(path: Path, label: str) -> None:
    """``path`` is a writable directory, or one that ``mkdir(parents=True)`` can make."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{label}: {path} is not a directory")
    existing = path.absolute()
    while not existing.exists():  # the nearest ancestor that exists decides
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{label}: cannot create {path}, {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{label}: {existing} is not writable")


@contextmanager
def _sigint_deferred():
    """Hold Ctrl-C while the staged files are moved into place (a handful of renames),
    so an interrupt cannot land between two of them; it is raised right after."""
    old = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or old is None:
        yield  # only the main thread may set handlers; None: one set outside Python
        return
    caught = []
    signal.signal(signal.SIGINT, lambda *sig: caught.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if caught and callable(old):
        old(*caught[0])  # the default handler raises KeyboardInterrupt
    elif caught and old == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)


def _write_temp(dest: Path, data: bytes) -> Path:
    """``data`` in a new hidden file beside ``dest`` (same file system, so ``os.replace``
    is a rename); returns its path. Created like a plain ``open(dest, "w")``: mode 0o666
    less the umask."""
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())  # on disk before the rename publishes it
    except BaseException:
        tmp.unlink()
        raise
    return tmp


def commit_files(files: dict[Path, bytes]) -> None:
    """Write ``files`` as one set. Each lands by ``os.replace`` (atomic per file: a
    reader sees the old or the new file, never a partial one), and the renames start
    only once every temporary file is fully written; Ctrl-C is held during them. A
    failure or Ctrl-C before that removes the temporaries and leaves every old file
    untouched. Not covered: a crash, SIGKILL or failing rename in the middle of the
    renames can leave some files new and the rest old."""
    staged: dict[Path, Path] = {}
    dest = None
    try:
        for dest, data in files.items():
            dest.parent.mkdir(parents=True, exist_ok=True)
            staged[dest] = _write_temp(dest, data)
        with _sigint_deferred():
            for dest in files:
                os.replace(staged[dest], dest)
                del staged[dest]
    except OSError as exc:  # named by its destination, not by a temporary name
        raise InputError(f"cannot write {dest}: {exc.strerror or exc}") from None
    finally:
        for tmp in staged.values():  # only what was not moved into place
            tmp.unlink(missing_ok=True)
