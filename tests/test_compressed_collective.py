"""Compressed all-reduce (refcoll/compressors/collective.py): patterns, bytes, error feedback."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import mpiexec_path

import refcoll
from refcoll.compressors import parse
from refcoll.compressors.base import Payload
from refcoll.compressors.collective import compressed_allreduce, simulate_compressed
from refcoll.compressors.conformance import build_compressor_cases, run_compressor_battery
from refcoll.compressors.patterns.gather import deserialise, serialise
from refcoll.core.errors import MismatchError, UsageError
from refcoll.core.ops import get_op
from refcoll.transport.sim import SimWorld

P = 3


def _inputs(shape, p=P, steps=1, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(shape).astype(dtype) for _ in range(p)] for _ in range(steps)]


def _local_decompressed(spec, xs, seed):
    """What each rank's payload stands for, computed without any communication."""
    comp = parse(spec)
    return [comp.decompress(comp.compress(x, comp.new_state(seed=seed, rank=r)))
            for r, x in enumerate(xs)]


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "threshold:threshold=0.7", "qsgd:levels=4",
                                  "terngrad", "int8:block=16", "sign:block=8"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gather_sums_every_decompressed_payload_in_rank_order(spec, op):
    inputs = _inputs((50,), seed=1)
    res = simulate_compressed(spec, inputs, seed=5, op=op, pattern="gather")
    parts = _local_decompressed(spec, inputs[0], seed=5)
    want = parts[0].copy()
    for part in parts[1:]:
        want += part
    get_op(op).finalize(want, P)
    for out in res.outputs[0]:
        assert np.array_equal(out, want)


def test_linear_payloads_go_through_the_chosen_algorithm():
    inputs = _inputs((101,), seed=2)
    for algorithm in ("ring", "rabenseifner", "dbtree"):
        got = simulate_compressed("none", inputs, algorithm=algorithm).outputs[0]
        want = refcoll.simulate("allreduce", inputs[0], algorithm=algorithm).outputs
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), algorithm
    casts = [x.astype(np.float16) for x in inputs[0]]
    want = refcoll.simulate("allreduce", casts, algorithm="ring").outputs[0].astype(np.float32)
    got = simulate_compressed("fp16", inputs, algorithm="ring").outputs[0][0]
    assert np.array_equal(got, want)


def test_random_k_sums_the_shared_coordinates_only():
    inputs = _inputs((200,), seed=3)
    out = simulate_compressed("randomk:ratio=0.1", inputs, seed=9).outputs[0][0]
    kept = np.flatnonzero(out)
    assert 0 < kept.size <= 20
    expected = sum(x[kept] for x in inputs[0]) * np.float32(10)
    np.testing.assert_allclose(out[kept], expected, rtol=1e-5)


@pytest.mark.parametrize("p", [2, 3, 7])
def test_shared_scale_int8_sums_codes_in_int8_without_overflow(p):
    inputs = _inputs((300,), p=p, seed=11)
    res = simulate_compressed("int8:block=64", inputs, pattern="allreduce")
    levels = 127 // p
    flat = np.stack([x.reshape(-1) for x in inputs[0]])
    blocks = [slice(a, min(a + 64, 300)) for a in range(0, 300, 64)]
    want = np.empty(300, np.float32)
    for b in blocks:  # the shared scale, then the codes every rank sends, computed here
        scale = np.abs(flat[:, b]).max() / np.float32(levels)
        codes = np.clip(np.rint(flat[:, b] / scale), -levels, levels)
        assert np.abs(codes.sum(axis=0)).max() <= 127
        want[b] = codes.sum(axis=0).astype(np.int8) * scale
        exact = flat[:, b].astype(np.float64).sum(axis=0)
        assert np.all(np.abs(res.outputs[0][0][b] - exact) <= p * scale / 2 * (1 + 1e-5))
    assert all(np.array_equal(out, want) for out in res.outputs[0])
    wire = res.traffic[0][0].payload
    assert wire == 300 + 4 * len(blocks)  # int8 codes and one float32 maximum per block


def test_powersgd_at_full_rank_reconstructs_the_average():
    inputs = _inputs((12, 5), dtype=np.float64, seed=4)
    out = simulate_compressed("powersgd:rank=5,min_rate=0", inputs, op="avg").outputs[0][0]
    np.testing.assert_allclose(out, np.mean(inputs[0], axis=0), rtol=1e-9, atol=1e-12)


def test_powersgd_warm_start_is_the_shared_summed_q():
    inputs = _inputs((30, 20), steps=2, seed=5)

    def body(t):
        comp = parse("powersgd:rank=2")
        state = comp.new_state(seed=1, rank=t.rank)
        for x in inputs:
            compressed_allreduce(x[t.rank], t, compressor=comp, state=state)
        return state.memory[("powersgd.q", 30, 20, 2)]

    qs = SimWorld(P).run(body)
    assert all(np.array_equal(q, qs[0]) for q in qs)


@pytest.mark.parametrize("spec,pattern", [("topk:ratio=0.1", "gather"),
                                          ("threshold:threshold=0.5", "gather"),
                                          ("sign", "twophase"), ("onebit:block=8", "twophase"),
                                          ("powersgd:rank=2", "allreduce"), ("bf16", "allreduce")])
def test_bytes_sent_are_the_payloads_measured_on_the_wire(spec, pattern):
    inputs = _inputs((40, 25), seed=6)
    res = simulate_compressed(spec, inputs, seed=2, pattern=pattern)
    traffic = res.traffic[0]
    ledger = res.ledger
    assert [m.sent for m in traffic] == [ledger.bytes_sent()[r] for r in range(P)]
    assert [m.received for m in traffic] == [ledger.bytes_received()[r] for r in range(P)]
    comp = parse(spec)
    if pattern == "gather":
        payloads = [comp.compress(x, comp.new_state(seed=2, rank=r))
                    for r, x in enumerate(inputs[0])]
        counts = 8 * len(payloads[0].arrays) * (P - 1)
        for r in range(P):  # a ring allgather forwards every payload but its right neighbour's
            forwarded = sum(pl.nbytes for q, pl in enumerate(payloads) if q != (r + 1) % P)
            assert traffic[r].sent == forwarded + counts
            assert traffic[r].payload == payloads[r].nbytes
    if pattern == "twophase":
        n = 1000
        chunk = [comp.compress(np.ones(b - a, np.float32), comp.new_state()).nbytes
                 for a, b in refcoll.core.chunking.chunk_bounds(n, P)]
        roles = len(comp.compress(np.ones(3, np.float32), comp.new_state()).arrays)
        for r in range(P):
            alltoall = sum(chunk[j] for j in range(P) if j != r)
            allgather = sum(chunk[j] for j in range(P) if j != (r + 1) % P)
            counts = 8 * roles * P * (P - 1) + 8 * roles * (P - 1)
            assert traffic[r].sent == alltoall + allgather + counts
    if pattern == "allreduce":
        wire = traffic[0].payload
        assert wire == (40 + 25) * 2 * 4 if spec.startswith("powersgd") else wire == 1000 * 2
        # The ring sends 2(p-1)/p of each all-reduced array, up to chunk rounding.
        assert abs(traffic[0].sent - 2 * (P - 1) * wire / P) <= 2 * (P - 1) * 8
    dense = refcoll.simulate("allreduce", inputs[0], algorithm="ring").ledger.max_rank_bytes
    assert all(m.dense == dense for m in traffic)


def test_twophase_error_feedback_loses_nothing_at_either_stage():
    inputs = _inputs((64,), steps=3, dtype=np.float64, seed=7)

    def body(t):
        comp = parse("ef(sign)")
        state = comp.new_state(seed=0, rank=t.rank)
        rows = []
        for x in inputs:
            old_worker = 0 if state.residual is None else state.residual.copy()
            old_server = dict(state.memory)
            out, _ = compressed_allreduce(x[t.rank], t, compressor=comp, state=state)
            rows.append((out, old_worker, state.residual.copy(), old_server, dict(state.memory)))
        return rows

    per_rank = SimWorld(P).run(body)
    bounds = refcoll.core.chunking.chunk_bounds(64, P)
    key = ("twophase.server", 64, P)
    for step, xs in enumerate(inputs):
        out = per_rank[0][step][0]
        incoming = sum(xs[r] + per_rank[r][step][1] - per_rank[r][step][2] for r in range(P))
        server_old = np.concatenate([per_rank[r][step][3].get(key, np.zeros(b - a))
                                     for r, (a, b) in enumerate(bounds)])
        server_new = np.concatenate([per_rank[r][step][4][key] for r in range(P)])
        np.testing.assert_allclose(out, incoming + server_old - server_new, rtol=0, atol=1e-12)


def test_the_compressed_battery_passes_in_the_simulator():
    cases = build_compressor_cases(P, algorithms_=["ring"], ops=["avg"], dtypes=["float32"])
    assert {c.pattern for c in cases} == {"allreduce", "gather", "twophase"}
    results = SimWorld(P).run(lambda t: run_compressor_battery(t, cases))[0]
    failed = [f"{r.case.id}: {r.reason}" for r in results if not r.passed]
    assert not failed and len(results) == len(cases)


def test_compressed_allreduce_keeps_its_state_and_allreduce_takes_none():
    xs = _inputs((100,), seed=8)[0]

    def body(t):
        state = parse("ef(topk:ratio=0.05)").new_state(seed=0, rank=t.rank)
        out, traffic = refcoll.compressed_allreduce(xs[t.rank], t, op="avg",
                                                    compressor="ef(topk:ratio=0.05)", state=state)
        return out, state, traffic

    (out, state, traffic), *_ = SimWorld(P).run(body)
    assert out.shape == (100,) and np.count_nonzero(out) <= 15
    assert state.residual is not None and state.traffic.sent > 0 and traffic == state.traffic
    assert state.traffic.ratio > 1
    with pytest.raises(UsageError, match="allreduce takes no compressor"):
        SimWorld(1).run(lambda t: refcoll.allreduce(xs[0], t, state=state))


@pytest.mark.parametrize("bad", ["int", "op", "pattern", "switch", "spec"])
def test_a_bad_compressed_call_fails_on_every_rank(bad):
    def body(t):
        x = np.ones(10, np.int32 if bad == "int" and t.rank == 1 else np.float32)
        kwargs = dict(compressor="topk:ratio=0.5")
        if bad == "op":
            kwargs["op"] = "max"
        if bad == "pattern":
            kwargs["pattern"] = "twophase"
        if bad == "switch":
            kwargs["algorithm"] = "switch"
        if bad == "spec" and t.rank == 2:
            kwargs["compressor"] = "topk:ratio=0.25"
        try:
            compressed_allreduce(x, t, **kwargs)
        except (UsageError, MismatchError) as exc:
            return type(exc).__name__, str(exc)
        return None

    results = SimWorld(P).run(body)
    assert all(r is not None for r in results), results
    if bad == "spec":
        assert all(kind == "MismatchError" and "topk:ratio=0.25" in msg for kind, msg in results)
    if bad == "int":
        assert all("rank 1" in msg for _, msg in results)


@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_verify_compressors_under_mpi_equals_the_simulator(tmp_path):
    out = tmp_path / "verify.json"
    res = subprocess.run(
        [sys.executable, "-m", "refcoll", "verify", "-n", "2", "--algorithm", "ring,auto",
         "--dtype", "float32", "--compressor", "none", "--compressor", "ef(topk:ratio=0.1)",
         "--compressor", "ef(sign)", "--compressor", "powersgd:rank=2",
         "--compressor", "qsgd", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert res.stdout.strip().splitlines()[-1] == f"{data['passed']} passed, 0 failed"
    patterns = {c["pattern"] for c in data["cases"]}
    assert patterns == {"allreduce", "gather", "twophase"} and data["passed"] > 50


def test_the_compressed_battery_runs_only_over_algorithms_with_an_all_reduce():
    """An algorithm without an all-reduce (bruck's gathers) has no compressed case, and naming
    one is refused with the algorithm's own reason."""
    from refcoll import algorithms
    from refcoll.core.errors import UsageError

    chosen = {case.algorithm for case in build_compressor_cases(2)}
    assert chosen == {name for name in algorithms.names("allreduce")
                      if algorithms.get(name).workers is None}
    without = [name for name in algorithms.names() if name not in algorithms.names("allreduce")]
    for name in without:
        with pytest.raises(UsageError, match="does not implement allreduce"):
            build_compressor_cases(2, algorithms_=[name])


@pytest.mark.parametrize("codes", [37, 38, 39, 40])
def test_a_gathered_payloads_arrays_come_back_aligned(codes):
    # Roles are packed one after another: float32 scales behind 37 one-byte codes start at
    # byte 37. A view there is misaligned, which NumPy tolerates and a device kernel does
    # not (CUDA faults on a misaligned 4-byte load); it is read through an aligned copy.
    rng = np.random.default_rng(codes)
    payload = Payload("int8", (codes,), np.dtype(np.float32),
                      {"codes": rng.integers(-127, 128, codes).astype(np.int8),
                       "scales": rng.standard_normal(3).astype(np.float32)})
    record = np.empty(serialise(payload).size + 1, np.uint8)[1:]  # even the record unaligned
    record[:] = serialise(payload)
    back = deserialise(record, np.array([codes, 3]), payload)
    for role, array in payload.arrays.items():
        assert back.arrays[role].flags.aligned, role
        assert back.arrays[role].tobytes() == array.tobytes()


@pytest.mark.parametrize("spec", ["topk:ratio=1.0", "threshold:threshold=0", "int8", "qsgd",
                                  "terngrad", "sign", "onebit"])
def test_a_float16_average_of_gathered_parts_does_not_overflow(spec):
    # The parts were added in float16 and then divided: two gradients of 40000 averaged to
    # inf. They now add in float32, divided once, rounded once.
    xs = [np.full(8, 40000.0, np.float16) for _ in range(2)]
    got = simulate_compressed(spec, [xs], op="avg", seed=1).outputs[0][0]
    assert got.dtype == np.float16 and np.isfinite(got).all(), got
    exact = {"topk:ratio=1.0", "threshold:threshold=0", "sign", "onebit"}  # 40000 whole
    assert spec not in exact or (got == 40000).all(), got


@pytest.mark.parametrize("spec,pattern", [("ef(topk:ratio=0.5)", None), ("ef(sign)", None),
                                          ("ef(int8)", "allreduce"), ("ef(fp16)", None)])
def test_one_ranks_state_of_another_tensor_is_every_ranks_error(spec, pattern):
    # The residual's check ran inside the pattern, on that rank alone: the others waited.
    comp = parse(spec)

    def body(t):
        state = comp.new_state(seed=0, rank=t.rank)
        if t.rank == 0:
            state.residual = np.zeros(3, np.float32)  # another tensor's residual
        with pytest.raises(UsageError, match="holds the residual of a float32 tensor of "
                                             r"shape \(3,\)") as raised:
            compressed_allreduce(np.arange(8, dtype=np.float32), t, compressor=comp,
                                 state=state, pattern=pattern)
        return str(raised.value)

    said = SimWorld(2, timeout=60).run(body)
    assert said[0].startswith("rank 0: ") and said[1].startswith("rank 0 could not run")


def test_ranks_whose_random_k_steps_differ_are_a_mismatch():
    # Random-k draws its indices from (seed, step): a rank on another step decompressed
    # with other indices, and every rank returned different bits without a word.
    comp = parse("randomk:ratio=0.25")

    def body(t):
        state = comp.new_state(seed=0, rank=t.rank)
        state.step = t.rank
        with pytest.raises(MismatchError, match=r"\('step', 0\)\], rank 1 has .*\('step', 1\)"):
            compressed_allreduce(np.arange(1, 9, dtype=np.float32), t, compressor=comp,
                                 state=state)

    SimWorld(2, timeout=60).run(body)
