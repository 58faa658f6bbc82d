"""`make run`: a demo matrix, two migrated SQLite databases, and parties A and B under gunicorn."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent


def _manage(args: list[str], env: dict) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env, check=True)


def _party_env(name: str, matrix: Path, var_dir: Path) -> dict:
    env = dict(os.environ)
    env.setdefault("MORPHO_ENGINE_BACKEND", "auto")
    env.update(
        MORPHO_MATRIX_PATH=str(matrix),
        # Each party is its own operator: its own database and its own broker folder.
        DATABASE_URL=f"sqlite:///{var_dir / f'party-{name}.sqlite3'}",
        CELERY_FILESYSTEM_BROKER_DIR=str(var_dir / f"celery-broker-{name}"),
    )
    return env


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited with status {proc.returncode}; see above")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url}: not healthy after {timeout:.0f} s")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run PIR parties A and B locally.")
    parser.add_argument("--pages", type=int, default=int(os.environ.get("DEMO_PAGES", 8192)),
                        help="pages of the generated demo matrix (default 8192 = 32 MiB)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-a", type=int, default=8001)
    parser.add_argument("--port-b", type=int, default=8002)
    parser.add_argument("--threads", type=int, default=8, help="gunicorn threads per party")
    args = parser.parse_args(argv)
    # A SIGTERM (from a supervisor, or `kill`) stops both parties like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)

    var_dir = Path(os.environ.get("MORPHO_VAR_DIR", BASE_DIR / "var"))
    var_dir.mkdir(parents=True, exist_ok=True)
    matrix = Path(os.environ.get("MORPHO_MATRIX_PATH") or var_dir / f"demo-{args.pages}p.bin")
    if not matrix.exists():
        print(f"generating the demo matrix {matrix} ({args.pages} pages)", flush=True)
        _manage(["make_matrix", "--pages", str(args.pages), "--seed", "1", "--out", str(matrix)],
                dict(os.environ))

    # Each child runs in a session of its own, so a terminal's Ctrl-C reaches only this process,
    # which stops each child with one SIGTERM: gunicorn's threaded worker deadlocks when a second
    # signal (the terminal's SIGINT, then its master's SIGTERM) lands inside its shutdown.
    parties = {"a": args.port_a, "b": args.port_b}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, port in parties.items():
            env = _party_env(name, matrix, var_dir)
            _manage(["migrate", "--no-input", "-v0"], env)
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "morphoweb.wsgi",
                 "--bind", f"{args.host}:{port}", "--workers", "1", "--threads", str(args.threads),
                 "--timeout", "120", "--name", f"morphoweb-party-{name}"],
                cwd=BASE_DIR, env=env, start_new_session=True,
            )
            # The party's bulk jobs run on its own Celery workers (one per visible GPU, else one
            # on the CPU), over the party's database and file broker.
            procs[f"{name}-workers"] = subprocess.Popen([sys.executable, "bin/gpu-workers"],
                                                        cwd=BASE_DIR, env=env,
                                                        start_new_session=True)
        urls = {name: f"http://{args.host}:{port}" for name, port in parties.items()}
        for name, url in urls.items():
            _wait_healthy(url, procs[name], timeout=300)
        print(
            f"\nparty A: {urls['a']}  (GET /health, /epoch; POST /query/page/gpu[/batch])\n"
            f"party B: {urls['b']}\n"
            f"matrix:  {matrix}\n\n"
            f"try:  .venv/bin/python -m queries.client --server-a {urls['a']} "
            f"--server-b {urls['b']} --row 1234 --row 99 --batch\n\n"
            f"Ctrl-C stops both.\n",
            flush=True,
        )
        while all(proc.poll() is None for proc in procs.values()):
            time.sleep(0.5)
        dead = [name for name, proc in procs.items() if proc.poll() is not None]
        print(f"party {', '.join(dead).upper()} exited; stopping the other", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping both parties", flush=True)
        return 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the master and every worker it forked


if __name__ == "__main__":
    sys.exit(main())
