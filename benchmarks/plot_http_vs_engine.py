"""Plots http_vs_engine.py's CSV: each HTTP figure as a fraction of the engine alone, per matrix.

    python3 benchmarks/plot_http_vs_engine.py --out docs/benchmarks/h100_http_vs_engine.png \
        docs/benchmarks/h100_http_vs_engine.csv
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import pyplot, read_csv  # noqa: E402

# the HTTP targets (docs/PERFORMANCE.md) as fractions of the engine's 32-query capacity, and in
# queries per second, drawn as that fraction of the engine alone of the same run
TARGETS = {"1048576": {"http_single_64_clients": 0.80, "http_batch32_16_clients": 0.90,
                       "bulk_job_10000": 0.85, "bulk_job_10000_binary": 0.85}}
TARGETS_QPS = {"65536": {"http_single_64_clients": 4000, "http_batch32_16_clients": 12000,
                         "http_batch32_binary_16_clients": 25000}}
SHOWN = ("http_single_64_clients", "http_batch32_16_clients", "http_batch32_binary_16_clients",
         "bulk_job_10000", "bulk_job_10000_binary")
LABELS = ("singles, 64 clients", "32-query JSON", "32-query binary", "bulk job, JSON upload",
          "bulk job, binary upload")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    plt = pyplot()

    header, rows = read_csv(args.csv)
    ratios: dict = defaultdict(dict)
    engine: dict = {}
    for row in rows:
        if row["figure"] == "engine_batch32":
            engine[row["pages"]] = float(row["engine_qps"])
        if row["figure"] in SHOWN and row["ratio"]:
            ratios[row["pages"]][row["figure"]] = float(row["ratio"])
    shapes = sorted(ratios, key=int)
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), sharey=True)
    for ax, pages in zip(axes if len(shapes) > 1 else [axes], shapes):
        values = [ratios[pages].get(name, 0.0) for name in SHOWN]
        bars = ax.bar(range(len(SHOWN)), values, color="#4477aa")
        for bar, value in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, value + 0.01, f"{value:.2f}", ha="center")
        for i, name in enumerate(SHOWN):
            target = TARGETS.get(pages, {}).get(name)
            if name in TARGETS_QPS.get(pages, {}) and engine.get(pages):
                target = TARGETS_QPS[pages][name] / engine[pages]
            if target:
                ax.plot([i - 0.4, i + 0.4], [target, target], color="#cc3311", lw=2)
        ax.set_xticks(range(len(SHOWN)), LABELS, rotation=25, ha="right")
        ax.set_ylim(0, 1.1)
        ax.set_title(f"{int(pages):,} pages: engine alone {engine.get(pages, 0):,.0f} q/s")
        ax.grid(axis="y", alpha=0.3)
    (axes[0] if len(shapes) > 1 else axes).set_ylabel("HTTP q/s / engine q/s (red: target)")
    fig.suptitle(header.get("machine", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
