import pytest

from refcoll.core.chunking import (
    SPLITS,
    chunk_bounds,
    chunk_sizes,
    chunk_slice,
    gloo_segments,
    max_chunk,
)
from refcoll.core.errors import UsageError


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 17])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 6, 7, 8, 16, 100, 5003])
def test_chunks_tile_the_buffer_with_the_remainder_first(n, p):
    bounds = chunk_bounds(n, p)
    assert len(bounds) == p
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_, b), (c, _) in zip(bounds, bounds[1:]):
        assert b == c, "chunks must be contiguous and in order"
    sizes = [b - a for a, b in bounds]
    assert sizes == chunk_sizes(n, p)
    assert sizes == [n // p + (1 if i < n % p else 0) for i in range(p)]
    assert max(sizes) == max_chunk(n, p)
    for i, (a, b) in enumerate(bounds):
        assert chunk_slice(n, p, i) == slice(a, b)


def test_fewer_elements_than_chunks_leaves_trailing_chunks_empty():
    assert chunk_sizes(2, 5) == [1, 1, 0, 0, 0]
    assert chunk_bounds(0, 3) == [(0, 0), (0, 0), (0, 0)]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        chunk_bounds(4, 0)
    with pytest.raises(ValueError):
        chunk_bounds(-1, 2)


# ------------------------------------------------------------------ the other split rules


def _expected_sizes(n, p, rule, itemsize):
    """Each rule from its definition: where the elements that do not divide evenly go."""
    if rule == "front":
        return [n // p + (i < n % p) for i in range(p)]
    if rule == "last":
        return [n // p] * (p - 1) + [n // p + n % p]
    if rule == "ceil":
        width = -(-n // p)
    else:  # gloo: segments of at most 1 MiB, at least 2 per rank, k per rank
        megabytes = -(-(n * itemsize) // 2**20)
        segments = max(2 * p, p * -(-megabytes // p))
        width = segments // p * -(-n // segments)
    return [max(0, min(width, n - i * width)) for i in range(p)]


@pytest.mark.parametrize("rule", SPLITS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 17])
@pytest.mark.parametrize("n", [0, 1, 2, 6, 7, 9, 100, 5003])
def test_every_rule_tiles_the_buffer_as_it_is_defined(n, p, rule):
    bounds = chunk_bounds(n, p, rule, itemsize=4)
    assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert sizes == _expected_sizes(n, p, rule, 4) == chunk_sizes(n, p, rule, itemsize=4)
    assert max(sizes) == max_chunk(n, p, rule, itemsize=4)


def test_the_rules_put_the_remainder_where_their_libraries_do():
    # MPICH's k_reduce_scatter_allgather and ring splits of 10007 on 4 ranks.
    assert chunk_sizes(10007, 4, "last") == [2501, 2501, 2501, 2504]
    assert chunk_sizes(10006, 4, "ceil") == [2502, 2502, 2502, 2500]
    assert chunk_sizes(10006, 4) == [2502, 2502, 2501, 2501]
    assert chunk_sizes(9, 4, "gloo", itemsize=4) == [4, 4, 1, 0]  # 8 segments of 2, 2 a rank


def test_gloo_segments_grow_with_the_bytes():
    assert gloo_segments(10007, 4, 4) == 8  # 2 per rank below 1 MiB a segment
    assert gloo_segments(3_000_001, 4, 4) == 12  # 12 MB: 12 segments of at most 1 MiB
    assert gloo_segments(3_000_001, 4, 2) == 8
    assert (chunk_sizes(3_000_001, 4, "gloo", itemsize=4)
            != chunk_sizes(3_000_001, 4, "gloo", itemsize=2))


def test_an_unknown_rule_is_refused_naming_the_rules():
    with pytest.raises(UsageError, match="front, last, ceil, gloo"):
        chunk_bounds(10, 3, "middle")
