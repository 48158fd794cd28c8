import pytest

from refcoll.core.chunking import chunk_bounds, chunk_sizes, chunk_slice, max_chunk


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 17])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 6, 7, 8, 16, 100, 5003])
def test_chunks_tile_the_buffer_with_the_remainder_first(n, p):
    bounds = chunk_bounds(n, p)
    assert len(bounds) == p
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (a, b), (c, _) in zip(bounds, bounds[1:]):
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
