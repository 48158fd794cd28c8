"""An algorithm with its options in one word: auto's names, bench's --algorithm."""

import json
import subprocess
import sys

import pytest
from conftest import mpiexec_path

from refcoll.algorithms.spelling import spell, split_spelled, unspell
from refcoll.bench.options import (
    algorithm_options,
    check_algorithm,
    parse_algorithms,
    registry_name,
)
from refcoll.core.errors import UsageError
from refcoll.model.pricing import estimate_name


@pytest.mark.parametrize("name,options,word", [
    ("ring", {}, "ring"),
    ("hierarchical", {"inter": "ring"}, "hierarchical(inter=ring)"),
    ("hierarchical", {"inter": "recursive_doubling", "pipeline": 8},
     "hierarchical(inter=recursive_doubling,pipeline=8)"),
    ("dbtree", {"segment": -3}, "dbtree(segment=-3)"),
])
def test_a_word_reads_back_as_the_name_and_options_it_was_written_from(name, options, word):
    assert spell(name, options) == word
    assert unspell(word) == (name, options)
    assert unspell(f"  {word.replace(',', ' , ')} ") == (name, options)


@pytest.mark.parametrize("bad", ["", "hier(x", "ring(a)", "ring(=1)", "ring(a=)", "ring(a=1,a=2)",
                                 "1ring", "ring)("])
def test_a_word_that_does_not_read_is_a_usage_error_showing_the_form(bad):
    with pytest.raises(UsageError, match=r"hierarchical\(inter=ring,pipeline=8\)"):
        unspell(bad)


def test_a_number_of_thousands_of_digits_is_a_usage_error_not_pythons_value_error():
    """int() refuses past 4300 digits with a ValueError: a tuning file's or a bench
    report's tree(segment=999...) ended every rank, or refcoll tune, in a traceback."""
    with pytest.raises(UsageError, match="has 5000 digits"):
        unspell("tree(segment=" + "9" * 5000 + ")")
    assert unspell("tree(segment=" + "9" * 30 + ")") == ("tree", {"segment": int("9" * 30)})


def test_a_list_is_cut_at_commas_outside_parentheses():
    assert split_spelled("ring, hierarchical(inter=ring,pipeline=4),auto,") == \
        ["ring", "hierarchical(inter=ring,pipeline=4)", "auto"]


def test_the_model_names_its_rows_in_the_same_form():
    assert estimate_name("hierarchical", "tree") == spell("hierarchical", {"inter": "tree"})


def test_bench_reads_its_algorithms_and_refuses_what_they_do_not_take():
    assert parse_algorithms("all") is None
    words = parse_algorithms("ring,hierarchical(inter=tree,pipeline=2),ring")
    assert words == ["ring", "hierarchical(inter=tree,pipeline=2)"]
    assert [registry_name(w) for w in words] == ["ring", "hierarchical"]
    assert algorithm_options(words[1]) == {"inter": "tree", "pipeline": 2}
    with pytest.raises(UsageError, match="unknown algorithm 'rung"):
        parse_algorithms("ring,rung(x=1)")
    with pytest.raises(UsageError, match="does not take the option pipelin"):
        check_algorithm("hierarchical(pipelin=2)", "allreduce")
    with pytest.raises(UsageError, match="choose an algorithm that takes it: hierarchical"):
        check_algorithm("ring(pipeline=2)", "allreduce")


@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_bench_runs_an_algorithm_with_its_options_and_names_the_rows_so(tmp_path, monkeypatch):
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    out = tmp_path / "bench.json"
    word = "hierarchical(ranks_per_node=1,inter=recursive_doubling,pipeline=3)"
    res = subprocess.run([sys.executable, "-m", "refcoll", "bench", "-n", "2", "-b", "64",
                          "-e", "4K", "-f", "64", "--algorithm", f"ring,{word}", "-i", "2", "-w",
                          "1", "--bound", "--against", "none", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["size"], r["algorithm"]) for r in rows] == [(s, a) for s in (64, 4096)
                                                          for a in ("ring", word)]
    assert all(r["wrong"] == 0 and r["checked"] > 0 and r["bound_us"] > 0 for r in rows)
    assert f"Avg bus bandwidth ({word})" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "refcoll", "bench", "-n", "2", "-b", "64", "-e",
                          "64", "--algorithm", "hierarchical(pipeline=0)", "--against", "none"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and not bad.stdout  # refused before the launch: no table
    assert bad.stderr.count("pipeline must be a whole number of segments") == 1, bad.stderr
