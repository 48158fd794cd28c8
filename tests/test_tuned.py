"""REFCOLL_TUNING_FILE: auto runs the algorithm a benchmark measured fastest at each size.

``refcoll tune`` writes the file from ``refcoll bench --json`` reports; auto reads it
(rank 0 under MPI, sending it to the others; the simulator from its environment).
"""

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import mpiexec_path

import refcoll
from refcoll.algorithms import NodeShape
from refcoll.calls import tuned
from refcoll.calls.auto import resolve_with_options
from refcoll.core.errors import UsageError

needs_mpi = pytest.mark.skipif(mpiexec_path() is None,
                               reason="no mpiexec: pip install 'refcoll[mpi]'")


def table(rules, collective="allreduce", ranks=4, nodes=1, per_node=None):
    return {"collective": collective, "ranks": ranks, "nodes": nodes,
            "per_node": per_node or ranks // nodes,
            "rules": [{"bytes": b, "algorithm": a, "time_us": 1.0} for b, a in rules]}


def document(*tables):
    return json.dumps({"version": 1, "tables": list(tables)})


RULES = [(1024, "recursive_doubling"), (65536, "tree(segment=1024)"), (1 << 20, "ring")]


def test_a_call_takes_the_rule_of_the_nearest_size_within_a_factor_of_two():
    tuning = tuned.parse(document(table(RULES)))
    pick = lambda n, **kw: tuning.choice("allreduce", 4, None, n, **kw)  # noqa: E731
    assert pick(1024) == ("recursive_doubling", {})
    assert pick(512) == ("recursive_doubling", {})  # half the smallest: still in reach
    assert pick(511) is None  # beyond: the cost model chooses
    assert pick(8192) == ("recursive_doubling", {})  # 8 KiB: 3 octaves from 1 KiB, 3 from 64
    assert pick(8193) == ("tree", {"segment": 1024})
    assert pick(2 << 20) == ("ring", {}) and pick((2 << 20) + 1) is None
    # another collective, rank count or layout: no table applies
    assert tuning.choice("reduce_scatter", 4, None, 1024) is None
    assert tuning.choice("allreduce", 8, None, 1024) is None
    assert tuning.choice("allreduce", 4, NodeShape(2, 2), 1024) is None
    # REFCOLL_ALGO naming others leaves the rule untaken
    assert pick(1 << 20, allowed=["ring", "tree"]) == ("ring", {})
    assert pick(1024, allowed=["ring", "tree"]) is None


def test_a_table_is_for_its_nodes():
    tuning = tuned.parse(document(table(RULES, nodes=2), table([(1024, "naive")])))
    assert tuning.choice("allreduce", 4, NodeShape(2, 2), 1024) == ("recursive_doubling", {})
    assert tuning.choice("allreduce", 4, None, 1024) == ("naive", {})
    assert tuning.choice("allreduce", 4, NodeShape(4, 1), 1024) is None
    # nodes without per_node: the ranks spread evenly, as one rank a node over the rest
    spread = {k: v for k, v in table(RULES, ranks=5, nodes=2).items() if k != "per_node"}
    assert tuned.parse(document(spread)).tables[0].per_node == 3
    uneven = tuned.parse(document(table(RULES, ranks=5, nodes=2, per_node=3)))
    assert uneven.choice("allreduce", 5, NodeShape(2, 3), 1024) == ("recursive_doubling", {})


@pytest.mark.parametrize("text,said", [
    ("{", "not valid JSON"),
    (json.dumps({"tables": [{"collective": "allreduce"}]}), "a table lacks ranks, rules"),
    (json.dumps({"rules": []}), "is not a refcoll tuning file"),
    (document(table([])), "has no rule"),
    (document(table([(1024, "rings")])), "the rule at 1024 B"),
    (document(table([(1024, "bruck")])), "the rule at 1024 B"),  # no all-reduce
    (document(table([(1024, "ring(segment=4)")])), "the rule at 1024 B"),  # not its option
    (document(table([(1024, "auto")])), "auto cannot run"),
    (document(table([(1024, "switch")])), "auto cannot run"),
    # values the run would refuse, refused when the file is read: the rule is named
    (document(table([(1024, "tree(segment=0)")])),
     r"the rule at 1024 B \(tree\(segment=0\)\): segment must be a positive"),
    (document(table([(1024, "tree(segment=abc)")])), "segment must be a positive"),
    (document(table([(1024, "hierarchical(pipeline=0)")])), "pipeline must be a whole number"),
    (document(table([(1024, "hierarchical(pipeline=1000000000)")])), "from 1 to 65536"),
    (document(table([(1024, "hierarchical(ranks_per_node=0)")])), "ranks_per_node must be"),
    (document(table([(1024, "ring(direction=bogus)")])), "direction must be one of"),
    (document(table([(1024, "ring"), (1024, "tree")])), "two rules at 1024 B"),
    (json.dumps({"version": 99, "tables": []}), "version 99; this refcoll reads version 1"),
    # a layout no run can have: the table would never apply, without a word
    (document(table(RULES, nodes=2, per_node=1)), "4 ranks cannot lie on 2 node"),
    (document(table(RULES, nodes=2, per_node=4)), "at most 4 rank"),
])
def test_a_file_auto_cannot_follow_is_a_usage_error_naming_it(text, said):
    with pytest.raises(UsageError, match=said) as info:
        tuned.parse(text, "t.json")
    assert "t.json" in str(info.value)


def test_an_unreadable_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match=r"the tuning file \(REFCOLL_TUNING_FILE\) does not "
                                         "exist"):
        tuned.read(str(tmp_path / "absent.json"))


def report(rows, hosts=("a", "a", "b", "b"), collective="allreduce"):
    return {"header": {"collective": collective, "workers": len(hosts), "dtype": "float32",
                       "ranks": [{"rank": r, "host": h} for r, h in enumerate(hosts)]},
            "rows": [{"size": s, "algorithm": a, "time_us": t, "wrong": w} for s, a, t, w in rows]}


def test_tune_keeps_each_sizes_fastest_algorithm_that_auto_may_run():
    rows = [(1024, "ring", 30.0, 0), (1024, "hierarchical(pipeline=2)", 20.0, 0),
            (1024, "auto", 5.0, 0),  # auto itself is not a rule
            (4096, "ring", 50.0, 0), (4096, "naive", 10.0, 3),  # a wrong answer is not a rule
            (4096, "switch", 1.0, 0)]  # nor an algorithm that needs switch processes
    doc = tuned.from_bench([("runs/b.json", report(rows))])
    (only,) = doc["tables"]
    assert (only["ranks"], only["nodes"], only["per_node"], only["from"]) == (4, 2, 2, "b.json")
    assert [(r["bytes"], r["algorithm"]) for r in only["rules"]] == \
        [(1024, "hierarchical(pipeline=2)"), (4096, "ring")]
    tuning = tuned.parse(json.dumps(doc))
    assert tuning.choice("allreduce", 4, NodeShape(2, 2), 1024) == ("hierarchical", {"pipeline": 2})
    with pytest.raises(UsageError, match="no row auto may take"):
        tuned.from_bench([("b.json", report([(1024, "auto", 5.0, 0)]))])


def test_tune_leaves_out_rows_wrong_in_place_or_never_checked():
    """bench -c 0 times without judging (wrong: null), and a row may be right out of place
    but wrong in place: neither is a rule auto should follow."""
    rows = report([(1024, "ring", 30.0, 0), (1024, "naive", 5.0, None),
                   (4096, "ring", 50.0, 0), (4096, "tree", 10.0, 0)])
    rows["rows"][3]["inplace_wrong"] = 2
    (only,) = tuned.from_bench([("b.json", rows)])["tables"]
    assert [(r["bytes"], r["algorithm"]) for r in only["rules"]] == [(1024, "ring"),
                                                                      (4096, "ring")]
    with pytest.raises(UsageError, match=r"1 failed a check; 1 were not checked \(bench -c 0\)"):
        tuned.from_bench([("b.json", report([(1024, "ring", 5.0, 1),
                                             (4096, "ring", 5.0, None)]))])


def test_an_exclusion_leaves_a_rule_of_an_algorithm_auto_never_picks(tmp_path, monkeypatch):
    """REFCOLL_ALGO=^ring excludes ring alone: a rule naming naive or hierarchical (which
    auto never picks by itself) still stands, as a listed algorithm does."""
    path = tmp_path / "t.json"
    path.write_text(document(table([(256, "naive")], ranks=2)))
    monkeypatch.setenv(tuned.TUNING_ENV, str(path))
    monkeypatch.setenv("REFCOLL_ALGO", "^ring")
    seen = []
    from refcoll.transport import SimWorld
    SimWorld(2).run(lambda t: seen.append(resolve_with_options(t, "allreduce", 64, 4)))
    assert seen == [("naive", {}), ("naive", {})]
    monkeypatch.setenv("REFCOLL_ALGO", "^naive")
    seen.clear()
    SimWorld(2).run(lambda t: seen.append(resolve_with_options(t, "allreduce", 64, 4)[0]))
    assert "naive" not in seen


def test_an_algorithm_wrong_at_a_size_in_any_dtype_is_no_rule_there_and_0_b_rows_are_no_rows():
    # bench -d float,int8: recursive doubling fast in float, wrong in int8 at 64 KiB. The
    # rule would hold for every dtype, int8 too: ring stands. bench writes rows of 0 B
    # (nccl-tests does: a size that holds no element a rank); tune refused the report.
    rows = [(65536, "ring", 100.0, 0), (65536, "recursive_doubling", 84.0, 0),
            (65536, "ring", 400.0, 0), (65536, "recursive_doubling", 426.0, 4),
            (0, "ring", 0.5, 0), (1024, "recursive_doubling", 9.0, 0)]
    (only,) = tuned.from_bench([("b.json", report(rows))])["tables"]
    assert [(r["bytes"], r["algorithm"]) for r in only["rules"]] == [
        (1024, "recursive_doubling"), (65536, "ring")]


def test_a_second_table_for_a_layout_is_refused():
    # choice() stops at the first table of a layout: a second's rules were never read
    text = document(table([(1024, "ring")], ranks=2), table([(1 << 20, "naive")], ranks=2))
    with pytest.raises(UsageError, match=r"tables\[0\] and tables\[1\] are both for "
                                         "allreduce on 2 ranks, 1 nodes of 2"):
        tuned.parse(text)


def test_sweeps_of_one_layout_make_one_table_and_a_later_size_stands():
    small = report([(1024, "ring", 30.0, 0), (1024, "naive", 20.0, 0)])
    large = report([(1 << 20, "ring", 300.0, 0), (1024, "ring", 10.0, 0)])
    one_node = report([(1024, "naive", 1.0, 0)], hosts=("a",) * 4)
    doc = tuned.from_bench([("small.json", small), ("large.json", large), ("one.json", one_node)])
    two, one = doc["tables"]
    assert two["from"] == "small.json, large.json" and one["from"] == "one.json"
    assert [(r["bytes"], r["algorithm"]) for r in two["rules"]] == [
        (1024, "ring"), (1 << 20, "ring")]
    assert (one["nodes"], one["per_node"]) == (1, 4)


def test_an_algorithm_one_report_found_wrong_is_no_rule_from_another():
    # Two sweeps of one layout, one of them wrong at 64 KiB for recursive doubling: the
    # table's rule there is not recursive doubling, in either order of the reports.
    right = report([(65536, "recursive_doubling", 80.0, 0), (65536, "ring", 100.0, 0)])
    wrong = report([(65536, "recursive_doubling", 85.0, 5), (65536, "ring", 110.0, 0)])
    for order in ([("a.json", right), ("b.json", wrong)], [("b.json", wrong), ("a.json", right)]):
        (only,) = tuned.from_bench(order)["tables"]
        assert [(r["bytes"], r["algorithm"]) for r in only["rules"]] == [(65536, "ring")], order
    crossed = report([(65536, "recursive_doubling", 80.0, 0), (65536, "ring", 100.0, 3)])
    with pytest.raises(UsageError, match="a.json, b.json: at every size they timed, each "
                                         "algorithm auto may run was found wrong"):
        tuned.from_bench([("a.json", crossed), ("b.json", wrong)])


class _OtherLibrary:
    """A simulated rank seen as another library's (a torch process group's) ranks are: not
    MPI, and not one process, so not the simulator."""

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        if name == "world":
            raise AttributeError(name)
        return getattr(self._t, name)


def test_another_librarys_ranks_run_rank_0s_tuning_file(tmp_path, monkeypatch):
    """Over a torch process group each rank read its own file: ranks whose hosts held
    different files chose different algorithms (Gloo: a collective mismatch). Rank 0's file
    now goes to the others, as under MPI."""
    files = [tmp_path / f"rank{r}.json" for r in range(2)]
    for path, algorithm in zip(files, ("ring", "recursive_doubling")):
        path.write_text(document(table([(256, algorithm)], ranks=2)))
    monkeypatch.setenv(tuned.TUNING_ENV, "tuning.json")  # the same path, another file a host
    mine = threading.local()  # each simulated rank is a thread: its "host"
    monkeypatch.setattr(tuned, "_text", lambda path: files[mine.rank].read_text())

    def body(t):
        mine.rank = t.rank
        return resolve_with_options(_OtherLibrary(t), "allreduce", 64, 4)

    assert refcoll.SimWorld(2).run(body) == [("ring", {}), ("ring", {})]


def test_the_simulator_runs_what_the_file_names(tmp_path, monkeypatch):
    # the file says tree with segments at 64 KiB: auto runs it, bit for bit, and the
    # cost model's choice where the file does not reach
    path = tmp_path / "t.json"
    path.write_text(document(table([(1 << 16, "tree(segment=1024)")])))
    xs = [np.random.default_rng(r).standard_normal(1 << 14).astype(np.float32) for r in range(4)]
    small = [x[:64] for x in xs]
    model = refcoll.simulate("allreduce", small, algorithm="auto").outputs
    monkeypatch.setenv(tuned.TUNING_ENV, str(path))
    ran = refcoll.simulate("allreduce", xs, algorithm="auto").outputs
    named = refcoll.simulate("allreduce", xs, algorithm="tree", segment=1024).outputs
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ran, named))
    assert all(a.tobytes() == b.tobytes() for a, b in
               zip(refcoll.simulate("allreduce", small, algorithm="auto").outputs, model))


def test_simulate_auto_runs_prices_and_estimates_what_auto_chooses(monkeypatch):
    """auto's choice of hierarchical learnt the node layout by split_node, which the printed
    formula left out (rounds 8 against 4), and its memory was estimated for the cost model's
    choice, whatever REFCOLL_ALGO said (0.02 GiB for a ring of 16 GiB)."""
    from refcoll.verify.simulation import run_simulation, simulation_case

    monkeypatch.setenv("REFCOLL_ALGO", "hierarchical")
    case = simulation_case("auto", 4, 8, ranks_per_node=2)
    report = run_simulation(case)
    assert report.chosen.startswith("hierarchical")
    assert all(got == want for _, got, want in report.comparison()), report.comparison()
    assert report.node.predicted == (report.node.intra, report.node.inter)
    monkeypatch.setenv("REFCOLL_ALGO", "ring")
    assert (simulation_case("auto", 4096, 1).memory_bytes(moves_data=False)
            == simulation_case("ring", 4096, 1).memory_bytes(moves_data=False))


def test_the_simulator_refuses_a_file_it_cannot_read(tmp_path, monkeypatch):
    monkeypatch.setenv(tuned.TUNING_ENV, str(tmp_path / "absent.json"))
    with pytest.raises(UsageError, match="the tuning file .* does not exist"):
        refcoll.simulate("allreduce", [np.ones(4, np.float32)] * 2, algorithm="auto")


def cli(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "refcoll", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)


@needs_mpi
def test_bench_tune_and_auto_under_mpi(tmp_path, monkeypatch):
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    first = cli("bench", "-n", "2", "-b", "1K", "-e", "8K", "-f", "8", "--algorithm",
                "ring,naive,tree(segment=64)", "--against", "none", "-w", "1", "-i", "2",
                "--json", str(tmp_path / "b.json"))
    assert first.returncode == 0, first.stdout + first.stderr
    made = cli("tune", str(tmp_path / "b.json"), "-o", str(tmp_path / "t.json"))
    assert made.returncode == 0, made.stdout + made.stderr
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    fastest = {}
    for row in rows:
        if row["size"] not in fastest or row["time_us"] < fastest[row["size"]][0]:
            fastest[row["size"]] = (row["time_us"], row["algorithm"])
    (written,) = json.loads((tmp_path / "t.json").read_text())["tables"]
    assert {r["bytes"]: r["algorithm"] for r in written["rules"]} == \
        {size: algo for size, (_, algo) in fastest.items()}
    # auto, given the file, runs each size's rule: bench names what auto resolved to
    monkeypatch.setenv(tuned.TUNING_ENV, str(tmp_path / "t.json"))
    again = cli("bench", "-n", "2", "-b", "1K", "-e", "8K", "-f", "8", "--algorithm", "auto",
                "--against", "none", "-w", "1", "-i", "1", "--json", str(tmp_path / "a.json"))
    assert again.returncode == 0, again.stdout + again.stderr
    again_rows = json.loads((tmp_path / "a.json").read_text())["rows"]
    resolved = {r["size"]: r["resolved"] for r in again_rows}
    assert resolved == {size: algo for size, (_, algo) in fastest.items()}
    # a file rank 0 cannot read stops every rank with exit 2 and one reason
    monkeypatch.setenv(tuned.TUNING_ENV, str(tmp_path / "absent.json"))
    bad = cli("bench", "-n", "2", "-b", "1K", "-e", "1K", "--algorithm", "auto", "--against",
              "none", "-w", "1", "-i", "1")
    assert bad.returncode == 2 and "the tuning file (REFCOLL_TUNING_FILE) does not exist" in \
        bad.stdout + bad.stderr


def test_tune_refuses_to_write_over_its_own_report(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(report([(1024, "ring", 30.0, 0)])))
    before = path.read_text()
    for output in (str(path), str(tmp_path / "." / "b.json")):
        res = cli("tune", str(path), "-o", output)
        assert res.returncode == 2 and "is the file of BENCH_JSON" in res.stderr, res.stderr
    assert path.read_text() == before


def test_simulate_prices_what_auto_ran_under_a_tuning_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(document(table([(4096, "tree(segment=256)")], ranks=2)))
    env = dict(__import__("os").environ, **{tuned.TUNING_ENV: str(path)})
    res = cli("simulate", "--algorithm", "auto", "-p", "2", "--count", "1024", "--json",
              str(tmp_path / "s.json"), env=env)
    assert res.returncode == 0, res.stderr
    assert "auto ran: tree(segment=256)" in res.stdout
    got = json.loads((tmp_path / "s.json").read_text())
    assert got["chosen"] == "tree(segment=256)"
    ledger = dict(got["ledger"], reduced=got["ledger"]["max_rank_reduced"])
    assert got["cost"] == {k: ledger[k] for k in got["cost"]}  # the ledger's own counts
    assert got["cost"]["rounds"] == 8  # tree in 4 segments; the model's pick would differ


def test_tune_refuses_what_it_cannot_read(tmp_path):
    res = cli("tune", str(tmp_path / "absent.json"), "-o", str(tmp_path / "t.json"))
    assert res.returncode == 2 and "the bench report does not exist" in res.stderr
    (tmp_path / "x.json").write_text("[1, 2")
    res = cli("tune", str(tmp_path / "x.json"), "-o", str(tmp_path / "t.json"))
    assert res.returncode == 2 and "not valid JSON" in res.stderr
    assert not (tmp_path / "t.json").exists()


def test_resolve_names_the_tuned_choice_on_a_transport(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(document(table([(256, "naive")], ranks=2)))
    monkeypatch.setenv(tuned.TUNING_ENV, str(path))
    seen = []

    def job(t, x):
        seen.append(resolve_with_options(t, "allreduce", x.size, x.itemsize))
        return x

    from refcoll.transport import SimWorld
    SimWorld(2).run(job, [(np.ones(64, np.float32),)] * 2)
    assert seen == [("naive", {})] * 2


def test_a_compressed_report_says_why_its_rows_were_never_checked():
    compressed = report([(1024, "ring", 3.0, None)])
    compressed["header"]["compressor"] = "topk:ratio=0.01"
    with pytest.raises(UsageError, match=r"not checked \(a compressed run, which bench does not "
                                         r"judge\)"):
        tuned.from_bench([("c.json", compressed)])
