"""The reduction orders real libraries used, from their recorded outputs (spec/orders.md).

tests/data/orders/ holds outputs of MPICH 5.0.2, Open MPI 5.0.11 and PyTorch
2.13's Gloo on refcoll's ``adversarial`` float inputs (n = 1003, p = 3 and 4),
recorded by ``python benchmarks/library_orders.py run ... --kinds adversarial
--n 1003`` and ``... record``: one ``.npz`` per library variant with every
rank's input and output. No library is needed here: these tests check that
:func:`refcoll.verify.identify.identify` names, bit for bit, the refcoll order
that the matrix of ``benchmarks/library_orders.py`` found for each library, and,
for the orders the libraries' sources describe, that an explicit NumPy fold in
that order gives the library's bits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from refcoll.core.ops import get_dtype
from refcoll.verify.identify import identify

DATA = Path(__file__).parent / "data" / "orders"

#: file -> {p: a refcoll order the library's output matches, or None: none matches}.
FOUND = {
    "mpich-allreduce-ring": {3: "ring(split=ceil)", 4: "ring"},
    "mpich-allreduce-tree": {3: "tree(subtrees=shrinking)", 4: "tree(subtrees=shrinking)"},
    "mpich-allreduce-tree-knomial_2": {3: "tree(first=farthest)", 4: "tree(first=farthest)"},
    "mpich-allreduce-tree-kary": {3: "naive", 4: "tree(shape=kary)"},
    "mpich-allreduce-recursive_multiplying": {3: "recursive_doubling(fold=modulo)",
                                              4: "recursive_doubling"},
    "mpich-reduce_scatter-pairwise": {3: "ring(direction=reverse, start=own)",
                                      4: "ring(direction=reverse, start=own)"},
    "openmpi-allreduce-basic_linear": {3: "naive(fold=right)", 4: "naive(fold=right)"},
    "openmpi-allreduce-ring": {3: "ring(start=own)", 4: "ring(start=own)"},
    "openmpi-allreduce-rabenseifner": {3: "rabenseifner", 4: "rabenseifner(pairing=near)"},
    "gloo-allreduce-float32": {3: "ring(direction=reverse, split=gloo)",
                               4: "ring(direction=reverse, split=gloo)"},
    "gloo-allreduce-bfloat16": {3: "ring(direction=reverse, split=gloo)",
                                4: "ring(direction=reverse, split=gloo)"},
    "gloo-reduce-float32": {3: None, 4: None},
}


def _load(name: str, p: int):
    d = np.load(DATA / f"{name}.npz")
    dt = get_dtype(str(d["dtype"]))
    inputs = [x.view(dt) for x in d[f"p{p}_in"]]
    outputs = [d[f"p{p}_out{r}"].view(dt) if f"p{p}_out{r}" in d.files else None
               for r in range(p)]
    return str(d["collective"]), str(d["op"]), inputs, outputs


def test_every_recording_is_listed():
    assert sorted(f.stem for f in DATA.glob("*.npz")) == sorted(FOUND)


@pytest.mark.parametrize("name", sorted(FOUND))
@pytest.mark.parametrize("p", [3, 4])
def test_identify_names_the_library_order(name, p):
    collective, op, inputs, outputs = _load(name, p)
    found = identify(inputs, outputs, collective=collective, op=op, known=[])
    want = FOUND[name][p]
    if want is None:
        assert found.matches == []
        label, differ, total = found.nearest
        assert 0 < differ < total
    else:
        assert want in found.matches
        assert not found.indistinct  # the adversarial inputs do tell orders apart


def _bounds(n: int, p: int) -> list[tuple[int, int]]:
    """Chunks of ``n`` on ``p`` ranks, the first ``n % p`` one longer (both MPIs' rule)."""
    base, extra = divmod(n, p)
    edges = np.cumsum([0] + [base + (i < extra) for i in range(p)])
    return list(zip(edges[:-1], edges[1:]))


def _fold(xs, ranks):
    """((x[r0] + x[r1]) + x[r2]) + ..., rounding each step in the inputs' dtype."""
    acc = xs[ranks[0]].copy()
    for r in ranks[1:]:
        acc = (acc + xs[r]).astype(acc.dtype)
    return acc


def _same_bits(a, b) -> bool:
    return np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def _all_ranks_equal(outputs, want) -> bool:
    return all(_same_bits(y, want) for y in outputs)


def test_open_mpi_basic_linear_folds_from_the_last_rank():
    # coll_base_allreduce.c's basic linear: a reduce to rank 0 that starts from
    # rank p-1 and applies each lower rank's buffer: x0 + (x1 + (x2 + x3)).
    _, _, xs, outs = _load("openmpi-allreduce-basic_linear", 4)
    assert _all_ranks_equal(outs, _fold(xs, [3, 2, 1, 0]))


def test_open_mpi_ring_starts_chunk_c_at_rank_c():
    _, _, xs, outs = _load("openmpi-allreduce-ring", 4)
    want = np.concatenate([_fold([x[a:b] for x in xs], [(c + k) % 4 for k in range(4)])
                           for c, (a, b) in enumerate(_bounds(len(xs[0]), 4))])
    assert _all_ranks_equal(outs, want)


def test_mpich_knomial_tree_adds_the_pair_first():
    # MPICH's default tree (knomial_1, k = 2) at p = 4: (x0 + (x1 + x2)) + x3.
    _, _, xs, outs = _load("mpich-allreduce-tree", 4)
    assert _all_ranks_equal(outs, _fold(xs, [1, 2, 0, 3]))


def test_gloo_reduce_is_a_reverse_ring_per_chunk():
    # No refcoll reduce order matches Gloo's reduce; its bits are those of a
    # reverse ring per chunk: chunk c = ((x[c-1] + x[c-2]) + ...) + x[c], the
    # chunks contiguous and in rank order.
    _, _, xs, outs = _load("gloo-reduce-float32", 4)
    y = outs[0]
    masks = np.stack([np.asarray(_fold(xs, [(c - 1 - k) % 4 for k in range(3)] + [c])).view(
        np.uint32) == y.view(np.uint32) for c in range(4)])
    assert masks.any(axis=0).all()
    first = masks.argmax(axis=0)  # the lowest chunk order each element fits
    last = 3 - masks[::-1].argmax(axis=0)  # the highest
    # a split point exists: the chunk index can rise with the element index
    assert np.all(np.maximum.accumulate(first) <= last)


def test_gloo_reduce_takes_its_all_reduce_order():
    # On the same inputs, Gloo's reduce gives the root what its ring all-reduce
    # gives every rank: a reduce order refcoll's reduce algorithms lack.
    _, _, xs, outs = _load("gloo-reduce-float32", 4)
    _, _, all_xs, all_outs = _load("gloo-allreduce-float32", 4)
    assert all(_same_bits(a, b) for a, b in zip(xs, all_xs))
    assert _same_bits(outs[0], all_outs[0])
