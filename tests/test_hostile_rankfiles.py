"""Hostile rank files, meta.json, output folders and golden vectors: one line, exit 2.

Each case builds its hostile input in ``tmp_path`` (tiny files: headers that *promise*
huge sizes, sparse files, FIFOs, links, deep JSON), runs ``refcoll`` in-process through
click's runner and requires exit 2, one line on stderr (no traceback), and nothing
changed in ``tmp_path`` (every file's bytes and every link's target as they were, a
victim file outside the folders included). A SIGALRM deadline fails a case that
blocks (a FIFO opened for reading) or loops over a huge ``p``; tracemalloc's peak
(NumPy reports its allocations to it) bounds the memory a refusal may take.
"""

from __future__ import annotations

import io
import json
import os
import signal
import stat
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_check_files import assert_refused  # the one check of a one-line refusal

from refcoll.cli import main
from refcoll.core import reading
from refcoll.core.errors import UsageError
from refcoll.verify import vectors as golden
from refcoll.verify.identify import known_orders

P, N = 4, 8
DEADLINE_S = 10
PEAK_BYTES = 100 << 20
COMMITTED = Path(__file__).resolve().parent.parent / "spec" / "vectors"


# ------------------------------------------------------------------------ harness

class Deadline(Exception):
    """A command ran past :data:`DEADLINE_S` (blocked on a FIFO, looped over p)."""


@pytest.fixture
def deadline():
    """Raise :class:`Deadline` inside whatever runs past DEADLINE_S seconds."""
    def expire(signum, frame):
        raise Deadline(f"still running after {DEADLINE_S} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(DEADLINE_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def invoke(*args):
    """Run refcoll in-process; return the result and tracemalloc's peak during the run."""
    tracemalloc.start()
    try:
        res = CliRunner().invoke(main, [str(a) for a in args])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return res, peak


def snapshot(root: Path) -> dict:
    """Every entry under ``root``, links not followed: its kind, a link's target, a file's bytes.

    Only regular files are opened (a large or sparse one is known by its size and time).
    """
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                seen[path] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                content = (Path(path).read_bytes() if info.st_size <= 1 << 20
                           else info.st_mtime_ns)
                seen[path] = ("file", info.st_size, content)
            else:
                seen[path] = (stat.S_IFMT(info.st_mode),)
    return seen


def refused(tmp: Path, *args, needles=()):
    """Run ``args``; require exit 2, one line naming every needle, nothing changed, bounds."""
    before = snapshot(tmp)
    res, peak = invoke(*args)
    line = assert_refused(res, *needles)
    assert peak < PEAK_BYTES, f"the refusal took {peak / 2**20:.0f} MiB"
    assert snapshot(tmp) == before, "a refused command changed files"
    return line


def good_case(tmp: Path) -> tuple[Path, Path]:
    """Inputs of P ranks and the ring's outputs, as refcoll writes them, and a victim file."""
    (tmp / "victim.txt").write_text("precious")
    for args in (["gen-inputs", "-p", P, "--count", N, tmp / "in"],
                 ["oracle", "--algorithm", "ring", tmp / "in", tmp / "out"]):
        res = CliRunner().invoke(main, [str(a) for a in args])
        assert res.exit_code == 0, res.output
    return tmp / "in", tmp / "out"


def npy(version: int, header: str, data: bytes = b"") -> bytes:
    """Return a .npy file of format ``version`` with ``header`` (a dict's text) and ``data``."""
    text = header.encode("utf-8" if version == 3 else "latin1")
    size = struct.pack("<H", len(text)) if version == 1 else struct.pack("<I", len(text))
    return b"\x93NUMPY" + bytes([version, 0]) + size + text + data


def promise(shape: str, descr: str = "<f4", version: int = 1) -> bytes:
    return npy(version, f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}")


def _put(path: Path, make) -> None:
    """Replace ``path`` (a file) with what ``make(path)`` creates."""
    path.unlink()
    make(path)


def _link_to(target):
    return lambda path: os.symlink(target, path)


# ------------------------------------------------------------ files check/oracle refuse

def _meta(folder: str, text: str):
    return lambda tmp: (tmp / folder / "meta.json").write_text(text)


def _rank(folder: str, r: int, data: bytes):
    return lambda tmp: (tmp / folder / f"rank{r}.npy").write_bytes(data)


def _special(folder: str, name: str, make):
    return lambda tmp: _put(tmp / folder / name, make)


def _save(folder: str, r: int, array):
    return lambda tmp: np.save(tmp / folder / f"rank{r}.npy", array)


def _then(*steps):
    def run(tmp):
        for step in steps:
            step(tmp)
    return run


#: name: (spoil the good case, the file the line names, what it says)
FILES = {
    # row 3: a huge world, refused from meta.json or the listing, never range(p)
    "in-meta-p-1e9": (_meta("in", '{"p": 1000000000}'), "in/meta.json", "at most 4096"),
    "out-meta-p-1e9": (_meta("out", '{"p": 1000000000}'), "out/meta.json", "at most 4096"),
    "in-rank-999999999-no-meta": (_then(_save("in", 999999999, np.zeros(N, np.float32)),
                                        lambda tmp: (tmp / "in" / "meta.json").unlink()),
                                  "in/rank999999999.npy", "beyond the 4096 ranks"),
    "in-rank-999999999-meta-p4": (_save("in", 999999999, np.zeros(N, np.float32)),
                                  "in/rank999999999.npy", "p = 4"),
    "out-rank-999999999": (_save("out", 999999999, np.zeros(N, np.float32)),
                           "out/rank999999999.npy", "beyond the inputs' 4 ranks"),
    "out-two-missing": (_then(lambda tmp: (tmp / "out" / "rank1.npy").unlink(),
                              lambda tmp: (tmp / "out" / "rank2.npy").unlink()),
                        "out/rank1.npy", "2 files are missing"),
    # row 4: only regular files of bounded size
    "in-meta-dev-zero": (_special("in", "meta.json", _link_to("/dev/zero")), "in/meta.json",
                         "character device"),
    "in-meta-fifo": (_special("in", "meta.json", os.mkfifo), "in/meta.json", "FIFO"),
    "in-meta-folder": (_special("in", "meta.json", os.mkdir), "in/meta.json", "folder"),
    "in-meta-dangling": (_special("in", "meta.json", _link_to("nowhere")), "in/meta.json",
                         "does not exist"),
    "in-meta-2-MiB": (_meta("in", '{"p": 4, "x": "' + "a" * (2 << 20) + '"}'), "in/meta.json",
                      "more than the 1048576"),
    "in-rank-fifo": (_special("in", "rank1.npy", os.mkfifo), "in/rank1.npy", "FIFO"),
    "out-rank-fifo": (_special("out", "rank2.npy", os.mkfifo), "out/rank2.npy", "FIFO"),
    "out-rank-dev-zero": (_special("out", "rank1.npy", _link_to("/dev/zero")), "out/rank1.npy",
                          "character device"),
    "in-rank-folder": (_special("in", "rank1.npy", os.mkdir), "in/rank1.npy", "folder"),
    # row 7: JSON and .npy headers beyond bounds
    "in-meta-nested-100000": (_meta("in", "[" * 100_000 + "]" * 100_000), "in/meta.json",
                              "nests deeper"),
    "in-meta-5000-digits": (_meta("in", '{"p": ' + "9" * 5000 + "}"), "in/meta.json",
                            "5000 digits"),
    "in-meta-nan": (_meta("in", '{"count": NaN}'), "in/meta.json", "NaN"),
    "in-meta-inf": (_meta("in", '{"count": 1e999}'), "in/meta.json", "1e999"),
    "out-meta-newline-name": (_meta("out", json.dumps({"collective": "all\nreduce\x1b[2J"})),
                              "out/meta.json", "collective must be a name"),
    "in-npy-dim-2-64": (_rank("in", 1, promise("(18446744073709551616,)")), "in/rank1.npy",
                        "73786976294838206464 bytes"),
    "in-npy-dims-overflow-int64": (_rank("in", 1, promise("(4294967296, 4294967296)")),
                                   "in/rank1.npy", "promises 73786976294838206464"),
    "in-npy-v3-3.6-TiB": (_rank("in", 1, promise("(1000000000000,)", version=3)),
                          "in/rank1.npy", "promises 4000000000000 bytes"),
    "out-npy-v2-3.6-TiB": (_rank("out", 1, promise("(1000000000000,)", version=2)),
                           "out/rank1.npy", "promises 4000000000000 bytes"),
    "in-npy-version-9": (_rank("in", 1, b"\x93NUMPY\x09\x00" + bytes(20)), "in/rank1.npy",
                         "version 9.0"),
    "in-npy-header-4-GiB": (_rank("in", 1, b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**32 - 1)),
                            "in/rank1.npy", "4294967295 bytes"),
    "in-npy-header-code": (_rank("in", 1, npy(1, "__import__('os').remove('victim.txt')")),
                           "in/rank1.npy", "not a dict of plain values"),
    "in-npy-header-5000-digit-dim": (_rank("in", 1, promise("(" + "9" * 5000 + ",)")),
                                     "in/rank1.npy", "40 digits"),
    "in-npy-negative-dim": (_rank("in", 1, promise("(-8,)")), "in/rank1.npy", "(-8,)"),
    "in-rank-leading-zero": (lambda tmp: np.save(tmp / "in" / "rank03.npy", np.ones(2)),
                             "in/rank03.npy", "without leading zeros (rank3.npy)"),
    "out-rank-leading-zero": (lambda tmp: np.save(tmp / "out" / "rank00.npy", np.ones(2)),
                              "out/rank00.npy", "without leading zeros (rank0.npy)"),
    "in-npy-65-dims": (_rank("in", 1, promise("(" + "1, " * 65 + ")") + bytes(4)),
                       "in/rank1.npy", "65 dimensions"),
    "in-npy-empty-with-a-2-70-dim": (_rank("in", 1, promise(f"(0, {2**70})")), "in/rank1.npy",
                                     "fewer than 2**63 bytes"),
    "in-npy-zero-byte-items": (_rank("in", 1, promise("(18446744073709551616,)", "|S0")),
                               "in/rank1.npy", "0 bytes"),
    "in-npy-bad-descr": (_rank("in", 1, promise("(1,)", "V99999999999999")), "in/rank1.npy",
                         "descr"),
}


@pytest.mark.parametrize("case", FILES)
def test_check_refuses_a_hostile_file(tmp_path, deadline, case):
    spoil, name, reason = FILES[case]
    in_dir, out_dir = good_case(tmp_path)
    spoil(tmp_path)
    refused(tmp_path, "check", in_dir, out_dir, needles=[tmp_path / name, reason])
    if name.startswith("in/"):  # the oracle reads the same inputs, and writes nothing
        refused(tmp_path, "oracle", "--algorithm", "ring", in_dir, tmp_path / "predicted",
                needles=[tmp_path / name, reason])


def test_an_input_folder_that_is_a_fifo_is_refused(tmp_path, deadline):
    os.mkfifo(tmp_path / "in")
    (tmp_path / "out").mkdir()
    refused(tmp_path, "check", tmp_path / "in", tmp_path / "out",
            needles=[tmp_path / "in", "not a folder"])


def test_more_rank_files_than_a_world_may_have_are_refused_at_once(tmp_path, deadline):
    (tmp_path / "in").mkdir()
    one = np.lib.format.magic(1, 0)  # the listing refuses before any file is read
    for r in range(4097):
        (tmp_path / "in" / f"rank{r}.npy").write_bytes(one)
    line = refused(tmp_path, "oracle", "--algorithm", "ring", tmp_path / "in",
                   tmp_path / "out", needles=["more than 4096 rank<r>.npy files"])
    assert str(tmp_path / "in") in line


def test_a_sparse_file_larger_than_memory_is_refused_before_it_is_read(tmp_path, deadline):
    """Beside smaller ranks, its header is refused against theirs; where every rank is
    that large, a whole-array command (auto's oracle under a tuning file) refuses it by
    the memory it needs, and an oracle that streams by the disk its outputs need (each
    before reading an element)."""
    in_dir, out_dir = good_case(tmp_path)
    count = 1 << 40  # 4 TiB of float32, on no disk blocks
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False,
                                                "shape": (count,)})

    def sparse(r):
        with open(in_dir / f"rank{r}.npy", "wb") as fh:
            fh.write(head.getvalue())
            try:
                fh.truncate(len(head.getvalue()) + 4 * count)
            except OSError as exc:
                pytest.skip(f"this file system has no sparse 4 TiB file ({exc})")
    sparse(1)
    try:
        first = np.load(in_dir / "rank0.npy", mmap_mode="r").size
        refused(tmp_path, "check", in_dir, out_dir,
                needles=[f"rank1.npy: holds {count} elements, rank0.npy holds {first}"])
        refused(tmp_path, "check", "--algorithm", "ring", in_dir, out_dir,
                needles=[f"rank1.npy: holds {count} elements"])
        refused(tmp_path, "oracle", "--algorithm", "ring", in_dir, tmp_path / "predicted",
                needles=[f"rank1.npy: holds {count} elements"])
        for r in range(P):
            sparse(r)
        (in_dir / "meta.json").unlink()  # the files alone define the world
        refused(tmp_path, "oracle", "--algorithm", "tree", in_dir, tmp_path / "predicted",
                needles=["writing 4 expected outputs needs about", "TiB of disk"])
        refused(tmp_path, "oracle", "--algorithm", "tree", "--collective", "reduce", in_dir,
                tmp_path / "predicted", needles=["writing 1 expected output needs about"])
        refused(tmp_path, "oracle", "--algorithm", "ring", "--collective", "reduce_scatter",
                in_dir, tmp_path / "predicted",
                needles=["writing 4 expected outputs needs about 4.0 TiB of disk"])
        with pytest.MonkeyPatch.context() as m:  # auto under a tuning file's rules: simulated
            m.setenv("REFCOLL_TUNING_FILE", str(tmp_path / "tuning.json"))
            refused(tmp_path, "oracle", "--algorithm", "auto", in_dir, tmp_path / "predicted",
                    needles=["reading the rank files", "needs about", "TiB"])
    finally:
        for r in range(P):
            (in_dir / f"rank{r}.npy").unlink(missing_ok=True)


def test_every_npy_version_and_layout_is_still_read(tmp_path, deadline):
    """Formats 2.0 and 3.0, big-endian and Fortran-ordered arrays are judged, not refused."""
    in_dir, out_dir = good_case(tmp_path)
    for r, version in ((1, (2, 0)), (2, (3, 0))):
        x = np.load(in_dir / f"rank{r}.npy")
        buffer = io.BytesIO()
        np.lib.format.write_array(buffer, x, version=version)
        (in_dir / f"rank{r}.npy").write_bytes(buffer.getvalue())
    np.save(in_dir / "rank3.npy", np.load(in_dir / "rank3.npy").astype(">f4"))
    res, _ = invoke("check", "--algorithm", "ring", in_dir, out_dir)
    assert res.exit_code == 0 and "verdict: conforming" in res.output, res.output
    (tmp_path / "f").mkdir()
    for r in range(3):
        np.save(tmp_path / "f" / f"rank{r}.npy",
                np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3) + r))
    res, _ = invoke("oracle", "--algorithm", "ring", tmp_path / "f", tmp_path / "g")
    assert res.exit_code == 0, res.output


# ------------------------------------------------------------------ the writers

def test_oracle_refuses_an_out_dir_that_links_to_its_inputs(tmp_path, deadline):
    in_dir, _ = good_case(tmp_path)
    os.symlink(in_dir, tmp_path / "outlink")
    refused(tmp_path, "oracle", "--algorithm", "ring", in_dir, tmp_path / "outlink",
            needles=["is IN_DIR", "overwrite the inputs"])


def test_oracle_replaces_links_in_out_dir_and_never_writes_through_them(tmp_path, deadline):
    in_dir, out_dir = good_case(tmp_path)
    victim = tmp_path / "victim.txt"
    for name in ("rank0.npy", "meta.json"):
        _put(out_dir / name, _link_to(victim))
    os.symlink(victim, out_dir / "rank7.npy")  # stale: beyond the new world
    res, _ = invoke("oracle", "--algorithm", "ring", in_dir, out_dir)
    assert res.exit_code == 0, res.output
    assert victim.read_text() == "precious"
    assert not (out_dir / "rank0.npy").is_symlink() and not (out_dir / "meta.json").is_symlink()
    assert not os.path.lexists(out_dir / "rank7.npy")
    assert sorted(os.listdir(out_dir)) == ["meta.json"] + [f"rank{r}.npy" for r in range(P)]


def test_gen_inputs_replaces_links_and_removes_stale_ones_not_their_targets(tmp_path, deadline):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "g").mkdir()
    os.symlink(victim, tmp_path / "g" / "rank0.npy")
    os.symlink(victim, tmp_path / "g" / "rank9.npy")
    os.symlink(victim, tmp_path / "g" / "meta.json")  # as if refcoll's world: not refused
    res, _ = invoke("gen-inputs", "-p", 2, "--count", 3, tmp_path / "g")
    assert res.exit_code == 0, res.output
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(tmp_path / "g")) == ["meta.json", "rank0.npy", "rank1.npy"]


def test_a_folder_where_a_rank_file_goes_is_refused_before_anything_changes(tmp_path, deadline):
    in_dir, out_dir = good_case(tmp_path)
    _put(out_dir / "rank2.npy", os.mkdir)
    refused(tmp_path, "oracle", "--algorithm", "ring", in_dir, out_dir,
            needles=[out_dir / "rank2.npy", "is a folder"])


def test_oracle_refuses_an_out_dir_that_is_a_dangling_link(tmp_path, deadline):
    in_dir, _ = good_case(tmp_path)
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    refused(tmp_path, "oracle", "--algorithm", "ring", in_dir, tmp_path / "dangling",
            needles=["which does not exist"])


@pytest.mark.parametrize("where", ["in-meta", "link-to-out-rank"])
def test_check_refuses_a_json_report_over_a_judged_file(tmp_path, deadline, where):
    in_dir, out_dir = good_case(tmp_path)
    report = in_dir / "meta.json"
    if where == "link-to-out-rank":
        report = tmp_path / "report.json"
        os.symlink(out_dir / "rank0.npy", report)
    refused(tmp_path, "check", "--json", report, in_dir, out_dir, needles=["a file being judged"])


# ------------------------------------------------------------------ row 10: bounded p

def test_gen_inputs_refuses_more_ranks_than_the_simulator_runs(tmp_path, deadline):
    refused(tmp_path, "gen-inputs", "-p", 200_000, "--count", 0, tmp_path / "g",
            needles=["-p 200000", "at most 4096"])
    assert not (tmp_path / "g").exists()


# -------------------------------------------------------------- row 11: golden vectors

@pytest.fixture
def one_vector(tmp_path) -> tuple[Path, dict]:
    """A folder holding one committed vector and a manifest of it alone."""
    entry = next(e for e in golden.read_manifest(COMMITTED)["vectors"]
                 if e["file"] == "ring-allreduce-sum-float32-p5-n37-random.npz")
    folder = tmp_path / "v"
    folder.mkdir()
    (folder / entry["file"]).write_bytes((COMMITTED / entry["file"]).read_bytes())
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "vectors": [entry]}))
    return folder, entry


def _manifest(folder: Path, change) -> None:
    data = json.loads((folder / "manifest.json").read_text())
    change(data, data["vectors"][0])
    (folder / "manifest.json").write_text(json.dumps(data))


def test_the_one_vector_folder_verifies(one_vector, deadline):
    res, _ = invoke("vectors", "--verify", one_vector[0])
    assert res.exit_code == 0 and "1 vectors, 0 mismatches" in res.output, res.output


def test_vectors_refuses_a_folder_without_its_manifest(tmp_path, deadline):
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "mine.npz").write_bytes(b"PK mine")
    refused(tmp_path, "vectors", tmp_path / "v",
            needles=["no manifest.json", "nothing was changed"])


@pytest.mark.parametrize("name", ["/etc/passwd", "../victim.npz", "sub/x.npz", "..", "a\nb.npz"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused_unopened(
        one_vector, deadline, monkeypatch, name, verify):
    folder, _ = one_vector
    (folder.parent / "victim.npz").write_text("precious")
    _manifest(folder, lambda data, entry: entry.update(file=name))
    opened = []
    real = reading.open_regular
    monkeypatch.setattr(reading, "open_regular", lambda path, **kw: (opened.append(str(path)),
                                                                     real(path, **kw))[1])
    args = ["vectors", "--verify", folder] if verify else ["vectors", folder]
    refused(folder.parent, *args, needles=["file must be a bare .npz name"])
    assert opened == [str(folder / "manifest.json")], opened


MANIFESTS = {  # change the manifest (data, its first entry); what the line says
    "nan": (lambda d, e: None, "NaN"),  # written as text below
    "p-string": (lambda d, e: e.update(p="5"), "p: must be a whole number"),
    "p-huge": (lambda d, e: e.update(p=10**9), "at most 4096"),
    "options-list": (lambda d, e: e.update(options={"root": [1, 2]}), "options: root"),
    "sha-short": (lambda d, e: e.update(sha256="zz"), "sha256"),
    "format-2": (lambda d, e: d.update(format=2), "format must be 1"),
    "count-wrong": (lambda d, e: d.update(count=7), "count is 7"),
    "not-object": (lambda d, e: d.update(vectors=[3]), "must be a JSON object"),
}


@pytest.mark.parametrize("case", MANIFESTS)
@pytest.mark.parametrize("verify", [False, True])
def test_a_manifest_is_checked_field_by_field(one_vector, deadline, case, verify):
    folder, _ = one_vector
    change, reason = MANIFESTS[case]
    _manifest(folder, change)
    if case == "nan":
        text = (folder / "manifest.json").read_text().replace('"n": 37', '"n": NaN', 1)
        (folder / "manifest.json").write_text(text)
    args = ["vectors", "--verify", folder] if verify else ["vectors", folder]
    refused(folder.parent, *args, needles=[folder / "manifest.json", reason])


def _member_promising(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("input_0.npy", promise("(1000000000000,)", version=3))


def _deflate_bomb(path: Path) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("input_0.npy", bytes(64 << 20))


VECTOR_FILES = {  # replace the vector with; what the line says
    "fifo": (os.mkfifo, "FIFO"),
    "dev-zero": (_link_to("/dev/zero"), "character device"),
    "not-a-zip": (lambda p: p.write_bytes(b"garbage"), "not a readable .npz"),
    "member-3.6-TiB": (_member_promising, "promises 4000000000000 bytes"),
    "deflate-bomb": (_deflate_bomb, "more than the 4194304"),
    "5-MiB": (lambda p: p.write_bytes(bytes(5 << 20)), "more than the 4194304"),
    "no-inputs": (lambda p: zipfile.ZipFile(p, "w").close(), "holds no input_0.npy"),
}


#: Files whose bytes refcoll reads, finds altered (their sha256 is not the manifest's), and
#: then cannot read as an archive: a mismatch like any other (exit 1), the next vector
#: still checked. The rest are not regular files of a size refcoll reads: refused, exit 2.
ALTERED_VECTORS = ("not-a-zip", "member-3.6-TiB", "deflate-bomb", "no-inputs")


@pytest.mark.parametrize("case", VECTOR_FILES)
def test_verify_refuses_a_vector_it_cannot_read(one_vector, deadline, case):
    folder, entry = one_vector
    make, reason = VECTOR_FILES[case]
    _put(folder / entry["file"], make)
    if case not in ALTERED_VECTORS:
        refused(folder.parent, "vectors", "--verify", folder, needles=[entry["file"], reason])
        return
    before = snapshot(folder.parent)
    res, peak = invoke("vectors", "--verify", folder)
    assert res.exit_code == 1 and res.exception.__class__ is SystemExit, res.output
    assert f"{entry['file']}: sha256 differs from the manifest's" in res.output
    assert f"{entry['file']}: cannot be read: " in res.output and reason in res.output
    assert peak < PEAK_BYTES and snapshot(folder.parent) == before


def test_vectors_removes_only_what_its_manifest_named(one_vector, deadline, monkeypatch):
    folder, entry = one_vector
    whole = golden.plan()
    few = whole[:2]
    monkeypatch.setattr(golden, "plan", lambda: few)
    victim = folder.parent / "victim.txt"
    victim.write_text("precious")
    (folder / "mine.npz").write_bytes(b"mine")  # not in the manifest: left alone
    _put(folder / entry["file"], _link_to(victim))  # named, and no longer planned: removed
    res, _ = invoke("vectors", folder)
    assert res.exit_code == 0, res.output
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(folder)) == sorted(["manifest.json", "mine.npz",
                                                 *(v.filename for v in few)])
    assert golden.verify(folder) == []
    (folder / few[0].filename).unlink()
    os.symlink(victim, folder / few[0].filename)  # named and planned: replaced, not through
    res, _ = invoke("vectors", folder)
    assert res.exit_code == 0 and victim.read_text() == "precious", res.output
    assert not (folder / few[0].filename).is_symlink()
    more = whole[:3]  # planned, but no manifest of refcoll's named it: not replaced
    monkeypatch.setattr(golden, "plan", lambda: more)
    os.symlink(victim, folder / more[2].filename)
    res, _ = invoke("vectors", folder)
    assert res.exit_code == 2 and "does not name it" in res.output, res.output
    assert victim.read_text() == "precious" and (folder / more[2].filename).is_symlink()


def test_vectors_refuses_a_file_for_its_folder(tmp_path, deadline):
    (tmp_path / "v").write_text("x")
    refused(tmp_path, "vectors", tmp_path / "v", needles=["is not a folder"])


# ------------------------------------------------------------- library orders (identify)

@pytest.mark.parametrize("text, reason", [
    ('{"a": 1}', "JSON list"),
    ('[{"collective": "allreduce", "p": NaN}]', "NaN"),
    ('[{"collective": "allreduce", "p": 3, "description": "a\\nb"}]', "description"),
    ('[{"collective": "allreduce", "p": 3, "matches": "ring"}]', "matches"),
    ('[{"collective": "allreduce", "p": "3"}]', "p: must be a whole number"),
    ('[{"p": 3}]', "has no collective"),
    ("[" * 100_000 + "]" * 100_000, "nests deeper"),
])
def test_known_orders_are_checked_field_by_field(tmp_path, text, reason):
    (tmp_path / "k.json").write_text(text)
    with pytest.raises(UsageError, match=reason):
        known_orders(tmp_path / "k.json")


def test_known_orders_refuse_a_device(tmp_path, deadline):
    os.symlink("/dev/zero", tmp_path / "k.json")
    with pytest.raises(UsageError, match="character device"):
        known_orders(tmp_path / "k.json")
