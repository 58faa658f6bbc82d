"""Folds CSVs one script wrote with the same columns into one file, a label column per source's part.

    python3 benchmarks/fold.py --out docs/benchmarks/h200_batch.csv --columns pages,key_format,layout \
        16817159,v1,fragments=v1alu_mainnet.csv 16817159,v2,fragments=wgmma_mainnet_on.csv \
        65536,v1,fragments=v1alu_65536.csv 65536,v2,fragments=wgmma_65536_on.csv

Each source is VALUES=PATH, VALUES its labels in --columns' order. The folded file holds every
source's `#` lines (machine, shape, command, date) as `# part NAME=VALUE ...: LINE`, then one
header (the label columns, then the sources' columns) and each source's rows under its labels.
`read_parts` gives the parts back, each with its labels, its own `#` lines and its rows.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

PART = "# part "

Part = Tuple[Dict[str, str], Dict[str, str], List[dict]]  # labels, `# name: value` lines, rows


def read_source(path) -> Tuple[List[str], List[str], List[List[str]]]:
    """(`#` lines without their `# `, the columns, the rows) of one script's CSV."""
    comments, lines = [], []
    with open(path) as fh:
        for line in fh:
            (comments if line.startswith("#") else lines).append(line.rstrip("\n"))
    comments = [c[1:].strip() for c in comments]
    table = [row for row in csv.reader(lines, skipinitialspace=True) if row]
    return comments, table[0], table[1:]


def fold(out, columns: Sequence[str], sources: Sequence[Tuple[Sequence[str], str]]) -> None:
    """Writes `out` from sources [(label values, path)]; every source must have the same columns."""
    parts, header = [], None
    for values, path in sources:
        if len(values) != len(columns):
            raise SystemExit(f"{path}: {len(values)} labels for the {len(columns)} columns {','.join(columns)}")
        comments, names, rows = read_source(path)
        if header is not None and names != header:
            raise SystemExit(f"{path}: columns {names} differ from the first source's {header}")
        header = names
        parts.append((" ".join(f"{c}={v}" for c, v in zip(columns, values)), values, comments, rows))
    with open(out, "w", newline="") as fh:
        for name, _, comments, _ in parts:
            fh.writelines(f"{PART}{name}: {line}\n" for line in comments)
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow([*columns, *header])
        for _, values, _, rows in parts:
            writer.writerows([*values, *row] for row in rows)


def read_parts(path) -> List[Part]:
    """[(labels, {name: value} of its `# name: value` lines, rows)] per part of a file fold() wrote;
    a CSV of one run is one part without labels."""
    named: Dict[str, Dict[str, str]] = {}
    plain: Dict[str, str] = {}
    lines = []
    with open(path) as fh:
        for line in fh:
            if line.startswith(PART):
                name, _, rest = line[len(PART):].rstrip("\n").partition(": ")
                key, _, value = rest.partition(": ")
                named.setdefault(name, {})[key] = value
            elif line.startswith("#"):
                key, _, value = line[1:].strip().partition(": ")
                plain[key] = value
            else:
                lines.append(line)
    rows = list(csv.DictReader(lines, skipinitialspace=True))
    if not named:
        return [({}, plain, rows)]
    parts = []
    for name, header in named.items():
        labels = dict(pair.split("=", 1) for pair in name.split())
        parts.append((labels, header, [r for r in rows if all(r[c] == v for c, v in labels.items())]))
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the folded CSV")
    ap.add_argument("--columns", required=True, help="the label columns, comma separated")
    ap.add_argument("sources", nargs="+", help="VALUES=PATH, VALUES comma separated in --columns' order")
    args = ap.parse_args(argv)
    sources = []
    for source in args.sources:
        values, sep, path = source.partition("=")
        if not sep:
            ap.error(f"{source}: not VALUES=PATH")
        sources.append((values.split(","), path))
    fold(args.out, args.columns.split(","), sources)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
