"""The reducer against DDP's rules, on simulated ranks: buckets, launch order, bits, errors.

Every expected layout is derived here from the cap rule (an independent
reimplementation, hand-worked cases, and torch's own assignment where torch is
installed); every expected gradient is a blocking ``refcoll.allreduce`` of the
same buckets.
"""

import contextlib
import math

import numpy as np
import pytest

import refcoll
from refcoll.calls.plans import Plan
from refcoll.compressors import parse
from refcoll.core.errors import MismatchError, UsageError
from refcoll.training.buckets import assign_buckets, parameters_of
from refcoll.training.reducer import Reducer

MIB = 2 ** 20


def run(p, fn):
    return refcoll.SimWorld(p, timeout=30).run(fn)


def caps(first_bytes, cap_bytes):
    """Return Reducer keywords that give these caps in bytes."""
    return {"first_bucket_mb": first_bytes / MIB, "bucket_cap_mb": cap_bytes / MIB}


def gradients(shapes, rank, step=0, dtypes=None):
    rng = np.random.default_rng([rank, step, 7])
    dtypes = dtypes or [np.float32] * len(shapes)
    return [rng.standard_normal(s).astype(d) for s, d in zip(shapes, dtypes)]


def blocking_reference(t, red, grads, algorithm, scale=True):
    """Return the gradients a blocking all-reduce of each of ``red``'s buckets gives.

    Each bucket is the concatenation of its gradients in bucket order, each times
    fl(1/p) when ``scale``, as torch computes it (DDP's copy_grad_to_bucket): in the
    bucket's dtype, or in float32 for a 16-bit float, rounded once to the dtype.
    """
    out = [None] * len(grads)
    for b in red.buckets:
        half = b.dtype.itemsize == 2
        factor = (np.float32 if half else b.dtype.type)(1.0 / t.size)
        parts = [((grads[i].astype(np.float32) if half else grads[i]) * factor if scale
                  else grads[i]).astype(b.dtype).reshape(-1) for i in b.params]
        summed = refcoll.allreduce(np.concatenate(parts), t, algorithm=algorithm)
        for i, off in zip(b.params, b.offsets):
            out[i] = summed[off:off + grads[i].size].reshape(grads[i].shape)
    return out


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def errors_on_every_rank(p, body, kind):
    def wrapped(t):
        try:
            body(t)
        except kind as exc:
            return str(exc)
        return None

    return run(p, wrapped)


# ------------------------------------------------------------------ bucket assignment

def per_dtype_assignment(nbytes, dtypes, order, first_cap, cap):
    """The cap rule, written another way: one pass per dtype, then sort by first position."""
    position = {i: k for k, i in enumerate(order)}
    buckets = []
    for dtype in {np.dtype(d) for d in dtypes}:
        current, size, limit = [], 0, first_cap
        for i in [i for i in order if np.dtype(dtypes[i]) == dtype]:
            current.append(i)
            size += nbytes[i]
            if size >= limit:
                buckets.append(current)
                current, size, limit = [], 0, cap
        if current:
            buckets.append(current)
    return sorted(buckets, key=lambda bucket: position[bucket[0]])


def test_hand_worked_cases_of_the_cap_rule():
    # float32 gradients of 400, 800, 1200, 1600, 2000 bytes; caps 1000 then 1500.
    # Reverse order: 4 (2000 >= 1000: closes the first bucket), 3 (1600 >= 1500: closes),
    # 2 (1200 < 1500), 1 (2000 >= 1500: closes [2, 1]), 0 (left open, closed at the end).
    nbytes = [400, 800, 1200, 1600, 2000]
    assert assign_buckets(nbytes, [np.float32] * 5, [4, 3, 2, 1, 0], 1000, 1500) == \
        [[4], [3], [2, 1], [0]]
    # A cap reached exactly closes the bucket (>=): 600 + 400 = 1000.
    assert assign_buckets([400, 600, 1000], [np.float32] * 3, [2, 1, 0], 1000, 1000) == \
        [[2], [1, 0]]
    # Two dtypes, each with its own first cap: float64 3 (1600 >= 1000) closes alone;
    # float32 4 (200) and 2 (1400 in all) close together, and are ordered by 4's position.
    nbytes, dtypes = [400, 800, 1200, 1600, 200], [np.float32, np.float64, np.float32,
                                                   np.float64, np.float32]
    assert assign_buckets(nbytes, dtypes, [4, 3, 2, 1, 0], 1000, 1500) == [[4, 2], [3], [1], [0]]


@pytest.mark.parametrize("seed", range(6))
def test_the_assignment_is_the_cap_rule_on_random_layouts(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    dtypes = [rng.choice([np.float32, np.float64, np.float16]) for _ in range(n)]
    nbytes = [int(rng.integers(1, 500)) * np.dtype(d).itemsize for d in dtypes]
    order = list(rng.permutation(n))
    first_cap, cap = int(rng.integers(1, 800)), int(rng.integers(1, 3000))
    assert assign_buckets(nbytes, dtypes, order, first_cap, cap) == \
        per_dtype_assignment(nbytes, dtypes, order, first_cap, cap)


@pytest.mark.slow  # importing torch takes seconds
def test_the_assignment_is_torchs_in_a_given_order():
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    rng = np.random.default_rng(3)
    numels = [int(k) for k in rng.integers(1, 400, 25)]
    order = [int(i) for i in rng.permutation(len(numels))]
    tensors = [torch.empty(numels[i]) for i in order]
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [1000, 3000],
                                                        [False] * len(order), order)
    ours = assign_buckets([4 * k for k in numels], [np.float32] * len(numels), order, 1000, 3000)
    assert ours == [list(b) for b in theirs]


def test_the_reducer_layout_starts_from_reverse_index_order_with_its_records():
    shapes = [(100,), (10, 20), (300,), (20, 20), (500,)]  # 400, 800, 1200, 1600, 2000 B
    red = run(1, lambda t: Reducer(shapes, t, **caps(1000, 1500)))[0]
    assert [list(b.params) for b in red.buckets] == [[4], [3], [2, 1], [0]]
    for k, b in enumerate(red.buckets):
        sizes = [math.prod(shapes[i]) for i in b.params]
        assert b.index == k and b.numel == sum(sizes) and b.nbytes == 4 * sum(sizes)
        assert list(b.offsets) == [sum(sizes[:j]) for j in range(len(sizes))]


def test_default_caps_are_ddps_one_and_twenty_five_mib():
    shapes = [(MIB // 4,), (6 * MIB // 4,), (MIB // 8,)]  # 1 MiB, 6 MiB, 0.5 MiB of float32
    red = run(1, lambda t: Reducer(shapes, t))[0]
    # Reverse order: 0.5 MiB (< 1), + 6 MiB closes the first bucket; 1 MiB stays open.
    assert [list(b.params) for b in red.buckets] == [[2, 1], [0]]


def test_parameters_are_read_from_arrays_shapes_pairs_and_names():
    params = parameters_of([np.zeros((2, 3), np.float64), (4,), 5, ((2, 2), "float16")])
    assert [(p.shape, str(p.dtype)) for p in params] == [
        ((2, 3), "float64"), ((4,), "float32"), ((5,), "float32"), ((2, 2), "float16")]
    named = parameters_of({"fc.weight": np.zeros((3, 4), np.float32), "fc.bias": np.zeros(3)})
    assert [p.describe() for p in named] == ["parameter 0 'fc.weight' float32[3, 4]",
                                             "parameter 1 'fc.bias' float64[3]"]
    pairs = parameters_of([("w", np.zeros(2, np.float32))])
    assert pairs[0].name == "w"


# -------------------------------------------------------------------- launch order

def test_buckets_launch_in_bucket_order_whatever_the_ready_order(monkeypatch):
    issued = {}
    real = Plan.start

    def recording(plan, *args, **kwargs):  # a bucket's all-reduce is its plan, started
        issued.setdefault(plan.t.rank, []).append(plan.x.size)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(Plan, "start", recording)
    shapes = [(100,), (200,), (300,), (400,)]  # 4 buckets of one parameter each

    def body(t):
        red = Reducer(shapes, t, algorithm="ring", **caps(1, 1))
        sizes = [b.numel for b in red.buckets]
        assert sizes == [400, 300, 200, 100]
        grads = gradients(shapes, t.rank)
        for i in (0, 1, 2):  # forward order: the last buckets first
            red.ready(i, grads[i])
        before = list(issued.get(t.rank, []))
        red.ready(3, grads[3])  # bucket 0 is ready: now every bucket launches, in order
        after = list(issued[t.rank])
        red.finalize()
        launched = [row["launched"] for row in red.timeline()]
        return before, after, launched

    for before, after, launched in run(2, body):
        assert before == [] and after == [400, 300, 200, 100]
        assert launched == sorted(launched)


def test_timeline_rows_hold_each_buckets_stamps_in_order():
    shapes = [(50,), (60,), (70,)]

    def body(t):
        red = Reducer(shapes, t, algorithm="ring", **caps(1, 1))
        assert red.timeline() == []
        grads = gradients(shapes, t.rank)
        for i in (2, 1, 0):
            red.ready(i, grads[i])
        red.finalize()
        return red.timeline()

    for rows in run(2, body):
        assert [row["index"] for row in rows] == [0, 1, 2]
        assert [row["bytes"] for row in rows] == [280, 240, 200]
        assert rows[0]["gradients"] == [0.0]
        for row in rows:
            assert max(row["gradients"]) == row["ready"]
            assert row["ready"] <= row["launched"] <= row["started"] <= row["finished"]


# ------------------------------------------------------------------------ the bits

SHAPES = [(37,), (5, 11), (129,), (3, 3, 3), (64,)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "tree", "recursive_doubling"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_gradients_are_the_blocking_allreduce_of_the_prescaled_buckets(p, algorithm, dtype):
    dtypes = [np.dtype(dtype)] * len(SHAPES)

    def body(t):
        red = Reducer([(s, dtype) for s in SHAPES], t, algorithm=algorithm, **caps(300, 600))
        assert len(red.buckets) > 1
        grads = gradients(SHAPES, t.rank, dtypes=dtypes)
        for i in reversed(range(len(SHAPES))):
            red.ready(i, grads[i])
        got = red.finalize()
        return got, blocking_reference(t, red, grads, algorithm), [g.copy() for g in grads]

    results = run(p, body)
    for got, want, _ in results:
        assert all(same_bits(a, b) for a, b in zip(got, want))
    assert all(same_bits(a, b) for got, _, _ in results for a, b in zip(got, results[0][0]))


def test_a_mixed_dtype_model_with_auto_is_bit_identical_too():
    dtypes = [np.float32, np.float64, np.float16, refcoll.DTYPES["bfloat16"], np.float64]

    def body(t):
        red = Reducer([(s, d) for s, d in zip(SHAPES, dtypes)], t, **caps(200, 400))
        assert {b.dtype for b in red.buckets} == {np.dtype(d) for d in dtypes}
        grads = gradients(SHAPES, t.rank, dtypes=dtypes)
        for i in reversed(range(len(SHAPES))):
            red.ready(i, grads[i])
        return red.finalize(), blocking_reference(t, red, grads, "auto")

    results = run(3, body)
    for got, want in results:
        assert [g.dtype for g in got] == [np.dtype(d) for d in dtypes]
        assert all(same_bits(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_the_scaled_copy_is_torchs_tensor_times_a_scalar_to_the_bit(dtype):
    """DDP's copy_grad_to_bucket is at::mul_out(view, grad, 1/p): torch computes a 16-bit
    float times a double in float32. At p = 3 a third of float16 elements differ from a
    product by the factor rounded to float16; the slot must hold torch's bits."""
    torch = pytest.importorskip("torch", reason="torch is the reference here")
    dt = refcoll.DTYPES[dtype]
    shapes = [(10000,), (1,)]  # one bucket: it is not launched until both are ready

    def body(t):
        red = Reducer([(s, dt) for s in shapes], t, algorithm="ring")
        assert len(red.buckets) == 1
        grad, other = gradients(shapes, t.rank, dtypes=[dt, dt])
        red.ready(0, grad)
        slot = red._views[0].copy()  # as copied in, before the bucket's all-reduce
        red.ready(1, other)
        red.finalize()
        return grad, slot

    for grad, slot in run(3, body):
        half = dt.itemsize == 2  # torch takes a 16-bit float's bits through int16
        tensor = (torch.from_numpy(grad.view(np.int16)).view(getattr(torch, dtype)) if half
                  else torch.from_numpy(grad))
        want = torch.mul(tensor, 1.0 / 3)
        want = want.view(torch.int16).numpy() if half else want.numpy()
        assert np.array_equal(slot.view(want.dtype), want)


@pytest.mark.parametrize("dtype,p", [("bfloat16", 257), ("float16", 2049), ("float32", 3)])
def test_the_in_place_division_is_torchs_div_by_the_exact_rank_count(dtype, p):
    # DDP's bucket_view.div_(p) divides by the integer p (in float32 for 16-bit floats);
    # p rounded to the dtype first (bfloat16(257) is 256) divided every element wrongly.
    from refcoll.training.buckets import divide_then_sum

    torch = pytest.importorskip("torch", reason="torch is the reference here")
    dt = refcoll.DTYPES[dtype]
    grad = gradients([(10000,)], 0, dtypes=[dt])[0]
    view = grad.copy()
    divide_then_sum([view], p, lambda: None, None)
    half = dt.itemsize == 2
    tensor = (torch.from_numpy(grad.view(np.int16)).view(getattr(torch, dtype)) if half
              else torch.from_numpy(grad)).clone()
    tensor.div_(p)
    want = tensor.view(torch.int16).numpy() if half else tensor.numpy()
    assert np.array_equal(view.view(want.dtype), want)


def test_a_hooks_handle_that_fails_on_one_rank_is_every_ranks_error():
    # Its wait() raised on that rank alone, before the first iteration's agreement: the
    # other ranks waited in the rebuild's collective for ever (a deadlock here).
    class Failing:
        def wait(self, timeout=None):
            raise RuntimeError("the future failed")

    def body(t):
        red = Reducer(SHAPES, t, hook=lambda b: Failing() if t.rank == 0 else b.buffer(),
                      **caps(300, 600))
        for i, g in reversed(list(enumerate(gradients(SHAPES, t.rank)))):
            red.ready(i, g)
        red.finalize()

    said = errors_on_every_rank(2, body, UsageError)
    assert all("rank 0: a hook's handle raised RuntimeError: the future failed" in (s or "")
               for s in said), said


def test_refcolls_own_error_in_the_first_iteration_keeps_its_kind(monkeypatch):
    # Without a hook, a timeout of the Reducer's own all-reduce is no hook's usage error.
    from refcoll.core.errors import CollectiveTimeout
    from refcoll.training import reducer as module

    def timed_out(*args, **kwargs):
        raise CollectiveTimeout("the bucket's all-reduce timed out")

    monkeypatch.setattr(module, "divide_then_sum", timed_out)

    def body(t):
        red = Reducer([(8,)], t, gradient_as_bucket_view=True, algorithm="ring")
        slot = red.gradient(0)
        slot[...] = 1
        red.ready(0, slot)
        red.finalize()

    said = errors_on_every_rank(1, body, CollectiveTimeout)
    assert said == ["the bucket's all-reduce timed out"]


def test_a_transposed_view_of_its_own_slot_is_copied_not_taken_as_the_slot():
    """A square parameter's slot seen transposed has the slot's address and shape; taken for
    the slot, its memory (the untransposed gradient) was reduced: a silent transpose."""
    shapes = [(4, 4)]

    def body(t):
        red = Reducer(shapes, t, algorithm="ring")
        grad = np.arange(16, dtype=np.float32).reshape(4, 4) * (t.rank + 1)
        red.gradient(0).T[...] = grad  # the slot holds grad transposed
        red.ready(0, red.gradient(0).T)  # which, seen transposed, is grad
        return red.finalize()[0]

    for got in run(2, body):
        assert np.array_equal(got, np.arange(16, dtype=np.float32).reshape(4, 4) * 1.5)


@pytest.mark.parametrize("p,differ", [(2, False), (3, True), (4, False)])
def test_multiplying_by_one_over_p_is_avg_only_for_powers_of_two(p, differ):
    shapes = [(4000,)]

    def body(t):
        red = Reducer(shapes, t, algorithm="ring")
        grad = gradients(shapes, t.rank)[0]
        red.ready(0, grad)
        ddp = red.finalize()[0]  # Σ fl(g · fl(1/p))
        avg = refcoll.allreduce(grad, t, op="avg", algorithm="ring")  # fl(Σ g) / p
        return int(np.count_nonzero(ddp != avg))

    counts = run(p, body)
    assert len(set(counts)) == 1
    assert (counts[0] > 0) == differ


def test_in_place_writes_into_the_arrays_given_to_ready():
    def body(t):
        red = Reducer(SHAPES, t, algorithm="ring", **caps(300, 600))
        grads = gradients(SHAPES, t.rank)
        for i in reversed(range(len(SHAPES))):
            red.ready(i, grads[i])
        out = red.finalize(in_place=True)
        return all(o is g for o, g in zip(out, grads)), grads, blocking_reference(
            t, red, gradients(SHAPES, t.rank), "ring")

    for same, grads, want in run(2, body):
        assert same and all(same_bits(a, b) for a, b in zip(grads, want))


# ------------------------------------------------------------------------- rebuild

def test_buckets_are_rebuilt_once_in_rank_zeros_ready_order():
    shapes = [(100,), (200,), (300,), (400,), (50,)]
    orders = {0: [1, 3, 0, 4, 2], 1: [4, 3, 2, 1, 0], 2: [0, 1, 2, 3, 4]}

    def body(t):
        red = Reducer(shapes, t, algorithm="ring", **caps(900, 1300))
        before = [list(b.params) for b in red.buckets]
        grads = gradients(shapes, t.rank)
        for i in orders[t.rank]:
            red.ready(i, grads[i])
        red.finalize()
        after = [list(b.params) for b in red.buckets]
        grads = gradients(shapes, t.rank, step=1)
        for i in reversed(range(len(shapes))):
            red.ready(i, grads[i])
        got = red.finalize()
        return before, after, [list(b.params) for b in red.buckets], red.rebuilt, got, \
            blocking_reference(t, red, grads, "ring")

    want = assign_buckets([4 * s[0] for s in shapes], [np.float32] * 5, orders[0], 900, 1300)
    results = run(3, body)
    for before, after, again, rebuilt, got, ref in results:
        assert before == [[4, 3], [2, 1], [0]] and after == want != before
        assert again == after and rebuilt  # never rebuilt a second time
        assert all(same_bits(a, b) for a, b in zip(got, ref))
        assert all(same_bits(a, b) for a, b in zip(got, results[0][4]))


# --------------------------------------------------------------------- find_unused

def test_unused_parameters_get_the_others_sum_or_are_left_alone():
    shapes = [(30,), (40,), (50,), (60,)]

    def body(t):
        red = Reducer(shapes, t, algorithm="ring", find_unused=True, **caps(1, 1))
        grads = gradients(shapes, t.rank)
        used = [i for i in (3, 2, 1) if not (i == 1 and t.rank == 2)]  # 0 unused everywhere
        zeros = [g.copy() if i in used else np.zeros_like(g) for i, g in enumerate(grads)]
        for i in used:
            red.ready(i, grads[i])
        out = red.finalize(in_place=True)
        return out, [out[i] is grads[i] for i in used], blocking_reference(t, red, zeros, "ring"), \
            red.rebuilt

    for out, identical, want, rebuilt in run(3, body):
        assert out[0] is None and all(identical) and not rebuilt
        assert all(same_bits(out[i], want[i]) for i in (1, 2, 3))


# ------------------------------------------------------------------------- no_sync

def test_no_sync_accumulates_and_the_first_ready_after_adds_it(monkeypatch):
    launches = []
    real = Plan.start
    monkeypatch.setattr(Plan, "start",
                        lambda plan, *a, **kw: launches.append(plan.t.rank) or real(plan, *a, **kw))

    def body(t):
        red = Reducer(SHAPES, t, algorithm="ring", **caps(300, 600))
        plain = Reducer(SHAPES, t, algorithm="ring", **caps(300, 600))
        micro = [gradients(SHAPES, t.rank, step=s) for s in range(3)]
        with red.no_sync():
            for step in (0, 1):
                for i in reversed(range(len(SHAPES))):
                    red.ready(i, micro[step][i])
            with pytest.raises(UsageError, match="nothing is reduced inside no_sync"):
                red.finalize()
        assert red.timeline() == [] and t.rank not in launches  # nothing was communicated
        for i in reversed(range(len(SHAPES))):
            red.ready(i, micro[2][i])
        got = red.finalize()
        for i in reversed(range(len(SHAPES))):
            acc = micro[0][i].copy()
            acc += micro[1][i]
            plain.ready(i, acc + micro[2][i])
        return got, plain.finalize()

    for got, want in run(2, body):
        assert all(same_bits(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------------- comm hooks

def test_an_error_feedback_compressor_keeps_one_state_per_bucket():
    spec, shapes = "ef(topk:ratio=0.1)", [(200,), (300,)]

    def body(t):
        red = Reducer(shapes, t, algorithm="ring", compressor=spec, seed=5, **caps(1, 1))
        comp = parse(spec)
        mine = {b.index: comp.new_state(seed=5 + b.index, rank=t.rank) for b in red.buckets}
        got, want = [], []
        for step in range(3):
            grads = gradients(shapes, t.rank, step=step)
            for i in reversed(range(len(shapes))):
                red.ready(i, grads[i])
            got.append(red.finalize())
            expected = [None, None]
            for b in red.buckets:
                raw = np.concatenate([grads[i] for i in b.params])
                summed, _ = refcoll.compressed_allreduce(raw, t, op="avg", compressor=comp,
                                                         state=mine[b.index], algorithm="ring")
                for i, off in zip(b.params, b.offsets):
                    expected[i] = summed[off:off + grads[i].size]
            want.append(expected)
        residuals = [np.count_nonzero(red.states[b].residual) for b in sorted(red.states)]
        return got, want, residuals, red.rebuilt

    for got, want, residuals, rebuilt in run(2, body):
        assert rebuilt and len(residuals) == 2 and all(r > 0 for r in residuals)
        for step_got, step_want in zip(got, want):
            assert all(same_bits(a, b) for a, b in zip(step_got, step_want))


def test_powersgd_in_a_bucket_compresses_each_parameter_in_its_shape():
    # A flat bucket would go whole: PowerSGD compresses matrices. Each parameter's view is
    # all-reduced in its shape with its own state, the bits of that call made by hand.
    spec, shapes = "powersgd:rank=2", [(64, 32), (32,)]

    def body(t):
        red = Reducer(shapes, t, algorithm="ring", compressor=spec, seed=5, **caps(1, 1))
        comp = parse(spec)
        mine = {i: comp.new_state(seed=5 + 65536 * b.index + j, rank=t.rank)
                for b in red.buckets for j, i in enumerate(b.params)}
        grads = gradients(shapes, t.rank, step=0)
        before = t.traffic.sent
        for i in reversed(range(len(shapes))):
            red.ready(i, grads[i])
        got = red.finalize()
        sent = t.traffic.sent - before
        want = {i: refcoll.compressed_allreduce(grads[i].reshape(shapes[i]).copy(), t,
                                                op="avg", compressor=comp, state=state,
                                                algorithm="ring")[0]
                for i, state in sorted(mine.items())}
        return got, want, sent

    for got, want, sent in run(2, body):
        assert all(same_bits(got[i].reshape(-1), want[i].reshape(-1)) for i in want)
        assert sent < (64 * 32 + 32) * 4 / 4  # the dense ring sends (n/2)·4 B, twice


def test_a_hook_gets_the_bucket_as_ddps_grad_bucket_and_its_result_is_kept():
    shapes = [(3, 4), (5,), (6,)]
    seen = {}

    def body(t):
        red = None

        def hook(bucket):
            grads = bucket.gradients()
            seen.setdefault(t.rank, []).append(
                (bucket.index(), bucket.parameters(), bucket.buffer().copy(),
                 [g.shape for g in grads], all(np.shares_memory(g, bucket.buffer())
                                               for g in grads), bucket.is_last()))
            if bucket.index() == 0:  # a handle: finalize waits for it
                return refcoll.iallreduce(bucket.buffer(), red.data_transport, op="avg",
                                          algorithm="ring")
            return bucket.buffer() * 2  # an array: taken as the reduced bucket

        red = Reducer(shapes, t, hook=hook, **caps(40, 40))
        grads = gradients(shapes, t.rank)
        for i in reversed(range(len(shapes))):
            red.ready(i, grads[i])
        return red.finalize(), grads, [list(b.params) for b in red.buckets]

    results = run(2, body)
    for rank, (out, grads, layout) in enumerate(results):
        assert layout == [[2, 1], [0]]
        calls = seen[rank]
        assert [c[0] for c in calls] == [0, 1] and [c[1] for c in calls] == layout
        assert same_bits(calls[0][2], np.concatenate([grads[2], grads[1]]))  # undivided
        assert calls[0][3] == [(6,), (5,)] and calls[1][3] == [(3, 4)]
        assert all(c[4] for c in calls) and [c[5] for c in calls] == [False, True]
        assert same_bits(out[0], grads[0] * 2)
        both = [results[r][1] for r in range(2)]
        for i in (1, 2):
            avg = refcoll.simulate("allreduce", [np.concatenate([g[2], g[1]]) for g in both],
                                   algorithm="ring", op="avg").outputs[rank]
            part = avg[:6] if i == 2 else avg[6:]
            assert same_bits(out[i], part)


# -------------------------------------------------------------- errors on every rank

def test_layouts_that_differ_are_a_mismatch_on_every_rank():
    def shape(t):
        return Reducer([(4,), (5,), (6,) if t.rank != 1 else (7,)], t)

    messages = errors_on_every_rank(3, shape, MismatchError)
    assert all(m is not None and "parameter 2: rank 0 has float32[6], rank 1 has float32[7]" in m
               for m in messages), messages
    assert len(set(messages)) == 1

    def cap(t):
        return Reducer([(4,)], t, bucket_cap_mb=25 if t.rank != 2 else 10)

    messages = errors_on_every_rank(3, cap, MismatchError)
    assert all(m and f"bucket_cap_mb in bytes: rank 0 has {25 * MIB}, rank 2 has {10 * MIB}"
               in m for m in messages), messages

    # The caps, not how each rank wrote them: 25 and 25.0 are one cap, and two MiB values
    # that print alike but give other byte caps (float64 0.342, float32 0.342) are not.
    made = run(2, lambda t: Reducer([(4,)], t, bucket_cap_mb=25 if t.rank else 25.0)._caps)
    assert made[0] == made[1]

    def printed_alike(t):
        return Reducer([(10,), (89653,)], t,
                       first_bucket_mb=0.342 if t.rank == 0 else np.float32(0.342))

    assert str(0.342) == str(np.float32(0.342))
    messages = errors_on_every_rank(2, printed_alike, MismatchError)
    assert all(m and "first_bucket_mb in bytes: rank 0 has 358612, rank 1 has 358613" in m
               for m in messages), messages

    def count(t):
        return Reducer([(4,)] * (3 if t.rank else 2), t)

    messages = errors_on_every_rank(2, count, MismatchError)
    assert all(m and "the number of parameters: rank 0 has 2, rank 1 has 3" in m
               for m in messages), messages


def test_a_bad_argument_at_construction_on_one_rank_is_an_error_on_every_rank():
    def body(t):
        return Reducer([(4,)], t, algorithm="no-such" if t.rank == 1 else "ring")

    messages = errors_on_every_rank(2, body, UsageError)
    assert all(m and "rank 1: unknown algorithm 'no-such'" in m for m in messages), messages


@pytest.mark.parametrize("bad, said", [
    ({"compressor": object()}, "rank 1: compressor= takes a spec string or a Compressor"),
    ({"seed": -1}, "rank 1: seed= takes a whole number from 0"),
    ({"shape": (-4, 3)}, "rank 1: parameter 1 has the shape (-4, 3)")])
def test_a_bad_compressor_seed_or_shape_on_one_rank_is_an_error_on_every_rank(bad, said):
    """A compressor= that was no Compressor failed on its rank alone, building the settings
    the ranks agree on, and the others waited out the deadline; a bad seed failed at the
    first bucket, inside ready(); a negative dimension in NumPy's words."""
    def body(t):
        mine = bad if t.rank == 1 else {}
        shapes = [(4,), mine.get("shape", (4, 3))]
        return Reducer(shapes, t, **{k: v for k, v in mine.items() if k != "shape"})

    messages = errors_on_every_rank(2, body, UsageError)
    assert all(m and said in m for m in messages), messages


NAMED = {"fc.weight": np.zeros((4, 3), np.float32), "fc.bias": np.zeros(4, np.float32),
         "out.weight": np.zeros((2, 4), np.float32)}


def an_iteration(red, t, skip=(), twice=(), bad=None):
    grads = gradients([p.shape for p in red.params], t.rank)
    for i in reversed(range(len(grads))):
        if (t.rank, i) in skip:
            continue
        red.ready(i, grads[i] if bad is None or bad[0] != (t.rank, i) else bad[1])
        if (t.rank, i) in twice:
            red.ready(i, grads[i])
    return red.finalize(), grads


def failing_then_working(p, **problem):
    """Run one iteration with ``problem`` on every rank, then a clean one; return both."""
    def body(t):
        red = Reducer(NAMED, t, algorithm="ring", **caps(40, 40))
        try:
            an_iteration(red, t, **problem)
        except UsageError as exc:
            message = str(exc)
        else:
            message = None
        got, grads = an_iteration(red, t)  # the reducer is still usable, the comm clean
        left = red.data_transport.unreceived() + red.control_transport.unreceived()
        return message, got, blocking_reference(t, red, grads, "ring"), left

    results = run(p, body)
    for _, got, want, left in results:
        assert all(same_bits(a, b) for a, b in zip(got, want)) and left == []
    return [r[0] for r in results]


def test_a_parameter_never_ready_is_named_with_its_rank_on_every_rank():
    messages = failing_then_working(3, skip={(2, 1)})
    assert len(set(messages)) == 1 and messages[0] is not None
    assert "parameter 1 'fc.bias' float32[4]" in messages[0]
    assert "on rank 2" in messages[0] and "find_unused=True" in messages[0]
    assert "Expected to have finished reduction in the prior iteration" in messages[0]


def test_a_gradient_marked_ready_twice_is_an_error_on_every_rank():
    messages = failing_then_working(2, twice={(1, 2)})
    assert len(set(messages)) == 1 and messages[0] is not None
    assert "parameter 2 'out.weight' float32[2, 4] was marked ready twice on rank 1" \
        in messages[0]
    assert "Expected to mark a variable ready only once" in messages[0]


@pytest.mark.parametrize("bad,expected", [
    (np.zeros(5, np.float32), "rank 0: ready(1, grad): the gradient has shape (5,)"),
    (np.zeros(4, np.float64), "rank 0: ready(1, grad): the gradient has dtype float64"),
])
def test_a_wrong_shape_or_dtype_is_an_error_on_every_rank(bad, expected):
    messages = failing_then_working(2, bad=((0, 1), bad))
    assert len(set(messages)) == 1 and messages[0] is not None and expected in messages[0]


def test_an_index_out_of_range_is_an_error_on_every_rank():
    def body(t):
        red = Reducer(NAMED, t, find_unused=True)
        red.ready(7 if t.rank == 1 else 0, np.zeros((4, 3), np.float32))
        red.finalize()

    messages = errors_on_every_rank(2, body, UsageError)
    assert all(m and "rank 1: ready(7, grad): no such parameter; indices run 0..2" in m
               for m in messages), messages


# ------------------------------------------------------------ gradient_as_bucket_view

@pytest.mark.parametrize("p", [2, 3])
def test_gradient_as_bucket_view_divides_in_place_and_returns_the_views(p):
    """DDP's gradient_as_bucket_view: written into the bucket, divided by p there, no copies.

    The expected result is computed here: each slot fl(g / p), the bucket summed by a
    blocking all-reduce. At p = 3 it differs from the copying path's fl(g * fl(1/3)).
    """
    shapes = [(6, 5), (5,), (5, 4), (4,)]
    caps_kw = caps(64, 128)

    def rank(t):
        red = Reducer(shapes, t, algorithm="ring", gradient_as_bucket_view=True, **caps_kw)
        copying = Reducer(shapes, t, algorithm="ring", **caps_kw)
        grads = gradients(shapes, t.rank)
        for i in reversed(range(len(shapes))):
            view = red.gradient(i)
            view[...] = grads[i]  # the backward pass writes straight into the bucket
            red.ready(i, view)
            copying.ready(i, grads[i])
        got, copied = red.finalize(), copying.finalize()
        views = all(np.shares_memory(g, red.gradient(i)) for i, g in enumerate(got))
        want = [None] * len(shapes)
        for b in red.buckets:
            parts = [np.divide(grads[i], np.float32(p)).reshape(-1) for i in b.params]
            summed = refcoll.allreduce(np.concatenate(parts), t, algorithm="ring")
            for i, off in zip(b.params, b.offsets):
                want[i] = summed[off:off + grads[i].size].reshape(shapes[i])
        return ([g.tobytes() for g in got], [w.tobytes() for w in want], views,
                sum(int((g != c).sum()) for g, c in zip(got, copied)))

    results = run(p, rank)
    for got, want, views, differing in results:
        assert got == want and views
        assert (differing > 0) == (p == 3)  # 1/p is exact for p a power of two
    assert all(r[0] == results[0][0] for r in results)


def test_one_ranks_bad_input_is_every_ranks_error_not_a_peers_wait():
    """Three inputs raised on one rank only while its peers waited for the deadline: an
    infinite bucket_cap_mb (a raw OverflowError), finalize() inside no_sync(), and a hook
    whose result has the wrong size. Each is now agreed: the same error on every rank."""
    shapes = [(3,), (4,)]

    def infinite_cap(t):
        Reducer(shapes, t, bucket_cap_mb=math.inf if t.rank == 0 else 25)

    for said in errors_on_every_rank(2, infinite_cap, UsageError):
        assert "rank 0: bucket_cap_mb must be a positive, finite number of MiB, got inf" in said

    def finalize_inside_no_sync(t):
        red = Reducer(shapes, t)
        grads = gradients(shapes, t.rank)
        with contextlib.ExitStack() as stack:
            if t.rank == 0:
                stack.enter_context(red.no_sync())
            for i in reversed(range(len(shapes))):
                red.ready(i, grads[i])
            red.finalize()

    for said in errors_on_every_rank(2, finalize_inside_no_sync, UsageError):
        assert "rank 0: finalize() inside no_sync()" in said

    def wrong_hook_on_one_rank(t):
        def hook(bucket):
            return bucket.buffer()[:-1] if t.rank == 1 else bucket.buffer()

        red = Reducer(shapes, t, hook=hook)
        for i, grad in reversed(list(enumerate(gradients(shapes, t.rank)))):
            red.ready(i, grad)
        red.finalize()

    for said in errors_on_every_rank(2, wrong_hook_on_one_rank, UsageError):
        assert "rank 1: the hook returned 6 elements for bucket 0, which holds 7" in said


@pytest.mark.parametrize("spec", ["ef(topk:ratio=0.2)", "ef(sign)", "powersgd:rank=1"])
def test_the_rebuild_carries_each_gradients_compressor_state(spec):
    # Gradients ready in the order 0, 2, 1, 3 make the rebuild lay the buckets out anew.
    # What error feedback still owes each gradient (and PowerSGD's warm start) moves
    # with it: the outputs plus the mean residual are the mean gradients, summed over
    # the steps, as without a rebuild. The states were dropped, and up to 2.5 was lost.
    from refcoll.compressors.patterns.twophase import owed
    shapes = [(30,), (20, 20), (40,), (10, 10)]

    def run(t):
        r = Reducer([np.zeros(s, np.float32) for s in shapes], t, bucket_cap_mb=0.0008,
                    first_bucket_mb=0.0008, compressor=spec)
        raw = [np.zeros(s) for s in shapes]
        out = [np.zeros(s) for s in shapes]
        before = []
        for step in range(4):
            rng = np.random.default_rng([step, t.rank])
            grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
            for i in (0, 2, 1, 3):
                r.ready(i, grads[i])
                raw[i] += grads[i]
            if step == 0 and r.compressor.matrices:
                before = [s for states in r.states.values() for s in states]
            for i, o in enumerate(r.finalize()):
                out[i] += o
        layouts = [list(b.params) for b in r.buckets]
        owes = [np.zeros(s) for s in shapes]
        for b, state in r.states.items():
            debt = None if r.compressor.matrices else owed(state, t.rank)
            for i, off in zip(r.buckets[b].params, r.buckets[b].offsets):
                if debt is not None:
                    owes[i] += debt[off:off + math.prod(shapes[i])].reshape(shapes[i])
        after = [s for states in r.states.values() for s in states] if before else []
        return raw, out, owes, layouts, before, after

    results = refcoll.SimWorld(2).run(run)
    assert r_is_rebuilt(results[0][3])
    if parse(spec).matrices:  # every gradient's own state, the same object, moved
        assert all(any(s is a for a in results[0][5]) for s in results[0][4])
        return
    for i in range(len(shapes)):
        mean_raw = sum(res[0][i] for res in results) / 2
        mean_owed = sum(res[2][i] for res in results) / 2
        assert np.abs(results[0][1][i] + mean_owed - mean_raw).max() < 1e-5, (spec, i)


def r_is_rebuilt(layout) -> bool:
    """Whether a layout is the rebuilt one (rank 0's ready order 0, 2, 1, 3)."""
    return [i for bucket in layout for i in bucket][:3] == [0, 2, 1]


def test_no_sync_into_the_slot_then_a_sync_step_divides_as_ddp_does():
    # With gradient_as_bucket_view, DDP's .grad is the slot: no_sync accumulates there and
    # the sync step divides the sum in place (div_). The sum went to a new array and was
    # multiplied by fl(1/3) instead: another rounding in a third of the elements.
    def body(t):
        red = Reducer([(4000,)], t, gradient_as_bucket_view=True, algorithm="ring")
        rng = np.random.default_rng(t.rank)
        a, g = (rng.standard_normal(4000).astype(np.float32) for _ in range(2))
        with red.no_sync():
            slot = red.gradient(0)
            slot[...] = a
            red.ready(0, slot)
        slot = red.gradient(0)
        slot[...] = g
        red.ready(0, slot)
        got = red.finalize()[0].copy()
        ddp = refcoll.allreduce(np.divide(a + g, np.float32(3)), t, algorithm="ring")
        return same_bits(got, ddp)

    assert run(3, body) == [True] * 3


def test_a_subnormal_gradient_under_np_seterr_raise_is_reduced_on_every_rank():
    """Scaling a subnormal by 1/p underflows: under np.seterr(all="raise") the rank that had
    one raised in ready() while the others waited in the bucket's all-reduce."""
    def step(t):
        before = np.seterr(all="raise")  # (each simulated rank is a thread of its own state)
        try:
            red = Reducer([(4,)], t)
            grad = np.ones(4, np.float32)
            if t.rank == 1:
                grad[0] = np.float32(1e-45)
            red.ready(0, grad)
            return red.finalize()[0]
        finally:
            np.seterr(**before)

    for got in run(3, step):
        assert got[1:].tolist() == [1.0] * 3 and 0.0 < got[0] < 1.0

    def unused(t):  # the same gradient accumulated in no_sync(), scaled at finalize()
        before = np.seterr(all="raise")
        try:
            red = Reducer([(4,), (4,)], t, find_unused=True)
            grad = np.ones(4, np.float32)
            if t.rank == 1:
                grad[0] = np.float32(1e-45)
            with red.no_sync():
                red.ready(0, grad)
            red.ready(1, np.ones(4, np.float32))
            return red.finalize()[0]
        finally:
            np.seterr(**before)

    for got in run(3, unused):
        assert got[1:].tolist() == [1.0] * 3 and 0.0 < got[0] < 1.0
