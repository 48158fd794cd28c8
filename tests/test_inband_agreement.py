"""What keeps the ranks on one path for a prepared all-reduce, in one process.

Every rank must prepare the same calls and drop them at the same call, or one
rank replays a plan while another runs the call the ordinary way (they then wait
for each other until the timeout). The MPI half is tests/mpi/test_inband_agreement_mpi.py.
"""

import pytest

from refcoll.calls import prepared
from refcoll.calls.prepared import op_key
from refcoll.core.ops import get_op


def test_every_spelling_of_an_op_keys_one_prepared_call():
    mpi = pytest.importorskip("mpi4py.MPI")
    assert op_key("sum") == op_key("SUM") == op_key(get_op("sum")) == op_key(mpi.SUM) == "sum"
    assert op_key("Max") == op_key(mpi.MAX) == "max"
    assert op_key("avg") == "avg"
    assert op_key("bogus") == "bogus"  # the ordinary checks name it
    assert op_key(mpi.BAND) is mpi.BAND


class _Entry:
    freed = 0

    def free(self):
        _Entry.freed += 1


def test_bound_calls_never_push_a_prepared_call_out(monkeypatch):
    """A rank that binds many buffers keeps every prepared call its peers keep."""
    monkeypatch.setattr(prepared, "PREPARED_KEPT", 8)  # 2 bound, 6 prepared
    monkeypatch.setattr(_Entry, "freed", 0)
    cache = {("ring", "sum", "f4", n): _Entry() for n in range(6)}
    for i in range(10):
        prepared._make_room(cache, True)
        cache[("bound", i)] = _Entry()
    assert [k for k in cache if k[0] != "bound"] == [("ring", "sum", "f4", n) for n in range(6)]
    assert [k for k in cache if k[0] == "bound"] == [("bound", 8), ("bound", 9)]
    prepared._make_room(cache, False)  # a seventh prepared call drops the oldest prepared one
    assert ("ring", "sum", "f4", 0) not in cache and len(cache) == 7
    assert _Entry.freed == 9
