"""Golden test vectors: inputs and every rank's expected output, for other implementations.

``spec/vectors/`` holds one small ``.npz`` file per vector and a ``manifest.json``
that lists them. A vector is one run of one algorithm's collective: every rank's
input (``input_0`` .. ``input_{p-1}``) and every rank's output (``output_r``;
``reduce`` has one, on its root), as :func:`refcoll.simulate` computes them, so an
implementation of the same algorithm in another language must reproduce every
output bit for bit. ``spec/vectors/README.md`` says how to read them.

What the set holds (:func:`plan`): every registered algorithm but ``auto`` (which
only picks one of the others: its record ``chooses``) and every collective it
implements, over

* ``float32``, ``random`` inputs at ``p`` in 1, 2, 3, 4, 5, 8 with ``n = p + 1``
  (uneven chunks) and ``n = 37`` at ``p`` in 3, 5, 8; ``n`` 0 and 1 at ``p = 3``
  (empty chunks);
* ``bfloat16`` ``random``, and ``int32`` ``exact`` (wrapping), at ``p = 5``;
* reductions also: ``float16`` ``random`` and ``float64`` ``random`` at ``p = 5``,
  ``adversarial`` ``float32`` sums at ``p = 8`` (cancelling values whose bits
  expose the order), ``avg``, ``max`` and ``prod`` of ``float32``, ``avg`` of
  ``bfloat16`` and of ``int32`` (truncating division);
* for each further option set of the algorithm's record
  (:attr:`~refcoll.algorithms.registry.Algorithm.vector_variants`: a segment or
  packet shorter than the buffer, unequal nodes, the switch's integer mode; the
  first set is the whole grid's) and for ``root = p - 1``: ``float32``
  ``random``, ``n = 37``, ``p`` in 3, 5, 8.

Random floats are the vectors that pin a reduction order; integers and ``exact``
inputs pin data movement and wrapping. Inputs come from
:func:`refcoll.verify.inputs.make_inputs` with seed :data:`SEED`.

Bytes: each file is an uncompressed zip with a fixed date, its members written in
sorted order with ``.npy`` format 1.0, little-endian, so regenerating gives the
same bytes and the manifest's sha256 of each file is stable; ``verify`` checks
both the digests and, by simulating again, every output.

Run ``refcoll vectors spec/vectors`` to regenerate and
``refcoll vectors --verify spec/vectors`` to check.

Files: the writer writes each file to a temporary name and renames it into place
(:mod:`refcoll.core.writing`), so a link in the folder is replaced, never written
through. It writes only into an empty or new folder, or one that holds a manifest
of refcoll's (:func:`read_manifest`), and removes only the files that manifest
named and the new plan does not. Manifests and vectors are read through
:mod:`refcoll.core.reading`: regular files within :data:`MAX_MANIFEST_BYTES` and
:data:`MAX_VECTOR_BYTES`, the manifest checked field by field (every ``file`` a bare
``.npz`` name in the folder) before any vector is opened.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .. import algorithms
from ..calls.collectives import simulate
from ..core import reading, writing
from ..core.bits import first_bit_difference, same_bits
from ..core.errors import UsageError, shown
from ..core.ops import dtype_name, get_dtype
from .inputs import make_inputs
from .manifest import FORMAT, MAX_MANIFEST_BYTES, manifest_text, read_manifest
from .npy import read_npy, stored_dtype

__all__ = ["FORMAT", "SEED", "PROCESS_COUNTS", "GENERATOR", "MAX_MANIFEST_BYTES",
           "MAX_VECTOR_BYTES", "Vector", "plan", "generate", "verify", "load", "read_manifest"]

#: Seed of every vector's inputs.
SEED = 0
#: Process counts of the main grid.
PROCESS_COUNTS = (1, 2, 3, 4, 5, 8)
#: The manifest's ``generator``: the command that first wrote the committed set. The
#: command is ``refcoll vectors spec/vectors`` now; the text stays, since it is part
#: of the manifest's bytes, which must not change while the vectors do not.
GENERATOR = "python -m refcoll.vectors spec/vectors"

_REDUCING = ("allreduce", "reduce_scatter", "reduce")
_ROOTED = ("broadcast", "reduce")
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip can hold: no clock in the bytes

#: The largest vector file, and the largest array in one, refcoll reads (the committed
#: ones are under 16 KiB).
MAX_VECTOR_BYTES = 4 << 20



@dataclass(frozen=True)
class Vector:
    """One vector: an algorithm's collective on one op, dtype, ``p``, ``n`` and input kind.

    ``options`` are the keyword options of the call (``root`` included), as sorted
    ``(name, value)`` pairs; ``op`` is ``None`` for allgather and broadcast.
    """

    algorithm: str
    collective: str
    op: str | None
    dtype: str
    p: int
    n: int
    kind: str
    options: tuple = ()

    @property
    def filename(self) -> str:
        """Return the file's name: every parameter, options last (``-root2``)."""
        parts = [self.algorithm, self.collective, self.op or "none", self.dtype,
                 f"p{self.p}", f"n{self.n}", self.kind]
        parts += [f"{key}{value}" for key, value in self.options]
        return "-".join(parts) + ".npz"

    def inputs(self) -> list[np.ndarray]:
        """Return every rank's input (data movement uses the ``sum`` inputs)."""
        return make_inputs(self.kind, get_dtype(self.dtype), self.n, self.p,
                           op=self.op or "sum", seed=SEED)

    def run(self, inputs: Sequence[np.ndarray]) -> list:
        """Return every rank's output from the simulator (``None`` off a reduce's root)."""
        kwargs = dict(self.options)
        if self.op is not None:
            kwargs["op"] = self.op
        return simulate(self.collective, list(inputs), algorithm=self.algorithm, **kwargs).outputs


def _vector(algorithm: str, collective: str, op, dtype: str, p: int, n: int, kind: str,
            options: dict, root: int = 0) -> Vector:
    if collective in _ROOTED:
        options = dict(options, root=root)
    return Vector(algorithm, collective, op if collective in _REDUCING else None, dtype, p, n,
                  kind, tuple(sorted(options.items())))


def _grid(reducing: bool) -> Iterator[tuple]:
    """Yield the main grid's ``(op, dtype, p, n, kind)``."""
    for p in PROCESS_COUNTS:
        yield ("sum", "float32", p, p + 1, "random")
        if p in (3, 5, 8):
            yield ("sum", "float32", p, 37, "random")
    for n in (0, 1):
        yield ("sum", "float32", 3, n, "random")
    yield ("sum", "bfloat16", 5, 37, "random")
    yield ("sum", "int32", 5, 37, "exact")
    if not reducing:
        return
    yield ("sum", "float16", 5, 37, "random")
    yield ("sum", "float64", 5, 37, "random")
    yield ("sum", "float32", 8, 37, "adversarial")
    for op in ("avg", "max", "prod"):
        yield (op, "float32", 5, 37, "random")
    yield ("avg", "bfloat16", 5, 37, "random")
    yield ("avg", "int32", 5, 37, "exact")


def plan() -> list[Vector]:
    """Return every vector of the set, in registry order (see the module docstring)."""
    vectors = []
    for algo in algorithms.REGISTRY.values():
        if algo.chooses:  # it runs one of the others: their vectors are its vectors
            continue
        base, *others = algo.vector_variants
        for collective in algo.collectives:
            vectors += [_vector(algo.name, collective, *case, base)
                        for case in _grid(collective in _REDUCING)]
            few = [(p, options, 0) for options in others for p in (3, 5, 8)]
            if collective in _ROOTED:
                few += [(p, base, p - 1) for p in (3, 5, 8)]
            vectors += [_vector(algo.name, collective, "sum", "float32", p, 37, "random",
                                options, root) for p, options, root in few]
    return vectors


# ----------------------------------------------------------------------- files

def _stored(arr: np.ndarray) -> np.ndarray:
    """Return ``arr`` as it is stored: little-endian, ml_dtypes types as their bits."""
    arr = np.ascontiguousarray(arr)
    return arr.view(stored_dtype(arr.dtype)).astype(stored_dtype(arr.dtype).newbyteorder("<"),
                                                    copy=False)


def _npz_bytes(arrays: dict) -> bytes:
    """Return an ``.npz`` whose bytes depend only on ``arrays`` (no dates, no compression)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for key in sorted(arrays):
            member = io.BytesIO()
            np.lib.format.write_array(member, _stored(arrays[key]), version=(1, 0),
                                      allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_DATE)
            info.create_system = 3  # the same bytes on every platform
            info.external_attr = 0o644 << 16
            archive.writestr(info, member.getvalue())
    return buffer.getvalue()


def _sha256(path: Path) -> str:
    """Return a vector file's sha256, read in pieces from a regular file of bounded size."""
    digest = hashlib.sha256()
    with reading.open_regular(path, max_bytes=MAX_VECTOR_BYTES, what="vector file") as fh:
        try:
            for block in iter(lambda: fh.read(1 << 16), b""):
                digest.update(block)
        except OSError as exc:
            raise UsageError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return digest.hexdigest()


def _entry(v: Vector, outputs: list, digest: str) -> dict:
    """Return a vector's manifest entry."""
    algo = algorithms.get(v.algorithm)
    options = dict(v.options)
    held = [r for r, y in enumerate(outputs) if y is not None]
    dt = get_dtype(v.dtype)
    return {
        "file": v.filename,
        "algorithm": v.algorithm,
        "collective": v.collective,
        "op": v.op,
        "dtype": v.dtype,
        "stored_as": dtype_name(stored_dtype(dt)),
        "p": v.p,
        "n": v.n,
        "kind": v.kind,
        "seed": SEED,
        "options": options,
        "root": options.get("root"),
        "extra_ranks": algo.extra_ranks(v.p, **options) if algo.extra_ranks else 0,
        "input_shape": [v.n],
        "output_ranks": held,
        "output_shapes": [list(np.shape(outputs[r])) for r in held],
        "sha256": digest,
    }


def _previous(path: Path) -> set[str]:
    """Return the files the folder's previous manifest names; refuse a folder not refcoll's.

    A missing or empty folder has none. A folder that holds anything but no
    ``manifest.json`` is refused: its files are someone else's.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return set()
    except OSError as exc:
        raise UsageError(f"{path}: the folder cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(mode):
        raise UsageError(f"{path}: is not a folder; give a folder for the vectors")
    if os.path.lexists(path / "manifest.json"):
        return {e["file"] for e in read_manifest(path)["vectors"]}
    try:
        with os.scandir(path) as entries:
            held = next(entries, None)
    except OSError as exc:
        raise UsageError(f"{path}: the folder cannot be read ({exc.strerror or exc})") from None
    if held is not None:
        raise UsageError(f"{path}: holds files ({shown(held.name)}...) but no manifest.json of "
                         "refcoll's vectors; give an empty or new folder, or one `refcoll "
                         "vectors` wrote (nothing was changed)")
    return set()


def generate(directory) -> dict:
    """Write every vector of :func:`plan` and ``manifest.json`` into ``directory``.

    ``directory`` must be new, empty, or hold a manifest of refcoll's; the files that
    manifest named and the plan no longer makes are removed, and nothing else (other
    ``.npz`` files, the README) is touched. Each file is written to a temporary name
    and renamed into place, never through a link. Returns the manifest.

    Raises:
        UsageError: a folder that is not refcoll's, a manifest that is not refcoll's
            (checked field by field), or a folder where a file goes; nothing is
            changed then.
    """
    path = Path(directory)
    previous = _previous(path)
    vectors = plan()
    wanted = {v.filename for v in vectors}
    stale = sorted(previous - wanted)
    for name in [*wanted, *stale, "manifest.json"]:
        if (path / name).is_dir() and not (path / name).is_symlink():
            raise UsageError(f"{path / name}: is a folder where refcoll writes or removes a "
                             "file; move it away (nothing was changed)")
    theirs = sorted(name for name in wanted - previous if os.path.lexists(path / name))
    if theirs:
        raise UsageError(f"{path / theirs[0]}: is where refcoll writes a vector, but the "
                         "folder's manifest.json does not name it: it is not refcoll's to "
                         "replace; move it away (nothing was changed)")
    writing.make_folder(path)
    entries = []
    for v in vectors:
        inputs = v.inputs()
        outputs = v.run(inputs)
        arrays = {f"input_{r}": x for r, x in enumerate(inputs)}
        arrays.update({f"output_{r}": y for r, y in enumerate(outputs) if y is not None})
        data = _npz_bytes(arrays)
        writing.write_bytes(path / v.filename, data)
        entries.append(_entry(v, outputs, hashlib.sha256(data).hexdigest()))
    for name in stale:
        writing.remove_file(path / name)
    header = {
        "format": FORMAT,
        "generator": GENERATOR,
        "expected_by": "refcoll.simulate",
        "bytes": ("stable: uncompressed zip, fixed member dates, members in sorted order, "
                  ".npy format 1.0 little-endian; sha256 is of the whole file"),
        "count": len(entries),
    }
    writing.write_text(path / "manifest.json", manifest_text(header, entries))
    return dict(header, vectors=entries)


#: What a broken archive can raise while it is opened or read (beside UsageError).
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError,
               zlib.error, EOFError, OSError, ValueError, KeyError, IndexError)


def load(directory, entry: dict) -> tuple[list, list]:
    """Return a vector's ``(inputs, outputs)`` by rank, in their real dtype.

    ``outputs[r]`` is ``None`` for a rank without an output (off a reduce's root). The
    file is read as a regular file of at most :data:`MAX_VECTOR_BYTES`, and each array
    through :func:`refcoll.verify.npy.read_npy` (its size checked before it is
    allocated).

    Raises:
        UsageError: the file is not such an archive, lacks an input, or holds an array
            that is not the entry's dtype as stored.
    """
    f = Path(directory) / entry["file"]
    dt = get_dtype(entry["dtype"])
    store = stored_dtype(dt)
    with reading.open_regular(f, max_bytes=MAX_VECTOR_BYTES, what="vector file") as fh:
        try:
            with zipfile.ZipFile(fh) as archive:
                members = {info.filename: info for info in archive.infolist()}

                def read(key):
                    info = members.get(f"{key}.npy")
                    if info is None:
                        raise UsageError(f"{f}: holds no {key}.npy")
                    if info.file_size > MAX_VECTOR_BYTES:
                        raise UsageError(f"{f}: its {key}.npy holds {info.file_size} bytes, "
                                         f"more than the {MAX_VECTOR_BYTES} refcoll reads")
                    with archive.open(info) as member:
                        stored = read_npy(member, f"{f}:{key}.npy", size=info.file_size)
                    if stored.dtype != store:
                        raise UsageError(f"{f}: its {key}.npy holds {stored.dtype}, but "
                                         f"{entry['dtype']} is stored as {store}")
                    return stored.view(dt)

                ranks = range(entry["p"])
                known = {f"{kind}_{r}.npy" for kind in ("input", "output") for r in ranks}
                other = sorted(set(members) - known)
                if other:
                    raise UsageError(f"{f}: holds {other[0]}, which no rank of a vector of "
                                     f"{entry['p']} ranks has")
                inputs = [read(f"input_{r}") for r in ranks]
                outputs = [read(f"output_{r}") if f"output_{r}.npy" in members else None
                           for r in ranks]
        except UsageError:
            raise
        except _ZIP_ERRORS as exc:
            detail = " ".join(str(exc).split())[:120] or type(exc).__name__
            raise UsageError(f"{f}: not a readable .npz archive ({detail})") from None
    return inputs, outputs


def _to_verify(path: Path) -> list[dict]:
    """Return the manifest's entries, each checked (:func:`read_manifest`); refuse a
    manifest that names no vector, or one vector twice."""
    entries = read_manifest(path)["vectors"]
    if not entries:
        raise UsageError(f"{path / 'manifest.json'}: names no vectors: nothing to verify")
    files = [entry["file"] for entry in entries]
    twice = sorted({name for name in files if files.count(name) > 1})
    if twice:
        raise UsageError(f"{path / 'manifest.json'}: names {twice[0]} more than once")
    return entries


def verify(directory) -> list[str]:
    """Re-simulate every vector in ``directory``; return one line per mismatch (none: ``[]``).

    Checks each file's sha256 against the manifest, every field of its entry that
    describes the vector (``n``, ``root``, ``output_ranks``, ``output_shapes``...)
    against the vector and the run, and every rank's stored output against
    :func:`refcoll.simulate`'s, bit for bit.

    Raises:
        UsageError: the manifest is not refcoll's (:func:`read_manifest`), names no
            vector or one twice, or a vector
            whose bytes are the manifest's cannot be read (not a regular file, too
            large, not an archive of arrays). An altered vector that cannot be read
            (a truncated file) is one more mismatch, and the others are still checked.
    """
    path = Path(directory)
    problems = []
    for entry in _to_verify(path):
        name = entry["file"]
        if not (path / name).exists():
            problems.append(f"{name}: missing")
            continue
        altered = _sha256(path / name) != entry["sha256"]
        if altered:
            problems.append(f"{name}: sha256 differs from the manifest's")
        v = Vector(entry["algorithm"], entry["collective"], entry.get("op"), entry["dtype"],
                   entry["p"], entry["n"], entry["kind"], tuple(sorted(entry["options"].items())))
        try:
            inputs, outputs = load(path, entry)
        except UsageError as exc:
            if not altered:  # the manifest's own bytes, unreadable: not refcoll's vectors
                raise
            problems.append(f"{name}: cannot be read: {exc}")  # altered, and so broken: go on
            continue
        short = [r for r, x in enumerate(inputs) if x.size != entry["n"]]
        if short:
            problems.append(f"{name}: rank {short[0]}'s input holds {inputs[short[0]].size} "
                            f"elements, the manifest says n = {entry['n']}")
            continue
        try:
            predicted = v.run(inputs)
        except UsageError as exc:  # the entry names a call the simulator refuses
            raise UsageError(f"{path / name}: {exc}") from None
        problems += [f"{name}: the manifest says {key} {entry.get(key)!r}; the vector is "
                     f"{value!r}" for key, value in _entry(v, predicted, entry["sha256"]).items()
                     if entry.get(key) != value]
        for r, (have, want) in enumerate(zip(outputs, predicted)):
            if have is None and want is None:
                continue
            if have is None or want is None:
                problems.append(f"{name}: rank {r} " + ("has no output, the simulator gives one"
                                                        if have is None else
                                                        "has an output, the simulator gives none"))
            elif not same_bits(have, np.asarray(want)):
                problems.append(f"{name}: rank {r} {first_bit_difference(have, np.asarray(want))}")
    return problems
