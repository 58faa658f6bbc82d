"""Page matrix files, padding, generation, row writes and epoch metadata."""
import numpy as np
import pytest

from gpu_engine.matrix import (
    PAGE_BYTES, ROW_BYTES, domain_bits_for, load_epoch, load_matrix, random_matrix,
    write_epoch_metadata, write_matrix_file,
)


@pytest.mark.parametrize("pages, bits", [(1, 1), (2, 1), (3, 2), (200, 8), (256, 8), (257, 9), (16_817_159, 25)])
def test_domain_bits_is_smallest_cover(pages, bits):
    assert domain_bits_for(pages) == bits


def test_configured_domain_bits_must_cover_the_pages():
    assert domain_bits_for(200, 12) == 12
    with pytest.raises(ValueError, match="too small for 300 pages"):
        domain_bits_for(300, 8)


def test_partial_last_page_is_zero_padded(tmp_path):
    raw = np.random.default_rng(0).integers(1, 256, size=2 * PAGE_BYTES + 100, dtype=np.uint8).tobytes()
    path = tmp_path / "m.bin"
    path.write_bytes(raw)
    matrix = load_matrix(path)
    assert matrix.num_pages == 3
    assert matrix.page(1) == raw[PAGE_BYTES : 2 * PAGE_BYTES]
    assert matrix.page(2) == raw[2 * PAGE_BYTES :] + bytes(PAGE_BYTES - 100)
    assert matrix.block(1, 3).tobytes() == raw[PAGE_BYTES:] + bytes(PAGE_BYTES - 100)


def test_small_file_is_one_padded_page(tmp_path):
    path = tmp_path / "tiny.bin"
    path.write_bytes(b"\x07" * 10)
    matrix = load_matrix(path)
    assert (matrix.num_pages, matrix.domain_bits) == (1, 1)
    assert matrix.page(0) == b"\x07" * 10 + bytes(PAGE_BYTES - 10)


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_matrix(path)


def test_written_file_matches_generated_matrix_and_is_random(tmp_path):
    path = write_matrix_file(tmp_path / "m.bin", 5000, seed=3)
    assert path.stat().st_size == 5000 * PAGE_BYTES
    on_disk, in_memory = load_matrix(path), random_matrix(5000, seed=3)
    for page in (0, 4095, 4096, 4999):
        assert on_disk.page(page) == in_memory.page(page)
    assert on_disk.page(0) != on_disk.page(1)
    assert on_disk.page(4999) != bytes(PAGE_BYTES)


def test_row_writes_stay_private_to_the_process(tmp_path):
    path = write_matrix_file(tmp_path / "m.bin", 4, seed=1)
    before = path.read_bytes()
    matrix = load_matrix(path)
    matrix.write_row(17, b"\xab" * ROW_BYTES)
    assert matrix.row(17) == b"\xab" * ROW_BYTES
    assert matrix.page(1)[ROW_BYTES : 2 * ROW_BYTES] == b"\xab" * ROW_BYTES
    assert path.read_bytes() == before
    with pytest.raises(ValueError, match="row 64 is outside"):
        matrix.write_row(64, b"\x00" * ROW_BYTES)
    with pytest.raises(ValueError, match="expected 256"):
        matrix.write_row(3, b"\x00" * 10)


def test_epoch_metadata_round_trip(tmp_path):
    path = write_matrix_file(tmp_path / "m.bin", 10, seed=2)
    write_epoch_metadata(path, epoch_id=7, block_number=19_000_000, state_root=bytes(range(32)), seeds=(1, 2, 3))
    epoch = load_epoch(path)
    described = epoch.describe()
    assert described["epoch_id"] == 7
    assert described["num_rows"] == 160
    assert described["state_root"] == "0x" + bytes(range(32)).hex()
    assert described["page_pir"] == {"domain_bits": 4, "rows_per_page": 16, "num_pages": 10, "page_size_bytes": 4096}


def test_epoch_without_metadata_defaults(tmp_path):
    path = write_matrix_file(tmp_path / "m.bin", 3, seed=2)
    epoch = load_epoch(path, domain_bits=6)
    assert (epoch.epoch_id, epoch.block_number, epoch.matrix.domain_bits) == (1, 0, 6)
