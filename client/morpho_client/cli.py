"""`morpho-client`: fetch rows privately from two parties and print or write them as hex."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from morpho_pir.protocol import MAX_BATCH_QUERIES

from morpho_client.aio import MAX_IN_FLIGHT, SWITCH_DEADLINE_S
from morpho_client.bulk import TOKEN_ENV, answered
from morpho_client.core import ENCODINGS, KEY_FORMATS, PirError
from morpho_client.lookup import parse_key, read_keys_file
from morpho_client.plan import read_rows_file
from morpho_client.planners import MAX_PLANNERS, auto_planners, check_planners
from morpho_client.sync import PirClient

PROGRESS_MIN_ROWS = 2 * MAX_BATCH_QUERIES  # fewer rows than two requests: no bar
DESCRIPTION = """\
Fetch rows privately from two PIR parties and print them as hex, `row N: 0x...` a line.
Each party sees only pseudorandom DPF keys: neither learns which rows were read, as long as
the two do not collude. Rows come from --row (repeatable), from a file (--rows FILE: a
pipelined fetch of batch queries, any number of rows) or through one bulk job per party
(--bulk FILE, resumable). In a records epoch, --key HEX (repeatable) and --keys FILE look
keys up instead, `key 0x...: 0x... (type T)` or `key 0x...: absent` a line: one query of
the key's three candidate pages, the same traffic whether it is there or not. Exit status 0
when every row was fetched or every key looked up, found or absent; 1 on any error (a row
or value is never printed from answers of two different epochs or served states)."""


def seconds(minimum: float, inclusive: bool):
    """An argparse type: a finite number of seconds above `minimum` (or from it, inclusive)."""
    words = f"{minimum:g} or more" if inclusive else f"above {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value >= minimum if inclusive else value > minimum)):
            raise argparse.ArgumentTypeError(f"expected a number of seconds, {words}, got {text!r}")
        return value
    return parse


parse_timeout = seconds(0, inclusive=False)
parse_deadline = seconds(0, inclusive=True)


def parse_in_flight(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_IN_FLIGHT:
        raise argparse.ArgumentTypeError(f"expected a whole number in 1..{MAX_IN_FLIGHT}, got {text!r}")
    return value


def parse_planners(text: str) -> int:
    try:
        return check_planners(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number in 0..{MAX_PLANNERS} (0: keys "
                                         f"made in this process), got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="morpho-client", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-a", required=True,
                        help="base URL of party A, e.g. http://127.0.0.1:8001")
    parser.add_argument("--server-b", required=True,
                        help="base URL of party B (another operator), e.g. http://127.0.0.1:8002")
    rows = parser.add_argument_group("the rows or keys (one of --row, --rows, --bulk, --key, "
                                     "--keys)")
    rows.add_argument("--row", type=int, action="append",
                      help="row to fetch (256 bytes); repeat for several")
    rows.add_argument("--rows", metavar="FILE",
                      help="fetch the rows listed in FILE (one per line, # comments) as batch "
                           "queries, several requests in flight at each party")
    rows.add_argument("--bulk", metavar="FILE",
                      help="fetch the rows listed in FILE through one bulk job per party (v1 "
                           "keys, NDJSON); rerun the same command to resume after a crash")
    rows.add_argument("--key", type=parse_key_argument, action="append", metavar="HEX",
                      help="in a records epoch: look this key up (hex); repeat for several")
    rows.add_argument("--keys", metavar="FILE",
                      help="in a records epoch: look up the keys listed in FILE (hex, one per "
                           "line, # comments)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", metavar="FILE",
                     help="write the rows (row N: 0x...) or keys there instead of stdout; written beside "
                          "it and renamed at the end, so a failed fetch leaves no partial file")
    out.add_argument("-q", "--quiet", action="store_true",
                     help="no progress bar (there is none either when stderr is not a terminal)")
    out.add_argument("-v", "--verbose", action="store_true",
                     help="say on stderr which encoding each party was spoken to in, and which "
                          "key format")
    wire = parser.add_argument_group("queries")
    wire.add_argument("--batch", action="store_true",
                      help=f"send --row rows through the batch endpoint, up to "
                           f"{MAX_BATCH_QUERIES} per request (--rows always does)")
    wire.add_argument("--timeout", type=parse_timeout, default=120.0,
                      help="seconds to wait for each HTTP request (above 0; default 120)")
    wire.add_argument("--encoding", choices=ENCODINGS, default="auto",
                      help="wire encoding of the queries: binary where the server advertises it "
                           "(auto, the default), or force json or binary; not with --bulk")
    wire.add_argument("--key-format", choices=KEY_FORMATS, default="auto",
                      help="DPF key format: v2 (docs/PROTOCOL.md section 3.1, cheaper for the "
                           "servers) where both servers advertise it (auto, the default), or "
                           "force v1 or v2; bulk jobs take v1 keys, so --bulk refuses v2")
    wire.add_argument("--in-flight", type=parse_in_flight, metavar="N",
                      help=f"batch requests kept in flight at each party (1..{MAX_IN_FLIGHT}; "
                           "default: two launches' worth of the parties' pass size)")
    wire.add_argument("--planners", type=parse_planners, metavar="N",
                      help=f"processes that make the keys of a long fetch beside the one that "
                           f"reads the answers (0..{MAX_PLANNERS}; 0: in this process; default "
                           f"{auto_planners()} on this host); not with --bulk")
    wire.add_argument("--switch-deadline", type=parse_deadline, default=SWITCH_DEADLINE_S, metavar="S",
                      help="seconds to keep retrying while the parties answer from different "
                           "epochs or states (an epoch switch) or are busy (default "
                           f"{SWITCH_DEADLINE_S:g})")
    bulk = parser.add_argument_group("bulk jobs (docs/CLIENT.md), only with --bulk")
    bulk.add_argument("--state", help="state file of the fetch (default FILE.state.json): the "
                                      "planned keys' seeds and each party's job id")
    bulk.add_argument("--token-a", help=f"party A's DRF token (default ${TOKEN_ENV[0]})")
    bulk.add_argument("--token-b", help=f"party B's DRF token (default ${TOKEN_ENV[1]})")
    bulk.add_argument("--poll", type=parse_timeout, default=None,
                      help="seconds between progress polls (default 2)")
    return parser


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Refuse options that mean nothing together, rather than ignore them."""
    given = [name for name in ("row", "rows", "bulk", "key", "keys")
             if getattr(args, name) is not None]
    if len(given) != 1:
        parser.error("give the rows with --row (repeatable), --rows FILE or --bulk FILE, or "
                     "the keys with --key (repeatable) or --keys FILE: one of the five")
    if args.bulk is None:
        for option in ("state", "token_a", "token_b", "poll"):
            if getattr(args, option) is not None:
                parser.error(f"--{option.replace('_', '-')} is for bulk jobs: give --bulk FILE")
        if args.batch and args.rows is not None:
            parser.error("--batch is for --row: --rows always sends batch queries")
        if args.batch and (args.key is not None or args.keys is not None):
            parser.error("--batch is for --row: lookups always send batch queries")
        return
    if args.batch:
        parser.error("--batch is for --row: --bulk sends the rows as one bulk job per party")
    if args.encoding != "auto":
        parser.error("--encoding is for queries: bulk jobs are sent and read as NDJSON")
    if args.key_format == "v2":
        parser.error("--key-format v2 cannot be used with --bulk: bulk jobs take v1 keys "
                     "(docs/PROTOCOL.md section 5.5); fetch with --rows FILE for v2 keys")
    if args.in_flight is not None:
        parser.error("--in-flight is for queries: a bulk job is one request per party")
    if args.planners is not None:
        parser.error("--planners is for queries: a bulk job's keys are made as they are sent")


def show_progress(args) -> bool:
    return not args.quiet and sys.stderr.isatty()


class RowWriter:
    """write(row, data) as `row N: 0x...` to stdout (through `out`), or to a file `target`:
    written beside it and renamed there by finish(), removed by abandon()."""

    def __init__(self, target: Optional[str], out: Callable[[str], None]) -> None:
        self.count = 0
        self.noun = "rows"  # what the lines are, for the closing message
        self.target = Path(target) if target is not None else None
        self._out = out
        if self.target is not None:
            self._tmp = self.target.with_name(self.target.name + ".partial")
            self._fh = open(self._tmp, "w")  # noqa: SIM115 - closed in finish() or abandon()
            self._out = lambda line: self._fh.write(line + "\n")

    def __call__(self, row: int, data: bytes) -> None:
        self.line(f"row {row}: 0x{data.hex()}")

    def line(self, text: str) -> None:
        self._out(text)
        self.count += 1

    def finish(self) -> None:
        if self.target is not None:
            self._fh.close()
            os.replace(self._tmp, self.target)
            print(f"wrote {self.count} {self.noun} to {self.target}", file=sys.stderr)

    def abandon(self) -> None:
        if self.target is not None:
            self._fh.close()
            self._tmp.unlink(missing_ok=True)


def progress_bar(total: int, enabled: bool, unit: str = "row"):
    """A tqdm bar on stderr, or a no-op where it is off (quiet, not a terminal, few rows)."""
    if not enabled or total < PROGRESS_MIN_ROWS:
        return contextlib.nullcontext(None)
    from tqdm import tqdm  # noqa: PLC0415 - the bar's library is loaded only where a bar is shown
    return tqdm(total=total, unit=unit, unit_scale=True, file=sys.stderr, dynamic_ncols=True)


def parse_key_argument(text: str) -> bytes:
    try:
        return parse_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def lookup_main(args, client: PirClient, keys: list[bytes], write: "RowWriter") -> None:
    """--key/--keys: each key's value, or `absent`, in the order given."""
    for key, record in zip(keys, client.lookup_records(keys)):
        found = "absent" if record is None else f"0x{record.value.hex()} (type {record.type})"
        write.line(f"key 0x{key.hex()}: {found}")
    if args.verbose:
        print(describe_encodings(client), file=sys.stderr)


def fetch_main(args, client: PirClient, rows: list[int], write: Callable) -> None:
    batch = args.rows is not None or args.batch
    with progress_bar(len(rows), show_progress(args)) as bar:
        for asked, data in client.iter_answers(rows, batch):
            for row, content in zip(asked.tolist(), data):
                write(row, content)
            if bar is not None:
                bar.update(len(data))
    if args.verbose:
        print(describe_encodings(client), file=sys.stderr)


def bulk_main(args, client: PirClient, rows: list[int], write: Callable) -> None:
    """`--bulk FILE`: every row of FILE through one bulk job per party."""
    state = args.state or f"{args.bulk}.state.json"
    last: dict = {}
    bar_context = progress_bar(len(rows), show_progress(args), unit="query")

    with bar_context as bar:
        def progress(job_a, job_b):
            figures = [(j.get("status"), answered(j)) for j in (job_a, job_b)]
            if figures == last.get("figures"):
                return
            last["figures"] = figures
            if bar is not None:
                done = min(int(answered(j) or 0) for j in (job_a, job_b))
                bar.update(done - bar.n)
                bar.set_postfix_str(f"A {job_a.get('status')}, B {job_b.get('status')}")
            elif not args.quiet:
                print_progress(job_a, job_b)

        for row, data in client.iter_rows_bulk(rows, (args.token_a, args.token_b), state,
                                               progress, args.poll or 2.0):
            write(row, data)


def print_progress(job_a: dict, job_b: dict) -> None:
    print("  ".join(f"{name}: job {job.get('id')} {job.get('status')} "
                    f"{answered(job)}/{job.get('total')}"
                    for name, job in (("A", job_a), ("B", job_b))), file=sys.stderr, flush=True)


def describe_encodings(client: PirClient) -> str:
    """`encoding: binary, keys: v2`, or each party's encoding when they differ (the -v line)."""
    a, b = client.last_encodings
    keys = f"keys: {client.last_key_format} (requested {client.key_format})"
    if a == b:
        return f"encoding: {a} (requested {client.encoding}), {keys}"
    return f"encoding: {a} with A, {b} with B (requested {client.encoding}), {keys}"


def main(argv: Optional[Sequence[str]] = None, out: Callable[[str], None] = print) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    write = None
    try:
        with PirClient(args.server_a, args.server_b, timeout=args.timeout,
                       encoding=args.encoding, key_format=args.key_format,
                       in_flight=args.in_flight, switch_deadline=args.switch_deadline,
                       planners=args.planners) as client:
            write = RowWriter(args.out, out)
            if args.key is not None or args.keys is not None:
                write.noun = "keys"
                keys = args.key if args.key is not None else read_keys_file(args.keys)
                lookup_main(args, client, keys, write)
                write.finish()
                return 0
            rows = args.row if args.row is not None else read_rows_file(args.rows or args.bulk)
            if args.bulk is not None:
                if args.verbose:
                    print("bulk jobs: NDJSON up and down, keys: v1 (bulk jobs take v1 keys)",
                          file=sys.stderr)
                bulk_main(args, client, rows, write)
            else:
                fetch_main(args, client, rows, write)
            write.finish()
    except KeyboardInterrupt:
        if write is not None:
            write.abandon()
        if args.bulk is not None:
            state = args.state or f"{args.bulk}.state.json"
            print(f"interrupted: the jobs go on; run the same command again to resume ({state})",
                  file=sys.stderr)
        return 130
    except (PirError, ValueError, OSError) as exc:  # OSError: a rows file or --out unusable
        if write is not None:
            write.abandon()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
