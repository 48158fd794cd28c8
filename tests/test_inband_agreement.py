"""What keeps the ranks on one path for a kept all-reduce, in one process.

A blocking all-reduce is kept as a plan by the agreed fields of its call
(``Call.key``: algorithm, op name, dtype, count), never by a buffer: every rank
must compute the same key for the same call, whatever it passes beside it (an op
spelled differently, ``out=`` or not, another shape), or one rank replays a kept
plan while another runs the call the ordinary way. The MPI half is
tests/mpi/test_inband_agreement_mpi.py.
"""

import numpy as np
import pytest

from refcoll.calls import plans
from refcoll.calls.args import PLAN_BYTES, checked
from refcoll.core.errors import UsageError
from refcoll.core.ops import get_op
from refcoll.transport import SimWorld
from refcoll.transport.base import TransportBase


class _Persistent(TransportBase):
    """A stand-in rank of a world with persistent exchanges (MPI's): what the checks look at."""

    def __init__(self, rank: int = 0, size: int = 2):
        super().__init__()
        self.rank, self.size = rank, size

    def persistent(self, sends, recvs, what: str = "persistent"):
        raise AssertionError("the checks record nothing")


def _key(t, x, op="sum", algorithm="ring", out=None, validate=True, **options):
    """Return the key the call's checks give (a stand-in: its arguments must pass them)."""
    return checked(t, t, "allreduce", x, op=op, root=None, algorithm=algorithm, out=out,
                   validate=validate, options=options).key


def test_every_spelling_of_an_op_keys_one_kept_plan():
    mpi = pytest.importorskip("mpi4py.MPI")
    t, x = _Persistent(), np.ones(8, np.float32)
    keys = {repr(op): _key(t, x, op) for op in ("sum", "SUM", "Sum", get_op("sum"), mpi.SUM)}
    assert set(keys.values()) == {("ring", "sum", np.dtype(np.float32), 8)}, keys
    assert _key(t, x, "Max") == _key(t, x, mpi.MAX) == ("ring", "max", np.dtype(np.float32), 8)
    assert _key(t, x, "avg") == ("ring", "avg", np.dtype(np.float32), 8)
    for op in ("bogus", mpi.BAND):  # no key at all: the checks name it
        with pytest.raises(UsageError, match="op"):
            _key(t, x, op, validate=False)


def test_every_spelling_of_an_op_reaches_the_one_kept_plan():
    """The quick look-up takes the lower-case name; every other spelling goes through the checks."""
    mpi = pytest.importorskip("mpi4py.MPI")
    t, x = _Persistent(), np.ones(8, np.float32)
    kept = object()  # stands for the Plan kept under the call's key
    t.cache["plans"] = {"kept": {_key(t, x): kept}}
    assert plans.reusable(t, x, "sum", "ring", None) is kept
    for op in ("SUM", get_op("sum"), mpi.SUM):
        assert plans.reusable(t, x, op, "ring", None) is None  # checked in full, then:
        assert plans.kept(t, _key(t, x, op)) is kept
    assert plans.reusable(t, x, "max", "ring", None) is None  # another op: not this plan
    assert plans.reusable(t, x, "sum", "tree", None) is None  # another algorithm
    assert plans.reusable(t, x.astype(np.float64), "sum", "ring", None) is None
    assert plans.reusable(t, np.ones(9, np.float32), "sum", "ring", None) is None


def test_out_and_the_shape_leave_the_key_as_it_is():
    """A rank that passes ``out=`` (or another shape of one count) keeps what its peers keep."""
    t = _Persistent()
    x = np.arange(16, dtype=np.float32)
    key = _key(t, x)
    assert _key(t, x, out=np.empty_like(x)) == key
    assert _key(t, x.copy(), out=None) == key
    assert _key(t, x.reshape(4, 4), out=np.empty((4, 4), np.float32)) == key
    assert _key(t, x.reshape(4, 4), out=np.empty(16, np.float32)) == key


def test_an_out_the_checks_would_refuse_never_reaches_a_kept_plan():
    """The quick look-up sends every ``out=`` the full checks would refuse to them."""
    t, x = _Persistent(), np.ones(16, np.float32)
    kept = object()
    t.cache["plans"] = {"kept": {_key(t, x): kept}}
    assert plans.reusable(t, x, "sum", "ring", x) is kept  # in place
    assert plans.reusable(t, x, "sum", "ring", np.empty_like(x)) is kept
    out = np.empty(16, np.float32)
    out.dtype = np.int32  # a dtype changed in place since the plan was kept
    readonly = np.empty_like(x)
    readonly.flags.writeable = False
    for bad in (out, np.empty(17, np.float32), np.empty(32, np.float32)[::2], readonly,
                [0.0] * 16):
        assert plans.reusable(t, x, "sum", "ring", bad) is None, bad
    y = np.ones(32, np.float32)
    assert plans.reusable(t, y[:16], "sum", "ring", y[8:24]) is None  # a partial overlap


def test_only_a_small_plain_numpy_all_reduce_on_persistent_exchanges_is_kept():
    t = _Persistent()
    largest = np.ones(PLAN_BYTES // 4, np.float32)
    assert _key(t, largest) is not None
    assert _key(t, np.ones(PLAN_BYTES // 4 + 1, np.float32)) is None  # its copies cost more
    assert _key(t, np.ones(8, np.float32), algorithm="tree", segment=4) is None  # options
    assert _key(_Persistent(0, 1), np.ones(8, np.float32)) is None  # one rank: nothing to replay
    simulated = SimWorld(2).run(lambda sim: checked(
        sim, sim, "allreduce", np.ones(8, np.float32), op="sum", root=None, algorithm="ring",
        out=None, validate=False, options={}).key)
    assert simulated == [None, None]  # no persistent exchanges: the algorithm runs again
