"""`make epoch MATRIX=FILE`: record and activate one epoch on both parties of `make run` at once.

Each party is switched by its own `manage.py load_epoch FILE --activate`, in its own environment
(database, engine server, matrix folder: devserver.party_env), and the two run side by side, so
the parties serve different epochs (clients refuse to combine their answers, and retry) only for
the difference between the two loads, not for a whole second command typed after the first.
Both must switch to the same epoch_id: it comes from --epoch-id, else from the file's sidecar,
and is refused when neither gives one. A party that already serves it is left as it is, so the
same command run again after one party failed switches only the other.

Standard library only, like the supervisor: it runs no Django itself.
"""
from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

from morphoweb.devserver import BASE_DIR, demo_matrix, demo_pages, party_env, state_folder

PARTIES = ("a", "b")
SWITCH_TIMEOUT_S = 900.0  # a load reads and checks the whole file, then uploads it


def _sidecar_epoch_id(matrix: Path) -> int | None:
    """The epoch_id of the file's sidecar `<path>.epoch.json`, or None."""
    try:
        meta = json.loads(Path(f"{matrix}.epoch.json").read_text())
    except (OSError, ValueError):
        return None
    epoch_id = meta.get("epoch_id") if isinstance(meta, dict) else None
    return epoch_id if isinstance(epoch_id, int) and not isinstance(epoch_id, bool) else None


def _manage(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _served_epoch(database: Path) -> int | None:
    """The epoch_id of the party's active epoch record (what its engines serve), or None."""
    try:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as conn:
            row = conn.execute("SELECT epoch_id FROM epochs_epoch WHERE state = 'active' "
                               "ORDER BY activated DESC LIMIT 1").fetchone()
    except sqlite3.Error:
        return None  # not migrated yet: load_epoch says so
    return row[0] if row else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Switch both parties of `make run` to a new epoch: the matrix file must be in "
                    "the parties' matrix folder (matrices/ in the state folder under `make run`), with "
                    "its sidecar. Other "
                    "options (--block-number, --state-root, --seeds, --stop-the-world, "
                    "--discard-updates, --placement) go to each party's load_epoch.")
    parser.add_argument("matrix", help="the epoch's matrix file")
    parser.add_argument("--epoch-id", type=int, help="default: the file's sidecar's")
    args, rest = parser.parse_known_args(argv)
    matrix = Path(args.matrix).resolve()
    if not matrix.is_file():  # else the missing sidecar's epoch id would be the complaint
        print(f"{args.matrix}: no such file; make one first (`manage.py make_matrix ... --out "
              f"FILE`, or `build_records`: docs/OPERATIONS.md, Switching epochs)", file=sys.stderr)
        return 2
    var_dir = state_folder()
    envs = {name: party_env(name, demo_matrix(var_dir, demo_pages()), var_dir) for name in PARTIES}
    # the SQLite file of each party, as its processes name it
    databases = {name: Path(env["DATABASE_URL"].removeprefix("sqlite:///"))
                 for name, env in envs.items()}
    missing = [name for name in PARTIES if not databases[name].exists()]
    if missing:
        print(f"no database of party {', '.join(m.upper() for m in missing)} in {var_dir}: start "
              f"the parties with `make run` (VAR= as there) first", file=sys.stderr)
        return 2
    epoch_id = args.epoch_id if args.epoch_id is not None else _sidecar_epoch_id(matrix)
    if epoch_id is None:
        print(f"{args.matrix}: no epoch id. Both parties must serve the same one: give it with "
              f"EPOCH_ID=N (or write it in the file's sidecar {matrix}.epoch.json)",
              file=sys.stderr)
        return 2
    command = ["load_epoch", str(matrix), "--epoch-id", str(epoch_id), "--activate", *rest]
    running = {}
    for name in PARTIES:
        if _served_epoch(databases[name]) == epoch_id:
            print(f"party {name.upper()}: already serves epoch {epoch_id}; left as it is")
            continue
        running[name] = _manage(command, envs[name])
    failed = []
    for name, proc in running.items():
        out, _ = proc.communicate(timeout=SWITCH_TIMEOUT_S)
        for line in out.strip().splitlines():
            print(f"party {name.upper()}: {line}")
        if proc.returncode != 0:
            failed.append(name)
    if not failed:
        print(f"both parties serve epoch {epoch_id}")
        return 0
    switched = [name.upper() for name in PARTIES if name not in failed]
    if switched:
        print(f"party {', '.join(switched)} serves epoch {epoch_id}, party "
              f"{', '.join(f.upper() for f in failed)} does not: clients refuse to combine the "
              f"parties' answers until both serve one epoch. Fix the cause above and run the same "
              f"command again (it switches only the party that has not), or activate the previous "
              f"epoch again on party {', '.join(switched)} (admin: Epochs)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
