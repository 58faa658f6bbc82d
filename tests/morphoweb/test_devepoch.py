"""`make epoch MATRIX=FILE`: what it says before it touches either party."""
from __future__ import annotations

from morphoweb import devepoch


def test_a_matrix_file_that_is_not_there_is_named_before_anything_else(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setenv("MORPHO_VAR_DIR", str(tmp_path))  # no party databases either
    assert devepoch.main([str(tmp_path / "matrices" / "epoch7.bin")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'matrices' / 'epoch7.bin'}: no such file; make one first" in err
    assert "no epoch id" not in err and "no database" not in err


def test_without_an_epoch_id_the_file_is_refused_saying_how_to_give_one(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.setenv("MORPHO_VAR_DIR", str(tmp_path))
    for party in ("a", "b"):
        (tmp_path / f"party-{party}.sqlite3").touch()
    matrix = tmp_path / "matrices" / "epoch7.bin"
    matrix.parent.mkdir()
    matrix.write_bytes(bytes(4096 * 4))
    assert devepoch.main([str(matrix)]) == 2
    assert "no epoch id. Both parties must serve the same one: give it with EPOCH_ID=N" in (
        capsys.readouterr().err)
