"""PNG plots of ``kvmesh compare`` documents and load sweeps (matplotlib, optional: the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kvmesh_cli.report import SweepPoint


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
        ax.bar(names, vals, color=(["#888888", "#2a7ab9", "#d9822b", "#3a9e5c", "#8e44ad", "#c0392b"] * 4)[: len(names)])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"{doc['workload']}: {doc['requests']} requests, {doc['engines']} engines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_sweep_plot(curves: Mapping[str, Sequence[SweepPoint]], slo_ttft_s: float, title: str, path: Path) -> bool:
    """Throughput (requests/s) against TTFT p50 and p90, one line per policy, the SLO as a line; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, attr, name in ((axes[0], "ttft_p50_s", "TTFT p50"), (axes[1], "ttft_p90_s", "TTFT p90")):
        for policy, pts in curves.items():
            pts = sorted(pts, key=lambda p: p.rate_scale)
            xs = [p.requests_per_s for p in pts if getattr(p, attr) is not None]
            ys = [getattr(p, attr) for p in pts if getattr(p, attr) is not None]
            ax.plot(xs, ys, marker="o", label=policy)
        ax.axhline(slo_ttft_s, color="#aa3333", linestyle="--", linewidth=1, label=f"SLO {slo_ttft_s:g} s")
        ax.set_xlabel("throughput (requests / model s)")
        ax.set_ylabel(f"{name} (model s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
