"""Plots the CUDA benchmark CSVs (queries/s against Q, both shapes) next to the published figures.

    python3 benchmarks/plot_cuda.py --out docs/benchmarks/cuda_qps.png \
        docs/benchmarks/cuda_mainnet.csv docs/benchmarks/cuda_65536.csv
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import pyplot, read_csv  # noqa: E402

# docs/PROTOCOL.md section 8 (Morphogenesis on one H100) and issue 3's targets, per shape
REFERENCE = {
    "16817159": {"title": "mainnet: 16,817,159 pages, d=25", "morpho_batch": 33.75, "morpho_single": 33.2,
                 "targets": [(8, 120.0), (32, 150.0)]},
    "65536": {"title": "65,536 pages, d=16", "morpho_batch": 5601.0, "morpho_single": 2000.0,
              "targets": [(None, 20000.0)]},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csvs", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    plt = pyplot()

    fig, axes = plt.subplots(1, len(args.csvs), figsize=(6 * len(args.csvs), 4.5))
    for ax, path in zip(axes if len(args.csvs) > 1 else [axes], args.csvs):
        header, rows = read_csv(path)
        pages = header["shape"].split(",")[0].split("=")[1]
        ref = REFERENCE.get(pages, {"title": header["shape"], "targets": []})
        q = [int(r["q"]) for r in rows]
        ax.plot(q, [float(r["batch_qps"]) for r in rows], "o-", label="cuda: one batch")
        ax.plot(q, [float(r["single_qps"]) for r in rows], "s--", label="cuda: single-query loop")
        if "morpho_batch" in ref:
            ax.axhline(ref["morpho_batch"], color="grey", ls=":", label="Morphogenesis best batch")
            ax.axhline(ref["morpho_single"], color="grey", ls="-.", label="Morphogenesis single query")
        for tq, tv in ref["targets"]:
            ax.plot([tq] if tq else [min(q), max(q)], [tv] * (1 if tq else 2), "r^" if tq else "r-",
                    alpha=0.6, label="issue 3 target" if tv == ref["targets"][0][1] else None)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xticks(q)
        ax.set_xticklabels([str(x) for x in q])
        ax.set_xlabel("queries per batch (3 keys each)")
        ax.set_ylabel("queries / s")
        ax.set_title(f"{ref['title']}\n{header.get('gpu', '')}, {header.get('dispatch', '')}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
