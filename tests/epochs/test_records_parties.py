"""Two real parties take the same record changes in the same order: one state digest, and a
private lookup (one query of three pages to each) reads every change back."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from gpu_engine.matrix import write_epoch_metadata
from gpu_engine.records import build
from morpho_pir.dpf import gen_keys
from morpho_pir.records import RecordsTable
from tests.conftest import REPO, http_json, server_env
from tests.morpho_pir.test_records import random_records

TOKEN = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def parties(start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("records-parties")
    keys, values, types = random_records(3000, key_bytes=20, value_bytes=40, seed=8)
    built = build(keys, values, types, seed=8, load=0.99)  # full pages: sets walk
    matrix = folder / "records.bin"
    built.rows.tofile(matrix)
    write_epoch_metadata(matrix, epoch_id=12, records=built.table)
    envs = [server_env(MORPHO_MATRIX_PATH=matrix, MORPHO_ENGINE_BACKEND="cpu",
                       DATABASE_URL=f"sqlite:///{folder / name}.sqlite3") for name in "ab"]
    make_operator = ("from django.contrib.auth.models import User; "
                     "from rest_framework.authtoken.models import Token; "
                     "user = User.objects.create_superuser('op', password='pw-op'); "
                     f"Token.objects.create(user=user, key='{TOKEN}')")
    for env in envs:
        for argv in (["migrate", "--no-input", "-v0"], ["shell", "-v0", "-c", make_operator]):
            subprocess.run([sys.executable, "manage.py", *argv], cwd=REPO, env=env, check=True,
                           timeout=300)
    urls = [start_server("runserver", env).url for env in envs]
    return urls, built.table, keys, values


def change(url: str, body: dict) -> tuple:
    request = urllib.request.Request(url + "/api/records/", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Token {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def state(url: str, updates: int) -> dict:
    deadline = time.monotonic() + 30
    while True:
        served = http_json(url + "/epoch")[2]["state"]
        if served["updates"] == updates or time.monotonic() > deadline:
            return served
        time.sleep(0.1)


def lookup(urls, table: RecordsTable, key: bytes):
    pages = table.candidate_pages(key)
    domain_bits = max(1, (table.num_pages - 1).bit_length())
    pairs = [gen_keys(page, domain_bits, rng=np.random.default_rng()) for page in pages]
    answers = []
    for party, url in enumerate(urls):
        request = urllib.request.Request(
            url + "/query/page/gpu",
            data=json.dumps({"keys": [pair[party].to_bytes().hex() for pair in pairs]}).encode(),
            headers={"Content-Type": "application/json",
                     "X-Morpho-Records-Fingerprint": table.fingerprint_hex})
        with urllib.request.urlopen(request, timeout=60) as response:
            answers.append((response.headers["X-Morpho-State-Digest"],
                            [bytes.fromhex(p[2:]) for p in json.loads(response.read())["pages"]]))
    assert answers[0][0] == answers[1][0], "the two parties answered from different states"
    return table.find(key, [bytes(a ^ b for a, b in zip(x, y))
                            for x, y in zip(answers[0][1], answers[1][1])])


def test_the_same_changes_in_the_same_order_give_one_state_and_lookups_read_them(parties):
    urls, table, keys, values = parties
    rng = np.random.default_rng(3)
    new = {rng.bytes(20): rng.bytes(40) for _ in range(30)}  # ~2% more records: walks
    bodies = [{"key": key.hex(), "value": value.hex()} for key, value in new.items()]
    bodies += [{"op": "delete", "key": keys[0].tobytes().hex()},
               {"key": keys[1].tobytes().hex(), "value": "ee" * 40, "record_type": 4}]
    written = []
    for url in urls:
        rows = []
        for body in bodies:
            status, answer = change(url, body)
            assert status == 201, answer
            rows.append(answer["rows"])
        written.append(rows)
    assert written[0] == written[1]  # the same rows, change by change
    assert any(len(rows) > 1 for rows in written[0]), "no set needed an eviction walk"
    count = len({row for rows in written[0] for row in rows})
    assert state(urls[0], count) == state(urls[1], count)
    assert state(urls[0], count)["updates"] == count
    for key, value in list(new.items())[:10]:
        assert lookup(urls, table, key).value == value
    assert lookup(urls, table, keys[0].tobytes()) is None
    found = lookup(urls, table, keys[1].tobytes())
    assert (found.value, found.type) == (b"\xee" * 40, 4)
    for index in (2, 1500, 2999):
        assert lookup(urls, table, keys[index].tobytes()).value == values[index].tobytes()
    assert lookup(urls, table, b"\x42" * 20) is None
