"""Lookups/s by key from one client process and through morpho-rpc, against the party's batches.

    python benchmarks/lookup_throughput.py --pages 4096 --out docs/benchmarks/cpu_4096_lookup.csv

Builds a records epoch of --pages pages filled to --load with accounts in the state table's
layout (morpho_pir.ethereum: key 0x01 || address, value the account's balance, nonce and code
hash), with gpu_engine.records.build as `manage.py build_records` does, and writes it with its
epoch sidecar under --folder/matrices; starts parties A and B over it as `make run` does
(morphoweb.devserver, through client_throughput.start_parties); then in one run:

- the reference: both parties' batch endpoints driven directly, 32-query binary requests of
  fresh keys from separate processes (client_throughput.reference): the slower party's queries/s;
- lookups: one process, AsyncPirClient.lookup_many over --keys random present keys for each
  --in-flight value (auto: what the parties' /health suggests), every value checked;
- the gateway: morpho-rpc started as a user starts it (the `morpho-rpc` command, else
  `python -m morpho_client.rpc`), driven by --callers threads each posting JSON-RPC batches of
  --rpc-batch eth_getBalance calls over plain HTTP/1.1 keep-alive connections (the body web3.py's
  batch requests send), every balance checked.

The CSV has one line per measure (`ratio` = lookups/s over the reference).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import http.client
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.client_throughput import reference, start_parties, stop_parties  # noqa: E402
from benchmarks.report import cpu_model, write_csv  # noqa: E402
from gpu_engine.matrix import write_epoch_metadata  # noqa: E402
from gpu_engine.records import build  # noqa: E402
from morpho_client import AsyncPirClient, PirClient, PirError  # noqa: E402
from morpho_pir.ethereum import (ACCOUNT_TYPE, EMPTY_CODE_HASH, STATE_KEY_BYTES,  # noqa: E402
                                 STATE_VALUE_BYTES)
from morpho_pir.protocol import ROWS_PER_PAGE  # noqa: E402
from morphoweb.partyprocs import free_port  # noqa: E402

FIELDS = ["measure", "in_flight", "callers", "rpc_batch", "lookups", "seconds", "lookups_per_s",
          "reference_per_s", "ratio", "failed"]


# -- the records epoch ----------------------------------------------------------------------------

def accounts(count: int, seed: int):
    """(keys, values, types) of `count` accounts in the state table's layout; balances below
    2**128, nonces below 1000, no code."""
    rng = np.random.default_rng(seed)
    keys = np.zeros((count, STATE_KEY_BYTES), dtype=np.uint8)
    keys[:, 0] = ACCOUNT_TYPE
    keys[:, 1:21] = rng.integers(0, 256, (count, 20), dtype=np.uint8)
    values = np.zeros((count, STATE_VALUE_BYTES), dtype=np.uint8)
    values[:, 16:32] = rng.integers(0, 256, (count, 16), dtype=np.uint8)  # balance, u256 BE
    values[:, 32:40] = rng.integers(0, 1000, count).astype(">u8").view(np.uint8).reshape(-1, 8)
    values[:, 40:72] = np.frombuffer(EMPTY_CODE_HASH, dtype=np.uint8)
    return keys, values, np.full(count, ACCOUNT_TYPE, dtype=np.uint8)


def build_epoch(pages: int, load: float, folder: Path, seed: int):
    """The records epoch's matrix file (and sidecar), its keys and values, and build seconds."""
    count = int(pages * ROWS_PER_PAGE * load)
    keys, values, types = accounts(count, seed)
    started = time.perf_counter()
    built = build(keys, values, types, seed, num_pages=pages)
    seconds = time.perf_counter() - started
    matrix = folder / "matrices" / f"records-{built.table.num_pages}p.bin"
    matrix.parent.mkdir(parents=True, exist_ok=True)
    built.rows.tofile(matrix)
    write_epoch_metadata(matrix, epoch_id=1, records=built.table)
    print(f"built {count:,} records in {built.table.num_pages:,} pages (load {built.load:.4f}) "
          f"in {seconds:.1f} s; written in {time.perf_counter() - started - seconds:.1f} s",
          flush=True)
    return matrix, keys, values, built.table, seconds, built.load


# -- lookups from one process ---------------------------------------------------------------------

def time_lookups(urls, wanted: list, warm: list, in_flight: Optional[int]):
    async def run():
        async with AsyncPirClient(*urls, in_flight=in_flight, planners=None) as client:
            await client.lookup_many(warm)  # connections open, the planners started
            started = time.perf_counter()
            got = await client.lookup_many(wanted)
            return time.perf_counter() - started, got, client.in_flight, client.last_key_format
    return asyncio.run(run())


def check_values(values: np.ndarray, picked: np.ndarray, got: list) -> None:
    for index, value in zip(picked.tolist(), got):
        if value != values[index].tobytes():
            raise AssertionError(f"record {index} came back {'absent' if value is None else 'wrong'}")


# -- the gateway ----------------------------------------------------------------------------------

def start_gateway(urls, folder: Path):
    """morpho-rpc over both parties, as a user starts it; (process, port, its command)."""
    port = free_port()
    command = shutil.which("morpho-rpc")
    argv = [command] if command else [sys.executable, "-m", "morpho_client.rpc"]
    argv += ["--server-a", urls[0], "--server-b", urls[1], "--listen", f"127.0.0.1:{port}"]
    log = open(folder / "morpho-rpc.log", "ab")  # noqa: SIM115 - the child keeps its own copy
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if rpc(port, {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId"})["result"]:
                return proc, port, shlex.join(["morpho-rpc" if command else argv[0]] + argv[1:])
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError((folder / "morpho-rpc.log").read_text()[-2000:]) from None
            time.sleep(0.2)


def rpc(port: int, body, conn: Optional[http.client.HTTPConnection] = None):
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    if response.status != 200:
        raise RuntimeError(f"morpho-rpc: HTTP {response.status}: {payload[:200]!r}")
    return json.loads(payload)


def drive_gateway(port: int, addresses: list, balances: list, callers: int, batch: int) -> float:
    """Seconds for `callers` threads to get every address's balance in batches of `batch`."""
    turns = [list(range(start, min(start + batch, len(addresses))))
             for start in range(0, len(addresses), batch)]
    failures: list = []
    lock = threading.Lock()

    def caller() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        while True:
            with lock:
                if not turns or failures:
                    return
                mine = turns.pop()
            body = [{"jsonrpc": "2.0", "id": i, "method": "eth_getBalance",
                     "params": [addresses[i], "latest"]} for i in mine]
            try:
                answers = {a["id"]: a for a in rpc(port, body, conn)}
                for i in mine:
                    if "result" not in answers[i] or int(answers[i]["result"], 16) != balances[i]:
                        raise AssertionError(f"{addresses[i]}: {answers[i]}, expected balance "
                                             f"{hex(balances[i])}")
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                failures.append(exc)
                return

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return time.perf_counter() - started


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # morpho-rpc stops serving on Ctrl-C
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=4096)
    parser.add_argument("--load", type=float, default=0.96, help="records per row")
    parser.add_argument("--keys", type=int, default=4096, help="lookups per client point")
    parser.add_argument("--in-flight", default="auto", help="comma-separated; auto: /health's")
    parser.add_argument("--reference-seconds", type=float, default=10.0)
    parser.add_argument("--reference-procs", type=int, default=2, help="processes per party")
    parser.add_argument("--reference-threads", type=int, default=8, help="connections each")
    parser.add_argument("--rpc-keys", type=int, default=2048, help="addresses through morpho-rpc")
    parser.add_argument("--callers", type=int, default=8, help="concurrent morpho-rpc callers")
    parser.add_argument("--rpc-batch", type=int, default=64, help="eth_getBalance per request")
    parser.add_argument("--web-workers", type=int, default=None,
                        help="gunicorn processes per party (default: devserver's)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/lookup-throughput"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    matrix, keys, values, table, build_s, load = build_epoch(args.pages, args.load, args.folder,
                                                             args.seed)
    os.environ["MORPHO_MATRIX_PATH"] = str(matrix)  # the devserver serves it, as `make run` would
    lines = [dict(measure="build", lookups=len(keys), seconds=f"{build_s:.2f}")]
    proc, url_a, url_b, _ = start_parties(table.num_pages, args.folder, args.web_workers)
    urls = (url_a, url_b)
    gateway = None
    rng = np.random.default_rng(args.seed + 1)
    try:
        with PirClient(*urls) as client:
            info = client.epoch()
            health = client.health()
            client.lookup(keys[0].tobytes())
            key_format = client.last_key_format
        ref = reference(urls, info.num_pages, info.domain_bits, key_format, args.reference_procs,
                        args.reference_threads, args.reference_seconds)
        print(f"{info.num_pages} pages, {key_format}: reference {ref:,.0f} queries/s", flush=True)
        lines.append(dict(measure="reference", lookups="", lookups_per_s="",
                          reference_per_s=f"{ref:.0f}"))
        warm = [keys[i].tobytes() for i in rng.integers(0, len(keys), 4 * 32 * 64)]
        for text in args.in_flight.split(","):
            in_flight = None if text == "auto" else int(text)
            picked = rng.choice(len(keys), args.keys, replace=False)
            wanted = [keys[i].tobytes() for i in picked.tolist()]
            try:
                seconds, got, used, key_format = time_lookups(urls, wanted, warm[:len(wanted)],
                                                              in_flight)
            except PirError as exc:
                print(f"  lookup_many in flight {text}: failed: {exc}", flush=True)
                lines.append(dict(measure="lookup_many", in_flight=text, lookups=len(wanted),
                                  reference_per_s=f"{ref:.0f}", failed=str(exc)[:200]))
                continue
            check_values(values, picked, got)
            rate = len(wanted) / seconds
            print(f"  lookup_many in flight {used:2}: {rate:9,.0f} lookups/s "
                  f"({rate / ref:.2f} of the reference)", flush=True)
            lines.append(dict(measure="lookup_many", in_flight=used, lookups=len(wanted),
                              seconds=f"{seconds:.3f}", lookups_per_s=f"{rate:.0f}",
                              reference_per_s=f"{ref:.0f}", ratio=f"{rate / ref:.3f}"))
        gateway, port, gateway_command = start_gateway(urls, args.folder)
        picked = rng.choice(len(keys), args.rpc_keys, replace=False).tolist()
        addresses = ["0x" + keys[i, 1:21].tobytes().hex() for i in picked]
        balances = [int.from_bytes(values[i, :32].tobytes(), "big") for i in picked]
        drive_gateway(port, addresses[:args.rpc_batch], balances, 1, args.rpc_batch)  # warm
        seconds = drive_gateway(port, addresses, balances, args.callers, args.rpc_batch)
        rate = len(addresses) / seconds
        print(f"  morpho-rpc, {args.callers} callers x {args.rpc_batch} eth_getBalance: "
              f"{rate:9,.0f} lookups/s ({rate / ref:.2f} of the reference)", flush=True)
        lines.append(dict(measure="morpho-rpc eth_getBalance", callers=args.callers,
                          rpc_batch=args.rpc_batch, lookups=len(addresses),
                          seconds=f"{seconds:.3f}", lookups_per_s=f"{rate:.0f}",
                          reference_per_s=f"{ref:.0f}", ratio=f"{rate / ref:.3f}"))
    finally:
        if gateway is not None:
            stop(gateway)
        stop_parties(proc)
    backend = health[0].get("backend", "?")
    device = health[0].get("device") or health[0].get("device_name") or ""
    load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    write_csv(args.out, [
        f"# machine: {platform.node()}; {cpu_model()}; {os.cpu_count()} CPUs; backend {backend} "
        f"{device}; python {platform.python_version()}; load average {load_avg} at the end",
        f"# shape: records epoch of {table.num_pages} pages (domain_bits {info.domain_bits}), "
        f"{len(keys)} accounts (load {load:.4f}), 53-byte keys, 192-byte values, built by "
        f"gpu_engine.records.build (measure build: its seconds, not the file write); both parties "
        f"of `make run` on this host; reference: {args.reference_procs} processes x "
        f"{args.reference_threads} connections per party for {args.reference_seconds:g} s, "
        f"32-query {key_format} requests; lookup_many: one process, {args.keys} random present "
        f"keys per point, every value checked; morpho-rpc: `{gateway_command}`, {args.callers} "
        f"threads posting JSON-RPC batches of {args.rpc_batch} eth_getBalance over plain HTTP "
        f"(http.client, not web3.py), {args.rpc_keys} random present addresses, every balance "
        f"checked",
        f"# command: python {shlex.join(sys.argv)}",
        f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
    ], FIELDS, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
