"""One party over several devices: sharded and replicated epochs, byte-exact against the
protocol's formula, on simulated CPU devices, so CI covers the placement logic without a GPU."""
from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest

from gpu_engine.backends.cpu import NumpyBackend
from morpho_pir.dpf import (KEY_FORMAT_V1, KEY_FORMAT_V2, KeyBatch, eval_pages, gen_keys, random_keys,
                            subtree_keys, subtree_keys_many)
from gpu_engine.engine import Engine, EngineUnavailable
from gpu_engine.matrix import PageMatrix, ServedEpoch, random_matrix
from gpu_engine.placement import (
    GRAIN_PAGES,
    DeviceFailed,
    DeviceGroup,
    Placement,
    check_bounds,
    choose_placement,
    parse_devices,
    shard_bounds,
    subtrees,
)
from morpho_pir.protocol import ROW_BYTES, ROWS_PER_PAGE
from tests.protocol_vectors import protocol_answers


class UploadingBackend(NumpyBackend):
    """A simulated device that holds its own copy of what it loads, as a GPU does, so a row
    written to the wrong device or place shows in the answers."""

    def __init__(self, total_bytes=None) -> None:
        super().__init__(workers=1)
        self.total_bytes = total_bytes
        self.fail = False  # make every later launch raise, as a lost GPU does

    def load(self, matrix, progress=None):
        copy = PageMatrix(matrix.block(0, matrix.num_pages).copy(), domain_bits=matrix.domain_bits)
        resident = super().load(copy, progress)
        answer = resident.answer

        def checked(keys, dispatch=None, **kw):
            if self.fail:
                raise RuntimeError("an illegal memory access was encountered")
            return answer(keys, **({} if dispatch is None else {"dispatch": dispatch}))

        resident.answer = checked
        return resident

    def memory_info(self) -> dict:
        return {"device": "simulated", "used_bytes": 0, "total_bytes": self.total_bytes}


def group(n: int, **kw) -> DeviceGroup:
    return DeviceGroup([UploadingBackend(**kw) for _ in range(n)], [f"cpu:{i}" for i in range(n)])


def client_keys(targets, domain_bits, rng, key_format):
    """Both parties' keys for `targets`, as a client makes them."""
    pairs = [gen_keys(int(t), domain_bits, rng, key_format=key_format) for t in targets]
    return KeyBatch.from_keys([p[0] for p in pairs]), KeyBatch.from_keys([p[1] for p in pairs])


@pytest.mark.parametrize("key_format", [KEY_FORMAT_V1, KEY_FORMAT_V2])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_subtree_keys_evaluate_the_pages_under_their_node(key_format, level):
    rng = np.random.default_rng(level)
    keys = random_keys(4, 10, rng, key_format)
    whole = eval_pages(keys, 1 << 10)
    size = 1 << (10 - level)
    for index in range(1 << level):
        part = eval_pages(subtree_keys(keys, level, index), size)
        assert np.array_equal(part, whole[:, index * size:(index + 1) * size])


@pytest.mark.parametrize("key_format", [KEY_FORMAT_V1, KEY_FORMAT_V2])
def test_subtree_keys_of_several_nodes_at_once_evaluate_their_pages(key_format):
    # what a shard derives for every device in one pass: nodes on shared and separate paths, of
    # several levels, the root among them, in no particular order
    rng = np.random.default_rng(5)
    keys = random_keys(3, 10, rng, key_format)
    whole = eval_pages(keys, 1 << 10)
    nodes = [(2, 1), (1, 1), (3, 0), (0, 0), (3, 3), (2, 1)]
    for (level, index), sub in zip(nodes, subtree_keys_many(keys, nodes), strict=True):
        size = 1 << (10 - level)
        assert sub.domain_bits == 10 - level
        assert np.array_equal(eval_pages(sub, size), whole[:, index * size:(index + 1) * size])
    with pytest.raises(ValueError, match="node 4 is outside"):
        subtree_keys_many(keys, [(1, 0), (2, 4)])


@pytest.mark.parametrize("key_format", [KEY_FORMAT_V1, KEY_FORMAT_V2])
@pytest.mark.parametrize("num_pages, bounds", [
    (1000, [0, 384, 1000]),  # 384 falls mid-subtree (inside [256, 512)); 1000 pages: no power of 2
    (4099, [0, 1280, 2816, 4099]),  # three devices; the last page past 4096 its own subtree
    (2000, [0, 128, 1920, 2000]),  # shards of 128, 1792 and 80 pages
    (5003, None),  # the default, balanced boundaries
])
def test_a_sharded_epoch_answers_byte_for_byte_as_the_protocol_says(key_format, num_pages, bounds):
    rng = np.random.default_rng(num_pages)
    matrix = random_matrix(num_pages, seed=7)
    devices = 2 if bounds is None else len(bounds) - 1
    resident = group(devices).load(matrix, placement=Placement.SHARD, bounds=bounds)
    assert resident.describe()["placement"] == "shard"
    edges = resident.bounds
    # pages on each side of every boundary, the last page, and random ones
    targets = sorted({0, num_pages - 1, *(b - 1 for b in edges[1:-1]), *edges[1:-1],
                      *rng.integers(0, num_pages, 4)})
    party0, party1 = client_keys(targets, matrix.domain_bits, rng, key_format)
    answers0, answers1 = resident.answer(party0), resident.answer(party1)
    assert np.array_equal(answers0, protocol_answers(matrix, party0))
    assert np.array_equal(answers1, protocol_answers(matrix, party1))
    for i, target in enumerate(targets):  # what the client reads: the page it asked for
        assert (answers0[i] ^ answers1[i]).tobytes() == matrix.page(target)
    assert answers0.any() and answers1.any()


def test_every_shard_is_covered_once_by_subtrees_inside_it_and_the_domain():
    # what a shard's launches read: each page of the matrix once, no subtree past the domain or
    # (but at the matrix's end) past its device's range, none deeper than a v2 key's tree
    rng = np.random.default_rng(3)
    page_counts = [*range(1, 700), *(int(n) for n in rng.integers(700, 1 << 22, 60))]
    for num_pages in page_counts:
        own = max(0, (num_pages - 1).bit_length())
        for domain_bits in {max(own, 8), max(own, 8) + 3}:
            for devices in (1, 2, 3, 5, 8):
                try:
                    bounds = shard_bounds(num_pages, domain_bits, devices)
                except ValueError:  # too few pages for so many devices
                    continue
                covered = []
                for first, stop in zip(bounds, bounds[1:]):
                    for tree in subtrees(first, stop, num_pages, domain_bits):
                        size = 1 << (domain_bits - tree.level)
                        assert tree.first == tree.index * size and tree.first >= first
                        assert tree.stop == min(tree.first + size, num_pages)
                        assert tree.stop <= stop and tree.first + size <= 1 << domain_bits
                        assert tree.level == 0 or size >= GRAIN_PAGES
                        assert tree.level <= domain_bits - 7  # a v2 key's tree depth
                        covered.append((tree.first, tree.stop))
                assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # in order, no gap
                assert covered[0][0] == 0 and covered[-1][1] == num_pages, (num_pages, bounds)


def test_default_boundaries_are_balanced_and_need_few_launches():
    # the mainnet shape (68.9 GB) over two GPUs: one half each, at most two subtrees a device, the
    # tail as high in the tree as its start allows (one level of keys to derive on the host, not nine)
    pages = 16_817_159  # the mainnet shape, docs/PERFORMANCE.md
    assert shard_bounds(pages, 25, 2) == [0, 1 << 23, pages]
    trees = subtrees(1 << 23, pages, pages, 25)
    assert [(t.level, t.first, t.stop) for t in trees] == [(2, 1 << 23, 1 << 24), (1, 1 << 24, pages)]
    for devices in (2, 3, 4, 8):
        bounds = shard_bounds(1_000_003, 20, devices)
        sizes = np.diff(bounds)
        assert sizes.max() <= 1.15 * 1_000_003 / devices
        assert all(len(subtrees(a, b, 1_000_003, 20)) <= 2 * (8 * devices).bit_length()
                   for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("pages, domain_bits, devices, bounds", [
    (16_817_159, 28, 2, [0, 1 << 23, 16_817_159]),  # a larger domain_bits splits the pages as before
    (1 << 20, 24, 2, [0, 1 << 19, 1 << 20]),
    (279, 10, 3, [0, 128, 256, 279]),  # the coarse step would leave a device nothing: 128s then
])
def test_default_boundaries_follow_the_pages_not_the_domain(pages, domain_bits, devices, bounds):
    assert shard_bounds(pages, domain_bits, devices) == bounds


@pytest.mark.parametrize("bounds, message", [
    ([0, 100, 1000], "must be multiples of 128 pages"),
    ([0, 512, 512, 1000], "cannot give each of 3 devices a shard"),
    ([0, 512, 999], "must run from 0 to 1000"),
])
def test_bad_boundaries_are_refused_in_words(bounds, message):
    with pytest.raises(ValueError, match=message):
        check_bounds(bounds, 1000)


def test_a_matrix_too_small_to_shard_is_refused_and_auto_replicates_it():
    with pytest.raises(ValueError, match="replicate it instead"):
        group(2).load(random_matrix(100, seed=1), placement=Placement.SHARD)
    resident = group(2).load(random_matrix(100, seed=1), placement=Placement.AUTO)
    assert resident.placement is Placement.REPLICATE


def test_auto_shards_only_where_one_device_cannot_hold_the_matrix_twice():
    matrix_bytes = 1000 * 4096
    tight = [UploadingBackend(total_bytes=matrix_bytes * 3 // 2) for _ in range(2)]
    roomy = [UploadingBackend(total_bytes=matrix_bytes * 3) for _ in range(2)]
    assert choose_placement("auto", matrix_bytes, 1000, 10, tight) is Placement.SHARD
    assert choose_placement("auto", matrix_bytes, 1000, 10, roomy) is Placement.REPLICATE
    assert choose_placement("auto", matrix_bytes, 1000, 10, [NumpyBackend(1)] * 2) is Placement.REPLICATE
    assert choose_placement("shard", matrix_bytes, 1000, 10, roomy) is Placement.SHARD
    with pytest.raises(ValueError):
        choose_placement("striped", matrix_bytes, 1000, 10, roomy)


def test_a_replicated_epoch_spreads_batches_over_its_devices():
    rng = np.random.default_rng(3)
    matrix = random_matrix(700, seed=2)
    resident = group(2).load(matrix, placement=Placement.REPLICATE)
    assert resident.max_in_flight == 4 and len(resident.each_copy()) == 2
    batches = [random_keys(9, matrix.domain_bits, rng) for _ in range(4)]
    started = [resident.start(keys) for keys in batches]  # none collected yet
    assert [d["launches"] for d in resident.devices()] == [2, 2]
    for keys, pending in zip(batches, started):
        assert np.array_equal(pending.result(), protocol_answers(matrix, keys))
    resident.start(batches[0]).result()  # both free again: the first takes it
    assert [d["launches"] for d in resident.devices()] == [3, 2]


@pytest.mark.parametrize("placement", [Placement.SHARD, Placement.REPLICATE])
def test_keys_a_group_cannot_answer_are_refused_and_fail_no_device(placement):
    # a replicated matrix leaves the check to the replica that runs the batch: its refusal is
    # the caller's error, and the group serves on
    rng = np.random.default_rng(4)
    matrix = random_matrix(700, seed=2)
    resident = group(2).load(matrix, placement=placement)
    with pytest.raises(ValueError, match=f"keys have domain_bits 11, matrix has {matrix.domain_bits}"):
        resident.answer(random_keys(3, 11, rng))
    assert resident.failure is None
    keys = random_keys(3, matrix.domain_bits, rng)
    assert np.array_equal(resident.answer(keys), protocol_answers(matrix, keys))


def test_a_group_launches_what_each_of_its_devices_serves_in_one_pass():
    # a shard's batch runs on every device, a replica's on any one: the least of them caps a launch
    narrow = UploadingBackend()
    narrow.pass_queries = 26  # the pages layout on an sm_80 GPU
    devices = DeviceGroup([UploadingBackend(), narrow], ["cpu:0", "cpu:1"])
    assert devices.pass_queries == 26 and devices.describe()["pass_queries"] == 26
    assert group(2).pass_queries == 74
    engine = Engine(devices, ServedEpoch(1, random_matrix(700, seed=2)))
    assert engine.health()["pass_queries"] == 26 and engine.policies()["interactive"].max_batch == 26
    engine.stop()


@pytest.mark.parametrize("placement", [Placement.SHARD, Placement.REPLICATE])
def test_row_writes_land_where_the_page_is(placement):
    rng = np.random.default_rng(5)
    matrix, expected = random_matrix(1000, seed=4), random_matrix(1000, seed=4)
    resident = group(2).load(matrix, placement=placement, bounds=[0, 384, 1000] if placement == "shard" else None)
    rows = {384 * ROWS_PER_PAGE - 1: b"\x11" * ROW_BYTES,  # the last row of device 0's pages
            384 * ROWS_PER_PAGE: b"\x22" * ROW_BYTES,  # the first row of device 1's
            1000 * ROWS_PER_PAGE - 1: b"\x33" * ROW_BYTES, 5: b"\x44" * ROW_BYTES}
    resident.write_rows(rows)
    for row, data in rows.items():
        expected.write_row(row, data)
    party0, party1 = client_keys([383, 384, 999, 0], matrix.domain_bits, rng, KEY_FORMAT_V1)
    for _ in resident.each_copy():  # every replica has the rows (the second batch: the other one)
        assert np.array_equal(resident.answer(party0), protocol_answers(expected, party0))
    got = resident.answer(party0) ^ resident.answer(party1)
    assert got[1].tobytes()[:ROW_BYTES] == b"\x22" * ROW_BYTES
    with pytest.raises(ValueError, match="outside"):
        resident.write_rows({1000 * ROWS_PER_PAGE: b"\x00" * ROW_BYTES})


@pytest.mark.parametrize("placement", [Placement.SHARD, Placement.REPLICATE])
def test_a_failed_device_takes_the_party_to_503_with_its_reason(placement):
    devices = group(2)
    epoch = ServedEpoch(epoch_id=4, matrix=random_matrix(600, seed=3), placement=placement)
    engine = Engine(devices, epoch).start()
    try:
        rng = np.random.default_rng(8)
        keys = random_keys(3, epoch.matrix.domain_bits, rng)
        assert engine.submit_keys(keys, (3,)).result(10).epoch_id == 4
        assert engine.health()["running"] is True
        devices.devices[0].fail = True  # the device an idle replicated group launches on first
        outcomes = []
        for _ in range(3):
            try:
                engine.submit_keys(keys, (3,)).result(10)
                outcomes.append("answered")
            except EngineUnavailable as exc:
                outcomes.append(str(exc))
        assert "device cpu:0 failed" in outcomes[0], outcomes
        # once failed, nothing more is answered: no answer from half the devices, ever
        assert outcomes[-1] != "answered"
        health = engine.health()
        assert health["running"] is False and "device cpu:0 failed" in health["failure"]
        assert health["placement"]["failure"] == health["failure"]
        # the engine stopped: an engine server exits so that its supervisor starts it again
        assert engine.running is False
    finally:
        engine.stop()


def test_epoch_switches_between_placements_stay_atomic_under_load():
    """Queries run while the engine switches shard -> replicate -> shard over three epochs: every
    answer is right for the epoch it names."""
    epochs = {1: ServedEpoch(1, random_matrix(900, seed=11), placement="shard"),
              2: ServedEpoch(2, random_matrix(900, seed=12), placement="replicate"),
              3: ServedEpoch(3, random_matrix(900, seed=13), placement="shard")}
    engine = Engine(group(2), epochs[1]).start()
    stop, wrong, seen, errors = threading.Event(), [], set(), []

    def ask(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            keys = random_keys(6, 10, rng)
            try:
                answer = engine.submit_keys(keys, (3, 3)).result(30)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))
                return
            seen.add(answer.epoch_id)
            if not np.array_equal(answer.answers, protocol_answers(epochs[answer.epoch_id].matrix, keys)):
                wrong.append(answer.epoch_id)

    threads = [threading.Thread(target=ask, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        for epoch_id in (2, 3):
            engine.switch_epoch(epochs[epoch_id]).result(30)
            assert engine.health()["placement"]["placement"] == epochs[epoch_id].placement
        deadline = time.monotonic() + 20
        while 3 not in seen and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        stop.set()
        engine.stop()
    assert not errors and not wrong
    assert 3 in seen


def test_device_ids_are_parsed_or_refused_in_words():
    assert parse_devices("0,1, 3") == [0, 1, 3]
    assert parse_devices("") == []
    with pytest.raises(ValueError, match="separated by commas"):
        parse_devices("0;1")
    with pytest.raises(ValueError, match="distinct device ids"):
        parse_devices("1,1")


def test_a_group_says_which_device_failed_before_anything_is_answered():
    resident = group(2).load(random_matrix(300, seed=1), placement=Placement.SHARD)
    resident.failure = "device cpu:0 failed: lost"
    with pytest.raises(DeviceFailed, match="cpu:0"):
        resident.answer(random_keys(3, 9, np.random.default_rng(1)))



# --- a party whose engine owns two (simulated) devices, as an operator runs it -------------------


@pytest.fixture
def two_device_party(db, serve_matrix, tmp_path):
    """Epoch 1 (300 pages) served over devices 0 and 1; epoch 2 (1000 pages) written beside it."""
    from gpu_engine.matrix import write_epoch_metadata, write_matrix_file

    paths = {}
    for epoch_id, pages in ((1, 300), (2, 1000)):
        paths[epoch_id] = write_matrix_file(tmp_path / f"e{epoch_id}.bin", pages, seed=epoch_id)
        write_epoch_metadata(paths[epoch_id], epoch_id=epoch_id)
    serve_matrix(paths[1], MORPHO_ENGINE_DEVICES="0,1")
    return paths


def ask_page(client, target: int, domain_bits: int) -> tuple:
    """(epoch_id, page) a client reads for `target` from one party asked twice, once per key."""

    rng = np.random.default_rng(target)
    pair = gen_keys(target, domain_bits, rng)
    answers, epoch_ids = [], set()
    for key in pair:
        body = {"keys": [key.to_bytes().hex()] * 3}
        response = client.post("/query/page/gpu", body, format="json")
        assert response.status_code == 200, response.content
        epoch_ids.add(response.json()["epoch_id"])
        answers.append(bytes.fromhex(response.json()["pages"][0][2:]))
    assert len(epoch_ids) == 1
    return epoch_ids.pop(), bytes(x ^ y for x, y in zip(*answers))


def test_health_shows_the_placement_and_load_epoch_chooses_it(two_device_party):
    from django.core.management import call_command
    from rest_framework.test import APIClient

    from gpu_engine.matrix import load_matrix

    client = APIClient()
    health = client.get("/health").json()
    assert health["status"] == "ok"
    # the CPU does not say its memory: auto replicates
    assert health["placement"]["placement"] == "replicate"
    assert [d["device"] for d in health["placement"]["devices"]] == ["cpu:0", "cpu:1"]
    first = load_matrix(two_device_party[1])
    assert ask_page(client, 299, 9) == (1, first.page(299))

    call_command("load_epoch", str(two_device_party[2]), "--placement", "shard", "--activate")
    health = client.get("/health").json()
    assert health["epoch_id"] == 2 and health["placement"]["placement"] == "shard"
    assert [(d["first_page"], d["stop_page"]) for d in health["placement"]["devices"]] == [
        (0, 512), (512, 1000)]
    second = load_matrix(two_device_party[2])
    for target in (511, 512, 999):  # both sides of the boundary, and the last page
        assert ask_page(client, target, 10) == (2, second.page(target))


def test_the_api_activates_an_epoch_with_a_placement(two_device_party):
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    from epochs.models import Epoch

    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("root", password="pw-root"))
    created = client.post("/api/epochs/", {"epoch_id": 2, "matrix_path": str(two_device_party[2])},
                          format="json")
    assert created.status_code == 201, created.content
    assert created.json()["placement"] == "auto"
    refused = client.post(f"/api/epochs/{created.json()['id']}/activate/", {"placement": "striped"},
                          format="json")
    assert refused.status_code == 400
    assert refused.json()["detail"] == 'placement: expected one of auto, shard, replicate, got "striped"'
    switched = client.post(f"/api/epochs/{created.json()['id']}/activate/", {"placement": "shard"},
                           format="json")
    assert switched.status_code == 200, switched.content
    assert switched.json()["placement"] == "shard" and switched.json()["state"] == "active"
    assert Epoch.objects.get(epoch_id=2).placement == "shard"
    assert client.get("/health").json()["placement"]["placement"] == "shard"


def test_a_bad_device_list_stops_the_process_with_the_setting_named():
    from tests.morphoweb.test_settings import check

    result = check(MORPHO_ENGINE_DEVICES="0,zero")
    assert result.returncode != 0
    assert "MORPHO_ENGINE_DEVICES: expected device ids separated by commas, e.g. 0,1, got '0,zero'" in result.stderr


def test_metrics_carry_each_device_by_label(two_device_party):
    from rest_framework.test import APIClient

    client = APIClient()
    ask_page(client, 7, 9)
    text = client.get("/metrics").content.decode()
    launches = {line.split("{")[1].split('"')[1]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("gpu_device_launches_total{")}
    assert set(launches) == {"cpu:0", "cpu:1"} and sum(launches.values()) >= 2
    assert 'gpu_device_resident_bytes{device="cpu:1",placement="replicate"} 1.2288e+06' in text
    assert 'gpu_device_busy_seconds_total{device="cpu:0",placement="replicate"}' in text


def test_the_dashboard_lists_each_device(two_device_party, client):
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    ask_page(APIClient(), 7, 9)
    client.force_login(User.objects.create_superuser("ops", password="pw-ops"))
    devices = client.get("/dashboard/data").json()["devices"]
    assert [(d["device"], d["placement"], d["resident"]) for d in devices] == [
        ("cpu:0", "replicate", 300 * 4096), ("cpu:1", "replicate", 300 * 4096)]
    assert sum(d["launches"] for d in devices) >= 2


def wait_for_health(client, check, seconds: float = 15.0) -> dict:
    """/health's body once `check(body)` holds, the watcher looking at the database between
    reads (here, in the test's thread: its own thread cannot see the test's transaction); the
    last body seen otherwise."""
    from engine.watcher import default_watcher

    deadline = time.monotonic() + seconds
    while True:
        default_watcher().check_all()
        body = client.get("/health").json()
        if check(body) or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def test_an_active_epoch_the_devices_cannot_hold_is_refused_not_replaced(two_device_party, tmp_path):
    """load_epoch, run without an engine, makes epoch 3 (100 pages, shard) active; the engine,
    started again, cannot shard it over two devices, so it answers nothing (503 with why), not
    epoch 1's pages. Changing the placement in the admin brings it back."""
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from rest_framework.test import APIClient

    from engine.holder import get_engine, shutdown_engine
    from epochs.models import Epoch, EpochState
    from gpu_engine.matrix import write_epoch_metadata, write_matrix_file

    client = APIClient()
    assert client.get("/health").json()["epoch_id"] == 1
    tiny = write_matrix_file(two_device_party[1].parent / "e3.bin", 100, seed=3)
    write_epoch_metadata(tiny, epoch_id=3)
    shutdown_engine()  # as load_epoch runs: a process with no engine, which cannot check
    said = io.StringIO()
    call_command("load_epoch", str(tiny), "--placement", "shard", "--activate", stderr=said)
    assert "nothing checked that this party's engines can serve it" in said.getvalue()
    record = Epoch.objects.get(epoch_id=3)
    assert record.state == EpochState.ACTIVE

    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "held"
    assert "epoch 3 is this party's active epoch, but this engine cannot serve it (100 pages " \
           "cannot give each of 2 devices a shard" in health.json()["failure"]
    pair = gen_keys(5, get_engine().epoch.matrix.domain_bits)
    refused = client.post("/query/page/gpu", {"keys": [pair[0].to_bytes().hex()] * 3}, format="json")
    assert refused.status_code == 503 and "epoch 3 is this party's active epoch" in refused.json()["detail"]
    assert refused["Retry-After"]
    # keys made for epoch 3 (domain_bits 7) are not judged by epoch 1's domain: 503, not 400
    pair = gen_keys(5, 7)
    refused = client.post("/query/page/gpu", {"keys": [pair[0].to_bytes().hex()] * 3}, format="json")
    assert refused.status_code == 503
    assert client.get("/epoch").status_code == 503  # nor is epoch 1 advertised as this party's

    admin = APIClient()
    admin.force_login(User.objects.create_superuser("ops", password="pw-ops"))
    changed = admin.post(f"/admin/epochs/epoch/{record.pk}/change/", {
        "switch_mode": "beside", "pending_updates": "absorb", "placement": "replicate"})
    assert changed.status_code == 302, changed.content.decode()[:2000]
    health = wait_for_health(client, lambda body: body["status"] == "ok")
    assert health["epoch_id"] == 3 and health["placement"]["placement"] == "replicate"
    assert ask_page(client, 99, 7) == (3, load_matrix_pages(tiny).page(99))


def test_the_admin_re_places_the_active_epoch_within_seconds(two_device_party):
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    from epochs.models import Epoch

    client = APIClient()
    assert client.get("/health").json()["placement"]["placement"] == "replicate"
    record = Epoch.objects.get(epoch_id=1)  # recorded active when the engine started
    admin = APIClient()
    admin.force_login(User.objects.create_superuser("ops", password="pw-ops"))
    changed = admin.post(f"/admin/epochs/epoch/{record.pk}/change/", {
        "switch_mode": "beside", "pending_updates": "absorb", "placement": "shard"})
    assert changed.status_code == 302, changed.content.decode()[:2000]
    health = wait_for_health(client, lambda body: body["placement"]["placement"] == "shard")
    assert health["status"] == "ok" and health["epoch_id"] == 1
    assert [(d["first_page"], d["stop_page"]) for d in health["placement"]["devices"]] == [(0, 128), (128, 300)]
    assert ask_page(client, 128, 9) == (1, load_matrix_pages(two_device_party[1]).page(128))


def load_matrix_pages(path):
    from gpu_engine.matrix import load_matrix

    return load_matrix(path)


class ShapeLimitedBackend(NumpyBackend):
    """A simulated device that, like a CUDA one, holds two sets of buffers per batch shape (keys,
    key format): a third batch of one shape started before one is collected is refused."""

    def __init__(self) -> None:
        super().__init__(workers=1)

    def load(self, matrix, progress=None):
        from gpu_engine.backends.base import PendingAnswer

        resident = super().load(matrix, progress)
        answer, running, lock = resident.answer, {}, threading.Lock()

        class Started(PendingAnswer):
            def __init__(self, shape, answers):
                super().__init__(answers)
                self.shape, self.collected = shape, False

            def result(self):
                with lock:
                    if not self.collected:
                        self.collected = True
                        running[self.shape] -= 1
                return self._answers

        def start(keys, dispatch=None):
            shape = (len(keys), keys.key_format)
            with lock:
                if running.get(shape, 0) >= 2:
                    raise RuntimeError(f"two batches of {len(keys)} keys are running already")
                running[shape] = running.get(shape, 0) + 1
            return Started(shape, answer(keys))

        resident.start = start
        return resident


def test_batches_of_both_key_formats_keep_to_each_replicas_buffers():
    """Full batches mixing v1 and v2 keys, four in flight over two replicas: each batch's two
    launches go to one device, so no device is asked for a third batch of one shape."""
    from gpu_engine.scheduler import LanePolicy

    matrix = random_matrix(500, seed=9)
    policy = LanePolicy(max_batch=8)
    engine = Engine(DeviceGroup([ShapeLimitedBackend(), ShapeLimitedBackend()], ["cpu:0", "cpu:1"]),
                    ServedEpoch(1, matrix, placement="replicate"), lambda lane: policy).start()
    rng = np.random.default_rng(6)
    try:
        submitted = []
        for i in range(24):  # 4 queries of each format a request: two requests fill a batch
            fmt = KEY_FORMAT_V1 if i % 2 else KEY_FORMAT_V2
            keys = random_keys(12, matrix.domain_bits, rng, fmt)
            submitted.append((keys, engine.submit_keys(keys, (3,) * 4)))
        for keys, future in submitted:
            assert np.array_equal(future.result(30).answers, protocol_answers(matrix, keys))
        assert engine.health()["running"] is True
    finally:
        engine.stop()


def test_a_device_that_fails_to_free_the_old_epoch_does_not_undo_the_switch():
    class StuckFree(UploadingBackend):
        def load(self, matrix, progress=None):
            resident = super().load(matrix, progress)

            def release():
                raise RuntimeError("an illegal memory access was encountered")

            resident.release = release
            return resident

    devices = DeviceGroup([StuckFree(), UploadingBackend()], ["cpu:0", "cpu:1"])
    first, second = random_matrix(400, seed=1), random_matrix(400, seed=2)
    engine = Engine(devices, ServedEpoch(1, first, placement="shard")).start()
    try:
        engine.switch_epoch(ServedEpoch(2, second, placement="shard")).result(10)
        keys = random_keys(3, second.domain_bits, np.random.default_rng(2))
        answer = engine.submit_keys(keys, (3,)).result(10)
        assert answer.epoch_id == 2 and np.array_equal(answer.answers, protocol_answers(second, keys))
    finally:
        engine.stop()  # the stuck device again: logged, not raised


# --- the hold: an engine that cannot serve the party's active epoch answers none --------------


def epoch_file(folder, epoch_id: int, pages: int):
    from gpu_engine.matrix import write_epoch_metadata, write_matrix_file

    path = write_matrix_file(folder / f"h{epoch_id}.bin", pages, seed=epoch_id)
    write_epoch_metadata(path, epoch_id=epoch_id)
    return path


def check_watches() -> None:
    from engine.watcher import default_watcher

    default_watcher().check_all()


def test_a_held_engine_tries_again_by_itself_once_the_cause_is_gone(db, serve_matrix, tmp_path, monkeypatch):
    """Epoch 2's file is away when the engine starts (an rsync in progress): it is held; once
    the file is back, the watcher tries again after FAILED_SWITCH_BACKOFF though nothing in the
    database changed, and the engine serves epoch 2."""
    import os

    from django.core.management import call_command

    from engine.holder import get_engine, shutdown_engine
    from epochs import sync

    first, second = epoch_file(tmp_path, 1, 100), epoch_file(tmp_path, 2, 100)
    serve_matrix(first)
    get_engine()
    shutdown_engine()
    call_command("load_epoch", str(second), "--activate", stderr=io.StringIO())
    os.rename(second, str(second) + ".away")
    monkeypatch.setattr(sync, "FAILED_SWITCH_BACKOFF", 0.3)
    engine = get_engine()
    check_watches()
    assert engine.held and "epoch 2 is this party's active epoch" in engine.held
    os.rename(str(second) + ".away", second)
    deadline = time.monotonic() + 10
    while engine.held and time.monotonic() < deadline:
        time.sleep(0.1)
        check_watches()
    assert engine.held is None and engine.epoch.epoch_id == 2


def test_row_updates_land_while_a_placement_the_devices_cannot_make_waits(db, serve_matrix, tmp_path):
    from rest_framework.test import APIClient

    from engine.holder import get_engine
    from epochs import sync
    from epochs.models import Epoch

    path = epoch_file(tmp_path, 4, 100)
    serve_matrix(path, MORPHO_ENGINE_DEVICES="0,1")
    engine = get_engine()
    Epoch.objects.filter(epoch_id=4).update(placement="shard")  # 100 pages: it cannot be made
    check_watches()
    assert engine.held is None and engine.placement == "replicate"
    assert "cannot give each of 2 devices a shard" in Epoch.objects.get(epoch_id=4).message
    row = bytes([7]) * ROW_BYTES
    sync.push_rows([(5 * ROWS_PER_PAGE, row)])  # acknowledged: the next answer has it
    epoch_id, page = ask_page(APIClient(), 5, 7)
    assert epoch_id == 4 and page[:ROW_BYTES] == row


def test_the_hold_lifts_when_the_active_epoch_is_the_one_served(db, serve_matrix, tmp_path):
    from django.core.management import call_command
    from django.utils import timezone

    from engine.holder import get_engine, shutdown_engine
    from epochs.models import Epoch, EpochState

    fourth, fifth = epoch_file(tmp_path, 4, 100), epoch_file(tmp_path, 5, 100)
    serve_matrix(fourth, MORPHO_ENGINE_DEVICES="0,1")
    get_engine()
    shutdown_engine()
    call_command("load_epoch", str(fifth), "--placement", "shard", "--activate", stderr=io.StringIO())
    engine = get_engine()
    assert engine.held and "epoch 5" in engine.held
    # made active again elsewhere, with a placement its devices cannot make either
    Epoch.objects.filter(epoch_id=5).update(state=EpochState.RETIRED)
    Epoch.objects.filter(epoch_id=4).update(state=EpochState.ACTIVE, placement="shard",
                                            activated=timezone.now())
    check_watches()
    assert engine.epoch.epoch_id == 4 and engine.held is None  # right epoch: answers again


def test_load_epoch_that_an_engine_refuses_records_nothing(two_device_party, tmp_path):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    from engine.holder import get_engine
    from epochs.models import Epoch

    get_engine()  # this process serves: load_epoch switches it first, as an engine server would
    tiny = epoch_file(two_device_party[1].parent, 3, 100)
    with pytest.raises(CommandError, match="epoch 3 was neither activated nor recorded: 100 pages "
                                           "cannot give each of 2 devices a shard"):
        call_command("load_epoch", str(tiny), "--placement", "shard", "--activate")
    assert not Epoch.objects.filter(epoch_id=3).exists()
    said = io.StringIO()
    call_command("load_epoch", str(tiny), "--placement", "replicate", "--activate", stdout=said)
    assert "epoch 3 is active" in said.getvalue()
    assert Epoch.objects.get(epoch_id=3).state == "active"


def test_make_run_waits_for_a_held_party_as_for_a_healthy_one():
    """`make run` starts a party whose active epoch cannot be served and says why, rather than
    wait ten minutes for a 200 and stop both parties."""
    import http.server
    import json

    from morphoweb.partyprocs import NotHealthy, wait_healthy

    class Held(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "held", "failure": "epoch 3 ..."}).encode()
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Held)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert wait_healthy(url, {}, timeout=5, interval=0.05, held_is_up=True) < 5
        with pytest.raises(NotHealthy, match="not healthy after"):
            wait_healthy(url, {}, timeout=0.3, interval=0.05)
    finally:
        server.shutdown()
