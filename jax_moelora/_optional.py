"""Optional dependencies: which extra of the package pulls each one.

``import jax_moelora`` needs only ``jax`` and ``numpy``. The modules that need
more import it under ``needs_extra``, which turns a missing module into an
``ImportError`` naming the extra to install.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["EXTRAS", "needs_extra"]

#: extra -> the distributions it adds (mirrors pyproject.toml's optional-dependencies).
EXTRAS: dict[str, tuple[str, ...]] = {
    "nnx": ("flax",),
    "peft": ("safetensors",),
    "bench": ("matplotlib", "rich"),
}


@contextlib.contextmanager
def needs_extra(extra: str, feature: str) -> Iterator[None]:
    """Run the imports of ``feature`` (a module or command, for the message);
    a missing module raises ``ImportError`` that names ``jax_moelora[extra]``.

    Raises:
      ValueError: ``extra`` is not one of ``EXTRAS``.
    """
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {sorted(EXTRAS)}, got {extra!r}")
    try:
        yield
    except ModuleNotFoundError as err:
        raise ImportError(
            f"{feature} needs {err.name!r}, which is not installed: "
            f"pip install 'jax_moelora[{extra}]' (or 'jax_moelora[all]')") from err
