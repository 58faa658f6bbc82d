"""Records tables (docs/PROTOCOL.md section 9): the layout and its vectors, the cuckoo build."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from django.core.management import CommandError, call_command

from gpu_engine.matrix import load_epoch
from gpu_engine.records import NoRoom, TableView, build
from morpho_pir.protocol import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE
from morpho_pir.records import Record, RecordsError, RecordsTable
from tests import protocol_vectors as vec
from tests.conftest import REPO

PROTOCOL = (REPO / "docs" / "PROTOCOL.md").read_text()


def random_records(n: int, key_bytes: int = 20, value_bytes: int = 32, seed: int = 1):
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 256, (n, key_bytes), dtype=np.uint8)
    values = rng.integers(0, 256, (n, value_bytes), dtype=np.uint8)
    types = rng.integers(1, 4, n, dtype=np.uint8)
    return keys, values, types


def pages_of(rows: np.ndarray, table: RecordsTable, key: bytes) -> list:
    return [rows[p * ROWS_PER_PAGE:(p + 1) * ROWS_PER_PAGE].tobytes()
            for p in table.candidate_pages(key)]


# -- the layout and its vectors ----------------------------------------------------------------

def test_vectors_follow_from_the_written_rules_and_are_in_the_protocol():
    table = RecordsTable(**vec.RECORDS_PARAMS)
    key, value = bytes.fromhex(vec.RECORDS_KEY_HEX), bytes.fromhex(vec.RECORDS_VALUE_HEX)
    # section 9.1 by hand: SHA-256 of each input, its first 8 bytes little-endian, then ranks
    words = [int.from_bytes(hashlib.sha256(bytes.fromhex(m)).digest()[:8], "little")
             for m in vec.RECORDS_HASH_INPUTS]
    assert words == vec.RECORDS_WORDS
    n = table.num_pages
    p0 = words[0] % n
    p1 = words[1] % (n - 1)
    p1 += p1 >= p0
    p2 = words[2] % (n - 2)
    p2 += p2 >= min(p0, p1)
    p2 += p2 >= max(p0, p1)
    assert (p0, p1, p2) == vec.RECORDS_PAGES == table.candidate_pages(key)
    assert hashlib.sha256(bytes.fromhex(vec.RECORDS_PARAMS_INPUT)).digest()[:16].hex() == \
        vec.RECORDS_FINGERPRINT[2:] == table.fingerprint.hex()
    row = table.encode_row(key, value, vec.RECORDS_TYPE)
    assert row.hex() == vec.RECORDS_ROW_PREFIX + "00" * (ROW_BYTES - 53)
    assert table.decode_row(row) == Record(key, value, vec.RECORDS_TYPE)
    params, small_key, small_pages, small_fingerprint = vec.RECORDS_SMALL
    small = RecordsTable(**params)
    assert small.candidate_pages(small_key) == small_pages
    assert small.fingerprint_hex == small_fingerprint
    for text in (*vec.RECORDS_HASH_INPUTS, *map(str, vec.RECORDS_WORDS), vec.RECORDS_FINGERPRINT,
                 vec.RECORDS_PARAMS_INPUT, vec.RECORDS_ROW_PREFIX, small_fingerprint,
                 str(vec.RECORDS_PAGES)):
        assert text in PROTOCOL.replace("\n", "").replace("` `", ""), text


@pytest.mark.parametrize("num_pages", [3, 4, 5, 1000, 2**32 + 7])
def test_candidate_pages_are_three_distinct_pages_the_same_one_by_one_and_at_once(num_pages):
    table = RecordsTable(seed=9, num_pages=num_pages, key_bytes=8, value_bytes=8)
    keys = [i.to_bytes(8, "little") for i in range(500)]
    many = table.candidate_pages_many(keys)
    assert many.shape == (500, 3)
    for key, row in zip(keys, many.tolist()):
        assert tuple(row) == table.candidate_pages(key)
        assert len(set(row)) == 3 and all(0 <= p < num_pages for p in row)
    if num_pages == 3:  # every order of the three pages shows up
        assert len({tuple(row) for row in many.tolist()}) == 6


def test_find_returns_the_value_once_none_when_absent_and_refuses_twice():
    table = RecordsTable(seed=1, num_pages=10, key_bytes=4, value_bytes=2)
    key = b"kkkk"
    pages = [bytearray(PAGE_BYTES) for _ in range(3)]
    assert table.find(key, [bytes(p) for p in pages]) is None
    other = table.encode_row(b"oooo", b"\x01\x02", 3)
    pages[0][0:ROW_BYTES] = other
    pages[1][5 * ROW_BYTES:6 * ROW_BYTES] = table.encode_row(key, b"\xaa\xbb", 7)
    assert table.find(key, [bytes(p) for p in pages]) == Record(key, b"\xaa\xbb", 7)
    pages[2][15 * ROW_BYTES:] = table.encode_row(key, b"\xcc\xdd", 7)
    with pytest.raises(RecordsError, match="is in 2 rows of its candidate pages"):
        table.find(key, [bytes(p) for p in pages])
    pages[2][15 * ROW_BYTES + 100] = 0  # still the same row
    pages[2][15 * ROW_BYTES] = 0  # type 0 with bytes in it: not this layout
    with pytest.raises(RecordsError, match="empty row .* holds non-zero bytes"):
        table.find(key, [bytes(p) for p in pages])
    with pytest.raises(RecordsError, match="key 0x616263: expected 4 bytes, got 3"):
        table.find(b"abc", [bytes(p) for p in pages])


def test_a_key_given_as_hex_text_or_a_number_is_refused_naming_what_was_given():
    table = RecordsTable(seed=1, num_pages=10, key_bytes=4, value_bytes=2)
    with pytest.raises(TypeError, match=r"key: expected bytes, got the str '0x6b6b6b6b' "
                                        r"\(bytes.fromhex reads hex\)"):
        table.check_key("0x6b6b6b6b")
    with pytest.raises(TypeError, match="key: expected bytes, got the int 4"):
        table.check_key(4)  # bytes(4) would be a key of four zero bytes
    assert table.check_key(bytearray(b"kkkk")) == b"kkkk"
    assert table.check_key(memoryview(b"kkkk")) == b"kkkk"


def test_parameters_come_back_from_their_description_and_a_wrong_fingerprint_is_refused():
    table = RecordsTable(seed=5, num_pages=77, key_bytes=20, value_bytes=72)
    assert RecordsTable.from_description(json.loads(json.dumps(table.describe()))) == table
    wrong = {**table.describe(), "fingerprint": "0x" + "00" * 16}
    with pytest.raises(RecordsError, match="is not the fingerprint of these parameters"):
        RecordsTable.from_description(wrong)
    for bad, message in (({"num_pages": 2}, "expected at least 3"),
                         ({"key_bytes": 200, "value_bytes": 56}, "1 \\+ key_bytes \\+ value_bytes"),
                         ({"seed": "1"}, "records.seed: expected an integer"),
                         ({"version": 2}, "records version 2 is not known")):
        params = {**table.describe(), **bad}
        params.pop("fingerprint")
        with pytest.raises(RecordsError, match=message):
            RecordsTable.from_description(params)


# -- the build -------------------------------------------------------------------------------

def test_the_build_places_every_record_at_a_load_of_at_least_095():
    keys, values, types = random_records(30_000)
    built = build(keys, values, types, seed=3)
    table = built.table
    assert built.load >= 0.95
    assert np.count_nonzero(built.rows[:, 0]) == 30_000  # no record dropped, none twice
    for index in range(0, 30_000, 37):
        key = keys[index].tobytes()
        assert table.find(key, pages_of(built.rows, table, key)) == \
            Record(key, values[index].tobytes(), int(types[index]))
    absent = bytes(20)
    assert table.find(absent, pages_of(built.rows, table, absent)) is None


def test_a_build_that_cannot_place_everything_grows_instead_of_dropping():
    keys, values, types = random_records(3 * ROWS_PER_PAGE + 1, key_bytes=8, value_bytes=1)
    built = build(keys, values, types, seed=1, num_pages=3)
    assert built.table.num_pages == 4 and built.seeds_tried == 4
    assert np.count_nonzero(built.rows[:, 0]) == keys.shape[0]


def test_a_key_given_twice_is_refused_with_both_records_named():
    keys, values, types = random_records(100)
    keys[70] = keys[12]
    with pytest.raises(RecordsError, match=f"key 0x{keys[12].tobytes().hex()} is given twice "
                                           r"\(records 12 and 70\)"):
        build(keys, values, types, seed=1)


def _view(built):
    rows = built.rows.copy()

    def read_page(page):
        return [rows[page * ROWS_PER_PAGE + slot].tobytes() for slot in range(ROWS_PER_PAGE)]

    def apply(written):
        for row, data in written.items():
            rows[row] = np.frombuffer(data, dtype=np.uint8)

    return rows, read_page, apply


def test_changes_write_the_same_rows_from_the_same_state_and_evict_when_pages_are_full():
    keys, values, types = random_records(2000, key_bytes=8, value_bytes=4)
    built = build(keys, values, types, seed=2, load=0.99)
    table = built.table
    rng = np.random.default_rng(5)
    changes = [(rng.bytes(8), rng.bytes(4)) for _ in range(25)]  # 2025 of 2032 rows
    results = []
    for _ in range(2):  # two parties, the same changes in the same order
        rows, read_page, apply = _view(built)
        walked = 0
        for key, value in changes:
            written = TableView(table, read_page).set(key, value, 5)
            walked += len(written) > 1
            apply(written)
        apply(TableView(table, read_page).delete(keys[0].tobytes()))
        results.append(rows)
    assert np.array_equal(*results)
    assert walked, "no change needed an eviction walk at load 0.99"
    rows = results[0]
    for key, value in changes:
        assert table.find(key, pages_of(rows, table, key)) == Record(key, value, 5)
    for index in range(1, 2000):  # every record the walks moved is still found
        key = keys[index].tobytes()
        assert table.find(key, pages_of(rows, table, key)).value == values[index].tobytes()
    assert table.find(keys[0].tobytes(), pages_of(rows, table, keys[0].tobytes())) is None


def test_a_set_with_no_room_is_refused_saying_to_rebuild():
    keys, values, types = random_records(3 * ROWS_PER_PAGE, key_bytes=8, value_bytes=4)
    built = build(keys, values, types, seed=2, num_pages=3)
    rows, read_page, _ = _view(built)
    with pytest.raises(NoRoom, match="rebuild the records epoch"):
        TableView(built.table, read_page).set(b"newkey!!", b"vvvv")
    # an existing key is overwritten in place, full or not
    written = TableView(built.table, read_page).set(keys[3].tobytes(), b"\x00\x01\x02\x03")
    assert len(written) == 1


# -- build_records ---------------------------------------------------------------------------

def test_build_records_reads_csv_and_json_lines_by_the_columns_named(tmp_path):
    keys, values, types = random_records(500, key_bytes=20, value_bytes=72)
    csv_path = tmp_path / "in.csv"
    csv_path.write_text("addr,account,kind\n" + "".join(
        f"0x{k.tobytes().hex()},{v.tobytes().hex()},{t}\n" for k, v, t in zip(keys, values, types)))
    jsonl_path = tmp_path / "in.jsonl"
    jsonl_path.write_text("".join(json.dumps({"addr": k.tobytes().hex(),
                                              "account": v.tobytes().hex(), "kind": int(t)}) + "\n"
                                  for k, v, t in zip(keys, values, types)))
    built = {}
    for source in (csv_path, jsonl_path):
        out = tmp_path / (source.suffix[1:] + ".bin")
        call_command("build_records", "--input", str(source), "--out", str(out), "--seed", "11",
                     "--key-column", "addr", "--value-column", "account", "--type-column", "kind",
                     "--epoch-id", "4")
        built[source.suffix] = out.read_bytes()
        epoch = load_epoch(out)
        table = epoch.records
        assert epoch.epoch_id == 4 and table.seed == 11
        assert table.num_pages == epoch.matrix.num_pages
        assert (table.key_bytes, table.value_bytes) == (20, 72)
        sidecar = json.loads((tmp_path / (out.name + ".epoch.json")).read_text())
        assert sidecar["records"]["fingerprint"] == table.fingerprint_hex
        rows = np.frombuffer(out.read_bytes(), dtype=np.uint8).reshape(-1, ROW_BYTES)
        for index in (0, 250, 499):
            key = keys[index].tobytes()
            assert table.find(key, pages_of(rows, table, key)) == \
                Record(key, values[index].tobytes(), int(types[index]))
    assert built[".csv"] == built[".jsonl"]  # the same records and seed: the same matrix


@pytest.mark.parametrize("content, message", [
    ("key,value\n00ff,0011\n00,0011\n", "line 3, column 'key': expected 2 bytes, got 1"),
    ("key,value\n00ff,0011\nzz00,0011\n", "line 3, column 'key': expected hex digits"),
    ("key,value\n00ff,0011\n00ff,0022\n", "key 0x00ff is given twice"),
    ("k,value\n00ff,0011\n", "line 2: no column 'key' (columns: k, value)"),
])
def test_build_records_names_the_bad_line(tmp_path, content, message):
    source = tmp_path / "in.csv"
    source.write_text(content)
    with pytest.raises(CommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call_command("build_records", "--input", str(source), "--out", str(tmp_path / "m.bin"))
    assert not (tmp_path / "m.bin").exists()


def test_find_many_reads_each_key_as_find_does_and_refuses_what_find_refuses():
    keys, values, types = random_records(3000, seed=8)
    built = build(keys, values, types, seed=8)
    table = built.table
    wanted = [keys[i].tobytes() for i in range(0, 3000, 29)] + [bytes([9, i]) * 10 for i in range(20)]
    pages = np.stack([np.frombuffer(b"".join(pages_of(built.rows, table, key)), np.uint8)
                      .reshape(3, PAGE_BYTES) for key in wanted])
    got = table.find_many(wanted, pages)
    assert got == [table.find(key, pages_of(built.rows, table, key)) for key in wanted]
    assert got[:104] == [Record(keys[i].tobytes(), values[i].tobytes(), int(types[i]))
                         for i in range(0, 3000, 29)] and got[104:] == [None] * 20
    twice = pages.copy()
    row = table.encode_row(wanted[5], b"\x01" * 32, 2)
    empty = next(s for s in range(ROWS_PER_PAGE) if not twice[5, 1, s * ROW_BYTES])
    twice[5, 1, empty * ROW_BYTES:(empty + 1) * ROW_BYTES] = np.frombuffer(row, np.uint8)
    with pytest.raises(RecordsError, match=f"key 0x{wanted[5].hex()} is in 2 rows"):
        table.find_many(wanted, twice)
    dirty = pages.copy()
    key, page, hole = np.argwhere(dirty.reshape(len(wanted), 3, ROWS_PER_PAGE, ROW_BYTES)
                                  [:, :, :, 0] == 0)[-1]
    dirty[key, page, hole * ROW_BYTES + 10] = 1  # a byte of an empty row
    with pytest.raises(RecordsError, match="empty row .* holds non-zero bytes"):
        table.find_many(wanted, dirty)
    with pytest.raises(RecordsError, match="shape"):
        table.find_many(wanted[:3], pages)
