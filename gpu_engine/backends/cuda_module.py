"""Loads the kernels in gpu_engine/kernels/*.cu once per process (CuPy RawModule over NVRTC)."""
from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Dict, Iterable, Tuple

import numpy as np

from gpu_engine.backends.cuda_plan import (
    MMA_TILE_COUNTS,
    SCAN_GROUP_SIZES,
    V1_FRAG_GROUP_KEYS,
    WGMMA_CAPABILITY,
    WGMMA_TILE_COUNTS,
    define_options,
)

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
# NVRTC and the CI nvcc check compile with the same options, so CI tests the text NVRTC gets;
# the constants the kernels share with the host come from cuda_plan, as -D options.
NVRTC_OPTIONS: Tuple[str, ...] = ("--std=c++17",) + define_options()
_VARIANT_DEFINES: Tuple[str, ...] = ()


def add_defines(defines: Iterable[str]) -> None:
    """Each NAME=VALUE a -D option of every kernel built after, in place of the host's value of
    that name if it has one: a variant to time."""
    global NVRTC_OPTIONS, _VARIANT_DEFINES
    variant = _VARIANT_DEFINES + tuple(defines)
    NVRTC_OPTIONS = ("--std=c++17",) + define_options(variant)  # raises on a bad one, changing nothing
    _VARIANT_DEFINES = variant


# The kernels of each file, by the names get_kernel() takes (a template instantiation by its name
# expression, which NVRTC must be told to keep); the CI nvcc check holds each file to its list.
KERNEL_NAMES: Dict[str, Tuple[str, ...]] = {
    "dpf_scan.cu": ("dpf_expand_top", *(f"dpf_scan<{g}>" for g in SCAN_GROUP_SIZES),
                    *(f"dpf_scan_bits<{g}>" for g in SCAN_GROUP_SIZES), "dpf_leaf_bits",
                    f"dpf_scan_v1_frag<{V1_FRAG_GROUP_KEYS}>", f"dpf_scan_v1_pair<{V1_FRAG_GROUP_KEYS}>"),
    "dpf_scan_mma.cu": (*(f"dpf_scan_mma<{t}>" for t in MMA_TILE_COUNTS),
                        *(f"dpf_scan_mma_frag<{t}>" for t in MMA_TILE_COUNTS),
                        *(f"dpf_scan_wgmma_frag<{t}>" for t in WGMMA_TILE_COUNTS),
                        "pages_to_fragments", "fragments_to_pages"),
    "matrix_fill.cu": ("fill_pages",),
}
KERNEL_FILES = tuple(KERNEL_NAMES)
# Text that goes in front of a kernel file (NVRTC has no include path of ours): helpers two files share
KERNEL_PRELUDES: Dict[str, Tuple[str, ...]] = {
    "dpf_scan.cu": ("bit_products.cuh",),
    "dpf_scan_mma.cu": ("bit_products.cuh",),
}
_NAME_EXPRESSIONS: Dict[str, Tuple[str, ...]] = {
    name: tuple(kernel for kernel in kernels if "<" in kernel) for name, kernels in KERNEL_NAMES.items()
}
_lock = threading.Lock()


def kernel_source(name: str) -> str:
    """The exact text handed to NVRTC for kernels/<name>: its preludes, then the file (from a
    #line directive, so the compiler's messages name the file's own lines)."""
    if name not in KERNEL_FILES:
        raise ValueError(f"unknown kernel file {name!r}, expected one of {KERNEL_FILES}")
    preludes = "".join((KERNEL_DIR / part).read_text() for part in KERNEL_PRELUDES.get(name, ()))
    return preludes + (f'#line 1 "{name}"\n' if preludes else "") + (KERNEL_DIR / name).read_text()


def arch_options(compute_capability: Tuple[int, int]) -> Tuple[str, ...]:
    """NVRTC's target for a GPU: sm_90a on sm_90 (the wgmma scan's instructions exist only
    there), else CuPy's choice for the device."""
    return ("-arch=sm_90a",) if tuple(compute_capability) == WGMMA_CAPABILITY else ()


@functools.lru_cache(maxsize=None)
def _module(name: str, compute_capability: Tuple[int, int]):
    import cupy

    return cupy.RawModule(
        code=kernel_source(name), options=NVRTC_OPTIONS + arch_options(compute_capability),
        name_expressions=_NAME_EXPRESSIONS[name] or None
    )


def get_kernel(file_name: str, kernel_name: str):
    """A RawKernel of kernels/<file_name> for the current device's architecture, compiled on
    first use and cached for the process."""
    import cupy

    if kernel_name not in KERNEL_NAMES.get(file_name, ()):
        raise ValueError(f"kernels/{file_name} has no kernel {kernel_name!r} in KERNEL_NAMES")
    cc = cupy.cuda.Device().compute_capability  # "90"
    with _lock:  # one compile per file even when two threads start at once
        module = _module(file_name, (int(cc[:-1]), int(cc[-1])))
        return _kernel(module, kernel_name)


@functools.lru_cache(maxsize=None)
def _kernel(module, kernel_name: str):
    return module.get_function(kernel_name)


def scan_kernel(plan):
    """The scan of a cuda_plan.ScanPlan (dpf_scan<G>, dpf_scan_bits<G> or dpf_scan_mma<T>), its
    dynamic shared-memory limit raised to at least the plan's."""
    file_name, kernel_name = plan.scan_kernel
    kernel = get_kernel(file_name, kernel_name)
    if plan.shared_bytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < plan.shared_bytes:
        kernel.max_dynamic_shared_size_bytes = plan.shared_bytes
    return kernel


def fill_reference(first_pair: int, num_pairs: int, seed: int) -> np.ndarray:
    """matrix_fill.cu's words for pairs [first_pair, first_pair + num_pairs), computed on the host."""
    with np.errstate(over="ignore"):
        i = np.arange(first_pair, first_pair + num_pairs, dtype=np.uint64)
        z = np.uint64(seed) ^ (i * np.uint64(0xD1342543DE82EF95))
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z.view(np.uint32)
