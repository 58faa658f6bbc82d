"""Every kernel file compiles with nvcc for sm_90, from the exact text and options NVRTC gets."""
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_engine.backends.cuda_launch import SCAN_GROUP_SIZES, SCAN_THREADS, TOP_THREADS
from gpu_engine.backends.cuda_module import (
    KERNEL_DIR,
    KERNEL_FILES,
    KERNEL_NAMES,
    NVRTC_OPTIONS,
    kernel_source,
)

NVCC = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin:/usr/local/bin"))
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
# Threads per block the host launches each kernel with (gpu_engine/backends/cuda.py); a kernel's
# __launch_bounds__ must be exactly this: fewer and the launch fails, more and registers are lost.
LAUNCH_THREADS = {"dpf_expand_top": TOP_THREADS,
                  **{f"dpf_scan<{g}>": SCAN_THREADS for g in SCAN_GROUP_SIZES}}


def test_every_cu_file_is_loaded_by_the_backend():
    assert sorted(p.name for p in KERNEL_DIR.glob("*.cu")) == sorted(KERNEL_FILES)


def test_sources_include_no_headers():
    # NVRTC has no C++ standard library: a kernel that includes one compiles with nvcc only
    for name in KERNEL_FILES:
        assert not re.search(r"^\s*#\s*include", kernel_source(name), re.M), name


@dataclass(frozen=True)
class Compiled:
    report: str  # ptxas -v and the compiler's messages
    ptx: str


def _compile(name, tmp_path):
    src = tmp_path / name
    src.write_text(kernel_source(name))
    cmd = [NVCC, "-arch=sm_90", "--cubin", *NVRTC_OPTIONS, "-Xptxas", "-v", "--keep", "--keep-dir",
           str(tmp_path), "-o", str(tmp_path / "out.cubin"), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return Compiled(done.stderr + done.stdout, (tmp_path / f"{Path(name).stem}.ptx").read_text())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """compiled(name): nvcc's output for kernels/<name>, once per module (dpf_scan.cu takes a while)."""
    done = {}

    def compile_once(name):
        if name not in done:
            done[name] = _compile(name, tmp_path_factory.mktemp(Path(name).stem))
        return done[name]

    return compile_once


def _loader_name(symbol):
    """The name get_kernel takes for a compiled entry: an extern "C" kernel's own, a template
    instantiation's name expression (_Z8dpf_scanILi4EE... is dpf_scan<4>)."""
    mangled = re.match(r"_Z(\d+)", symbol)
    if mangled is None:
        return symbol
    end = mangled.end() + int(mangled.group(1))
    argument = re.match(r"ILi(\d+)EE", symbol[end:])
    assert argument is not None, f"unexpected template in {symbol}"
    return f"{symbol[mangled.end():end]}<{argument.group(1)}>"


@needs_nvcc
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_compiles_for_sm90(name, compiled):
    report = compiled(name).report
    assert "error" not in report.lower()
    # ptxas compiled, for sm_90, exactly the kernels the loader may ask this file for
    entries = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", report)
    assert {arch for _, arch in entries} == {"sm_90"}
    assert sorted(_loader_name(symbol) for symbol, _ in entries) == sorted(KERNEL_NAMES[name])


@needs_nvcc
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_ptx_entry_points_take_the_blocks_the_host_launches(name, compiled):
    ptx = compiled(name).ptx
    assert re.search(r"^\.target sm_90\b", ptx, re.M)
    # .visible .entry SYMBOL(params) then the directives (.maxntid from __launch_bounds__) before {
    entries = {_loader_name(symbol): directives
               for symbol, directives in re.findall(r"\.visible \.entry (\w+)\(.*?\)(.*?)\{", ptx, re.DOTALL)}
    assert sorted(entries) == sorted(KERNEL_NAMES[name])
    for kernel, directives in entries.items():
        bound = re.search(r"\.maxntid (\d+), 1, 1", directives)
        if kernel in LAUNCH_THREADS:
            assert bound is not None and int(bound.group(1)) == LAUNCH_THREADS[kernel], (kernel, directives)


@needs_nvcc
def test_scan_instantiations_match_the_host_and_do_not_spill(compiled):
    report = compiled("dpf_scan.cu").report
    entries = re.findall(r"Compiling entry function '(\w+)'", report)
    compiled_sizes = sorted(int(m) for e in entries for m in re.findall(r"dpf_scanILi(\d+)E", e))
    assert compiled_sizes == sorted(SCAN_GROUP_SIZES)
    assert "dpf_expand_top" in entries
    # registers capped by __launch_bounds__ must not push accumulators to local memory
    for block in report.split("Compiling entry function")[1:]:
        name = re.search(r"'(\w+)'", block).group(1)
        spill = re.search(r"(\d+) bytes spill stores", block)
        assert spill is None or spill.group(1) == "0", f"{name} spills: {block}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_nvrtc_module_has_every_kernel_with_its_launch_bounds(name):
    from gpu_engine.backends.cuda_module import get_kernel

    for kernel in KERNEL_NAMES[name]:
        function = get_kernel(name, kernel)  # NVRTC compiles the file on the first one
        if kernel in LAUNCH_THREADS:
            assert function.max_threads_per_block == LAUNCH_THREADS[kernel], kernel
