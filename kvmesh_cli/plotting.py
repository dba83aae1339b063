"""PNG plots of ``kvmesh compare`` documents (matplotlib, optional: the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path


def write_plot(doc: dict[str, object], path: Path) -> bool:
    """Bar charts of TTFT p50/p90, e2e p50, output tokens/s and hit rate per policy; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    policies: dict[str, dict[str, float | None]] = doc["policies"]  # type: ignore[assignment]
    names = list(policies)
    panels = [
        ("TTFT p50 (model s)", "ttft_p50_s", 1.0), ("TTFT p90 (model s)", "ttft_p90_s", 1.0),
        ("e2e p50 (model s)", "e2e_p50_s", 1.0), ("output tokens/s", "output_tokens_per_s", 1.0),
        ("prefix-cache hit rate (%)", "prefix_hit_rate", 100.0),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (title, key, mult) in zip(axes, panels, strict=True):
        vals = [(policies[n].get(key) or 0.0) * mult for n in names]
        ax.bar(names, vals, color=["#888888", "#2a7ab9", "#d9822b", "#3a9e5c"][: len(names)])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"{doc['workload']}: {doc['requests']} requests, {doc['engines']} engines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
