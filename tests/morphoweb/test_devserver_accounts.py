"""`make run DEMO=accounts`: both parties serve make_accounts' state as a records epoch, and the
command the supervisor prints looks an account up privately."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

from morpho_client.cli import main as cli_main
from morpho_pir.ethereum import Account
from tests.conftest import REPO, free_port, http_json, server_env


def test_make_run_accounts_serves_a_records_epoch_the_printed_lookup_reads(tmp_path):
    var = tmp_path / "v"
    ports = free_port(), free_port()
    env = server_env(MORPHO_VAR_DIR=var, DEMO="accounts", DEMO_ACCOUNTS=300,
                     MORPHO_ENGINE_BACKEND="cpu", MORPHO_WEB_WORKERS=2, CUDA_VISIBLE_DEVICES="")
    argv = [sys.executable, "-m", "morphoweb.devserver", "--port-a", str(ports[0]),
            "--port-b", str(ports[1])]
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        run = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while b"Ctrl-C stops everything" not in log_path.read_bytes():
            assert run.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        printed = log_path.read_text()
        assert "morpho-rpc --server-a" in printed
        # where to read what the lookups should answer
        assert f"dataset: {var / 'demo-accounts-300.jsonl'} (an account a line" in printed
        assert f"the table's keys and values: {var / 'demo-accounts-300.state.jsonl'}" in printed
        key = re.search(r"--key (0x[0-9a-f]+)", printed).group(1)
        epoch = http_json(f"http://127.0.0.1:{ports[0]}/epoch")[2]
        assert epoch["records"]["key_bytes"] == 53 and epoch["records"]["value_bytes"] == 192
        lines = []
        assert cli_main(["--server-a", f"http://127.0.0.1:{ports[0]}", "--server-b",
                         f"http://127.0.0.1:{ports[1]}", "--key", key], out=lines.append) == 0
        first = json.loads((var / "demo-accounts-300.jsonl").read_text().splitlines()[0])
        value = bytes.fromhex(lines[0].split(": 0x")[1].split(" ")[0])
        account = Account.decode(value[:76])
        assert (account.balance, account.nonce) == (int(first["balance"], 16), first["nonce"])
    finally:
        run.send_signal(signal.SIGTERM)
        try:
            run.wait(90)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait(30)
