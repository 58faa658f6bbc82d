"""morpho-rpc against two real parties serving make_accounts' state, driven by web3.py: a client
no one here wrote reads balances, nonces, code and storage privately, equal to the dataset."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from morphoweb.partyprocs import free_port
from morpho_client import PirClient
from morpho_client.rpc import Gateway, make_server
from tests.conftest import REPO, http_json, server_env

# web3.py raises the interpreter's recursion limit to 100,000 on import; the rest of the suite
# (the API's refusal of JSON nested too deeply among them) runs at Python's own limit.
_RECURSION_LIMIT = sys.getrecursionlimit()
web3 = pytest.importorskip("web3")
from web3 import Web3  # noqa: E402

sys.setrecursionlimit(_RECURSION_LIMIT)

ACCOUNTS = 1000


def manage(*argv, env=None):
    subprocess.run([sys.executable, "manage.py", *argv], cwd=REPO, env=env, check=True,
                   timeout=600, stdout=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("accounts")
    manage("make_accounts", "--accounts", str(ACCOUNTS), "--seed", "7", "--out",
           str(folder / "accounts.jsonl"))
    manage("build_records", "--input", str(folder / "accounts.state.jsonl"), "--out",
           str(folder / "state.bin"), "--type-column", "type", "--seed", "3",
           "--block-number", "1234")
    accounts = [json.loads(line) for line in (folder / "accounts.jsonl").read_text().splitlines()]
    return folder, accounts


@pytest.fixture(scope="module")
def gateway(start_server, dataset):
    folder, _ = dataset
    urls = []
    for name in "ab":
        env = server_env(MORPHO_MATRIX_PATH=folder / "state.bin", MORPHO_ENGINE_BACKEND="cpu",
                         DATABASE_URL=f"sqlite:///{folder / name}.sqlite3")
        manage("migrate", "--no-input", "-v0", env=env)
        urls.append(start_server("runserver", env).url)
    client = PirClient(*urls)
    server = make_server(Gateway(client, chain_id=31337), "127.0.0.1", free_port())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    client.close()


def absent_addresses(count: int) -> list:
    return [Web3.to_checksum_address("0x" + (i + 1).to_bytes(20, "big").hex())
            for i in range(count)]


def test_web3_reads_every_account_and_absent_ones_as_empty(gateway, dataset):
    _, accounts = dataset
    w3 = Web3(Web3.HTTPProvider(gateway, request_kwargs={"timeout": 300}))
    assert w3.is_connected()
    assert w3.eth.chain_id == 31337 and w3.eth.block_number == 1234
    present = [Web3.to_checksum_address(a["address"]) for a in accounts]
    absent = absent_addresses(ACCOUNTS)
    with w3.batch_requests() as batch:
        for address in present + absent:
            batch.add(w3.eth.get_balance(address))
            batch.add(w3.eth.get_transaction_count(address))
        answers = batch.execute()
    balances, nonces = answers[0::2], answers[1::2]
    assert balances[:ACCOUNTS] == [int(a["balance"], 16) for a in accounts]
    assert nonces[:ACCOUNTS] == [a["nonce"] for a in accounts]
    assert balances[ACCOUNTS:] == [0] * ACCOUNTS and nonces[ACCOUNTS:] == [0] * ACCOUNTS
    assert max(balances) == 2 ** 256 - 1  # the largest quantity comes through whole


def test_web3_reads_code_and_storage(gateway, dataset):
    _, accounts = dataset
    w3 = Web3(Web3.HTTPProvider(gateway, request_kwargs={"timeout": 300}))
    contracts = [a for a in accounts if a["code"] != "0x" and a["storage"]][:8]
    plain = [a for a in accounts if a["code"] == "0x"][:2]
    for account in contracts + plain:
        address = Web3.to_checksum_address(account["address"])
        assert "0x" + w3.eth.get_code(address).hex().removeprefix("0x") == account["code"]
        for slot, value in list(account["storage"].items())[:3]:
            assert w3.eth.get_storage_at(address, int(slot, 16)) == bytes.fromhex(value[2:])
        assert w3.eth.get_storage_at(address, 2 ** 255 + 12345) == bytes(32)
    assert w3.eth.get_code(absent_addresses(1)[0]) == b""


def test_the_block_parameter_is_honoured(gateway, dataset):
    _, accounts = dataset
    w3 = Web3(Web3.HTTPProvider(gateway))
    address = Web3.to_checksum_address(accounts[5]["address"])
    balance = int(accounts[5]["balance"], 16)
    for block in ("latest", "pending", "safe", "finalized", 1234):
        assert w3.eth.get_balance(address, block) == balance
    with pytest.raises(Exception, match="header not found"):
        w3.eth.get_balance(address, 1233)
    rpc = lambda method, params: http_json(gateway, {"jsonrpc": "2.0", "id": 1, "method": method,
                                                     "params": params})[2]
    assert rpc("eth_getBalance", [accounts[5]["address"], {"blockNumber": "0x4d2"}])["result"] \
        == hex(balance)
    assert rpc("eth_getBalance", [accounts[5]["address"], {"blockHash": "0x" + "11" * 32}]
               )["error"]["code"] == -32000
    assert rpc("eth_getBalance", ["0x1234", "latest"])["error"]["code"] == -32602
    assert rpc("eth_getStorageAt", [accounts[5]["address"], "zz"])["error"]["code"] == -32602
    assert rpc("eth_sendRawTransaction", ["0x00"])["error"]["code"] == -32601
    assert rpc("net_version", [])["result"] == "31337"
    assert rpc("web3_clientVersion", [])["result"].startswith("morpho-rpc/")


@pytest.fixture
def upstream():
    """A stand-in upstream node that answers every call with 0x2a and writes down what came."""
    seen = []

    class Upstream(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            data = json.dumps({"jsonrpc": "2.0", "id": body["id"], "result": "0x2a"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_parties_down_is_an_error_never_a_fallback(upstream):
    url, seen = upstream
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with PirClient(*dead, timeout=2, switch_deadline=0) as client:
        gateway = Gateway(client, upstream=url)
        answer = gateway.handle({"jsonrpc": "2.0", "id": 3, "method": "eth_getBalance",
                                 "params": ["0x" + "ab" * 20, "latest"]})
        assert answer["error"]["code"] == -32000
        assert "cannot reach" in answer["error"]["message"]
        assert seen == []  # the address went nowhere
        other = gateway.handle({"jsonrpc": "2.0", "id": 4, "method": "eth_gasPrice",
                                "params": []})
    assert other == {"jsonrpc": "2.0", "id": 4, "result": "0x2a"}
    assert [call["method"] for call in seen] == ["eth_gasPrice"]
