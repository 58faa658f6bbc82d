"""`make run GPU_A= GPU_B=`: each party's processes see only their own GPUs."""
from __future__ import annotations

import pytest

from morphoweb import devserver


def test_each_party_is_pinned_to_its_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    matrix = tmp_path / "m.bin"
    a = devserver.party_env("a", matrix, tmp_path, devserver.check_gpu("GPU_A", "0"))
    b = devserver.party_env("b", matrix, tmp_path, devserver.check_gpu("GPU_B", " 1 "))
    assert (a["CUDA_VISIBLE_DEVICES"], b["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    # unset: the host's own setting, for both
    assert devserver.party_env("a", matrix, tmp_path)["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert devserver.check_gpu("GPU_A", "") is None and devserver.check_gpu("GPU_A", None) is None
    assert devserver.check_gpu("GPU_B", "2, 3") == "2,3"


@pytest.mark.parametrize("value", ["cuda:1", "-1", "0,", "GPU-5f3c"])
def test_a_gpu_that_is_not_an_id_list_is_refused_naming_the_setting(value):
    with pytest.raises(SystemExit, match=f"GPU_B={value!r}: expected GPU ids"):
        devserver.check_gpu("GPU_B", value)


def test_the_command_line_takes_them(monkeypatch):
    monkeypatch.setenv("GPU_A", "x")
    with pytest.raises(SystemExit, match="GPU_A='x'"):
        devserver.main(["--port-a", "1", "--port-b", "2"])
