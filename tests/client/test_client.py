"""The PIR client against two live party servers (runserver processes) over the same matrix."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from morpho_pir.dpf import DpfKey, eval_point, page_mask
from gpu_engine.matrix import load_matrix, write_epoch_metadata, write_matrix_file
from morpho_client import AsyncPirClient, EpochInfo, EpochMismatch, PirClient, ServerError
from morpho_client.plan import plan_query
from tests.conftest import REPO, server_env

PAGES = 300  # 4,800 rows, domain_bits 9
EPOCH = 11


@pytest.fixture(scope="module")
def matrix_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("client") / "matrix.bin"
    write_matrix_file(path, PAGES, seed=3)
    write_epoch_metadata(path, epoch_id=EPOCH, block_number=77)
    return path


@pytest.fixture(scope="module")
def parties(start_server, matrix_file, tmp_path_factory):
    """Parties A and B over the same matrix, and C over a copy of it named as another epoch."""
    other = matrix_file.with_name("other.bin")
    shutil.copyfile(matrix_file, other)
    write_epoch_metadata(other, epoch_id=EPOCH + 1, block_number=78)
    db_dir = tmp_path_factory.mktemp("dbs")
    envs = [server_env(MORPHO_MATRIX_PATH=path, MORPHO_ENGINE_BACKEND="cpu",
                       DATABASE_URL=f"sqlite:///{db_dir / name}.sqlite3")
            for name, path in (("a", matrix_file), ("b", matrix_file), ("c", other))]
    # Each party is an operator with its own migrated database, as `make run` sets them up.
    migrations = [subprocess.Popen([sys.executable, "manage.py", "migrate", "--no-input", "-v0"],
                                   cwd=REPO, env=env) for env in envs]
    assert [m.wait(300) for m in migrations] == [0, 0, 0]
    servers = [start_server("runserver", env, wait=False) for env in envs]
    return [server.wait_healthy().url for server in servers]


@pytest.fixture(scope="module")
def expected(matrix_file):
    return load_matrix(matrix_file)


@pytest.mark.processes
def test_fetch_single_rows(parties, expected):
    a, b, _ = parties
    with PirClient(a, b) as client:
        info = client.epoch()
        assert (info.epoch_id, info.num_pages, info.num_rows, info.domain_bits) == (EPOCH, PAGES, PAGES * 16, 9)
        for row in (0, 17, 2345, PAGES * 16 - 1):
            assert client.fetch_row(row) == expected.row(row)


@pytest.mark.processes
def test_fetch_many_rows_in_batches(parties, expected):
    a, b, _ = parties
    rows = random.Random(5).sample(range(PAGES * 16), 40)  # two requests: 32 + 8 queries
    with PirClient(a, b) as client:
        assert client.fetch_rows(rows, batch=True) == [expected.row(r) for r in rows]
    with PirClient(a, b, max_batch=3) as client:
        assert client.fetch_rows(rows[:7], batch=True) == [expected.row(r) for r in rows[:7]]


@pytest.mark.processes
def test_cli_prints_each_row_as_hex(parties, expected):
    a, b, _ = parties
    for extra in ([], ["--batch"]):
        result = subprocess.run(
            [sys.executable, "-m", "morpho_client", "--server-a", a, "--server-b", b,
             "--row", "5", "--row", "4000", *extra],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [
            f"row 5: 0x{expected.row(5).hex()}",
            f"row 4000: 0x{expected.row(4000).hex()}",
        ]


@pytest.mark.processes
def test_mismatched_epochs_are_refused(parties):
    a, _, c = parties
    with PirClient(a, c) as client:
        with pytest.raises(EpochMismatch) as caught:
            client.fetch_row(1)
    assert f"A ({a}) epoch {EPOCH}, B ({c}) epoch {EPOCH + 1}" in str(caught.value)
    result = subprocess.run(
        [sys.executable, "-m", "morpho_client", "--server-a", a, "--server-b", c, "--row", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "the servers serve different epochs" in result.stderr


@pytest.mark.processes
def test_row_out_of_range_and_unreachable_server(parties):
    a, b, _ = parties
    with PirClient(a, b) as client:
        with pytest.raises(ValueError, match=r"row 4800 is outside \[0, 4800\)"):
            client.fetch_row(PAGES * 16)
    with PirClient(a, "http://127.0.0.1:9") as client:
        with pytest.raises(ServerError, match="http://127.0.0.1:9/epoch: cannot reach the server"):
            client.fetch_row(0)


@pytest.mark.processes
def test_a_server_error_is_reported_with_its_reason(parties):
    a, b, _ = parties
    with PirClient(a, b) as client:
        with pytest.raises(ServerError) as caught:
            client.call(a, "/query/page/gpu", {"keys": ["00"] * 3})
    assert caught.value.status == 400
    assert "HTTP 400: keys[0]: key length: expected 197 bytes" in str(caught.value)


def test_every_query_hides_its_page_among_three():
    # Each query names three distinct pages with the wanted one at a random slot, and each
    # key pair is a DPF for its page: the servers cannot tell which of the three is wanted.
    slots = set()
    for trial in range(60):
        page = trial % 50
        plan = plan_query(page, num_pages=50, domain_bits=6)
        assert len(set(plan.pages)) == 3 and plan.pages[plan.target_slot] == page
        assert all(0 <= p < 50 for p in plan.pages)
        slots.add(plan.target_slot)
        for slot, (ha, hb) in enumerate(zip(plan.keys_a, plan.keys_b)):
            ka, kb = DpfKey.from_bytes(bytes.fromhex(ha), 6), DpfKey.from_bytes(bytes.fromhex(hb), 6)
            assert (ka.party, kb.party) == (0, 1)
            at = bytes(x ^ y for x, y in zip(eval_point(ka, plan.pages[slot]), eval_point(kb, plan.pages[slot])))
            assert at == b"\xff" * 16
    assert slots == {0, 1, 2}
    # A one- or two-page matrix still gets three keys.
    assert plan_query(0, num_pages=1, domain_bits=1).pages == (0, 0, 0)
    assert sorted(plan_query(1, num_pages=2, domain_bits=1).pages) == [0, 0, 1]


def test_v2_plans_are_point_functions_of_their_pages():
    plan = plan_query(300, num_pages=400, domain_bits=9, key_format=2)
    for slot, (ha, hb) in enumerate(zip(plan.keys_a, plan.keys_b)):
        ka, kb = DpfKey.from_bytes(bytes.fromhex(ha), 9), DpfKey.from_bytes(bytes.fromhex(hb), 9)
        assert (ka.key_format, len(bytes.fromhex(ha))) == (2, 72)
        for page in (plan.pages[slot], plan.pages[slot] ^ 1, 0, 399):
            at = bytes(x ^ y for x, y in zip(page_mask(ka, page), page_mask(kb, page)))
            assert at == (b"\xff" * 16 if page == plan.pages[slot] else bytes(16))


class EpochRewritingProxy:
    """Forwards to a real party but names another epoch in its first `lies` query answers."""

    def __init__(self, target: str, lies: int) -> None:
        import http.server
        import threading
        import urllib.request

        proxy = self
        self.lies, self.queries = lies, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self, body=None):
                request = urllib.request.Request(target + self.path, data=body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    payload = json.loads(response.read())
                # It speaks JSON and v1 keys only, like a server from before the binary
                # encoding and v2 keys.
                payload.pop("encodings", None)
                payload.pop("key_formats", None)
                if self.path.startswith("/query/"):
                    proxy.queries += 1
                    if proxy.queries <= proxy.lies:
                        payload["epoch_id"] += 1000
                raw = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._forward()

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers["Content-Length"])))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.processes
@pytest.mark.parametrize("lies, retried_ok", [(1, True), (10**6, False)])
def test_answers_from_different_epochs_are_retried(parties, expected, lies, retried_ok):
    a, b, _ = parties
    proxy = EpochRewritingProxy(b, lies)
    try:
        with PirClient(a, proxy.url, switch_deadline=1.0) as client:
            if retried_ok:
                assert client.fetch_rows([3, 4000], batch=True) == [expected.row(3), expected.row(4000)]
                assert client.last_encodings == ("binary", "json")  # each party in its own
                assert client.last_key_format == "v1"  # B does not take v2 keys
            else:
                with pytest.raises(EpochMismatch, match="answered from different epochs: 11 and 1011"):
                    client.fetch_rows([3], batch=True)
    finally:
        proxy.close()
    # retried until the answers agree (the second time), or for as long as the deadline allows
    assert proxy.queries == 2 if retried_ok else proxy.queries >= 3


# --- the binary encoding (docs/PROTOCOL.md section 5.3) -----------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("encoding, used",
                         [("auto", "binary"), ("binary", "binary"), ("json", "json")])
def test_each_encoding_fetches_the_same_rows(parties, expected, encoding, used):
    a, b, _ = parties
    rows = random.Random(8).sample(range(PAGES * 16), 35)  # a full batch of 32, then 3
    with PirClient(a, b, encoding=encoding) as client:
        assert client.last_encodings == (None, None)
        assert client.fetch_rows(rows, batch=True) == [expected.row(r) for r in rows]
        assert client.last_encodings == (used, used)
        assert client.fetch_row(77) == expected.row(77)
        assert client.epoch().encodings == ("json", "binary")


@pytest.mark.processes
@pytest.mark.parametrize("flag, line", [
    ([], "encoding: binary (requested auto), keys: v2 (requested auto)"),
    (["--encoding", "json"], "encoding: json (requested json), keys: v2 (requested auto)"),
    (["--encoding", "binary", "--key-format", "v1"],
     "encoding: binary (requested binary), keys: v1 (requested v1)"),
    (["--key-format", "v2", "--encoding", "json"],
     "encoding: json (requested json), keys: v2 (requested v2)"),
])
def test_cli_says_which_encoding_it_used_with_v(parties, expected, flag, line):
    a, b, _ = parties
    result = subprocess.run(
        [sys.executable, "-m", "morpho_client", "--server-a", a, "--server-b", b,
         "--row", "5", "--batch", "-v", *flag],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"row 5: 0x{expected.row(5).hex()}"]
    assert result.stderr.splitlines() == [line]


# --- key formats (docs/PROTOCOL.md section 3.1) --------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("encoding", ["json", "binary"])
@pytest.mark.parametrize("key_format, used", [("auto", "v2"), ("v2", "v2"), ("v1", "v1")])
def test_each_key_format_fetches_the_same_rows(parties, expected, encoding, key_format, used):
    a, b, _ = parties
    rows = random.Random(9).sample(range(PAGES * 16), 34)  # a full batch of 32, then 2
    with PirClient(a, b, encoding=encoding, key_format=key_format) as client:
        assert client.last_key_format is None
        assert client.fetch_rows(rows, batch=True) == [expected.row(r) for r in rows]
        assert client.last_key_format == used
        assert client.fetch_row(PAGES * 16 - 1) == expected.row(PAGES * 16 - 1)
        assert client.epoch().key_formats == ("v1", "v2")


def test_the_key_format_is_v2_only_where_both_parties_offer_it():
    body = {"epoch_id": 1, "num_rows": 32, "seeds": [1, 2, 3], "block_number": 0,
            "state_root": "0x" + "00" * 32,
            "page_pir": {"domain_bits": 1, "rows_per_page": 16, "num_pages": 2,
                         "page_size_bytes": 4096}}
    old = EpochInfo.from_json(body, "http://x")
    new = EpochInfo.from_json({**body, "key_formats": ["v1", "v2"]}, "http://x")
    assert (old.key_formats, new.key_formats) == (("v1",), ("v1", "v2"))
    with pytest.raises(ServerError, match="key_formats: expected an array of strings"):
        EpochInfo.from_json({**body, "key_formats": "v2"}, "http://x")
    client = AsyncPirClient("http://a", "http://b")
    assert client.key_format_for(new) == "v1"  # nothing advertised yet
    v2_only = EpochInfo.from_json({**body, "key_formats": ["v2"]}, "http://x")  # a server of v2 alone
    for formats, chosen in [((new, new), "v2"), ((new, old), "v1"), ((old, new), "v1"),
                            ((v2_only, new), "v2"), ((v2_only, v2_only), "v2")]:
        client._key_formats = tuple(info.key_formats for info in formats)
        assert client.key_format_for(new) == chosen
    client._key_formats = (v2_only.key_formats, old.key_formats)
    with pytest.raises(ServerError, match=r"no key format in common: A \(http://a\) takes v2 keys; "
                                          r"B \(http://b\) takes v1 keys"):
        client.key_format_for(new)
    for forced in ("v1", "v2"):
        client = AsyncPirClient("http://a", "http://b", key_format=forced)
        client._key_formats = (("v1",), ("v1",))
        assert client.key_format_for(old) == forced
    with pytest.raises(ValueError, match="key_format must be one of auto, v1, v2, got 'v3'"):
        PirClient("http://a", "http://b", key_format="v3")


def test_a_bulk_fetch_is_refused_before_any_job_where_a_party_takes_v2_keys_alone(monkeypatch):
    # bulk jobs take v1 keys: a party that answers v2 keys alone would refuse its half
    # after the other party had started a job, so nothing is posted to either
    body = {"epoch_id": 1, "num_rows": 32, "seeds": [1, 2, 3], "block_number": 0,
            "state_root": "0x" + "00" * 32, "key_formats": ["v1", "v2"],
            "page_pir": {"domain_bits": 1, "rows_per_page": 16, "num_pages": 2, "page_size_bytes": 4096}}
    info = EpochInfo.from_json(body, "http://a")
    with PirClient("http://a", "http://b") as client:
        async def epoch():
            client.core._key_formats = (("v1", "v2"), ("v2",))
            return info

        async def no_job(*args):
            raise AssertionError("a job was posted")

        monkeypatch.setattr(client.core, "settled_epoch", epoch)
        monkeypatch.setattr(client.core, "_bulk_submit", no_job)
        with pytest.raises(ServerError, match="bulk jobs take v1 keys and http://b takes v2 keys only"):
            list(client.iter_rows_bulk([0, 17], tokens=("ta", "tb")))


def test_a_server_that_lists_no_encodings_speaks_json():
    body = {"epoch_id": 1, "num_rows": 32, "seeds": [1, 2, 3], "block_number": 0,
            "state_root": "0x" + "00" * 32,
            "page_pir": {"domain_bits": 1, "rows_per_page": 16, "num_pages": 2,
                         "page_size_bytes": 4096}}
    assert EpochInfo.from_json(body, "http://x").encodings == ("json",)
    binary_only = EpochInfo.from_json({**body, "encodings": ["binary"]}, "http://x")
    assert binary_only.encodings == ("binary",)
    with pytest.raises(ServerError, match="encodings: expected an array of strings"):
        EpochInfo.from_json({**body, "encodings": "binary"}, "http://x")
    with PirClient("http://a", "http://b") as client:
        assert (client.encoding_for(0), client.encoding_for(1)) == ("json", "json")
    with pytest.raises(ValueError, match="encoding must be one of auto, json, binary, got 'hex'"):
        PirClient("http://a", "http://b", encoding="hex")
