"""Cases of the docs/semantics.md §7 benchmark: models, the case grid, seeded inputs and
the HBM byte floor.

A case is one (model, projection, tokens, rank, adapters) point. Its inputs
are built on the host with a seeded NumPy generator (``top_k`` distinct
experts per token, one adapter per token, every (adapter, expert) pair
adapted) and put on the device once; the timed programs never see the host.

Decode cases (``tokens <= decode_max_tokens``, by default
``DECODE_MAX_TOKENS``) use the gather fold on the unsorted flat rows;
prefill cases use the grouped fold on rows that are already sorted by
expert and, within an expert, by adapter (the order
``moe_lora_fold`` and ``MoEBlock`` fold in: ``ops.sort_rows_by_expert``; the
sort is done here, outside the timed region).

The ``router`` projection (not in the default grid) is the router's fold as
``MoEBlock`` runs it: one row a token, ``x`` the activations (the case's
dtype) against float32 pools, ``base_out`` the float32 logits ``[T,
n_experts]``, one table column (``n_experts = 1`` in the route): the gather
fold at every token count.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora.ops.folds import sort_rows_by_expert
from jax_moelora.tables import MoeExpertRoute

__all__ = [
    "Model", "Case", "CaseInputs", "MODELS", "PROJECTIONS", "DECODE_TOKENS", "PREFILL_TOKENS",
    "DECODE_MAX_TOKENS", "ROUTER", "parse_model", "case_grid", "make_routing", "make_inputs",
    "floor_bytes", "case_floor_bytes",
]

DECODE_TOKENS = (1, 16, 64, 256)
PREFILL_TOKENS = (4096, 16384)
# Token counts up to this are decode (gather fold); larger ones are prefill.
DECODE_MAX_TOKENS = 256
PROJECTIONS = ("gate", "down")
# The router's fold: float32 pools, one table column (module docstring).
ROUTER = "router"


@dataclasses.dataclass(frozen=True)
class Model:
    """The MoE layer shape of one model."""

    name: str
    n_experts: int
    top_k: int
    hidden: int
    inter: int


MODELS: dict[str, Model] = {
    m.name: m for m in (
        Model("Qwen3-30B-A3B", 128, 8, 2048, 768),
        Model("Mixtral-8x7B", 8, 2, 4096, 14336),
        Model("DeepSeek-V2-Lite", 64, 6, 2048, 1408),
    )
}
_ALIASES = {"qwen": "Qwen3-30B-A3B", "mixtral": "Mixtral-8x7B", "deepseek": "DeepSeek-V2-Lite"}


def parse_model(spec: str) -> Model:
    """A model by name (case-insensitive; ``qwen``, ``mixtral``, ``deepseek``
    also work) or a custom ``name:experts:top_k:hidden:inter``."""
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) != 5:
            raise ValueError(f"custom model must be name:experts:top_k:hidden:inter, got {spec!r}")
        e, k, h, i = (int(p) for p in parts[1:])
        if min(e, k, h, i) < 1 or k > e:
            raise ValueError(f"custom model {spec!r}: sizes must be positive and top_k <= experts")
        return Model(parts[0], e, k, h, i)
    low = spec.lower()
    for name, model in MODELS.items():
        if name.lower() == low:
            return model
    if low in _ALIASES:
        return MODELS[_ALIASES[low]]
    raise ValueError(f"unknown model {spec!r}; known: {', '.join(MODELS)} "
                     "(or name:experts:top_k:hidden:inter)")


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark point."""

    model: Model
    proj: str
    tokens: int
    rank: int
    adapters: int
    seed: int = 0
    decode_max_tokens: int = DECODE_MAX_TOKENS  # up to it the gather fold, above the grouped

    @property
    def x_gather(self) -> int:
        return 1 if self.proj == "gate" else 0

    @property
    def k_in(self) -> int:
        return self.model.inter if self.proj == "down" else self.model.hidden

    @property
    def n_out(self) -> int:
        return {"gate": self.model.inter, "down": self.model.hidden,
                ROUTER: self.model.n_experts}[self.proj]

    @property
    def top_k(self) -> int:
        """Rows a token: the model's top_k, 1 for the router."""
        return 1 if self.proj == ROUTER else self.model.top_k

    @property
    def table_experts(self) -> int:
        """Columns of the route's tables: the model's experts, 1 for the router."""
        return 1 if self.proj == ROUTER else self.model.n_experts

    @property
    def phase(self) -> str:
        return "decode" if self.tokens <= self.decode_max_tokens else "prefill"

    @property
    def gather(self) -> bool:
        """Whether the gather fold runs (decode, and the router at any T);
        else the grouped fold over sorted rows."""
        return self.phase == "decode" or self.proj == ROUTER

    @property
    def n_rows(self) -> int:
        return self.tokens * self.top_k

    def pool_dtype(self, dtype) -> jnp.dtype:
        """The pools' and ``base_out``'s dtype for activations of ``dtype``:
        float32 for the router, else ``dtype``."""
        return jnp.dtype(jnp.float32 if self.proj == ROUTER else dtype)

    @property
    def label(self) -> str:
        return (f"{self.model.name} {self.proj} T={self.tokens} ({self.phase}) "
                f"R={self.rank} L={self.adapters}")


def case_grid(models: Sequence[Model], projs: Sequence[str] = PROJECTIONS,
              tokens: Sequence[int] = DECODE_TOKENS + PREFILL_TOKENS,
              ranks: Sequence[int] = (16, 64), adapters: Sequence[int] = (1, 4),
              seed: int = 0, decode_max_tokens: int = DECODE_MAX_TOKENS) -> list[Case]:
    """Every combination, in the order model, projection, rank, adapters, tokens;
    token counts up to ``decode_max_tokens`` are decode cases (gather fold).
    ``projs``: of ``gate``, ``down`` and ``router``."""
    known = PROJECTIONS + (ROUTER,)
    for p in projs:
        if p not in known:
            raise ValueError(f"projection must be one of {known}, got {p!r}")
    for name, vals in (("tokens", tokens), ("ranks", ranks), ("adapters", adapters)):
        if any(int(v) < 1 for v in vals):
            raise ValueError(f"{name} must be positive, got {list(vals)}")
    return [Case(m, p, int(t), int(r), int(l), seed, int(decode_max_tokens))
            for m, p, r, l, t in itertools.product(models, projs, ranks, adapters, tokens)]


def make_routing(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """Seeded ``(topk_ids int32 [T, top_k], row_adapter int32 [T])``: distinct
    experts per token (the router: ``[T, 1]`` zeros, its one table column),
    adapters drawn uniformly from ``0 .. L-1`` (the same for every projection
    of a model and token count)."""
    m = case.model
    rng = np.random.default_rng([case.seed, m.n_experts, m.top_k, case.tokens, case.adapters])
    picks = rng.random((case.tokens, m.n_experts))
    if case.proj == ROUTER:
        topk = np.zeros((case.tokens, 1), np.int32)
    else:
        topk = np.argsort(picks, axis=1)[:, :m.top_k]
    row_adapter = rng.integers(0, case.adapters, size=case.tokens)
    return topk.astype(np.int32), row_adapter.astype(np.int32)


def floor_bytes(topk_ids: np.ndarray, row_adapter: np.ndarray | None, *, rank: int, k_in: int,
                n_out: int, x_gather: int, itemsize: int = 2,
                adapted: np.ndarray | None = None,
                x_itemsize: int | None = None) -> dict[str, int]:
    """The bytes a perfect fold moves (docs/semantics.md §7), counted from the routing.

    ``adapted`` (bool ``[L, E]``, default all True) says which (table row,
    expert) cells hold an adapter; rows of other cells, and rows whose token
    maps to an adapter ``< 0``, are not folded. Counts: each distinct touched
    (adapter, expert) A ``[R, K]`` and B ``[N, R]`` block once; ``x`` once
    (the distinct tokens of folded rows when ``x_gather`` is 1, else the
    folded rows); ``base_out`` of folded rows read and written once.
    ``itemsize``: bytes an element of the pools and ``base_out``;
    ``x_itemsize``: of ``x`` (default ``itemsize``). Returns the parts and
    their ``total``.
    """
    topk_ids = np.asarray(topk_ids)
    T, top_k = topk_ids.shape
    experts = topk_ids.reshape(-1).astype(np.int64)
    tok = np.repeat(np.arange(T), top_k)
    ra = np.zeros(T, np.int64) if row_adapter is None else np.asarray(row_adapter, np.int64)
    adapter = ra[tok]
    ok = adapter >= 0
    if adapted is not None:
        adapted = np.asarray(adapted, bool)
        L, E = adapted.shape
        l = np.zeros_like(adapter) if L == 1 else adapter
        inside = ok & (l < L) & (experts >= 0) & (experts < E)
        ok = inside.copy()
        ok[inside] = adapted[l[inside], experts[inside]]
    l = adapter
    if adapted is not None and adapted.shape[0] == 1:
        l = np.zeros_like(adapter)            # L == 1: every adapter value selects row 0
    pairs = {(int(a), int(e)) for a, e in zip(l[ok], experts[ok])}
    n_pairs = len(pairs)
    x_rows = len(np.unique(tok[ok])) if x_gather else int(ok.sum())
    parts = {
        "pairs": n_pairs,
        "folded_rows": int(ok.sum()),
        "x_rows": x_rows,
        "ab_bytes": n_pairs * rank * (k_in + n_out) * itemsize,
        "x_bytes": x_rows * k_in * (itemsize if x_itemsize is None else x_itemsize),
        "out_bytes": 2 * int(ok.sum()) * n_out * itemsize,
    }
    parts["total"] = parts["ab_bytes"] + parts["x_bytes"] + parts["out_bytes"]
    return parts


def case_floor_bytes(case: Case, topk_ids: np.ndarray, row_adapter: np.ndarray,
                     dtype=jnp.bfloat16) -> dict[str, int]:
    """``floor_bytes`` of ``case``'s routing (``make_routing``), activations
    of ``dtype`` and pools of ``case.pool_dtype(dtype)``."""
    return floor_bytes(topk_ids, row_adapter, rank=case.rank, k_in=case.k_in, n_out=case.n_out,
                       x_gather=case.x_gather, itemsize=case.pool_dtype(dtype).itemsize,
                       x_itemsize=jnp.dtype(dtype).itemsize)


@dataclasses.dataclass
class CaseInputs:
    """Device inputs of one case.

    ``args`` is the pytree every method takes (besides ``base_out``):
    ``x``, ``route``, ``row_adapter`` and, for the gather fold, ``indices``;
    for the grouped fold ``expert_offsets`` and ``sorted_token_ids`` (rows
    already sorted by expert and adapter). ``bytes`` is ``case_floor_bytes``
    of the routing.
    """

    case: Case
    base_out: jax.Array
    args: dict[str, Any]
    bytes: dict[str, int]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw_device(key, spec, dtype):
    keys = jax.random.split(key, len(spec))
    return [(jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)
            for k, (shape, std) in zip(keys, spec)]


def _draw(seed: int, spec: tuple, dtype) -> list[jax.Array]:
    """Seeded normal arrays ``(shape, std)``: drawn on the device on a GPU
    (fast even at 0.5 GB), with NumPy on the CPU (faster there)."""
    if jax.default_backend() == "gpu":
        return _draw_device(jax.random.key(seed, impl="unsafe_rbg"), spec, jnp.dtype(dtype))
    rng = np.random.default_rng(seed)
    return [jnp.asarray((rng.standard_normal(shape, np.float32) * np.float32(std)).astype(dtype))
            for shape, std in spec]


def make_inputs(case: Case, dtype=jnp.bfloat16) -> CaseInputs:
    """Seeded inputs of ``case`` on JAX's default device: ``x`` of ``dtype``,
    the pools and ``base_out`` of ``case.pool_dtype(dtype)``.

    The routing is drawn on the host (``make_routing``); the float arrays by
    ``_draw``. Pool slot ``1 + l * E + e`` holds adapter ``l``'s expert
    ``e`` (slot 0 reserved; ``E`` the table's columns); A ~ N(0, 1/K) and B ~
    N(0, 1/R), so deltas are O(scale); scales are uniform in [0.25, 1].
    """
    E, L, R, K, N = case.table_experts, case.adapters, case.rank, case.k_in, case.n_out
    T, rows = case.tokens, case.n_rows
    topk, row_adapter = make_routing(case)
    rng = np.random.default_rng([case.seed, E, L, R, K, N, T])
    P = 1 + L * E
    spec = (((P, R, K), float(1.0 / np.sqrt(K))), ((P, N, R), float(1.0 / np.sqrt(R))),
            ((rows, N), 1.0), ((T if case.x_gather else rows, K), 1.0))
    a_pool, b_pool, base_out, x = _draw(int(rng.integers(2**31)), spec, case.pool_dtype(dtype))
    x = x.astype(dtype)
    slots = (1 + np.arange(L)[:, None] * E + np.arange(E)[None, :]).astype(np.int32)
    scale = rng.uniform(0.25, 1.0, size=(L, E)).astype(np.float32)
    route = MoeExpertRoute(a_pool=a_pool, b_pool=b_pool, a_table=jnp.asarray(slots),
                           b_table=jnp.asarray(slots), scale_table=jnp.asarray(scale))
    args: dict[str, Any] = {"route": route, "row_adapter": jnp.asarray(row_adapter), "x": x}
    if case.gather:
        args["indices"] = jnp.asarray(topk.reshape(-1))
    else:
        _, offsets, sorted_tok = sort_rows_by_expert(jnp.asarray(topk), E,
                                                     jnp.asarray(row_adapter), L)
        args["expert_offsets"] = offsets
        args["sorted_token_ids"] = sorted_tok
    nbytes = case_floor_bytes(case, topk, row_adapter, dtype)
    return CaseInputs(case, jax.block_until_ready(base_out), args, nbytes)
