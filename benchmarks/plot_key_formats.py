"""Plots batch queries/s against Q per GPU and shape, per key format and scan, with floor and targets.

    python3 benchmarks/plot_key_formats.py --out docs/benchmarks/batch_qps.png \
        docs/benchmarks/h100_batch.csv docs/benchmarks/h200_batch.csv

Each CSV is a backend_batch.py run or runs folded by fold.py; a run's dispatch line names the
series (v1 or v2 keys, the pages or the fragments layout, the scan), and runs of one series and
panel make one line, by Q (where two hold the same Q, the later run's figure is drawn). Runs
folded under a `layout` label other than --layout are left out. One panel per GPU and shape, with the
memory floor (one read of the matrix per batch at the GPU's measured streaming read, docs/SCANS.md)
and the targets drawn: v2's at the best batch size (a line), v1's at their batch sizes (open
diamonds).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fold import read_parts  # noqa: E402
from benchmarks.report import pyplot  # noqa: E402

# measured streaming reads, bytes/s (docs/SCANS.md, Floors): the H100's single-query scan under
# ncu, the H200's single v1 query at mainnet
READ_BYTES_PER_S = {"H100": 3.08e12, "H200": 4.47e12}
PAGE_BYTES = 4096
# the v2-key targets (docs/PERFORMANCE.md), queries/s at the best batch size, per page count
V2_TARGET = {16817159: 2500.0, 65536: 150000.0}
# the v1-key targets (docs/PERFORMANCE.md), queries/s at a batch size (Q: q/s), per page count; 65,536 pages: at
# the best batch size, drawn at Q = 32
V1_TARGETS = {16817159: {8: 280.0, 32: 300.0}, 65536: {32: 50000.0}}


def label(header: dict) -> str:
    """The series of a backend_batch.py CSV, from its dispatch line: v1 keys, or v2 keys on the ALU,
    on the tensor cores, or on the tensor cores over the fragments layout (wgmma or mma.sync)."""
    dispatch = header.get("dispatch", "")
    if "keys=v2" not in dispatch:
        return "v1 keys, fragments (ALU <= 2 queries)" if "layout=fragments" in dispatch else "v1 keys (ALU)"
    if "layout=fragments" in dispatch:
        return "v2 keys, fragments, wgmma" if "wgmma" in dispatch else "v2 keys, fragments, mma.sync"
    return "v2 keys, tensor cores" if "scan=mma" in dispatch else "v2 keys, ALU"


COLORS = {"v1 keys (ALU)": "tab:blue", "v2 keys, ALU": "tab:orange", "v2 keys, tensor cores": "tab:green",
          "v2 keys, fragments, mma.sync": "tab:purple", "v2 keys, fragments, wgmma": "tab:brown",
          "v1 keys, fragments (ALU <= 2 queries)": "tab:cyan"}


def gpu_model(header: dict) -> str:
    """'H100' or 'H200' from a backend_batch.py CSV's gpu line."""
    return next(m for m in READ_BYTES_PER_S if m in header.get("gpu", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csvs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="fragments", help="the runs of this layout label (default: fragments)")
    args = ap.parse_args()

    plt = pyplot()

    panels = defaultdict(lambda: defaultdict(dict))  # (gpu, pages) -> label -> {q: queries/s}
    for path in args.csvs:
        for labels, header, rows in read_parts(path):
            if labels.get("layout", args.layout) != args.layout:
                continue
            pages = int(header["shape"].split(",")[0].split("=")[1])
            panels[(gpu_model(header), pages)][label(header)].update(
                {int(r["q"]): float(r["batch_qps"]) for r in rows})
    gpus = sorted({gpu for gpu, _ in panels})
    shapes = sorted({pages for _, pages in panels}, reverse=True)
    fig, axes = plt.subplots(len(gpus), len(shapes), figsize=(6 * len(shapes), 4.3 * len(gpus)), squeeze=False)
    for row, gpu in enumerate(gpus):
        for ax, pages in zip(axes[row], shapes):
            top = 1
            for name, by_q in sorted(panels[(gpu, pages)].items()):
                qs = sorted(by_q)
                ax.plot(qs, [by_q[q] for q in qs], marker="o", ms=3, label=name, color=COLORS[name])
                top = max(top, max(qs))
            floor_s = pages * PAGE_BYTES / READ_BYTES_PER_S[gpu]
            qs = list(range(1, top + 1))
            ax.plot(qs, [q / floor_s for q in qs], "k:", label=f"memory floor ({floor_s * 1e3:.3g} ms a batch)")
            if pages in V2_TARGET:
                ax.axhline(V2_TARGET[pages], color="tab:red", ls="--", lw=1, label="v2 target")
            if pages in V1_TARGETS:
                targets = V1_TARGETS[pages]
                ax.plot(list(targets), list(targets.values()), "D", mfc="none", color="tab:red",
                        label="v1 targets")
            ax.set_yscale("log")
            ax.set_xlabel("queries per batch (Q, 3 keys each)")
            ax.set_ylabel("queries/s")
            ax.set_title(f"{pages:,} pages, one {gpu}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
