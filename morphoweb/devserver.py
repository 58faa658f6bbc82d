"""`make run`: a demo matrix and parties A and B, each an engine server, gunicorn and bulk workers.

DEMO=accounts serves an Ethereum-like state as a records epoch instead of random pages.

Each party is its own operator: its own SQLite database, Celery file broker and engine server
under the state folder (MORPHO_VAR_DIR, default var/), which only this user may enter; the demo
matrix lies in var/matrices/, a folder of matrix files alone, the only one epochs are taken
from. The engine server owns the matrix and the device; the web processes and the bulk worker
reach it over an ipc:// socket. The party's port is served by its front end
(morphoweb/frontend.py), which reads each request whole before it passes it to gunicorn on a
Unix socket, so slow clients cannot hold gunicorn's threads. An engine server
that dies is started again; any other process that dies stops everything, and so does the death
of the process that started this one (`make`, killed alone or with its terminal).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from morpho_pir.ethereum import ACCOUNT_TYPE, state_key
from morphoweb.partyprocs import NotHealthy, end_with_parent, health, wait_healthy

BASE_DIR = Path(__file__).resolve().parent.parent
RESTART_DELAY_S = 1.0  # pause before an engine server that died is started again
IPC_PATH_MAX = 100  # bytes: a Unix socket path must fit sockaddr_un (108 with the NUL)


class Child:
    """One supervised process, in a session of its own so that a terminal's Ctrl-C reaches only
    this supervisor, which stops each child with one SIGTERM (gunicorn's threaded worker
    deadlocks when a second signal lands inside its shutdown)."""

    def __init__(self, name: str, argv: list[str], env: dict, restart: bool = False) -> None:
        self.name, self.argv, self.env, self.restart = name, argv, env, restart
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0

    def start(self) -> "Child":
        self.proc = subprocess.Popen(self.argv, cwd=BASE_DIR, env=self.env, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def reap(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the process and everything it forked
            self.proc.wait()


def _manage(args: list[str], env: dict) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env, check=True)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as the servers bind it: connections of a run just stopped, in TIME_WAIT, hold no port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _socket_path(var_dir: Path, filename: str) -> Path:
    path = var_dir / filename
    if len(str(path)) > IPC_PATH_MAX:
        raise SystemExit(f"the state folder {var_dir} is too deep for a Unix socket path "
                         f"({len(str(path))} > {IPC_PATH_MAX} bytes): choose a shorter VAR=")
    return path


def _engine_url(var_dir: Path, name: str) -> str:
    return f"ipc://{_socket_path(var_dir, f'engine-{name}.sock')}"


def check_gpu(setting: str, value: Optional[str]) -> Optional[str]:
    """A party's GPUs as CUDA_VISIBLE_DEVICES takes them ("1", "2,3"), or None for the host's
    own setting; SystemExit naming the setting otherwise."""
    if value is None or value.strip() == "":
        return None
    ids = [part.strip() for part in value.split(",")]
    if not all(part.isdigit() for part in ids):
        raise SystemExit(f"{setting}={value!r}: expected GPU ids as nvidia-smi numbers them, "
                         "e.g. 0 or 2,3")
    return ",".join(ids)


def party_env(name: str, matrix: Path, var_dir: Path, gpu: Optional[str] = None) -> dict:
    """The environment of party `name`'s processes (`make epoch` gives its commands the same).
    `gpu` pins them to those GPUs (CUDA_VISIBLE_DEVICES): the engine server's device 0 is the
    first of them, and the bulk workers pin themselves within them."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env.setdefault("MORPHO_ENGINE_BACKEND", "auto")
    env.update(
        MORPHO_MATRIX_PATH=str(matrix),
        MORPHO_VAR_DIR=str(var_dir),
        DATABASE_URL=f"sqlite:///{var_dir / f'party-{name}.sqlite3'}",
        CELERY_FILESYSTEM_BROKER_DIR=str(var_dir / f"celery-broker-{name}"),
        CELERY_BEAT_SCHEDULE_FILENAME=str(var_dir / f"celerybeat-schedule-{name}"),
        MORPHO_BULK_FILES_DIR=str(var_dir / f"bulk-{name}"),
        MORPHO_ENGINE_URL=_engine_url(var_dir, name),
        MORPHO_PARTY_NAME=name.upper(),  # in the admin's header, the dashboard and /
        MORPHO_GUNICORN_CONTROL_SOCKET=str(var_dir / f"gunicorn-{name}.ctl"),
        # The front end is the one proxy before gunicorn: the throttle counts requests per
        # address from the last entry of X-Forwarded-For, the one the front end writes.
        MORPHO_NUM_PROXIES="1",
    )
    return env


def _served(health_body: dict) -> str:
    """What a party serves, from its /health: the active epoch of its database, which a restart
    after `make epoch` loads instead of the demo matrix."""
    if "epoch_id" not in health_body:
        return "serving nothing yet"
    device = health_body.get("device") or health_body.get("backend")
    return (f"serves epoch {health_body['epoch_id']} (block {health_body.get('block_number')}, "
            f"{health_body.get('num_pages')} pages) on {device}")


def _var_arg(var_dir: Path) -> str:
    """` VAR=...` for the make commands the banner prints, unless the state folder is var/:
    `make superuser` and `make epoch` then find the parties' databases where they are."""
    return "" if var_dir == (BASE_DIR / "var").resolve() else f" VAR={var_dir}"


def demo_pages() -> int:
    """Pages of the generated demo matrix: DEMO_PAGES, else 8192 (32 MiB)."""
    return int(os.environ.get("DEMO_PAGES") or 8192)


def state_folder() -> Path:
    """The parties' state folder: MORPHO_VAR_DIR (`make run VAR=`), else var/."""
    return Path(os.environ.get("MORPHO_VAR_DIR") or BASE_DIR / "var").resolve()


def demo_matrix(var_dir: Path, pages: int) -> Path:
    """The matrix file the parties start from where their databases have no active epoch."""
    return Path(os.environ.get("MORPHO_MATRIX_PATH")
                or var_dir / "matrices" / f"demo-{pages}p.bin")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_with_parent() -> int:
    """Have the kernel send SIGTERM when the parent (`make`) dies, and return the parent's pid.

    Killing `make` alone (`kill <pid>`, a tmux or screen session closed around it) signals make,
    not this process: without this, the parties would run on, orphaned, holding their ports. Where
    prctl is missing (not Linux), the supervision loop notices the parent's pid change instead."""
    parent = os.getppid()
    end_with_parent()
    return parent


def _orphaned(parent: int) -> bool:
    """True once the process that started this one has gone (this one was handed to another)."""
    return os.getppid() != parent


def _party(name: str, host: str, port: int, matrix: Path, var_dir: Path, web_workers: int,
           threads: int, gpu: Optional[str]) -> list[Child]:
    env = party_env(name, matrix, var_dir, gpu)
    _manage(["migrate", "--no-input", "-v0"], env)
    py = sys.executable
    web_socket = _socket_path(var_dir, f"web-{name}.sock")
    return [
        # The one process that loads the matrix and owns the device; restarted if it dies.
        Child(f"engine-{name}", [py, "manage.py", "serve_engine"], env, restart=True),
        # The party's port: requests are read whole here (header and body deadlines), so a
        # slow client holds a socket of this asyncio process, not a gunicorn thread.
        Child(f"front-{name}", [py, "-m", "morphoweb.frontend", "--listen", f"{host}:{port}",
                                "--upstream", f"unix:{web_socket}"], env),
        Child(f"web-{name}", [py, "-m", "gunicorn", "morphoweb.wsgi",
                              "--bind", f"unix:{web_socket}",
                              "--workers", str(web_workers), "--threads", str(threads),
                              "--name", f"morphoweb-party-{name}"], env),
        # Bulk jobs: Celery workers over the party's database and file broker, submitting to
        # the same engine server on its bulk lane.
        Child(f"workers-{name}", [py, "bin/gpu-workers"], env),
    ]


DEMOS = ("pages", "accounts")


def _accounts_demo(var_dir: Path, accounts: int) -> tuple[Path, str, str]:
    """The accounts demo's records epoch (made once): make_accounts, then build_records of its
    state table; the client options that look its first account up; and where its dataset is."""
    dataset = var_dir / f"demo-accounts-{accounts}.jsonl"
    matrix = var_dir / "matrices" / f"demo-accounts-{accounts}.bin"
    if not matrix.exists():
        print(f"generating the accounts demo {matrix} ({accounts} accounts)", flush=True)
        _manage(["make_accounts", "--accounts", str(accounts), "--seed", "1", "--out",
                 str(dataset)], dict(os.environ))
        _manage(["build_records", "--input", str(dataset.with_name(dataset.stem + ".state.jsonl")),
                 "--out", str(matrix), "--type-column", "type", "--seed", "1"], dict(os.environ))
    with open(dataset) as fh:
        address = bytes.fromhex(json.loads(fh.readline())["address"][2:])
    state = dataset.with_name(dataset.stem + ".state.jsonl")
    where = (f"dataset: {dataset} (an account a line: address, balance, nonce, code, storage); "
             f"the table's keys and values: {state}\n")
    return matrix, f"--key 0x{state_key(ACCOUNT_TYPE, address).hex()}", where


def main(argv=None) -> int:
    cores = os.cpu_count() or 2
    parser = argparse.ArgumentParser(description="Run PIR parties A and B locally.")
    parser.add_argument("--pages", type=int, default=demo_pages(),
                        help="pages of the generated demo matrix (default 8192 = 32 MiB)")
    parser.add_argument("--demo", choices=DEMOS, default=os.environ.get("DEMO") or "pages",
                        help="pages: a random matrix of --pages; accounts: an Ethereum-like "
                             "state of --accounts accounts as a records epoch, for lookups by "
                             "key and morpho-rpc")
    parser.add_argument("--accounts", type=int,
                        default=int(os.environ.get("DEMO_ACCOUNTS") or 10_000),
                        help="accounts of the accounts demo (default 10000)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-a", type=int, default=int(os.environ.get("PORT_A") or 8001))
    parser.add_argument("--port-b", type=int, default=int(os.environ.get("PORT_B") or 8002))
    parser.add_argument("--web-workers", type=int,
                        default=int(os.environ.get("MORPHO_WEB_WORKERS") or max(2, cores // 2)),
                        help="gunicorn processes per party (default: half the cores, at least 2)")
    parser.add_argument("--threads", type=int, default=8, help="gunicorn threads per process")
    for name in ("a", "b"):
        parser.add_argument(f"--gpu-{name}", default=os.environ.get(f"GPU_{name.upper()}"),
                            metavar="IDS",
                            help=f"party {name.upper()}'s GPUs (CUDA_VISIBLE_DEVICES of its "
                                 f"processes, e.g. {'0' if name == 'a' else '1'}; default "
                                 f"$GPU_{name.upper()}, else the host's)")
    args = parser.parse_args(argv)
    gpus = {"a": check_gpu("GPU_A", args.gpu_a), "b": check_gpu("GPU_B", args.gpu_b)}
    # A SIGTERM (a supervisor, `kill`) or SIGHUP (the terminal closed) stops everything like
    # Ctrl-C; so does SIGINT (`kill -INT`) where a shell started `make run` in the background
    # and left SIGINT ignored, as shells do for background jobs of a script.
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, _interrupt)
    parent = _stop_with_parent()
    if _orphaned(parent):  # the parent died before the kernel was asked to say so
        return 1

    ports = {"a": args.port_a, "b": args.port_b}
    busy = [f"{port} (party {name.upper()})" for name, port in ports.items()
            if not _port_free(args.host, port)]
    if len(set(ports.values())) < len(ports):
        raise SystemExit(f"parties A and B need two different ports, got {args.port_a} twice")
    if busy:
        raise SystemExit(f"port {', '.join(busy)} on {args.host} is in use (another `make run`?): "
                         f"stop it, or choose others with `make run PORT_A=... PORT_B=...`")

    # Databases, sockets and the broker's messages are this user's alone: the folder is 0700 and
    # every file the parties make is 0600, so no other local user reaches gunicorn around the front
    # end or reads the admin's password hash.
    os.umask(0o077)
    var_dir = state_folder()
    var_dir.mkdir(parents=True, exist_ok=True)
    var_dir.chmod(0o700)
    if args.demo == "accounts":
        matrix, hint, dataset = _accounts_demo(var_dir, args.accounts)
    else:
        matrix = demo_matrix(var_dir, args.pages)
        if not matrix.exists():
            print(f"generating the demo matrix {matrix} ({args.pages} pages)", flush=True)
            _manage(["make_matrix", "--pages", str(args.pages), "--seed", "1", "--out",
                     str(matrix)], dict(os.environ))
        hint, dataset = "--row 1234 --row 99 --batch", ""

    children: list[Child] = []
    try:
        for name, port in ports.items():
            party = _party(name, args.host, port, matrix, var_dir, args.web_workers, args.threads,
                           gpus[name])
            children += [child.start() for child in party]
        urls = {name: f"http://{args.host}:{port}" for name, port in ports.items()}
        served = {}
        for name, url in urls.items():
            party = {c.name: c.proc for c in children if c.name.endswith(f"-{name}")}
            try:
                wait_healthy(url, party, timeout=600, interval=0.3, held_is_up=True)
            except NotHealthy as exc:
                raise SystemExit(f"{exc}; see above") from None
            status, body = health(url)
            served[name] = _served(body) + (f" (CUDA_VISIBLE_DEVICES={gpus[name]})"
                                            if gpus[name] else "")
            if status != 200:  # up, but answering no query until the operator fixes it
                print(f"party {name.upper()} ({url}) answers 503: {body.get('failure')}",
                      file=sys.stderr, flush=True)
        print(
            f"\nparty A: {urls['a']}  {served['a']}  (GET /health, /epoch; POST /query/page/gpu[/batch])\n"
            f"party B: {urls['b']}  {served['b']}\n"
            f"each: a front end on its port, gunicorn on {var_dir}/web-<party>.sock with "
            f"{args.web_workers} web processes x {args.threads} threads, an engine server "
            f"({var_dir}/engine-<party>.sock), bulk workers\n"
            f"demo matrix: {matrix} (served until another epoch is activated; "
            f"`make epoch MATRIX=FILE{_var_arg(var_dir)}` switches both parties)\n"
            f"{dataset}\n"
            f"try:  .venv/bin/morpho-client --server-a {urls['a']} "
            f"--server-b {urls['b']} {hint}\n"
            + (f"      .venv/bin/morpho-rpc --server-a {urls['a']} --server-b {urls['b']} "
               f"(JSON-RPC on 127.0.0.1:8545)\n" if args.demo == "accounts" else "")
            + "\n"
            f"admin:  `make superuser{_var_arg(var_dir)}` creates a user and token on both, then "
            f"{urls['a']}/admin/\n"
            f"Ctrl-C stops everything.\n",
            flush=True,
        )
        while True:
            time.sleep(0.5)
            if _orphaned(parent):
                print("the process that started `make run` has gone; stopping both parties",
                      file=sys.stderr, flush=True)
                return 0
            for child in children:
                if child.alive():
                    continue
                if not child.restart:
                    print(f"{child.name} exited with status {child.proc.returncode}; stopping "
                          f"everything", file=sys.stderr, flush=True)
                    return 1
                child.restarts += 1
                print(f"{child.name} exited with status {child.proc.returncode}; starting it "
                      f"again (restart {child.restarts})", file=sys.stderr, flush=True)
                time.sleep(RESTART_DELAY_S)
                child.start()
    except KeyboardInterrupt:
        print("\nstopping both parties", flush=True)
        return 0
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.reap(20)


if __name__ == "__main__":
    sys.exit(main())
