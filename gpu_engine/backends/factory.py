"""Backend selection: `auto` takes CUDA where CuPy and a GPU are present, else the CPU, and says why."""
from __future__ import annotations

from typing import Optional

from gpu_engine.backends.base import Backend, BackendUnavailable
from gpu_engine.backends.cpu import NumpyBackend
from gpu_engine.backends.cuda_plan import LAYOUT_CHOICES, V2_SCANS
from gpu_engine.choices import BACKEND_NAMES


def _cuda_backend(device: Optional[int], v2_scan: str, layout: str) -> Backend:
    try:
        from gpu_engine.backends.cuda import CudaBackend
    except ImportError as exc:  # its message already says that the CUDA backend needs CuPy
        raise BackendUnavailable(str(exc)) from exc
    return CudaBackend(device, v2_scan, layout)


def create_backend(name: str = "auto", device: Optional[int] = None, v2_scan: str = "auto",
                   layout: str = "auto") -> Backend:
    """The backend called `name` (on GPU `device`, else the current one); raises
    BackendUnavailable if `cuda` cannot run here. v2_scan: how CUDA scans v2 keys (auto, mma or
    alu; cuda_plan.use_tensor_cores); layout: how CUDA stores a matrix (cuda_plan.MATRIX_LAYOUTS,
    or auto: the one the GPU's fastest scans read, cuda_plan.auto_layout); the CPU backend has one
    scan and one layout. The backend `auto` falls back to CUDA's pages layout where the GPU cannot
    hold the one asked for, then to the CPU; `cuda` refuses."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}, expected one of {', '.join(BACKEND_NAMES)}")
    if v2_scan not in V2_SCANS:
        raise ValueError(f"unknown v2 scan {v2_scan!r}, expected one of {', '.join(V2_SCANS)}")
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"unknown matrix layout {layout!r}, expected one of {', '.join(LAYOUT_CHOICES)}")
    if name == "cpu":
        return NumpyBackend()
    if name == "cuda":
        return _cuda_backend(device, v2_scan, layout)
    try:
        return _cuda_backend(device, v2_scan, layout)
    except BackendUnavailable as exc:
        if layout == "fragments":  # a GPU that cannot hold this layout still beats the CPU in pages
            try:
                backend = _cuda_backend(device, v2_scan, "pages")
                backend.fallback_reason = str(exc)
                return backend
            except BackendUnavailable:
                pass
        backend = NumpyBackend()
        # Only the cause: `backend` already says cpu, and the caller logs the fallback once.
        backend.fallback_reason = str(exc)
        return backend
