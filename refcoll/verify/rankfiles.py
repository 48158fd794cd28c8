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

A file that cannot be read, or that does not fit the world, is a
:class:`~refcoll.core.errors.UsageError` naming the file and the reason, so the command
line exits 2 ("cannot be judged") and never 1 ("not conforming") for a bad file.
:func:`load_case` is the one entry of ``refcoll check`` and ``refcoll oracle``: it
applies every rule to a folder of inputs and, for ``check``, a folder of outputs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from ..core.errors import UsageError
from ..core.ops import dtype_name, get_dtype

__all__ = ["read_meta", "read_rank_files", "write_rank_files", "write_world", "load_case",
           "stored_dtype"]

_RANK_FILE = re.compile(r"rank(0|[1-9][0-9]*)\.npy")

#: The collectives whose result depends on ``root``, and those that reduce (take ``op``).
_ROOTED = ("broadcast", "reduce")
_REDUCING = ("allreduce", "reduce_scatter", "reduce")

_BITS_RULE = "only bfloat16 and float8 types are stored as their unsigned bits"


def stored_dtype(dtype) -> np.dtype:
    """Return how ``dtype`` is stored in ``.npy``: ml_dtypes' types as unsigned bits."""
    dtype = np.dtype(dtype)
    if dtype.kind == "V" or dtype.name.startswith(("bfloat16", "float8")):
        return np.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


# ------------------------------------------------------------------------- writing

def write_rank_files(directory, arrays, *, meta: dict | None = None) -> None:
    """Write ``rank<r>.npy`` for each array (None: no file) and ``meta.json``.

    bfloat16 and float8 arrays are stored as their unsigned-integer bits (``.npy``
    cannot name ml_dtypes' types); ``meta.json`` records the real dtype and how it is
    stored, so any language can read the bits back. Other files in the folder are
    left alone, so each rank of a job may write its own file (``[None] * r + [x]``).
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    first = next((a for a in arrays if a is not None), None)
    info = dict(meta or {})
    if first is not None:
        info.setdefault("dtype", dtype_name(first.dtype))
        info["stored_as"] = str(stored_dtype(first.dtype))
    for r, arr in enumerate(arrays):
        if arr is not None:
            np.save(path / f"rank{r}.npy", np.ascontiguousarray(arr).view(stored_dtype(arr.dtype)))
    (path / "meta.json").write_text(json.dumps(info, indent=2) + "\n")


def write_world(directory, arrays, *, meta: dict | None = None) -> None:
    """Write a whole world's rank files, as ``refcoll gen-inputs`` and ``oracle`` do.

    :func:`write_rank_files` with ``p = len(arrays)`` in ``meta.json``, after removing
    the rank files already in the folder that this world has no array for (a larger
    world's, or a non-root rank of an earlier all-reduce where a reduce is written):
    the folder then holds exactly this world, and its ``p`` stays true.
    """
    path = Path(directory)
    if path.is_dir():
        for r, f in _rank_files(path).items():
            if r >= len(arrays) or arrays[r] is None:
                f.unlink()
    write_rank_files(path, arrays, meta={**(meta or {}), "p": len(arrays)})


# ------------------------------------------------------------------------- reading

def _folder(directory, role: str) -> Path:
    """Return ``directory`` as a Path, refusing one that is missing or not a folder."""
    path = Path(directory)
    if not path.exists():
        raise UsageError(f"{directory}: the {role} folder does not exist")
    if not path.is_dir():
        raise UsageError(f"{directory}: is a file, not a folder of rank<r>.npy files")
    return path


def _rank_files(path: Path) -> dict[int, Path]:
    """Return ``{rank: file}`` for the ``rank<r>.npy`` files in ``path``."""
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise UsageError(f"{path}: the folder cannot be read ({exc.strerror})") from None
    found = {}
    for name in names:
        match = _RANK_FILE.fullmatch(name)
        if match:
            found[int(match[1])] = path / name
    return dict(sorted(found.items()))


def _count_field(meta: dict, key: str, f: Path, least: int, what: str) -> None:
    value = meta.get(key)
    if key in meta and (type(value) is not int or value < least):
        raise UsageError(f"{f}: {key} must be {what}, not {value!r}")


def read_meta(directory) -> dict:
    """Return ``directory``'s ``meta.json`` as a dict ({} when there is none), checked.

    Raises:
        UsageError: the file cannot be read, is empty, is not JSON, is not a JSON
            object, or a field refcoll reads has a value no world can have.
    """
    f = Path(directory) / "meta.json"
    if not f.exists():
        return {}
    try:
        raw = f.read_bytes()
    except OSError as exc:
        raise UsageError(f"{f}: cannot be read ({exc.strerror})") from None
    if not raw.strip():
        raise UsageError(f'{f}: is empty; it must hold a JSON object such as {{"dtype": '
                         f'"float32", "p": 4}}, or be removed')
    try:
        meta = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{f}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
            type(meta), "number")
        raise UsageError(f"{f}: holds a JSON {kind}, not a JSON object of fields "
                         '(such as {"dtype": "float32", "p": 4})')
    if "dtype" in meta:
        if not isinstance(meta["dtype"], str):
            raise UsageError(f"{f}: dtype must be a dtype's name, not {meta['dtype']!r}")
        try:
            dt = get_dtype(meta["dtype"])
        except UsageError as exc:
            raise UsageError(f"{f}: {exc}") from None
        stored = meta.get("stored_as", str(stored_dtype(dt)))
        if stored != str(stored_dtype(dt)):
            raise UsageError(f"{f}: stored_as {stored!r} does not fit dtype {meta['dtype']}, "
                             f"which is stored as {stored_dtype(dt)} ({_BITS_RULE})")
    _count_field(meta, "p", f, 1, "a whole number of ranks, 1 or more")
    _count_field(meta, "count", f, 0, "a whole number of elements, 0 or more")
    _count_field(meta, "root", f, 0, "a rank, 0 or more")
    for key in ("collective", "op"):
        if key in meta and not isinstance(meta[key], str):
            raise UsageError(f"{f}: {key} must be a name, not {meta[key]!r}")
    return meta


def _header(fh, f: Path):
    """Return the ``.npy`` header's ``(shape, dtype)`` (None where its version is unknown)."""
    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dt = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, _, dt = np.lib.format.read_array_header_2_0(fh)
        else:
            return None
    except (ValueError, SyntaxError, EOFError) as exc:
        raise UsageError(f"{f}: its .npy header cannot be read ({exc})") from None
    return shape, dt


def _load(f: Path) -> np.ndarray:
    """Read one ``.npy`` file, refusing what is not one plain array with a reason."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            start = fh.read(6)
            if not start:
                raise UsageError(f"{f}: is empty (0 bytes), not a .npy file")
            if start.startswith(b"PK"):
                raise UsageError(f"{f}: is an .npz archive, not a .npy file; save each rank's "
                                 "array alone with numpy.save")
            if start != b"\x93NUMPY":
                raise UsageError(f"{f}: not a .npy file (it does not start with NumPy's "
                                 "\\x93NUMPY header); save each rank's array with numpy.save")
            fh.seek(0)
            header = _header(fh, f)
            if header is not None:
                shape, dt = header
                if dt.hasobject:
                    raise UsageError(f"{f}: holds Python objects (a pickled object array), "
                                     "not numbers; save a numeric array")
                need = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                held = size - fh.tell()
                if held < need:
                    raise UsageError(f"{f}: truncated: its header promises {need} bytes "
                                     f"({dt}{list(shape)}), the file holds {held}")
                if held > need:
                    raise UsageError(f"{f}: holds {held - need} bytes after its array "
                                     "(more than one array written into one file?)")
        arr = np.load(f, allow_pickle=False)
    except UsageError:
        raise
    except OSError as exc:
        raise UsageError(f"{f}: cannot be read ({exc.strerror or exc})") from None
    except (ValueError, EOFError) as exc:
        raise UsageError(f"{f}: not a readable .npy file ({exc})") from None
    if arr.dtype.names is not None:
        raise UsageError(f"{f}: holds a structured dtype {arr.dtype}, not one type of number")
    if arr.dtype.byteorder not in ("=", "|"):
        arr = arr.astype(arr.dtype.newbyteorder("="))  # same values, this machine's order
    return arr


def _as(arr: np.ndarray, f: Path, want: np.dtype, why: str) -> np.ndarray:
    """Return ``arr`` as ``want``: itself, or its unsigned bits viewed as ml_dtypes' type."""
    if arr.dtype == want:
        return arr
    store = stored_dtype(want)
    bits = arr.dtype == store or (arr.dtype.kind == "V" and arr.dtype.itemsize == want.itemsize)
    if store != want and bits:
        return arr.view(want)
    detail = ""
    if arr.dtype.itemsize == want.itemsize:
        detail = f"; {_BITS_RULE}" + (f" ({want} as {store})" if store != want else "")
    raise UsageError(f"{f}: holds {dtype_name(arr.dtype)}, expected {dtype_name(want)} "
                     f"({why}){detail}")


def read_rank_files(directory, *, dtype=None, size: int | None = None) -> list:
    """Read ``rank<r>.npy`` files, ``None`` for a missing rank (up to ``size`` ranks).

    The dtype comes from ``dtype``, else ``meta.json``, else the first file, and every
    file must hold it; arrays stored as bits are viewed back as that dtype. The
    world's rules (no gaps, ``meta.json``'s ``p``) are :func:`load_case`'s.

    Raises:
        UsageError: the folder, ``meta.json`` or a file cannot be read, or a file
            holds another dtype (naming both).
    """
    path = _folder(directory, "rank files'")
    meta = read_meta(path)
    files = _rank_files(path)
    if not files and size is None:
        raise UsageError(f"{directory}: no rank<r>.npy files")
    want, why = None, ""
    if dtype is not None:
        want, why = get_dtype(dtype), "the dtype asked for"
    elif "dtype" in meta:
        want, why = get_dtype(meta["dtype"]), f"as {path / 'meta.json'} says"
    arrays = []
    for r in range(size if size is not None else max(files) + 1):
        if r not in files:
            arrays.append(None)
            continue
        arr = _load(files[r])
        if want is None:
            want, why = arr.dtype, f"as {files[r].name} holds"
        arrays.append(_as(arr, files[r], want, why))
    return arrays


# -------------------------------------------------------------------------- a case

def _world_size(path: Path, meta: dict, files: dict) -> int:
    """Return the inputs' ``p``: meta.json's when given, else the files', with no gap."""
    meta_file = path / "meta.json"
    if "p" in meta:
        p = meta["p"]
        beyond = [r for r in files if r >= p]
        if beyond:
            raise UsageError(f"{files[beyond[0]]}: beyond the world: {meta_file} says p = {p} "
                             f"(rank0.npy .. rank{p - 1}.npy); remove the file or correct p")
        rule = f"{meta_file} says p = {p}, so rank0.npy .. rank{p - 1}.npy must all exist"
    else:
        if not files:
            raise UsageError(f"{path}: no rank<r>.npy files (one per rank: rank0.npy, "
                             "rank1.npy, ...)")
        p = max(files) + 1
        rule = (f"the files go up to rank{p - 1}.npy, so every rank below needs one "
                "(or write meta.json with p)")
    missing = [r for r in range(p) if r not in files]
    if missing:
        more = f"; {len(missing)} files are missing" if len(missing) > 1 else ""
        raise UsageError(f"{path / f'rank{missing[0]}.npy'}: missing; {rule}{more}")
    return p


def _load_inputs(in_dir) -> tuple[list, dict]:
    path = _folder(in_dir, "input")
    meta = read_meta(path)
    files = _rank_files(path)
    p = _world_size(path, meta, files)
    inputs = read_rank_files(path, size=p)
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


def _load_outputs(out_dir, inputs: list, *, collective: str, root: int, op: str | None) -> list:
    path = _folder(out_dir, "output")
    meta = read_meta(path)
    files = _rank_files(path)
    p, dtype = len(inputs), inputs[0].dtype
    _check_output_meta(path, meta, p=p, dtype=dtype, collective=collective, root=root, op=op)
    beyond = [r for r in files if r >= p]
    if beyond:
        raise UsageError(f"{files[beyond[0]]}: beyond the inputs' {p} ranks (rank0.npy .. "
                         f"rank{p - 1}.npy)")
    needed = [root] if collective == "reduce" else range(p)
    missing = [r for r in needed if r not in files]
    if missing:
        whose = (f"reduce's root {root} must have an output" if collective == "reduce" else
                 f"{collective} gives each of the {p} ranks an output")
        more = f"; {len(missing)} files are missing" if len(missing) > 1 else ""
        raise UsageError(f"{path / f'rank{missing[0]}.npy'}: missing; {whose}{more}")
    return [_as(_load(files[r]), files[r], dtype, "the inputs' dtype") if r in files else None
            for r in range(p)]


def load_case(in_dir, out_dir=None, *, collective: str = "allreduce", root: int = 0,
              op: str | None = None) -> tuple[list, list | None, dict]:
    """Read one case for ``refcoll oracle`` (inputs) or ``refcoll check`` (and outputs).

    Inputs: ``meta.json``'s ``p`` when present, else the files' (no gap); one dtype
    and one shape on every rank, agreeing with ``meta.json``'s ``dtype`` and
    ``count``. Outputs (when ``out_dir`` is given): no file beyond the inputs' ranks,
    one for every rank that the collective gives a result (reduce: only ``root``),
    each of the inputs' dtype (or its unsigned bits for bfloat16 and float8), and a
    ``meta.json``, if any, that names the same ``p``, dtype, collective, root and ``op``
    (compared when given). Shapes and values of the outputs are the judge's
    (:func:`refcoll.verify.oracle.check_outputs`), not a reading error.

    Returns:
        ``(inputs, outputs, meta)``: the input arrays by rank, the outputs by rank
        (None for a rank without one; ``None`` without ``out_dir``), and the inputs'
        ``meta.json`` with ``p``, ``dtype`` and ``count`` filled in from the files.

    Raises:
        UsageError: naming the file and the reason, for anything that makes the case
            impossible to judge.
    """
    inputs, meta = _load_inputs(in_dir)
    p = len(inputs)
    if root >= p:
        raise UsageError(f"--root {root} is not one of the {p} ranks (0 .. {p - 1})")
    if out_dir is None:
        return inputs, None, meta
    return inputs, _load_outputs(out_dir, inputs, collective=collective, root=root, op=op), meta
