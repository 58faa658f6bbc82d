"""Every kernel file compiles with nvcc for sm_90, from the exact text and options NVRTC gets."""
import re
import shutil
import subprocess

import pytest

from gpu_engine.backends.cuda_launch import SCAN_GROUP_SIZES
from gpu_engine.backends.cuda_module import KERNEL_DIR, KERNEL_FILES, NVRTC_OPTIONS, kernel_source

NVCC = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin:/usr/local/bin"))
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")


def test_every_cu_file_is_loaded_by_the_backend():
    assert sorted(p.name for p in KERNEL_DIR.glob("*.cu")) == sorted(KERNEL_FILES)


def test_sources_include_no_headers():
    # NVRTC has no C++ standard library: a kernel that includes one compiles with nvcc only
    for name in KERNEL_FILES:
        assert not re.search(r"^\s*#\s*include", kernel_source(name), re.M), name


def _compile(name, tmp_path):
    src = tmp_path / name
    src.write_text(kernel_source(name))
    cmd = [NVCC, "-arch=sm_90", "--cubin", *NVRTC_OPTIONS, "-Xptxas", "-v", "-o", str(tmp_path / "out.cubin"), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return done.stderr + done.stdout


@needs_nvcc
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_compiles_for_sm90(name, tmp_path):
    report = _compile(name, tmp_path)
    assert "error" not in report.lower()


@needs_nvcc
def test_scan_instantiations_match_the_host_and_do_not_spill(tmp_path):
    report = _compile("dpf_scan.cu", tmp_path)
    entries = re.findall(r"Compiling entry function '(\w+)'", report)
    compiled = sorted(int(m) for e in entries for m in re.findall(r"dpf_scanILi(\d+)E", e))
    assert compiled == sorted(SCAN_GROUP_SIZES)
    assert "dpf_expand_top" in entries
    # registers capped by __launch_bounds__ must not push accumulators to local memory
    for block in report.split("Compiling entry function")[1:]:
        name = re.search(r"'(\w+)'", block).group(1)
        spill = re.search(r"(\d+) bytes spill stores", block)
        assert spill is None or spill.group(1) == "0", f"{name} spills: {block}"
