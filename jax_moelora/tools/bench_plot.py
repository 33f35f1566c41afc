"""The benchmark's plot: % of the byte floor against tokens, one line per
method (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from jax_moelora._optional import needs_extra

with needs_extra("bench", "jax_moelora.tools.bench_plot"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

__all__ = ["plot_rows"]

_COLORS = {"fast": "tab:green", "simple": "tab:orange", "cpu": "tab:purple", "jnp": "tab:gray",
           "ragged_dot": "tab:red", "einsum": "tab:blue"}
_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D"]


def plot_rows(rows: Sequence[dict], path: Path, title: str = "") -> Path:
    """One subplot per (model, projection); x: tokens (log), y: % of floor.

    Color is the method, line style the adapter count, marker the rank.
    Rows without a time, or that failed the check, are not drawn.
    """
    good = [r for r in rows if r.get("pct_floor") is not None and r.get("check") != "MISMATCH"]
    panels = list(dict.fromkeys((r["model"], r["proj"]) for r in rows)) or [("", "")]
    adapters = sorted({r["adapters"] for r in rows})
    ranks = sorted({r["rank"] for r in rows})
    ncols = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, (model, proj) in zip(axes.flat, panels):
        sel = [r for r in good if r["model"] == model and r["proj"] == proj]
        for method in dict.fromkeys(r["method"] for r in sel):
            for li, L in enumerate(adapters):
                for ri, R in enumerate(ranks):
                    pts = sorted((r["tokens"], r["pct_floor"]) for r in sel
                                 if r["method"] == method and r["adapters"] == L
                                 and r["rank"] == R)
                    if not pts:
                        continue
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color=_COLORS.get(method), linestyle=_STYLES[li % 4],
                            marker=_MARKERS[ri % 4], markersize=4,
                            label=f"{method} L={L} R={R}")
        for level in (50, 70):
            ax.axhline(level, color="black", linewidth=0.6, linestyle=":", alpha=0.6)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["tokens"] for r in rows if (r["model"], r["proj"]) == (model, proj)})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_title(f"{model} {proj}", fontsize=10)
        ax.set_xlabel("tokens")
        ax.set_ylabel("% of byte floor")
        ax.grid(True, which="both", alpha=0.25)
        if ax.lines and any(not ln.get_label().startswith("_") for ln in ax.lines):
            ax.legend(fontsize=6, ncol=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
