"""The one rule for sizes, bandwidths and durations, and their human-readable forms.

Every option that takes a size, a bandwidth or a time reads it here, so that
``64K`` means the same bytes to ``refcoll bench`` and ``refcoll model``.

* **Sizes** (:func:`parse_size`): a bare number is bytes; a letter alone
  (``K M G T``, any case) and ``KiB MiB GiB TiB`` are powers of 1024, as
  nccl-tests reads ``-b 8 -e 128M``; ``kB``/``KB``, ``MB``, ``GB``, ``TB`` are
  powers of 1000.
* **Bandwidths** (:func:`parse_bandwidth`): ``B`` is bytes, ``b``/``bit`` bits;
  ``k M G T`` are powers of 1000 (as links are quoted) and ``Ki Mi Gi Ti`` of
  1024; a unit is required.
* **Durations** (:func:`parse_duration`): ``ns us µs ms s``; a bare number is
  seconds, unless the caller requires a unit.

Every parser refuses what it cannot read, what is not finite and what is
negative with a :class:`~refcoll.core.errors.UsageError` that names the option
(``name``) and gives an example to write instead.
"""

from __future__ import annotations

import math
import re

from .errors import UsageError

__all__ = [
    "SIZE_RULE",
    "BANDWIDTH_UNITS",
    "parse_count",
    "parse_size",
    "parse_sizes",
    "parse_bandwidth",
    "parse_duration",
    "format_size",
    "human_bytes",
    "human_time",
    "counted",
    "MIN_BANDWIDTH",
    "MAX_BANDWIDTH",
    "MAX_DURATION",
]

# A number, or the words float() reads as non-finite, so they are refused by name.
_NUMBER = (r"\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
           r"|[-+]?(?i:nan|inf(?:inity)?))\s*")

#: Bandwidth prefixes: letters are decimal, ``i`` makes them binary.
_BANDWIDTH_SCALE = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
                    "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}

#: Size prefixes, by the power of the base they stand for.
_SIZE_LETTERS = "KMGT"

#: How :func:`parse_size` reads a size, in words, for every command's --help.
SIZE_RULE = ("bytes; K, M, G, T (any case) and KiB, MiB, GiB, TiB are powers of 1024, as "
             "nccl-tests reads -e 128M; kB, MB, GB, TB are powers of 1000")

#: The bandwidth units :func:`parse_bandwidth` reads, for messages and help.
BANDWIDTH_UNITS = "B/s, kB/s, MB/s, GB/s, TB/s, KiB/s, MiB/s, GiB/s, Gb/s (= Gbit/s = Gbps), Mb/s"

_DECIMAL_BYTES = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_BINARY_BYTES = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _finite(text, value: float, name: str, example: str) -> float:
    """Return ``value`` if finite and not negative; else a UsageError naming ``name``."""
    if not math.isfinite(value):
        raise UsageError(f"{name} {text!r}: not a finite number; give e.g. {example}")
    if value < 0:
        raise UsageError(f"{name} {text!r}: must not be negative; give e.g. {example}")
    return value


# ------------------------------------------------------------------------------ counts

def parse_count(text, *, name: str = "count", minimum: int | None = 1,
                maximum: int | None = None, example: str = "4") -> int:
    """Return a whole number from ``4``, ``1300000000`` or ``1.3e9``.

    Refused with a :class:`UsageError` that names ``name`` (an option, ``--nodes``):
    what is not a number, not finite, not whole, below ``minimum`` (None: no
    bound) or above ``maximum``.
    """
    raw = str(text).strip()
    try:
        value = int(raw)  # exact for long integers
    except ValueError:
        m = re.fullmatch(_NUMBER, raw)
        if not m:
            raise UsageError(f"{name} {text!r}: not a number; give a whole number, e.g. "
                             f"{example}") from None
        number = float(m.group(1))
        if not math.isfinite(number):
            raise UsageError(f"{name} {text!r}: not a finite number; give a whole number, e.g. "
                             f"{example}") from None
        if not number.is_integer():
            raise UsageError(f"{name} {text!r}: not a whole number; give e.g. {example}") \
                from None
        value = int(number)
    if minimum is not None and value < minimum:
        raise UsageError(f"{name} {text}: must be at least {minimum}; give e.g. {example}")
    if maximum is not None and value > maximum:
        raise UsageError(f"{name} {text}: must be at most {maximum:,}; give e.g. {example}")
    return value


# ------------------------------------------------------------------------------- sizes

def parse_size(text, *, name: str = "size", whole: bool = False,
               letters: str = _SIZE_LETTERS, decimal: bool = True) -> int:
    """Return bytes from ``64K``, ``64KiB``, ``25MB``, ``1G``, ``4096``.

    A bare number is bytes; a letter alone (``K M G T``, any case) and ``KiB
    MiB GiB TiB`` are powers of 1024 (message sizes, as nccl-tests reads
    them); ``kB MB GB TB`` are powers of 1000. The size must be finite and not
    negative; a fraction of a byte is rounded to the nearest.

    Args:
        text: what the user wrote.
        name: what messages call it (an option, ``--bucket-size``); a refusal
            reads ``bad {name} '{text}': ...``.
        whole: refuse a number that is not whole (``1.5K``), as nccl-tests does.
        letters: the prefixes accepted, a subset of ``KMGT`` (``"KMG"``: no ``T``).
        decimal: accept the decimal forms (``kB``, ``MB``...); False: the binary
            ones only.

    Raises:
        UsageError: anything else, naming ``name`` and giving an example.
    """
    allowed = "".join(letters).upper()
    example = "64K, 64KiB, 25MB or 4096" if decimal else "64K, 16M or 4096 (binary: 64K = 65536)"
    bad = f"bad {name}"
    m = re.fullmatch(_NUMBER + r"(?:([A-Za-z])(iB|B)?)?\s*", str(text))
    letter = (m.group(2) or "").upper() if m else ""
    suffix = m.group(3) if m else None
    if not m or letter not in allowed or suffix == "B" and not decimal:
        raise UsageError(f"{bad} {text!r}: cannot read a size; write e.g. {example}")
    digits = m.group(1)
    value = _finite(text, float(digits), bad, example)
    if whole and not value.is_integer():
        raise UsageError(f"{bad} {text!r}: not a whole number of bytes; give one, e.g. "
                         f"{example}")
    base = 1000 if suffix == "B" else 1024
    power = _SIZE_LETTERS.index(letter) + 1 if letter else 0
    if re.fullmatch(r"\s*\+?[0-9]+\s*", digits):
        return int(digits) * base ** power  # exact, however large
    return int(round(value * base ** power))


def format_size(nbytes: int) -> str:
    """Return ``nbytes`` as :func:`parse_size` reads it back: ``1G``, ``64K``, ``100 B``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes} B"


def parse_sizes(text: str, *, name: str = "sizes", largest: int | None = None) -> list[int]:
    """Return byte sizes from ``64K,1M,16M`` or a doubling range ``64K..64M``.

    Every size must be positive, and at most ``largest`` bytes if given;
    ``name`` (an option, ``--sizes``) is what messages call them.
    """
    sizes: list[int] = []
    for item in str(text).split(","):
        if not item.strip():
            continue
        if ".." in item:
            low, high = (parse_size(v, name=name) for v in item.split("..", 1))
            if low < 1 or high < low:
                raise UsageError(f"{name} {item!r}: a range must run from a positive size "
                                 f"upwards, e.g. 64K..64M")
            if largest is not None and high > largest:
                raise UsageError(f"{name} {item!r}: give sizes up to {format_size(largest)} "
                                 f"(the largest buffer it measures)")
            while low <= high:
                sizes.append(low)
                low *= 2
        else:
            sizes.append(parse_size(item, name=name))
    if not sizes or any(s < 1 for s in sizes):
        raise UsageError(f"{name} {text!r}: give positive sizes, e.g. 64K..64M or 64K,1M,16M")
    if largest is not None and max(sizes) > largest:
        raise UsageError(f"{name} {text!r}: give sizes up to {format_size(largest)} (the "
                         f"largest buffer it measures)")
    return sizes


# -------------------------------------------------------------------- bandwidths, times

#: The rates and times any command takes: beyond them a product of sizes and times
#: overflows a float (1e-300 B/s gave times of inf that tied with finite ones).
MIN_BANDWIDTH, MAX_BANDWIDTH, MAX_DURATION = 1.0, 1e18, 1e7


def parse_bandwidth(text: str, *, name: str = "bandwidth", zero: bool = False) -> float:
    """Return bytes per second from ``300GB/s``, ``200Gb/s``, ``200Gbit/s``, ``1e9B/s``.

    ``B`` is bytes and ``b`` or ``bit`` bits; ``k M G T`` are powers of 1000 and
    ``Ki Mi Gi Ti`` of 1024. A number without a unit is refused (``600`` is
    more likely 600 GB/s than 600 B/s), but ``0`` where ``zero`` allows it (a
    free reduction). Otherwise the bandwidth must be positive and finite, from
    :data:`MIN_BANDWIDTH` (1 B/s) to :data:`MAX_BANDWIDTH` (1 EB/s).
    ``name`` (an option, ``--intra-bw``) is what messages call it.
    """
    example = "300GB/s or 200Gb/s"
    m = re.fullmatch(_NUMBER + r"(?:([kKMGT]i?)?(B|bit|b)(?:/s|ps))?\s*", str(text))
    if not m:
        raise UsageError(f"{name} {text!r}: cannot read a bandwidth; write a number and a unit, "
                         f"e.g. {example} (units: {BANDWIDTH_UNITS})")
    value = _finite(text, float(m.group(1)), name, example)
    if value == 0 and not zero:
        raise UsageError(f"{name} {text!r}: a bandwidth must be positive; give e.g. {example}")
    if not m.group(3):
        if value == 0:
            return 0.0
        raise UsageError(f"{name} {text!r}: a bandwidth needs a unit: add one, e.g. "
                         f"{text.strip()}GB/s (units: {BANDWIDTH_UNITS})")
    value *= _BANDWIDTH_SCALE[m.group(2) or ""]
    value = value / 8 if m.group(3) != "B" else value
    if value and not MIN_BANDWIDTH <= value <= MAX_BANDWIDTH:
        raise UsageError(f"{name} {text!r}: give 1 B/s to 1 EB/s (a rate outside them makes "
                         f"times no number can hold); e.g. {example}")
    return value


_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}


def parse_duration(text: str, *, name: str = "duration", unit: bool = False) -> float:
    """Return seconds from ``2us``, ``2µs``, ``500ns``, ``50ms``, ``1s`` or ``0.05`` (seconds).

    With ``unit`` a number needs its unit (a latency of ``5`` is more likely
    5 µs than 5 s), but for ``0``. The time must be finite, not negative and at
    most :data:`MAX_DURATION`.
    ``name`` (an option, ``--inter-latency``) is what messages call it.
    """
    example = "5us, 500ns or 0" if unit else "50ms, 0.1s or 0.05 (seconds)"
    m = re.fullmatch(_NUMBER + r"(ns|us|µs|ms|s)?\s*", str(text))
    if not m:
        raise UsageError(f"{name} {text!r}: cannot read a time; write e.g. {example} "
                         f"(units: ns, us, µs, ms, s)")
    value = _finite(text, float(m.group(1)), name, example)
    if unit and m.group(2) is None and value != 0:
        raise UsageError(f"{name} {text!r}: a time needs a unit: add one, e.g. "
                         f"{text.strip()}us (units: ns, us, µs, ms, s)")
    value *= _SECONDS[m.group(2)]
    if value > MAX_DURATION:
        raise UsageError(f"{name} {text!r}: at most {MAX_DURATION:g} s (four months); "
                         f"give e.g. {example}")
    return value


# --------------------------------------------------------------------------- humanisers

def human_bytes(nbytes: float, digits: str = ".3g", *, binary: bool = False) -> str:
    """Return ``nbytes`` in the largest unit it reaches, its number formatted with ``digits``.

    Decimal units (TB, GB, MB, kB) by default, with three significant digits;
    ``binary`` gives TiB, GiB, MiB, KiB. Below the smallest unit: whole bytes.
    """
    for unit, scale in _BINARY_BYTES if binary else _DECIMAL_BYTES:
        if nbytes >= scale:
            return f"{nbytes / scale:{digits}} {unit}"
    return f"{nbytes:.0f} B"


def counted(n: int, noun: str) -> str:
    """Return ``n`` and ``noun`` in the number it takes: ``1 channel``, ``2 channels``."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def human_time(seconds: float) -> str:
    """Return ``seconds`` with three significant digits in s, ms, µs or ns."""
    if seconds >= 1000:
        return f"{seconds:,.0f} s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns" if seconds else "0"
