"""Plots batch queries/s against Q for v1 keys, v2 keys on the ALU and v2 keys on the tensor cores.

    python3 benchmarks/plot_key_formats.py --out docs/benchmarks/keyformats_qps.png \
        docs/benchmarks/keyformats_mainnet_*.csv docs/benchmarks/keyformats_65536_*.csv

One panel per shape, with the memory floor (one read of the matrix per batch at 3.08 TB/s,
docs/benchmarks/NOTES-cuda.md) and issue 16's v2 target drawn.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import pyplot, read_csv  # noqa: E402

READ_BYTES_PER_S = 3.08e12  # the H100's measured streaming read (NOTES-cuda.md, Floors)
PAGE_BYTES = 4096
# issue 16's v2-key targets, queries/s at the best batch size, per page count
V2_TARGET = {16817159: 2500.0, 65536: 150000.0}


def label(header: dict) -> str:
    """'v1', 'v2 ALU' or 'v2 tensor cores' from a backend_batch.py CSV's dispatch line."""
    dispatch = header.get("dispatch", "")
    if "keys=v2" not in dispatch:
        return "v1 keys (ALU)"
    return "v2 keys, tensor cores" if "scan=mma" in dispatch else "v2 keys, ALU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csvs", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    plt = pyplot()

    shapes = defaultdict(list)  # pages -> [(label, qs, qps)]
    for path in args.csvs:
        header, rows = read_csv(path)
        pages = int(header["shape"].split(",")[0].split("=")[1])
        qs = [int(r["q"]) for r in rows]
        shapes[pages].append((label(header), qs, [float(r["batch_qps"]) for r in rows]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.5), squeeze=False)
    for ax, pages in zip(axes[0], sorted(shapes, reverse=True)):
        top = 1
        for name, qs, qps in sorted(shapes[pages]):
            ax.plot(qs, qps, marker="o", label=name)
            top = max(top, max(qs))
        floor_s = pages * PAGE_BYTES / READ_BYTES_PER_S
        qs = list(range(1, top + 1))
        ax.plot(qs, [q / floor_s for q in qs], "k:", label=f"memory floor ({floor_s * 1e3:.3g} ms a batch)")
        if pages in V2_TARGET:
            ax.axhline(V2_TARGET[pages], color="tab:red", ls="--", lw=1, label="issue 16 v2 target")
        ax.set_yscale("log")
        ax.set_xlabel("queries per batch (Q, 3 keys each)")
        ax.set_ylabel("queries/s")
        ax.set_title(f"{pages:,} pages, one H100")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
