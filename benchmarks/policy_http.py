"""Poisson sweep over HTTP of the four batching modes and an A/A control, each made live.

    python3 benchmarks/policy_http.py --csv var/bench/policy_http_cpu.csv \
        --png var/bench/policy_http_cpu.png          (`make bench-policy-http`, ~16 minutes)

Starts its own party in a temporary folder: a 256-page matrix, a SQLite database, gunicorn with
1 worker x 32 threads, the CPU engine, the query throttle off. Writes five policy records (the
four modes and a second latency one, the A/A control) into the interactive lane, field for field
those of `benchmarks.loadgen.bench_policies` (so this sweep and the engine-level one
compare the same policies), measures t(1) (the slo target is 5 x t(1) unless --target-ms) and
the capacity over HTTP, offers one stretch not measured, then for each
round, each offered fraction of the capacity and each mode: activates the mode's record through
the database, as the admin does (no restart), waits until the server's /metrics reports it, and
offers Poisson load. Every mode of one (round, fraction) gets the same arrival trace (common
random numbers), so the modes differ by their policy, not by the luck of the draw; the mode order
turns by one each round. The rounds of a point are pooled (`loadgen.summarise`) into a CSV that
`python3 benchmarks/loadgen.py --from-csv FILE` reads, plotted, and judged (slo within 10%
of the best static mode). The server is stopped and the folder removed on the way out, whatever
ends the run.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

BASE_DIR = Path(__file__).resolve().parent.parent
# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(BASE_DIR))

from benchmarks import loadgen, loadgen_http  # noqa: E402
from gpu_engine.engine_stats import percentile  # noqa: E402
from morpho_pir.protocol import KEYS_PER_QUERY  # noqa: E402
from gpu_engine.scheduler import LanePolicy  # noqa: E402
from morphoweb.partyprocs import NotHealthy, free_port, isolated_env, wait_healthy  # noqa: E402

LANE = "interactive"
PAGES = 256
WORKERS, THREADS = 1, 32
NOTE = "Made by benchmarks/policy_http.py: loadgen.bench_policies, for the HTTP policy sweep."


# --- The policy records ----------------------------------------------------------------------


def record_fields(policy: LanePolicy) -> Dict[str, object]:
    """The record fields that carry an engine policy: every engine field, by name."""
    from policies.models import ENGINE_FIELDS

    return {name: getattr(policy, name) for name in ENGINE_FIELDS}


def sync_bench_policies(policies: Mapping[str, LanePolicy], lane: str = LANE) -> Dict[str, object]:
    """Create or update one record per mode (named as the engine policy), through the model.

    Each record is fully validated (`full_clean`, so `clean()` applies the engine's own checks)
    before it is saved; an active record stays active and the server follows the new values."""
    from policies.models import BatchingPolicy

    records = {}
    for mode, policy in policies.items():
        record = BatchingPolicy.objects.filter(name=policy.name).first() or BatchingPolicy(notes=NOTE)
        for field, value in record_fields(policy).items():
            setattr(record, field, value)
        record.lane = lane
        record.full_clean()
        record.save()
        records[mode] = record
    return records


def activate(name: str) -> None:
    """Make the record `name` its lane's policy in force, as the admin's action does."""
    from policies.models import BatchingPolicy

    BatchingPolicy.objects.get(name=name).activate()


# --- The sweep: common arrivals per (round, fraction), the modes interleaved --------------------


def run_sweep(modes: Sequence[str], fractions: Sequence[float], rounds: int, capacity: float,
              seconds: float, seed: int, switch: Callable[[str], None],
              offer: Callable[[np.ndarray], loadgen.Run]) -> Dict[Tuple[float, str], List[loadgen.Run]]:
    """For each round, fraction and mode: `switch(mode)`, then `offer(arrivals)`.

    One Poisson trace of `seconds` at `fraction x capacity` is drawn per (round, fraction) and
    offered to every mode; traces of different rounds and fractions are independent draws."""
    rng = np.random.default_rng(seed)
    runs: Dict[Tuple[float, str], List[loadgen.Run]] = {}
    for round_ in range(rounds):
        for fraction in fractions:
            arrivals = loadgen.poisson_arrivals(fraction * capacity, seconds, rng)
            arrivals.setflags(write=False)  # one trace for every mode: none may change it
            for mode in loadgen.mode_order(modes, round_):
                switch(mode)
                runs.setdefault((fraction, mode), []).append(offer(arrivals))
    return runs


def points_of(runs: Mapping[Tuple[float, str], Sequence[loadgen.Run]], modes: Sequence[str],
              fractions: Sequence[float], capacity: float, target_ms: float) -> List[loadgen.Point]:
    """One Point per (fraction, mode), its rounds pooled; `mode` holds the plain mode name."""
    return [loadgen.summarise(mode, fraction, fraction * capacity, runs[(fraction, mode)], target_ms)
            for fraction in fractions for mode in modes]


# --- The party -------------------------------------------------------------------------------


class Party:
    """One gunicorn party on a fresh matrix and SQLite database in a folder of its own.

    A context manager: leaving it (normally, on an error, on Ctrl-C) stops the server's whole
    process group and removes the folder."""

    def __init__(self, pages: int = PAGES, seed: int = 1, port: int = 0, threads: int = THREADS,
                 log=print) -> None:
        self.pages, self.seed, self.threads, self.log = pages, seed, threads, log
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp: Optional[Path] = None
        self.proc: Optional[subprocess.Popen] = None
        self.env: Dict[str, str] = {}

    def __enter__(self) -> "Party":
        self.tmp = Path(tempfile.mkdtemp(prefix="policy-http-"))
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        tmp = self.tmp
        env = isolated_env(MORPHO_VAR_DIR=tmp, MORPHO_MATRIX_PATH=tmp / "matrix.bin",
                           MORPHO_ENGINE_BACKEND="cpu", DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}",
                           MORPHO_QUERY_THROTTLE="off", MORPHO_LOG_LEVEL="WARNING",
                           DJANGO_SETTINGS_MODULE="morphoweb.settings", CUDA_VISIBLE_DEVICES="")
        self.env = env
        self._manage("make_matrix", "--pages", str(self.pages), "--seed", str(self.seed),
                     "--out", str(tmp / "matrix.bin"))
        self._manage("migrate", "--no-input", "-v", "0")
        self.log_path = tmp / "gunicorn.log"
        with open(self.log_path, "wb") as log_file:
            # A session of its own: a Ctrl-C at the terminal reaches this process only, and
            # stop() ends the master and its worker together.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "morphoweb.wsgi", "--bind", f"127.0.0.1:{self.port}",
                 "--workers", str(WORKERS), "--threads", str(self.threads), "--timeout", "120"],
                cwd=BASE_DIR, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(self.url, {"gunicorn": self.proc}, 180, interval=0.3)
        except NotHealthy as exc:
            raise RuntimeError(f"{exc}:\n{self.log_tail()}") from None
        self.log(f"gunicorn ({WORKERS} worker x {self.threads} threads, cpu engine, {self.pages} pages) "
                 f"at {self.url}, files in {tmp}")

    def _manage(self, *args: str) -> None:
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=BASE_DIR, env=self.env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}{done.stderr}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (AttributeError, OSError):
            return "(no log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if proc is not None:
            try:  # whatever of the group is left (a worker that outlived its master)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def setup_django(self) -> None:
        """Let this process write the party's policy records (its settings, its database)."""
        import django

        os.environ.update(self.env)
        django.setup()


# --- The command -----------------------------------------------------------------------------


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _load() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


@dataclass
class Result:
    points: List[loadgen.Point]
    shape: dict


def sweep(args, log=print) -> Result:
    # and the A/A control: latency measured twice says how far two runs of one policy fall apart
    modes = list(loadgen.MODES) + [loadgen.CONTROL]
    loads = [_load()]
    with Party(PAGES, args.seed, args.port, log=log) as party:
        party.setup_django()
        url = party.url
        epoch = loadgen_http.epoch_info(url)
        domain_bits = epoch["page_pir"]["domain_bits"]
        pool = loadgen.make_pool(domain_bits, 256, args.seed)
        gc.freeze()  # the pool: no collection walks it during a measured stretch

        def use(policies: Mapping[str, LanePolicy], mode: str) -> None:
            sync_bench_policies(policies)
            activate(policies[mode].name)
            loadgen_http.wait_for_policy(url, policies[mode].name, args.switch_timeout,
                                         target_ms=policies[mode].p95_target_ms)

        # t(1) with the latency policy in force (a provisional target until it is known)
        target_ms = args.target_ms
        use(loadgen.bench_policies(args.window_us, target_ms or 250.0, args.max_batch), "latency")
        t1 = loadgen_http.single_query_s(url, pool, count=20)
        if target_ms is None:
            target_ms = round(5 * t1 * 1000, 1)
        policies = loadgen.bench_policies(args.window_us, target_ms, args.max_batch, control=True)
        use(policies, "latency")
        capacity = loadgen_http.http_capacity(url, pool, args.clients, args.capacity_s)
        log(f"t(1) over HTTP {t1 * 1000:.2f} ms (median of 20); slo p95 target {target_ms} ms "
            f"({'--target-ms' if args.target_ms else '5 x t(1)'}); capacity {capacity:.1f} q/s with "
            f"{args.clients} closed-loop clients; load average {loads[0]}")
        seconds = args.warmup + args.duration / args.rounds
        switches: List[float] = []

        # Enough threads that a slow answer never delays the next arrival (open loop). Not a
        # `with`: on an interrupt nothing waits for answers; the server's stop ends them.
        executor = ThreadPoolExecutor(max_workers=256, thread_name_prefix="http-load")
        current = [""]
        try:
            def switch(mode: str) -> None:
                activate(policies[mode].name)
                switches.append(loadgen_http.wait_for_policy(url, policies[mode].name,
                                                             args.switch_timeout))
                current[0] = mode

            def offer(arrivals: np.ndarray) -> loadgen.Run:
                run = loadgen_http.offer(url, pool, arrivals, args.warmup, executor)
                log(f"  {current[0]:>10} {len(arrivals) / seconds:7.1f} q/s offered: "
                    f"{run.completed / run.span_s:7.1f} q/s, "
                    f"p95 {percentile([1000 * v for v in run.latencies_s], 0.95):7.1f} ms, "
                    f"refused {run.refused}")
                return run

            # One stretch not measured first: the first measured stretch right after the capacity
            # run came out about twice as slow (p95) as the same mode and rate in later rounds,
            # for longer than the 2 s warm-up. Its own draw: the sweep's traces stay as they are.
            prime = loadgen.poisson_arrivals(args.fractions[0] * capacity, seconds,
                                             np.random.default_rng([args.seed, 1]))
            loadgen_http.offer(url, pool, prime, args.warmup, executor)
            runs = run_sweep(modes, args.fractions, args.rounds, capacity, seconds, args.seed,
                             switch, offer)
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        loads.append(_load())
    cost = {k: loadgen_http.metric_value(metrics, "gpu_cost_model", parameter=k)
            for k in ("intercept_s", "per_query_s")}

    def fit_ms(b: int) -> float:
        return round(1000 * (cost["intercept_s"] + b * cost["per_query_s"]), 3)

    points = points_of(runs, modes, args.fractions, capacity, target_ms)
    for point in points:
        log(f"{point.mode:>10} {point.fraction:4.0%} offered {point.offered_qps:7.1f} q/s: "
            f"{point.throughput_qps:7.1f} q/s, p50 {point.p50_ms:7.1f} p95 {point.p95_ms:7.1f} "
            f"(round median {point.p95_round_median_ms:7.1f}) p99 {point.p99_ms:7.1f} ms, "
            f"batch {point.mean_batch:4.1f}, refused {point.refused}")
    shape = {"server": f"gunicorn workers={WORKERS} threads={THREADS}", "backend": "cpu",
             "pages": PAGES,
             "domain_bits": domain_bits, "keys_per_query": KEYS_PER_QUERY,
             "max_batch": args.max_batch,
             "window_us": args.window_us, "p95_target_ms": target_ms,
             "target": "--target-ms" if args.target_ms else "5xt1_http",
             "t1_http_ms": round(t1 * 1000, 3), "capacity_qps": round(capacity, 1),
             "clients": args.clients, "rounds": args.rounds, "warmup_s": args.warmup,
             "stretch_s": round(seconds, 3), "arrivals": "common_per_round_and_fraction",
             "switch_max_s": round(max(switches), 3) if switches else math.nan,
             # the engine's own launch-cost fit at the end (launches timed under the sweep's load)
             "engine_fit_end_t1_ms": fit_ms(1),
             f"engine_fit_end_t{args.max_batch}_ms": fit_ms(args.max_batch),
             "loadavg_start": loads[0], "loadavg_end": loads[-1]}
    return Result(points, shape)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 benchmarks/policy_http.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0,
                        help="measured seconds per point, split over the rounds (default 20)")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds of load before each stretch is measured (default 2)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="stretches per point, the modes interleaved in each (default 3)")
    parser.add_argument("--fractions", default=",".join(map(str, loadgen.FRACTIONS)),
                        help="offered rates as fractions of the measured capacity")
    parser.add_argument("--seed", type=int, default=1, help="matrix, queries and arrivals")
    parser.add_argument("--target-ms", type=float, default=None,
                        help="slo p95 target (default: 5 x t(1) measured over HTTP)")
    parser.add_argument("--window-us", type=int, default=5000,
                        help="throughput/adaptive admission window")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients for the capacity")
    parser.add_argument("--capacity-s", type=float, default=None,
                        help="seconds the capacity is measured for (default: max(3, duration / 3))")
    parser.add_argument("--switch-timeout", type=float, default=5.0,
                        help="seconds a live policy switch may take before the run fails")
    parser.add_argument("--port", type=int, default=0, help="gunicorn's port (default: a free one)")
    parser.add_argument("--csv", help="write the points here (machine/shape/command/date lines first)")
    parser.add_argument("--png", help="plot p95/p99 and throughput against offered load here")
    args = parser.parse_args(argv)
    args.fractions = [float(f) for f in args.fractions.split(",") if f]
    if not args.fractions or not all(0 < f for f in args.fractions):
        parser.error("--fractions: positive numbers, comma-separated")
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("--rounds >= 1, --duration > 0 and --warmup >= 0")
    if args.capacity_s is None:
        args.capacity_s = max(3.0, args.duration / 3)
    if args.png:
        try:
            import matplotlib  # noqa: F401 - known before a long run, not after it
        except ImportError:
            parser.error("--png needs matplotlib (pip install matplotlib), or leave --png out")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        result = sweep(args, log=lambda *a: print(*a, flush=True))
    except KeyboardInterrupt:
        print("interrupted: server stopped, temporary files removed", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    header = loadgen.header_lines(result.shape, argv, "benchmarks/policy_http.py")
    loadgen.report(result.points, header, args.csv, args.png,
                   "Batching modes under Poisson load over HTTP (gunicorn, cpu)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
