"""What NCCL chose at each size of ``refcoll bench --against nccl``, read from its own log.

NCCL prints, with ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING``, one line per
collective call on rank 0 (``AllReduce: 4194304 Bytes -> Algo RING proto SIMPLE
channel{Lo..Hi}={0..31}``). :meth:`NcclLog.start` sets those variables (and
``NCCL_ALGO``/``NCCL_PROTO`` when the configuration forces them) in this process's
environment before NCCL initialises, with ``NCCL_DEBUG_FILE`` a file of this
process's own; after each size :meth:`NcclLog.choice` reads the lines written
since and returns NCCL's last choice at that size
(:func:`refcoll.baselines.nccl_log.choice_for`). The parsing itself is
:mod:`refcoll.baselines.nccl_log`'s.

The file lies in a folder of this process's own, made for it
(:func:`refcoll.core.writing.private_folder`: mode 0700, a name no one can guess)
and removed by :meth:`NcclLog.close`, never in the shared ``/tmp`` under a name
another user could predict and fill with lines of their own. It is read back
through :mod:`refcoll.core.reading` (a regular file; at most
:data:`~refcoll.core.reading.MAX_TEXT_BYTES` a read).
"""

from __future__ import annotations

import contextlib
import os
from typing import Mapping, MutableMapping

from ..baselines import nccl_log
from ..core.errors import UsageError
from ..core.reading import MAX_TEXT_BYTES, open_regular
from ..core.writing import private_folder, remove_file
from .config import BenchConfig

__all__ = ["NcclLog", "nccl_settings"]


def nccl_settings(config: BenchConfig, environ: Mapping[str, str] = os.environ) -> dict:
    """Return NCCL's algorithm and protocol in force: the configuration's, else the environment's.

    ``{"algo": ..., "proto": ...}``, None where NCCL chooses. The values are
    checked (:func:`refcoll.baselines.nccl_log.nccl_env`), so a bad
    ``NCCL_ALGO`` already in the environment is refused too.
    """
    algo = config.nccl_algo or environ.get("NCCL_ALGO") or None
    proto = config.nccl_proto or environ.get("NCCL_PROTO") or None
    nccl_log.nccl_env(algo, proto)
    return {"algo": algo, "proto": proto}


class NcclLog:
    """This process's NCCL debug file, read from where the last read stopped.

    Args:
        pattern: ``NCCL_DEBUG_FILE``'s value (NCCL expands ``%h`` and ``%p``).
        folder: the private folder :meth:`start` made for it, which :meth:`close`
            removes (None: the caller's folder, left in place).
    """

    def __init__(self, pattern: str, environ: MutableMapping[str, str] | None = None,
                 saved: dict | None = None, folder: str | None = None) -> None:
        self.pattern = pattern
        self._offsets: dict[str, int] = {}
        self._environ = environ
        self._saved = saved or {}  # what start() replaced, put back by close()
        self._folder = folder  # made by start(), removed by close()

    @classmethod
    def start(cls, config: BenchConfig, environ: MutableMapping[str, str] = os.environ,
              folder: str | None = None) -> "NcclLog":
        """Set NCCL's debug and tuning variables in ``environ``; return the log to read.

        Call it before NCCL initialises in this process (it reads them once). The
        file is named after this process (its pid), so no rank reads another's, in
        ``folder`` or, by default, a private folder made for it (mode 0700, an
        unpredictable name) that :meth:`close` removes. :meth:`close` puts the
        variables back as they were.
        """
        settings = nccl_settings(config, environ)
        env = nccl_log.nccl_env(settings["algo"], settings["proto"])
        made = private_folder("refcoll-nccl-") if folder is None else None
        pattern = os.path.join(folder or made, f"refcoll-nccl-{os.getpid()}.%h.%p")
        env.update(nccl_log.debug_env(pattern, environ))
        saved = {name: environ.get(name) for name in env}
        environ.update(env)
        return cls(pattern, environ, saved, made)

    def new_lines(self) -> list[str]:
        """Return the lines NCCL appended since the last call."""
        lines: list[str] = []
        for path in nccl_log.tuning_files(self.pattern):
            with open_regular(path, what="NCCL debug log") as fh:  # a regular file, no FIFO
                fh.seek(self._offsets.get(path, 0))
                data = fh.read(MAX_TEXT_BYTES)  # bounded: the rest waits for the next call
                self._offsets[path] = fh.tell()
            lines += data.decode("utf-8", errors="replace").splitlines(keepends=True)
        return lines

    def choice(self, collective: str, nbytes: int):
        """Return NCCL's last choice for ``collective`` at ``nbytes`` since the last read (or None).

        ``nbytes`` is the bytes of the call as NCCL logs them (the buffer of an
        all-reduce); sizes NCCL logs otherwise (per-rank counts) fall back to
        the last line of the collective.
        """
        tunings = [t for t in nccl_log.parse_tuning(self.new_lines())
                   if t.collective in (None, nccl_log.COLLECTIVE_OF.get(collective, collective))]
        found = nccl_log.choice_for(tunings, collective, nbytes)
        return found if found is not None else (tunings[-1] if tunings else None)

    def close(self) -> None:
        """Remove this process's log files (and the folder :meth:`start` made); put NCCL's
        variables back as they were."""
        for path in nccl_log.tuning_files(self.pattern):
            with contextlib.suppress(OSError, UsageError):
                remove_file(path)  # a link is removed, never what it names
        if self._folder is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._folder)
            self._folder = None
        for name, value in self._saved.items():
            if value is None:
                self._environ.pop(name, None)
            else:
                self._environ[name] = value
        self._saved = {}
