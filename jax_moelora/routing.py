"""MoE LoRA routing: the per-request fold decision and the per-token adapter
maps the fold kernels read (docs/semantics.md §2).

A row-adapter map is an int32 array with one value per token: ``< 0`` means
"no fold on this token" (the base model); a value ``l >= 0`` selects table row
``l`` of a :class:`~jax_moelora.tables.MoeExpertRoute` (with ``L == 1`` every
non-negative value selects row 0).

Host functions take Python ints / NumPy arrays. The traced functions
(``build_moe_row_adapter``, ``build_moe_row_adapter_decode*``, the array forms
of ``resolve_moe_lora_route*``, ``decode_route_servable`` and
``checkify_decode_route_servable``) are plain ``jnp`` code: they run under
``jax.jit`` with static shapes, no host callback and no host sync.
"""

from __future__ import annotations

import enum
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jax_moelora.int_range import check_int32_values
from jax_moelora.ops.search import searchsorted

__all__ = [
    "Route",
    "UnservableBatchError",
    "resolve_moe_lora_route",
    "resolve_moe_lora_route_multi",
    "ensure_decode_route_servable",
    "decode_route_servable",
    "checkify_decode_route_servable",
    "build_moe_row_adapter_host",
    "build_moe_row_adapter",
    "build_moe_row_adapter_decode",
    "build_moe_row_adapter_decode_multi",
]

_I32 = np.iinfo(np.int32)


class Route(enum.IntEnum):
    """The MoE LoRA fold decision of one request (an ``IntEnum``; the array
    forms use the same values as int32)."""

    FOLD = 0    #: fold the request's adapter (or nothing is loaded)
    SKIP = 1    #: base-model request: no fold
    REFUSE = 2  #: the request's adapter is not installed: the batch cannot be served


class UnservableBatchError(ValueError):
    """A decode batch holds a sequence whose adapter is not installed
    (route ``REFUSE``). ``path`` names the caller, ``refused`` counts the
    refused sequences."""

    def __init__(self, message: str, *, path: str, refused: int) -> None:
        super().__init__(message)
        self.path = path
        self.refused = refused


# --------------------------------------------------------------------------
# input helpers
# --------------------------------------------------------------------------

def _is_int_scalar(v: Any) -> bool:
    """A Python/NumPy integer scalar (not bool, not an array)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_bool_scalar(v: Any) -> bool:
    return isinstance(v, (bool, np.bool_))


def _int32_array(v: Any, name: str) -> jax.Array:
    """``v`` as an int32 ``jnp`` array; jax arrays (and tracers) are cast
    without a host sync, host values are range-checked first."""
    if isinstance(v, jax.Array):
        if not jnp.issubdtype(v.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {v.dtype}")
        check_int32_values(v, name)
        return v.astype(jnp.int32)
    if _is_bool_scalar(v):
        raise TypeError(f"{name} must be an integer, got bool")
    arr = np.asarray(v)
    if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) is float64
        arr = arr.astype(np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    check_int32_values(arr, name)
    return jnp.asarray(arr.astype(np.int32))


def _bool_array(v: Any, name: str) -> jax.Array:
    if isinstance(v, jax.Array):
        if v.dtype != jnp.bool_:
            raise TypeError(f"{name} must be a bool array, got dtype {v.dtype}")
        return v
    arr = np.asarray(v)
    if arr.size == 0 and arr.dtype.kind == "f":
        arr = arr.astype(np.bool_)
    if arr.dtype != np.bool_:
        raise TypeError(f"{name} must be bool, got dtype {arr.dtype}")
    return jnp.asarray(arr)


def _scalar(v: jax.Array, name: str) -> jax.Array:
    if v.ndim != 0:
        raise ValueError(f"{name} must be a scalar, got shape {tuple(v.shape)}")
    return v


def _static_size(v: Any, name: str) -> int:
    try:
        n = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be a static Python int, got {type(v).__name__}") from None
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be a static Python int, got bool")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


def _vector(v: jax.Array, name: str) -> jax.Array:
    if v.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(v.shape)}")
    return v


# --------------------------------------------------------------------------
# the fold decision
# --------------------------------------------------------------------------

def resolve_moe_lora_route(adapter_slot: Any, active: Any, has_moe_lora: Any) -> Route | jax.Array:
    """The fold decision of a request in single-active mode.

    No MoE LoRA loaded -> ``FOLD``; ``adapter_slot < 0`` -> ``SKIP``;
    ``adapter_slot == active`` -> ``FOLD``; any other slot -> ``REFUSE``
    (only the active adapter's experts are installed).

    Args:
      adapter_slot: the request's adapter slot: an int, or an int array of
        any shape (one per request).
      active: the active adapter slot (an int or a 0-d int array; ``-1``
        when none is loaded).
      has_moe_lora: whether a MoE LoRA is loaded (bool or 0-d bool array).

    Returns:
      A :class:`Route` when every argument is a Python/NumPy scalar; else an
      int32 ``jnp`` array shaped like ``adapter_slot`` holding Route values
      (traceable under ``jit``).
    """
    if _is_int_scalar(adapter_slot) and _is_int_scalar(active) and _is_bool_scalar(has_moe_lora):
        if not has_moe_lora:
            return Route.FOLD
        if adapter_slot < 0:
            return Route.SKIP
        return Route.FOLD if adapter_slot == active else Route.REFUSE
    slot = _int32_array(adapter_slot, "adapter_slot")
    act = _scalar(_int32_array(active, "active"), "active")
    has = _scalar(_bool_array(has_moe_lora, "has_moe_lora"), "has_moe_lora")
    route = jnp.where(slot < 0, jnp.int32(Route.SKIP),
                      jnp.where(slot == act, jnp.int32(Route.FOLD), jnp.int32(Route.REFUSE)))
    return jnp.where(has, route, jnp.int32(Route.FOLD)).astype(jnp.int32)


def resolve_moe_lora_route_multi(adapter_slot: Any, installed: Any,
                                 has_moe_lora: Any = True) -> Route | jax.Array:
    """The fold decision of a request when several adapters are installed.

    No MoE LoRA loaded -> ``FOLD``; ``adapter_slot < 0`` -> ``SKIP``;
    ``installed[adapter_slot]`` -> ``FOLD``; a slot that is not installed or
    is ``>= len(installed)`` -> ``REFUSE``.

    Args:
      adapter_slot: an int, or an int array of any shape.
      installed: bool ``[max_loras]``: which adapter slots have their
        experts installed.
      has_moe_lora: bool or 0-d bool array.

    Returns:
      A :class:`Route` when ``adapter_slot`` and ``has_moe_lora`` are
      scalars and ``installed`` is a host sequence / NumPy array; else an
      int32 ``jnp`` array shaped like ``adapter_slot`` (traceable).
    """
    if (_is_int_scalar(adapter_slot) and _is_bool_scalar(has_moe_lora)
            and not isinstance(installed, jax.Array)):
        inst = np.asarray(installed)
        if inst.size == 0 and inst.dtype.kind == "f":
            inst = inst.astype(np.bool_)
        if inst.dtype != np.bool_:
            raise TypeError(f"installed must be bool, got dtype {inst.dtype}")
        if inst.ndim != 1:
            raise ValueError(f"installed must be 1-D [max_loras], got shape {inst.shape}")
        if not has_moe_lora:
            return Route.FOLD
        if adapter_slot < 0:
            return Route.SKIP
        ok = adapter_slot < inst.shape[0] and bool(inst[adapter_slot])
        return Route.FOLD if ok else Route.REFUSE
    slot = _int32_array(adapter_slot, "adapter_slot")
    inst = _vector(_bool_array(installed, "installed"), "installed")
    has = _scalar(_bool_array(has_moe_lora, "has_moe_lora"), "has_moe_lora")
    n = inst.shape[0]
    if n == 0:
        hit = jnp.zeros(slot.shape, jnp.bool_)
    else:
        hit = inst[jnp.clip(slot, 0, n - 1)] & (slot < n)
    route = jnp.where(slot < 0, jnp.int32(Route.SKIP),
                      jnp.where(hit, jnp.int32(Route.FOLD), jnp.int32(Route.REFUSE)))
    return jnp.where(has, route, jnp.int32(Route.FOLD)).astype(jnp.int32)


# --------------------------------------------------------------------------
# refusing unservable batches
# --------------------------------------------------------------------------

def _refusal_message(path: str, count: str) -> str:
    return (f"MoE LoRA {path}: {count} sequence(s) of the batch route to a non-active "
            "adapter whose experts are not installed; refusing the batch rather than "
            "mis-folding it with the active adapter (serve one adapter per batch, or "
            "install the adapter)")


def _check_path(path: Any) -> str:
    if not isinstance(path, str):
        raise TypeError(f"path must be a str, got {type(path).__name__}")
    return path


def ensure_decode_route_servable(route: Any, path: str) -> None:
    """Raise :class:`UnservableBatchError` when ``route`` is ``REFUSE``.

    Args:
      route: a :class:`Route`, an int Route value, or a concrete array of
        Route values (raises if any entry is ``REFUSE``).
      path: the caller, named in the message (e.g. ``"decode_step"``).

    Raises:
      UnservableBatchError: a sequence routes to a non-active adapter.
      ValueError: ``route`` holds a value that is not a Route.
      TypeError: ``route`` is traced (use :func:`checkify_decode_route_servable`
        or :func:`decode_route_servable` inside ``jit``) or not an int.
    """
    path = _check_path(path)
    if _is_bool_scalar(route):
        raise TypeError("route must be a Route or int, got bool")
    try:
        values = np.asarray(route)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise TypeError(
            "ensure_decode_route_servable needs a concrete route; inside jit use "
            "checkify_decode_route_servable (under jax.experimental.checkify) or "
            "decode_route_servable (a device flag)") from None
    if values.dtype.kind not in "iu":
        raise TypeError(f"route must hold Route values (integers), got dtype {values.dtype}")
    bad = ~np.isin(values, [int(r) for r in Route])
    if bad.any():
        raise ValueError(f"route holds values that are not a Route: {np.unique(values[bad]).tolist()}")
    refused = int(np.count_nonzero(values == Route.REFUSE))
    if refused:
        raise UnservableBatchError(_refusal_message(path, str(refused)), path=path, refused=refused)


def decode_route_servable(route: Any) -> jax.Array:
    """Device flag: a bool scalar, True when no entry of ``route`` is
    ``REFUSE`` (traceable; gate the fold or return it to the host)."""
    r = _int32_array(route, "route")
    return jnp.all(r != jnp.int32(Route.REFUSE))


def checkify_decode_route_servable(route: Any, path: str) -> None:
    """In-``jit`` twin of :func:`ensure_decode_route_servable`: a
    ``jax.experimental.checkify.check`` that fails when any entry of
    ``route`` is ``REFUSE``.

    Call it inside a function wrapped by ``checkify.checkify`` (``errors``
    must include ``checkify.user_checks``); ``err.throw()`` then raises with
    the refusal message naming ``path``.
    """
    path = _check_path(path)
    r = _int32_array(route, "route")
    refused = jnp.sum(r == jnp.int32(Route.REFUSE))
    safe_path = path.replace("{", "{{").replace("}", "}}")
    checkify.check(refused == 0, _refusal_message(safe_path, "{refused}"), refused=refused)


# --------------------------------------------------------------------------
# per-token adapter maps
# --------------------------------------------------------------------------

def _host_int_vector(v: Any, name: str) -> np.ndarray:
    if _is_bool_scalar(v) or _is_int_scalar(v):
        raise TypeError(f"{name} must be a 1-D sequence of ints, got a scalar")
    try:
        arr = np.asarray(v)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"{name}: build_moe_row_adapter_host is host-only; use "
                        "build_moe_row_adapter inside jit") from None
    if arr.size == 0 and arr.dtype.kind == "f":
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr.astype(np.int64)


def build_moe_row_adapter_host(cu_seqlens: Any, adapter_slots: Any) -> np.ndarray | None:
    """Per-token adapter map of a packed prefill batch (NumPy, host).

    Args:
      cu_seqlens: int ``[batch + 1]``, the prefix sum of stream lengths.
      adapter_slots: int ``[batch]``, each stream's adapter slot.

    Returns:
      int32 ``[cu_seqlens[-1]]`` with ``adapter_slots[b]`` written unchanged
      over tokens ``cu_seqlens[b] .. cu_seqlens[b+1]``; or ``None`` (nothing
      built) when ``cu_seqlens`` has fewer than 2 entries, ``adapter_slots``
      is not ``batch`` long, ``cu_seqlens[0] != 0``, or any boundary is
      negative or decreasing (every boundary is checked before the map is
      sized from the last one).

    Raises:
      TypeError / ValueError: inputs that are not 1-D integer sequences, or
        slots outside the int32 range.
    """
    cu = _host_int_vector(cu_seqlens, "cu_seqlens")
    slots = _host_int_vector(adapter_slots, "adapter_slots")
    check_int32_values(slots, "adapter_slots", "build_moe_row_adapter_host")
    if cu.shape[0] < 2:
        return None
    batch = cu.shape[0] - 1
    if slots.shape[0] != batch or cu[0] != 0:
        return None
    if np.any(cu < 0) or np.any(np.diff(cu) < 0):
        return None
    lengths = np.diff(cu)
    return np.repeat(slots.astype(np.int32), lengths)


def build_moe_row_adapter(cu_seqlens: Any, adapter_slots: Any,
                          num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Traceable twin of :func:`build_moe_row_adapter_host` with a static
    token count.

    Args:
      cu_seqlens: int ``[batch + 1]`` (host or traced).
      adapter_slots: int ``[batch]`` (host or traced).
      num_tokens: static Python int, the length of the map.

    Returns:
      ``(map, valid)``: ``map`` int32 ``[num_tokens]``, ``valid`` a bool
      scalar. ``valid`` is True exactly when the host function returns a map
      that fits, i.e. not ``None`` and ``cu_seqlens[-1] <= num_tokens``; then
      ``map[:cu_seqlens[-1]]`` equals the host map and tokens past
      ``cu_seqlens[-1]`` are -1. When ``valid`` is False the map is all -1
      (nothing folds). Shape mismatches that make the host return ``None``
      (fewer than 2 boundaries, ``batch`` slots missing) give a constant
      ``valid = False``.
    """
    n = _static_size(num_tokens, "num_tokens")
    cu = _vector(_int32_array(cu_seqlens, "cu_seqlens"), "cu_seqlens")
    slots = _vector(_int32_array(adapter_slots, "adapter_slots"), "adapter_slots")
    empty = jnp.full((n,), -1, jnp.int32)
    batch = cu.shape[0] - 1
    if batch < 1 or slots.shape[0] != batch:
        return empty, jnp.bool_(False)
    valid = ((cu[0] == 0) & jnp.all(cu >= 0) & jnp.all(cu[1:] >= cu[:-1])
             & (cu[batch] <= n))
    t = jnp.arange(n, dtype=jnp.int32)
    # the stream holding token t: the last b with cu[b] <= t (empty streams
    # are passed over because their end equals the next stream's start).
    b = searchsorted(cu, t, side="right") - 1
    inside = (t < cu[batch]) & (b >= 0) & (b < batch)
    m = jnp.where(inside, slots[jnp.clip(b, 0, batch - 1)], jnp.int32(-1))
    return jnp.where(valid, m, empty), valid


def _decode_slots(adapter_slots: Any, padded_n: int) -> tuple[int, jax.Array]:
    n = _static_size(padded_n, "padded_n")
    slots = _vector(_int32_array(adapter_slots, "adapter_slots"), "adapter_slots")
    if slots.shape[0] > n:
        raise ValueError(f"adapter_slots has {slots.shape[0]} sequences, more than padded_n={n}")
    return n, slots


def _pad(v: jax.Array, n: int) -> jax.Array:
    return jnp.pad(v, (0, n - v.shape[0]), constant_values=-1)


def build_moe_row_adapter_decode(adapter_slots: Any, padded_n: int, active: Any,
                                 has_moe_lora: Any) -> jax.Array:
    """The ``[padded_n]`` per-token map of a decode batch (single-active).

    Row ``i`` is ``active`` when ``resolve_moe_lora_route(adapter_slots[i],
    active, has_moe_lora)`` is ``FOLD``, else -1: ``SKIP``, ``REFUSE`` and
    padding rows (``i >= len(adapter_slots)``) are all -1. (With no MoE LoRA
    the route is ``FOLD`` and ``active`` is -1 by convention, so all rows
    are -1.) Check for ``REFUSE`` separately
    (:func:`ensure_decode_route_servable`): this map silently skips it.

    Args:
      adapter_slots: int ``[batch]`` with ``batch <= padded_n`` (traceable).
      padded_n: static Python int.
      active: int or 0-d int array.
      has_moe_lora: bool or 0-d bool array.

    Returns:
      int32 ``[padded_n]`` (a ``jnp`` array).
    """
    n, slots = _decode_slots(adapter_slots, padded_n)
    act = _scalar(_int32_array(active, "active"), "active")
    route = resolve_moe_lora_route(slots, act, has_moe_lora)
    return _pad(jnp.where(route == jnp.int32(Route.FOLD), act, jnp.int32(-1)), n)


def build_moe_row_adapter_decode_multi(adapter_slots: Any, padded_n: int, installed: Any,
                                       has_moe_lora: Any = True) -> jax.Array:
    """Multi-adapter form of :func:`build_moe_row_adapter_decode`: row ``i``
    is the row's own ``adapter_slots[i]`` when
    ``resolve_moe_lora_route_multi(adapter_slots[i], installed, has_moe_lora)``
    is ``FOLD``, else -1 (``SKIP``, ``REFUSE`` and padding rows). With no
    MoE LoRA every route is ``FOLD``, so the map is the slots themselves
    (padded with -1); there is then no route to fold with.

    Returns:
      int32 ``[padded_n]`` (a ``jnp`` array); traceable, static ``padded_n``.
    """
    n, slots = _decode_slots(adapter_slots, padded_n)
    route = resolve_moe_lora_route_multi(slots, installed, has_moe_lora)
    return _pad(jnp.where(route == jnp.int32(Route.FOLD), slots, jnp.int32(-1)), n)
