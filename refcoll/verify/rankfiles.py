"""Rank files: a collective's per-rank arrays on disk, and the rules that make them a world.

A folder holds ``rank<r>.npy`` for every rank ``r = 0 .. p-1`` (NumPy's own format,
which every language can read) and, optionally, ``meta.json``: a JSON object whose
fields refcoll reads are

* ``dtype``: refcoll's name of the arrays' dtype (``float32``, ``bfloat16``...);
* ``stored_as``: how the arrays lie in the files. It differs from ``dtype`` only for
  bfloat16 and the float8 types (ml_dtypes' types, which ``.npy`` cannot name): those
  are stored as the unsigned integers of their width, their bits unchanged;
* ``p``: the number of ranks. When present it is authoritative: a missing file
  below ``p`` or a file at or beyond ``p`` is refused, never a smaller or larger world;
* ``count``: the elements each rank's input holds;
* ``collective``, ``op``, ``root`` (written by ``refcoll oracle``): what the outputs
  are, so they cannot be judged as another collective's.

Without ``meta.json`` the files define the world: ``p`` is the highest rank plus one,
every rank below it must have its file, and every file must hold the first one's dtype.

A world has at most :data:`MAX_SIMULATED_RANKS` ranks (the simulator's bound: the oracle runs
every rank as a thread of one process), and every file is read within bounds, through
:mod:`refcoll.core.reading`: each is a regular file (a FIFO or a device is refused
before it is read), ``meta.json`` holds at most :data:`MAX_META_BYTES` of bounded JSON,
and a ``.npy`` file's header (format 1.0, 2.0 or 3.0) must promise exactly the bytes the
file holds, its size computed in Python's integers, before anything is allocated.

A file that cannot be read, or that does not fit the world, is a
:class:`~refcoll.core.errors.UsageError` naming the file and the reason, so the command
line exits 2 ("cannot be judged") and never 1 ("not conforming") for a bad file.
:func:`load_case` is the one entry of ``refcoll check`` and ``refcoll oracle``: it
applies every rule to a folder of inputs and, for ``check``, a folder of outputs.

Rank files and ``meta.json`` are written through :mod:`refcoll.core.writing`: each to a
temporary name in its folder and renamed over the old one, never through a link.
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path

import numpy as np

from ..algorithms import COLLECTIVES
from ..core import reading, writing
from ..core.errors import UsageError, shown
from ..core.ops import dtype_name, get_dtype, get_op
from ..transport.sim import MAX_SIMULATED_RANKS
from .npy import NpyFile, native_dtype, npy_header, read_npy, stored_dtype

__all__ = ["MAX_META_BYTES", "read_meta", "rank_file_bytes", "read_rank_files",
           "write_rank_files", "write_world", "load_case", "load_outputs", "files_dtype",
           "read_elements", "Streamed"]

_RANK_FILE = re.compile(r"rank(0|[1-9][0-9]*)\.npy")

#: A name a rank file could be mistaken for (``rank03.npy``): refused, never skipped, so the
#: world never shrinks without a word.
_LIKE_A_RANK_FILE = re.compile(r"rank[0-9]+\.npy")

#: The largest ``meta.json`` refcoll reads (refcoll's own are about 200 bytes).
MAX_META_BYTES = 1 << 20

#: A name in ``meta.json`` (a dtype, op or collective): short, one line, no escapes.
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

#: The collectives whose result depends on ``root``, and those that reduce (take ``op``).
_ROOTED = ("broadcast", "reduce")
_REDUCING = ("allreduce", "reduce_scatter", "reduce")

_BITS_RULE = "only bfloat16 and float8 types are stored as their unsigned bits"
_RANKS_WHY = "the oracle runs every rank as a thread of this one process"


# ------------------------------------------------------------------------- writing

def _refuse_folders(paths) -> None:
    """Refuse, before anything is written, a folder where a file is to be written or removed."""
    for f in paths:
        try:
            folder = stat.S_ISDIR(os.lstat(f).st_mode)
        except OSError:
            continue
        if folder:
            raise UsageError(f"{f}: is a folder where refcoll writes a file; move it away "
                             "(nothing was changed)")


def write_rank_files(directory, arrays, *, meta: dict | None = None) -> None:
    """Write ``rank<r>.npy`` for each array (None: no file) and ``meta.json``.

    An array may be given as a function that makes it: it is called when its file is
    written, so a world larger than memory is written one rank at a time; or as a
    :class:`Streamed` array, written block by block.

    bfloat16 and float8 arrays are stored as their unsigned-integer bits (``.npy``
    cannot name ml_dtypes' types); ``meta.json`` records the real dtype and how it is
    stored, so any language can read the bits back. Other files in the folder are
    left alone, so each rank of a job may write its own file (``[None] * r + [x]``).
    Each file is written to a temporary name and renamed over the old one, so a link
    in its place is replaced, never written through.
    """
    path = Path(directory)
    writing.make_folder(path)
    info = dict(meta or {})
    _refuse_folders([path / f"rank{r}.npy" for r, a in enumerate(arrays) if a is not None]
                    + [path / "meta.json"])
    for r, arr in enumerate(arrays):
        if arr is None:
            continue
        if callable(arr):  # made now, written, let go: one rank's array at a time
            arr = arr()
        if "stored_as" not in info:  # the first array's dtype names the world's
            info.setdefault("dtype", dtype_name(arr.dtype))
            info["stored_as"] = str(stored_dtype(arr.dtype))
        if isinstance(arr, Streamed):
            arr.save(path / f"rank{r}.npy")
        else:
            writing.save_npy(path / f"rank{r}.npy",
                             np.ascontiguousarray(arr).view(stored_dtype(arr.dtype)))
        del arr
    writing.write_json(path / "meta.json", info, indent=2)


class Streamed:
    """A rank's array written block by block, never whole: ``dtype``, ``shape`` and
    ``blocks()``, the flat blocks of its elements in order (C order); or, with
    ``source``, a copy of the ``.npy`` file already written there, byte for byte."""

    def __init__(self, dtype, shape: tuple, blocks=None, source=None):
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        self.blocks, self.source = blocks, source

    def save(self, path) -> None:
        """Replace ``path`` with the array in NumPy's ``.npy`` format, as ``np.save``
        writes it (no link followed)."""
        if self.source is not None:
            with reading.open_regular(self.source, what="rank file") as src, \
                    writing.write_file(path) as fh:
                while chunk := src.read(4 << 20):
                    fh.write(chunk)
            return
        stored = stored_dtype(self.dtype)
        header = {"descr": np.lib.format.dtype_to_descr(stored), "fortran_order": False,
                  "shape": self.shape}
        written = 0
        with writing.write_file(path) as fh:
            np.lib.format.write_array_header_1_0(fh, header)
            for block in self.blocks():
                block = np.ascontiguousarray(block).reshape(-1)
                fh.write(block.view(stored).data)
                written += block.size
            if written != math.prod(self.shape):  # raised inside: the file is not replaced
                raise ValueError(f"{path}: {written} elements made of {math.prod(self.shape)}")


def write_world(directory, arrays, *, meta: dict | None = None) -> None:
    """Write a whole world's rank files, as ``refcoll gen-inputs`` and ``oracle`` do.

    :func:`write_rank_files` with ``p = len(arrays)`` in ``meta.json``, after removing
    the rank files already in the folder that this world has no array for (a larger
    world's, or a non-root rank of an earlier all-reduce where a reduce is written):
    the folder then holds exactly this world, and its ``p`` stays true. A stale file
    that is a link is removed itself, never what it points to. A folder of rank files
    without ``meta.json`` is someone else's (a library's outputs): it is refused, not
    overwritten.

    Raises:
        UsageError: more than :data:`MAX_SIMULATED_RANKS` arrays, a folder where a file goes,
            a folder that cannot be created, or rank files refcoll did not write; nothing
            is changed then.
    """
    most = MAX_SIMULATED_RANKS
    if len(arrays) > most:
        raise UsageError(f"{directory}: a world of {len(arrays)} ranks is more than refcoll "
                         f"writes (at most {most}: {_RANKS_WHY})")
    path = Path(directory)
    writing.make_folder(path)
    found = _rank_files(path)
    if found and not os.path.lexists(path / "meta.json"):
        names = ", ".join(f.name for _, f in sorted(found.items())[:3])
        raise UsageError(f"{directory}: holds {len(found)} rank file(s) ({names}"
                         f"{', ...' if len(found) > 3 else ''}) and no meta.json, so refcoll did "
                         "not write them (a library's outputs?); it would overwrite or remove "
                         "them: write into a new folder or one refcoll wrote, or remove them "
                         "first")
    stale = [f for r, f in found.items() if r >= len(arrays) or arrays[r] is None]
    _refuse_folders(stale + [path / f"rank{r}.npy" for r, a in enumerate(arrays)
                             if a is not None] + [path / "meta.json"])
    for f in stale:
        writing.remove_file(f)
    write_rank_files(path, arrays, meta={**(meta or {}), "p": len(arrays)})


# ------------------------------------------------------------------------- reading

def _folder(directory, role: str) -> Path:
    """Return ``directory`` as a Path, refusing one that is missing or not a folder."""
    path = Path(directory)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UsageError(f"{directory}: the {role} folder does not exist") from None
    except OSError as exc:
        raise UsageError(f"{directory}: the {role} folder cannot be read "
                         f"({exc.strerror or exc})") from None
    if stat.S_ISREG(mode):
        raise UsageError(f"{directory}: is a file, not a folder of rank<r>.npy files")
    if not stat.S_ISDIR(mode):
        raise UsageError(f"{directory}: is a special file (a FIFO, device or socket), not a "
                         "folder of rank<r>.npy files")
    return path


def _rank_files(path: Path) -> dict[int, Path]:
    """Return ``{rank: file}`` for the ``rank<r>.npy`` files in ``path``, by rank.

    Raises:
        UsageError: the folder cannot be read, it holds more rank files than a
            world may have (found while listing, so a huge folder costs no memory), or
            a file named like one but for leading zeros (``rank03.npy``).
    """
    most = MAX_SIMULATED_RANKS
    found = {}
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                match = _RANK_FILE.fullmatch(entry.name)
                if not match:
                    if _LIKE_A_RANK_FILE.fullmatch(entry.name):
                        raise UsageError(f"{path / entry.name}: not a rank file's name: "
                                         f"rank<r>.npy writes r without leading zeros "
                                         f"(rank{int(entry.name[4:-4])}.npy); rename it, or "
                                         "move it out of the folder")
                    continue
                if len(found) == most:
                    raise UsageError(f"{path}: holds more than {most} rank<r>.npy files, more "
                                     f"ranks than refcoll reads or writes ({_RANKS_WHY})")
                found[int(match[1])] = path / entry.name
    except OSError as exc:
        raise UsageError(f"{path}: the folder cannot be read ({exc.strerror or exc})") from None
    return dict(sorted(found.items()))


def rank_file_bytes(*folders) -> int:
    """Return the bytes the rank files in ``folders`` hold in all, from their sizes alone.

    Nothing is opened: what a command will read can be held against the memory it may
    use before the first file is read (a sparse file may claim far more than its disk).

    A folder that is missing or not a folder counts 0 bytes (the reader says why).

    Raises:
        UsageError: a folder holds more rank files than a world may have.
    """
    total = 0
    for directory in folders:
        if not os.path.isdir(directory):
            continue
        for f in _rank_files(Path(directory)).values():
            try:
                info = os.stat(f)
            except OSError:
                continue  # the reader says why
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total


def _beyond_most(f: Path, r: int) -> UsageError:
    most = MAX_SIMULATED_RANKS
    return UsageError(f"{f}: rank {r} is beyond the {most} ranks refcoll reads (rank0.npy .. "
                      f"rank{most - 1}.npy: {_RANKS_WHY})")


def _first_gap(ranks) -> int:
    """Return the lowest rank without a file, given the sorted ranks that have one."""
    return next((i for i, r in enumerate(ranks) if r != i), len(ranks))


def _count_field(meta: dict, key: str, f: Path, least: int, what: str) -> None:
    value = meta.get(key)
    if key in meta and (type(value) is not int or value < least):
        raise UsageError(f"{f}: {key} must be {what}, not {shown(value)}")


def _name_field(meta: dict, key: str, f: Path, what: str) -> None:
    value = meta.get(key)
    if key in meta and not (isinstance(value, str) and _NAME.fullmatch(value)):
        raise UsageError(f"{f}: {key} must be {what}, not {shown(value)}")


def read_meta(directory) -> dict:
    """Return ``directory``'s ``meta.json`` as a dict ({} when there is none), checked.

    Read through :mod:`refcoll.core.reading`: a regular file of at most
    :data:`MAX_META_BYTES`, bounded JSON (depth, integers' digits, finite numbers).

    Raises:
        UsageError: the file is not a regular file, cannot be read, is empty, is not
            JSON within those bounds, is not a JSON object, or a field refcoll reads has
            a value no world can have (``p`` above :data:`MAX_SIMULATED_RANKS` included).
    """
    f = Path(directory) / "meta.json"
    if not os.path.lexists(f):
        return {}
    if not f.exists():
        raise UsageError(f"{f}: is a symbolic link to {shown(os.readlink(f))}, which does not "
                         "exist; correct the link or remove it")
    raw = reading.read_bytes(f, max_bytes=MAX_META_BYTES, what="meta.json")
    if not raw.strip():
        raise UsageError(f'{f}: is empty; it must hold a JSON object such as {{"dtype": '
                         f'"float32", "p": 4}}, or be removed')
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{f}: not valid JSON (not UTF-8 text: byte {exc.start} is "
                         f"{raw[exc.start]:#04x})") from None
    meta = reading.loads_json(text, source=str(f))
    if not isinstance(meta, dict):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
            type(meta), "number")
        raise UsageError(f"{f}: holds a JSON {kind}, not a JSON object of fields "
                         '(such as {"dtype": "float32", "p": 4})')
    _name_field(meta, "dtype", f, "a dtype's name")
    if "dtype" in meta:
        try:
            dt = get_dtype(meta["dtype"])
        except UsageError as exc:
            raise UsageError(f"{f}: {exc}") from None
        stored = meta.get("stored_as", str(stored_dtype(dt)))
        if stored != str(stored_dtype(dt)):
            raise UsageError(f"{f}: stored_as {shown(stored)} does not fit dtype "
                             f"{meta['dtype']}, which is stored as {stored_dtype(dt)} "
                             f"({_BITS_RULE})")
    _count_field(meta, "p", f, 1, "a whole number of ranks, 1 or more")
    if "p" in meta and meta["p"] > MAX_SIMULATED_RANKS:
        raise UsageError(f"{f}: p = {meta['p']} is more ranks than refcoll reads (at most "
                         f"{MAX_SIMULATED_RANKS}: {_RANKS_WHY})")
    _count_field(meta, "count", f, 0, "a whole number of elements, 0 or more")
    _count_field(meta, "root", f, 0, "a rank, 0 or more")
    for key in ("collective", "op"):
        _name_field(meta, key, f, "a name")
    if "op" in meta:  # as the options read it: SUM is sum
        try:
            meta["op"] = get_op(meta["op"]).name
        except UsageError as exc:
            raise UsageError(f"{f}: {exc}") from None
    if "collective" in meta and meta["collective"] not in COLLECTIVES:
        raise UsageError(f"{f}: collective {shown(meta['collective'])} is not one of "
                         f"{', '.join(COLLECTIVES)}")
    return meta


def _load(f: Path) -> np.ndarray:
    """Read one ``.npy`` file: a regular file (no FIFO, no device), one plain array."""
    with reading.open_regular(f, what="rank file") as fh:
        try:
            return read_npy(fh, f, size=os.fstat(fh.fileno()).st_size)
        except OSError as exc:
            raise UsageError(f"{f}: cannot be read ({exc.strerror or exc})") from None


def _open(f: Path) -> NpyFile:
    """Open one ``.npy`` file to be read block by block: :func:`_load`'s rules, on its header."""
    try:
        return NpyFile(f, lambda name: reading.open_regular(name, what="rank file"))
    except OSError as exc:
        raise UsageError(f"{f}: cannot be read ({exc.strerror or exc})") from None


def _as(arr, f: Path, want: np.dtype, why: str):
    """Return ``arr`` (an array or an :class:`NpyFile`) as ``want``: itself, or its unsigned
    bits viewed as ml_dtypes' type."""
    if arr.dtype == want:
        return arr
    store = stored_dtype(want)
    bits = arr.dtype == store or (arr.dtype.kind == "V" and arr.dtype.itemsize == want.itemsize)
    if store != want and bits:
        return arr.view(want) if isinstance(arr, np.ndarray) else arr.as_dtype(want)
    detail = ""
    if arr.dtype.itemsize == want.itemsize:
        detail = f"; {_BITS_RULE}" + (f" ({want} as {store})" if store != want else "")
    raise UsageError(f"{f}: holds {dtype_name(arr.dtype)}, expected {dtype_name(want)} "
                     f"({why}){detail}")


def read_rank_files(directory, *, dtype=None, size: int | None = None,
                    lazy: bool = False) -> list:
    """Read ``rank<r>.npy`` files, ``None`` for a missing rank (up to ``size`` ranks).

    ``lazy``: return each file as an :class:`~refcoll.verify.npy.NpyFile`, its header
    checked and its elements read later, block by block.

    The dtype comes from ``dtype``, else ``meta.json``, else the first file, and every
    file must hold it; arrays stored as bits are viewed back as that dtype. The
    world's rules (no gaps, ``meta.json``'s ``p``) are :func:`load_case`'s.

    Raises:
        UsageError: the folder, ``meta.json`` or a file cannot be read, a file holds
            another dtype (naming both), or the world would have more than
            :data:`MAX_SIMULATED_RANKS` ranks.
    """
    path = _folder(directory, "rank files'")
    meta = read_meta(path)
    files = _rank_files(path)
    if not files and size is None:
        raise UsageError(f"{directory}: no rank<r>.npy files")
    if size is None:
        last = next(reversed(files))
        if last >= MAX_SIMULATED_RANKS:
            raise _beyond_most(files[last], last)
        size = last + 1
    elif size > MAX_SIMULATED_RANKS:
        raise UsageError(f"{directory}: {size} ranks is more than refcoll reads (at most "
                         f"{MAX_SIMULATED_RANKS}: {_RANKS_WHY})")
    want, why = None, ""
    if dtype is not None:
        want, why = get_dtype(dtype), "the dtype asked for"
    elif "dtype" in meta:
        want, why = get_dtype(meta["dtype"]), f"as {path / 'meta.json'} says"
    arrays = []
    for r in range(size):
        if r not in files:
            arrays.append(None)
            continue
        arr = _open(files[r]) if lazy else _load(files[r])
        if want is None:
            want, why = arr.dtype, f"as {files[r].name} holds"
        arrays.append(_as(arr, files[r], want, why))
    return arrays


# -------------------------------------------------------------------------- a case

def _world_size(path: Path, meta: dict, files: dict) -> int:
    """Return the inputs' ``p``: meta.json's when given, else the files', with no gap.

    The first gap is found from the files that exist (sorted ranks: the first ``r``
    whose file is not the ``r``-th), never by a walk over ``range(p)``.
    """
    meta_file = path / "meta.json"
    last = next(reversed(files), None)
    if "p" in meta:
        p = meta["p"]
        if last is not None and last >= p:
            beyond = next(r for r in files if r >= p)
            raise UsageError(f"{files[beyond]}: beyond the world: {meta_file} says p = {p} "
                             f"(rank0.npy .. rank{p - 1}.npy); remove the file or correct p")
        rule = f"{meta_file} says p = {p}, so rank0.npy .. rank{p - 1}.npy must all exist"
    else:
        if last is None:
            raise UsageError(f"{path}: no rank<r>.npy files (one per rank: rank0.npy, "
                             "rank1.npy, ...)")
        if last >= MAX_SIMULATED_RANKS:
            raise _beyond_most(files[last], last)
        p = last + 1
        rule = (f"the files go up to rank{p - 1}.npy, so every rank below needs one "
                "(or write meta.json with p)")
    if len(files) < p:  # every file is below p, so some rank below p has none
        missing = p - len(files)
        more = f"; {missing} files are missing" if missing > 1 else ""
        raise UsageError(f"{path / f'rank{_first_gap(files)}.npy'}: missing; {rule}{more}")
    return p


def _load_inputs(in_dir, lazy: bool = False) -> tuple[list, dict]:
    path = _folder(in_dir, "input")
    meta = read_meta(path)
    files = _rank_files(path)
    p = _world_size(path, meta, files)
    inputs = read_rank_files(path, size=p, lazy=lazy)
    first, where = inputs[0], files[0]
    try:
        get_dtype(first.dtype)
    except UsageError as exc:
        raise UsageError(f"{where}: holds {first.dtype}, which refcoll does not reduce ({exc})"
                         ) from None
    for r, x in enumerate(inputs):
        if x.shape == first.shape:
            continue
        if x.ndim == first.ndim == 1:
            raise UsageError(f"{files[r]}: holds {x.size} elements, {where.name} holds "
                             f"{first.size}; every rank's input has the same length")
        raise UsageError(f"{files[r]}: has shape {x.shape}, {where.name} has {first.shape}; "
                         "every rank's input has the same shape")
    if "count" in meta and meta["count"] != first.size:
        raise UsageError(f"{path / 'meta.json'}: says count {meta['count']}, but the rank "
                         f"files hold {first.size} elements each")
    return inputs, {**meta, "p": p, "dtype": dtype_name(first.dtype), "count": int(first.size)}


def _check_output_meta(path: Path, meta: dict, *, p: int, dtype: np.dtype, collective: str,
                       root: int, op: str | None) -> None:
    """Refuse outputs whose meta.json describes another world or another collective."""
    f = path / "meta.json"
    if "p" in meta and meta["p"] != p:
        raise UsageError(f"{f}: says p = {meta['p']}, but the inputs have {p} ranks")
    if "dtype" in meta and get_dtype(meta["dtype"]) != dtype:
        raise UsageError(f"{f}: says dtype {meta['dtype']}, expected {dtype_name(dtype)} (the "
                         "inputs' dtype: a collective's outputs have its inputs' dtype)")
    if meta.get("collective", collective) != collective:
        raise UsageError(f"{f}: holds {meta['collective']} outputs, not {collective}; judge "
                         f"them with --collective {meta['collective']}")
    if collective in _ROOTED and meta.get("root", root) != root:
        raise UsageError(f"{f}: holds the outputs of root {meta['root']}, not {root}; judge "
                         f"them with --root {meta['root']}")
    if op is not None and collective in _REDUCING and meta.get("op", op) != op:
        raise UsageError(f"{f}: holds the outputs of op {meta['op']}, not {op}; judge them "
                         f"with --op {meta['op']}")


def load_outputs(out_dir, p: int, dtype, *, collective: str, root: int, op: str | None,
                 lazy: bool = False) -> list:
    """Read ``out_dir``'s outputs for ``p`` ranks' inputs of ``dtype`` (:func:`load_case`'s
    rules), None where none. The folder's listing and ``meta.json`` are judged first, so a
    ``p`` past the files there is refused before anything is made for each rank."""
    path = _folder(out_dir, "output")
    meta = read_meta(path)
    files = _rank_files(path)
    _check_output_meta(path, meta, p=p, dtype=dtype, collective=collective, root=root, op=op)
    if files and next(reversed(files)) >= p:
        beyond = next(r for r in files if r >= p)
        raise UsageError(f"{files[beyond]}: beyond the inputs' {p} ranks (rank0.npy .. "
                         f"rank{p - 1}.npy)")
    if collective == "reduce":
        gap, missing = (None, 0) if root in files else (root, 1)
        whose = f"reduce's root {root} must have an output"
    else:  # every file is below p: the first gap is the first missing rank
        gap, missing = _first_gap(files), p - len(files)
        whose = f"{collective} gives each of the {p} ranks an output"
    if missing:
        more = f"; {missing} files are missing" if missing > 1 else ""
        raise UsageError(f"{path / f'rank{gap}.npy'}: missing; {whose}{more}")
    read = _open if lazy else _load
    judged = [root] if collective == "reduce" else range(p)  # (a reduce's others: undefined)
    return [_as(read(files[r]), files[r], dtype, "the inputs' dtype")
            if r in files and r in judged else None for r in range(p)]


def load_case(in_dir, out_dir=None, *, collective: str = "allreduce", root: int = 0,
              op: str | None = None, lazy: bool = False) -> tuple[list, list | None, dict]:
    """Read one case for ``refcoll oracle`` (inputs) or ``refcoll check`` (and outputs).

    Inputs: ``meta.json``'s ``p`` when present, else the files' (no gap), at most
    :data:`MAX_SIMULATED_RANKS`; one dtype and one shape on every rank, agreeing with
    ``meta.json``'s ``dtype`` and ``count``. Outputs (when ``out_dir`` is given): no
    file beyond the inputs' ranks, one for every rank that the collective gives a
    result (reduce: only ``root``), each of the inputs' dtype (or its unsigned bits for
    bfloat16 and float8), and a ``meta.json``, if any, that names the same ``p``,
    dtype, collective, root and ``op`` (compared when given). Shapes and values of the
    outputs are the judge's (:func:`refcoll.verify.oracle.check_outputs`), not a
    reading error. A world's rules are checked from its folder's listing and
    ``meta.json`` before any of its rank files is read. With ``lazy``, every file's
    header and size are checked and none of its elements is read: each is an
    :class:`~refcoll.verify.npy.NpyFile` that :func:`~refcoll.verify.oracle.check_outputs`
    reads block by block.

    Returns:
        ``(inputs, outputs, meta)``: the input arrays by rank, the outputs by rank
        (None for a rank without one; ``None`` without ``out_dir``), and the inputs'
        ``meta.json`` with ``p``, ``dtype`` and ``count`` filled in from the files.

    Raises:
        UsageError: naming the file and the reason, for anything that makes the case
            impossible to judge.
    """
    inputs, meta = _load_inputs(in_dir, lazy)
    p = len(inputs)
    if root >= p:
        raise UsageError(f"--root {root} is not one of the {p} ranks (0 .. {p - 1})")
    if out_dir is None:
        return inputs, None, meta
    return inputs, load_outputs(out_dir, p, inputs[0].dtype, collective=collective, root=root,
                                op=op, lazy=lazy), meta


# ---------------------------------------------------------------- without reading it all

def files_dtype(directory, rank: int | None = None) -> np.dtype:
    """Return the dtype of a folder's rank files: ``meta.json``'s, else the header of
    ``rank``'s file (a reduce's root: the others' are not its output), else the first's.

    Only the header of one file is read.
    """
    path = _folder(directory, "output")
    meta = read_meta(path)
    if "dtype" in meta:
        return get_dtype(meta["dtype"])
    files = _rank_files(path)
    if not files:
        raise UsageError(f"{directory}: no rank<r>.npy files")
    first = files[rank if rank in files else next(iter(files))]
    with reading.open_regular(first, what="rank file") as fh:
        _, _, dt, _ = npy_header(fh, first)
    dt = native_dtype(dt)  # as NpyFile reads it: a big-endian file's values, not its bytes
    try:
        get_dtype(dt)  # one refcoll judges, or the file is named
    except UsageError as exc:
        raise UsageError(f"{first}: {exc}") from None
    return dt


def read_elements(outputs: list, asked: dict) -> list:
    """Return elements ``asked[r]`` (sorted) of each rank ``r``'s output file, read alone
    (:meth:`~refcoll.verify.npy.NpyFile.take`); None for the ranks not asked. Each file
    is closed after."""
    out = [None] * len(outputs)
    for r, indices in sorted(asked.items()):
        try:
            out[r] = outputs[r].take(indices)
        finally:
            outputs[r].close()
    return out
