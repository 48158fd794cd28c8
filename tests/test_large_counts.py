"""Counts past 2**31: chunking, cost formulas, the ledger, and a real MPI run.

Fast tests hold the arithmetic to Python ints (no 32-bit overflow anywhere):
:func:`refcoll.core.chunking.chunk_bounds` and friends at ``n = 2**33 + 5``, the cost
functions of ring, Rabenseifner and the binomial tree at ``n = 3·2**31`` against
their closed forms, and the :class:`~refcoll.transport.base.Ledger`'s sums over
messages of more than 2**31 bytes.

What the fast tests cannot do: move a message of more than 2**31 bytes through
the simulator. ``SimWorld`` copies real bytes from the sender's buffer into the
receiver's (``recv.buf[...] = send.buf``) and every transport buffer must be
C-contiguous (:func:`refcoll.transport.sim.as_bytes`), so there is no cheap
stand-in (a zero-stride view is refused, and writing a lazily mapped buffer
commits its pages): it needs 4 GiB and runs as a slow test.

Slow tests (``-m slow``):

* the simulator broadcasts ``2**31 + 3`` bytes between two ranks (4 GiB);
* ``mpiexec -n 2`` all-reduces ``2**31 + 3`` int8 elements per rank (2 GiB + 3 B)
  with ``ring``, whose indices and offsets pass 2**31 but whose messages at p = 2
  are half the buffer (2**30 + 2 B), and then with ``recursive_doubling``, whose
  one exchange at p = 2 is the whole buffer: a 2**31 + 3-byte message through
  mpi4py's large-count (MPI-4 ``_c``) calls. Each rank's input is a known function
  of the index, so every output byte is checked (in 64 MiB blocks) without
  holding the other rank's input, and a few positions around 2**30 and 2**31 are
  checked against a pure-Python formula. About 6 GiB per rank at the peak.

This file is also the MPI worker: ``mpiexec -n 2 python tests/test_large_counts.py``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
import pytest

from refcoll.algorithms.naive import naive_broadcast_cost
from refcoll.algorithms.rabenseifner import rabenseifner_allreduce_cost
from refcoll.algorithms.recursive_doubling import recursive_doubling_allreduce_cost
from refcoll.algorithms.ring import ring_allreduce_cost
from refcoll.algorithms.tree import tree_allreduce_cost
from refcoll.core.chunking import chunk_bounds, chunk_sizes, chunk_slice, max_chunk
from refcoll.transport.base import Ledger, Message

#: Elements of the large runs: past INT_MAX, odd, so chunks are uneven.
LARGE_N = 2**31 + 3
#: Memory the two-rank MPI run needs, with room to spare (bytes).
MPI_RUN_BYTES = 14 << 30
#: Words per block when checking a large output (64 MiB of words).
BLOCK_WORDS = 1 << 24


# --------------------------------------------------------------------- chunking

@pytest.mark.parametrize("n,p", [(2**33 + 5, 7), (2**33 + 5, 1), (3 * 2**31, 8),
                                 (2**31 + 3, 2), (2**40 + 1, 1000)])
def test_chunking_is_exact_past_int32(n, p):
    q, e = divmod(n, p)
    bounds = chunk_bounds(n, p)
    assert len(bounds) == p
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for i, (start, stop) in enumerate(bounds):
        assert type(start) is int and type(stop) is int
        assert start == i * q + min(i, e)  # the module's closed form
        assert stop - start == q + (1 if i < e else 0)
        if i:
            assert start == bounds[i - 1][1]  # contiguous, no gap or overlap
    assert chunk_sizes(n, p) == [stop - start for start, stop in bounds]
    assert sum(chunk_sizes(n, p)) == n
    for i in (0, e - 1 if e else 0, e, p - 1):
        if 0 <= i < p:
            sl = chunk_slice(n, p, i)
            assert (sl.start, sl.stop) == bounds[i]
    assert max_chunk(n, p) == q + (1 if e else 0)


def test_chunk_bounds_of_2_33_plus_5_by_7_by_hand():
    # 2**33 + 5 = 8589934597 = 7 * 1227133513 + 6: six chunks of 1227133514, one less.
    bounds = chunk_bounds(2**33 + 5, 7)
    assert bounds[0] == (0, 1227133514)
    assert bounds[5] == (5 * 1227133514, 6 * 1227133514)
    assert bounds[6] == (6 * 1227133514, 2**33 + 5)
    assert bounds[6][1] - bounds[6][0] == 1227133513


# ------------------------------------------------------------------------- costs

N_BIG = 3 * 2**31  # 6442450944: divisible by 2**31's factors only, so p = 8 divides it
ITEMSIZE = 4


def _all_ints(c) -> bool:
    return all(type(v) is int for v in c.counts().values())


@pytest.mark.parametrize("p", [2, 3, 5, 7, 8, 16])
def test_ring_allreduce_cost_past_int32(p):
    n, s = N_BIG, ITEMSIZE
    q, e = divmod(n, p)
    c = ring_allreduce_cost(p, n, s)
    assert _all_ints(c)
    # Rank r sends all chunks but r and r+1's; the smallest adjacent pair is two short
    # chunks unless only the last chunk is short (then short + long).
    smallest_pair = 2 * q + (1 if e and p - e == 1 else 0)
    assert c.counts() == {
        "rounds": 2 * (p - 1),
        "messages": 2 * p * (p - 1),
        "bytes": 2 * (p - 1) * n * s,
        "max_rank_messages": 2 * (p - 1),
        "max_rank_bytes": (2 * n - smallest_pair) * s,
        "critical_bytes": 2 * (p - 1) * -(-n // p) * s,
        "reduced": n - q,
    }
    if e == 0:  # the textbook form, exactly: 2((p-1)/p)·n bytes on the critical path
        assert c.critical_bytes == 2 * (p - 1) * n * s // p


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_rabenseifner_allreduce_cost_past_int32_power_of_two(p):
    n, s = N_BIG, ITEMSIZE
    lg = p.bit_length() - 1
    c = rabenseifner_allreduce_cost(p, n, s)
    assert _all_ints(c)
    # Thakur, Rabenseifner & Gropp 2005: 2 lg p·α + 2((p-1)/p)·n·β + ((p-1)/p)·n·γ.
    assert c.counts() == {
        "rounds": 2 * lg,
        "messages": 2 * lg * p,
        "bytes": 2 * (p - 1) * n * s,
        "max_rank_messages": 2 * lg,
        "max_rank_bytes": 2 * (p - 1) * n * s // p,
        "critical_bytes": 2 * (p - 1) * n * s // p,
        "reduced": (p - 1) * n // p,
    }


@pytest.mark.parametrize("p", [3, 5, 6, 7, 12])
def test_rabenseifner_allreduce_cost_past_int32_with_the_fold(p):
    n, s = N_BIG, ITEMSIZE
    pof2 = 1 << (p.bit_length() - 1)
    rem, lg = p - pof2, pof2.bit_length() - 1
    c = rabenseifner_allreduce_cost(p, n, s)
    assert _all_ints(c)
    # The docstring's form: (2 lg p' + 2)·α + (2(p'-1)/p' + 2)·n·β + (1 + (p'-1)/p')·n·γ.
    assert c.rounds == 2 * lg + 2
    assert c.messages == 2 * rem + 2 * lg * pof2
    assert c.bytes == (2 * rem * n + 2 * (pof2 - 1) * n) * s
    assert c.critical_bytes == (2 * (pof2 - 1) * n // pof2 + 2 * n) * s
    assert c.reduced == n + (pof2 - 1) * n // pof2


@pytest.mark.parametrize("p", [2, 3, 5, 8, 9])
@pytest.mark.parametrize("segment", [None, 1 << 20])
def test_tree_allreduce_cost_past_int32(p, segment):
    n, s = N_BIG, ITEMSIZE
    lg = (p - 1).bit_length()
    segments = 1 if segment is None else -(-n // segment)
    c = tree_allreduce_cost(p, n, s, segment=segment)
    assert _all_ints(c)
    assert c.counts() == {
        "rounds": 2 * lg * segments,
        "messages": 2 * (p - 1) * segments,
        "bytes": 2 * (p - 1) * n * s,
        "max_rank_messages": lg * segments,
        "max_rank_bytes": lg * n * s,
        "critical_bytes": 2 * lg * n * s,
        "reduced": lg * n,
    }


@pytest.mark.parametrize("name", ["naive", "ring", "recursive_doubling", "rabenseifner", "tree",
                                  "hierarchical"])
def test_every_closed_form_cost_is_int_and_time_finite_past_int32(name):
    """The cheap cost functions (no schedule replay) stay exact ints at n = 3·2**31."""
    from refcoll import algorithms

    for collective, fn in algorithms.get(name).costs.items():
        for p in (2, 7, 8):
            c = fn(p, N_BIG, ITEMSIZE)
            assert _all_ints(c), (collective, p, c.counts())
            assert min(c.counts().values()) >= 0
            assert c.bytes >= N_BIG * ITEMSIZE  # every rank's data moves at least once
            assert np.isfinite(c.time(3e-6, 2.5e-10, 1e-9))


# ------------------------------------------------------------------------ ledger

def test_ledger_sums_messages_past_int32_exactly():
    big = [2**31 + 3, 3 * 2**31, 2**33]
    ledger = Ledger(messages=[Message(1, 0, 1, big[0], 0, 0), Message(1, 1, 0, big[1], 0, 0),
                              Message(2, 0, 1, big[2], 0, 0)])
    assert ledger.counts() == {
        "rounds": 2,
        "messages": 3,
        "bytes": sum(big),
        "max_rank_messages": 2,
        "max_rank_bytes": big[0] + big[2],
        "critical_bytes": big[1] + big[2],
        "reduced": 0,
    }
    assert all(type(v) is int for v in ledger.counts().values())


def test_simulator_refuses_the_cheap_stand_ins():
    """A zero-stride view cannot stand in for a big buffer: transports need contiguous memory."""
    from refcoll.transport.base import as_bytes

    fake = np.broadcast_to(np.zeros(1, np.uint8), (LARGE_N,))
    with pytest.raises(ValueError, match="C-contiguous"):
        as_bytes(fake)


# --------------------------------------------------------- large inputs, cheaply

def _word_constants(rank: int) -> tuple[int, int]:
    """The odd multiplier and offset of rank ``rank``'s words (distinct per rank)."""
    return 2 * rank + 1, (0x9E3779B9 * (rank + 1)) & 0xFFFFFFFF


def pattern_words(start: int, stop: int, rank: int) -> np.ndarray:
    """Return words ``start..stop-1`` of rank ``rank``'s input: ``k·a + b mod 2**32``.

    The input's bytes are these little-endian words' bytes, so element ``i`` is
    byte ``i % 4`` of word ``i // 4``: no period short of 2**34 bytes, and a
    chunk written at a wrong offset shows.
    """
    a, b = _word_constants(rank)
    words = np.arange(start, stop, dtype="<u4")
    words *= np.uint32(a)
    words += np.uint32(b)
    return words


def pattern(n: int, rank: int) -> np.ndarray:
    """Return rank ``rank``'s input of ``n`` int8 elements (a view of its words)."""
    return pattern_words(0, -(-n // 4), rank).view(np.int8)[:n]


def pattern_byte(i: int, rank: int) -> int:
    """Return element ``i`` of rank ``rank``'s input as an unsigned byte, in pure Python."""
    a, b = _word_constants(rank)
    word = ((i // 4) * a + b) % 2**32
    return (word >> (8 * (i % 4))) & 0xFF


def expected_sum(i: int, ranks: int) -> int:
    """Return element ``i`` of the int8 sum over ``ranks`` ranks, in pure Python."""
    total = sum(pattern_byte(i, r) for r in range(ranks)) % 256
    return total - 256 if total >= 128 else total


def sample_positions(n: int) -> list[int]:
    """Positions worth a look: both ends, the p = 2 chunk boundary, and around 2**31."""
    half = -(-n // 2)
    return sorted(i for i in {0, 1, 2, 3, half - 1, half, half + 1, 2**31 - 1, 2**31,
                              2**31 + 1, n - 2, n - 1} if 0 <= i < n)


def mismatched_blocks(out: np.ndarray, n: int, ranks: int) -> int:
    """Return how many bytes of ``out`` differ from the sum of every rank's pattern."""
    got = out.view(np.uint8)
    bad = 0
    words = -(-n // 4)
    for start in range(0, words, BLOCK_WORDS):
        stop = min(start + BLOCK_WORDS, words)
        want = pattern_words(start, stop, 0).view(np.uint8).copy()
        for r in range(1, ranks):
            want += pattern_words(start, stop, r).view(np.uint8)  # wraps, as int8 does
        lo, hi = 4 * start, min(4 * stop, n)
        bad += int(np.count_nonzero(got[lo:hi] != want[: hi - lo]))
    return bad


def test_pattern_matches_its_pure_python_formula():
    n = 4 * 1000 + 3
    for rank in (0, 1, 5):
        x = pattern(n, rank)
        for i in (0, 1, 2, 3, 4, 517, n - 1):
            assert int(x.view(np.uint8)[i]) == pattern_byte(i, rank)
    total = (pattern(n, 0).astype(np.int16) + pattern(n, 1)).astype(np.int8)
    assert [int(v) for v in total[[0, 7, n - 1]]] == [expected_sum(i, 2) for i in (0, 7, n - 1)]
    assert mismatched_blocks(total, n, 2) == 0
    total[9] += 1
    assert mismatched_blocks(total, n, 2) == 1


# ------------------------------------------------------------------- slow: memory

def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


@pytest.mark.slow
@pytest.mark.skipif(_available_bytes() < (6 << 30), reason="needs about 5 GiB of free memory")
def test_simulator_moves_a_message_past_2_31_bytes():
    import refcoll
    from refcoll.transport import SimWorld

    n = LARGE_N
    world = SimWorld(2)

    def rank_main(t):
        buf = pattern(n, 0) if t.rank == 0 else np.empty(-(-n // 4), "<u4").view(np.int8)[:n]
        refcoll.broadcast(buf, 0, t, out=buf, algorithm="naive", validate=False)
        return mismatched_blocks(buf, n, 1), [int(buf.view(np.uint8)[i]) for i in
                                              sample_positions(n)]

    results = world.run(rank_main)
    assert [m.nbytes for m in world.ledger.messages] == [n]  # one message past 2**31 bytes
    assert world.ledger.counts() == naive_broadcast_cost(2, n, 1).counts()
    for bad, sampled in results:
        assert bad == 0
        assert sampled == [pattern_byte(i, 0) for i in sample_positions(n)]


@pytest.mark.slow
@pytest.mark.skipif(_available_bytes() < MPI_RUN_BYTES, reason="needs about 14 GiB of free memory")
def test_mpi_allreduce_of_2_31_plus_3_int8_elements():
    from conftest import ROOT, mpiexec_path

    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("no mpiexec: install with pip install 'refcoll[mpi]'")
    # At p = 2 recursive doubling's one exchange is the whole buffer: past 2**31 bytes.
    assert recursive_doubling_allreduce_cost(2, LARGE_N, 1).max_rank_bytes == LARGE_N
    assert ring_allreduce_cost(2, LARGE_N, 1).critical_bytes == 2 * max_chunk(LARGE_N, 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    cmd = [mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__)]
    started = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    elapsed = time.perf_counter() - started
    assert res.returncode == 0, f"mpiexec failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result line:\n{res.stdout[-4000:]}"
    ranks = json.loads(lines[-1][len("RESULT "):])
    print(f"\nmpiexec -n 2, {LARGE_N} int8: {elapsed:.1f} s in all; "
          + "; ".join(f"rank {r['rank']}: ring {r['ring_s']:.1f} s, recursive doubling "
                      f"{r['rd_s']:.1f} s, peak RSS {r['peak_rss_kib'] / 2**20:.2f} GiB"
                      for r in ranks))
    for r in ranks:
        assert r["count"] == LARGE_N
        assert r["ring_mismatches"] == 0, r
        assert r["ring_samples"] == r["expected_samples"], r
        assert r["input_samples"] == r["expected_input"], r
        assert r["rd_differs_from_ring"] == 0, r


# ------------------------------------------------------------------- MPI worker

def _mpi_worker() -> None:
    """Run under ``mpiexec -n 2``: ring, then recursive doubling, of ``LARGE_N`` int8."""
    from mpi4py import MPI

    import refcoll

    comm = MPI.COMM_WORLD
    n, p, rank = LARGE_N, comm.size, comm.rank
    x = pattern(n, rank)
    positions = sample_positions(n)
    comm.Barrier()
    started = time.perf_counter()
    out = refcoll.allreduce(x, comm, op="sum", algorithm="ring")
    comm.Barrier()
    ring_s = time.perf_counter() - started
    report = {
        "rank": rank,
        "count": int(out.size),
        "ring_s": ring_s,
        "ring_mismatches": mismatched_blocks(out, n, p),
        "ring_samples": [int(out[i]) for i in positions],
        "expected_samples": [expected_sum(i, p) for i in positions],
        "input_samples": [int(x.view(np.uint8)[i]) for i in positions],
        "expected_input": [pattern_byte(i, rank) for i in positions],
    }
    started = time.perf_counter()
    refcoll.allreduce(x, comm, op="sum", algorithm="recursive_doubling", out=x)  # in place
    comm.Barrier()
    report["rd_s"] = time.perf_counter() - started
    differs = 0
    for start in range(0, n, 4 * BLOCK_WORDS):
        stop = min(start + 4 * BLOCK_WORDS, n)
        differs += int(np.count_nonzero(x[start:stop] != out[start:stop]))
    report["rd_differs_from_ring"] = differs
    report["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    everyone = comm.gather(report)
    if rank == 0:
        print("RESULT " + json.dumps(everyone), flush=True)


if __name__ == "__main__":
    _mpi_worker()
