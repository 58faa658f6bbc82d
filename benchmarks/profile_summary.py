"""Where a py-spy profile's time went: each function's share of the samples (inclusive), top N.

    python3 benchmarks/profile_summary.py [--top 40] [--seconds S --rate R] PROFILE.txt ...

Reads py-spy's raw output (`py-spy record -f raw`: one collapsed stack and its count a line).
With --seconds and --rate, also what share of the possible samples were taken: for a profile
recorded with --gil, how busy the interpreter was.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

# "func (/long/path/site-packages/pkg/mod.py:12)" -> "func (pkg/mod.py:12)"
_PATH = re.compile(r" \((?:/[^()]*/(?:site-packages|python3\.\d+|main|repo)/)?([^()]*)\)")


def summarise(path: Path, top: int, possible: int = 0) -> str:
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        total += samples
        for frame in {_PATH.sub(r" (\1)", frame) for frame in stack.split(";")}:
            inclusive[frame] += samples
    lines = [f"== {path.name}: {total} samples"
             + (f", {100 * total / possible:.0f}% of the {possible} possible" if possible else "")]
    lines += [f"{100 * n / max(1, total):5.1f}% {frame[:150]}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=0.0, help="how long each was recorded")
    parser.add_argument("--rate", type=float, default=0.0, help="samples per second asked for")
    args = parser.parse_args(argv)
    possible = int(args.seconds * args.rate)
    for path in args.profiles:
        print(summarise(path, args.top, possible), "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
