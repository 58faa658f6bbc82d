"""Plots two GPUs against one: each placement's latency and throughput as a ratio to one GPU's.

    python3 benchmarks/plot_placement.py --out docs/benchmarks/h100x2_mainnet_placement.png \
        docs/benchmarks/h100x2_mainnet_placement.csv [--http ONE_GPU.csv TWO_GPUS.csv]

Left: one query's latency (q=1) and a 32-query batch's (q=32), over one GPU's, per shape and
placement, with the two-GPU shard target (9 ms against one H200's 15.1 ms pass: 0.60). Right:
throughput over one GPU's, with the 1.9x target; --http adds the 32-query HTTP batches of two
GPUs over one (http_vs_engine.py --devices 0 and 0,1) beside the engine's own ratio.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import pyplot, read_csv  # noqa: E402

SHARD_LATENCY_TARGET = 9.0 / 15.1  # 9 ms where one H200 reads mainnet in 15.1 ms
THROUGHPUT_TARGET = 1.9  # two GPUs against one
MAINNET_PAGES = 16817159


def shape_name(pages: str) -> str:
    return "mainnet" if int(pages) == MAINNET_PAGES else f"{int(pages):,} pages"


def http_ratios(one_gpu: str, two_gpus: str) -> dict:
    """{(pages, figure): (HTTP 2-GPU/1-GPU, engine 2-GPU/1-GPU)} of http_vs_engine.py's batch
    rows present in both files."""
    rows = [{(r["pages"], r["figure"]): r for r in read_csv(path)[1]} for path in (one_gpu, two_gpus)]
    ratios = {key: (float(rows[1][key]["http_qps"]) / float(rows[0][key]["http_qps"]),
                    float(rows[1][key]["engine_qps"]) / float(rows[0][key]["engine_qps"]))
              for key in rows[0] if key[1].startswith("http_batch32") and key in rows[1]}
    if not ratios:
        raise SystemExit(f"{one_gpu} and {two_gpus} share no http_batch32 row")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csvs", nargs="+", help="placement.py CSVs")
    ap.add_argument("--http", nargs=2, metavar=("ONE_GPU", "TWO_GPUS"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    plt = pyplot()

    bars = []  # (label, latency_vs_one, qps_vs_one)
    gpu = ""
    for path in args.csvs:
        header, rows = read_csv(path)
        gpu = header.get("gpu", gpu)
        pages = header["shape"].split(",")[0].split("=")[1]
        for row in rows:
            if row["placement"] != "one":
                bars.append((f"{shape_name(pages)}\n{row['placement']} q={row['q']}",
                             float(row["latency_vs_one"]), float(row["qps_vs_one"])))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    x = range(len(bars))
    left.bar(x, [b[1] for b in bars], color="tab:blue")
    left.axhline(1.0, color="grey", lw=0.8)
    left.axhline(SHARD_LATENCY_TARGET, color="tab:red", ls="--",
                 label=f"shard q=1 target ({SHARD_LATENCY_TARGET:.2f}: 9 ms of one H200's 15.1 ms)")
    left.set_title("latency, two GPUs over one")
    throughput = [(b[0], b[2], "tab:green") for b in bars]
    if args.http:
        engines = {}  # pages -> the engine's ratio (one engine figure per run, in every row)
        for (pages, fig_name), (http, engine) in http_ratios(*args.http).items():
            kind = "binary" if "binary" in fig_name else "JSON"
            throughput.append((f"{shape_name(pages)}\nHTTP {kind} q=32", http, "tab:orange"))
            engines[pages] = engine
        throughput += [(f"{shape_name(pages)}\nthose runs' engine", engine, "tab:olive")
                       for pages, engine in engines.items()]
    right.bar(range(len(throughput)), [t[1] for t in throughput], color=[t[2] for t in throughput])
    right.axhline(THROUGHPUT_TARGET, color="tab:red", ls="--", label="target 1.9x")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_title("throughput, two GPUs over one")
    for axis, labels in ((left, [b[0] for b in bars]), (right, [t[0] for t in throughput])):
        axis.set_xticks(range(len(labels)))
        axis.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        axis.set_ylabel("ratio to one GPU")
        axis.legend(fontsize=8, loc="lower left", framealpha=0.95)
        for i, height in enumerate(p.get_height() for p in axis.patches):
            axis.annotate(f"{height:.2f}", (i, height), ha="center", va="bottom", fontsize=7)
    fig.suptitle(f"Placement over two GPUs ({gpu.split(',')[0].split(': ', 1)[-1].split(' (')[0]} x2)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
