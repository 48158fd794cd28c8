"""hierarchical(level="rack"): the two levels are a rack's nodes and the uplinks between racks.

The racks come from the topology file (``REFCOLL_TOPO_FILE``) that the emulated cluster
writes, looked up by each rank's host; the simulator predicts the bits with
``ranks_per_node`` set to a rack's ranks.
"""

import json
import sys

import numpy as np
import pytest
from conftest import mpiexec_path

import refcoll
from refcoll.cluster import Cluster, missing_capability
from refcoll.core.calibration import Calibration
from refcoll.core.errors import UsageError

WHY = missing_capability()
needs_cluster = pytest.mark.skipif(WHY is not None or mpiexec_path() is None,
                                   reason=f"no emulated cluster here: {WHY or 'no mpiexec'}")


def test_a_level_is_node_or_rack_and_rack_takes_no_ranks_per_node():
    xs = [np.ones(8, np.float32) * r for r in range(4)]
    with pytest.raises(UsageError, match="level must be one of node, rack"):
        refcoll.simulate("allreduce", xs, algorithm="hierarchical", level="switch")
    with pytest.raises(UsageError, match="give one of them"):
        refcoll.simulate("allreduce", xs, algorithm="hierarchical", level="rack",
                         ranks_per_node=2)


def test_without_hosts_or_a_topology_every_rank_says_what_is_missing():
    # The simulator's ranks have no host names: every rank raises the same error.
    xs = [np.ones(8, np.float32) * r for r in range(4)]
    with pytest.raises(UsageError, match="every rank has no topology file") as info:
        refcoll.simulate("allreduce", xs, algorithm="hierarchical", level="rack")
    assert "give it ranks_per_node" in str(info.value)


JOB = """
import json, os, sys
import numpy as np
from mpi4py import MPI
import refcoll
from refcoll.algorithms._nodes import node_layout
from refcoll.core.errors import UsageError
from refcoll.transport.mpi import transport_for
w = MPI.COMM_WORLD
r = w.Get_rank()
t = transport_for(w)
out = {}
for n in (7, 1 << 16):
    x = (np.arange(n, dtype=np.float32) * 0.37 + r * 1.3).astype(np.float32)
    out[n] = [refcoll.allreduce(x, w, algorithm="hierarchical", level="rack").tolist(),
              refcoll.allreduce(x, w, algorithm="hierarchical").tolist()]
out["racks"] = node_layout(t, None, "rack").sizes
out["nodes"] = node_layout(t).sizes
# auto with the fixed calibration: the topology's links and uplinks price it
os.environ["REFCOLL_CALIBRATION"] = "default"
from refcoll.calls import auto
x = (np.arange(1 << 20, dtype=np.float32) * 0.37 + r * 1.3).astype(np.float32)
out["auto"] = refcoll.allreduce(x, w, algorithm="auto").tolist()
out["choice"] = auto.resolve_with_options(t, "allreduce", x.size, 4)
out["calibration"] = auto.calibration_for(t).to_json()
os.environ.pop("REFCOLL_TOPO_FILE")
try:  # a fresh communicator, so nothing is cached: without the file, every rank refuses
    refcoll.allreduce(np.ones(4, np.float32), w.Dup(), algorithm="hierarchical", level="rack")
except UsageError as exc:
    out["error"] = str(exc)
json.dump(out, open(sys.argv[1] % r, "w"))
"""


@needs_cluster
def test_racks_from_the_topology_file_give_the_simulators_bits(tmp_path):
    # 2 racks of 2 nodes of 1 rank: level="rack" makes groups of the 2 ranks of a rack.
    script = tmp_path / "job.py"
    script.write_text(JOB)
    bench = tmp_path / "bench.json"
    with Cluster(nodes=4, ranks_per_node=1, link="1gbit", racks=2, oversubscription=4) as c:
        res = c.run([sys.executable, str(script), str(tmp_path / "rank%d.json")],
                    capture_output=True, text=True, timeout=300)
        # bench names it with its options; its bound replays the schedule of racks of 2
        timed = c.run([sys.executable, "-m", "refcoll", "bench", "-b", "64K", "-e", "64K",
                       "-w", "1", "-i", "2", "--bound", "--against", "none", "--algorithm",
                       "hierarchical(level=rack,pipeline=2)", "--json", str(bench)],
                      capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert timed.returncode == 0, timed.stdout[-3000:] + timed.stderr[-3000:]
    (row,) = json.loads(bench.read_text())["rows"]
    assert row["algorithm"] == "hierarchical(level=rack,pipeline=2)"
    assert row["wrong"] == 0 and row["checked"] > 0 and row["bound_us"] > 0
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for n in (7, 1 << 16):
        xs = [(np.arange(n, dtype=np.float32) * 0.37 + r * 1.3).astype(np.float32)
              for r in range(4)]
        racks = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=2)
        nodes = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=1)
        for r, out in enumerate(outs):
            rack, node = (np.array(v, np.float32) for v in out[str(n)])
            assert rack.tobytes() == racks.outputs[r].tobytes(), (n, r)
            assert node.tobytes() == nodes.outputs[r].tobytes(), (n, r)
    for out in outs:
        assert out["racks"] == [2, 2] and out["nodes"] == [1, 1, 1, 1]
        assert "every rank has no topology file" in out["error"]
    # auto read the uplinks (a quarter of the rack's node links) and grouped by racks; the
    # simulator, given the calibration the job agreed on, runs the same choice
    record = outs[0]["calibration"]
    assert record["rack_nodes"] == 2 and record["rack_beta"] == pytest.approx(8 / 0.5e9)
    name, options = outs[0]["choice"]
    assert name == "hierarchical" and options["ranks_per_node"] == 2, outs[0]["choice"]
    fields = {k: record[k] for k in ("alpha", "beta", "gamma", "inter_alpha", "inter_beta",
                                     "nodes", "per_node", "rack_beta", "rack_nodes")}
    xs = [(np.arange(1 << 20, dtype=np.float32) * 0.37 + r * 1.3).astype(np.float32)
          for r in range(4)]
    predicted = refcoll.simulate("allreduce", xs, algorithm="auto", node_size=1,
                                 calibration=Calibration(**fields)).outputs
    for r, out in enumerate(outs):
        assert out["choice"] == outs[0]["choice"]
        assert np.array(out["auto"], np.float32).tobytes() == predicted[r].tobytes(), r
