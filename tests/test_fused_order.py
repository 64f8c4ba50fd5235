"""The order in which the fused kernels draw their GEMM tiles (csrc/kernels/fused/tile_order.h).

The kernels' own function, through the extension, against an order written out here: experts
in order; within an expert, groups of row blocks in order; within a group, column by column.
The GEMM + combine's queue goes in chunks of column blocks, each that order over the chunk's
columns. Every tile exactly once, so no output tile is skipped or computed twice.
"""
import numpy as np
import pytest

from jax_ep import runtime


@pytest.fixture(scope="module")
def ext():
    e = runtime.extension()
    if e is None:
        pytest.skip("the CUDA extension is not built")
    return e


def expected_order(block_start, col_blocks, group):
    order = []
    for lo, hi in zip(block_start[:-1], block_start[1:]):
        for first in range(lo, hi, group):
            rows = range(first, min(first + group, hi))
            order += [b * col_blocks + n for n in range(col_blocks) for b in rows]
    return order


def expected_chunked(block_start, col_blocks, group, chunk):
    order = []
    for first in range(0, col_blocks, chunk):
        cols = min(chunk, col_blocks - first)
        order += [t // cols * col_blocks + first + t % cols
                  for t in expected_order(block_start, cols, group)]
    return order


def layouts(rng):
    yield [0, 8], 16                           # one expert of 8 row blocks
    yield [0, 0, 3, 3, 3, 20, 21], 28          # empty segments between others, a hot one
    yield [0, 1, 2, 3], 1                      # one column block
    for _ in range(200):
        L = int(rng.integers(1, 40))
        rows = rng.integers(0, 25, L) * (rng.random(L) > 0.3)  # some experts empty
        yield [0, *np.cumsum(rows).tolist()], int(rng.integers(1, 30))


@pytest.mark.parametrize("group", [1, 3, 64, "kernels"])
def test_tiles_go_by_expert_then_row_block_group_then_column(ext, group):
    group = ext.fused_raster_row_blocks if group == "kernels" else group
    rng = np.random.default_rng(group)
    for block_start, col_blocks in layouts(rng):
        got = ext.fused_tile_order(block_start, col_blocks, group)
        want = expected_order(block_start, col_blocks, group)
        assert got == want, (block_start, col_blocks, group)
        assert sorted(got) == list(range(block_start[-1] * col_blocks))  # each tile once


@pytest.mark.parametrize("chunk", [1, 3, 5, "kernels"])
def test_chunked_tiles_go_chunk_by_chunk_over_every_row_block(ext, chunk):
    chunk = ext.fused_chunk_blocks if chunk == "kernels" else chunk
    rng = np.random.default_rng(100 + chunk)
    group = ext.fused_raster_row_blocks
    for block_start, col_blocks in layouts(rng):
        got = ext.fused_tile_order(block_start, col_blocks, group, chunk)
        assert got == expected_chunked(block_start, col_blocks, group, chunk), (
            block_start, col_blocks, chunk)
        assert sorted(got) == list(range(block_start[-1] * col_blocks))  # each tile once
        chunks = [t % col_blocks // chunk for t in got]
        assert chunks == sorted(chunks)        # every tile of a chunk before the next chunk's
    # a chunk as wide as the row or wider is the unchunked order
    assert (ext.fused_tile_order([0, 3, 5], 4, 2, 4) == ext.fused_tile_order([0, 3, 5], 4, 2, 9)
            == ext.fused_tile_order([0, 3, 5], 4, 2))


def test_the_kernels_group_and_the_argument_checks(ext):
    assert ext.fused_raster_row_blocks >= 1
    assert ext.fused_tile_order([0, 2], 3, 1) == [0, 1, 2, 3, 4, 5]  # group 1: row-block order
    for bad, what in ((([0], 1, 1), "block_start needs"), (([1, 2], 1, 1), "start at 0"),
                      (([0, 2, 1], 1, 1), "not decrease"), (([0, 2], 0, 1), "col_blocks"),
                      (([0, 2], 1, 0), "group"), (([0, 2**30], 4, 1), "fit an int32"),
                      (([0, 2], 2**20, 2**12), "fit an int32"),
                      (([0, 2], 1, 1, -1), "chunk_blocks")):
        with pytest.raises(ValueError, match=what):
            ext.fused_tile_order(*bad)
