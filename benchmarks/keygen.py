"""Key generation speed: gen_keys (one pair at a time, pure Python) against gen_key_pairs (a batch).

    python benchmarks/keygen.py --out FILE.csv

Each row is one way of making `keys` key pairs of depth `domain_bits` (a 32-query batch of the
client is 96 pairs), timed `repeats` times; `pairs_per_s` is from the best time, the median is
shown beside it because this machine is shared. `vectorised` includes both parties' keys as hex
strings (the JSON encoding); `window_v1`/`window_v2` are what the client does per window of a
fetch (`--methods window_v1 window_v2 --keys 3072`: 32 requests of 32 queries).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.report import cpu_model, write_csv  # noqa: E402
from morpho_client.plan import plan_window  # noqa: E402
from morpho_pir.dpf import format_by_name, gen_keys  # noqa: E402
from morpho_pir.keygen import gen_key_pairs  # noqa: E402
from morpho_pir.protocol import KEYS_PER_QUERY, ROWS_PER_PAGE  # noqa: E402

FIELDS = ["method", "domain_bits", "keys", "repeats", "best_s", "median_s", "pairs_per_s",
          "pairs_per_s_median"]


def header_lines(args: argparse.Namespace, argv: list[str]) -> list[str]:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"# machine: {platform.node()}; {cpu_model()}; {os.cpu_count()} CPUs; "
        f"python {platform.python_version()}, numpy {np.__version__}; "
        f"load average {load} at the end",
        f"# shape: domain_bits={','.join(map(str, args.domain_bits))}, keys={args.keys} "
        f"(a {args.keys // 3}-query batch, 3 key pairs a query), repeats={args.repeats} "
        f"(gen_keys: {args.python_repeats}); targets uniform over [0, 2**d)",
        "# command: python benchmarks/keygen.py " + " ".join(shlex.quote(a) for a in argv),
        f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
    ]


def _time(make, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        make()
        times.append(time.perf_counter() - start)
    return times


def measure(method: str, d: int, keys: int, repeats: int, rng: np.random.Generator) -> dict:
    targets = [int(x) for x in rng.integers(0, 1 << d, size=keys)]
    if method == "gen_keys":
        def make():
            pairs = [gen_keys(t, d) for t in targets]
            return ([k0.to_bytes().hex() for k0, _ in pairs],
                    [k1.to_bytes().hex() for _, k1 in pairs])
    elif method.startswith("window_"):
        # what the client's fetch does per window: decoy pages, then both parties' key arrays
        # in one call (morpho_client.plan.plan_window), keys // 3 rows of 3 key pairs each
        fmt = format_by_name(method.removeprefix("window_"))
        rows = np.asarray(targets[:keys // KEYS_PER_QUERY], dtype=np.int64) * ROWS_PER_PAGE

        def make():
            return plan_window(rows, 1 << d, d, fmt)
    else:
        def make():
            pairs = gen_key_pairs(targets, d)
            return pairs.key_hex(0), pairs.key_hex(1)
    times = _time(make, repeats)
    best, median = min(times), statistics.median(times)
    return {"method": method, "domain_bits": d, "keys": keys, "repeats": repeats,
            "best_s": f"{best:.5f}", "median_s": f"{median:.5f}",
            "pairs_per_s": f"{keys / best:.0f}", "pairs_per_s_median": f"{keys / median:.0f}"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain-bits", type=int, nargs="+", default=[16, 25])
    parser.add_argument("--keys", type=int, default=96, help="key pairs per batch (default 96)")
    parser.add_argument("--repeats", type=int, default=20, help="timed batches of gen_key_pairs")
    parser.add_argument("--python-repeats", type=int, default=2, help="timed batches of gen_keys")
    parser.add_argument("--methods", nargs="+", default=["gen_keys", "vectorised"],
                        choices=["gen_keys", "vectorised", "window_v1", "window_v2"],
                        help="window_v1/v2: the client's plan_window (decoys and both parties' "
                             "keys), key pairs counted")
    parser.add_argument("--out", help="CSV to write (with # header lines); stdout only if unset")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(1)
    rows = []
    for d in args.domain_bits:
        for method in args.methods:
            repeats = args.python_repeats if method == "gen_keys" else args.repeats
            rows.append(measure(method, d, args.keys, repeats, rng))
        for row in rows[-len(args.methods):]:
            print(f"d={d:2d} {row['method']:10s} {row['pairs_per_s']:>7s} pairs/s "
                  f"(median {row['pairs_per_s_median']}), best {float(row['best_s']) * 1e3:.1f} ms "
                  f"per {args.keys} pairs", flush=True)
    if args.out:
        write_csv(args.out, header_lines(args, argv), FIELDS, rows)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
