"""Writing a file: the one way refcoll puts bytes on disk, never through a link.

Every file refcoll writes (rank files, ``meta.json``, ``--json`` and ``--csv`` reports,
plots, golden vectors, tuning files, the calibration cache, cluster state) is written
to a fresh temporary name in its own folder and renamed over the target. So:

* a symbolic link at the target is replaced, never written through: as root, a planted
  ``rank0.npy -> /etc/passwd`` costs the link, not ``/etc/passwd``;
* a reader sees the old file or the new one, never half of one, and two writers at once
  leave one whole file;
* a failed write leaves the old file and no temporary behind;
* a target that is a device, a FIFO or a socket (``--json /dev/null``), or any file in
  ``/dev``, ``/proc`` or ``/sys``, is refused: renaming over it, as root, would replace
  the system's own file.

:func:`same_place` tells whether two paths are one folder by what they resolve to, and
:func:`remove_file` removes a file or a link (never what a link points to). Where two
jobs may update one file (the calibration cache), :func:`locked` serialises them.

Example:
    >>> from refcoll.core.writing import write_json
    >>> write_json("report.json", {"rows": []})  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
import time
from pathlib import Path

import numpy as np

from .errors import UsageError, shown

__all__ = ["check_target", "make_folder", "write_file", "write_bytes", "write_text", "write_json",
           "save_npy", "remove_file", "same_place", "locked", "private_folder"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_target(path) -> None:
    """Refuse a path refcoll must not replace: a folder, a device, FIFO or socket, a system file.

    Commands call it on their output paths before any work, so a long run never ends
    in a refusal it could have given at the start; :func:`write_file` calls it again.

    Raises:
        UsageError: ``path`` is a folder, a device, FIFO or socket, or in ``/dev``,
            ``/proc`` or ``/sys``.
    """
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise UsageError(f"{path}: is a folder; give a file name")
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise UsageError(f"{path}: is not a regular file (a device, FIFO or socket); give the "
                         "name of a file to write")
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    if folder.split(os.sep)[1:2] in (["dev"], ["proc"], ["sys"]):
        raise UsageError(f"{path}: is in {folder}, the system's own files; give the name of a "
                         "file to write elsewhere")


def make_folder(path) -> None:
    """Create folder ``path`` and its parents if missing, or say in one line why it cannot be.

    Raises:
        UsageError: ``path`` is a link to nothing, or the folder cannot be created.
    """
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise UsageError(f"{path}: is a symbolic link to {shown(os.readlink(path))}, which "
                         "does not exist; create that folder or give another")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{path}: the folder cannot be created ({exc.strerror or exc})") from None


@contextlib.contextmanager
def write_file(path, *, mode: int = 0o666):
    """Yield a binary file object whose contents replace ``path`` when the block ends.

    The file is a temporary in ``path``'s folder, renamed over ``path`` after the block
    (atomically, replacing a link there rather than following it); on an exception it
    is removed and ``path`` is left as it was.

    Args:
        path: the file to write.
        mode: its permission bits before the umask (0o666, as ``open`` gives; 0o600
            for a private file).

    Raises:
        UsageError: ``path`` is a folder, a device, FIFO or socket, or in ``/dev``,
            ``/proc`` or ``/sys``; or its folder is missing or not writable.
    """
    check_target(path)
    target = Path(path)
    folder = target.parent
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    except FileNotFoundError:
        raise UsageError(f"{path}: folder {folder} does not exist; create it first") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot be written in {folder} ({exc.strerror})") from None
    try:
        os.fchmod(fd, mode & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            yield fh
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes(path, data: bytes, *, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` (a temporary renamed over it, no link followed)."""
    with write_file(path, mode=mode) as fh:
        fh.write(data)


def write_text(path, text: str, *, mode: int = 0o666) -> None:
    """Replace ``path`` with UTF-8 ``text`` (a temporary renamed over it, no link followed)."""
    write_bytes(path, text.encode("utf-8"), mode=mode)


def write_json(path, value, *, indent: int | None = 2, mode: int = 0o666, **dumps) -> None:
    """Replace ``path`` with ``value`` as JSON and a final newline (no link followed)."""
    write_text(path, json.dumps(value, indent=indent, **dumps) + "\n", mode=mode)


def save_npy(path, array) -> None:
    """Replace ``path`` with ``array`` in NumPy's ``.npy`` format (no link followed)."""
    with write_file(path) as fh:
        np.save(fh, array, allow_pickle=False)


def remove_file(path) -> None:
    """Remove a file or a symbolic link (the link itself); a folder is refused.

    Raises:
        UsageError: ``path`` is a folder.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{path}: is a folder; refcoll removes only the files it wrote")
    os.unlink(path)


def same_place(a, b) -> bool:
    """Return whether paths ``a`` and ``b`` are one file or folder, by what they resolve to."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


#: Seconds :func:`locked` waits for another holder before it gives up.
LOCK_WAIT = 5.0


@contextlib.contextmanager
def locked(path, wait: float | None = None):
    """Hold an exclusive lock for updating ``path`` (on ``path.lock``, beside it).

    Two jobs that read, change and rewrite one file (the calibration cache) take it in
    turn, so neither loses the other's entry. A holder that keeps it longer than
    ``wait`` seconds (:data:`LOCK_WAIT`; a stopped job, anyone who can open the file) is
    not waited for: :class:`UsageError`, so the caller goes on without the update.
    """
    wait = LOCK_WAIT if wait is None else wait
    lock = f"{path}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                 0o600)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UsageError(f"{lock} has been locked by another process for more than "
                                     f"{wait:g} s") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def claimed(path, *, shared: bool):
    """Hold a lock on ``path.lock`` (beside it) for the block, if it can be had at once.

    Shared, as each of the jobs that use a thing holds it; exclusive, as the one that
    removes the thing does, so that none removes it from under a job. Yields whether
    it was had (it never waits). The lock goes with the block, or with the process.
    """
    lock = f"{path}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                 0o600)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            had = True
        except BlockingIOError:
            had = False
        yield had
    finally:
        os.close(fd)


def private_folder(prefix: str = "refcoll-") -> str:
    """Make a folder only this user can enter (mode 0700, an unpredictable name); return it."""
    return tempfile.mkdtemp(prefix=prefix)
