"""Range checks for user integers narrowed to int32 and for row counts that
int32 indices must address.

Every int32 operand of the folds (ids, offsets, tables, row-adapter maps) and
every traced row index (``jnp.arange(rows, dtype=int32)``) can name at most
``INT32_MAX + 1`` rows, so a value outside int32 is refused with an error
naming the argument and the value instead of wrapping silently.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["INT32_MAX", "INT32_MIN", "Int32RangeError", "check_int32_values", "check_rows"]

INT32_MAX = int(np.iinfo(np.int32).max)
INT32_MIN = int(np.iinfo(np.int32).min)


class Int32RangeError(OverflowError, ValueError):
    """An integer that must fit int32 does not (an ``OverflowError`` and a
    ``ValueError``, so either ``except`` clause catches it)."""


def check_int32_values(v: Any, name: str, fn: str = "") -> None:
    """Raise :class:`Int32RangeError` when the concrete integer array ``v``
    holds a value outside int32, naming ``fn``, ``name``, the value and its
    position. Traced values (nothing to read without a host sync) and dtypes
    that already fit int32 pass unchecked."""
    if isinstance(v, jax.core.Tracer):
        return
    dt = np.dtype(getattr(v, "dtype", np.asarray(v).dtype))
    if dt.kind not in "iu" or np.can_cast(dt, np.int32, casting="safe"):
        return
    arr = np.asarray(v)
    if arr.size == 0:
        return
    bad = (arr < INT32_MIN) | (arr > INT32_MAX)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        where = f" at index {pos if len(pos) != 1 else pos[0]}" if pos else ""
        prefix = f"{fn}: " if fn else ""
        raise Int32RangeError(f"{prefix}{name} holds {int(arr[bad].flat[0])}{where}, outside the "
                              f"int32 range [{INT32_MIN}, {INT32_MAX}]")


def check_rows(fn: str, name: str, rows: int) -> None:
    """Raise ``ValueError`` when ``rows`` (a static row count of ``name``) is
    more than int32 indices can address (``INT32_MAX`` rows)."""
    if rows > INT32_MAX:
        raise ValueError(f"{fn}: {name} has {rows} rows; int32 row indices address at most "
                         f"{INT32_MAX} (2**31 - 1) rows")
