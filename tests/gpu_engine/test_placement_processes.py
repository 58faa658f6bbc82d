"""A party whose engine server owns two (simulated) devices, run as an operator runs it: the
engine server, gunicorn, `load_epoch --placement` from another process, answers over HTTP."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from benchmarks.stack import Party
from morpho_pir.dpf import gen_keys
from gpu_engine.matrix import load_matrix, metadata_path, write_epoch_metadata, write_matrix_file
from tests.conftest import REPO, every_web_process_serves, http_json, server_env

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def party(tmp_path_factory, vector_matrix_path):
    folder = tmp_path_factory.mktemp("d2")
    first = folder / "matrices" / "e1.bin"  # apart from the party's database and sockets
    first.parent.mkdir()
    shutil.copy(vector_matrix_path, first)
    shutil.copy(metadata_path(vector_matrix_path), metadata_path(first))
    second = write_matrix_file(first.parent / "e2.bin", 300, seed=2)
    write_epoch_metadata(second, epoch_id=2)
    made = Party(first, folder, backend="cpu", web_workers=2, threads=4,
                 extra_env=dict(MORPHO_ENGINE_DEVICES="0,1", CUDA_VISIBLE_DEVICES=""))
    yield made, second
    made.stop()


def read_page(url: str, target: int, domain_bits: int) -> tuple:
    """(epoch_id, page) from the two answers to both parties' keys, as a client reads them."""
    pages, epochs = [], set()
    for key in gen_keys(target, domain_bits):
        status, _, body = http_json(url + "/query/page/gpu", {"keys": [key.to_bytes().hex()] * 3})
        assert status == 200, body
        epochs.add(body["epoch_id"])
        pages.append(bytes.fromhex(body["pages"][0][2:]))
    assert len(epochs) == 1
    return epochs.pop(), bytes(a ^ b for a, b in zip(*pages))


def test_the_engine_server_places_epochs_over_its_devices(party):
    made, second = party
    assert "replicate over cpu:0, cpu:1" in made.log("engine")  # its ready line
    status, _, health = http_json(made.url + "/health")
    assert status == 200 and health["placement"]["placement"] == "replicate"
    assert read_page(made.url, 42, 8) == (health["epoch_id"], load_matrix(made.matrix).page(42))

    made.manage("load_epoch", str(second), "--placement", "shard", "--activate")
    # each web worker checks keys against the epoch it follows (300 pages: domain_bits 9, not 8)
    every_web_process_serves(made.url, 2, 9, since=time.monotonic())
    health = http_json(made.url + "/health")[2]
    assert health["epoch_id"] == 2 and health["placement"]["placement"] == "shard"
    assert [(d["device"], d["first_page"], d["stop_page"]) for d in health["placement"]["devices"]] == [
        ("cpu:0", 0, 128), ("cpu:1", 128, 300)]
    pages = load_matrix(second)
    for target in (127, 128, 299):  # each side of the boundary, and the last page
        assert read_page(made.url, target, 9) == (2, pages.page(target))


def test_serve_engine_refuses_a_bad_device_list_in_words(tmp_path):
    done = subprocess.run([sys.executable, "manage.py", "serve_engine", "--url",
                           f"ipc://{tmp_path / 'e.sock'}", "--devices", "0,0"], cwd=REPO,
                          env=server_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--devices: expected distinct device ids >= 0, got '0,0'" in done.stderr
