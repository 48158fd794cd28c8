"""`refcoll model`'s refusals: every bad number, unit, bucket count, algorithm and output
path is one line on stderr naming the option and what to do, with exit status 2, before any
work; dbtree and switch are priced; a reader that leaves early ends the command quietly."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from refcoll.algorithms.dbtree import dbtree_allreduce_cost
from refcoll.algorithms.dbtree import dbtree_model_cost as dbtree_cost
from refcoll.cli import main
from refcoll.core.errors import UsageError
from refcoll.model import (
    ALGORITHMS,
    CHANNELLED,
    MAX_BUCKETS,
    MAX_GPUS,
    Cluster,
    Options,
    Workload,
    allreduce_estimate,
    buckets_of,
    parse_bandwidth,
    parse_count,
    parse_duration,
    plan,
    select_algorithms,
)

BASE = ["model", "--nodes", "2", "--gpus-per-node", "4", "--intra-bw", "900GB/s",
        "--inter-bw", "400Gb/s", "--bidirectional"]


def with_option(option, value, base=BASE):
    """Return ``base`` with ``option value`` (replacing it if ``base`` has it) and --params."""
    args = list(base)
    if option in args:
        i = args.index(option)
        args[i + 1] = value
    else:
        args += [option, value]
    if option != "--params" and "--params" not in args and "--calibrate" not in args:
        args += ["--params", "1e6"]
    return args


def refused(args, *needles):
    """Run ``args``; check exit 2 and one line on stderr that holds every needle; return it."""
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert res.stdout == ""  # refused before any work
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith("refcoll: error: ")
    for needle in needles:
        assert needle in line, line
    assert re.search(r"\b(give|write|add|choose|create|must be)\b", line), line  # says what to do
    return line


# ------------------------------------------------------------- 1. numbers: finite, positive

NUMERIC = [
    ("--params", ["nan", "inf", "-inf", "1e400", "-1", "0", "1.5", "many"]),
    ("--nodes", ["nan", "inf", "0", "-2", "2.5"]),
    ("--gpus-per-node", ["nan", "inf", "0", "-1"]),
    ("--bytes-per-element", ["nan", "inf", "0", "-4", "3"]),
    ("--forward", ["nan", "inf", "-1", "1e400", "-5ms"]),
    ("--backward", ["nan", "inf", "-0.1", "1e400s"]),
    ("--intra-bw", ["nanGB/s", "infGB/s", "1e400GB/s", "0GB/s", "-5GB/s", "0"]),
    ("--inter-bw", ["nanGb/s", "infGb/s", "0Gb/s", "-1Gb/s"]),
    ("--intra-latency", ["nanus", "infus", "1e400us", "-1us"]),
    ("--inter-latency", ["nanus", "inf", "-5us"]),
    ("--reduce-bw", ["nanTB/s", "infTB/s", "-1TB/s"]),
    ("--buckets", ["nan", "inf", "0", "-1", "2.5"]),
    ("--bucket-size", ["nan", "inf", "0", "-1MB", "1e400"]),
]


@pytest.mark.parametrize("option, value", [(o, v) for o, values in NUMERIC for v in values])
def test_every_bad_number_is_refused_naming_its_option(option, value):
    refused(with_option(option, value), option)


@pytest.mark.parametrize("option, value", [("-n", "nan"), ("-n", "inf"), ("-n", "0"),
                                           ("-n", "1"), ("--sizes", "nan"), ("--sizes", "0"),
                                           ("--sizes", "inf"), ("--sizes", "64K..1e400"),
                                           ("--sizes", "4G")])
def test_calibrate_numbers_are_refused_before_mpiexec_starts(option, value):
    refused(["model", "--calibrate", option, value], option)


def test_zero_is_allowed_where_it_means_something():
    # No latency, free reduction, no compute: 0 needs no unit and is not refused.
    res = CliRunner().invoke(main, BASE + ["--params", "1e6", "--intra-latency", "0",
                                           "--inter-latency", "0", "--reduce-bw", "0",
                                           "--forward", "0", "--backward", "0s"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output


def test_the_library_refuses_non_finite_numbers_too():
    with pytest.raises(UsageError, match="finite"):
        Workload.from_params(math.nan)
    with pytest.raises(UsageError, match="finite"):
        Workload.from_params(math.inf)
    with pytest.raises(UsageError, match="finite"):
        Workload(((10,),), forward=math.nan)
    with pytest.raises(UsageError, match="finite"):
        Cluster(2, 2, math.inf, 1e9)
    with pytest.raises(UsageError, match="finite"):
        Cluster(2, 2, 1e9, 1e9, inter_latency=math.nan)
    with pytest.raises(UsageError, match=f"at most {MAX_GPUS:,}"):
        Cluster(MAX_GPUS + 1, 1, 1e9, 1e9)
    assert parse_count("1.3e9", name="--params") == 1_300_000_000
    assert parse_count("12345678901234567891") == 12345678901234567891  # exact, not a float


def test_a_cluster_too_large_to_price_is_refused_at_once():
    line = refused(with_option("--nodes", str(MAX_GPUS)), "--nodes", "--gpus-per-node")
    assert f"{MAX_GPUS:,}" in line


# ---------------------------------------------------------------------- 2. units required

@pytest.mark.parametrize("option, value", [("--intra-bw", "600"), ("--inter-bw", "400"),
                                           ("--reduce-bw", "1e12"), ("--intra-bw", "600 ")])
def test_a_bandwidth_without_a_unit_is_refused_listing_the_units(option, value):
    line = refused(with_option(option, value), option, "unit", "GB/s", "Gbit/s", "MB/s")
    assert "600GB/s" in line or option != "--intra-bw"  # it shows what was probably meant


@pytest.mark.parametrize("option", ["--intra-latency", "--inter-latency"])
def test_a_latency_without_a_unit_is_refused_listing_the_units(option):
    refused(with_option(option, "2"), option, "unit", "us", "ns", "ms")


def test_the_accepted_units():
    assert parse_bandwidth("200Gbit/s") == parse_bandwidth("200Gb/s") == 25e9
    assert parse_bandwidth("100Gbps") == 12.5e9 and parse_bandwidth("300MB/s") == 300e6
    assert parse_bandwidth("0", zero=True) == 0
    with pytest.raises(UsageError, match="needs a unit"):
        parse_bandwidth("1e9")
    assert parse_duration("5us", unit=True) == pytest.approx(5e-6)
    assert parse_duration("0", unit=True) == 0
    assert parse_duration("0.05") == 0.05  # forward and backward: a bare number is seconds
    with pytest.raises(UsageError, match="needs a unit"):
        parse_duration("5", unit=True)


def test_help_states_units_and_limits():
    res = CliRunner().invoke(main, ["model", "--help"], catch_exceptions=False)
    text = " ".join(res.output.split())
    assert res.exit_code == 0
    assert "a number without a unit is refused" in text
    assert "Gbit/s" in text and "16384" in text and "100000" in text
    assert "1 (one bucket, no overlap)" in text
    assert "dbtree" in text and "--in-network" in text


# ------------------------------------------------------------------------------ 3. buckets

def test_zero_buckets_is_refused_saying_one_means_no_overlap():
    refused(with_option("--buckets", "0"), "--buckets", "at least 1", "1 means one bucket",
            "no overlap")


@pytest.mark.parametrize("buckets, params", [("1e11", "1e9"), (str(MAX_BUCKETS + 1), "1e9"),
                                             ("11", "10")])
def test_too_many_buckets_is_refused_at_once_with_the_limit(buckets, params):
    args = with_option("--params", params, with_option("--buckets", buckets))
    line = refused(args, "--buckets", "at most")
    assert f"{min(int(float(params)), MAX_BUCKETS):,}" in line


def test_a_bucket_size_making_too_many_buckets_is_refused():
    line = refused(with_option("--bucket-size", "1", BASE + ["--params", "1e9"]),
                   "--bucket-size", f"{MAX_BUCKETS:,}", "give at least")
    assert "40,000 B" in line  # 4 GB / 100,000 buckets


def test_the_largest_bucket_count_runs():
    res = CliRunner().invoke(main, ["model", "--nodes", "1", "--gpus-per-node", "2",
                                    "--intra-bw", "100GB/s", "--unidirectional", "--params",
                                    "1e9", "--buckets", str(MAX_BUCKETS), "--algorithm", "ring"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert f" {MAX_BUCKETS} " in res.output


def test_the_library_bounds_buckets_too():
    c, w = Cluster(2, 2, 1e11, 1e10), Workload.from_params(1000)
    for count in (0, 1001, 10 ** 11):
        with pytest.raises(UsageError, match="bucket"):
            buckets_of(w, count)
        with pytest.raises(UsageError, match="bucket"):
            plan(c, w, Options(("ring",), buckets=count))


# ------------------------------------------------------------------- 4. dbtree and switch

@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8, 12, 16, 31])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 1000, 65536, 131073, 65536 * 5 + 12345])
def test_the_model_dbtree_counts_are_the_registrys(p, n):
    assert dbtree_cost(p, n, 4).counts() == dbtree_allreduce_cost(p, n, 4).counts()


def test_dbtree_prices_a_model_sized_buffer_exactly():
    # For p a power of two >= 4: rounds = 4(2 lg p - 1) + 12(S-1), S segments per half.
    p, segments = 1024, 10_000
    c = dbtree_cost(p, 2 * segments * 65536, 2)
    assert c.rounds == 4 * (2 * 10 - 1) + 12 * (segments - 1)
    assert c.reduced == segments * 65536 * 2  # interior in one tree, a leaf in the other


def test_dbtree_in_the_cli_and_inside_the_hierarchical_all_reduce(tmp_path):
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(main, BASE + ["--params", "1e8", "--algorithm", "dbtree,ring",
                                           "--inter", "dbtree", "--json", str(out)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "dbtree" in res.output
    data = json.loads(out.read_text())
    assert [a["algorithm"] for a in data["allreduce"]] == ["dbtree", "ring"]
    c = Cluster(1, 8, 1e11, 1e10)
    est = allreduce_estimate(c, "dbtree", 1 << 20, 4)
    assert [ph.link for ph in est.phases] == ["intra"]
    assert est.bytes == dbtree_allreduce_cost(8, 1 << 20, 4).critical_bytes
    hier = allreduce_estimate(Cluster(4, 2, 1e11, 1e10), "hierarchical", 1 << 20, 4,
                              inter="dbtree")
    assert hier.phases[1].bytes == dbtree_allreduce_cost(4, 1 << 19, 4).critical_bytes


def test_switch_without_in_network_says_what_to_add_and_what_is_supported():
    line = refused(with_option("--algorithm", "switch"), "--in-network", "ring", "dbtree",
                   "hierarchical")
    assert "unknown" not in line
    refused(with_option("--inter", "switch"), "--inter", "--in-network")
    res = CliRunner().invoke(main, with_option("--algorithm", "switch,ring") + ["--in-network"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "switch" in res.output


@pytest.mark.parametrize("option", ["--algorithm", "--inter"])
def test_an_unknown_algorithm_lists_the_supported_ones(option):
    refused(with_option(option, "nccl_magic"), "'nccl_magic'", option, "ring", "tree", "dbtree",
            "recursive_doubling", "rabenseifner")


def test_select_algorithms():
    assert "switch" not in select_algorithms("all", in_network=False)
    usable = select_algorithms(None, in_network=True)
    # The registry's schedules in registry order (switch last), then the channelled ones.
    assert usable[len(ALGORITHMS) - 1] == "switch" and usable[len(ALGORITHMS):] == tuple(CHANNELLED)
    assert select_algorithms("dbtree, ring,dbtree", in_network=False) == ("dbtree", "ring")


# --------------------------------------------------------------------- 5. output paths first

def test_json_into_a_missing_folder_is_refused_before_the_run(tmp_path):
    missing = tmp_path / "no" / "plan.json"
    refused(BASE + ["--params", "1e9", "--buckets", "25", "--json", str(missing)], "--json",
            "does not exist", "create it")
    refused(BASE + ["--params", "1e9", "--json", str(tmp_path)], "--json", "is a folder")
    # --calibrate checks it before starting mpiexec.
    refused(["model", "--calibrate", "--json", str(missing)], "--json", "does not exist")


# --------------------------------------------------------------------- 6. a closed stdout pipe

def _pipeline(reader: str, tmp_path):
    err = tmp_path / "stderr"
    args = " ".join(BASE[1:] + ["--params", "1e9", "--buckets", "8", "--compressor", "fp16"])
    script = (f"set -o pipefail; {sys.executable} -m refcoll model {args} 2>{err} | {reader}")
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return res, err.read_text()


def test_a_reader_that_closed_the_pipe_ends_the_command_quietly(tmp_path):
    # The reader closes its end at once and lingers, so every write of refcoll meets EPIPE.
    res, err = _pipeline("(exec 0<&-; sleep 1)", tmp_path)
    assert err == "", err
    assert res.returncode == 141, (res.returncode, res.stderr)


def test_head_takes_the_first_line_and_nothing_is_said(tmp_path):
    res, err = _pipeline("head -1", tmp_path)
    assert err == "", err
    assert res.stdout.startswith("cluster: 2 nodes") and res.stdout.count("\n") == 1
    assert res.returncode in (0, 141)


def test_back_to_back_without_calibrate_is_refused():
    refused(with_option("--nodes", "2") + ["--back-to-back"], "--back-to-back", "--calibrate")
