"""`manage.py make_matrix`: a seeded matrix file and its epoch sidecar, served as written."""
from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from gpu_engine.matrix import PAGE_BYTES, load_epoch, random_matrix


def test_make_matrix_writes_pages_and_epoch(tmp_path, capsys):
    out = tmp_path / "sub" / "m.bin"
    call_command("make_matrix", "--pages", "37", "--seed", "9", "--out", str(out),
                 "--epoch-id", "4", "--block-number", "99", "--cuckoo-seeds", "7", "8", "9")
    assert out.stat().st_size == 37 * PAGE_BYTES
    meta = json.loads(out.with_name("m.bin.epoch.json").read_text())
    assert (meta["epoch_id"], meta["block_number"], meta["seeds"]) == (4, 99, [7, 8, 9])
    epoch = load_epoch(out)
    assert (epoch.epoch_id, epoch.block_number, epoch.matrix.num_pages) == (4, 99, 37)
    same_seed = random_matrix(37, seed=9)
    assert all(epoch.matrix.page(i) == same_seed.page(i) for i in range(37))
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--pages", "0"], "--pages: expected at least 1, got 0"),
    (["--pages", "2", "--state-root", "abcd"], "--state-root: expected 32 bytes, got 2"),
    (["--pages", "2", "--state-root", "xyz"], "--state-root: expected 64 hex digits"),
])
def test_make_matrix_rejects_bad_arguments(tmp_path, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("make_matrix", "--out", str(tmp_path / "m.bin"), *args)
    assert not (tmp_path / "m.bin").exists()
