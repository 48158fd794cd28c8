"""Hostile inputs to the emulated cluster: state files, numbers, topologies, launcher scripts.

Each test builds one hostile input and holds refcoll to one line on stderr, exit 2, and
nothing outside changed. ``refcoll cluster down`` and ``up`` act, as root, on what a
state file names: here they meet state files refcoll never wrote, naming namespaces it
never made (decoys this file makes and removes), and must touch none of them.

The commands run in-process (click's ``CliRunner``); the state folder is a temporary one
(``REFCOLL_CLUSTER_DIR``), never the machine's own. The tests that build namespaces need
CAP_NET_ADMIN and ``ip`` (CI runs as root); elsewhere they skip, saying why. Destructive
calls are stubbed where a test judges only what refcoll would have done.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cluster import host_view, leftovers, needs_root

from refcoll.cli import main
from refcoll.cluster import Cluster, emulate, launch
from refcoll.cluster import check as link_check
from refcoll.cluster import state as cluster_state
from refcoll.core import topology
from refcoll.core.errors import UsageError

ERROR = re.compile(r"refcoll: error: [^\n]+\n")


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def one_line_exit_2(res, *said: str) -> str:
    """Assert the command failed with exit 2 and one line naming each of ``said``."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert ERROR.fullmatch(res.stderr), res.stderr
    for words in said:
        assert words in res.stderr, res.stderr
    return res.stderr


@pytest.fixture
def untouched_host():
    before = host_view()
    yield
    assert host_view() == before, "the host's own namespace changed"


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """A cluster folder of the test's own, as ``REFCOLL_CLUSTER_DIR`` names it."""
    folder = tmp_path / "clusters"
    os.mkdir(folder, 0o755)
    os.chmod(folder, 0o755)
    monkeypatch.setattr(emulate, "STATE_DIR", folder)
    monkeypatch.setenv("REFCOLL_CLUSTER_DIR", str(folder))
    return folder


@pytest.fixture
def acts(monkeypatch):
    """Stub every destructive call of emulate's (``ip``, ``tc``, signals, rmtree); record them.

    ``ip netns list`` answers with namespaces refcoll never made, so that code which
    trusted a name's prefix would try to remove them.
    """
    done = []

    def run(*argv, check=True):
        done.append(("run", *argv))
        out = "hostvpn\ncni-1\nrcabc123-n1\nrcabc123-evil\n" if argv[1:3] == ("netns", "list") \
            else ""
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(emulate, "_run", run)
    monkeypatch.setattr(emulate, "missing_capability", lambda: None)  # judged apart
    monkeypatch.setattr(emulate.os, "kill", lambda pid, sig: done.append(("kill", pid, sig)))
    monkeypatch.setattr(emulate.shutil, "rmtree",
                        lambda path, **kw: done.append(("rmtree", str(path))))
    return done


def destructive(done) -> list:
    """The recorded calls that change something (all but ``ip netns list``)."""
    return [call for call in done if call[:4] != ("run", "ip", "netns", "list")]


def state_of(prefix: str, *, owner=None, owner_start=None, detached=False, nodes=1,
             made=None) -> dict:
    """A state as refcoll writes it for cluster ``prefix`` (trustworthy in content)."""
    cluster = Cluster(nodes=nodes, ranks_per_node=1)
    cluster.prefix = prefix
    cluster.made = made if made is not None else [cluster.hub] + [
        cluster.node_ns(i) for i in range(1, nodes + 1)]
    state = dict(cluster.describe(), owner=owner, owner_start=owner_start)
    if detached:
        state["detached"] = True
    return state


def put(folder: Path, name: str, state, mode: int = 0o644) -> Path:
    path = folder / name
    path.write_text(state if isinstance(state, str) else json.dumps(state))
    os.chmod(path, mode)
    return path


# ------------------------------------------------------- state files refcoll never wrote

#: (file name, content, mode, what the one line says): each refused by ``down``.
HOSTILE_STATES = {
    "the issue's: another prefix, names of the host's": (
        "rcevil.json", {"prefix": "cni", "namespaces": ["hostvpn", "/", "../../home"]}, 0o644,
        "prefix 'cni' is not one refcoll makes"),
    "its prefix, a host namespace among its own": (
        "rcabc123.json", state_of("rcabc123", made=["rcabc123-hub", "hostvpn"]), 0o644,
        "namespace 'hostvpn' is not one cluster rcabc123 makes"),
    "its prefix, a path out of /etc/netns": (
        "rcabc123.json", state_of("rcabc123", made=["rcabc123-n1/../../../home"]), 0o644,
        "is not one cluster rcabc123 makes"),
    "its prefix and a name that only starts with it": (
        "rcabc123.json", state_of("rcabc123", made=["rcabc123-evil"]), 0o644,
        "namespace 'rcabc123-evil' is not one"),
    "a file named for one cluster, naming another": (
        "rcabc123.json", state_of("rcdef456"), 0o644, "names cluster rcdef456"),
    "writable by its group": (
        "rcabc123.json", state_of("rcabc123"), 0o664, "is writable by others (mode 664"),
    "writable by all": (
        "rcabc123.json", state_of("rcabc123"), 0o646, "is writable by others (mode 646"),
    "nested 200 deep": (
        "rcabc123.json", "[" * 200 + "]" * 200, 0o644, "nests deeper than the 64 levels"),
    "NaN for its owner": (
        "rcabc123.json", '{"prefix": "rcabc123", "namespaces": [], "owner": NaN}', 0o644,
        "NaN is not a number refcoll accepts"),
    "an owner id past any process's": (
        "rcabc123.json", state_of("rcabc123", owner=10 ** 15), 0o644,
        "owner: must be at most 4.1943e+06"),
    "a spec of 300 nodes": (
        "rcabc123.json", dict(state_of("rcabc123"), spec=dict(state_of("rcabc123")["spec"],
                                                                nodes=300)), 0o644,
        "spec: --nodes: must be at most 64"),
    "a spec with a field refcoll has not": (
        "rcabc123.json", dict(state_of("rcabc123"), spec={"nodes": 1, "shell": "rm -rf /"}),
        0o644, "spec must be an object of"),
    "nodes that are not its spec's": (
        "rcabc123.json", dict(state_of("rcabc123"), nodes=[{"host": "db1", "namespace": "hostvpn",
                                                            "address": "10.0.0.1"}]), 0o644,
        "its nodes are not those its spec makes"),
    "larger than a state file can be": (
        "rcabc123.json", json.dumps({"prefix": "rcabc123", "pad": "x" * (2 << 20)}), 0o644,
        "more than the 1048576 refcoll reads"),
    "not JSON": ("rcabc123.json", "prefix = rcabc123", 0o644, "not valid JSON"),
}


@pytest.mark.parametrize("name,content,mode,said", HOSTILE_STATES.values(), ids=HOSTILE_STATES)
def test_down_refuses_a_state_file_refcoll_did_not_write_and_changes_nothing(
        state_dir, acts, name, content, mode, said):
    path = put(state_dir, name, content, mode)
    before = path.read_bytes()
    one_line_exit_2(cli("cluster", "down"), str(path), said, "removes no cluster")
    assert destructive(acts) == []  # no signal, no namespace deleted, nothing under /etc/netns
    assert path.read_bytes() == before  # and the file is left for a person to look at
    one_line_exit_2(cli("cluster", "down"), said)  # the next down refuses it again


def test_down_refuses_a_state_file_that_is_a_link(state_dir, tmp_path, acts):
    real = put(tmp_path, "elsewhere.json", state_of("rcabc123"))
    (state_dir / "rcabc123.json").symlink_to(real)
    one_line_exit_2(cli("cluster", "down"), "is a symbolic link")
    assert destructive(acts) == [] and real.exists() and (state_dir / "rcabc123.json").is_symlink()


def test_down_refuses_a_folder_named_as_a_state_file(state_dir, acts):
    (state_dir / "rcabc123.json").mkdir()
    one_line_exit_2(cli("cluster", "down"), "is a folder, not a regular file")
    assert destructive(acts) == []


def test_a_fifo_for_a_state_file_is_refused_without_waiting(state_dir, acts):
    os.mkfifo(state_dir / "rcabc123.json", 0o644)
    signal.alarm(60)  # a guard against a hang, not a timing: a reader must not block on it
    try:
        res = cli("cluster", "down")
    finally:
        signal.alarm(0)
    one_line_exit_2(res, "is a FIFO (named pipe), not a regular file")
    assert destructive(acts) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_down_refuses_a_state_file_another_user_owns(state_dir, acts):
    path = put(state_dir, "rcabc123.json", state_of("rcabc123"))
    os.chown(path, 65534, 65534)
    one_line_exit_2(cli("cluster", "down"), "is owned by user 65534, not root")
    assert destructive(acts) == []


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_cluster_folder_others_may_write_is_refused(state_dir, acts, monkeypatch, mode):
    monkeypatch.setattr(emulate, "missing_capability", lambda: None)  # root or not
    put(state_dir, "rcabc123.json", state_of("rcabc123"))
    os.chmod(state_dir, mode)
    for command in (["down"], ["status"], ["up", "--nodes", "1"]):
        one_line_exit_2(cli("cluster", *command), "the cluster folder (REFCOLL_CLUSTER_DIR) is "
                        f"writable by others (mode {mode:o}")
    assert destructive(acts) == [] and (state_dir / "rcabc123.json").exists()


def test_a_cluster_folder_that_is_a_link_is_refused(state_dir, tmp_path, acts, monkeypatch):
    link = tmp_path / "link"
    link.symlink_to(state_dir)
    put(state_dir, "rcabc123.json", state_of("rcabc123"))
    monkeypatch.setattr(emulate, "STATE_DIR", link)
    one_line_exit_2(cli("cluster", "down"), f"{link}: the cluster folder", "is a symbolic link")
    assert destructive(acts) == [] and (state_dir / "rcabc123.json").exists()


def test_status_names_a_bad_state_file_and_lists_the_good_one(state_dir, acts):
    put(state_dir, "rcabc123.json", state_of("rcabc123", detached=True))
    bad = put(state_dir, "rcdef456.json", "[" * 200 + "]" * 200)
    res = cli("cluster", "status")
    one_line_exit_2(res, f"{bad}: nests deeper than the 64 levels refcoll reads")
    assert res.stdout.startswith("cluster rcabc123: 1 nodes x 1 ranks, link 1gbit, ")
    assert res.stdout.count("\n") == 1
    res = cli("cluster", "status", "--json")
    one_line_exit_2(res, "nests deeper")
    listed = json.loads(res.stdout)
    assert [s.get("prefix") for s in listed] == ["rcabc123", None]
    assert "nests deeper" in listed[1]["problem"]
    assert destructive(acts) == []


def test_a_state_without_a_spec_can_be_removed_but_not_run_on(state_dir, acts):
    put(state_dir, "rcabc123.json", {"prefix": "rcabc123", "owner": None,
                                     "namespaces": ["rcabc123-hub"]})
    one_line_exit_2(cli("cluster", "run", "--", "true"), "no cluster is up that refcoll can run on")
    res = cli("cluster", "down")
    assert (res.exit_code, res.stdout) == (0, "removed rcabc123\n"), res.output
    # its own and what ip lists of its pattern (made before a state said so), never -evil
    assert [c[-1] for c in acts if c[1:4] == ("ip", "netns", "del")] == ["rcabc123-n1",
                                                                         "rcabc123-hub"]
    put(state_dir, "rcabc123.json", {"prefix": "rcabc123", "namespaces": [],
                                     "nodes": [{"host": "db1", "namespace": "hostvpn"}]})
    one_line_exit_2(cli("cluster", "down"), "lists nodes but no spec that makes them")


def test_run_uses_only_a_trusted_state(state_dir, acts):
    put(state_dir, "rcabc123.json", state_of("rcabc123"), mode=0o666)
    for command in (["run", "--", "true"], ["check"]):  # the file is named, not "no cluster"
        one_line_exit_2(cli("cluster", *command), "rcabc123.json", "is writable by others",
                        "refcoll runs on no cluster while it is there")
    assert destructive(acts) == []


def test_an_untrusted_state_file_says_how_to_remove_its_cluster_by_hand(state_dir, acts):
    """down refuses the file; its advice names the cluster's namespaces that exist (by the
    file's name, of its own pattern only) and its files, so the cluster is not stranded."""
    put(state_dir, "rcabc123.json", "prefix = rcabc123")
    said = one_line_exit_2(cli("cluster", "down"), "not valid JSON",
                           "if it is refcoll's cluster rcabc123, look at it, then remove it by "
                           "hand: ip netns del rcabc123-n1; rm -r /etc/netns/rcabc123-n1; rm "
                           f"{state_dir}/rcabc123.json {state_dir}/rcabc123.topo.json")
    assert "rcabc123-evil" not in said and "hostvpn" not in said
    assert destructive(acts) == []


def test_down_that_cannot_delete_a_namespace_keeps_the_state_file(state_dir, monkeypatch):
    """Without the privilege to delete namespaces, down used to say "removed", exit 0 and
    drop the state file, leaving namespaces nothing could find again."""
    def run(*argv, check=True):
        if argv[1:3] == ("netns", "list"):
            return subprocess.CompletedProcess(argv, 0, "rcabc123-hub\nrcabc123-n1\n", "")
        if argv[1:3] == ("netns", "del"):
            return subprocess.CompletedProcess(argv, 1, "", "Cannot remove namespace file: "
                                               "Operation not permitted\n")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(emulate, "_run", run)
    monkeypatch.setattr(emulate, "missing_capability", lambda: None)
    monkeypatch.setattr(emulate.os, "kill", lambda pid, sig: None)
    path = put(state_dir, "rcabc123.json", state_of("rcabc123", detached=True))
    one_line_exit_2(cli("cluster", "down"), "cluster rcabc123: could not delete rcabc123-hub "
                    "(Cannot remove namespace file: Operation not permitted)",
                    "its state file", "is kept: run refcoll cluster down again as root")
    assert path.exists()
    monkeypatch.setattr(emulate, "missing_capability", lambda: "no CAP_NET_ADMIN here")
    one_line_exit_2(cli("cluster", "down"), "no CAP_NET_ADMIN here")
    assert path.exists()


def test_status_calls_a_cluster_whose_build_was_killed_incomplete(state_dir, acts):
    """A build killed halfway lists only the namespaces it made; its spec says the rest."""
    put(state_dir, "rcabc123.json", state_of("rcabc123", nodes=2, made=["rcabc123-hub"]))
    res = cli("cluster", "status")
    assert res.exit_code == 0 and "INCOMPLETE (refcoll cluster down)" in res.stdout, res.output


def test_run_refuses_more_processes_than_the_cluster_has_ranks(state_dir, acts):
    put(state_dir, "rcabc123.json", state_of("rcabc123", nodes=1, detached=True))
    one_line_exit_2(cli("cluster", "run", "-n", "5", "--", "true"),
                    "-n 5: cluster rcabc123 has 1 ranks (1 nodes); give -n 1 or fewer")
    assert destructive(acts) == []


def test_a_held_cluster_is_not_reported_as_none(state_dir, acts):
    me, started = os.getpid(), cluster_state.start_time(os.getpid())
    put(state_dir, "rcaaaaa1.json", state_of("rcaaaaa1", owner=me, owner_start=started))
    res = cli("cluster", "down")
    assert res.exit_code == 0 and res.stdout == "no cluster removed\n", res.output
    assert "left cluster rcaaaaa1" in res.stderr


def test_a_relative_or_linked_cluster_folder_is_refused_before_anything_is_made(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="is not an absolute path"):
        cluster_state.check_folder(Path("clusters"), create=True)
    assert not (tmp_path / "clusters").exists()
    # another user's link, in a folder of root's: it would choose where root writes
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "planted"
    link.symlink_to(target)
    os.lchown(link, 65534, 65534)
    with pytest.raises(UsageError, match=r"passes through .*planted, a link of user 65534"):
        cluster_state.check_folder(link / "new" / "clusters", create=True)
    assert not (target / "new").exists()
    # a folder others may write, above folders still to be made: refused before making them
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UsageError, match="which is writable by others"):
        cluster_state.check_folder(shared / "new" / "deeper", create=True)
    assert not (shared / "new").exists()


@pytest.mark.parametrize("content", ["[" * 100 + "]" * 100, '{"nodes": NaN}', '{"nodes": 7}',
                                     '{"machine": 1e999, "nodes": [{"host": "h"}]}', None])
def test_the_machine_of_a_host_survives_a_hostile_cluster_file(tmp_path, monkeypatch, content):
    path = tmp_path / "state.json"
    if content is None:
        os.mkfifo(path)  # a reader would wait forever for a writer
    else:
        path.write_text(content)
    monkeypatch.setenv("REFCOLL_CLUSTER", str(path))
    signal.alarm(60)  # a guard against a hang
    try:
        assert emulate.machine_of("h") == "h"
    finally:
        signal.alarm(0)
    monkeypatch.setenv("REFCOLL_CLUSTER", "/dev/zero")
    assert emulate.machine_of("h") == "h"


# ------------------------------------------------------------ a running job's cluster

def test_down_leaves_a_cluster_a_running_job_holds_unless_forced(state_dir, acts):
    me, started = os.getpid(), cluster_state.start_time(os.getpid())
    put(state_dir, "rcaaaaa1.json", state_of("rcaaaaa1", owner=me, owner_start=started))
    put(state_dir, "rcaaaaa2.json", state_of("rcaaaaa2", owner=me, detached=True))
    # this process's id, given again to another process: the owner that wrote it is gone
    put(state_dir, "rcaaaaa3.json", state_of("rcaaaaa3", owner=me, owner_start=started + 1))
    put(state_dir, "rcaaaaa4.json", state_of("rcaaaaa4", owner=1 << 22, owner_start=1))
    res = cli("cluster", "down")
    assert res.exit_code == 0, res.output
    assert res.stdout == "removed rcaaaaa2, rcaaaaa3, rcaaaaa4\n"
    assert res.stderr == (f"refcoll: left cluster rcaaaaa1: process {me} holds it and runs "
                          "(refcoll cluster down --force removes it)\n")
    deleted = [call[-1] for call in acts if call[1:4] == ("ip", "netns", "del")]
    assert sorted(deleted) == [f"rcaaaaa{i}-{ns}" for i in (2, 3, 4) for ns in ("hub", "n1")]
    assert [p.name for p in state_dir.iterdir()] == ["rcaaaaa1.json"]
    res = cli("cluster", "down", "--force")
    assert res.exit_code == 0 and res.stdout == "removed rcaaaaa1\n", res.output
    assert not list(state_dir.iterdir())
    # only names of refcoll's pattern: never rcabc123-evil, which ip netns list also shows
    assert all(call[-1].startswith("rcaaaaa") for call in acts
               if call[1:4] == ("ip", "netns", "del"))
    assert not [call for call in acts if call[0] == "kill"]  # the stub found no process


# ------------------------------------------------------------- numbers before building

HOSTILE_UP = {
    "300 nodes": (["--nodes", "300"], "--nodes: must be at most 64, not 300"),
    "no node": (["--nodes", "0"], "--nodes: must be at least 1, not 0"),
    "oversubscription nan": (["--racks", "2", "--oversubscription", "nan"],
                             "--oversubscription: must be a finite number, not nan"),
    "oversubscription inf": (["--oversubscription", "inf"],
                             "--oversubscription: must be a finite number, not inf"),
    "oversubscription below 1": (["--racks", "2", "--oversubscription", "1e-300"],
                                 "--oversubscription: must be at least 1"),
    "oversubscription 1e6": (["--racks", "2", "--oversubscription", "1e6"],
                             "--oversubscription: must be at most 1000"),
    "an uplink below 1 kbit/s": (["--racks", "2", "--link", "2kbit", "--oversubscription",
                                  "1000"], "a rack's uplink would run at 2 bit/s"),
    "link 1e-300": (["--link", "1e-300kbit"], "link rate '1e-300kbit': an emulated link runs at"),
    "link nan": (["--link", "nan"], "link rate 'nan': not a finite number"),
    "link 100 Tbit/s": (["--link", "100tbit"], "link rate '100tbit': an emulated link runs at"),
    "a node's link 0": (["--node-link", "2=0gbit"], "link rate '0gbit'"),
    "delay nan": (["--delay", "nan"], "--delay 'nan': not a finite number"),
    "delay with no unit": (["--delay", "5"], "--delay '5': a time needs a unit"),
    "delay 100 s": (["--delay", "100s"], "--delay '100s': at most 1 s a link"),
    "delay negative": (["--delay", "-5us"], "--delay '-5us': must not be negative"),
    "100000 ranks a node": (["--node-ranks", "1=100000"], "--node-ranks 1: must be at most 256"),
    "a node number in another script": (["--node-ranks", "\u00b2=3"], "write NODE=VALUE"),
    "no rank": (["--ranks-per-node", "0"], "--ranks-per-node: must be at least 1"),
    "more racks than nodes": (["--racks", "3"], "--racks: must be at most 2"),
}


@pytest.mark.parametrize("args,said", HOSTILE_UP.values(), ids=HOSTILE_UP)
def test_up_refuses_a_number_out_of_bounds_before_building_anything(state_dir, acts, args, said):
    one_line_exit_2(cli("cluster", "up", *args), said)
    assert acts == []  # not even ip netns list: the numbers are checked first
    assert not list(state_dir.iterdir())


def test_a_failed_ip_command_is_one_line_naming_it_and_what_ip_said(monkeypatch):
    said = "Error: argument \"x\" is wrong\nCannot create namespace file: File exists\n"
    monkeypatch.setattr(emulate.subprocess, "run",
                        lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", said))
    with pytest.raises(emulate.ClusterError) as caught:
        emulate._run("ip", "netns", "add", "rcabc123 hub")
    assert str(caught.value) == ("ip netns add 'rcabc123 hub' failed: Cannot create namespace "
                                 "file: File exists")

    def missing(argv, **kw):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(emulate.subprocess, "run", missing)
    with pytest.raises(emulate.ClusterError, match=r"^ip: cannot be run \(No such file"):
        emulate._run("ip", "netns", "list")


# ------------------------------------------------------- real namespaces: decoys untouched

def _ns_exists(name: str) -> bool:
    return name in emulate._namespaces()


@pytest.fixture
def decoys(tmp_path):
    """Namespaces refcoll never made, each with a process in it and an /etc/netns folder.

    Removed at the end whatever happened.
    """
    tag = secrets.token_hex(3)
    names = {"decoy": f"decoy-{tag}",          # not refcoll's pattern at all
             "lookalike": f"rc{tag}-n1",       # refcoll's pattern, but no trusted state
             "prefixed": f"rcfeed{tag[:2]}-evil"}  # starts with a prefix, not of its pattern
    sleepers, made = [], []
    had_etc = emulate.NETNS_ETC.exists()
    try:
        for name in names.values():
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
            made.append(name)
            (emulate.NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
            (emulate.NETNS_ETC / name / "hosts").write_text("a decoy's own file\n")
            sleepers.append(subprocess.Popen(["ip", "netns", "exec", name, "sleep", "1000"]))
        yield names, sleepers
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for name in names.values():
            shutil.rmtree(emulate.NETNS_ETC / name, ignore_errors=True)
        if not had_etc:
            try:
                emulate.NETNS_ETC.rmdir()  # as it was: absent
            except OSError:
                pass


def _untouched(names: dict, sleepers: list) -> None:
    for name in names.values():
        assert _ns_exists(name), f"{name} was removed"
        assert (emulate.NETNS_ETC / name / "hosts").read_text() == "a decoy's own file\n"
    assert [s.poll() for s in sleepers] == [None] * len(sleepers), "a decoy's process was killed"


@needs_root
@pytest.mark.parametrize("case", ["the issue's", "untrusted lookalike", "lookalike and link"])
def test_down_leaves_namespaces_refcoll_never_made(untouched_host, state_dir, decoys, tmp_path,
                                                   case):
    names, sleepers = decoys
    lookalike = names["lookalike"][:8]
    if case == "the issue's":
        put(state_dir, "rcevil.json", {"prefix": "cni", "namespaces": [
            names["decoy"], "/", "../../home", names["lookalike"]]})
        said = "prefix 'cni' is not one refcoll makes"
    elif case == "untrusted lookalike":  # refcoll's names, in a file others may write
        put(state_dir, f"{lookalike}.json", state_of(lookalike), mode=0o666)
        said = "is writable by others"
    else:  # refcoll's names, through a link to a file refcoll did not write there
        real = put(tmp_path, "planted.json", state_of(lookalike))
        (state_dir / f"{lookalike}.json").symlink_to(real)
        said = "is a symbolic link"
    one_line_exit_2(cli("cluster", "down"), said)
    one_line_exit_2(cli("cluster", "down", "--force"), said)
    _untouched(names, sleepers)


@needs_root
def test_down_removes_only_its_own_names_and_follows_no_link_out_of_etc_netns(
        untouched_host, state_dir, decoys, tmp_path):
    names, sleepers = decoys
    prefix = names["prefixed"][:8]  # a trusted state of the prefix the decoy starts with
    hub = f"{prefix}-hub"
    subprocess.run(["ip", "netns", "add", hub], check=True, capture_output=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not refcoll's\n")
    planted = emulate.NETNS_ETC / f"{prefix}-n1"
    planted.symlink_to(outside)  # /etc/netns/PREFIX-n1 -> a folder elsewhere
    try:
        put(state_dir, f"{prefix}.json", state_of(prefix, owner=1 << 22, owner_start=1))
        res = cli("cluster", "down")
        assert res.exit_code == 0 and res.stdout == f"removed {prefix}\n", res.output
        assert not _ns_exists(hub)
        assert (outside / "keep").read_text() == "not refcoll's\n" and planted.is_symlink()
        _untouched(names, sleepers)  # PREFIX-evil included: not a name refcoll makes
    finally:
        subprocess.run(["ip", "netns", "del", hub], capture_output=True)
        planted.unlink(missing_ok=True)


@needs_root
def test_a_failed_ip_command_while_building_is_one_line_and_leaves_nothing(
        untouched_host, state_dir, monkeypatch):
    real = emulate._run

    def bad_address(*argv, check=True):  # node 2's address, as no ip can take it
        if argv[3:6] == ("addr", "add", f"{emulate.SUBNET}.0.2/16"):
            argv = (*argv[:5], f"{emulate.SUBNET}.0.999/16", *argv[6:])
        return real(*argv, check=check)

    monkeypatch.setattr(emulate, "_run", bad_address)
    said = one_line_exit_2(cli("cluster", "up", "--nodes", "2", "--ranks-per-node", "1"),
                           f"addr add {emulate.SUBNET}.0.999/16 dev eth0 failed: ")
    prefix = re.search(r"rc[0-9a-f]{6}", said).group(0)
    assert said.startswith(f"refcoll: error: ip -n {prefix}-n2 addr add")
    assert "10.203.0.999/16" in said.split("failed: ", 1)[1]  # what ip said of it
    assert leftovers(prefix) == [] and not list(state_dir.iterdir())


@needs_root
def test_a_failed_tc_command_while_building_is_one_line_and_leaves_nothing(
        untouched_host, state_dir, monkeypatch):
    real = emulate._run

    def bad_burst(*argv, check=True):  # node 2's bucket, larger than tc's 32 bits
        if "tbf" in argv and argv[3].endswith("-n2"):
            at = argv.index("burst") + 1
            argv = (*argv[:at], "5000000000b", *argv[at + 1:])
        return real(*argv, check=check)

    monkeypatch.setattr(emulate, "_run", bad_burst)
    said = one_line_exit_2(cli("cluster", "up", "--nodes", "2", "--ranks-per-node", "1"),
                           "shaping a link needs tc's tbf qdisc, which failed here (ip netns exec",
                           "-n2 tc qdisc add dev eth0 root handle 2: tbf rate 1000000000bit",
                           "latency 50ms failed: ")
    assert "burst" in said.split("failed: ", 1)[1]  # what tc said of it
    prefix = re.search(r"rc[0-9a-f]{6}", said).group(0)
    assert leftovers(prefix) == [] and not list(state_dir.iterdir())


@needs_root
def test_up_and_down_leave_a_running_jobs_cluster_unless_forced(untouched_host, state_dir):
    with Cluster(nodes=1, ranks_per_node=1, link="100mbit") as live:
        res = cli("cluster", "up", "--nodes", "1", "--ranks-per-node", "1")
        assert res.exit_code == 0, res.output
        left = (f"refcoll: left cluster {live.prefix}: process {os.getpid()} holds it and runs "
                "(refcoll cluster down --force removes it)\n")
        assert res.stderr == left
        detached = res.stdout.split()[1].rstrip(":")
        assert all(_ns_exists(ns) for ns in live.made)
        res = cli("cluster", "down")
        assert (res.exit_code, res.stdout, res.stderr) == (0, f"removed {detached}\n", left)
        assert leftovers(detached) == [] and all(_ns_exists(ns) for ns in live.made)
        res = cli("cluster", "down", "--force")
        assert (res.exit_code, res.stdout) == (0, f"removed {live.prefix}\n"), res.output
        assert not any(_ns_exists(ns) for ns in live.made)
    assert leftovers(live.prefix) == []


# ------------------------------------------------------------------ topology files

def _topology(**changes) -> dict:
    base = {"version": 1, "nodes": [{"host": "a", "rack": 1, "ranks": 2, "link_bits_per_s": 1e9},
                                    {"host": "b", "rack": 2, "ranks": 2, "link_bits_per_s": 1e9}],
            "racks": [{"rack": 1, "uplink_bits_per_s": 5e8}, {"rack": 2, "uplink_bits_per_s": 5e8}]}
    return {**base, **changes}


HOSTILE_TOPOLOGIES = {
    "an uplink of a rack with no node": (
        json.dumps(_topology(racks=[{"rack": 3, "uplink_bits_per_s": 5e8}])),
        "racks[0]: rack 3 holds no node of the file"),
    "a link rate NaN": (
        '{"nodes": [{"host": "a", "link_bits_per_s": NaN}]}', "NaN is not a number refcoll"),
    "a link rate Infinity": (
        '{"nodes": [{"host": "a", "link_bits_per_s": Infinity}]}', "Infinity is not a number"),
    "a link rate 1e-300": (
        '{"nodes": [{"host": "a", "link_bits_per_s": 1e-300}]}',
        "nodes[0].link_bits_per_s: must be at least 1000, not 1e-300"),
    "a negative link rate": (
        '{"nodes": [{"host": "a", "link_bits_per_s": -1e9}]}',
        "nodes[0].link_bits_per_s: must be at least 1000"),
    "a link rate 1e300": (
        '{"nodes": [{"host": "a", "link_bits_per_s": 1e300}]}',
        "nodes[0].link_bits_per_s: must be at most 1e+15"),
    "a link rate of text": (
        '{"nodes": [{"host": "a", "link_bits_per_s": "fast"}]}',
        "nodes[0].link_bits_per_s: must be a finite number, not 'fast'"),
    "an uplink NaN": (
        json.dumps(_topology(racks=[{"rack": 1, "uplink_bits_per_s": float("nan")}])),
        "NaN is not a number refcoll accepts"),
    "an uplink 1e-300": (
        json.dumps(_topology(racks=[{"rack": 1, "uplink_bits_per_s": 1e-300}])),
        "racks[0].uplink_bits_per_s: must be at least 1000"),
    "nested JSON": ('{"nodes": ' + "[" * 100 + "]" * 100 + "}", "nests deeper than the 64"),
    "a host twice": (json.dumps(_topology(nodes=[{"host": "a"}, {"host": "a"}], racks=[])),
                     "host 'a' is listed 2 times"),
    "a rack number of 19 digits": ('{"nodes": [{"host": "a", "rack": 1000000000000000000}]}',
                                   "nodes[0].rack: must be at most 65536"),
    "ranks 1.5": ('{"nodes": [{"host": "a", "ranks": 1.5}]}',
                  "nodes[0].ranks: must be a whole number, not 1.5"),
    "a latency of an hour": (json.dumps(_topology(link_latency_s=3600)),
                             "link_latency_s: must be at most 10"),
    "nodes as an object": ('{"nodes": {"host": "a"}}', "is not a refcoll topology"),
    "a misspelt field": ('{"nodes": [{"host": "a", "link": 1e-300}]}',
                         "nodes[0]: has a field refcoll does not read, 'link'"),
    "uplinks in a field of their own": (json.dumps(_topology(uplinks={"7": 1e9})),
                                        "has a field refcoll does not read, 'uplinks'"),
}


@pytest.mark.parametrize("text,said", HOSTILE_TOPOLOGIES.values(), ids=HOSTILE_TOPOLOGIES)
def test_model_refuses_a_hostile_topology_in_one_line(tmp_path, text, said):
    path = tmp_path / "topo.json"
    path.write_text(text)
    one_line_exit_2(cli("model", "--topology", str(path), "--params", "1e6", "--no-search"),
                    f"{path}: ", said)


@pytest.mark.parametrize("where", ["/dev/zero", "fifo", "folder", "absent"])
def test_model_refuses_a_topology_that_is_no_file(tmp_path, where):
    path = {"/dev/zero": Path("/dev/zero"), "fifo": tmp_path / "fifo",
            "folder": tmp_path, "absent": tmp_path / "absent.json"}[where]
    if where == "fifo":
        os.mkfifo(path)
    signal.alarm(60)  # a guard against a hang on the FIFO
    try:
        res = cli("model", "--topology", str(path), "--params", "1e6", "--no-search")
    finally:
        signal.alarm(0)
    if res.exit_code == 2 and "Usage:" in res.stderr:  # click refuses a folder itself
        assert "is a directory" in res.stderr
        return
    one_line_exit_2(res, str(path))


def test_a_topology_with_no_uplink_of_its_own_still_reads(tmp_path):
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(_topology(racks=[{"rack": 1}, {"rack": 2, "uplink_bits_per_s": 0}],
                                         link_latency_s=0)))
    assert topology.read(path).uplinks == {}  # absent or 0: no uplink, as before


# ------------------------------------------------------------- the launcher stand-in

def test_the_standin_quotes_its_python_and_keeps_the_working_folder_off_its_path(
        tmp_path, monkeypatch):
    odd = tmp_path / "a b;$(touch pwned)" / "python"
    monkeypatch.setattr(sys, "executable", str(odd))
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (folder / "ssh").symlink_to(victim)  # planted: the script must not be written through it
    standin = launch._standin(folder)
    text = standin.read_text()
    assert text.splitlines()[0] == "#!/bin/sh"
    assert text.splitlines()[1] == (f"exec '{odd}' -P -m refcoll.cluster.standin \"$@\"")
    assert victim.read_text() == "keep\n" and not standin.is_symlink()
    assert stat.S_IMODE(standin.stat().st_mode) & 0o777 == 0o755 & ~_umask()
    # sh reads back the one word: the path with its space, ; and $( ) as they are
    words = subprocess.run(["sh", "-c", text.splitlines()[1].replace("exec ", "printf '%s\\n' ")
                            .replace('"$@"', "")], capture_output=True, text=True,
                           cwd=tmp_path).stdout
    assert words.splitlines() == [str(odd), "-P", "-m", "refcoll.cluster.standin"]
    assert not (tmp_path / "pwned").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_hostfiles_are_not_written_through_a_link(tmp_path):
    cluster = Cluster(nodes=2, ranks_per_node=1)
    cluster.prefix = "rcabc123"
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    for name, write in (("hosts", cluster.hostfile),
                        ("ompi", lambda p: launch.openmpi_hostfile(cluster, p))):
        (tmp_path / name).symlink_to(victim)
        write(tmp_path / name)
        assert victim.read_text() == "keep\n" and not (tmp_path / name).is_symlink()
    assert (tmp_path / "hosts").read_text() == "rcabc123-n1:1\nrcabc123-n2:1\n"


def test_every_python_the_cluster_starts_has_no_working_folder_on_its_path(monkeypatch):
    cluster = Cluster(nodes=2, ranks_per_node=1)
    cluster.prefix = "rcabc123"
    for argv in launch.torchrun_argvs(cluster, ["python", "train.py"]):
        at = argv.index(sys.executable)
        assert argv[at + 1:at + 4] == ["-P", "-m", "torch.distributed.run"]
    started = []

    class Server:
        stdout = type("Out", (), {"readline": staticmethod(lambda: "ready\n")})()

        def __init__(self, argv, **kw):
            started.append(argv)

        def kill(self):
            pass

        def wait(self):
            pass

    def client(argv, **kw):
        started.append(argv)
        return subprocess.CompletedProcess(argv, 0, json.dumps(
            {"rtt_s": 1e-4, "bits_per_s": 1e9, "both_ways_bits_per_s": []}), "")

    monkeypatch.setattr(link_check.subprocess, "Popen", Server)
    monkeypatch.setattr(link_check.subprocess, "run", client)
    link_check.measure_link(cluster, 1, 2)
    for argv in started:
        at = argv.index(sys.executable)
        assert argv[at + 1:at + 3] == ["-P", "-c"], argv


def test_a_cluster_spec_is_checked_when_made_in_python():
    for spec, said in (({"nodes": 300}, "--nodes: must be at most 64"),
                       ({"oversubscription": float("nan")}, "must be a finite number"),
                       ({"link": 1e9}, "give a rate such as 1gbit"),
                       ({"node_links": {"x": "1gbit"}}, "--node-link names node 'x'"),
                       ({"delay": "1e400s"}, "not a finite number")):
        with pytest.raises(UsageError, match=said):
            Cluster(**spec)
