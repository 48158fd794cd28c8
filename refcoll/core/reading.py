"""Reading a user's file: the one way refcoll opens what someone else wrote.

refcoll reads files other people made (rank files from a library under test, tuning
files, topologies, calibrations, manifests, logs), often as root. Every such read goes
through this module, which refuses, with one line naming the file, what a careful
system tool refuses:

* anything but a regular file: a folder, a FIFO (opened without blocking, so a pipe
  with no writer cannot hang the reader), a device such as ``/dev/zero``, a socket.
  A symbolic link is followed to what it names, and that must be a regular file;
* a file larger than the bound its kind allows (JSON: :data:`MAX_JSON_BYTES`); the
  bound is held while reading too, so a file that grows is cut off, not swallowed;
* text that is not UTF-8;
* JSON that does not parse, nests deeper than :data:`MAX_JSON_DEPTH`, holds ``NaN`` or
  ``Infinity``, a float that overflows to infinity, or an integer of
  :data:`MAX_JSON_DIGITS` digits or more.

Each refusal is a :class:`~refcoll.core.errors.UsageError`: the command line prints it
as one line and exits 2 ("cannot be judged"), never 1 ("not conforming"). The
checks of what a file's fields mean belong to the one reader of each kind of file;
:func:`number` is their shared check of a bounded, finite number.

Example:
    >>> from refcoll.core.reading import read_json
    >>> read_json("/dev/zero")  # doctest: +SKIP
    UsageError: /dev/zero: is a character device, not a regular file
"""

from __future__ import annotations

import json
import math
import os
import stat

from .errors import UsageError

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_JSON_DIGITS", "MAX_TEXT_BYTES",
           "open_regular", "read_bytes", "read_text", "read_json", "loads_json", "number"]

#: The largest JSON file refcoll reads (meta.json, tunings, topologies, caches, reports).
MAX_JSON_BYTES = 16 << 20

#: The largest text file refcoll reads whole (an ``all_reduce_perf`` or NCCL log).
MAX_TEXT_BYTES = 256 << 20

#: The deepest nesting of arrays and objects a JSON file may have.
MAX_JSON_DEPTH = 64

#: An integer in JSON with this many digits or more is refused (2**63 has 19).
MAX_JSON_DIGITS = 20

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")


def _os_reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "does not exist"
    return f"cannot be read ({exc.strerror or exc})"


def open_regular(path, *, max_bytes: int | None = None, what: str = "file"):
    """Open ``path`` for binary reading, refusing anything but a regular file.

    The file is opened with ``O_NONBLOCK`` (a FIFO with no writer returns at once
    instead of hanging) and then judged by ``fstat`` of what was opened, so a link
    swapped in between a check and the open changes nothing.

    Args:
        path: the file; a symbolic link is followed.
        max_bytes: refuse a file larger than this (None: any size).
        what: the kind of file, for the message (``"tuning file"``).

    Returns:
        A binary file object positioned at the start; the caller closes it.

    Raises:
        UsageError: the file is missing, unreadable, not regular, or too large.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"{path}: the {what} {_os_reason(exc)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{path}: is {_kind(info.st_mode)}, not a regular file; give the "
                             f"{what} as a file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise UsageError(f"{path}: the {what} holds {info.st_size} bytes, more than the "
                             f"{max_bytes} refcoll reads from one")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path, *, max_bytes: int, what: str = "file") -> bytes:
    """Return a regular file's bytes, at most ``max_bytes`` of them (else a UsageError)."""
    with open_regular(path, max_bytes=max_bytes, what=what) as fh:
        try:
            data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise UsageError(f"{path}: the {what} {_os_reason(exc)}") from None
    if len(data) > max_bytes:  # it grew after it was opened
        raise UsageError(f"{path}: the {what} holds more than the {max_bytes} bytes refcoll "
                         "reads from one")
    return data


def read_text(path, *, max_bytes: int = MAX_TEXT_BYTES, what: str = "file") -> str:
    """Return a regular file's text (UTF-8, a leading byte-order mark dropped)."""
    data = read_bytes(path, max_bytes=max_bytes, what=what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: the {what} is not UTF-8 text (byte {exc.start} is "
                         f"{data[exc.start]:#04x})") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number refcoll accepts (only finite numbers)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is beyond the range of a float")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) >= MAX_JSON_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits is beyond what "
                         f"refcoll accepts (at most {MAX_JSON_DIGITS - 1})")
    return int(text)


def _depth(value) -> int:
    """Return how deep ``value``'s arrays and objects nest (iteratively: no recursion, and
    one iterator per level held, so a file of millions of small arrays costs no more)."""
    if not isinstance(value, (list, dict)):
        return 0
    stack = [iter(value.values() if isinstance(value, dict) else value)]
    deepest = 1
    while stack:
        for item in stack[-1]:
            if isinstance(item, (list, dict)):
                stack.append(iter(item.values() if isinstance(item, dict) else item))
                deepest = max(deepest, len(stack))
                if deepest > MAX_JSON_DEPTH:
                    return deepest
                break
        else:
            stack.pop()
    return deepest


def loads_json(text: str | bytes, *, source: str):
    """Parse JSON with refcoll's bounds: finite numbers, bounded integers and depth.

    Args:
        text: the document.
        source: what it came from, for the message (a path, ``"REFCOLL_TUNING_FILE"``).

    Raises:
        UsageError: one line naming ``source`` and what is wrong.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise UsageError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                           parse_int=_bounded_int)
    except RecursionError:
        raise UsageError(f"{source}: nests deeper than the {MAX_JSON_DEPTH} levels refcoll "
                         "reads") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{source}: not valid JSON ({exc})") from None
    except ValueError as exc:  # from the number parsers
        raise UsageError(f"{source}: not valid JSON for refcoll ({exc})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise UsageError(f"{source}: nests deeper than the {MAX_JSON_DEPTH} levels refcoll reads")
    return value


def read_json(path, *, what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES):
    """Return the JSON value in a regular file, read and parsed within refcoll's bounds.

    Raises:
        UsageError: the file is not a regular file of at most ``max_bytes``, is empty,
            is not UTF-8, or is not JSON within :func:`loads_json`'s bounds.
    """
    data = read_bytes(path, max_bytes=max_bytes, what=what)
    if not data.strip():
        raise UsageError(f"{path}: the {what} is empty; it must hold JSON")
    return loads_json(data, source=str(path))


def number(value, *, where: str, least: float | None = None, most: float | None = None,
           integer: bool = False, above: float | None = None):
    """Return ``value`` if it is a finite number in range, else raise one line naming ``where``.

    Args:
        value: what a file held.
        where: the file and field, for the message (``"topo.json: uplinks[1]"``).
        least, most: inclusive bounds; ``above``: an exclusive lower bound.
        integer: it must be a whole number (a JSON integer).

    Raises:
        UsageError: a bool, a string, null, NaN, an infinity, a float where an integer is
            wanted, or a number out of range.
    """
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (
            isinstance(value, float) and not math.isfinite(value)):
        want = "a whole number" if integer else "a finite number"
        raise UsageError(f"{where}: must be {want}, not {value!r}")
    if above is not None and not value > above:
        raise UsageError(f"{where}: must be above {above:g}, not {value!r}")
    if least is not None and value < least:
        raise UsageError(f"{where}: must be at least {least:g}, not {value!r}")
    if most is not None and value > most:
        raise UsageError(f"{where}: must be at most {most:g}, not {value!r}")
    return value
