"""Hostile inputs: refcoll run on files a careless or hostile user made, as a user would run it.

Run: python benchmarks/hostile_inputs.py [--json FILE] [--only WORD] [--limit-gb 4]

Each case builds its input in a fresh temporary folder (rank files that promise terabytes,
FIFOs, links to ``/dev/zero`` or to a file standing in for ``/etc/passwd``, JSON nested
100,000 deep, state files naming namespaces refcoll never made...), runs the ``refcoll``
command beside this Python on it, in a process limited to ``--limit-gb`` of address space
and 20 s, and reads back:

* the exit status, how many lines it wrote to stderr (a traceback is many), its wall
  time and its peak resident memory (``wait4``'s ``ru_maxrss``);
* whether anything it must leave alone changed: the bytes of a victim file, an input
  folder's files, a decoy network namespace (the cluster cases, as root only).

A refusal passes when it exits 2 with one line, within 1 s and 100 MB, and changes
nothing; a case that must succeed (writing through a folder that holds a planted link)
passes when it exits as the command documents and the victim is unchanged. The last line
counts both. The time and memory are figures of this machine, printed and never asserted
by a test; ``tests/test_hostile_*.py`` hold each row's behaviour.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REFCOLL = str(Path(sys.executable).with_name("refcoll"))
ROOT = os.geteuid() == 0 and shutil.which("ip") is not None


@dataclass
class Run:
    """One command to run on a built input, and what it must leave as it was."""

    argv: list[str]
    env: dict = field(default_factory=dict)
    cwd: str | None = None
    protect: list = field(default_factory=list)  # files and folders that must not change
    expect: int = 2  # the exit status a careful tool gives
    after: object = None  # a callable returning a problem (str) or None, run after
    cleanup: object = None


CASES: list[tuple[str, str, object]] = []


def case(row: str, name: str):
    """Register a builder ``fn(tmp: Path) -> Run`` for issue row ``row``."""
    def register(fn):
        CASES.append((row, name, fn))
        return fn
    return register


# ------------------------------------------------------------------ building blocks

def npy_header(shape, descr="<f4", version=(1, 0)) -> bytes:
    """Return a ``.npy`` header (any version) for ``shape``, with no data after it."""
    text = repr({"descr": descr, "fortran_order": False, "shape": tuple(shape)}).encode()
    prefix, width = (10, 2) if version == (1, 0) else (12, 4)
    text += b" " * (-(prefix + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY" + bytes(version) + len(text).to_bytes(width, "little") + text


def rank_folder(path: Path, p: int = 2, count: int = 4, dtype="float32") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for r in range(p):
        np.save(path / f"rank{r}.npy", np.arange(count, dtype=dtype) + r)
    return path


def victim(tmp: Path) -> Path:
    """A file standing in for one root must never overwrite (``/etc/passwd``)."""
    path = tmp / "victim"
    path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    return path


def check_with_meta(tmp: Path, meta: str | bytes) -> Run:
    inp = rank_folder(tmp / "in")
    (inp / "meta.json").write_bytes(meta.encode() if isinstance(meta, str) else meta)
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))], protect=[inp])


def check_with_rank(tmp: Path, data: bytes, rank: int = 1) -> Run:
    inp = rank_folder(tmp / "in")
    (inp / f"rank{rank}.npy").write_bytes(data)
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))], protect=[inp])


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def json_file(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------- rows 3, 4, 7: rank files

@case("3", "meta.json p = 10**9")
def _(tmp):
    return check_with_meta(tmp, '{"p": 1000000000}')


@case("3", "meta.json p = 10**7")
def _(tmp):
    return check_with_meta(tmp, '{"p": 10000000}')


@case("3", "rank0.npy beside rank999999999.npy")
def _(tmp):
    inp = rank_folder(tmp / "in", p=1)
    shutil.copy(inp / "rank0.npy", inp / "rank999999999.npy")
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))], protect=[inp])


@case("3", "outputs: rank0.npy beside rank999999999.npy")
def _(tmp):
    out = rank_folder(tmp / "out")
    shutil.copy(out / "rank0.npy", out / "rank999999999.npy")
    return Run(["check", str(rank_folder(tmp / "in")), str(out)], protect=[out])


@case("3", "outputs' meta.json p = 10**9")
def _(tmp):
    out = rank_folder(tmp / "out")
    (out / "meta.json").write_text('{"p": 1000000000}')
    return Run(["check", str(rank_folder(tmp / "in")), str(out)], protect=[out])


@case("4", "meta.json a link to /dev/zero")
def _(tmp):
    inp = rank_folder(tmp / "in")
    os.symlink("/dev/zero", inp / "meta.json")
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))])


@case("4", "meta.json a link to /dev/urandom")
def _(tmp):
    inp = rank_folder(tmp / "in")
    os.symlink("/dev/urandom", inp / "meta.json")
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))])


@case("4", "meta.json a FIFO")
def _(tmp):
    inp = rank_folder(tmp / "in")
    fifo(inp / "meta.json")
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))])


@case("4", "rank1.npy a FIFO")
def _(tmp):
    inp = rank_folder(tmp / "in")
    (inp / "rank1.npy").unlink()
    fifo(inp / "rank1.npy")
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))])


@case("4", "outputs' rank0.npy a link to /dev/zero")
def _(tmp):
    out = rank_folder(tmp / "out")
    (out / "rank0.npy").unlink()
    os.symlink("/dev/zero", out / "rank0.npy")
    return Run(["check", str(rank_folder(tmp / "in")), str(out)])


@case("4", "rank0.npy a folder")
def _(tmp):
    inp = rank_folder(tmp / "in")
    (inp / "rank0.npy").unlink()
    (inp / "rank0.npy").mkdir()
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))])


@case("4", "meta.json 1 GiB (sparse)")
def _(tmp):
    inp = rank_folder(tmp / "in")
    with open(inp / "meta.json", "wb") as fh:
        fh.truncate(1 << 30)
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))])


@case("4", "meta.json unreadable (mode 000, as another user)")
def _(tmp):
    inp = rank_folder(tmp / "in")
    (inp / "meta.json").write_text("{}")
    os.chmod(inp / "meta.json", 0)
    argv = ["check", str(inp), str(rank_folder(tmp / "out"))]
    if os.geteuid() == 0:  # root reads anything: run as nobody, who cannot
        os.chmod(tmp, 0o755)
        for sub in (inp, tmp / "out"):
            os.chmod(sub, 0o755)
            for f in sub.iterdir():
                if f.name != "meta.json":
                    os.chmod(f, 0o644)
        return Run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", REFCOLL,
                    *argv], env={"HOME": str(tmp)})
    return Run(argv)


@case("7", "meta.json nested 100,000 deep")
def _(tmp):
    return check_with_meta(tmp, '{"p": ' + "[" * 100_000 + "]" * 100_000 + "}")


@case("7", "meta.json a 5,000-digit integer")
def _(tmp):
    return check_with_meta(tmp, '{"count": ' + "9" * 5000 + "}")


@case("7", "meta.json 1e400 (overflows to infinity)")
def _(tmp):
    return check_with_meta(tmp, '{"count": 1e400}')


@case("7", "meta.json p NaN")
def _(tmp):
    return check_with_meta(tmp, '{"p": NaN}')


@case("7", "meta.json count Infinity")
def _(tmp):
    return check_with_meta(tmp, '{"count": Infinity}')


@case("7", "meta.json p -1")
def _(tmp):
    return check_with_meta(tmp, '{"p": -1}')


@case("7", "meta.json a list")
def _(tmp):
    return check_with_meta(tmp, "[1, 2]")


@case("7", "meta.json not UTF-8")
def _(tmp):
    return check_with_meta(tmp, b'{"dtype": "\xff"}')


@case("7", "meta.json empty")
def _(tmp):
    return check_with_meta(tmp, "")


@case("7", "meta.json dtype an object")
def _(tmp):
    return check_with_meta(tmp, '{"dtype": {"a": 1}}')


@case("7", ".npy dimension 2**64")
def _(tmp):
    return check_with_rank(tmp, npy_header((2**64,)))


@case("7", ".npy dimensions whose product passes 2**64")
def _(tmp):
    return check_with_rank(tmp, npy_header((2**40, 2**40)))


@case("7", ".npy v3.0 header promising 3.6 TiB")
def _(tmp):
    return check_with_rank(tmp, npy_header((2**40 - 1,), version=(3, 0)))


@case("7", ".npy v2.0 header promising 1 TiB")
def _(tmp):
    return check_with_rank(tmp, npy_header((2**38,), version=(2, 0)))


@case("7", ".npy v1.0 header promising 1 TiB")
def _(tmp):
    return check_with_rank(tmp, npy_header((2**38,)))


@case("7", ".npy version 9.9")
def _(tmp):
    return check_with_rank(tmp, npy_header((4,))[:6] + b"\x09\x09" + npy_header((4,))[8:])


@case("7", ".npy negative dimension")
def _(tmp):
    return check_with_rank(tmp, npy_header((-4,)))


@case("7", ".npy header not a dict")
def _(tmp):
    text = b"[1, 2, 3]" + b" " * 54 + b"\n"
    return check_with_rank(tmp, b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text)


@case("7", ".npy header length past the file")
def _(tmp):
    return check_with_rank(tmp, b"\x93NUMPY\x01\x00\xff\xff{")


@case("7", ".npy of Python objects (a pickle)")
def _(tmp):
    return check_with_rank(tmp, npy_header((1,), descr="|O") + b"\x80\x04N.")


@case("7", ".npy truncated")
def _(tmp):
    return check_with_rank(tmp, npy_header((1000,)) + b"\0" * 40)


@case("7", ".npy empty file")
def _(tmp):
    return check_with_rank(tmp, b"")


@case("7", ".npz where a .npy belongs")
def _(tmp):
    return check_with_rank(tmp, b"PK\x03\x04" + b"\0" * 60)


@case("7", "a sparse 1 TiB rank file that holds its array")
def _(tmp):
    inp = rank_folder(tmp / "in")
    with open(inp / "rank1.npy", "wb") as fh:
        head = npy_header((2**38,))
        fh.write(head)
        fh.truncate(len(head) + 4 * 2**38)
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))], protect=[inp])


@case("7", "ranks of mixed dtypes")
def _(tmp):
    inp = rank_folder(tmp / "in")
    np.save(inp / "rank1.npy", np.arange(4, dtype="float64"))
    return Run(["check", str(inp), str(rank_folder(tmp / "out"))])


@case("7", "input folder is a file")
def _(tmp):
    (tmp / "in").write_text("x")
    return Run(["check", str(tmp / "in"), str(rank_folder(tmp / "out"))])


# ------------------------------------------------------------ rows 5, 10, 11: writing

@case("5", "oracle IN OUT with OUT a link to IN")
def _(tmp):
    inp = rank_folder(tmp / "in", p=4)
    os.symlink(inp, tmp / "out")
    return Run(["oracle", "--algorithm", "ring", str(inp), str(tmp / "out")], protect=[inp])


@case("5", "oracle IN IN/./ (the same folder spelled twice)")
def _(tmp):
    inp = rank_folder(tmp / "in", p=4)
    return Run(["oracle", "--algorithm", "ring", str(inp), str(inp) + "/./"], protect=[inp])


@case("5", "oracle into OUT whose rank0.npy links to a victim")
def _(tmp):
    inp, bad = rank_folder(tmp / "in"), victim(tmp)
    (tmp / "out").mkdir()
    os.symlink(bad, tmp / "out" / "rank0.npy")
    return Run(["oracle", "--algorithm", "ring", str(inp), str(tmp / "out")],
               protect=[bad, inp], expect=0)


@case("5", "oracle into OUT whose meta.json links to a victim")
def _(tmp):
    inp, bad = rank_folder(tmp / "in"), victim(tmp)
    (tmp / "out").mkdir()
    os.symlink(bad, tmp / "out" / "meta.json")
    return Run(["oracle", "--algorithm", "ring", str(inp), str(tmp / "out")],
               protect=[bad, inp], expect=0)


@case("5", "oracle into OUT whose stale rank5.npy links to a victim")
def _(tmp):
    inp, bad = rank_folder(tmp / "in"), victim(tmp)
    (tmp / "out").mkdir()
    os.symlink(bad, tmp / "out" / "rank5.npy")
    return Run(["oracle", "--algorithm", "ring", str(inp), str(tmp / "out")],
               protect=[bad, inp], expect=0)


@case("5", "gen-inputs into a folder whose rank0.npy links to a victim")
def _(tmp):
    bad = victim(tmp)
    (tmp / "g").mkdir()
    os.symlink(bad, tmp / "g" / "rank0.npy")
    return Run(["gen-inputs", "-p", "2", "--count", "4", str(tmp / "g")], protect=[bad], expect=0)


@case("5", "check --json FILE where FILE links to a victim")
def _(tmp):
    bad = victim(tmp)
    os.symlink(bad, tmp / "report.json")
    inp = rank_folder(tmp / "in")
    return Run(["oracle", "--algorithm", "ring", str(inp), str(tmp / "out")],
               protect=[bad], expect=0,
               after=lambda: _run_ok(["check", "--algorithm", "ring",
                                      "--json", str(tmp / "report.json"),
                                      str(inp), str(tmp / "out")], bad))


def _run_ok(argv, bad: Path):
    done = subprocess.run([REFCOLL, *argv], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return f"check --json exited {done.returncode}: {done.stderr.strip()[-200:]}"
    if not (bad.parent / "report.json").is_file() or (bad.parent / "report.json").is_symlink():
        return "the report did not replace the link"
    return None


@case("5", "tune -o FILE where FILE links to a victim")
def _(tmp):
    bad = victim(tmp)
    os.symlink(bad, tmp / "tuning.json")
    report = json_file(tmp / "bench.json", json.dumps(bench_report(
        [{"size": 1024, "algorithm": "ring", "time_us": 10.0, "wrong": 0}])))
    return Run(["tune", "-o", str(tmp / "tuning.json"), report], protect=[bad], expect=0)


@case("10", "gen-inputs -p 200000 --count 0")
def _(tmp):
    return Run(["gen-inputs", "-p", "200000", "--count", "0", str(tmp / "g")],
               after=lambda: "files written" if (tmp / "g").exists()
               and any((tmp / "g").iterdir()) else None)


@case("10", "oracle on 5,000 one-element rank files")
def _(tmp):
    inp = tmp / "in"
    inp.mkdir()
    one = npy_header((1,)) + b"\0" * 4
    for r in range(5000):
        (inp / f"rank{r}.npy").write_bytes(one)
    return Run(["oracle", "--algorithm", "ring", str(inp), str(tmp / "out")])


@case("10", "simulate -p 10**6")
def _(tmp):
    return Run(["simulate", "--algorithm", "ring", "-p", "1000000", "--count", "1"])


@case("11", "vectors DIR on a folder of other .npz files")
def _(tmp):
    folder = tmp / "v"
    folder.mkdir()
    np.savez(folder / "weights.npz", a=np.arange(3))
    (folder / "notes.txt").write_text("mine\n")
    return Run(["vectors", str(folder)], protect=[folder])


@case("9", "vectors --verify: a manifest naming /etc/passwd")
def _(tmp):
    folder, bad = tmp / "v", victim(tmp)
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "count": 1, "vectors": [
        {"file": str(bad), "sha256": "0" * 64}]}))
    return Run(["vectors", "--verify", str(folder)], protect=[bad])


@case("9", "vectors --verify: a manifest naming ../victim")
def _(tmp):
    folder = tmp / "v"
    victim(tmp)
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "count": 1, "vectors": [
        {"file": "../victim", "sha256": "0" * 64}]}))
    return Run(["vectors", "--verify", str(folder)])


@case("9", "vectors --verify: a manifest nested deep")
def _(tmp):
    folder = tmp / "v"
    folder.mkdir()
    (folder / "manifest.json").write_text("[" * 50_000 + "]" * 50_000)
    return Run(["vectors", "--verify", str(folder)])


@case("9", "vectors --verify: manifest.json a FIFO")
def _(tmp):
    folder = tmp / "v"
    folder.mkdir()
    fifo(folder / "manifest.json")
    return Run(["vectors", "--verify", str(folder)])


# ------------------------------------------------------- rows 4, 8, 9: tuning, model, env

def bench_report(rows) -> dict:
    """Return a ``refcoll bench --json`` report of 2 ranks on one host holding ``rows``."""
    return {"header": {"collective": "allreduce", "workers": 2, "dtype": "float32",
                       "ranks": [{"rank": r, "host": "a"} for r in range(2)]}, "rows": rows}


def _report(tmp: Path, rows) -> str:
    return json_file(tmp / "bench.json", json.dumps(bench_report(rows)))


@case("9", "tune on a report whose rows are numbers")
def _(tmp):
    return Run(["tune", "-o", str(tmp / "t.json"), _report(tmp, [1, 2, 3])])


@case("9", "tune on a report whose row lacks algorithm")
def _(tmp):
    return Run(["tune", "-o", str(tmp / "t.json"),
                _report(tmp, [{"collective": "allreduce", "size": 8, "time_us": 1.0}])])


@case("9", "tune on a report with a 10**400-byte size")
def _(tmp):
    text = json.dumps(bench_report([{"algorithm": "ring", "size": 0, "time_us": 1.0}]))
    text = text.replace('"size": 0', '"size": 1' + "0" * 400)
    return Run(["tune", "-o", str(tmp / "t.json"), json_file(tmp / "bench.json", text)])


@case("9", "tune on /dev/zero")
def _(tmp):
    return Run(["tune", "-o", str(tmp / "t.json"), "/dev/zero"])


@case("9", "tune on a FIFO")
def _(tmp):
    return Run(["tune", "-o", str(tmp / "t.json"), str(fifo(tmp / "bench.json"))])


@case("4", "REFCOLL_TUNING_FILE=/dev/zero")
def _(tmp):
    return Run(["simulate", "--algorithm", "auto", "-p", "4", "--count", "64"],
               env={"REFCOLL_TUNING_FILE": "/dev/zero"})


@case("4", "REFCOLL_TUNING_FILE a FIFO")
def _(tmp):
    return Run(["simulate", "--algorithm", "auto", "-p", "4", "--count", "64"],
               env={"REFCOLL_TUNING_FILE": str(fifo(tmp / "tuning.json"))})


@case("4", "REFCOLL_TUNING_FILE nested deep")
def _(tmp):
    path = json_file(tmp / "tuning.json", "[" * 100_000 + "]" * 100_000)
    return Run(["simulate", "--algorithm", "auto", "-p", "4", "--count", "64"],
               env={"REFCOLL_TUNING_FILE": path})


@case("8", "REFCOLL_TIMEOUT=nan")
def _(tmp):
    return Run(["verify", "-n", "1", "--algorithm", "ring"], env={"REFCOLL_TIMEOUT": "nan"})


@case("8", "REFCOLL_TIMEOUT=-5")
def _(tmp):
    return Run(["verify", "-n", "1", "--algorithm", "ring"], env={"REFCOLL_TIMEOUT": "-5"})


def topology(tmp: Path, rate: float = 1e9, racks=()) -> str:
    """Write a topology of two nodes (``refcoll cluster``'s format); return its path."""
    topo = {"version": 1, "source": "hostile", "link_latency_s": 0,
            "nodes": [{"host": h, "rack": 1, "ranks": 2, "link_bits_per_s": r}
                      for h, r in (("a", rate), ("b", 1e9))],
            "racks": [{"rack": r, "uplink_bits_per_s": 1e9} for r in racks]}
    return json_file(tmp / "t.json", json.dumps(topo))


@case("9", "model --topology: a link rate NaN")
def _(tmp):
    return Run(["model", "--topology", topology(tmp, float("nan")), "--params", "1000"])


@case("12", "model --topology: a link rate 1e-300")
def _(tmp):
    return Run(["model", "--topology", topology(tmp, 1e-300), "--params", "1000"])


@case("9", "model --topology: an uplink for an empty rack")
def _(tmp):
    return Run(["model", "--topology", topology(tmp, racks=(1, 7)), "--params", "1000"])


@case("9", "model --topology: nested JSON")
def _(tmp):
    return Run(["model", "--topology", json_file(tmp / "t.json", "[" * 100_000 + "]" * 100_000),
                "--params", "1000"])


@case("9", "model --topology /dev/zero")
def _(tmp):
    return Run(["model", "--topology", "/dev/zero", "--params", "1000"])


@case("9", "model --from-calibration: nodes NaN")
def _(tmp):
    return Run(["model", "--from-calibration",
                json_file(tmp / "c.json", '{"alpha": 1e-6, "beta": 1e-9, "nodes": NaN}'),
                "--params", "1000"])


@case("9", "model --from-calibration a FIFO")
def _(tmp):
    return Run(["model", "--from-calibration", str(fifo(tmp / "c.json")), "--params", "1000"])


#: A described cluster for the --layers cases (the seeds' example, no search).
SMALL = ["--preset", "seed", "--no-search"]


@case("9", "model --layers not UTF-8")
def _(tmp):
    (tmp / "layers.json").write_bytes(b"[[1024, \xff\xfe]]")
    return Run(["model", "--layers", str(tmp / "layers.json"), *SMALL])


@case("9", "model --layers nested deep")
def _(tmp):
    return Run(["model", "--layers", json_file(tmp / "l.json", "[" * 100_000 + "]" * 100_000),
                *SMALL])


@case("9", "model --layers a negative shape")
def _(tmp):
    return Run(["model", "--layers", json_file(tmp / "l.json", "[[1024, -4096]]"), *SMALL])


@case("9", "a calibration cache with per_node: Infinity, then refcoll list")
def _(tmp):
    cache = tmp / "cache"
    cache.mkdir()
    (cache / "calibration.json").write_text('{"entries": {"x": {"per_node": Infinity}}}')
    return Run(["list"], env={"REFCOLL_CACHE": str(cache)}, expect=0)


# --------------------------------------------------------- rows 1, 2, 12: the cluster

def _cluster_dir(tmp: Path) -> Path:
    folder = tmp / "clusters"
    folder.mkdir(mode=0o755)
    return folder


def _decoy() -> str:
    name = f"decoy{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    return name


def _decoy_run(tmp: Path, state: dict, *, mode: int = 0o644, name: str | None = None,
               force: bool = False) -> Run:
    folder = _cluster_dir(tmp)
    decoy = _decoy()
    keep = tmp / "keep"
    keep.mkdir()
    (keep / "file").write_text("mine\n")
    state = json.loads(json.dumps(state).replace("DECOY", decoy).replace("KEEP", str(keep)))
    path = folder / (name or f"{state.get('prefix', 'rc000000')}.json")
    path.write_text(json.dumps(state))
    os.chmod(path, mode)

    def survived():
        have = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        gone = [] if decoy in have else [f"namespace {decoy}"]
        gone += [] if (keep / "file").exists() else [str(keep)]
        return f"removed {', '.join(gone)}" if gone else None

    def cleanup():
        subprocess.run(["ip", "netns", "del", decoy], capture_output=True)

    return Run(["cluster", "down"] + (["--force"] if force else []),
               env={"REFCOLL_CLUSTER_DIR": str(folder)}, after=survived, cleanup=cleanup)


def _escape(tmp: Path) -> str:
    return os.path.relpath(tmp / "keep", "/etc/netns")


if ROOT:
    @case("1", "state file: prefix cni naming a decoy and a path out of /etc/netns")
    def _(tmp):
        return _decoy_run(tmp, {"prefix": "cni", "owner": None,
                                "namespaces": ["DECOY", _escape(tmp)]}, name="rc0000aa.json")

    @case("1", "state file: refcoll's prefix naming a decoy namespace")
    def _(tmp):
        return _decoy_run(tmp, {"prefix": "rc0000ab", "owner": None,
                                "namespaces": ["rc0000ab-hub", "DECOY"]})

    @case("1", "state file: a namespace ../../ out of /etc/netns")
    def _(tmp):
        return _decoy_run(tmp, {"prefix": "rc0000ac", "owner": None,
                                "namespaces": [_escape(tmp), "DECOY"]})

    @case("1", "state file: writable by everyone")
    def _(tmp):
        return _decoy_run(tmp, {"prefix": "rc0000ad", "owner": None,
                                "namespaces": ["DECOY"]}, mode=0o666)

    @case("1", "state file: owned by another user")
    def _(tmp):
        run = _decoy_run(tmp, {"prefix": "rc0000ae", "owner": None, "namespaces": ["DECOY"]})
        os.chown(Path(run.env["REFCOLL_CLUSTER_DIR"]) / "rc0000ae.json", 65534, 65534)
        return run

    @case("1", "state file: a link to a state file elsewhere")
    def _(tmp):
        run = _decoy_run(tmp, {"prefix": "rc0000af", "owner": None, "namespaces": ["DECOY"]},
                         name="elsewhere.json")
        folder = Path(run.env["REFCOLL_CLUSTER_DIR"])
        os.symlink(folder / "elsewhere.json", folder / "rc0000af.json")
        return run

    @case("1", "state file: a link to /dev/zero")
    def _(tmp):
        folder = _cluster_dir(tmp)
        os.symlink("/dev/zero", folder / "rc0000b0.json")
        return Run(["cluster", "down"], env={"REFCOLL_CLUSTER_DIR": str(folder)})

    @case("1", "state file: nested 100,000 deep")
    def _(tmp):
        folder = _cluster_dir(tmp)
        (folder / "rc0000b1.json").write_text("[" * 100_000 + "]" * 100_000)
        return Run(["cluster", "status"], env={"REFCOLL_CLUSTER_DIR": str(folder)})

    @case("1", "cluster folder writable by everyone")
    def _(tmp):
        run = _decoy_run(tmp, {"prefix": "rc0000b2", "owner": None, "namespaces": ["DECOY"]})
        os.chmod(run.env["REFCOLL_CLUSTER_DIR"], 0o777)
        return run

    @case("2", "down while a live job's cluster is up (no --force)")
    def _(tmp):
        run = _decoy_run(tmp, {"prefix": "rc0000b3", "owner": os.getpid(),
                               "namespaces": ["rc0000b3-hub"]})
        run.expect = 0  # nothing to remove: it says the live one is left
        run.after = _left(Path(run.env["REFCOLL_CLUSTER_DIR"]) / "rc0000b3.json", run.after)
        return run

    @case("12", "cluster up --nodes 300")
    def _(tmp):
        return Run(["cluster", "up", "--nodes", "300"],
                   env={"REFCOLL_CLUSTER_DIR": str(_cluster_dir(tmp))})

    @case("12", "cluster up --oversubscription nan")
    def _(tmp):
        return Run(["cluster", "up", "--racks", "2", "--oversubscription", "nan"],
                   env={"REFCOLL_CLUSTER_DIR": str(_cluster_dir(tmp))})

    @case("12", "cluster up --link 1e-300bit")
    def _(tmp):
        return Run(["cluster", "up", "--link", "1e-300bit"],
                   env={"REFCOLL_CLUSTER_DIR": str(_cluster_dir(tmp))})

    @case("12", "cluster up --link nanbit")
    def _(tmp):
        return Run(["cluster", "up", "--link", "nanbit"],
                   env={"REFCOLL_CLUSTER_DIR": str(_cluster_dir(tmp))})

    @case("12", "cluster up --delay 1e300s")
    def _(tmp):
        return Run(["cluster", "up", "--delay", "1e300s"],
                   env={"REFCOLL_CLUSTER_DIR": str(_cluster_dir(tmp))})


def _left(state: Path, before):
    def check():
        problem = before()
        return problem or (None if state.exists() else "removed the live cluster's state")
    return check


# --------------------------------------------------------------- row 6: the import path

@case("6", "a ./refcoll/ planted where verify -n 2 runs")
def _(tmp):
    planted = tmp / "refcoll"
    planted.mkdir()
    marker = tmp / "planted-ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (planted / "__main__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return Run(["verify", "-n", "2", "--algorithm", "ring", "--sizes", "1"], cwd=str(tmp),
               expect=0, after=lambda: "the planted package ran" if marker.exists() else None)


# ------------------------------------------------------------------------- running

def snapshot(paths) -> dict:
    """Return each protected path's bytes' digest (a folder: each file's, by name)."""
    out = {}
    for path in map(Path, paths):
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for f in files:
            if f.is_symlink() or not f.is_file():
                out[str(f)] = "link" if f.is_symlink() else "other"
                continue
            try:
                info = f.stat()
                if info.st_size > 64 << 20:  # a sparse terabyte: its size and time stand in
                    out[str(f)] = f"{info.st_size} {info.st_mtime_ns}"
                else:
                    out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
            except OSError:
                out[str(f)] = "unreadable"
    return out


def run_case(run: Run, limit_bytes: int, timeout: float) -> dict:
    argv = run.argv if run.argv[0].startswith("/") or run.argv[0] == "setpriv" else [REFCOLL,
                                                                                     *run.argv]
    env = {**os.environ, **run.env}

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
        os.setsid()

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        child = subprocess.Popen(argv, env=env, cwd=run.cwd, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=err, preexec_fn=limit)
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                os.killpg(child.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(child.pid, 0)
                status = None
                break
            time.sleep(0.005)
        seconds = time.perf_counter() - start
        child.returncode = 0  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    code = None if status is None else os.waitstatus_to_exitcode(status)
    lines = [line for line in stderr.splitlines() if line.strip()]
    return {"exit": code, "lines": len(lines), "first": lines[0][:160] if lines else "",
            "seconds": seconds, "mb": usage.ru_maxrss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write every case's figures here")
    parser.add_argument("--only", help="run the cases whose name holds this word")
    parser.add_argument("--limit-gb", type=float, default=4.0)
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    results, refusals, refused_ok, safe, safe_ok = [], 0, 0, 0, 0
    if not ROOT:
        print("# not root (or no ip): the cluster cases are left out")
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; each case under "
          f"{args.limit_gb:g} GB of address space and {args.timeout:g} s")
    print(f"{'row':>3} {'exit':>4} {'lines':>5} {'s':>6} {'MB':>6}  verdict  case: first line")
    for row, name, build in CASES:
        if args.only and args.only not in name:
            continue
        tmp = Path(tempfile.mkdtemp(prefix="refcoll-hostile-"))
        run = None
        try:
            run = build(tmp)
            before = snapshot(run.protect)
            got = run_case(run, int(args.limit_gb * 2**30), args.timeout)
            problems = []
            if snapshot(run.protect) != before:
                problems.append("a protected file changed")
            if run.after is not None:
                said = run.after()
                if said:
                    problems.append(said)
            if run.expect == 2:
                refusals += 1
                good = (got["exit"] == 2 and got["lines"] == 1 and got["seconds"] <= 1.0
                        and got["mb"] <= 100 and not problems)
                refused_ok += good
            else:
                safe += 1
                good = got["exit"] == run.expect and not problems
                safe_ok += good
            verdict = "ok" if good else "FAIL"
            print(f"{row:>3} {got['exit']!s:>4} {got['lines']:>5} {got['seconds']:6.2f} "
                  f"{got['mb']:6.0f}  {verdict:7}  {name}: {got['first']}"
                  + (f" [{'; '.join(problems)}]" if problems else ""), flush=True)
            results.append({"row": row, "case": name, "expect": run.expect, **got,
                            "problems": problems, "ok": bool(good)})
        finally:
            if run is not None and run.cleanup is not None:
                run.cleanup()
            subprocess.run(["chmod", "-R", "u+rwX", str(tmp)], capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"refusals: {refused_ok} of {refusals} end in one line and exit 2 within 1 s and "
          f"100 MB, changing nothing; writes through planted links and other safe runs: "
          f"{safe_ok} of {safe} as documented; {len(results)} hostile inputs in all")
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": results}, indent=1) + "\n")
    return 0 if refused_ok == refusals and safe_ok == safe else 1


if __name__ == "__main__":
    sys.exit(main())
