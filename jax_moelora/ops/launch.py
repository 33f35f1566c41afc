"""Launch options of the CUDA kernels: read when a fold or ``expert_matmul``
is traced, part of its static configuration, and passed to the custom call as
an attribute.

- programmatic dependent launch (on by default): a kernel that follows a
  plan or shrink kernel of the same fold (the decode cells kernel, the
  prefill expand) may start while that kernel still runs, and waits for its
  results on the device (``griddepcontrol.wait``). Off, it is an ordinary
  launch after it: same results, bit for bit (``tests/test_launch.py``),
  slower; for tools that expect one kernel at a time, and to measure what
  the overlap buys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

__all__ = ["programmatic_launch", "programmatic_launch_enabled"]

_PDL = [True]


@contextlib.contextmanager
def programmatic_launch(enabled: bool) -> Iterator[None]:
    """Folds and ``expert_matmul`` traced within the context launch their
    dependent kernels with programmatic dependent launch when ``enabled``,
    else as ordinary launches (a function already compiled keeps the option
    it was traced with)."""
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"programmatic_launch: enabled must be a bool, got {enabled!r}")
    saved = _PDL[0]
    _PDL[0] = bool(enabled)
    try:
        yield
    finally:
        _PDL[0] = saved


def programmatic_launch_enabled() -> bool:
    """Whether folds traced now use programmatic dependent launch."""
    return _PDL[0]
