"""Launch geometry of the simple kernels (docs/semantics.md §4).

These functions describe the grids the ``impl="simple"`` CUDA kernels launch
with (two launches per fold: a shrink into ``xa``, then an expand-and-fold);
they need no GPU, so tests check the window and grid arithmetic on any
machine. ``MLG_M_TILE`` is the value the extension was compiled with.
"""

from __future__ import annotations

from jax_moelora._ext import (
    GBGMV_N_PER_BLOCK,
    GBGMV_THREADS,
    GBGMV_THREADS_PER_OUTPUT,
    MLG_M_TILE,
    RANK_ALIGN,
)

__all__ = [
    "MLG_M_TILE",
    "GBGMV_THREADS",
    "GBGMV_N_PER_BLOCK",
    "GBGMV_THREADS_PER_OUTPUT",
    "RANK_ALIGN",
    "gather_bgmv_grids",
    "gather_row_token",
    "grouped_down_wc",
    "grouped_down_windows",
    "padded_rank",
]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_nonneg(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")


def gather_bgmv_grids(
    max_rank: int, n_out: int, n_slots: int
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(shrink, expand)`` grids of the simple gather fold.

    Each 256-thread block computes 4 outputs of one row (64 threads each):
    shrink ``(ceil(max_rank / 4), n_slots, 1)``, expand
    ``(ceil(n_out / 4), n_slots, 1)``.
    """
    _check_nonneg(max_rank=max_rank, n_out=n_out, n_slots=n_slots)
    return (
        (_ceil_div(max_rank, GBGMV_N_PER_BLOCK), n_slots, 1),
        (_ceil_div(n_out, GBGMV_N_PER_BLOCK), n_slots, 1),
    )


def gather_row_token(row: int, top_k: int) -> int:
    """The token that owns flat ``(token, slot)`` row ``row``: ``row // top_k``."""
    _check_nonneg(row=row, top_k=top_k)
    if top_k == 0:
        raise ValueError("top_k must be >= 1")
    return row // top_k


def grouped_down_wc(row_offset: int, row_end: int) -> int:
    """``grid.y`` of the grouped fold for the window ``[row_offset, row_end)``.

    ``max(1, ceil(max(0, row_end - row_offset) / MLG_M_TILE))``.
    """
    return max(1, _ceil_div(max(0, row_end - row_offset), MLG_M_TILE))


def grouped_down_windows(total_rows: int, cap: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` windows of at most ``cap`` rows covering
    ``0 .. total_rows`` (an empty list for 0 rows). ``cap == 0`` raises."""
    _check_nonneg(total_rows=total_rows, cap=cap)
    if cap == 0:
        raise ValueError("grouped_down_windows: cap must be >= 1, got 0")
    return [(s, min(s + cap, total_rows)) for s in range(0, total_rows, cap)]


def padded_rank(r: int) -> int:
    """``r`` rounded up to a multiple of 8 (16-byte rows in bf16)."""
    _check_nonneg(r=r)
    return _ceil_div(r, RANK_ALIGN) * RANK_ALIGN
