"""Exceptions refcoll raises: each names what was wrong, where, and what to do."""

from __future__ import annotations

__all__ = [
    "RefcollError",
    "UsageError",
    "MismatchError",
    "CollectiveTimeout",
    "DeadlockError",
    "PeerFailure",
    "WrongResult",
    "shown",
    "reason",
]


class RefcollError(RuntimeError):
    """Base class of refcoll's own errors."""


class UsageError(RefcollError, ValueError):
    """An argument that no rank could run with (unknown algorithm, op, dtype...)."""


class MismatchError(RefcollError, ValueError):
    """Ranks passed different arguments to the same collective call."""


class CollectiveTimeout(RefcollError, TimeoutError):
    """A blocking wait passed its deadline."""


class DeadlockError(RefcollError):
    """The simulator found every live rank waiting on another: a wait-for cycle."""


class PeerFailure(RefcollError):
    """Another rank failed, so this rank's collective cannot complete."""


class WrongResult(RefcollError):
    """A watched library's collective returned what no conforming implementation can give."""


def shown(value, limit: int = 60) -> str:
    """Return ``value``'s repr cut to ``limit`` characters, so a message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def reason(exc: BaseException) -> str:
    """Return an exception's message on one line, cut short (for "cannot be read (...)")."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 120 else f"{text[:117]}..."
