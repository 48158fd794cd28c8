"""The golden vectors' manifest: what it lists, and how refcoll checks it before trusting it.

``manifest.json`` beside the vectors names each ``.npz`` file with its algorithm,
collective, dtype, op, ``p``, ``n``, options and sha256 (:mod:`refcoll.verify.vectors`
writes it). Anyone can hand refcoll a manifest, so :func:`read_manifest` reads it through
:func:`refcoll.core.reading.read_json` (a regular file of at most
:data:`MAX_MANIFEST_BYTES`, bounded JSON) and checks every entry field by field before
any vector is opened: names are short and plain, numbers whole, finite and in range,
and every ``file`` a bare ``.npz`` name in the folder, so nothing outside it is ever
opened, hashed or removed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .. import algorithms
from ..core import reading
from ..core.errors import UsageError, shown
from ..transport.sim import MAX_SIMULATED_RANKS

__all__ = ["FORMAT", "MAX_MANIFEST_BYTES", "read_manifest", "manifest_text"]

#: Version of the manifest's layout.
FORMAT = 1

#: The largest manifest refcoll reads (the committed one is under 200 KiB).
MAX_MANIFEST_BYTES = 4 << 20

#: A vector's file: a bare name in the folder (no folder part, no ``..``), ending .npz.
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=+\-]{0,250}\.npz")

#: A name in an entry (algorithm, collective, op, dtype, kind, an option's name or value).
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

#: A file's digest: sha256 in lower-case hex.
_SHA256 = re.compile(r"[0-9a-f]{64}")


def manifest_text(header: dict, entries: list) -> str:
    """Return the manifest as JSON: the header's keys, then ``vectors``, one a line."""
    head = json.dumps(header, indent=1, sort_keys=True)[:-2]  # drop the closing "\n}"
    body = ",\n  ".join(json.dumps(e, sort_keys=True) for e in entries)
    return f'{head},\n "vectors": [\n  {body}\n ]\n}}\n'


def _name(entry: dict, key: str, where: str, *, optional: bool = False) -> None:
    value = entry.get(key)
    if key not in entry and not optional:
        raise UsageError(f"{where}: has no {key}")
    if value is None and optional:
        return
    if not (isinstance(value, str) and _NAME.fullmatch(value)):
        raise UsageError(f"{where}: {key} must be a name, not {shown(value)}")


def _whole(entry: dict, key: str, where: str, *, least: int = 0, most=None,
           optional: bool = False) -> None:
    if key not in entry:
        if optional:
            return
        raise UsageError(f"{where}: has no {key}")
    if entry[key] is None and optional:
        return
    reading.number(entry[key], where=f"{where}: {key}", least=least, most=most, integer=True)


def _shape_list(value, where: str) -> None:
    if not isinstance(value, list) or len(value) > 64:
        raise UsageError(f"{where}: must be a list of whole numbers, not {shown(value)}")
    for i, d in enumerate(value):
        reading.number(d, where=f"{where}[{i}]", least=0, integer=True)


def _options(options, where: str) -> None:
    """Check an entry's ``options``: a JSON object of names, each to a name or a number."""
    if not isinstance(options, dict):
        raise UsageError(f"{where}: options must be a JSON object, not {shown(options)}")
    for key, value in options.items():
        if not _NAME.fullmatch(key):
            raise UsageError(f"{where}: options: {shown(key)} is not an option's name")
        if isinstance(value, str):
            if not _NAME.fullmatch(value):
                raise UsageError(f"{where}: options: {key} must be a name or a number, not "
                                 f"{shown(value)}")
        else:
            reading.number(value, where=f"{where}: options: {key}")


def _checked_entry(entry, where: str) -> dict:
    """Check one manifest entry field by field: types, names, bounded finite numbers."""
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: must be a JSON object, not {shown(entry)}")
    name = entry.get("file")
    if not (isinstance(name, str) and _FILE.fullmatch(name)):
        raise UsageError(f"{where}: file must be a bare .npz name in the vectors' folder (no "
                         f"folder part, no ..), not {shown(name)}")
    where = f"{where} ({name})"
    for key in ("algorithm", "collective", "dtype", "kind"):
        _name(entry, key, where)
    _name(entry, "op", where, optional=True)
    _name(entry, "stored_as", where, optional=True)
    _whole(entry, "p", where, least=1, most=MAX_SIMULATED_RANKS)
    _whole(entry, "n", where)
    _whole(entry, "seed", where, optional=True)
    _whole(entry, "extra_ranks", where, optional=True)
    _whole(entry, "root", where, most=entry["p"] - 1, optional=True)
    _options(entry.get("options"), where)
    try:  # the algorithm's own options (and the root): no keyword of the simulator's
        algorithms.check_options(entry["algorithm"], entry["collective"],
                                 {k: v for k, v in entry["options"].items() if k != "root"})
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    digest = entry.get("sha256")
    if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise UsageError(f"{where}: sha256 must be 64 lower-case hex digits, not "
                         f"{shown(digest)}")
    if "input_shape" in entry:
        _shape_list(entry["input_shape"], f"{where}: input_shape")
    if "output_ranks" in entry:
        _shape_list(entry["output_ranks"], f"{where}: output_ranks")
        for i, r in enumerate(entry["output_ranks"]):
            reading.number(r, where=f"{where}: output_ranks[{i}]", most=entry["p"] - 1)
    if "output_shapes" in entry:
        shapes = entry["output_shapes"]
        if not isinstance(shapes, list) or len(shapes) > entry["p"]:
            raise UsageError(f"{where}: output_shapes must be a list of shapes, one per output")
        for i, shape in enumerate(shapes):
            _shape_list(shape, f"{where}: output_shapes[{i}]")
    return entry


def read_manifest(directory) -> dict:
    """Return ``directory``'s ``manifest.json``, checked field by field.

    Read through :func:`refcoll.core.reading.read_json` (a regular file of at most
    :data:`MAX_MANIFEST_BYTES`, bounded JSON). Every entry's ``file`` must be a bare
    ``.npz`` name in the folder, so nothing outside it is ever opened or removed.

    Raises:
        UsageError: one line naming the manifest (and the entry) and what is wrong.
    """
    f = Path(directory) / "manifest.json"
    data = reading.read_json(f, what="vectors' manifest", max_bytes=MAX_MANIFEST_BYTES)
    if not isinstance(data, dict):
        raise UsageError(f"{f}: must hold a JSON object (refcoll's vectors' manifest), not "
                         f"{shown(data)}")
    if data.get("format") != FORMAT or isinstance(data.get("format"), bool):
        raise UsageError(f"{f}: format must be {FORMAT} (refcoll's vectors' manifest), not "
                         f"{shown(data.get('format'))}")
    vectors = data.get("vectors")
    if not isinstance(vectors, list):
        raise UsageError(f"{f}: vectors must be a list of entries, not {shown(vectors)}")
    for i, entry in enumerate(vectors):
        _checked_entry(entry, f"{f}: vectors[{i}]")
    if "count" in data and (type(data["count"]) is not int or data["count"] != len(vectors)):
        raise UsageError(f"{f}: count is {shown(data['count'])}, but it lists {len(vectors)} "
                         "vectors")
    return data
