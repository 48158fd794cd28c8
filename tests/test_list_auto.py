"""``refcoll list`` prints auto's table: its change points are auto's own, its columns line up."""

import json

import pytest
from click.testing import CliRunner

from refcoll.calls import auto
from refcoll.calls.auto import DEFAULT, AlgoFilter, Calibration, choice_changes, choose
from refcoll.cli import listing, main


def separators(line: str) -> list[int]:
    return [i for i, ch in enumerate(line) if ch == "|"]


def table_blocks(output: str) -> dict[str, list[str]]:
    """Return the table's lines per collective, from ``refcoll list``'s output."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("auto's table"))
    blocks, current = {}, None
    for line in lines[start + 2:]:
        if not line.startswith("  "):
            break
        if line.startswith("    "):
            blocks[current].append(line)
        elif not line.strip().endswith(")") and ":" not in line:
            current = line.strip()
            blocks[current] = []
    return blocks


def agrees_with_choose(collective, p, changes, calibration=DEFAULT, allowed=None, itemsize=4):
    """Assert auto picks each entry's algorithm at its count and the previous one just below."""
    assert changes[0]["count"] == 1
    assert choose(collective, p, 1, itemsize, calibration, allowed) == changes[0]["algorithm"]
    for before, entry in zip(changes, changes[1:]):
        assert entry["algorithm"] != before["algorithm"]
        assert entry["bytes"] == entry["count"] * itemsize
        assert choose(collective, p, entry["count"] - 1, itemsize, calibration,
                      allowed) == before["algorithm"]
        assert choose(collective, p, entry["count"], itemsize, calibration,
                      allowed) == entry["algorithm"]


@pytest.fixture(scope="module")
def listed(tmp_path_factory):
    """``refcoll list --json`` with the fixed calibration (the table is the slow part: once)."""
    out = tmp_path_factory.mktemp("list") / "list.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REFCOLL_CALIBRATION", "default")
        mp.delenv("REFCOLL_ALGO", raising=False)
        res = CliRunner().invoke(main, ["list", "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output, json.loads(out.read_text())


def test_every_row_of_every_table_has_its_separators_at_the_same_offsets(listed):
    output, data = listed
    blocks = table_blocks(output)
    assert list(blocks) == list(data["auto"]["table"]["collectives"])
    assert "allreduce" in blocks
    for collective, lines in blocks.items():
        assert len(lines) == 1 + len(auto.TABLE_PS), collective
        offsets = {tuple(separators(line)) for line in lines}
        assert len(offsets) == 1 and offsets != {()}, (collective, lines)
        assert [line.split("|")[0].strip() for line in lines[1:]] == [str(p) for p in
                                                                       auto.TABLE_PS]


def test_the_heading_names_the_calibration_and_the_json_keeps_the_old_grid(listed):
    output, data = listed
    heading = next(line for line in output.splitlines() if line.startswith("auto's table"))
    assert "p = 2…64" in heading and "fixed defaults" in heading
    table = data["auto"]["table"]
    assert table["ps"] == list(auto.TABLE_PS) and table["dtype"] == "float32"
    assert table["largest_bytes"] == auto.TABLE_LARGEST
    grid = data["auto"]["allreduce_float32"]  # the earlier grid, kept for its readers
    assert {row["p"] for row in grid} == {2, 4, 8, 16, 64}
    assert {row["algorithm"] for row in grid} <= set(auto.candidates("allreduce"))
    assert output.splitlines()[-2].startswith("gpu: ")  # the device lines still end it


@pytest.mark.parametrize("p", [2, 3, 7, 12, 64])
def test_the_printed_change_points_are_autos_own_choices(listed, p):
    _, data = listed
    for collective, rows in data["auto"]["table"]["collectives"].items():
        row = next(r for r in rows if r["p"] == p)
        agrees_with_choose(collective, p, row["changes"])
        top = auto.TABLE_LARGEST // 4
        assert choose(collective, p, top, 4, DEFAULT) == row["changes"][-1]["algorithm"]
        for entry in row["changes"]:
            want = auto.modelled_time(entry["algorithm"], collective, p, entry["count"], 4,
                                      DEFAULT)
            assert entry["predicted_s"] == pytest.approx(want)


def test_the_text_shows_the_json_changes(listed):
    output, data = listed
    lines = table_blocks(output)["allreduce"]
    for row, line in zip(data["auto"]["table"]["collectives"]["allreduce"], lines[1:]):
        cells = [cell.strip() for cell in line.split("|")]
        assert cells[1] == row["changes"][0]["algorithm"]
        assert [c.split(" ≥ ")[0] for c in cells[2:] if c] == \
            [entry["algorithm"] for entry in row["changes"][1:]]


@pytest.mark.parametrize("p,filter_text", [(5, ""), (8, "^rabenseifner"), (6, "ring,tree")])
def test_change_points_hold_for_another_calibration_and_refcoll_algo(p, filter_text):
    calibration = Calibration(alpha=2e-5, beta=4e-11, gamma=3e-10)
    allowed = AlgoFilter.parse(filter_text).allowed("allreduce")
    changes = choice_changes("allreduce", p, 4, calibration, allowed, largest=1 << 24)
    agrees_with_choose("allreduce", p, changes, calibration, allowed)
    assert {c["algorithm"] for c in changes} <= set(allowed)


def test_refcoll_algo_is_named_and_obeyed(monkeypatch):
    monkeypatch.setenv("REFCOLL_CALIBRATION", "default")
    monkeypatch.setenv("REFCOLL_ALGO", "ring,recursive_doubling")
    monkeypatch.setattr(listing, "TABLE_PS", (2, 3, 4))
    res = CliRunner().invoke(main, ["list"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    heading = next(line for line in res.output.splitlines() if line.startswith("auto's table"))
    assert "REFCOLL_ALGO=ring,recursive_doubling" in heading
    blocks = table_blocks(res.output)
    assert list(blocks) == ["allreduce"]  # one algorithm left for the others
    assert "reduce_scatter: always ring" in res.output
    for line in blocks["allreduce"][1:]:
        cells = [cell.strip() for cell in line.split("|")][1:]
        assert {c.split(" ≥ ")[0] for c in cells if c} <= {"ring", "recursive_doubling"}


def test_widths_come_from_the_contents():
    rows = [{"p": 2, "changes": [{"count": 1, "bytes": 4, "algorithm": "a"}]},
            {"p": 128, "changes": [{"count": 1, "bytes": 4, "algorithm": "a_long_name"},
                                   {"count": 9000, "bytes": 36000, "algorithm": "b"},
                                   {"count": 99000, "bytes": 396000, "algorithm": "c"}]}]
    lines = listing.table_lines(rows)
    assert len({tuple(separators(line)) for line in lines}) == 1
    assert lines == ["  p | from 4 B    | then         | then",
                     "  2 | a           |              |",
                     "128 | a_long_name | b ≥ 35.2 KiB | c ≥ 387 KiB"]


def test_a_tuning_file_is_named_beside_the_table_it_overrides(tmp_path, monkeypatch):
    """auto follows REFCOLL_TUNING_FILE where its tables apply: list says so, and a file it
    cannot read is refused before anything is printed."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"version": 1, "tables": [
        {"collective": "allreduce", "ranks": 2, "nodes": 1, "per_node": 2,
         "rules": [{"bytes": 1024, "algorithm": "tree", "time_us": 1.0},
                   {"bytes": 4096, "algorithm": "ring", "time_us": 2.0}]}]}))
    monkeypatch.setenv("REFCOLL_TUNING_FILE", str(path))
    out = tmp_path / "list.json"
    res = CliRunner().invoke(main, ["list", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert f"REFCOLL_TUNING_FILE={path}: where one of its tables applies" in res.output
    assert "allreduce on 2 ranks (1 nodes x 2): 2 rules, for calls of 512 to 8192 B" in \
        res.output
    tuning = json.loads(out.read_text())["auto"]["tuning"]
    assert tuning["file"] == str(path) and tuning["tables"][0]["reach_bytes"] == [512, 8192]
    monkeypatch.setenv("REFCOLL_TUNING_FILE", str(tmp_path / "absent.json"))
    res = CliRunner().invoke(main, ["list"])
    assert res.exit_code == 2 and "does not exist" in res.output
    assert "algorithms:" not in res.output


@pytest.mark.parametrize("path,says", [("/dev/null", "--json /dev/null: is not a regular file"),
                                       ("/nonexistent/x.json", "folder /nonexistent does not")])
def test_a_json_path_it_cannot_write_is_refused_before_the_listing(path, says):
    res = CliRunner().invoke(main, ["list", "--json", path])
    assert res.exit_code == 2 and says in res.output, res.output
    assert "algorithms:" not in res.output
