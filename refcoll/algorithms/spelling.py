"""An algorithm with its options in one word: ``hierarchical(inter=ring,pipeline=8)``.

The form ``auto`` names its choice in (``REFCOLL_DEBUG``'s lines, ``refcoll model``'s
rows) and ``refcoll bench --algorithm`` reads: the registry name, then the options
as ``key=value`` pairs in parentheses. :func:`spell` writes it, :func:`unspell`
reads it back, :func:`check_spelled` refuses one its algorithm cannot run, and
:func:`split_spelled` cuts a comma list of them.
"""

from __future__ import annotations

import re

from ..core.errors import UsageError
from .registry import check_options, implementation

__all__ = ["spell", "unspell", "split_spelled", "check_spelled"]

_WORD = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$")
_INT = re.compile(r"^[+-]?\d+$")


def spell(name: str, options: dict | None = None) -> str:
    """Return ``name`` with ``options`` in one word: ``ring``, ``hierarchical(inter=tree)``."""
    if not options:
        return name
    return name + "(" + ",".join(f"{key}={value}" for key, value in options.items()) + ")"


#: The most digits an option's whole number may have (Python refuses past 4300).
_MOST_DIGITS = 30


def unspell(text: str) -> tuple[str, dict]:
    """Return the ``(name, options)`` of a word :func:`spell` wrote.

    Values that read as integers become ``int``; the others stay strings.

    Raises:
        UsageError: the text is not ``name`` or ``name(key=value,...)``.
    """
    found = _WORD.match(text)
    if not found:
        raise UsageError(f"cannot read algorithm {text!r}: write a name, or a name with its "
                         "options as hierarchical(inter=ring,pipeline=8)")
    name, inside = found.group(1), found.group(2)
    options: dict = {}
    for pair in (inside.split(",") if inside and inside.strip() else []):
        key, eq, value = (part.strip() for part in pair.partition("="))
        if not eq or not key.isidentifier() or not value or key in options:
            raise UsageError(f"cannot read the option {pair.strip()!r} of {text!r}: write "
                             "key=value, each key once, as hierarchical(inter=ring,pipeline=8)")
        if _INT.match(value) and len(value.lstrip("+-")) > _MOST_DIGITS:
            raise UsageError(f"the option {key}={value[:20]}... of {text[:40]!r}... has "
                             f"{len(value)} digits: no count of refcoll's takes more than "
                             f"{_MOST_DIGITS}")
        options[key] = int(value) if _INT.match(value) else value
    return name, options


def split_spelled(text: str) -> list[str]:
    """Return the words of a comma list, commas inside parentheses kept: ``a,b(x=1,y=2)``."""
    words, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            words.append(text[start:i])
            start = i + 1
    words.append(text[start:])
    return [word.strip() for word in words if word.strip()]


def check_spelled(text: str, collective: str) -> tuple[str, dict]:
    """Return the ``(name, options)`` of ``text``, refused unless its algorithm runs
    ``collective`` with those options (:class:`UsageError` naming what it takes)."""
    name, options = unspell(text)
    implementation(name, collective)
    check_options(name, collective, options)
    return name, options
