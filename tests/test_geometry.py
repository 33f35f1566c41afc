"""docs/semantics.md §4: launch geometry of the simple kernels."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_moelora as jm
from jax_moelora import _ext, geometry

SETTINGS = settings(max_examples=50, deadline=None)
sizes = st.integers(0, 1 << 20)


# --------------------------------------------------------------------------
# constants shared with the compiled kernels
# --------------------------------------------------------------------------

def test_mlg_m_tile_is_the_compiled_value():
    # The header is the one source of the constant: read it here independently
    # of the extension, which must have been compiled with the same value.
    header = (Path(__file__).resolve().parents[1] / "ffi_src" / "moelora_constants.h").read_text()
    found = re.search(r"kMlgMTile\s*=\s*(\d+)\s*;", header)
    assert found, "kMlgMTile not found in ffi_src/moelora_constants.h"
    assert int(found.group(1)) == _ext.ext.MLG_M_TILE == 64  # docs/semantics.md §4
    assert geometry.MLG_M_TILE == 64 and jm.MLG_M_TILE == 64
    # the Python geometry tiles by it
    assert geometry.grouped_down_wc(0, 64) == 1 and geometry.grouped_down_wc(0, 65) == 2


def test_cuda_tile_matches_when_built():
    if _ext.HAS_CUDA:
        assert _ext.ext.CUDA_MLG_M_TILE == geometry.MLG_M_TILE
    else:
        assert _ext.ext.CUDA_MLG_M_TILE is None


def test_gather_block_constants():
    assert geometry.GBGMV_THREADS == 256 and geometry.GBGMV_N_PER_BLOCK == 4
    assert geometry.GBGMV_THREADS_PER_OUTPUT == 64
    assert geometry.GBGMV_N_PER_BLOCK * geometry.GBGMV_THREADS_PER_OUTPUT == geometry.GBGMV_THREADS
    assert geometry.RANK_ALIGN == 8
    assert (geometry.GBGMV_THREADS, geometry.RANK_ALIGN) == (_ext.ext.GBGMV_THREADS,
                                                              _ext.ext.RANK_ALIGN)


# --------------------------------------------------------------------------
# gather_bgmv_grids
# --------------------------------------------------------------------------

@SETTINGS
@given(max_rank=sizes, n_out=sizes, n_slots=sizes)
def test_gather_bgmv_grids(max_rank, n_out, n_slots):
    shrink, expand = jm.gather_bgmv_grids(max_rank, n_out, n_slots)
    assert shrink == (math.ceil(max_rank / 4), n_slots, 1)
    assert expand == (math.ceil(n_out / 4), n_slots, 1)
    # 4 outputs per block: the blocks cover every output, no block is empty
    for out, grid in ((max_rank, shrink), (n_out, expand)):
        assert grid[0] * 4 >= out and (grid[0] - 1) * 4 < max(out, 1)


@pytest.mark.parametrize("args, err", [
    ((-1, 4, 4), ValueError),
    ((8, -4, 4), ValueError),
    ((8, 4, -1), ValueError),
    ((8.0, 4, 4), TypeError),
    ((8, "4", 4), TypeError),
    ((8, 4, True), TypeError),
])
def test_gather_bgmv_grids_invalid(args, err):
    with pytest.raises(err):
        jm.gather_bgmv_grids(*args)


# --------------------------------------------------------------------------
# gather_row_token
# --------------------------------------------------------------------------

@SETTINGS
@given(token=st.integers(0, 1 << 16), top_k=st.integers(1, 16), data=st.data())
def test_gather_row_token(token, top_k, data):
    k = data.draw(st.integers(0, top_k - 1))
    row = token * top_k + k  # slot-major flat row
    assert jm.gather_row_token(row, top_k) == token


@pytest.mark.parametrize("args, err", [
    ((4, 0), ValueError),
    ((-1, 2), ValueError),
    ((4, -2), ValueError),
    ((4.0, 2), TypeError),
    ((4, 2.0), TypeError),
    ((None, 2), TypeError),
])
def test_gather_row_token_invalid(args, err):
    with pytest.raises(err):
        jm.gather_row_token(*args)


# --------------------------------------------------------------------------
# grouped_down_wc / grouped_down_windows
# --------------------------------------------------------------------------

@SETTINGS
@given(row_offset=st.integers(0, 1 << 18), length=st.integers(-300, 1 << 18))
def test_grouped_down_wc(row_offset, length):
    row_end = row_offset + length
    wc = jm.grouped_down_wc(row_offset, row_end)
    rows = max(0, length)
    tile = geometry.MLG_M_TILE
    assert wc == max(1, math.ceil(rows / tile))
    # the tiles cover the window and none is wholly past it
    assert wc >= 1 and wc * tile >= rows
    if rows:
        assert (wc - 1) * tile < rows


def test_grouped_down_wc_tile_boundaries():
    tile = geometry.MLG_M_TILE
    assert jm.grouped_down_wc(5, 5) == 1
    assert jm.grouped_down_wc(9, 3) == 1          # reversed window: at least 1
    assert jm.grouped_down_wc(0, tile) == 1
    assert jm.grouped_down_wc(0, tile + 1) == 2
    assert jm.grouped_down_wc(tile, 3 * tile) == 2


def test_grouped_down_wc_invalid():
    with pytest.raises(TypeError):
        jm.grouped_down_wc("0", 4)
    with pytest.raises(TypeError):
        jm.grouped_down_wc(0, None)


@SETTINGS
@given(total=st.integers(0, 5000), cap=st.integers(1, 700))
def test_grouped_down_windows(total, cap):
    wins = jm.grouped_down_windows(total, cap)
    if total == 0:
        assert wins == []
        return
    assert wins[0][0] == 0 and wins[-1][1] == total
    for (s0, e0), (s1, _) in zip(wins, wins[1:]):
        assert e0 == s1  # contiguous
    for s, e in wins:
        assert 0 < e - s <= cap
    assert all(e - s == cap for s, e in wins[:-1])  # only the last one is short
    assert len(wins) == math.ceil(total / cap)


@pytest.mark.parametrize("args, err", [
    ((10, 0), ValueError),
    ((0, 0), ValueError),
    ((-1, 4), ValueError),
    ((10, -4), ValueError),
    ((10.0, 4), TypeError),
    ((10, 4.5), TypeError),
])
def test_grouped_down_windows_invalid(args, err):
    with pytest.raises(err):
        jm.grouped_down_windows(*args)


# --------------------------------------------------------------------------
# padded_rank
# --------------------------------------------------------------------------

@SETTINGS
@given(r=st.integers(0, 4096))
def test_padded_rank(r):
    p = jm.padded_rank(r)
    assert p % 8 == 0 and r <= p < r + 8
    assert p == math.ceil(r / 8) * 8
    assert jm.padded_rank(p) == p  # idempotent


@pytest.mark.parametrize("r, err", [(-1, ValueError), (8.0, TypeError), ("8", TypeError),
                                    (True, TypeError)])
def test_padded_rank_invalid(r, err):
    with pytest.raises(err):
        jm.padded_rank(r)
